"""An OpenAI-compatible HTTP server on generate.py's model and caches (SpeCache among them).

    python -m serving.serve --cache specache --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 32}'

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the model's chat
template), GET /health (requests waiting, running and finished; tokens generated and tokens/s of
the worker's busy time; the median time to first token of the latest requests; how full the
batch ran; the kept conversations and their RAM). Requests take max_tokens (chat: or
max_completion_tokens), temperature (0 is greedy), top_k (an extension: sample among the k
likeliest; top_p is not supported and must be 1), stop (up to 4 strings), seed, stream
(server-sent events in OpenAI's chunk format, ending with `data: [DONE]`;
stream_options.include_usage adds a usage chunk).
`usage` carries the token counts, `prompt_tokens_details.cached_tokens` (the prompt tokens a kept
conversation held already) and, as the extra field `cache`, the statistics of the request's cache
when its answer ended (for SpeCache: fast-tier bytes and their ratio to a 16-bit cache, bytes
fetched per token); generate.py --json prints the same.

Batching is continuous (batching.py): one worker thread owns the model; requests wait in a queue
(at most --max_queue, beyond which they get HTTP 429), join the running batch between passes while
it has fewer than --max_batch_size, and leave it as soon as their answer is complete. Each pass of
the model takes a decode step of every running answer and up to --prefill_chunk tokens of joining
prompts (whole chunks, shortest prompt first), so running answers go on streaming while a long
prompt joins. With the full cache, and SpeCache with its slow tier in host RAM, the requests share
one cache, a row each (a decode step attends in one call per layer for all of them); with the
others each request has a cache of its own.
Either way greedy answers equal generate.py's for the same prompt (with the same --prefill_chunk),
and a sampled request with a seed gives the same answer alone or beside others. `--batching static`
lets requests join only an empty batch (the baseline scripts/bench/bench_serve.py compares with).

Conversations: the cache of a finished chat request is kept (up to --keep_conversations_gb: a
full-cache row's K and V copied out, the tokens it holds; another cache whole, its bytes as
allocated, a disk tier's files included; least recently used first out). A chat request
whose tokens extend a kept cache's token for token (the same messages, the assistant's reply as it
was sent, and a new turn) continues that cache and prefills only its new tokens, as chat.py does;
any other starts afresh. When the server stops, every cache goes, and a disk tier's files with it.

Bad requests (malformed JSON, a field of the wrong type or an unknown one, max_tokens <= 0, a prompt
that leaves no room in --max_seq_length, an unknown model) get HTTP 400 with an OpenAI-style
{"error": {...}} body. A streaming client that disconnects stops its sequence, which leaves the
batch. A failed request fails alone; an error in a pass of the model fails the requests in it with
HTTP 500 and the server goes on.
"""

import argparse
import asyncio
import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from checkpoint import UserError, load_model, load_tokenizer, resolve_checkpoint
from options import (
    add_cache_arguments,
    add_model_arguments,
    cache_from_args,
    context_length,
    model_dtype,
    pick_device,
    validate_cache_args,
)
from serving.batching import PREFILL_CHUNK, Engine, QueueFull
from serving.openai_api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    validation_message,
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
    sampling: tuple  # (temperature, top_k, seed)
    tokenizer: Tokenizer
    loop: asyncio.AbstractEventLoop
    keep: bool = False  # its cache may be kept for a request that continues it (a chat turn)
    reused: int = 0  # prompt tokens a kept cache held already (set by the engine)
    submitted: float = 0.0  # time.monotonic() when it entered the queue (set by the engine)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0  # tokens the model gave this request, a stop token included
    sent: str = ""  # text handed to the client so far
    finished: bool = False  # the answer is complete, failed, or no longer wanted
    stats: dict = field(default_factory=dict)  # its cache's statistics when this answer ended
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


# ---------------------------------------------------------------------------------------------
# The HTTP side
# ---------------------------------------------------------------------------------------------


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status)


def make_app(engine: Engine, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    app = FastAPI(title="SpeCache server", docs_url=None, redoc_url=None)
    capacity = engine.capacity

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, error: RequestValidationError):
        message, param = validation_message(error)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error)

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.health()}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "local"}],
        }

    def admit(
        body: Sampling,
        prompt_ids: list[int],
        max_tokens: Optional[int],
        prompt_param: str,
        keep: bool = False,
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
            keep,
        )
        try:
            engine.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy: {engine.max_queue} requests are waiting already; "
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
            "prompt_tokens_details": {"cached_tokens": job.reused},
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
        job = admit(body, ids, body.max_completion_tokens or body.max_tokens, "messages", keep=True)
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
        "--batching",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous (default): requests join the running batch between passes and leave it "
        "when done, and each pass takes their prompt chunks beside the running answers' steps; "
        "static: they join only an empty batch (scripts/bench/bench_serve.py's baseline)",
    )
    p.add_argument(
        "--keep_conversations_gb",
        type=float,
        default=1.0,
        help="bytes (RAM, and a disk tier's files) for the caches of finished chat requests, least "
        "recently used first out: a request whose messages extend one prefills only its new tokens "
        "(default 1; 0: keep none)",
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
    add_cache_arguments(
        p,
        whole_prompt=f"{PREFILL_CHUNK} here, so that running answers go on "
        "streaming while a long prompt joins; streaming and h2o: the whole prompt",
    )
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate_cache_args(args)
        for name in ("max_batch_size", "max_queue", "max_seq_length"):
            value = getattr(args, name)
            if value is not None and value <= 0:
                raise UserError(f"--{name} must be at least 1 (got {value})")
        if args.keep_conversations_gb < 0:
            raise UserError(
                f"--keep_conversations_gb must be >= 0 (got {args.keep_conversations_gb})"
            )
        device = pick_device(args.device)
        dtype = model_dtype(args.dtype, device)
        checkpoint = resolve_checkpoint(args.checkpoint)
        model = load_model(checkpoint, device, dtype)
        tokenizer = load_tokenizer(checkpoint, model)
        capacity = context_length(args.max_seq_length, model)
        engine = Engine(
            model,
            lambda batch: cache_from_args(args, model, batch, capacity),
            capacity,
            args.max_batch_size,
            args.max_queue,
            args.prefill_chunk or PREFILL_CHUNK,
            int(args.keep_conversations_gb * 1e9),
            static=args.batching == "static",
        )  # a bad cache setting fails here, before the server listens
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or checkpoint.parent.name
    print(
        f"Serving {name} ({checkpoint}, {dtype}, --cache {args.cache}, context {capacity}, "
        f"{args.batching} batches of up to {args.max_batch_size}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
        flush=True,
    )
    engine.start()
    app = make_app(engine, tokenizer, name)
    # uvicorn stops on SIGTERM and then raises it again, whose default action would end the
    # process at once: as an exit here instead, the finally below runs
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()  # the caches go, and a disk tier's files with them
    return 0


if __name__ == "__main__":
    sys.exit(main())
