"""Long generations: does a cache drift over a thousand tokens, and does memory stay flat?

    python scripts/eval/long_run.py drift             # 2k-token essay prompt, 1000 new tokens, \
        SpeCache 1-bit
    python scripts/eval/long_run.py drift --methods specache-1bit specache-2bit kivi-1bit \
        --new_tokens 400
    python scripts/eval/long_run.py memory            # 10 generations in one process

drift: the prompt is 2k tokens of Paul Graham essays (plain text, no chat template), continued
greedily for --new_tokens tokens with no stop token, by the full cache and by each method (one
shared prefill, scripts/eval/harness.py). A free-running comparison says little after the first
token where two caches differ, since their texts then part ways; so each method's own text is also
run through the full-precision model in one pass, and per window of --window tokens the table gives
how often the method's token is the one the full cache would have chosen after the same history
(teacher-forced agreement). A cache that drifts shows it as agreement that decays window after
window. The full cache's own row is the floor that numerics set (cached decode against one long
prefill). Also per window: distinct 4-grams of each text (a generation stuck in a loop falls toward
0) and the position where each method first leaves the full cache's text.

memory: --runs generations of --new_tokens tokens in one process, each setting up its cache anew
as the scripts do; after each: resident memory (VmRSS) and the cache's fast-tier bytes. Growth
beyond the first runs (allocator warm-up) would be a leak.

Writes {out}/long_run_drift.{md,json} or {out}/long_run_memory.{md,json}.
"""

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from model import CAUSAL_PROMPT, Transformer  # noqa: E402

# noqa: E402
from scripts.eval.harness import (
    RESULTS_DIR,
    Runner,
    method_argument,
    runner_from_args,
    write_report,
)
from scripts.eval.haystack import haystack_tokens  # noqa: E402


def full_cache_choices(model: Transformer, prompt: list[int], generated: list[int]) -> list[int]:
    """The full-precision model's greedy choice at each generated position, given the text before
    it."""
    tokens = torch.tensor([prompt + generated], device=model.tok_embeddings.weight.device)
    model.setup_caches(1, tokens.shape[1])
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    wanted = torch.arange(len(prompt) - 1, tokens.shape[1] - 1, device=tokens.device).unsqueeze(0)
    with torch.compiler.set_stance("force_eager"):
        logits = model(tokens, positions, CAUSAL_PROMPT, output_index=wanted)
    return logits[0].argmax(-1).tolist()


def windows(values: list, size: int) -> list[list]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def distinct_ngrams(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams over all n-grams of the tokens (1.0: no n-gram repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where a and b differ (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def drift_report(
    model: Transformer, prompt: list[int], outputs: dict[str, list[int]], window: int
) -> tuple[str, dict]:
    """The drift table for `outputs` (method -> its generated tokens; "full" among them)."""
    rows = {}
    for method, generated in outputs.items():
        choices = full_cache_choices(model, prompt, generated)
        agree = [int(c == t) for c, t in zip(choices, generated)]
        rows[method] = dict(
            agreement=[sum(w) / len(w) for w in windows(agree, window)],
            distinct=[distinct_ngrams(w) for w in windows(generated, window)],
            leaves_full_at=first_difference(generated, outputs["full"]),
        )
    methods = list(outputs)
    lines = [
        f"Teacher-forced agreement with the full cache's choice, and distinct 4-grams, per window "
        "of "
        f"{window} new tokens ({len(prompt)}-token prompt).",
        "",
        "| window | " + " | ".join(f"{m} agreement | {m} distinct 4-grams" for m in methods) + " |",
        "|---" * (1 + 2 * len(methods)) + "|",
    ]
    for i in range(len(rows["full"]["agreement"])):
        cells = [f"{rows[m]['agreement'][i]:.2f} | {rows[m]['distinct'][i]:.2f}" for m in methods]
        lines.append(f"| {i * window}-{(i + 1) * window} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "First new token where each method's text leaves the full cache's: "
        + ", ".join(f"{m} {rows[m]['leaves_full_at']}" for m in methods if m != "full")
        + ".",
    ]
    return "\n".join(lines), rows


def drift(runner: Runner, prompt: list[int], new_tokens: int, window: int) -> tuple[str, dict]:
    runner.stop_ids = frozenset()  # a thousand tokens whatever the model would stop at
    prefilled = runner.prefill(prompt, new_tokens)
    outputs = {m: runner.decode(m, prompt, prefilled, new_tokens).tokens[0] for m in runner.methods}
    markdown, rows = drift_report(runner.model, prompt, outputs, window)
    tail = {m: runner.tokenizer.decode(tokens[-window:]) for m, tokens in outputs.items()}
    markdown += "\n\nThe last window of each text:\n\n" + "\n\n".join(
        f"- **{m}**: {' '.join(text.split())}" for m, text in tail.items()
    )
    return markdown, dict(rows=rows, tokens=outputs)


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; elsewhere the peak, from getrusage)."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory(runner: Runner, prompt: list[int], new_tokens: int, runs: int) -> tuple[str, dict]:
    runner.stop_ids = frozenset()
    rows = []
    for run in range(runs):
        prefilled = runner.prefill(prompt, new_tokens)
        for method in runner.methods:
            result = runner.decode(method, prompt, prefilled, new_tokens)
            gc.collect()
            rows.append(
                dict(
                    run=run + 1,
                    method=method,
                    rss=resident_bytes(),
                    fast=result.stats.get("fast_tier_bytes"),
                    tokens=len(result.tokens[0]),
                )
            )
        del prefilled
        gc.collect()
    lines = [
        f"{runs} generations of {new_tokens} tokens from a {len(prompt)}-token prompt, "
        "one process.",
        "",
        "| run | method | resident MB | fast-tier KV MB |",
        "|---|---|---|---|",
    ]
    for r in rows:
        fast = "-" if r["fast"] is None else f"{r['fast'] / 1e6:.2f}"
        lines.append(f"| {r['run']} | {r['method']} | {r['rss'] / 1e6:.0f} | {fast} |")
    return "\n".join(lines), dict(rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("check", choices=["drift", "memory"])
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="model.pth (default: the embedded SmolLM2)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["specache-1bit"],
        type=method_argument,
        metavar="METHOD",
        help="compared with the full cache (default: specache-1bit)",
    )
    parser.add_argument("--prompt_tokens", type=int, default=2048)
    parser.add_argument(
        "--new_tokens", type=int, default=None, help="default: 1000 (drift), 200 (memory)"
    )
    parser.add_argument("--window", type=int, default=100, help="drift: tokens per window")
    parser.add_argument("--runs", type=int, default=10, help="memory: generations in the process")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--compile", action="store_true", help="compile the decode steps")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="where the report goes (default docs/results)"
    )
    args = parser.parse_args()
    too_few_new = args.new_tokens is not None and args.new_tokens < 2
    if args.prompt_tokens < 1 or args.window < 1 or args.runs < 1 or too_few_new:
        parser.error(
            "--prompt_tokens, --window and --runs must be positive, --new_tokens at least 2"
        )
    args.methods = ["full"] + args.methods
    args.budget_bits, args.stats, args.prompt_format = 1, False, "auto"
    runner = runner_from_args(args)
    prompt = haystack_tokens(runner.tokenizer, args.prompt_tokens)
    if args.check == "drift":
        markdown, raw = drift(runner, prompt, args.new_tokens or 1000, args.window)
    else:
        markdown, raw = memory(runner, prompt, args.new_tokens or 200, args.runs)
    print(markdown)
    write_report(args.out, f"long_run_{args.check}", markdown, raw)


if __name__ == "__main__":
    main()
