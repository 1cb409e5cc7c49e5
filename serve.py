"""An OpenAI-compatible HTTP server on generate.py's model and caches (SpeCache among them).

    python serve.py --cache specache --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 32}'

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the model's chat
template), GET /health (requests waiting and decoding, tokens generated since the start). Requests
take max_tokens (chat: or max_completion_tokens), temperature (0 is greedy), top_k (an extension:
sample among the k likeliest; top_p is not supported and must be 1), stop (up to 4 strings), seed,
stream (server-sent events in OpenAI's chunk format, ending with `data: [DONE]`;
stream_options.include_usage adds a usage chunk). `usage` carries the token counts and, as the extra
field `cache`, the statistics of the batch's cache when the answer ended (for SpeCache: fast-tier
bytes and their ratio to a 16-bit cache, bytes fetched per token); generate.py --json prints the
same.

Batching is static: one worker thread owns the model; requests wait in a queue (at most
--max_queue, beyond which they get HTTP 429), and whenever the worker is free it takes the oldest
with up to --max_batch_size - 1 more that share its sampling settings and fit the context together,
and decodes them as one ragged batch (prompts of different lengths side by side) until each has its
answer. A request that arrives mid-batch waits for the next batch (no continuous batching). Greedy
answers do not depend on the batch; a sampled request with a seed runs alone, so that the seed
alone fixes its answer.

Bad requests (malformed JSON, a field of the wrong type or an unknown one, max_tokens <= 0, a prompt
that leaves no room in --max_seq_length, an unknown model) get HTTP 400 with an OpenAI-style
{"error": {...}} body. A streaming client that disconnects stops its sequence (the batch ends early
once none of its requests is still wanted). A failed request fails alone; an error in the batch's
decoding fails that batch's requests with HTTP 500 and the server goes on.
"""

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from checkpoint import UserError, load_model, load_tokenizer, resolve_checkpoint
from openai_api import APIError, ChatRequest, CompletionRequest, Sampling, validation_message
from generation import GenerateOptions, generate
from model import Transformer
from options import (
    add_cache_arguments,
    add_model_arguments,
    cache_from_args,
    context_length,
    model_dtype,
    pick_device,
    validate_cache_args,
)
from tokenizer import IncrementalText, Tokenizer


# ---------------------------------------------------------------------------------------------
# Jobs: one request's answer as it grows
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """One request in the worker's hands. The worker calls `feed`; the request's handler reads
    `events` (("text", piece), ("done", finish_reason), ("error", message)) on its event loop."""

    prompt_ids: list[int]
    max_tokens: int
    stops: list[str]
    sampling: tuple  # (temperature, top_k, seed); equal tuples may share a batch
    tokenizer: Tokenizer
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0  # tokens the model gave this request, a stop token included
    sent: str = ""  # text handed to the client so far
    finished: bool = False  # the answer is complete, failed, or no longer wanted
    stats: dict = field(default_factory=dict)  # the batch's cache statistics when this answer ended
    stats_source: Callable[[], dict] = dict
    # the answer's tokens (without a stop token) and text
    answer: IncrementalText = field(init=False)

    def __post_init__(self):
        self.answer = IncrementalText(self.tokenizer)

    def _emit(self, *event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def feed(self, token: int) -> None:
        """The next token: emit the text it completes; finish at a stop token, a stop string or
        max_tokens."""
        if self.finished:
            return
        self.generated += 1
        answer = self.answer
        if token in self.tokenizer.stop_ids:
            answer.rest()
            self._send(answer.text)  # what waited for a stop string that never came
            return self.finish("stop")
        answer.add(token)
        if len(answer.ids) >= self.max_tokens:
            answer.rest()
        text = answer.text
        # a stop string starts after what was sent: text that could begin one is held back
        hits = [i for i in (text.find(s, len(self.sent)) for s in self.stops) if i >= 0]
        if hits:
            self._send(text[: min(hits)])
            return self.finish("stop")
        if len(answer.ids) >= self.max_tokens:
            self._send(text)
            return self.finish("length")
        hold = max(
            (n for s in self.stops for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])),
            default=0,
        )
        self._send(text[: len(text) - hold])  # what could begin a stop string waits

    def _send(self, text: str) -> None:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            self._emit("text", text[len(self.sent) :])
            self.sent = text

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            self.stats = self.stats_source()
            self._emit("done", reason)

    def fail(self, message: str) -> None:
        if not self.finished:
            self.finished = True
            self._emit("error", message)

    def abandon(self) -> None:
        """The client has gone: nothing more is sent, and the batch need not wait for this one."""
        self.finished = True


