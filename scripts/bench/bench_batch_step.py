"""What a decode step of several sequences costs against a step of one: serving/serve.py's engine
(where the sequences share one cache, a row each: the full cache's, and SpeCache's in a CPU's RAM)
against one cache set up for the whole batch by generate.

    python scripts/bench/bench_batch_step.py                          # 2k context, 1, 2, 4, 8
    python scripts/bench/bench_batch_step.py --context 1024 --batch 1 8 --methods full \
        --out /tmp/step

Per method and batch size B: B prompts of --context tokens (random ids, greedy) go to an engine
(serving.batching.Engine, eager, --dtype, batches of B, prompt chunks of 256), and once all B
decode, the median time between --steps of its decode passes (a job's tokens) is reported; then the
same B prompts decode in one cache of batch B (generation.generate), the median time between its
steps. Ratios: over the engine's step of one sequence. This curve bounds what continuous batching
can gain over static batching on a machine: what a step costs per sequence as the batch fills.
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from serving.batching import Engine  # noqa: E402
from caches.by_name import make_cache  # noqa: E402
from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from generation import GenerateOptions, generate  # noqa: E402
from scripts.eval.harness import write_report  # noqa: E402

CHUNK = 256


class Endless:
    """A job (serving.serve.Job's fields) that takes tokens until told to stop."""

    def __init__(self, prompt: list[int]):
        self.prompt_ids, self.max_tokens, self.keep = prompt, 1 << 30, False
        self.sampling = (0.0, None, None)  # greedy
        self.finished, self.error = False, None
        self.fed: list[float] = []  # when each token came: one per pass of the engine
        self.started = threading.Event()
        self.stats_source = dict

    def feed(self, token: int) -> None:
        self.fed.append(time.perf_counter())
        self.started.set()

    def finish(self, reason: str) -> None:
        self.finished = True

    def fail(self, message: str) -> None:
        self.finished, self.error = True, message
        self.started.set()


def engine_step_seconds(model, method: str, prompts: list[list[int]], capacity: int, steps: int):
    """The median seconds of an engine's decode pass once every prompt decodes (between the first
    job's tokens, as `one_cache_step_seconds` times generate's steps)."""
    engine = Engine(
        model,
        lambda n: make_cache(method, model, n, capacity),
        capacity,
        max_batch_size=len(prompts),
        prefill_chunk=CHUNK,
    )
    jobs = [Endless(prompt) for prompt in prompts]
    for job in jobs:
        engine.submit(job)
    engine.start()
    try:
        for job in jobs:
            job.started.wait()
            if job.error:
                raise SystemExit(f"{method}: {job.error}")
        first = len(jobs[0].fed)  # every prompt is in: the passes from here on are decode steps
        while len(jobs[0].fed) < first + steps + 1:
            time.sleep(0.05)
    finally:
        for job in jobs:
            job.finished = True
        engine.close()
    fed = jobs[0].fed[first:]
    return statistics.median(b - a for a, b in zip(fed, fed[1:]))


def one_cache_step_seconds(model, method: str, prompts: list[list[int]], capacity: int, steps: int):
    """The median seconds of a decode step of one cache set up for the whole batch (between the
    steps' callbacks)."""
    cache = make_cache(method, model, len(prompts), capacity)
    times = []
    options = GenerateOptions(prefill_chunk=CHUNK)
    record = lambda tokens: times.append(time.perf_counter())  # noqa: E731
    generate(model, cache, prompts, 2 + steps, callback=record, options=options)
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument("--methods", nargs="+", default=["full", "specache-1bit"])
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per row")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--out", type=Path, default=None, help="also write step.md and .json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model = load_model(checkpoint, "cpu", getattr(torch, args.dtype))
    # the first sequences decode while the others' prompts go in, a chunk per pass
    capacity = args.context + max(args.batch) * args.context // CHUNK + 2 * args.steps + 64
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(100, vocab - 100, (args.context,), generator=generator).tolist()
        for _ in range(max(args.batch))
    ]
    rows = []
    for method in args.methods:
        for batch in args.batch:
            engine = engine_step_seconds(model, method, prompts[:batch], capacity, args.steps)
            one = one_cache_step_seconds(model, method, prompts[:batch], capacity, args.steps)
            rows.append(dict(method=method, batch=batch, engine_s=engine, one_cache_s=one))
            print(f"{rows[-1]}", file=sys.stderr, flush=True)
    lines = [
        f"{checkpoint.parent.name}, {args.context}-token prompts, {args.dtype}, eager, "
        f"{torch.get_num_threads()} threads, {args.steps} steps per row; ratios over the engine's "
        "step of one sequence",
        "",
        "| method | sequences | engine ms/step | ratio | one cache ms/step | ratio | "
        "engine ms per sequence |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(b for b in rows if b["method"] == r["method"] and b["batch"] == 1)["engine_s"]
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['engine_s'] * 1e3:.1f} | "
            f"{r['engine_s'] / base:.2f}x | {r['one_cache_s'] * 1e3:.1f} | "
            f"{r['one_cache_s'] / base:.2f}x | {r['engine_s'] / r['batch'] * 1e3:.1f} |"
        )
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write_report(args.out, "step", markdown, dict(rows=rows))


if __name__ == "__main__":
    main()
