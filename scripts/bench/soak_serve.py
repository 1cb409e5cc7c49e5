"""A soak test of serving/serve.py on 127.0.0.1: a few hundred requests of every kind at mixed
concurrency, then checks that nothing was lost, wrong or left behind.

    python scripts/bench/soak_serve.py                              # 300 requests per cache
    python scripts/bench/soak_serve.py --requests 40 --methods specache-1bit-disk  # a short one

Per method (`full`, `specache-1bit`, `specache-1bit-disk`: SpeCache with its slow tier on disk), one
server (continuous batching, batches of 8, conversations kept up to --keep_gb) and the official
`openai` client. Warm-up waves of 48 requests at concurrency 16 fill the pools and the kept
conversations' budget (to 90%, or until their count stops changing), then one wave at each
concurrency the run draws from, so that the run brings the server no pattern of threads it has not
met (with the disk tier's I/O threads, resident memory went on rising through the first 250
requests of a run, by 9% of the warm-up's, and 1% over the next 250); then the run sends
--requests requests in waves, each wave at a concurrency drawn from 1-16. Each request is one
of:
- a chat or a completion, streamed or not, on one of 12 prompts whose greedy answers are known
  (generate.py's, computed here with the same cache);
- a second turn of an earlier chat (its messages, the reply as sent, a new question): answered,
  with the prompt tokens it reused counted;
- a bad request (malformed JSON, an unknown field, a wrong model, max_tokens 0, a prompt longer
  than the context);
- a stream whose client hangs up after the first chunk.

Checks: every good request got its answer, and every known one the known answer; every bad one an
HTTP 4xx; after the run, with the server idle, resident memory within 10% of where it was after
the warm-up, and as many threads; after the server stops, no file left in the disk tier's folder.
Exits 1 if a check fails; --out writes soak.md and soak.json.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from caches.by_name import make_cache  # noqa: E402
from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from generation import generate  # noqa: E402
from scripts.bench.bench_serve import start_server, stop  # noqa: E402
from scripts.eval.harness import write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

CONTEXT = 512
MAX_TOKENS = 12
CONCURRENCIES = (1, 2, 4, 8, 16)  # a wave's clients
TOPICS = ("rivers", "bread", "winter", "clocks", "bees", "maps", "glass", "salt", "kites", "owls")
QUESTIONS = [f"In one sentence, what is interesting about {t}?" for t in TOPICS] + [
    "Name three colours.",
    "What is 12 plus 30?",
]
METHODS = {
    "full": ["--cache", "full"],
    "specache-1bit": ["--cache", "specache"],
    "specache-1bit-disk": ["--cache", "specache", "--slow_tier", "disk"],
}
BAD = [
    ("/v1/chat/completions", "{not json"),
    ("/v1/completions", {"prompt": "a", "frobnicate": 1}),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}),
    ("/v1/completions", {"prompt": "word " * (2 * CONTEXT)}),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "a"}]}),
]


def process_figures(pid: int) -> tuple[int, int]:
    """The server's resident bytes and thread count."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"])


