"""The one generation loop, gpt-fast style: sampling, prefill (in one piece or in chunks), the
decode steps a cache drives (caches/), and how they compile. generate.py's command line, chat.py,
serving/serve.py and the evaluation scripts all generate through `generate` below.
"""

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from model import CausalPrompt, Transformer
from quantize import Int4Linear, Int8Linear


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def multinomial_sample_one_no_sync(
    probs: Tensor, generator: Optional[torch.Generator] = None
) -> Tensor:
    """Sample from probs without a device sync (the exponential-race trick gpt-fast uses)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.long)


def logits_to_probs(
    logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None
) -> Tensor:
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = torch.where(logits < v[..., -1:], -float("inf"), logits)
    return torch.nn.functional.softmax(logits, dim=-1)


def sample(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Next token (B, 1) from the last position's logits (B, S, V); temperature 0 is greedy.
    `generator`: the random numbers' source (default: torch's global one)."""
    logits = logits[:, -1].float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = logits_to_probs(logits, temperature, top_k)
    return multinomial_sample_one_no_sync(probs, generator)


# ---------------------------------------------------------------------------------------------
# Prefill and decode
# ---------------------------------------------------------------------------------------------


def products_in(device: torch.device, dtype: Optional[torch.dtype]) -> torch.autocast:
    """The matrix products in `dtype` under it (None: as they are): torch.autocast without its
    cache of cast weights, which would hold a second copy of every weight."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False)


def prefill(
    model: Transformer,
    tokens: Tensor,
    lengths: Tensor,
    start: int = 0,
    chunk: Optional[int] = None,
    forward: Optional[Callable] = None,
    **sampling,
) -> Tensor:
    """Run the right-padded prompts (B, S) through the model at positions start..start+S-1, on top
    of the `start` tokens each sequence's cache holds; the first new token of each (B, 1). Each
    layer's cache takes the prompt's K, V from there (`CausalPrompt` carries the lengths and where
    the rows start).

    `chunk`: at most that many positions per pass, each pass on top of the ones before, so that
    only one chunk's activations (and, with SpeCache, one chunk's 16-bit K, V) are in memory at a
    time. `forward`: the model's call (a compiled one).

    Attention is SDPA's causal kernel, compiled or not: compiled FlexAttention prefill on CPU failed
    to build or gave wrong logits in torch 2.13 (decode, one query per sequence, is fine).
    """
    batch, seqlen = tokens.shape
    chunk = min(chunk or seqlen, seqlen)
    last = lengths - 1  # each prompt's last row, whose logits give its first new token
    logits = None
    for first in range(0, seqlen, chunk):
        out = prefill_pass(model, tokens, lengths, start, first, chunk, forward)
        in_chunk = ((last >= first) & (last < first + chunk)).view(batch, 1, 1)
        logits = out if logits is None else torch.where(in_chunk, out, logits)
    return sample(logits, **sampling)


def prefill_rows(
    tokens: Tensor, lengths: Tensor, start: int, first: int, chunk: int
) -> tuple[Tensor, Tensor, CausalPrompt]:
    """The rows, positions and mask of one prefill pass: the prompts' rows first..first+chunk-1
    (of `tokens`, the right-padded (B, S) prompts of `lengths`) at positions start+first on, each
    attending causally to what its prompt holds. `prefill_pass` runs them alone; the server's engine
    packs one prompt's rows beside other requests' (serving.batching.Engine._pass)."""
    rows = tokens[:, first : first + chunk]
    input_pos = torch.arange(
        start + first, start + first + rows.shape[1], device=tokens.device
    ).expand(tokens.shape[0], -1)
    return rows, input_pos, CausalPrompt(start + lengths, start + first)


def prefill_pass(
    model: Transformer,
    tokens: Tensor,
    lengths: Tensor,
    start: int,
    first: int,
    chunk: int,
    forward: Optional[Callable] = None,
) -> Tensor:
    """One pass of `prefill` over `prefill_rows`; the logits (B, 1, V) of each prompt's last row
    where the pass holds it, else of its last row in the pass."""
    forward = model if forward is None else forward  # (a compiled module has no truth value)
    rows, input_pos, mask = prefill_rows(tokens, lengths, start, first, chunk)
    here = (lengths - 1 - first).clamp(0, rows.shape[1] - 1).unsqueeze(1)
    return forward(rows, input_pos, mask, output_index=here)


def pad_prompts(prompts: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """A ragged batch as right-padded tokens (B, S) and each prompt's length (B,)."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    return tokens, lengths


