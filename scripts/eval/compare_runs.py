"""Two runs of the same prompts, side by side: how many replies are identical, per method, and
each score in both (the fidelity guard of a change that is not a method of its own: a dtype, a
build, a kernel).

    python scripts/eval/compare_runs.py docs/results/x/needle_float32/needle.json \
        docs/results/x/needle_auto/needle.json --names float32 auto --out docs/results/x/needle

Takes two reports of scripts/eval/needle.py or scripts/eval/ruler.py (their .json) over the same
prompts (the same lengths, depths, tasks, samples and seed). For each method both ran, per cell
(needle: length and depth; RULER: length and task), prints the identical replies, and each run's
score (needle: the cells the needle was found in; RULER: string_match_all %, as ruler.py scores
it). The guard the issue sets: at least 95% identical replies, and every RULER task's score
within one answer (100 / samples points) in the two runs; the last lines say whether each holds.
"""

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.eval.harness import write_report  # noqa: E402

# one reply: (method, cell) -> [(prompt key, reply text, score)]
Replies = dict[tuple[str, str], list[tuple[tuple, str, float]]]


def replies(report: dict) -> tuple[Replies, float]:
    """Every reply of a needle or RULER report by method and cell; and what one answer is worth
    in a cell's score (RULER: 100 / samples per task; needle: one found cell)."""
    found: Replies = defaultdict(list)
    if "rows" in report:  # needle.py
        for row in report["rows"]:
            cell = f"{row['length']} tokens"
            key = (row["length"], row["depth"])
            found[row["method"], cell].append((key, row["reply"], float(row["found"])))
        return found, 1.0
    for sample in report["samples"]:  # ruler.py
        cell = f"{sample['length']} {sample['task']}"
        outputs = sample["outputs"]
        for method, output in outputs.items():
            key = (sample["length"], sample["task"], sample["index"])
            found[method, cell].append((key, output["text"], output["score"]))
    return found, 100.0 / report["samples_per_task"]


def in_length_order(method_and_cell: tuple[str, str]) -> tuple:
    """Sort key: by method, then by the cell's length in tokens (its first word), then by name."""
    method, cell = method_and_cell
    return method, int(cell.split()[0]), cell


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("reports", type=Path, nargs=2, help="the two runs' .json reports")
    parser.add_argument("--names", nargs=2, default=["first", "second"], help="their labels")
    parser.add_argument("--out", type=Path, default=None, help="also write compare.md/.json here")
    args = parser.parse_args()
    (first, one), (second, _) = (replies(json.loads(p.read_text())) for p in args.reports)
    a, b = args.names
    ruler = "samples" in json.loads(args.reports[0].read_text())
    score = "score %" if ruler else "found"
    lines = [
        f"`{args.reports[0]}` ({a}) against `{args.reports[1]}` ({b}): the same prompts",
        "",
        f"| method | cell | replies | identical | {a} {score} | {b} {score} |",
        "|---|---|---|---|---|---|",
    ]
    rows, total, same, worst = [], 0, 0, 0.0
    for method, cell in sorted(set(first) & set(second), key=in_length_order):
        here = {key: (text, points) for key, text, points in first[method, cell]}
        there = {key: (text, points) for key, text, points in second[method, cell]}
        keys = sorted(set(here) & set(there))
        if not keys:
            continue
        identical = sum(here[k][0] == there[k][0] for k in keys)
        mean = [sum(run[k][1] for k in keys) / (len(keys) if ruler else 1) for run in (here, there)]
        total, same = total + len(keys), same + identical
        if ruler:
            worst = max(worst, abs(mean[0] - mean[1]) / one)
        rows.append(
            dict(method=method, cell=cell, replies=len(keys), identical=identical, score=mean)
        )
        lines.append(
            f"| {method} | {cell} | {len(keys)} | {identical} | {mean[0]:g} | {mean[1]:g} |"
        )
    if not total:
        raise SystemExit("the two reports share no prompt of a method both ran")
    lines += [
        "",
        f"Identical replies: {same} of {total} ({100 * same / total:.0f}%; the guard: at least "
        "95%).",
    ]
    if ruler:
        lines.append(
            f"Largest change of a task's score: {worst:g} answers (the guard: at most one)."
        )
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        raw = dict(rows=rows, identical=same, replies=total, largest_change_answers=worst)
        write_report(args.out, "compare", markdown, raw)


if __name__ == "__main__":
    main()