class Soak:
    def __init__(self, url: str, model: str, known: dict, seed: int):
        self.url, self.model, self.known = url, model, known
        self.client = openai.OpenAI(
            base_url=url + "/v1", api_key="none", timeout=300, max_retries=0
        )
        self.random = random.Random(seed)
        self.chats: list[list[dict]] = []  # finished first turns, for second ones
        self.failures: list[str] = []
        self.counts = dict(known=0, second_turn=0, bad=0, hung_up=0, reused_tokens=0)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def known_request(self, rng: random.Random) -> None:
        question = rng.choice(QUESTIONS)
        chat, stream = rng.random() < 0.5, rng.random() < 0.5
        kwargs = dict(model=self.model, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
        if chat:
            messages = [{"role": "user", "content": question}]
            response = self.client.chat.completions.create(messages=messages, **kwargs)
            text = (
                "".join(c.choices[0].delta.content or "" for c in response if c.choices)
                if stream
                else response.choices[0].message.content
            )
            self.chats.append(messages + [{"role": "assistant", "content": text}])
        else:
            response = self.client.completions.create(prompt=question, **kwargs)
            text = (
                "".join(c.choices[0].text for c in response if c.choices)
                if stream
                else response.choices[0].text
            )
        expected = self.known[("chat" if chat else "completion", question)]
        self.check(text == expected, f"{question!r} (chat={chat}): {text!r} != {expected!r}")
        self.counts["known"] += 1

    def second_turn(self, rng: random.Random) -> None:
        if not self.chats:
            return self.known_request(rng)
        messages = rng.choice(self.chats) + [{"role": "user", "content": "Say it shorter."}]
        response = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        self.check(bool(response.choices[0].message.content), "an empty second turn")
        details = response.usage.prompt_tokens_details
        self.counts["reused_tokens"] += (details.cached_tokens or 0) if details else 0
        self.counts["second_turn"] += 1

    def bad_request(self, rng: random.Random) -> None:
        path, body = rng.choice(BAD)
        if isinstance(body, dict):
            body = json.dumps(dict({"model": self.model}, **body))
        response = httpx.post(
            self.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60
        )
        self.check(
            400 <= response.status_code < 500, f"{path} {body[:40]!r}: {response.status_code}"
        )
        self.counts["bad"] += 1

    def hang_up(self, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": rng.choice(QUESTIONS), "max_tokens": 200}
        request = dict(body, stream=True)
        with httpx.stream("POST", self.url + "/v1/completions", json=request, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        self.counts["hung_up"] += 1

    def one(self, seed: int) -> None:
        rng = random.Random(seed)
        kind = rng.choices(
            (self.known_request, self.second_turn, self.bad_request, self.hang_up), (5, 2, 2, 1)
        )[0]
        try:
            kind(rng)
        except Exception as error:
            self.failures.append(f"{kind.__name__}: {type(error).__name__}: {error}")

    def wave(self, size: int, concurrency: int) -> None:
        seeds = [self.random.randrange(1 << 30) for _ in range(size)]
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(self.one, seeds))


def known_answers(checkpoint: Path, method: str) -> dict:
    """generate.py's greedy answers to QUESTIONS as chats and as completions, with `method`'s
    cache (the disk tier answers as the RAM one does, token for token)."""
    model = load_model(checkpoint, torch.device("cpu"), torch.float32)
    tokenizer = get_tokenizer(checkpoint.parent)
    stop_ids = frozenset(tokenizer.stop_ids)
    kind = "full" if method == "full" else "specache-1bit"
    known = {}
    for question in QUESTIONS:
        for form, ids in (
            ("chat", tokenizer.encode_messages([{"role": "user", "content": question}])),
            ("completion", tokenizer.encode(question)),
        ):
            cache = make_cache(kind, model, 1, CONTEXT)
            tokens = generate(model, cache, [ids], MAX_TOKENS, stop_ids=stop_ids).tokens[0]
            known[(form, question)] = tokenizer.decode([t for t in tokens if t not in stop_ids])
    return known


def idle(url: str, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = httpx.get(url + "/health", timeout=10).json()
        if health["running"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.2)
    raise TimeoutError("the server did not go idle")


def soak(checkpoint: Path, method: str, requests: int, keep_gb: float, port: int, seed: int):
    known = known_answers(checkpoint, method)
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    flags = [*METHODS[method], "--max_batch_size", "8", "--keep_conversations_gb", str(keep_gb)]
    if method.endswith("-disk"):
        flags += ["--slow_tier_dir", str(folder)]
    log = folder.parent / f"{folder.name}.log"
    args = ["--checkpoint", str(checkpoint), "--max_seq_length", str(CONTEXT), *flags]
    process = start_server(args, port, log)
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    run = Soak(url, model, known, seed)
    started = time.time()
    try:
        kept = -1
        # warm-up: until the kept conversations fill their budget (a full-cache conversation costs
        # the tokens it holds, so many fit: their count goes on rising for several waves)
        for _ in range(12):
            run.wave(48, 16)
            health = idle(url)
            full = health["kept_conversations_bytes"] >= 0.9 * keep_gb * 1e9
            if full or health["kept_conversations"] == kept:
                break
            kept = health["kept_conversations"]
        for concurrency in CONCURRENCIES:
            run.wave(2 * concurrency, concurrency)
        idle(url)
        warm_rss, warm_threads = process_figures(process.pid)
        done = 0
        while done < requests:
            size = min(run.random.randint(8, 40), requests - done)
            run.wave(size, run.random.choice(CONCURRENCIES))
            done += size
        health = idle(url)
        time.sleep(1)  # the threads of the last requests' connections end
        rss, threads = process_figures(process.pid)
    finally:
        stop(process)
    left = [str(p) for p in folder.rglob("*")]
    run.check(not left, f"files left in the disk tier's folder: {left[:3]}")
    run.check(
        rss <= 1.1 * warm_rss, f"resident memory {rss / 1e6:.0f} MB after {warm_rss / 1e6:.0f}"
    )
    run.check(threads == warm_threads, f"{threads} threads after {warm_threads}")
    run.check("Traceback" not in log.read_text(), f"a traceback in {log}")
    return dict(
        method=method,
        requests=requests,
        minutes=(time.time() - started) / 60,
        failures=run.failures,
        warm_rss_mb=warm_rss / 1e6,
        rss_mb=rss / 1e6,
        warm_threads=warm_threads,
        threads=threads,
        files_left=len(left),
        tokens_per_second=health["tokens_per_second"],
        ttft_median_s=health["time_to_first_token_median_s"],
        kept_conversations=health["kept_conversations"],
        **run.counts,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: SmolLM2")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--requests", type=int, default=300, help="after the warm-up, per method")
    parser.add_argument("--keep_gb", type=float, default=0.5, help="--keep_conversations_gb")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write soak.md and soak.json here")
    args = parser.parse_args()
    checkpoint = resolve_checkpoint(args.checkpoint)
    rows = [
        soak(checkpoint, m, args.requests, args.keep_gb, args.port, args.seed) for m in args.methods
    ]
    lines = [
        f"{checkpoint.parent.name}, context {CONTEXT}, batches of 8, {MAX_TOKENS} new tokens, "
        f"conversations kept up to {args.keep_gb} GB; {args.requests} requests after a warm-up "
        "that fills the budget, in waves at concurrency 1-16; the kinds and failures are counted "
        "over the warm-up and the run",
        "",
        "| method | requests | known answers | second turns (tokens reused) | bad | hung up | "
        "failures | RSS MB warm, after | threads warm, after | files left | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['requests']} | {r['known']} | {r['second_turn']} "
            f"({r['reused_tokens']}) | {r['bad']} | {r['hung_up']} | {len(r['failures'])} | "
            f"{r['warm_rss_mb']:.0f}, {r['rss_mb']:.0f} | {r['warm_threads']}, {r['threads']} | "
            f"{r['files_left']} | {r['minutes']:.1f} |"
        )
    markdown = "\n".join(lines)
    print(markdown)
    for r in rows:
        for failure in r["failures"]:
            print(f"FAILED {r['method']}: {failure}", file=sys.stderr)
    if args.out:
        write_report(args.out, "soak", markdown, dict(rows=rows))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
