"""What one op per layer buys: SpeCache's decode step on a CPU with each layer's attention as one
op (`specache::step_attention`, specache/kernels/step_cpu.cpp) against the same layers run op by op
(`SpeCacheLayer.step_in_parts`, what a slow tier outside RAM or a probe runs), eager and compiled.

    python scripts/bench/bench_step_op.py --checkpoint \
        checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth --out /tmp/step_op

Per mode and context: one random-token prompt prefilled once, then the two variants in turn, one
generation of `--steps` steps each, for `--rounds` rounds after a first round that warms up (and
compiles) both; a generation's time per step is its median, a variant's the median over rounds.
Alternating in one process keeps the box's changing load out of the ratio.

Writes {out}/step_op.md (the table under the command) and {out}/step_op.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import load_model, prepare_default_checkpoint  # noqa: E402
from scripts.bench.bench import prompt_of_length  # noqa: E402
from scripts.eval.harness import Runner  # noqa: E402
from specache import SpeCacheLayer  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

ONE_OP = SpeCacheLayer.step_in_ram


def op_by_op(layer: SpeCacheLayer, rows, k, v, discard):
    """The layer's step in RAM, op by op."""
    return layer.step_in_parts(rows, k, v, True, discard)


def step_ms(runner: Runner, method: str, prompt: list[int], prefilled, steps: int) -> float:
    times = []
    runner.decode(
        method,
        prompt,
        prefilled,
        steps + 1,
        callback=lambda tokens: times.append(time.perf_counter()),
    )
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 4096], help="context lengths (tokens)"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"]
    )
    parser.add_argument(
        "--method",
        default="specache-1bit",
        help="a SpeCache method as scripts/bench/bench.py names it",
    )
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per generation")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds timed, after one of warm-up"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write step_op.md and step_op.json here"
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    checkpoint = args.checkpoint or prepare_default_checkpoint()
    model = load_model(checkpoint, torch.device("cpu"), torch.float32)
    tokenizer = get_tokenizer(checkpoint.parent)
    rows, prefilled = [], {}
    # eager first: compiling (Runner(compile=True)) changes the model's decode for good
    for mode in sorted(set(args.modes), key=["eager", "compiled"].index):
        runner = Runner(
            model,
            tokenizer,
            [args.method],
            compile=mode == "compiled",
            round_capacity=False,
            whole_step=True,
        )
        for length in args.lengths:
            prompt = prompt_of_length(length, model.config.vocab_size)
            if length not in prefilled:  # the prompt's K and V do not depend on the mode
                prefilled[length] = runner.prefill(prompt, args.steps + 8)
            times = {"one op": [], "op by op": []}
            for round_ in range(args.rounds + 1):
                for name, step in (("one op", ONE_OP), ("op by op", op_by_op)):
                    SpeCacheLayer.step_in_ram = step
                    ms = step_ms(runner, args.method, prompt, prefilled[length], args.steps)
                    if round_:  # the first round warms up and compiles
                        times[name].append(ms)
            SpeCacheLayer.step_in_ram = ONE_OP
            one, parts = (statistics.median(times[name]) for name in ("one op", "op by op"))
            rows.append(dict(length=length, mode=mode, one_op=one, op_by_op=parts))
            print(f"  {length} {mode}: {one:.1f} against {parts:.1f} ms/step", file=sys.stderr)
    lines = [
        f"{checkpoint.parent.name}/{checkpoint.name}, {args.method}, batch 1, "
        f"{torch.get_num_threads()} CPU threads; ms per step, medians of {args.rounds} alternating "
        "rounds",
        "",
        "| context | mode | one op per layer | op by op | speed-up |",
        "|---|---|---|---|---|",
        *(
            f"| {r['length']} | {r['mode']} | {r['one_op']:.1f} | {r['op_by_op']:.1f} | "
            f"{r['op_by_op'] / r['one_op']:.2f}x |"
            for r in rows
        ),
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python scripts/bench/bench_step_op.py " + " ".join(sys.argv[1:])
        (args.out / "step_op.md").write_text(f"`{command}`\n\n" + "\n".join(lines) + "\n")
        (args.out / "step_op.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
