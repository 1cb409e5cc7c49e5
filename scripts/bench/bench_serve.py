"""Load on serving/serve.py: requests/s and tokens/s at several concurrencies, full cache against
SpeCache.

    python scripts/bench/bench_serve.py                             # 2k-token prompts, \
        concurrency 1, 4, 8
    python scripts/bench/bench_serve.py --prompt_tokens 512 --concurrency 1 2 --requests 2 --out \
        /tmp/serve

Per method, one server (`python -m serving.serve`, in a subprocess on 127.0.0.1, eager, in --dtype,
--max_batch_size the highest concurrency, --max_seq_length the prompt plus the answer) and, per
concurrency C, C clients (threads with the official `openai` client) that each send --requests
completions one after the other: a prompt of --prompt_tokens tokens (its own text per request, so
that nothing is shared), at most --max_tokens new tokens, greedy (the prompts are prose the model
continues; an answer that stops early counts the tokens it has). One warm-up request goes first.
Reported: requests/s and generated tokens/s over the wall-clock of all of a concurrency's requests,
the median latency of a request, and the server's peak resident memory (VmHWM, after all
concurrencies), with the server's default (continuous) batching.

    python scripts/bench/bench_serve.py --workload mixed   # static against continuous batching
    python scripts/bench/bench_serve.py --workload turns   # a second chat turn, kept or prefilled
                                                           # again

`mixed`: per method, one server with `--batching static` and one with `continuous` (batches of 8)
take the same --mixed_requests streamed completions from 8 clients, each sending its next request
when the last is answered: every 4th has a --prompt_tokens prompt, the rest --short_tokens, and each
asks for an answer of its own length, drawn (seeded, the same in both runs) between the two
--answer_tokens bounds: answers of one length would keep a static batch full and in step, which
real requests do not.
Reported: the short requests' median time to first token (the first text chunk), the long ones',
and generated tokens/s over the run's wall-clock; continuous over static in the ratio columns; and
from the server's /health, how full its batch ran: the sequences a decode step advanced on average,
and the share of the worker's busy time spent in passes that held a prompt chunk (a cost both
batchings pay in full), and 'at a full batch', an estimate of what continuous batching could reach
there (scripts/bench/bench_batching.py says how; it runs the same load in one process, without
HTTP). With --repeats N, the pair runs N times in turn, each continuous run's ratios are over the
static run just before it, and a second table gives their median and range: how full a static batch
runs depends on when requests happen to arrive, so one pair's ratio varies from run to run.

    python scripts/bench/bench_serve.py --workload mixed --dtype bfloat16 --repeats 3

`turns`: per method, a chat's first turn (a --prompt_tokens message, 16 tokens of reply) and then
its second turn (the reply and a short question), streamed, on a server that keeps conversations
and on one that keeps none (`--keep_conversations_gb 0`, so the second turn prefills it all): the
second turn's time to first token, and the prompt tokens the server reused.
"""

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from caches.by_name import parse_method  # noqa: E402
from scripts.bench.bench_batching import (  # noqa: E402
    MIXED_BATCH,
    health_figures,
    mixed_report,
    mixed_request,
)
from checkpoint import resolve_checkpoint  # noqa: E402
from scripts.eval.harness import write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
SENTENCES = (
    "The river runs past the old mill and under the stone bridge. ",
    "Children play by the water in summer. ",
    "In winter the ice is thick enough to walk on. ",
    "Farmers bring their grain to the mill each autumn. ",
)


def server_flags(method: str) -> list[str]:
    kind, bits, select = parse_method(method)
    flags = ["--cache", kind]
    if kind == "full" and bits == 16:
        flags = ["--cache", "full", "--full_16bit"]
    elif bits:
        flags += ["--specache_bits", str(bits)]
    return flags + (["--specache_select", select] if select else [])