class QueueFull(Exception):
    pass


class Engine:
    """The worker thread that owns the model, and the queue it takes batches from."""

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer, args: argparse.Namespace, capacity: int
    ):
        self.model, self.tokenizer, self.args, self.capacity = model, tokenizer, args, capacity
        self.pending: deque[Job] = deque()
        self.ready = threading.Condition()
        self.cache, self.cache_rows = None, 0
        # the batch in hand; tokens given to requests since start
        self.decoding, self.tokens_generated = (
            0,
            0,
        )
        self.thread = threading.Thread(target=self._run, name="decode", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.ready:
            if len(self.pending) >= self.args.max_queue:
                raise QueueFull
            self.pending.append(job)
            self.ready.notify()

    def _take(self) -> list[Job]:
        """The oldest job and up to max_batch_size - 1 more with its sampling settings that fit the
        context."""
        with self.ready:
            while not self.pending:
                self.ready.wait()
            first = self.pending.popleft()
            batch = [first]
            if first.sampling[0] > 0 and first.sampling[2] is not None:
                return batch  # seeded sampling runs alone
            for job in list(self.pending):
                if len(batch) == self.args.max_batch_size:
                    break
                longest = max(len(j.prompt_ids) for j in batch + [job])
                most = max(j.max_tokens for j in batch + [job])
                if job.sampling == first.sampling and longest + most <= self.capacity:
                    batch.append(job)
                    self.pending.remove(job)
            return batch

    def _run(self) -> None:
        while True:
            # a client may have gone while queued
            batch = [job for job in self._take() if not job.finished]
            if batch:
                self.decoding = len(batch)
                try:
                    self._decode(batch)
                finally:
                    self.decoding = 0

    def cache_for(self, rows: int):
        """The cache for a batch of `rows` sequences: the last one again if the size is the same."""
        # a new batch size sets the model's caches up anew
        if self.cache is None or self.cache_rows != rows:
            self.cache = None  # the old one goes first, so that the two never take memory together
            self.cache = cache_from_args(self.args, self.model, rows, self.capacity)
            self.cache_rows = rows
        return self.cache

    def _decode(self, batch: list[Job]) -> None:
        temperature, top_k, seed = batch[0].sampling
        if seed is not None:
            torch.manual_seed(seed)

        steps = [0]  # decode steps so far (the first token comes from prefill)

        def feed(tokens: torch.Tensor) -> None:
            for job, (token,) in zip(batch, tokens.tolist()):
                self.tokens_generated += not job.finished
                try:
                    job.feed(token)
                except Exception as error:  # one request's failure (its text, say) is its own
                    job.fail(f"{type(error).__name__}: {error}")
            steps[0] += 1

        cache = self.cache_for(len(batch))
        for job in batch:
            job.stats_source = lambda: cache.stats(max(1, steps[0] - 1))
        longest = max(len(job.prompt_ids) for job in batch)
        new_tokens = min(max(job.max_tokens for job in batch), self.capacity - longest)
        try:
            options = GenerateOptions(
                prefill_chunk=self.args.prefill_chunk,
                keep_going=lambda: not all(job.finished for job in batch),
            )
            generate(
                self.model,
                cache,
                [job.prompt_ids for job in batch],
                new_tokens,
                stop_ids=frozenset(self.tokenizer.stop_ids),
                callback=feed,
                options=options,
                temperature=temperature,
                top_k=top_k,
            )
        except Exception as error:
            print(
                f"error: a batch of {len(batch)} failed: {type(error).__name__}: {error}",
                file=sys.stderr,
            )
            self.cache = None  # whatever state it was left in goes
            for job in batch:
                job.fail(
                    f"the batch this request was decoded in failed: {type(error).__name__}: {error}"
                )
            return
        for job in batch:
            job.finish("length")  # the context ran out before its max_tokens (no-op for the others)


# ---------------------------------------------------------------------------------------------
# The HTTP side
# ---------------------------------------------------------------------------------------------


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status)


