"""SpeCache: speculative key-value caching (Jie et al., ICML 2025, arXiv 2503.16163), in one file.

The complete 16-bit KV cache lives in the big slow tier (host RAM); the small fast tier (VRAM, or
on a CPU the working set a step reads) keeps a 1- or 2-bit copy of every key and value, a 16-bit
window of the newest tokens, and a buffer of k fetched 16-bit pairs per layer and KV head. Every
decode step runs two tokens at once, the real one and a speculative guess of the next one; the
speculative row's attention decides which k pairs to fetch for the next step, and the fetch runs
while the rest of this step computes.

Algorithm (the paper's Appendix A; names as there):

  Prefill. Each layer attends over the prompt in full precision, then quantizes the prompt's
  keys and values into the low-bit copy (whole groups, all but the newest R tokens, which stay in
  the 16-bit residual window) and sends its 16-bit K, V to the slow tier, before the next layer
  runs.

  Bootstrap step. The first token T1, sampled from the prefill logits, attends over the low-bit
  copy and the window. Its attention weights give kappa_1, the top-k positions per layer and KV
  head, whose fetch starts at once; its logits give the first speculative token T'2. Its K, V are
  dropped (the next step computes them again).

  Decode step t. Rows [T_t, T'_{t+1}] attend in mixed precision: 16-bit pairs at the fetched
  positions kappa_t and in the window, the low-bit copy everywhere else (nothing is dropped). The
  real row does not see the speculative row's key. Per layer, the speculative row's weights give
  kappa_{t+1}, and its fetch starts as soon as the layer is done. The real row's K, V go to the
  slow tier and join the window (whose oldest group moves on to the low-bit copy once the window
  holds R + g tokens); the speculative row's are dropped. Row 0's logits give T_{t+1} (any sampler), row 1's give T'_{t+2} (greedy).
  A wrong guess is never rolled back: it only makes the next fetch less apt.

Choices the paper leaves open (ours), all configurable in `SpeCacheConfig`:
- Keys are quantized after RoPE. Scales and zeros are fp16 (bf16 when the model is bf16).
- The exact tiers (slow store, window, fetched buffer) hold 16-bit pairs: the model's dtype when it
  is 16-bit, fp16 when the model runs in fp32 (the fast dtype on a CPU), so a CPU run keeps the
  paper's memory budget; `pair_dtype=torch.float32` makes SpeCache with top-k at least the context
  length reproduce an fp32 full cache exactly.
- The window always holds the newest R tokens in 16 bits, plus up to g - 1 older ones waiting for
  a whole group: when it reaches R + g tokens, its oldest g are quantized together (keys need a
  whole group of tokens) and written to the slow tier. (KIVI's code instead quantizes its whole
  window when it reaches R, leaving 0..R-1 recent tokens in 16 bits; on SmolLM2 needle prompts
  that quantized most of the question and cost answers.) Positions in the window are 16-bit
  already, so kappa is drawn from the quantized positions, plus, in the step before a flush, the
  window group about to be quantized: kappa_{t+1} is chosen a step before it is used, and without
  them those g positions would spend that step low-bit and unfetched.
- With GQA, the weights are averaged over the query heads of a KV head before the top-k.
- The speculative token is the greedy choice of row 1, whatever sampler row 0 uses.
- Values are grouped over min(group, head_dim) channels.
- Batches are ragged: each sequence keeps its own lengths, window and kappa.
- On a CPU both tiers are the same RAM, so there is no transfer to hide: the fetch is a gather of
  k pairs inside the layer's compiled step, right after kappa_{t+1} is chosen, and the real row's
  16-bit pair is written to the slow tier there too. (A worker thread that gathered in the
  background, the paper's design for the host side, made a SmolLM2 step at 1k slower: 50 vs 39
  ms, the hand-off costing more than the 50 KB gather it hid.) The background fetch below, with
  `overlap_fetch`, is for a GPU, whose slow tier is pinned host memory.

Hybrid models (Gemma-3: five of every six layers see only a sliding window of the newest 512
positions): only the full-attention layers get SpeCache. A sliding-window layer keeps its window
as a ring of 16-bit pairs in the fast tier (`SpeCacheWindow`): it never looks further back, so
there is nothing to offload, and a ring the size of the window is smaller than a low-bit copy of a
long context. It follows SpeCache's two-row steps: both rows attend over the ring, only the real
row's pair is kept.

Variants: `speculative=False` is the paper's non-speculative baseline (each step scores the real
token against the low-bit copy, fetches its exact top-k synchronously, then attends again);
`topk=0` is KIVI alone (the low-bit copy and the window, nothing fetched).
"""
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernels import lowbit_cpu
from kernels.attention import LowBitKV, Segments, mixed_attention
from kernels.quant import quantize_keys, quantize_values, sixteen_bit_dtype, value_group
from model import CAUSAL_PROMPT, RingKVCache, Transformer, attention, sliding_window_attention


