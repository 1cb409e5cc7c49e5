"""Static against continuous batching in one process: serving/serve.py's engine
(serving.batching.Engine) without HTTP, on the mixed load of `bench_serve.py --workload mixed`. It
runs where serving/serve.py's HTTP stack is not installed (a GPU machine: scripts/gpu_check.sh runs
it) and without the HTTP stack's share of the time.

    python scripts/bench/bench_batching.py                             # the embedded SmolLM2
    python scripts/bench/bench_batching.py --dtype bfloat16 --repeats 3 --out /tmp/batching
    python scripts/bench/bench_batching.py --device cuda --random_weights Meta-Llama-3-8B \\
        --dtype bfloat16

Per method and run, static batching and then continuous (`Engine(static=...)`): one engine (eager,
batches of 8, serving/serve.py's prompt chunks) takes --requests requests from 8 client threads,
each submitting its next request when the last is answered: every 4th has a --prompt_tokens prompt,
the rest --short_tokens (random token ids, each request its own), and each takes an answer of its
own length, drawn (seeded, the same for both batchings) between the two --answer_tokens bounds,
every token of it (no stop token: with random weights any token may be one). The time to first token
runs from a request's submission to its first token.

Reported as bench_serve.py's mixed load (`mixed_report`): the short and long requests' median time
to first token, generated tokens/s over the run's wall-clock, continuous over static for the same
method and run, and from the engine's `health()`, how full its batch ran: the sequences a decode
step advanced on average, and the share of its busy time spent in passes that held a prompt chunk
(a cost both batchings pay in full). "At a full batch" estimates what continuous batching could
reach on this machine and workload if every decode-only pass had carried 8 sequences: the run's
wall-clock less the busy seconds of passes without a prompt chunk times (1 - sequences per step /
8), at the same cost per pass (a pass costs more as it fills, so this leans high). Clients that wait
for each answer keep a joining sequence out of the decode steps, so no scheduler reaches it; where
it falls short of a target, that target is out of reach there. With --repeats N, a second table
gives the runs' median and range: how full a static batch runs depends on when requests happen to
arrive.
"""

import argparse
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from serving.batching import PREFILL_CHUNK, Engine  # noqa: E402
from caches.by_name import make_cache  # noqa: E402
from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from scripts.bench.bench import random_model  # noqa: E402
from scripts.eval.harness import write_report  # noqa: E402

MIXED_BATCH = 8  # the clients, and the engine's max_batch_size


