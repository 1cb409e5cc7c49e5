"""serving/serve.py: the real server in a subprocess on 127.0.0.1, spoken to with the official
`openai` client (and raw HTTP for what a client library would refuse to send). Greedy answers are
held against generation.generate on the same model and cache, run in this process."""

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from caches.by_name import make_cache
from generation import GenerateOptions, generate
from scripts.bench.bench_serve import server_flags, start_server
from serving.serve import Job, main
from tokenizer import get_tokenizer

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 512
TEXT = (
    "SpeCache keeps the whole key-value cache in large, slow memory and a one-bit copy of it in "
    "fast memory. "
    "Each decoding step, the copy scores every past token, and only the few pairs that matter most "
    "are read "
    "back in sixteen bits. A guessed next token lets the read for the following step start early. "
) * 3
QUESTION = TEXT + "\nIn one sentence: where does SpeCache keep the whole cache?"
# k well under the prompt's quantized positions
SPECACHE = [
    "--cache",
    "specache",
    "--specache_topk",
    "16",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log: Path):
        self.port, self.log = free_port(), log
        self.process = start_server(
            ["--max_seq_length", str(CONTEXT), *args], self.port, log, timeout=180
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", timeout=120, max_retries=0
        )

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def full_server(tmp_path_factory):
    server = Server(
        ["--cache", "full", "--max_batch_size", "2", "--max_queue", "2"],
        tmp_path_factory.mktemp("serve") / "full.log",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def specache_server(tmp_path_factory):
    server = Server(SPECACHE, tmp_path_factory.mktemp("serve") / "specache.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return get_tokenizer(smollm2_checkpoint.parent)


def reference(
    model, tokenizer, method: str, ids: list[int], max_tokens: int, topk: int = 64
) -> str:
    """generate.py's greedy answer (text up to the stop token) for the same cache and context."""
    cache = make_cache(method, model, 1, CONTEXT, topk=topk)
    tokens = generate(
        model, cache, [ids], max_tokens, stop_ids=frozenset(tokenizer.stop_ids)
    ).tokens[0]
    return tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])


def chat(server: Server, content: str, stream: bool = False, max_tokens: int = 24) -> str:
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )
    if not stream:
        return server.client.chat.completions.create(**kwargs).choices[0].message.content
    return "".join(
        chunk.choices[0].delta.content or ""
        for chunk in server.client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    )