@dataclass(frozen=True)
class SpeCacheConfig:
    bits: int = 1  # low-bit copy: 1 or 2 bits per element
    group: int = 64  # g: tokens per key group (per channel), channels per value group (per token)
    residual: int = 64  # R: the newest R tokens stay 16-bit; a multiple of g
    topk: int = 64  # k: 16-bit pairs fetched per layer and KV head each step; 0 = KIVI alone
    speculative: bool = True  # False: the paper's non-speculative baseline
    stats: bool = False  # also measure recall@k of kappa (an extra scoring pass per layer)
    overlap_fetch: bool = True  # GPU: False waits for each fetch as soon as it starts (what overlap buys)
    pair_dtype: Optional[torch.dtype] = None  # the exact pairs' dtype; None: 16-bit (see above)

    def pair_dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.pair_dtype or sixteen_bit_dtype(model_dtype)

    def validate(self, head_dim: int) -> None:
        if self.bits not in (1, 2):
            raise ValueError(f"SpeCache bits must be 1 or 2, got {self.bits}")
        if self.group < 1 or self.residual < 1:
            raise ValueError(f"SpeCache group and residual must be positive, got {self.group} and {self.residual}")
        if self.residual % self.group:
            raise ValueError(f"the residual window ({self.residual}) must be a multiple of the group size "
                             f"({self.group}), so that groups of tokens leave the window whole")
        if self.topk < 0:
            raise ValueError(f"SpeCache top-k must be >= 0, got {self.topk}")
        if head_dim * self.bits % 8:
            raise ValueError(f"SpeCache packs each token's {self.bits}-bit codes into whole bytes, so head_dim x bits "
                             f"must be a multiple of 8; this model's head_dim is {head_dim}")
        if head_dim % value_group(self.group, head_dim):
            raise ValueError(f"head_dim {head_dim} is not a multiple of the value group size {self.group}")


