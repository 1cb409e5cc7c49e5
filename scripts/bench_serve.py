"""Load on serve.py: requests/s and tokens/s at several concurrencies, full cache against SpeCache.

    python scripts/bench_serve.py                                   # 2k-token prompts, \
        concurrency 1, 4, 8
    python scripts/bench_serve.py --prompt_tokens 512 --concurrency 1 2 --requests 2 --out \
        /tmp/serve

Per method, one server (`python serve.py`, in a subprocess on 127.0.0.1, eager, --max_batch_size
the highest concurrency, --max_seq_length the prompt plus the answer) and, per concurrency C, C
clients (threads with the official `openai` client) that each send --requests completions one after
the other: a prompt of --prompt_tokens tokens (its own text per request, so that nothing is shared),
at most --max_tokens new tokens, greedy (the prompts are prose the model continues; an answer that
stops early counts the tokens it has). One warm-up request goes first. Reported: requests/s and
generated tokens/s over
the wall-clock of all of a concurrency's requests, the median latency of a request, and the
server's peak resident memory (VmHWM, after all concurrencies). Requests that arrive together are
decoded as one static batch, so the figures are those of batches of up to C sequences, prefill
included.
"""

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from caches import parse_method  # noqa: E402
from checkpoint import resolve_checkpoint  # noqa: E402
from scripts.harness import write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
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
    """serve.py with `flags` on 127.0.0.1:`port` (its stderr into `log`), once /health answers."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "serve.py"),
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
            raise RuntimeError(f"serve.py exited:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"serve.py did not start:\n{log.read_text()}")


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument("--methods", nargs="+", default=["full", "specache-1bit"])
    parser.add_argument("--prompt_tokens", type=int, default=2048)
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument(
        "--requests", type=int, default=2, help="requests per client, one after the other"
    )
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--out", type=Path, default=None, help="also write serve.md and serve.json here"
    )
    args = parser.parse_args()
    checkpoint = resolve_checkpoint(args.checkpoint)
    tokenizer = get_tokenizer(checkpoint.parent)
    context = -(-(args.prompt_tokens + args.max_tokens + 8) // 64) * 64
    rows, log = [], Path("/tmp") / f"bench_serve_{args.port}.log"
    for method in args.methods:
        process = start_server(
            [
                "--checkpoint",
                str(checkpoint),
                "--max_seq_length",
                str(context),
                "--max_batch_size",
                str(max(args.concurrency)),
                *server_flags(method),
            ],
            args.port,
            log,
        )
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", timeout=1800, max_retries=0
        )
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
            process.terminate()
            process.wait(timeout=60)
    full = {r["concurrency"]: r for r in rows if r["method"] == args.methods[0]}
    lines = [
        f"{checkpoint.parent.name}, {args.prompt_tokens}-token prompts, {args.max_tokens} new "
        "tokens, greedy, "
        f"{args.requests} requests per client, eager, context {context}; ratios over "
        f"{args.methods[0]} at the "
        "same concurrency",
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
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write_report(args.out, "serve", markdown, dict(rows=rows))


if __name__ == "__main__":
    main()