# Inductor's C++ wrapper for the whole CPU step, built apart from the kernels (the glue at -O1, the
# kernels at -O3), so gcc takes seconds; built together at -O3 it took over 17 minutes on SpeCache's
# step. SmolLM2 int8 at 1k, 2 cores: 11.9 against 13.0 ms per step (full cache, 16-bit) and 21.1
# against 23.6 (SpeCache 1-bit) with the Python wrapper, for about the same compile time.
CPU_WHOLE_STEP_OPTIONS = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def compile_decode(model: Transformer, fullgraph: bool = True, whole_step: bool = False) -> None:
    """Compile the decode steps: the whole step as one graph, or each transformer block and the
    head.

    `whole_step`: `model.forward` becomes one graph (on a GPU replayed as a CUDA graph, mode
    "reduce-overhead"), which removes the per-block dispatch and guard checks: on SmolLM2 at 1k on a
    2-core CPU, 14.4 against 17.7 ms per step with the full cache and 30.8 against 37.3 with
    SpeCache, for 0.5-3 minutes of compiling per cache kind and length instead of seconds
    (docs/RESULTS.md). It serves the caches whose step is one pass of the model (`whole_step` in
    caches/): the full cache, the eviction baselines, and SpeCache with its slow tier in a CPU's
    RAM.

    Per block: all blocks share one compiled graph (their weights are graph inputs), so compiling
    takes seconds, and the Python loop between blocks is where SpeCache hands fetches to and from
    the background (a GPU, the disk tier); the position is a tensor, so nothing recompiles as it
    moves. `fullgraph=False` lets a step split its graph where it must (caches/: `graph_breaks`).

    Each cache kind, row count and capacity is a graph of its own, so a process that compares
    several (the benchmarks) needs more than dynamo's default of 8 per function.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if whole_step:
        if model.tok_embeddings.weight.device.type == "cuda":
            model.compile(fullgraph=True, dynamic=False, mode="reduce-overhead")
        else:  # the step calls ~1000 kernels: from C++, not from a Python wrapper
            model.compile(fullgraph=True, dynamic=False, options=CPU_WHOLE_STEP_OPTIONS)
        return
    for layer in model.layers:
        layer.compile(fullgraph=fullgraph, dynamic=False)
    model.norm.compile(fullgraph=True, dynamic=False)
    model.output.compile(fullgraph=True, dynamic=False)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each sequence, up to and including a stop token
    prompt_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    decode_bytes: (
        int  # bytes the decode steps had to read: weights + the KV cache up to each position
    )
    stats: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def decode_gbps(self) -> float:
        return (
            self.decode_bytes / self.decode_seconds / 1e9
            if self.decode_seconds > 0
            else float("nan")
        )


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights a decode step reads (the embedding table only if it is the head's weight
    too;
    quantized Linears count their codes, scales and zeros)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.bytes_read() for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    if model.output.weight is not model.tok_embeddings.weight:
        emb = model.tok_embeddings.weight
        total -= emb.numel() * emb.element_size()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STOP_CHECK_EVERY = 8  # decode steps between the host's looks at whether every sequence has stopped


@dataclass(frozen=True)
class GenerateOptions:
    """How a generation fits its caller, beyond the prompts and sampling (generate's defaults serve
    generate.py itself)."""

    prefill_chunk: Optional[int] = None  # prefill takes at most that many positions per pass
    compile_prefill: bool = False  # prefill through torch.compile (dynamic shapes)
    # prefill's matrix products in this dtype (torch.autocast; the caches, attention and logits
    # keep the model's): --prefill_dtype bfloat16, faster on CPUs that multiply it natively; None:
    # the model's dtype
    prefill_products: Optional[torch.dtype] = None
    # A conversation (chat.py) goes on in the same cache: `keep` leaves what the cache holds in
    # place at the end (the prompt and every new token but the last, which the next prompt starts
    # with), and the next call's `held` says how many tokens that is. Both are for one sequence,
    # whose stop is then checked at every step (so no token past it enters the cache).
    held: int = 0
    keep: bool = False
    # The caller has begun the cache and ingested the prompts (a prefill shared by several caches,
    # scripts/eval/harness.py): decoding starts from these first tokens (B, 1)
    first_token: Optional[Tensor] = None
    # asked before each step (a host-side check, no device sync): False ends the batch there
    # (serving/serve.py, when every request in it has what it wants or has gone)
    keep_going: Callable[[], bool] = lambda: True


@torch.no_grad()
def generate(
    model: Transformer,
    cache,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    stop_ids: frozenset = frozenset(),
    callback: Callable[[Tensor], None] = lambda tokens: None,
    options: GenerateOptions = GenerateOptions(),
    **sampling,
) -> GenerationResult:
    """Generate up to `max_new_tokens` for each prompt (a ragged batch) with `cache` (caches/:
    a cache set up for len(prompts) sequences; `make_cache` names them all), sampling with
    `sampling` (temperature, top_k: see `sample`; default greedy).

    Prefill runs the prompts through the model (each layer's cache takes them in), then the cache
    bootstraps, then each decode step gives the real tokens' logits and the sampled tokens go back
    to the cache. `callback` receives each step's new tokens (B, 1). Sequences that emit a stop id
    are done; the host looks every STOP_CHECK_EVERY steps and ends the batch when all are (the
    tokens past a stop are cut), so the loop waits on the device only then.
    """
    device = model.tok_embeddings.weight.device
    tokens, lengths = pad_prompts(prompts, device)
    sampling = dict(dict(temperature=0.0, top_k=None), **sampling)
    held, keep, first_token = options.held, options.keep, options.first_token
    if (held or keep) and len(prompts) != 1:
        raise ValueError("a conversation goes on one sequence at a time (held, keep)")
    if (held or options.prefill_chunk) and not cache.chunks:
        raise ValueError(
            "this cache takes each prompt in one piece, from position 0: no chunked prefill and no "
            "continued conversation"
        )
    try:
        _sync(device)
        t0 = time.perf_counter()
        if first_token is not None:
            real = first_token
        else:
            cache.begin(tokens, lengths, held)
            chunked = dict(start=held, chunk=options.prefill_chunk, **sampling)
            with products_in(device, options.prefill_products):
                if options.compile_prefill:
                    real = prefill(
                        model,
                        tokens,
                        lengths,
                        forward=torch.compile(model, fullgraph=True, dynamic=True),
                        **chunked,
                    )
                else:
                    with torch.compiler.set_stance("force_eager"):
                        real = prefill(model, tokens, lengths, **chunked)
        _sync(device)
        prefill_seconds = time.perf_counter() - t0

        pos = (held + lengths).unsqueeze(1)
        cache.sampled(real)
        cache.bootstrap(model, real, pos)
        new_tokens, done = [real], torch.zeros(len(prompts), dtype=torch.bool, device=device)
        callback(real)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        positions = [held + len(p) for p in prompts]  # tokens each sequence's cache holds
        check_every = 1 if keep else STOP_CHECK_EVERY
        per_step_weights = weight_bytes(model)
        decode_bytes, steps = 0, 0
        t0 = time.perf_counter()
        for step in range(max_new_tokens - 1):
            done |= torch.isin(real[:, 0], stop)
            if (step % check_every == 0 and bool(done.all())) or not options.keep_going():
                break
            real = sample(cache.step(model, real, pos), **sampling)
            cache.sampled(real)
            positions = [n + 1 for n in positions]
            decode_bytes += per_step_weights + cache.step_bytes(positions)
            pos += 1
            steps += 1
            new_tokens.append(real)
            callback(real)
        _sync(device)
        # not the cache's finish: a disk tier removes its files there
        decode_seconds = time.perf_counter() - t0
    # Ctrl-C too: the cache still finishes (a disk tier's files go); the first error wins
    except BaseException:
        with contextlib.suppress(Exception):
            cache.finish()
        raise
    cache.finish(keep)
    return GenerationResult(
        cut_at_stop(torch.cat(new_tokens, dim=1).tolist(), stop_ids),
        lengths.tolist(),
        prefill_seconds,
        decode_seconds,
        steps,
        decode_bytes,
        cache.stats(steps),
    )


def cut_at_stop(sequences: list[list[int]], stop_ids: frozenset) -> list[list[int]]:
    cut = []
    for seq in sequences:
        end = next((i + 1 for i, t in enumerate(seq) if t in stop_ids), len(seq))
        cut.append(seq[:end])
    return cut