class Request:
    """A job as the engine sees it (serving.serve.Job's fields) that takes `max_tokens` tokens,
    whatever they are, and records when its first came."""

    def __init__(self, prompt: list[int], max_tokens: int):
        self.prompt_ids, self.max_tokens, self.keep = prompt, max_tokens, False
        self.sampling = (0.0, None, None)  # greedy
        self.finished, self.error, self.tokens = False, None, 0
        self.first_token_at: Optional[float] = None
        self.done = threading.Event()
        self.stats_source = dict

    def feed(self, token: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens += 1
        if self.tokens >= self.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.finished = True
        self.done.set()

    def fail(self, message: str) -> None:
        self.finished, self.error = True, message
        self.done.set()


def mixed_request(
    i: int, long_tokens: int, short_tokens: int, answer_tokens: list[int]
) -> tuple[bool, int, int]:
    """Request i of the mixed load: (long, its prompt's tokens, its answer's tokens). Every 4th has
    a long prompt; each answer's length is drawn between the two `answer_tokens` bounds, seeded by
    i, so that both batchings (and bench_serve.py's servers) take the same requests."""
    long = i % 4 == 0
    return long, long_tokens if long else short_tokens, random.Random(i).randint(*answer_tokens)


def health_figures(health: dict) -> dict:
    """How full a run's batch ran, from its engine's health (/health): what `mixed_report` reads."""
    return dict(
        sequences_per_step=health["sequences_per_step_mean"],
        prompt_pass_share=health["prompt_pass_s"] / health["busy_s"],
        decode_only_s=health["busy_s"] - health["prompt_pass_s"],
    )


def mixed_report(rows: list[dict], header: str, methods: list[str], repeats: int) -> str:
    """The mixed load's tables from its runs (a row per method, run and batching: wall_s,
    tokens_per_s, the short and long requests' median TTFT, `health_figures`); adds each row's
    ratios over the static run of the same method and run, and a continuous row's ratio at a full
    batch."""
    static = {(r["method"], r["run"]): r for r in rows if r["batching"] == "static"}
    for r in rows:
        base = static[r["method"], r["run"]]
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["short_ttft_ratio"] = r["short_ttft_median_s"] / base["short_ttft_median_s"]
        if r["batching"] == "continuous":
            emptier = r["decode_only_s"] * (1 - r["sequences_per_step"] / MIXED_BATCH)
            r["full_batch_ratio"] = r["tokens_per_s_ratio"] * r["wall_s"] / (r["wall_s"] - emptier)
    lines = [
        header,
        "",
        "| method | run | batching | wall s | tok/s | short TTFT median s | long TTFT median s | "
        "tok/s ratio | short TTFT ratio | sequences per step | time in prompt passes | "
        "tok/s ratio at a full batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full_batch = "" if r["batching"] == "static" else f"{r['full_batch_ratio']:.2f}x"
        lines.append(
            f"| {r['method']} | {r['run']} | {r['batching']} | {r['wall_s']:.1f} | "
            f"{r['tokens_per_s']:.1f} | {r['short_ttft_median_s']:.2f} | "
            f"{r['long_ttft_median_s']:.2f} | {r['tokens_per_s_ratio']:.2f}x | "
            f"{r['short_ttft_ratio']:.2f}x | {r['sequences_per_step']:.1f} | "
            f"{r['prompt_pass_share']:.0%} | {full_batch} |"
        )
    if repeats > 1:
        lines += [
            "",
            "Continuous over static, over the runs (the static batch's fill varies from run to run "
            "with when requests arrive):",
            "",
            "| method | tok/s ratio, median | lowest | highest | short TTFT ratio, median | "
            "at a full batch, median |",
            "|---|---|---|---|---|---|",
        ]
        for method in methods:
            ours = [r for r in rows if r["method"] == method and r["batching"] == "continuous"]
            speed = [r["tokens_per_s_ratio"] for r in ours]
            ttft = statistics.median(r["short_ttft_ratio"] for r in ours)
            full_batch = statistics.median(r["full_batch_ratio"] for r in ours)
            lines.append(
                f"| {method} | {statistics.median(speed):.2f}x | {min(speed):.2f}x | "
                f"{max(speed):.2f}x | {ttft:.2f}x | {full_batch:.2f}x |"
            )
    return "\n".join(lines)


def one_run(args, model, method: str, batching: str, context: int) -> dict:
    """The mixed load's requests through one engine; its row of the table."""
    engine = Engine(
        model,
        lambda n: make_cache(method, model, n, context),
        context,
        max_batch_size=MIXED_BATCH,
        prefill_chunk=PREFILL_CHUNK,
        static=batching == "static",
    )
    vocab = model.config.vocab_size

    def ask(i: int) -> dict:
        long, size, answer = mixed_request(
            i, args.prompt_tokens, args.short_tokens, args.answer_tokens
        )
        generator = torch.Generator().manual_seed(5000 + i)
        prompt = torch.randint(100, vocab - 100, (size,), generator=generator).tolist()
        request = Request(prompt, answer)
        submitted = time.perf_counter()
        engine.submit(request)
        request.done.wait()
        if request.error:
            raise SystemExit(f"{method}, {batching}: {request.error}")
        return dict(long=long, ttft=request.first_token_at - submitted, tokens=request.tokens)

    engine.start()
    try:
        ask(1)  # warm-up
        started = time.perf_counter()
        with ThreadPoolExecutor(MIXED_BATCH) as pool:
            done = list(pool.map(ask, range(args.requests)))
        wall = time.perf_counter() - started
        health = engine.health()
    finally:
        engine.close()
    return dict(
        method=method,
        batching=batching,
        requests=len(done),
        wall_s=wall,
        tokens_per_s=sum(d["tokens"] for d in done) / wall,
        short_ttft_median_s=statistics.median(d["ttft"] for d in done if not d["long"]),
        long_ttft_median_s=statistics.median(d["ttft"] for d in done if d["long"]),
        **health_figures(health),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument(
        "--random_weights",
        default=None,
        metavar="NAME",
        help="a model of this shape (a name in config.py) with random weights, no checkpoint",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--methods", nargs="+", default=["full", "specache-1bit"])
    parser.add_argument("--prompt_tokens", type=int, default=2048, help="the long prompts'")
    parser.add_argument("--short_tokens", type=int, default=64, help="the short prompts'")
    parser.add_argument("--requests", type=int, default=32, help="requests in all (default 32)")
    parser.add_argument(
        "--answer_tokens",
        type=int,
        nargs=2,
        default=[16, 128],
        metavar=("MIN", "MAX"),
        help="each request's answer length, drawn between these (default 16 128)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of static and continuous batching, in turn"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write batching.md and .json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.random_weights:
        model, name = random_model(args.random_weights, device, dtype), args.random_weights
        name += " shape, random weights"
    else:
        checkpoint = resolve_checkpoint(args.checkpoint)
        model, name = load_model(checkpoint, device, dtype), checkpoint.parent.name
    context = -(-(args.prompt_tokens + args.answer_tokens[1] + 64) // 64) * 64
    rows = []
    for method in args.methods:
        for run in range(1, args.repeats + 1):
            for batching in ("static", "continuous"):
                rows.append(dict(run=run, **one_run(args, model, method, batching, context)))
                print(f"{rows[-1]}", file=sys.stderr, flush=True)
    header = (
        f"{name}, in one process (batching.Engine, no HTTP), {args.requests} requests from "
        f"{MIXED_BATCH} client threads, every 4th with a {args.prompt_tokens}-token prompt and the "
        f"rest {args.short_tokens}, answers of {args.answer_tokens[0]}-{args.answer_tokens[1]} "
        f"tokens, greedy, batches of {MIXED_BATCH}, eager, {args.dtype}, {device.type}, prompt "
        f"chunks of {PREFILL_CHUNK}, {torch.get_num_threads()} threads; ratios: continuous over "
        "static for the same method, in the same run"
    )
    markdown = mixed_report(rows, header, args.methods, args.repeats)
    print(markdown)
    if args.out:
        write_report(args.out, "batching", markdown, dict(rows=rows))


if __name__ == "__main__":
    main()