class SpeCacheState:
    """What all layers share: per-sequence lengths, on the device (for the kernels) and on the host
    (for the decisions the Python loop makes, so it never waits on the device)."""

    def __init__(self, config: SpeCacheConfig, batch_size: int, capacity: int, device: torch.device):
        self.config, self.capacity = config, capacity
        self.quantized_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # Lq
        self.window_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # r
        self.selectable_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # kappa is drawn from [0, this)
        self.host_quantized_len = [0] * batch_size
        self.host_window_len = [0] * batch_size
        self.prefilling = True  # prefill: full-precision attention, then ingest the prompt
        self.append = True  # decode: keep the real row's K, V (not in the bootstrap step)

    def begin(self, lengths: list[int]) -> None:
        """Before prefill: sequence b will hold lengths[b] tokens; whole groups of all but the
        newest R are quantized (Lq), the rest (R to R + g - 1 tokens) stay in the window."""
        r, g = self.config.residual, self.config.group
        self.host_quantized_len = [max(0, n - r) // g * g for n in lengths]
        self.host_window_len = [n - lq for n, lq in zip(lengths, self.host_quantized_len)]
        self._sync()

    def _sync(self) -> None:
        self.quantized_len.copy_(torch.tensor(self.host_quantized_len))
        self.window_len.copy_(torch.tensor(self.host_window_len))
        self.selectable_len.copy_(torch.tensor(self.host_selectable_len()))

    def host_selectable_len(self) -> list[int]:
        """Lq, or Lq + g when the next kept row fills the window and its oldest group gets quantized."""
        full = self.config.residual + self.config.group
        return [lq + (self.config.group if r + 1 == full else 0)
                for lq, r in zip(self.host_quantized_len, self.host_window_len)]

    def sequences_to_flush(self) -> list[int]:
        return [b for b, r in enumerate(self.host_window_len) if r == self.config.residual + self.config.group]


class SlowTier:
    """The complete 16-bit K and V of one layer: pinned host memory beside a GPU, else plain RAM.

    (A memory-mapped file would slot in here for caches larger than RAM.)
    """

    def __init__(self, shape: tuple, dtype: torch.dtype, fast_device: torch.device):
        pin = fast_device.type == "cuda"
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream(fast_device) if pin else None

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store k, v (Hkv, N, D) of sequence b at positions [start, start + N). On a GPU the copy
        is asynchronous, ordered before any later fetch on the same stream."""
        if self.copy_stream is None:
            self.k[b, :, start: start + k.shape[1]] = k
            self.v[b, :, start: start + v.shape[1]] = v
            return
        # Copy out on the side stream, and keep the source alive until the copy is done.
        self.copy_stream.wait_stream(torch.cuda.current_stream(k.device))
        with torch.cuda.stream(self.copy_stream):
            self.k[b, :, start: start + k.shape[1]].copy_(k, non_blocking=True)
            self.v[b, :, start: start + v.shape[1]].copy_(v, non_blocking=True)
        k.record_stream(self.copy_stream)
        v.record_stream(self.copy_stream)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def gather_pairs(store: Tensor, positions: Tensor, out: Tensor) -> None:
    """out[b, h, i] = store[b, h, positions[b, h, i]]: the 16-bit pairs of kappa."""
    torch.gather(store, 2, positions.unsqueeze(-1).expand(*positions.shape, store.shape[-1]), out=out)


class PairFetcher:
    """Moves kappa's 16-bit pairs from the slow tier (pinned host memory) into the fast tier's
    fetched buffer on the GPU, in the background: `start` returns at once, `wait` returns when they
    have landed (for the compute stream).

    A worker thread waits for kappa (an event on the compute stream), copies it to the host, gathers
    the pairs from pinned memory into a pinned staging buffer, and copies them up on a side stream;
    `wait` makes the compute stream wait for that copy, so the host never blocks on the GPU.
    """

    def __init__(self, layer: "SpeCacheLayer", executor: ThreadPoolExecutor):
        self.layer, self.executor = layer, executor
        self.pending: Optional[Future] = None
        self.device = layer.fetched_k.device
        shape = layer.fetched_k.shape
        self.stream = torch.cuda.Stream(self.device)
        self.host_positions = torch.zeros(shape[:3], dtype=torch.long, pin_memory=True)
        self.staging_k = torch.zeros(shape, dtype=layer.fetched_k.dtype, pin_memory=True)
        self.staging_v = torch.zeros(shape, dtype=layer.fetched_v.dtype, pin_memory=True)
        self.landed = torch.cuda.Event()

    def start(self) -> None:
        """Fetch the pairs of the layer's new kappa (kappa_pos / kappa_valid)."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.pending = self.executor.submit(self._fetch, ready)

    def wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()  # re-raises here whatever went wrong in the worker
        torch.cuda.current_stream(self.device).wait_event(self.landed)

    def _fetch(self, ready: "torch.cuda.Event") -> None:
        layer = self.layer
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.host_positions.copy_(layer.kappa_pos, non_blocking=True)
            layer.fetched_pos.copy_(layer.kappa_pos, non_blocking=True)
            layer.fetched_valid.copy_(layer.kappa_valid, non_blocking=True)
            positions_copied = torch.cuda.Event()
            positions_copied.record(self.stream)
        # Waiting here blocks this worker only. The stream is in order, so the previous step's
        # upload from the staging buffers is also done once the positions have arrived.
        positions_copied.synchronize()
        gather_pairs(layer.slow.k, self.host_positions, self.staging_k)
        gather_pairs(layer.slow.v, self.host_positions, self.staging_v)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            layer.fetched_k.copy_(self.staging_k, non_blocking=True)
            layer.fetched_v.copy_(self.staging_v, non_blocking=True)
            self.landed.record(self.stream)


@torch.compiler.disable
def _fetch_synchronously(fetcher: PairFetcher) -> None:
    """The non-speculative baseline's fetch: outside any compiled graph, and waited for."""
    fetcher.start()
    fetcher.wait()


def select_top_k(weights: Tensor, selectable_len: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """kappa: the k positions below selectable_len (B,) with the most attention weight (B, Hkv, T),
    per sequence and KV head, and which of them are real (a short sequence has fewer than k)."""
    selectable_len = selectable_len[:, None, None]
    candidates = torch.arange(weights.shape[-1], device=weights.device) < selectable_len
    positions = weights.masked_fill(~candidates, -1.0).topk(k, dim=-1).indices
    return positions, positions < selectable_len


class SpeCacheLayer(nn.Module):
    """One layer's SpeCache, plugged in as `Attention.kv_cache` (see model.py)."""

    def __init__(self, state: SpeCacheState, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, executor: Optional[ThreadPoolExecutor]):
        """`dtype`: the exact pairs' dtype (window, fetched buffer, slow tier)."""
        super().__init__()
        c, b, t = state.config, state.quantized_len.shape[0], state.capacity
        self.state, self.config = state, c
        scale_dtype = sixteen_bit_dtype(dtype)
        code_bytes = head_dim * c.bits // 8
        n_value_groups = head_dim // value_group(c.group, head_dim)
        k = min(c.topk, t)

        def fast(name, *shape, dtype=dtype):
            self.register_buffer(name, torch.zeros(*shape, dtype=dtype, device=device), persistent=False)

        # Fast tier: the low-bit copy of every position...
        fast("k_packed", b, n_kv_heads, t, code_bytes, dtype=torch.uint8)
        fast("k_scale", b, n_kv_heads, t // c.group, head_dim, dtype=scale_dtype)
        fast("k_zero", b, n_kv_heads, t // c.group, head_dim, dtype=scale_dtype)
        fast("v_packed", b, n_kv_heads, t, code_bytes, dtype=torch.uint8)
        fast("v_scale", b, n_kv_heads, t, n_value_groups, dtype=scale_dtype)
        fast("v_zero", b, n_kv_heads, t, n_value_groups, dtype=scale_dtype)
        # ... the 16-bit residual window: the newest R tokens and up to g more waiting for a group ...
        fast("window_k", b, n_kv_heads, c.residual + c.group, head_dim)
        fast("window_v", b, n_kv_heads, c.residual + c.group, head_dim)
        # ... and the fetched 16-bit pairs of kappa_t, with kappa_{t+1} as this step chooses it.
        fast("fetched_k", b, n_kv_heads, k, head_dim)
        fast("fetched_v", b, n_kv_heads, k, head_dim)
        fast("fetched_pos", b, n_kv_heads, k, dtype=torch.long)
        fast("fetched_valid", b, n_kv_heads, k, dtype=torch.bool)
        fast("kappa_pos", b, n_kv_heads, k, dtype=torch.long)
        fast("kappa_valid", b, n_kv_heads, k, dtype=torch.bool)
        fast("recall", 2, dtype=torch.long)  # [hits, pairs] of kappa_t against the real row's own top-k
        # Slow tier: the complete 16-bit cache. Beside a GPU it is host memory, fetched from in the
        # background; on a CPU it is the same RAM, gathered from inside the step (no fetcher).
        self.slow = SlowTier((b, n_kv_heads, t, head_dim), dtype, device)
        self.fetcher = PairFetcher(self, executor) if device.type == "cuda" else None

    # --- the low-bit copy ------------------------------------------------------------------

    def lowbit(self) -> LowBitKV:
        return LowBitKV(self.k_packed, self.k_scale, self.k_zero, self.v_packed, self.v_scale, self.v_zero,
                        self.config.bits, self.config.group)

    def _quantize_into(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Quantize k, v (Hkv, N, D) of sequence b (N a multiple of g) into positions [start, start + N)."""
        c, n = self.config, k.shape[1]
        packed, scale, zero = quantize_keys(k, c.bits, c.group, self.k_scale.dtype)
        self.k_packed[b, :, start: start + n] = packed
        self.k_scale[b, :, start // c.group: (start + n) // c.group] = scale
        self.k_zero[b, :, start // c.group: (start + n) // c.group] = zero
        packed, scale, zero = quantize_values(v, c.bits, c.group, self.v_scale.dtype)
        self.v_packed[b, :, start: start + n] = packed
        self.v_scale[b, :, start: start + n] = scale
        self.v_zero[b, :, start: start + n] = zero

    def ingest_prompt(self, k: Tensor, v: Tensor) -> None:
        """After prefill attention: quantize each prompt but its newest tokens, keep those in the
        window, and send all of its 16-bit K, V to the slow tier."""
        for b, (lq, r) in enumerate(zip(self.state.host_quantized_len, self.state.host_window_len)):
            self._quantize_into(b, 0, k[b, :, :lq], v[b, :, :lq])
            self.window_k[b, :, :r] = k[b, :, lq: lq + r]
            self.window_v[b, :, :r] = v[b, :, lq: lq + r]
            self.slow.write(b, 0, k[b, :, : lq + r], v[b, :, : lq + r])

    def store_new_pairs(self) -> None:
        """GPU, after a step that kept the real row: send its 16-bit pair (the window's newest slot)
        to the slow tier in host memory, outside the compiled graph."""
        for b, (lq, r) in enumerate(zip(self.state.host_quantized_len, self.state.host_window_len)):
            self.slow.write(b, lq + r, self.window_k[b, :, r: r + 1].clone(), self.window_v[b, :, r: r + 1].clone())

    def gather_kappa(self) -> None:
        """Fetch kappa's pairs from the slow tier now, in the step (the CPU path)."""
        gather_pairs(self.slow.k, self.kappa_pos, self.fetched_k)
        gather_pairs(self.slow.v, self.kappa_pos, self.fetched_v)
        self.fetched_pos.copy_(self.kappa_pos)
        self.fetched_valid.copy_(self.kappa_valid)

    def flush_window(self, b: int) -> None:
        """Sequence b's window holds R + g tokens: quantize the oldest g (their 16-bit pairs are in
        the slow tier already) and slide the window down by g."""
        start, g = self.state.host_quantized_len[b], self.config.group
        self._quantize_into(b, start, self.window_k[b, :, :g], self.window_v[b, :, :g])
        self.window_k[b, :, :-g] = self.window_k[b, :, g:].clone()
        self.window_v[b, :, :-g] = self.window_v[b, :, g:].clone()

    # --- attention -------------------------------------------------------------------------

    def select_kappa(self, weights: Tensor, selectable_len: Tensor) -> tuple[Tensor, Tensor]:
        return select_top_k(weights, selectable_len, self.kappa_pos.shape[-1])

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask) -> Tensor:
        state = self.state
        if state.prefilling:
            y = attention(q, k, v, CAUSAL_PROMPT)
            self.ingest_prompt(k, v)
            return y
        segments = Segments(state.quantized_len, self.fetched_k, self.fetched_v, self.fetched_pos,
                            self.fetched_valid, self.window_k, self.window_v, state.window_len, k, v)
        nothing_fetched = segments._replace(fetched_valid=torch.zeros_like(self.fetched_valid))
        if self.config.topk == 0:  # KIVI alone
            y, _ = mixed_attention(q, self.lowbit(), segments)
        elif not self.config.speculative:
            # The non-speculative baseline: score the real row against the low-bit copy, fetch its
            # exact top-k, wait for it, and attend again.
            _, weights = mixed_attention(q, self.lowbit(), nothing_fetched)
            kappa_pos, kappa_valid = self.select_kappa(weights, state.quantized_len)
            self.kappa_pos.copy_(kappa_pos)
            self.kappa_valid.copy_(kappa_valid)
            if self.fetcher is None:
                self.gather_kappa()
            else:
                _fetch_synchronously(self.fetcher)
            y, _ = mixed_attention(q, self.lowbit(), segments)
        else:
            # Mixed precision with kappa_t; the last row (the speculative one, or T1 in the
            # bootstrap step) chooses kappa_{t+1}, which the decode loop starts fetching.
            y, weights = mixed_attention(q, self.lowbit(), segments)
            kappa_pos, kappa_valid = self.select_kappa(weights, state.selectable_len)
            self.kappa_pos.copy_(kappa_pos)
            self.kappa_valid.copy_(kappa_valid)
            if self.config.stats and state.append:
                self._count_recall(q, nothing_fetched)
            if self.fetcher is None:  # kappa_{t+1}'s pairs, for the next step (a GPU starts a fetch instead)
                self.gather_kappa()
        if state.append:  # the real row's K, V join the window; the speculative row's are dropped
            batch = torch.arange(k.shape[0], device=k.device)
            new_k, new_v = k[:, :, 0].to(self.window_k.dtype), v[:, :, 0].to(self.window_v.dtype)
            self.window_k[batch, :, state.window_len] = new_k
            self.window_v[batch, :, state.window_len] = new_v
            if self.fetcher is None:  # and to the slow tier (a GPU copies it out after the layer)
                self.slow.k[batch, :, state.quantized_len + state.window_len] = new_k
                self.slow.v[batch, :, state.quantized_len + state.window_len] = new_v
        return y

    def _count_recall(self, q: Tensor, nothing_fetched: Segments) -> None:
        """How many of kappa_t the real row's own low-bit top-k would also have picked."""
        _, weights = mixed_attention(q[:, :, :1], self.lowbit(), nothing_fetched._replace(
            new_k=nothing_fetched.new_k[:, :, :1], new_v=nothing_fetched.new_v[:, :, :1]))
        own, own_valid = self.select_kappa(weights, self.state.quantized_len)
        hit = (self.fetched_pos.unsqueeze(-1) == own.unsqueeze(-2)) & own_valid.unsqueeze(-2)
        hits = (hit.any(-1) & self.fetched_valid).sum()
        self.recall.add_(torch.stack([hits, self.fetched_valid.sum()]))

    # --- accounting ------------------------------------------------------------------------

    def fast_tier_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.named_buffers() if name != "recall")


class SpeCacheWindow(RingKVCache):
    """A sliding-window layer under SpeCache: its ring of 16-bit pairs, all in the fast tier."""

    fetcher = None  # nothing to fetch: run_layers treats it as a CPU layer

    def __init__(self, state: SpeCacheState, window: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(state.quantized_len.shape[0], window, n_kv_heads, head_dim, dtype, device)
        self.state = state

    def ingest_prompt(self, k: Tensor, v: Tensor, lengths: Optional[Tensor] = None) -> None:
        if lengths is None:
            lengths = self.state.quantized_len + self.state.window_len
        super().ingest_prompt(k, v, lengths)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask) -> Tensor:
        if self.state.prefilling:
            y = sliding_window_attention(q, k, v, self.window)
            self.ingest_prompt(k, v)
            return y
        y = self.attend(q, k, v, input_pos)
        if self.state.append:  # the real row only; the speculative row's pair is dropped
            self.write(k[:, :, :1], v[:, :, :1], input_pos[:, :1])
        return y


def setup_specache(model: Transformer, batch_size: int, max_seq_length: int, config: SpeCacheConfig) -> SpeCacheState:
    """Replace every full-attention layer's cache with a SpeCache holding `max_seq_length` positions
    per sequence (rounded up to a whole group), and every sliding-window layer's with a ring of its
    window. A top-k above that capacity is clamped to it."""
    c = model.config
    config.validate(c.head_dim)
    if all(layer.attention.window is not None for layer in model.layers):
        raise ValueError("every layer of this model attends over a sliding window only, which stays in the fast "
                         "tier whole: SpeCache has nothing to offload; use the full cache")
    capacity = -(-max_seq_length // config.group) * config.group
    device, dtype = model.tok_embeddings.weight.device, config.pair_dtype_for(model.tok_embeddings.weight.dtype)
    state = SpeCacheState(config, batch_size, capacity, device)
    if device.type == "cpu":
        lowbit_cpu.available()  # builds the C kernel now (once per machine), not while torch.compile traces
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specache-fetch") if device.type == "cuda" else None
    for layer in model.layers:
        window = layer.attention.window
        layer.attention.kv_cache = (
            SpeCacheLayer(state, c.n_local_heads, c.head_dim, dtype, device, executor) if window is None
            else SpeCacheWindow(state, window, c.n_local_heads, c.head_dim, dtype, device))
    model.setup_rope(capacity + 1)  # the speculative row can sit one past the last real position
    model.max_batch_size, model.max_seq_length = batch_size, capacity
    return state


def specache_layers(model: Transformer) -> list[SpeCacheLayer]:
    """The SpeCache layers (the full-attention ones; sliding-window layers keep a ring)."""
    return [layer.attention.kv_cache for layer in model.layers if isinstance(layer.attention.kv_cache, SpeCacheLayer)]


def window_layers(model: Transformer) -> list[SpeCacheWindow]:
    return [layer.attention.kv_cache for layer in model.layers if isinstance(layer.attention.kv_cache, SpeCacheWindow)]


@torch.no_grad()
def run_layers(model: Transformer, tokens: Tensor, input_pos: Tensor, start_fetches: bool) -> Tensor:
    """One forward pass of the new rows through every layer, with the fetch hand-offs between layers."""
    x = model.embed(tokens)
    state = specache_layers(model)[0].state
    for layer, freqs_cis in zip(model.layers, model.rope(input_pos)):
        cache = layer.attention.kv_cache
        if cache.fetcher is None:  # a CPU: the layer fetches and stores within its step
            x = layer(x, input_pos, freqs_cis, None)
            continue
        cache.fetcher.wait()  # kappa_t's pairs have landed in this layer's fast tier
        x = layer(x, input_pos, freqs_cis, None)
        if state.append:
            cache.store_new_pairs()  # the real row's 16-bit pair goes to the slow tier
        if start_fetches:
            cache.fetcher.start()  # kappa_{t+1}'s pairs move while the later layers compute
            if not state.config.overlap_fetch:
                cache.fetcher.wait()
    return model.head(x)


def advance(model: Transformer, state: SpeCacheState) -> None:
    """After a step that kept the real rows: count them into the windows, and flush full windows."""
    selectable = state.host_selectable_len()
    state.window_len += 1
    state.host_window_len = [r + 1 for r in state.host_window_len]
    full = state.sequences_to_flush()
    for b in full:
        for cache in specache_layers(model):
            cache.flush_window(b)
        state.host_quantized_len[b] += state.config.group
        state.host_window_len[b] -= state.config.group
    if full or state.host_selectable_len() != selectable:
        state._sync()


def greedy_guess(logits: Tensor) -> Tensor:
    """The paper's speculative token: the greedy choice of the speculative row."""
    return logits.argmax(-1, keepdim=True)


def wait_for_fetches(model: Transformer) -> None:
    for cache in specache_layers(model):
        if cache.fetcher is not None:
            cache.fetcher.wait()


@torch.no_grad()
def specache_generate(model: Transformer, state: SpeCacheState, prompts: list[list[int]], max_new_tokens: int, *,
                      stop_ids: frozenset = frozenset(), temperature: float = 0.0, top_k: Optional[int] = None,
                      callback: Callable[[Tensor], None] = lambda tokens: None,
                      guess_next: Callable[[Tensor], Tensor] = greedy_guess,
                      first_token: Optional[Tensor] = None) -> "GenerationResult":
    """generate.generate with SpeCache: prefill, the bootstrap step, then two-row decode steps.

    Prefill and the bootstrap step run eagerly (once per generation; prefill quantizes each prompt
    in Python); decode steps run whatever `compile_decode` compiled. `guess_next` turns the last
    row's logits (B, V) into the next speculative token (B, 1): the seam for better guesses.
    With `first_token` (B, 1), prefill has happened elsewhere (a prefill shared by several caches,
    see scripts/harness.py: `state.begin`, then each layer's `ingest_prompt`) and decoding starts
    from it.
    """
    from generate import GenerationResult, cut_at_stop, pad_prompts, prefill, sample, weight_bytes

    config, device = state.config, state.quantized_len.device
    lengths = [len(p) for p in prompts]
    if max(lengths) + max_new_tokens > state.capacity:
        raise ValueError(f"{max(lengths)} prompt + {max_new_tokens} new tokens exceed the SpeCache capacity "
                         f"{state.capacity}; set it up with a larger max_seq_length")
    sampling = dict(temperature=temperature, top_k=top_k)
    tokens, prompt_lengths = pad_prompts(prompts, device)
    pos = prompt_lengths.unsqueeze(1).clone()

    # Prefill: full precision, then each layer's K, V go low-bit + window, and to the slow tier.
    t0 = time.perf_counter()
    if first_token is None:
        state.begin(lengths)
        state.prefilling = True
        with torch.compiler.set_stance("force_eager"):
            real = prefill(model, tokens, prompt_lengths, **sampling)
    else:
        real = first_token
    state.prefilling = False
    _sync(device)
    prefill_seconds = time.perf_counter() - t0

    speculate = config.speculative and config.topk > 0
    if speculate:  # the bootstrap step: T1 picks kappa_1 and guesses T'2; its K, V are dropped
        state.append = False
        with torch.compiler.set_stance("force_eager"):
            guess = guess_next(run_layers(model, real, pos, start_fetches=True)[:, -1])
        state.append = True

    new_tokens, done = [real], torch.zeros(len(prompts), dtype=torch.bool, device=device)
    callback(real)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    matches, steps, decode_bytes = 0, 0, 0
    per_step_weights = weight_bytes(model)
    t0 = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        done |= torch.isin(real[:, 0], stop)
        if bool(done.all()):
            break
        if speculate:  # a decode step: [T_t, T'_{t+1}] at [p, p + 1]
            logits = run_layers(model, torch.cat([real, guess], 1), torch.cat([pos, pos + 1], 1), start_fetches=True)
            real, guess_was = sample(logits[:, :1], **sampling), guess
            guess = guess_next(logits[:, 1])
            matches += int((guess_was == real).sum())
        else:
            real = sample(run_layers(model, real, pos, start_fetches=False), **sampling)
        decode_bytes += step_bytes(model, state) + per_step_weights
        advance(model, state)
        pos += 1
        steps += 1
        new_tokens.append(real)
        callback(real)
    wait_for_fetches(model)
    _sync(device)
    decode_seconds = time.perf_counter() - t0
    result = GenerationResult(cut_at_stop(torch.cat(new_tokens, 1).tolist(), stop_ids), lengths,
                              prefill_seconds, decode_seconds, steps, decode_bytes)
    result.stats = cache_stats(model, state, matches / max(1, steps * len(prompts)) if speculate else None)
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_bytes(model: Transformer, state: SpeCacheState) -> int:
    """KV bytes one decode step reads: the low-bit copy up to each sequence's Lq, the window and
    the fetched pairs (the slow tier is read only by the k-pair gathers, counted apart), and the
    rings of sliding-window layers."""
    cache = specache_layers(model)[0]
    per_position = sum(t[0, 0, 0].numel() * t.element_size() for t in (cache.k_packed, cache.v_packed, cache.v_scale,
                                                                          cache.v_zero))
    per_position += 2 * cache.k_scale[0, 0, 0].numel() * cache.k_scale.element_size() / state.config.group
    pairs = cache.window_k.shape[2] + cache.fetched_k.shape[2]
    per_pair = 2 * cache.window_k[0, 0, 0].numel() * cache.window_k.element_size()
    heads = cache.k_packed.shape[1] * len(specache_layers(model))
    rings = sum(ring.k_cache[0].nbytes + ring.v_cache[0].nbytes for ring in window_layers(model))
    lowbit = heads * sum(lq * per_position + pairs * per_pair for lq in state.host_quantized_len)
    return int(lowbit + rings * len(state.host_quantized_len))


def sixteen_bit_cache_bytes(model: Transformer, capacity: int, batch: int = 1, windows: bool = True) -> int:
    """Bytes of 16-bit K and V caches for `batch` sequences of `capacity` positions: what the
    fast-tier ratios compare with. Sliding-window layers hold their window only (as the full cache
    here does), or with `windows=False` the whole capacity (as a cache that ignores them would)."""
    c = model.config
    per_position = 2 * 2 * c.n_local_heads * c.head_dim
    held = [capacity if w is None or not windows else w for w in map(c.window, range(c.n_layer))]
    return batch * per_position * sum(held)


def cache_stats(model: Transformer, state: SpeCacheState, speculative_match_rate: Optional[float]) -> dict:
    """Tier sizes, the ratio to a 16-bit cache of the same length, fetch volume, speculation quality."""
    caches, rings = specache_layers(model), window_layers(model)
    c, cfg = model.config, state.config
    fast_global = sum(cache.fast_tier_bytes() for cache in caches)
    fast_rings = sum(ring.fast_tier_bytes() for ring in rings)
    fast = fast_global + fast_rings
    slow = sum(cache.slow.nbytes() for cache in caches)
    batch = state.quantized_len.shape[0]
    full_16bit = sixteen_bit_cache_bytes(model, state.capacity, batch)
    pair_bytes = 2 * c.head_dim * caches[0].fetched_k.element_size()
    stats = {
        "cache": "specache" if cfg.topk and cfg.speculative else ("specache-nospec" if cfg.topk else "kivi"),
        "bits": cfg.bits, "group": cfg.group, "residual": cfg.residual, "topk": caches[0].fetched_k.shape[2],
        "capacity_tokens": state.capacity,
        "fast_tier_bytes": fast,
        "slow_tier_bytes": slow,
        "fast_tier_ratio_to_16bit_cache": fast / full_16bit,
        "bytes_fetched_per_token": pair_bytes * caches[0].fetched_k.shape[2] * c.n_local_heads * len(caches),
        "speculative_match_rate": speculative_match_rate,
    }
    if rings:  # a hybrid model: each layer type's fast tier against its own 16-bit cache
        global_16bit = 2 * 2 * c.n_local_heads * c.head_dim * state.capacity * batch * len(caches)
        stats.update({
            "full_attention_layers": len(caches), "sliding_window_layers": len(rings),
            "fast_tier_bytes_full_attention_layers": fast_global,
            "fast_tier_bytes_sliding_window_layers": fast_rings,
            "fast_tier_ratio_full_attention_layers": fast_global / global_16bit,
            "fast_tier_ratio_sliding_window_layers": fast_rings / (full_16bit - global_16bit),
            "fast_tier_ratio_to_16bit_cache_without_windows": fast / sixteen_bit_cache_bytes(
                model, state.capacity, batch, windows=False),
        })
    if cfg.stats:
        hits, pairs = (sum(int(cache.recall[i]) for cache in caches) for i in range(2))
        stats["recall_at_k"] = hits / pairs if pairs else None
    return stats