@pytest.mark.parametrize("which", ["full", "specache"])
def test_chat_and_completions_match_generate_streaming_or_not(
    which, request, smollm2_model, tokenizer
):
    server = request.getfixturevalue(f"{which}_server")
    method, topk = ("full", 64) if which == "full" else ("specache", 16)
    assert [m.id for m in server.client.models.list().data] == [MODEL]

    expected = reference(
        smollm2_model, tokenizer, method, tokenizer.encode_chat(QUESTION), 24, topk
    )
    assert expected.strip()
    assert chat(server, QUESTION) == expected
    assert chat(server, QUESTION, stream=True) == expected

    expected = reference(smollm2_model, tokenizer, method, tokenizer.encode(TEXT), 12, topk)
    response = server.client.completions.create(
        model=MODEL, prompt=TEXT, max_tokens=12, temperature=0
    )
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 12 and response.usage.prompt_tokens == len(
        tokenizer.encode(TEXT)
    )
    cache = response.usage.model_extra["cache"]
    assert cache["cache"] == which and (
        which == "full" or 0 < cache["fast_tier_ratio_to_16bit_cache"] < 1
    )
    streamed = list(
        server.client.completions.create(
            model=MODEL,
            prompt=TEXT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    assert streamed[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("which", ["full", "specache"])
def test_a_second_chat_turn_continues_the_kept_conversation(
    which, request, smollm2_model, tokenizer
):
    """Turn 2's messages are turn 1's, its reply as sent, and a new question: the server
    continues turn 1's cache (usage says how many prompt tokens it held) and answers what chat.py
    answers continuing its cache."""
    server = request.getfixturevalue(f"{which}_server")
    method, topk = ("full", 64) if which == "full" else ("specache", 16)
    first = [{"role": "user", "content": "Question 7: name a colour of the sky."}]
    reply = server.client.chat.completions.create(
        model=MODEL, messages=first, max_tokens=16, temperature=0
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    answer = reply.choices[0].message.content
    second = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And at night?"},
    ]
    again = server.client.chat.completions.create(
        model=MODEL, messages=second, max_tokens=12, temperature=0
    )
    turn1 = tokenizer.encode_messages(first)
    assert again.usage.prompt_tokens == len(tokenizer.encode_messages(second))
    assert again.usage.prompt_tokens_details.cached_tokens > len(turn1)

    cache = make_cache(method, smollm2_model, 1, CONTEXT, topk=topk)
    stop_ids = frozenset(tokenizer.stop_ids)
    kept = GenerateOptions(keep=True)
    tokens = generate(smollm2_model, cache, [turn1], 16, stop_ids=stop_ids, options=kept).tokens[0]
    held = len(turn1) + len(tokens) - 1
    assert again.usage.prompt_tokens_details.cached_tokens == held
    rest = tokenizer.encode_messages(second)[held:]
    kept = GenerateOptions(keep=True, held=held)
    tokens = generate(smollm2_model, cache, [rest], 12, stop_ids=stop_ids, options=kept).tokens[0]
    cache.finish()
    expected = tokenizer.decode([t for t in tokens if t not in stop_ids])
    assert again.choices[0].message.content == expected


def test_stop_strings_and_the_stop_token_end_an_answer(full_server, smollm2_model, tokenizer):
    expected = reference(smollm2_model, tokenizer, "full", tokenizer.encode_chat(QUESTION), 24)
    cut = expected.split()[2]  # the third word ends the answer just before it
    response = full_server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
        stop=[cut],
    )
    assert response.choices[0].message.content == expected[: expected.index(cut)]
    assert response.choices[0].finish_reason == "stop"
    short = full_server.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=200,
        temperature=0,
    )
    # its <|im_end|>
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 200


def test_eight_concurrent_clients_each_get_their_own_answer(specache_server):
    questions = [
        f"{QUESTION} Answer number {i}." if i % 2 else f"Question {i}: what is {i} plus {i}?"
        for i in range(8)
    ]
    alone = [chat(specache_server, q, max_tokens=12) for q in questions]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda q: chat(specache_server, q, max_tokens=12), questions, timeout=300)
        )
    assert together == alone


def post(server: Server, path: str, body, raw: bool = False) -> httpx.Response:
    kwargs = (
        dict(content=body, headers={"Content-Type": "application/json"}) if raw else dict(json=body)
    )
    return httpx.post(server.url + path, timeout=60, **kwargs)


@pytest.mark.parametrize(
    "path, body, raw, param",
    [
        ("/v1/chat/completions", "{not json", True, None),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "max_tokens": "five"},
            False,
            "max_tokens",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "temperature": [1]},
            False,
            "temperature",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "frobnicate": 1}, False, "frobnicate"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, False, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "a", "top_p": 0.5}, False, "top_p"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, False, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "word " * CONTEXT}, False, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, False, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "robot", "content": "a"}]},
            False,
            "messages.0.role",
        ),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body(full_server, path, body, raw, param):
    response = post(full_server, path, body, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert chat(full_server, "Say hi.", max_tokens=2)  # still serving


def test_the_openai_client_raises_on_a_bad_request(full_server):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        full_server.client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "a"}]
        )