def prompt_text(tokenizer, tokens: int, seed: int) -> str:
    text = f"Story {seed}. " + "".join(
        SENTENCES[(seed + i) % len(SENTENCES)] for i in range(tokens // 8)
    )
    return tokenizer.decode(tokenizer.encode(text, bos=False)[:tokens])


def start_server(flags: list[str], port: int, log: Path, timeout: float = 300) -> subprocess.Popen:
    """serving/serve.py with `flags` on 127.0.0.1:`port` (its stderr into `log`), once /health
    answers."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "serving.serve",
            "--port",
            str(port),
            "--log_level",
            "warning",
            *flags,
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serving/serve.py exited:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"serving/serve.py did not start:\n{log.read_text()}")


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def serve(args, checkpoint: Path, context: int, flags: list[str], log: Path):
    """A server on `checkpoint` in --dtype with `flags`, and an `openai` client for it."""
    port = args.port
    common = ["--checkpoint", str(checkpoint), "--max_seq_length", str(context)]
    process = start_server([*common, "--dtype", args.dtype, *flags], port, log)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1800, max_retries=0
    )
    return process, client


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=60)


def load(args, checkpoint: Path, tokenizer, context: int, log: Path) -> tuple[str, dict]:
    """Requests/s and tokens/s at each concurrency."""
    rows = []
    for method in args.methods:
        flags = ["--max_batch_size", str(max(args.concurrency)), *server_flags(method)]
        process, client = serve(args, checkpoint, context, flags, log)
        model = client.models.list().data[0].id
        try:

            def ask(seed: int) -> tuple[float, int]:
                started = time.perf_counter()
                prompt = prompt_text(tokenizer, args.prompt_tokens, seed)
                response = client.completions.create(
                    model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0
                )
                return time.perf_counter() - started, response.usage.completion_tokens

            ask(-1)  # warm-up
            for c in args.concurrency:

                def client_run(i: int) -> list[tuple[float, int]]:
                    return [ask(1000 * c + args.requests * i + r) for r in range(args.requests)]

                started = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    done = [x for each in pool.map(client_run, range(c)) for x in each]
                wall = time.perf_counter() - started
                rows.append(
                    dict(
                        method=method,
                        concurrency=c,
                        requests=len(done),
                        wall_s=wall,
                        requests_per_s=len(done) / wall,
                        tokens_per_s=sum(n for _, n in done) / wall,
                        median_latency_s=statistics.median(t for t, _ in done),
                    )
                )
                print(
                    f"{method} x{c}: {rows[-1]['requests_per_s']:.2f} req/s, "
                    f"{rows[-1]['tokens_per_s']:.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
            peak = peak_rss_bytes(process.pid)
            for row in rows:
                row.setdefault("peak_rss_gb", peak / 1e9)
        finally:
            stop(process)
    full = {r["concurrency"]: r for r in rows if r["method"] == args.methods[0]}
    lines = [
        f"{checkpoint.parent.name}, {args.prompt_tokens}-token prompts, {args.max_tokens} new "
        f"tokens, greedy, {args.requests} requests per client, eager, {args.dtype}, "
        f"context {context}; ratios over {args.methods[0]} at the same concurrency",
        "",
        "| method | concurrency | requests | req/s | tok/s | median latency s | peak RSS GB | "
        "tok/s ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.2f} | "
        f"{r['tokens_per_s']:.1f} | {r['median_latency_s']:.1f} | {r['peak_rss_gb']:.2f} | "
        f"{r['tokens_per_s'] / full[r['concurrency']]['tokens_per_s']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines), dict(rows=rows)


def timed_stream(create, **request) -> tuple[Optional[float], int, int]:
    """A streamed, greedy request (`create`: the client's completions.create or
    chat.completions.create): the time to its first text chunk, its completion tokens and the
    prompt tokens the server reused."""
    started = time.perf_counter()
    stream = create(temperature=0, stream=True, stream_options={"include_usage": True}, **request)
    first, tokens, reused = None, 0, 0
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        text = (
            None
            if choice is None
            else getattr(choice, "text", None)
            or (choice.delta.content if getattr(choice, "delta", None) else None)
        )
        if text and first is None:
            first = time.perf_counter() - started
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            reused = (details.cached_tokens or 0) if details else 0
    return first, tokens, reused


def mixed(args, checkpoint: Path, tokenizer, context: int, log: Path) -> tuple[str, dict]:
    """Static against continuous batching on one workload of short and long prompts, --repeats
    times in turn (static, continuous, static, ...)."""
    rows = []
    for method, run, batching in itertools.product(
        args.methods, range(1, args.repeats + 1), ("static", "continuous")
    ):
        flags = [*server_flags(method), "--batching", batching]
        flags += ["--max_batch_size", str(MIXED_BATCH)]
        if args.prefill_chunk:
            flags += ["--prefill_chunk", str(args.prefill_chunk)]
        process, client = serve(args, checkpoint, context, flags, log)
        model = client.models.list().data[0].id

        def ask(i: int) -> dict:
            long, size, answer = mixed_request(
                i, args.prompt_tokens, args.short_tokens, args.answer_tokens
            )
            ttft, tokens, _ = timed_stream(
                client.completions.create,
                model=model,
                prompt=prompt_text(tokenizer, size, 5000 + i),
                max_tokens=answer,
            )
            return dict(long=long, ttft=ttft, tokens=tokens)

        try:
            ask(1)  # warm-up
            started = time.perf_counter()
            with ThreadPoolExecutor(MIXED_BATCH) as pool:
                done = list(pool.map(ask, range(args.mixed_requests)))
            wall = time.perf_counter() - started
            health = httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=10).json()
        finally:
            stop(process)
        short = [d["ttft"] for d in done if not d["long"] and d["ttft"] is not None]
        long = [d["ttft"] for d in done if d["long"] and d["ttft"] is not None]
        rows.append(
            dict(
                method=method,
                run=run,
                batching=batching,
                requests=len(done),
                wall_s=wall,
                tokens_per_s=sum(d["tokens"] for d in done) / wall,
                short_ttft_median_s=statistics.median(short),
                long_ttft_median_s=statistics.median(long),
                **health_figures(health),
            )
        )
        print(f"{method} {batching}: {rows[-1]}", file=sys.stderr, flush=True)
    chunks = "serve.py's prefill chunks"
    if args.prefill_chunk:
        chunks = f"prefill chunks of {args.prefill_chunk}"
    header = (
        f"{checkpoint.parent.name}, {args.mixed_requests} streamed completions from "
        f"{MIXED_BATCH} clients, every 4th with a {args.prompt_tokens}-token prompt and the rest "
        f"{args.short_tokens}, answers of {args.answer_tokens[0]}-{args.answer_tokens[1]} tokens, "
        f"greedy, batches of {MIXED_BATCH}, eager, {args.dtype}, context {context}, {chunks}; "
        "ratios: continuous over static for the same method, in the same run"
    )
    return mixed_report(rows, header, args.methods, args.repeats), dict(rows=rows)


def turns(args, checkpoint: Path, tokenizer, context: int, log: Path) -> tuple[str, dict]:
    """A second chat turn's time to first token, with its conversation kept and without."""
    rows = []
    first = [
        {
            "role": "user",
            "content": prompt_text(tokenizer, args.prompt_tokens, 7) + "\nWhat is this about?",
        }
    ]
    for method in args.methods:
        for keep in ("1", "0"):
            flags = ["--keep_conversations_gb", keep, *server_flags(method)]
            process, client = serve(args, checkpoint, context, flags, log)
            model = client.models.list().data[0].id
            try:
                reply = client.chat.completions.create(
                    model=model, messages=first, max_tokens=16, temperature=0
                )
                second = first + [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "Say it in five words."},
                ]
                ttft, _, reused = timed_stream(
                    client.chat.completions.create,
                    model=model,
                    messages=second,
                    max_tokens=args.max_tokens,
                )
            finally:
                stop(process)
            rows.append(dict(method=method, kept=keep == "1", ttft_s=ttft, reused_tokens=reused))
            print(f"{method} kept={keep}: {rows[-1]}", file=sys.stderr, flush=True)
    fresh = {r["method"]: r for r in rows if not r["kept"]}
    lines = [
        f"{checkpoint.parent.name}, a chat's second turn after a {args.prompt_tokens}-token first "
        f"message and a 16-token reply, streamed, greedy, eager, {args.dtype}, "
        f"context {context}; ratio: over the same turn prefilled whole",
        "",
        "| method | conversation | second turn's TTFT s | prompt tokens reused | TTFT ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {'kept' if r['kept'] else 'prefilled again'} | "
            f"{r['ttft_s']:.2f} | {r['reused_tokens']} | "
            f"{r['ttft_s'] / fresh[r['method']]['ttft_s']:.2f}x |"
        )
    return "\n".join(lines), dict(rows=rows)