def make_app(engine: Engine, model_name: str) -> FastAPI:
    app = FastAPI(title="SpeCache server", docs_url=None, redoc_url=None)
    tokenizer, capacity = engine.tokenizer, engine.capacity

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, error: RequestValidationError):
        message, param = validation_message(error)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error)

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "waiting": len(engine.pending),
            "decoding": engine.decoding,
            "tokens_generated": engine.tokens_generated,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "local"}],
        }

    def admit(
        body: Sampling, prompt_ids: list[int], max_tokens: Optional[int], prompt_param: str
    ) -> Job:
        if body.model != model_name:
            raise APIError(
                400,
                f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        room = capacity - len(prompt_ids)
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this server's context "
                "(--max_seq_length) "
                f"is {capacity} tokens, which leaves no room for an answer",
                param=prompt_param,
                code="context_length_exceeded",
            )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")
        job = Job(
            prompt_ids,
            min(max_tokens or room, room),
            stops,
            (
                body.temperature,
                body.top_k if body.temperature > 0 else None,
                body.seed if body.temperature > 0 else None,
            ),
            tokenizer,
            asyncio.get_running_loop(),
        )
        try:
            engine.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy: {engine.args.max_queue} requests are waiting already; "
                "try again later",
                kind="rate_limit_error",
                code="queue_full",
            ) from None
        return job

    def usage(job: Job) -> dict:
        return {
            "prompt_tokens": len(job.prompt_ids),
            "completion_tokens": job.generated,
            "total_tokens": len(job.prompt_ids) + job.generated,
            "cache": job.stats,
        }

    async def answer(job: Job) -> tuple[str, str]:
        text = ""
        while True:
            event = await job.events.get()
            if event[0] == "text":
                text += event[1]
            elif event[0] == "done":
                return text, event[1]
            else:
                raise APIError(500, event[1], kind="server_error")

    async def respond(job: Job, body: Sampling, chat: bool):
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        head = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model_name,
        }

        def chunk(piece: Optional[str], finish: Optional[str], first: bool = False) -> str:
            if chat:
                delta = (
                    {"role": "assistant", "content": ""}
                    if first
                    else ({"content": piece} if piece else {})
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {
                    "index": 0,
                    "text": piece or "",
                    "logprobs": None,
                    "finish_reason": finish,
                }
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        if body.stream:

            async def events():
                try:
                    if chat:
                        yield chunk(None, None, first=True)
                    while True:
                        event = await job.events.get()
                        if event[0] == "text":
                            yield chunk(event[1], None)
                        elif event[0] == "done":
                            yield chunk(None, event[1])
                            if body.stream_options and body.stream_options.include_usage:
                                last = {**head, "choices": [], "usage": usage(job)}
                                yield f"data: {json.dumps(last)}\n\n"
                            break
                        else:
                            error = APIError(500, event[1], kind="server_error").body
                            yield f"data: {json.dumps(error)}\n\n"
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    job.abandon()  # a client that went away mid-stream: its sequence stops

            return StreamingResponse(
                events(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )

        try:
            text, finish = await answer(job)
        finally:
            job.abandon()
        choice = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            if chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        )
        return {
            **head,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": usage(job),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise APIError(400, "prompt takes one string per request", param="prompt")
        job = admit(
            body,
            tokenizer.encode(prompts[0]) if prompts[0] else [],
            body.max_tokens or 16,
            "prompt",
        )
        return await respond(job, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        try:
            ids = tokenizer.encode_messages(
                [{"role": m.role, "content": m.text()} for m in body.messages]
            )
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from None
        job = admit(body, ids, body.max_completion_tokens or body.max_tokens, "messages")
        return await respond(job, body, chat=True)

    return app


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served_model_name",
        default=None,
        help="the model name clients send (default: the checkpoint's directory name)",
    )
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="context per sequence, prompt and answer (default: the model's, at most 4096)",
    )
    p.add_argument(
        "--max_batch_size", type=int, default=8, help="requests decoded side by side (default 8)"
    )
    p.add_argument(
        "--max_queue",
        type=int,
        default=64,
        help="requests that may wait for a batch; beyond, HTTP 429 (default 64)",
    )
    p.add_argument(
        "--log_level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info logs each request)",
    )
    p.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    add_cache_arguments(p)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate_cache_args(args)
        for name in ("max_batch_size", "max_queue", "max_seq_length"):
            value = getattr(args, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name} must be at least 1 (got {value})")
        device = pick_device(args.device)
        dtype = model_dtype(args.dtype, device)
        checkpoint = resolve_checkpoint(args.checkpoint)
        model = load_model(checkpoint, device, dtype)
        tokenizer = load_tokenizer(checkpoint, model)
        capacity = context_length(args.max_seq_length, model)
        engine = Engine(model, tokenizer, args, capacity)
        engine.cache_for(1)  # a bad cache setting fails here, before the server listens
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or checkpoint.parent.name
    print(
        f"Serving {name} ({checkpoint}, {dtype}, --cache {args.cache}, context {capacity}, batches "
        "of up to "
        f"{args.max_batch_size}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    engine.start()
    uvicorn.run(make_app(engine, name), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