def test_a_full_queue_answers_429_and_the_rest_finish(full_server):
    def ask(_):  # a long answer each, so that requests pile up behind a batch of 2 and a queue of 2
        return post(
            full_server,
            "/v1/completions",
            {"model": MODEL, "prompt": TEXT, "max_tokens": 120, "temperature": 0},
        )

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(8), timeout=300))
    codes = sorted(r.status_code for r in responses)
    assert 429 in codes and 200 in codes and set(codes) == {200, 429}, codes
    busy = next(r for r in responses if r.status_code == 429).json()["error"]
    assert busy["type"] == "rate_limit_error"
    answers = {r.json()["choices"][0]["text"] for r in responses if r.status_code == 200}
    assert len(answers) == 1  # the same greedy answer, whichever batch it was in


def test_a_client_that_disconnects_mid_stream_leaves_the_server_serving(full_server):
    def health():
        return httpx.get(full_server.url + "/health", timeout=10).json()

    before = health()["tokens_generated"]
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", full_server.url + "/v1/completions", json=body, timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    deadline = time.time() + 60
    while health()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert health()["running"] == 0
    # its sequence stopped, well short of the 300 asked
    assert health()["tokens_generated"] - before < 150
    assert chat(full_server, "Say hi.", max_tokens=4)
    assert "Traceback" not in full_server.log.read_text()


def test_job_holds_back_text_that_may_begin_a_stop_string(tokenizer):
    """The streamed pieces never show a stop string, even one split across tokens."""
    loop = asyncio.new_event_loop()
    job = Job([1], 50, ["Paris."], (0.0, None, None), tokenizer, loop)
    for token in tokenizer.encode(" The capital is Paris. Next", bos=False):
        job.feed(token)
    loop.run_until_complete(asyncio.sleep(0))
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    pieces = [e[1] for e in events if e[0] == "text"]
    assert "".join(pieces) == " The capital is " and events[-1] == ("done", "stop")
    loop.close()


def job_pieces(job, loop):
    loop.run_until_complete(asyncio.sleep(0))
    events = []
    while not job.events.empty():
        events.append(job.events.get_nowait())
    return "".join(e[1] for e in events if e[0] == "text"), events[-1]


def test_job_decodes_only_the_newest_tokens_and_loses_no_text(tokenizer):
    """Token by token, the pieces add up to the whole answer's text (characters split between byte
    tokens included), each decode sees a few tokens (not the whole answer: no quadratic cost), and
    text held back for a stop string that never came goes out at the stop token."""
    text = "naïve café, 日本語のテキスト 😀🚀 and so on. " * 8
    ids = tokenizer.encode(text, bos=False)
    seen = []

    class Counting:
        stop_ids = tokenizer.stop_ids

        def decode(self, some):
            seen.append(len(some))
            return tokenizer.decode(some)

    loop = asyncio.new_event_loop()
    job = Job([1], 10_000, ["never"], (0.0, None, None), Counting(), loop)
    for token in ids:
        job.feed(token)
    job.feed(next(iter(tokenizer.stop_ids)))
    pieces, last = job_pieces(job, loop)
    assert pieces == tokenizer.decode(ids) and last == ("done", "stop")
    assert len(ids) > 100 and max(seen) <= 8
    job = Job([1], 50, ["Paris."], (0.0, None, None), tokenizer, loop)
    for token in tokenizer.encode(" The capital is Pari", bos=False) + [
        next(iter(tokenizer.stop_ids))
    ]:
        job.feed(token)
    assert job_pieces(job, loop) == (" The capital is Pari", ("done", "stop"))
    loop.close()


def test_bad_options_are_one_error_line(capsys):
    assert main(["--cache", "nonsense"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown --cache 'nonsense'")
    assert main(["--max_batch_size", "0"]) == 2
    assert "--max_batch_size must be at least 1" in capsys.readouterr().err


def test_bench_serve_starts_each_method_with_its_own_flags():
    assert server_flags("full") == ["--cache", "full"]
    assert server_flags("full-16bit") == ["--cache", "full", "--full_16bit"]
    assert server_flags("specache-2bit:paper") == [
        "--cache",
        "specache",
        "--specache_bits",
        "2",
        "--specache_select",
        "paper",
    ]
    assert server_flags("kivi-1bit") == ["--cache", "kivi", "--specache_bits", "1"]
