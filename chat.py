"""Chat with a model in the terminal, one turn after another on the same KV cache.

    python chat.py --specache                 # SpeCache 1-bit on the embedded default model
    python chat.py --checkpoint checkpoints/<org>/<model>/model.pth --max_seq_length 8192

Each new turn is prefilled on top of the cache the conversation has built (the history is never
prefilled again): the full cache attends to it as it is; SpeCache's new turn attends to the
history's exact 16-bit pairs, read from the slow tier block by block, and is then quantized into
the low-bit copy as a prompt is. Commands: /reset (a new conversation), /stats (the cache's tiers
and ratios), /exit (or Ctrl-D). Ctrl-C stops the current answer and keeps the conversation.
"""

import argparse
import signal
import sys
import time
from typing import Optional

import torch

from checkpoint import UserError, load_model, load_tokenizer, resolve_checkpoint
from generation import GenerateOptions, GenerationResult, compile_decode, generate
from generate import TextStream, log, peak_memory_bytes, run_command, validate_generation_args
from options import (
    EVICTION_CACHES,
    add_cache_arguments,
    add_model_arguments,
    cache_from_args,
    cache_summary,
    context_length,
    model_dtype,
    prefill_products,
    pick_device,
    validate_cache_args,
)
from specache import SlowTierError

COMMANDS = "/reset starts over, /stats shows the cache, /exit leaves; Ctrl-C stops an answer"


class Conversation:
    """What the cache holds: `held` tokens, and the last reply's last token, which is not in the
    cache
    yet (the next turn starts with it)."""

    def __init__(self):
        self.held, self.pending = 0, None
        self.last: Optional[GenerationResult] = None

    def next_prompt(self, tokenizer, text: str, system: Optional[str]) -> list[int]:
        """The ids this turn prefills: the whole first turn, or the end of the last reply and the
        new
        user turn. The reply's last token ends its turn if it is a stop token (the end-of-turn token
        in its place: another, <|endoftext|> say, is not what the chat format puts there), else it
        is followed by one (a reply cut by --max_new_tokens or Ctrl-C)."""
        if self.pending is None:
            return tokenizer.encode_chat(text, system)
        end = (
            [tokenizer.end_of_turn_id]
            if self.pending in tokenizer.stop_ids
            else [self.pending, tokenizer.end_of_turn_id]
        )
        return end + tokenizer.encode_next_turn(text)

    def answered(self, prompt: list[int], result: GenerationResult) -> None:
        self.held += len(prompt) + len(result.tokens[0]) - 1
        self.pending, self.last = result.tokens[0][-1], result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(p)
    p.add_argument(
        "--system", default=None, help="system message (default: the model's own, if any)"
    )
    p.add_argument("--max_new_tokens", type=int, default=512, help="the longest answer, in tokens")
    p.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature; 0 = greedy"
    )
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling")
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="the conversation's context, in tokens (default: the model's, at most 4096); /reset "
        "when "
        "it is full",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (minutes of compiling first)",
    )
    p.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    add_cache_arguments(p)
    return p


def answer(
    model, cache, tokenizer, prompt: list[int], conversation: Conversation, args, capacity: int
):
    """Stream one reply to stdout and count it into the conversation; Ctrl-C ends it after the
    current step (after the prefill, if it comes during one), and the cache stays whole."""
    stopped = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stopped.append(True))
    stream = TextStream(tokenizer, frozenset(tokenizer.stop_ids), hide_stop=True)
    try:
        options = GenerateOptions(
            prefill_chunk=args.prefill_chunk,
            held=conversation.held,
            keep=True,
            keep_going=lambda: not stopped,
            prefill_products=prefill_products(args.prefill_dtype),
        )
        result = generate(
            model,
            cache,
            [prompt],
            min(args.max_new_tokens, capacity - conversation.held - len(prompt)),
            stop_ids=frozenset(tokenizer.stop_ids),
            callback=stream,
            options=options,
            temperature=args.temperature,
            top_k=args.top_k,
        )
        conversation.answered(prompt, result)
    finally:
        signal.signal(signal.SIGINT, previous)
    print(flush=True)
    if stopped:
        log("[answer stopped]")
    return result


def show_stats(cache, conversation: Conversation, capacity: int) -> None:
    print(f"conversation: {conversation.held} of {capacity} tokens in the cache", flush=True)
    if conversation.last is not None:
        stats = conversation.last.stats
        print(
            f"cache: full, K and V in {stats['kv_dtype']}"
            if stats["cache"] == "full"
            else f"cache: {cache_summary(stats)}",
            flush=True,
        )


def run(args: argparse.Namespace) -> None:
    validate_generation_args(args)
    validate_cache_args(args)
    if args.cache in EVICTION_CACHES:
        raise UserError(
            f"--cache {args.cache} cannot hold a conversation: a new turn would have to attend to "
            "the "
            "tokens it evicted; use full, specache, specache-nospec or kivi"
        )
    device = pick_device(args.device)
    dtype = model_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model = load_model(checkpoint, device, dtype)
    tokenizer = load_tokenizer(checkpoint, model)
    capacity = context_length(args.max_seq_length, model)
    cache = cache_from_args(args, model, 1, capacity, log=log)
    if args.compile:
        compile_decode(model, fullgraph=not cache.graph_breaks, whole_step=cache.whole_step)
    log(
        f"Chatting with {checkpoint.parent.name} ({dtype}, --cache {args.cache}, context "
        f"{capacity} tokens). "
        f"{COMMANDS}."
    )
    interactive = sys.stdin.isatty()
    conversation = Conversation()
    try:
        while True:
            try:
                line = input(">>> " if interactive else "")
            except EOFError:
                break
            except KeyboardInterrupt:
                print()
                log("(/exit leaves)")
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                cache.finish()  # a disk tier's files go; the next turn begins afresh
                conversation = Conversation()
                log("[a new conversation]")
                continue
            if text == "/stats":
                show_stats(cache, conversation, capacity)
                continue
            if text.startswith("/"):
                log(f"unknown command {text.split()[0]}: {COMMANDS}")
                continue
            prompt = conversation.next_prompt(tokenizer, text, args.system)
            if conversation.held + len(prompt) >= capacity:
                log(
                    f"The conversation has reached the context: {conversation.held} tokens held "
                    f"and {len(prompt)} "
                    f"in this turn, of {capacity}. /reset to start a new one (or restart with a "
                    "larger "
                    "--max_seq_length)."
                )
                continue
            t0 = time.perf_counter()
            try:
                result = answer(model, cache, tokenizer, prompt, conversation, args, capacity)
            except SlowTierError as error:  # the disk tier's files are gone with it
                log(f"error: {error}; the conversation starts over")
                conversation = Conversation()
                continue
            log(
                f"[{len(prompt)} tokens prefilled in {result.prefill_seconds:.2f} s, "
                f"{len(result.tokens[0])} generated "
                f"at {result.decode_tokens_per_second:.1f} tok/s, {time.perf_counter() - t0:.1f} "
                "s; "
                f"{conversation.held} of {capacity} tokens in the cache]"
            )
            if conversation.held + 1 >= capacity:
                log("The conversation has reached the context. /reset to start a new one.")
    finally:
        cache.finish()
    log(f"Peak memory: {peak_memory_bytes(device) / 1e9:.2f} GB")


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