WORKLOADS = {"load": load, "mixed": mixed, "turns": turns}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument("--workload", choices=list(WORKLOADS), default="load")
    parser.add_argument("--methods", nargs="+", default=["full", "specache-1bit"])
    parser.add_argument("--prompt_tokens", type=int, default=2048)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument(
        "--requests", type=int, default=2, help="load: requests per client, one after the other"
    )
    parser.add_argument(
        "--short_tokens", type=int, default=64, help="mixed: the short prompts' tokens"
    )
    parser.add_argument(
        "--mixed_requests", type=int, default=32, help="mixed: requests in all (default 32)"
    )
    parser.add_argument(
        "--answer_tokens",
        type=int,
        nargs=2,
        default=[16, 128],
        metavar=("MIN", "MAX"),
        help="mixed: each request's max_tokens, drawn between these (default 16 128)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="mixed: runs of static and continuous batching, in turn (default 1)",
    )
    parser.add_argument(
        "--prefill_chunk",
        type=int,
        default=None,
        help="mixed: both servers' --prefill_chunk (default: serving/serve.py's)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="every server's --dtype (default auto: float32 on a CPU)",
    )
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--out", type=Path, default=None, help="also write serve.md and serve.json here"
    )
    args = parser.parse_args()
    checkpoint = resolve_checkpoint(args.checkpoint)
    tokenizer = get_tokenizer(checkpoint.parent)
    # room for the prompt, the answer, the chat format and a second turn
    answer = args.answer_tokens[1] if args.workload == "mixed" else args.max_tokens
    context = -(-(args.prompt_tokens + 2 * answer + 96) // 64) * 64
    log = Path("/tmp") / f"bench_serve_{args.port}.log"
    markdown, data = WORKLOADS[args.workload](args, checkpoint, tokenizer, context, log)
    print(markdown)
    if args.out:
        write_report(args.out, "serve", markdown, data)


if __name__ == "__main__":
    main()
