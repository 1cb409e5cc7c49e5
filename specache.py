"""SpeCache: speculative key-value caching (Jie et al., ICML 2025, arXiv 2503.16163), in one file.

The complete 16-bit KV cache lives in the big slow tier (host RAM); the small fast tier (VRAM, or
on a CPU the working set a step reads) keeps a 1- or 2-bit copy of every key and value, a 16-bit
window of the newest tokens, and a buffer of k fetched 16-bit pairs per layer and KV head. Every
decode step runs two tokens at once, the real one and a speculative guess of the next one; the
speculative row's attention decides which pairs to fetch for the next step, and the fetch runs
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
  holds R + g tokens); the speculative row's are dropped. Row 0's logits give T_{t+1} (any
  sampler), row 1's give T'_{t+2}. A wrong guess is never rolled back: it only makes the next
  fetch less apt.

Choosing kappa: the paper's rule and ours. With a 1-bit copy the paper's rule loses most
needle retrievals on the models measured here (docs/RESULTS.md): a speculative row that attends
with pairs chosen for another query guesses badly, its choice for the next step is then worse, and
the real row pays. Each change below is a `SpeCacheConfig` field and a name in `--specache_select`
(`PAPER` is the paper's rule; `DEFAULT_SELECT` is ours, chosen from the ablation):
- split=share: that share of the k pairs is chosen within the step by the real row's own low-bit
  scores (the low-bit pass runs first; those positions are then read in 16 bits from the slow tier
  and their low-bit share is taken back out, `kernels.attention.drop_from_lowbit`); the rest is
  the speculative row's prefetch. On a GPU that part of the fetch is waited for.
- gqa-max: a KV head ranks positions by the largest weight any of its query heads gives them,
  not the mean (under the mean, one retrieval head's peak is divided by the group size).
- correct=tau: per KV head, when the real row's query and the speculative query that chose the
  prefetch are less alike than tau (mean cosine over its query heads), the prefetch is discarded
  and all k are chosen by the real row (FreeKV's correction).
- sinks=n: the first n positions are always exact, held in the fast tier beside the fetched pairs.
- lloyd: a 1-bit group's two levels are the means of its values below and above the midpoint.
- lookup: the speculative token is copied from the context where the last tokens occurred before
  (prompt lookup), else the speculative row's greedy choice.
- reuse: positions that the previous prefetch held are not read from the slow tier again.
- oracle (diagnostics, not a method): all k chosen with the real row's exact scores, read from
  the whole slow tier: `oracle=error` (the default) takes the positions where the low-bit copy's
  attention weight is furthest from the exact one, `oracle=mass` those of the largest exact weight.
  At 1 bit the mass oracle misses answers the error oracle finds: positions the copy over-weights
  must be read exactly too, or they pull the attention off the answer.

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
  window group about to be quantized: kappa_{t+1} is chosen a step before it is used.
- A fetched pair counts only while its position is quantized (below Lq); every per-generation
  buffer is reset when a generation's prompt comes in.
- Values are grouped over min(group, head_dim) channels. Batches are ragged: each sequence keeps
  its own lengths, window and kappa.
- On a CPU both tiers are the same RAM, so there is no transfer to hide: the fetch is a gather of
  the pairs inside the layer's compiled step, and the real row's 16-bit pair is written to the slow
  tier there too (offload.py has the GPU's background and synchronous fetches).

Hybrid models (Gemma-3: five of every six layers see only a sliding window of the newest 512
positions): only the full-attention layers get SpeCache. A sliding-window layer keeps its window
as a ring of 16-bit pairs in the fast tier (`SpeCacheWindow`): it never looks further back, so
there is nothing to offload. It follows SpeCache's two-row steps: both rows attend over the ring,
only the real row's pair is kept.

Variants: `speculative=False` is the paper's non-speculative baseline (each step's k pairs are
chosen by the real row's own low-bit scores and fetched synchronously); `topk=0` is KIVI alone (the
low-bit copy and the window, nothing fetched).
"""
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernels import lowbit_cpu
from kernels.attention import (LowBitKV, Segments, drop_from_lowbit, lowbit_part, merge_softmax, merged_output,
                               positions_mask, query_rows, row_position_weights)
from kernels.quant import LEVELS, quantize_keys, quantize_values, sixteen_bit_dtype, value_group
from model import CAUSAL_PROMPT, RingKVCache, Transformer, attention, sliding_window_attention
from offload import PairFetcher, SlowTier, copy_keys_to, fetch_now, gather_pairs

# --- configuration ---------------------------------------------------------------------------

PAPER = dict(real_share=0.0, gqa="mean", correct_below=None, sinks=0, levels="minmax", guess="greedy", reuse=False,
             oracle=None)
# name: (field, its value when the name comes without "=value", the value's type; None: takes no value)
VARIANTS = {
    "split": ("real_share", 0.5, float),
    "gqa-max": ("gqa", "max", None),
    "correct": ("correct_below", 0.9, float),
    "sinks": ("sinks", 4, int),
    "lloyd": ("levels", "lloyd", None),
    "lookup": ("guess", "lookup", None),
    "reuse": ("reuse", True, None),
    "oracle": ("oracle", "error", str),
}
DEFAULT_SELECT = "split,gqa-max,sinks,lloyd,lookup,reuse"


def parse_select(select: str) -> dict:
    """The selection fields of `select`: "paper", "default" (ours), or a comma-separated list of
    changes to the paper's rule (names of VARIANTS; "split=0.25" or "sinks=8" set a value)."""
    fields = dict(PAPER)
    for item in filter(None, (part.strip() for part in select.split(","))):
        name, _, value = item.partition("=")
        if name in ("paper", "default"):
            if value:
                raise ValueError(f"--specache_select: {name} takes no value")
            fields.update(parse_select(DEFAULT_SELECT) if name == "default" else {})
            continue
        if name not in VARIANTS:
            raise ValueError(f"unknown --specache_select entry {name!r}: use paper, default or some of "
                             f"{', '.join(VARIANTS)}")
        field, default, parser = VARIANTS[name]
        if value and parser is None:
            raise ValueError(f"--specache_select: {name} takes no value")
        try:
            fields[field] = parser(value) if value else default
        except ValueError:
            raise ValueError(f"--specache_select: {name}={value} is not a valid {parser.__name__}") from None
    return fields


@dataclass(frozen=True)
class SpeCacheConfig:
    bits: int = 1  # low-bit copy: 1 or 2 bits per element
    group: int = 64  # g: tokens per key group (per channel), channels per value group (per token)
    residual: int = 64  # R: the newest R tokens stay 16-bit; a multiple of g
    topk: int = 64  # k: 16-bit pairs fetched per layer and KV head each step; 0 = KIVI alone
    speculative: bool = True  # False: the paper's non-speculative baseline
    # How kappa is chosen (see the module docstring; PAPER is the paper's rule)
    real_share: float = 0.5  # split: the share of the k pairs that the real row chooses within the step
    gqa: str = "max"  # how a KV head ranks positions over its query heads: "mean" or "max"
    correct_below: Optional[float] = None  # correct: discard a KV head's prefetch below this query cosine
    sinks: int = 4  # the first positions, always exact
    levels: str = "lloyd"  # 1-bit levels: "minmax" (the paper's) or "lloyd"
    guess: str = "lookup"  # the speculative token: "greedy" (the paper's) or "lookup"
    reuse: bool = True  # do not read again what the previous prefetch held
    oracle: Optional[str] = None  # diagnostics: "error" or "mass", chosen with exact scores from the slow tier
    stats: bool = False  # also measure recall and exact-mass coverage (extra scoring passes per layer)
    overlap_fetch: bool = True  # GPU: False waits for each fetch as soon as it starts (what overlap buys)
    pair_dtype: Optional[torch.dtype] = None  # the exact pairs' dtype; None: 16-bit (see above)

    def with_select(self, select: str) -> "SpeCacheConfig":
        return replace(self, **parse_select(select))

    def select_name(self) -> str:
        """The selection as --specache_select would name it."""
        names = []
        for name, (field, default, parser) in VARIANTS.items():
            value = getattr(self, field)
            if value != PAPER[field]:
                names.append(name if parser is None else f"{name}={value}")
        return ",".join(names) or "paper"

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
        if not 0 <= self.real_share <= 1:
            raise ValueError(f"split: the real row's share of k must be in [0, 1], got {self.real_share}")
        if self.gqa not in ("mean", "max") or self.levels not in LEVELS or self.guess not in ("greedy", "lookup"):
            raise ValueError(f"unknown selection setting: gqa={self.gqa!r}, levels={self.levels!r}, "
                             f"guess={self.guess!r}")
        if self.oracle not in (None, "error", "mass"):
            raise ValueError(f"oracle must be error or mass, got {self.oracle!r}")
        if self.correct_below is not None and not -1 <= self.correct_below <= 1:
            raise ValueError(f"correct: the threshold is a cosine in [-1, 1], got {self.correct_below}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
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
        self.prefilling, self.append = True, True
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


# --- selection -------------------------------------------------------------------------------

def over_query_heads(weights: Tensor, how: str) -> Tensor:
    """A KV head's ranking of positions from its query heads' weights (B, Hkv, G, T): mean or max."""
    return weights.amax(2) if how == "max" else weights.mean(2)


def select_top_k(scores: Tensor, candidates: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k candidate positions (candidates: (B, Hkv, T) bool) with the highest scores (B, Hkv, T,
    non-negative), best first, and which of them are real (a short sequence has fewer than k)."""
    top = scores.masked_fill(~candidates, -1.0).topk(k, dim=-1)
    return top.indices, top.values >= 0


def queries_disagree(q: Tensor, previous: Tensor, n_kv_heads: int, threshold: float) -> Tensor:
    """(B, Hkv) bool: KV heads whose real query rows q (B, H, D) and the queries that chose their
    prefetch (B, H, D) have a mean cosine (over the KV head's query heads) below `threshold`."""
    cosine = torch.nn.functional.cosine_similarity(q.float(), previous.float(), dim=-1)  # (B, H)
    return cosine.unflatten(1, (n_kv_heads, -1)).mean(-1) < threshold


# What `SpeCacheLayer.diagnose` sums per KV head over the real rows of decode steps
DIAGNOSTICS = ("own_hits", "own_total", "exact_hits", "exact_total", "coverage", "oracle_coverage", "rows")


# --- one layer -------------------------------------------------------------------------------

class SpeCacheLayer(nn.Module):
    """One layer's SpeCache, plugged in as `Attention.kv_cache` (see model.py).

    The exact pairs the step reads besides the window sit in one buffer of slots per KV head:
    [sinks | the speculative prefetch (k_spec) | the real row's picks (k_real)], k_spec + k_real = k.
    """

    def __init__(self, state: SpeCacheState, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, executor: Optional[ThreadPoolExecutor]):
        """`dtype`: the exact pairs' dtype (window, fetched buffer, slow tier)."""
        super().__init__()
        c, b, t = state.config, state.quantized_len.shape[0], state.capacity
        self.state, self.config = state, c
        scale_dtype = sixteen_bit_dtype(dtype)
        code_bytes = head_dim * c.bits // 8
        n_value_groups = head_dim // value_group(c.group, head_dim)
        k = min(c.topk, t)
        self.k_real = k if not c.speculative or c.oracle else int(k * c.real_share + 0.5)
        self.k_spec, self.n_sinks = k - self.k_real, min(c.sinks, t)
        self.correcting = c.correct_below is not None and self.k_spec > 0
        # the real row picks all k on a head whose prefetch it discards, else k_real
        self.picks = k if self.correcting else self.k_real
        slots = self.n_sinks + k
        self.spec_slots = slice(self.n_sinks, self.n_sinks + self.k_spec)
        self.real_slots = slice(self.n_sinks + self.k_spec, slots)

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
        # ... and the exact pairs in slots: sinks, kappa_t's prefetch, the real row's picks.
        fast("fetched_k", b, n_kv_heads, slots, head_dim)
        fast("fetched_v", b, n_kv_heads, slots, head_dim)
        fast("fetched_pos", b, n_kv_heads, slots, dtype=torch.long)
        fast("fetched_valid", b, n_kv_heads, slots, dtype=torch.bool)
        fast("kappa_pos", b, n_kv_heads, self.k_spec, dtype=torch.long)  # kappa_{t+1}, as this step chooses it
        fast("kappa_valid", b, n_kv_heads, self.k_spec, dtype=torch.bool)
        if self.correcting:  # the last row's queries, which chose the prefetch the next step reads
            fast("last_query", b, n_heads, head_dim, dtype=torch.float32)
        # [pairs read from the slow tier, KV heads whose prefetch was discarded, KV heads checked]
        fast("counts", 3, dtype=torch.long)
        if c.stats:  # per KV head, summed: see `diagnose`
            fast("diagnostics", len(DIAGNOSTICS), n_kv_heads, dtype=torch.float64)
        self.fetched_pos[:, :, : self.n_sinks] = torch.arange(self.n_sinks, device=device)
        self.fetched_valid[:, :, : self.n_sinks] = True  # counted while quantized (below Lq)
        # Slow tier: the complete 16-bit cache (offload.py); beside a GPU it is host memory.
        self.slow = SlowTier((b, n_kv_heads, t, head_dim), dtype, device)
        self.on_gpu = device.type == "cuda"
        self.fetcher = self.staging = None
        if self.on_gpu and self.k_spec:
            spec = self.spec_slots
            self.fetcher = PairFetcher(self.slow, self.fetched_k[:, :, spec], self.fetched_v[:, :, spec],
                                       self.fetched_pos[:, :, spec], self.fetched_valid[:, :, spec], self.kappa_pos,
                                       self.kappa_valid, executor, c.reuse)
        if self.on_gpu and self.picks:
            self.staging = [torch.zeros(b, n_kv_heads, self.picks, head_dim, dtype=dtype, pin_memory=True)
                            for _ in range(2)]

    # --- the low-bit copy and the tiers ------------------------------------------------------

    def lowbit(self) -> LowBitKV:
        return LowBitKV(self.k_packed, self.k_scale, self.k_zero, self.v_packed, self.v_scale, self.v_zero,
                        self.config.bits, self.config.group)

    def _quantize_into(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Quantize k, v (Hkv, N, D) of sequence b (N a multiple of g) into positions [start, start + N);
        the sinks among them keep their 16-bit pairs."""
        c, n = self.config, k.shape[1]
        packed, scale, zero = quantize_keys(k, c.bits, c.group, self.k_scale.dtype, c.levels)
        self.k_packed[b, :, start: start + n] = packed
        self.k_scale[b, :, start // c.group: (start + n) // c.group] = scale
        self.k_zero[b, :, start // c.group: (start + n) // c.group] = zero
        packed, scale, zero = quantize_values(v, c.bits, c.group, self.v_scale.dtype, c.levels)
        self.v_packed[b, :, start: start + n] = packed
        self.v_scale[b, :, start: start + n] = scale
        self.v_zero[b, :, start: start + n] = zero
        sinks = max(0, min(self.n_sinks, start + n) - start)
        self.fetched_k[b, :, start: start + sinks] = k[:, :sinks].to(self.fetched_k.dtype)
        self.fetched_v[b, :, start: start + sinks] = v[:, :sinks].to(self.fetched_v.dtype)

    def ingest_prompt(self, k: Tensor, v: Tensor) -> None:
        """A generation starts: forget the last one's fetches and counts, quantize each prompt but
        its newest tokens, keep those in the window, and send all of its 16-bit K, V to the slow tier."""
        self.fetched_valid[:, :, self.n_sinks:] = False
        self.kappa_valid.zero_()
        self.counts.zero_()
        if self.config.stats:
            self.diagnostics.zero_()
        if self.correcting:
            self.last_query.zero_()
        if self.fetcher is not None:
            self.fetcher.reset()
        k, v = k.to(self.window_k.dtype), v.to(self.window_v.dtype)  # quantized from the 16-bit pairs, as flushes are
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

    def flush_window(self, b: int) -> None:
        """Sequence b's window holds R + g tokens: quantize the oldest g (their 16-bit pairs are in
        the slow tier already) and slide the window down by g."""
        start, g = self.state.host_quantized_len[b], self.config.group
        self._quantize_into(b, start, self.window_k[b, :, :g], self.window_v[b, :, :g])
        self.window_k[b, :, :-g] = self.window_k[b, :, g:].clone()
        self.window_v[b, :, :-g] = self.window_v[b, :, g:].clone()

    def read_pairs(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The 16-bit pairs at positions (B, Hkv, K), now: a gather on a CPU, a waited fetch on a GPU."""
        if self.on_gpu:
            return fetch_now(self.slow, positions, *self.staging)
        return gather_pairs(self.slow.k, positions), gather_pairs(self.slow.v, positions)

    # --- a step --------------------------------------------------------------------------------

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask) -> Tensor:
        state, c = self.state, self.config
        if state.prefilling:
            y = attention(q, k, v, CAUSAL_PROMPT)
            self.ingest_prompt(k, v)
            return y
        b, n_heads, s, d = q.shape
        rows = query_rows(q, k.shape[1])
        # The exact pairs that count now: quantized positions only; the real row's slots are refilled below.
        exact = self.fetched_valid & (self.fetched_pos < state.quantized_len[:, None, None])
        exact[:, :, self.real_slots] = False
        discard = None  # KV heads whose prefetch the real row replaces (correct)
        if self.correcting and state.append:
            discard = queries_disagree(q[:, :, 0], self.last_query, k.shape[1], c.correct_below)
            exact[:, :, self.spec_slots] &= ~discard.unsqueeze(-1)
            self.counts[1] += discard.sum()
            self.counts[2] += discard.numel()
        seg = Segments(state.quantized_len, self.fetched_k, self.fetched_v, self.fetched_pos, exact, self.window_k,
                       self.window_v, state.window_len, k, v)
        part = lowbit_part(rows, self.lowbit(), seg)
        if self.picks:
            part, seg = self.pick_within_step(rows, part, seg, s, discard)
        merged = merge_softmax(rows, part, seg, s)
        y = merged_output(part, merged, seg)
        if self.k_spec:  # the last row (the speculative one, or T1 in the bootstrap step) chooses kappa_{t+1}
            self.choose_prefetch(over_query_heads(row_position_weights(part, merged, seg, s, s - 1), c.gqa))
        if c.stats and state.append:
            self.diagnose(rows, seg, s)
        if self.correcting:
            self.last_query.copy_(q[:, :, -1])
        if state.append:  # the real row's K, V join the window; the speculative row's are dropped
            batch = torch.arange(b, device=k.device)
            new_k, new_v = k[:, :, 0].to(self.window_k.dtype), v[:, :, 0].to(self.window_v.dtype)
            self.window_k[batch, :, state.window_len] = new_k
            self.window_v[batch, :, state.window_len] = new_v
            if not self.on_gpu:  # and to the slow tier (a GPU copies it out after the layer)
                self.slow.k[batch, :, state.quantized_len + state.window_len] = new_k
                self.slow.v[batch, :, state.quantized_len + state.window_len] = new_v
        return y.reshape(b, n_heads, s, d).to(q.dtype)

    def pick_within_step(self, rows: Tensor, part, seg: Segments, s: int, discard: Optional[Tensor]):
        """The real row (row 0) picks positions of the low-bit pass by its own weights (or, as the
        oracle, by its exact scores); their 16-bit pairs are read now, fill the real row's slots
        (all k slots of a KV head in `discard`), and their low-bit share leaves `part`."""
        c, t = self.config, part.weights.shape[-1]
        weights = row_position_weights(part, merge_softmax(rows, part, seg, s), seg, s, 0)  # (B, Hkv, G, T)
        if c.oracle:
            exact, _ = self.exact_real_row_probs(rows, seg, s)
            scores = (exact if c.oracle == "mass" else (exact - weights).abs()).mean(2)
        else:
            scores = over_query_heads(weights, c.gqa)
        lq = self.state.quantized_len[:, None, None]
        candidates = (torch.arange(t, device=rows.device) < lq) & ~positions_mask(seg.fetched_pos, seg.fetched_valid, t)
        picks, valid = select_top_k(scores, candidates, self.picks)
        slot = torch.arange(self.fetched_pos.shape[-1], device=rows.device)
        first = torch.full(picks.shape[:2] + (1,), self.real_slots.start, device=rows.device)  # a head's first picked slot
        if discard is not None:
            first = torch.where(discard.unsqueeze(-1), self.spec_slots.start, first)
        valid = valid & (torch.arange(self.picks, device=rows.device) < slot.shape[0] - first)  # the picks placed
        rank = (slot - first).clamp(0, self.picks - 1)  # which pick each slot takes, where slot >= first
        taken = slot >= first

        def place(new: Tensor, old: Tensor) -> Tensor:
            """Per slot: the pick of its rank where the slot is taken, else what it held."""
            extra = new.shape[3:]
            index = rank.view(*rank.shape, *[1] * len(extra)).expand(*rank.shape, *extra)
            return torch.where(taken.view(*taken.shape, *[1] * len(extra)), new.gather(2, index), old)

        pair_k, pair_v = self.read_pairs(picks)
        self.fetched_k.copy_(place(pair_k.to(self.fetched_k.dtype), self.fetched_k))
        self.fetched_v.copy_(place(pair_v.to(self.fetched_v.dtype), self.fetched_v))
        self.fetched_pos.copy_(place(picks, self.fetched_pos))
        self.counts[0] += valid.sum()
        exact = place(valid, seg.fetched_valid)
        return drop_from_lowbit(part, self.lowbit(), picks, valid), seg._replace(fetched_valid=exact)

    def choose_prefetch(self, weights: Tensor) -> None:
        """kappa_{t+1}: the top-k_spec positions of the last row's weights (B, Hkv, T), among those
        quantized by the next step and not sinks. On a CPU its pairs are gathered now; a GPU starts a
        background fetch after the layer (run_layers)."""
        t = weights.shape[-1]
        position = torch.arange(t, device=weights.device)
        candidates = (position < self.state.selectable_len[:, None, None]) & (position >= self.n_sinks)
        kappa_pos, kappa_valid = select_top_k(weights, candidates, self.k_spec)
        if not self.on_gpu:  # count the pairs to read: with reuse, those the previous prefetch did not hold
            new = kappa_valid
            if self.config.reuse:
                held = (kappa_pos.unsqueeze(-1) == self.kappa_pos.unsqueeze(-2)) & self.kappa_valid.unsqueeze(-2)
                new = new & ~held.any(-1)
            self.counts[0] += new.sum()
        self.kappa_pos.copy_(kappa_pos)
        self.kappa_valid.copy_(kappa_valid)
        if self.on_gpu:
            return
        spec = self.spec_slots
        self.fetched_k[:, :, spec] = gather_pairs(self.slow.k, kappa_pos)
        self.fetched_v[:, :, spec] = gather_pairs(self.slow.v, kappa_pos)
        self.fetched_pos[:, :, spec] = kappa_pos
        self.fetched_valid[:, :, spec] = kappa_valid

    def fast_tier_bytes(self) -> int:
        """The layer's fast-tier buffers, all sequences (not its counters)."""
        return sum(t.numel() * t.element_size() for name, t in self.named_buffers()
                   if name not in ("counts", "diagnostics"))

    # --- diagnostics (stats=True) ----------------------------------------------------------------

    def exact_real_row_probs(self, rows: Tensor, seg: Segments, s: int) -> tuple[Tensor, Tensor]:
        """The real row's exact attention, from the 16-bit keys in the slow tier, the window and its
        own key: the probabilities of the history's positions [0, T) (B, Hkv, G, T), per query head,
        and the probability of the window and its own key together (B, Hkv, G)."""
        b, n_kv, m, d = rows.shape
        real = rows.view(b, n_kv, m // s, s, d)[:, :, :, 0]
        keys = copy_keys_to(self.slow, rows.device) if self.on_gpu else self.slow.k
        t = keys.shape[2]
        quantized = torch.arange(t, device=rows.device) < self.state.quantized_len[:, None, None, None]
        in_window = torch.arange(seg.window_k.shape[2], device=rows.device) < seg.window_len[:, None, None, None]
        scores = torch.cat([(real @ keys.float().transpose(-1, -2)).masked_fill(~quantized, float("-inf")),
                            (real @ seg.window_k.float().transpose(-1, -2)).masked_fill(~in_window, float("-inf")),
                            (real * seg.new_k[:, :, None, 0].float()).sum(-1, keepdim=True)], -1)
        probs = scores.softmax(-1)
        return probs[..., :t], probs[..., t:].sum(-1)

    def diagnose(self, rows: Tensor, seg: Segments, s: int) -> None:
        """Why a selection fails, per KV head: recall of the fetched pairs (all k, prefetched and
        picked) against the real row's own low-bit top-k and against its exact top-k (the oracle,
        from the 16-bit keys), the share of its exact attention mass read in 16 bits (coverage), and
        that share had the oracle's k been fetched."""
        c = self.config
        probs, elsewhere = self.exact_real_row_probs(rows, seg, s)
        mass, elsewhere = probs.mean(2), elsewhere.mean(2)  # a KV head's share: the mean over its query heads
        t, k = mass.shape[-1], self.k_spec + self.k_real
        position = torch.arange(t, device=rows.device)
        selectable = (position < self.state.quantized_len[:, None, None]) & (position >= self.n_sinks)
        sinks = seg.fetched_valid & (torch.arange(seg.fetched_valid.shape[-1], device=rows.device) < self.n_sinks)
        coverage = (mass * positions_mask(seg.fetched_pos, seg.fetched_valid, t)).sum(-1) + elsewhere
        oracle, oracle_valid = select_top_k(mass, selectable, k)
        covered = positions_mask(oracle, oracle_valid, t) | positions_mask(seg.fetched_pos, sinks, t)
        oracle_coverage = (mass * covered).sum(-1) + elsewhere
        plain = seg._replace(fetched_valid=sinks)  # the real row's own low-bit pass: only the sinks exact
        plain_part = lowbit_part(rows, self.lowbit(), plain)
        own_weights = row_position_weights(plain_part, merge_softmax(rows, plain_part, plain, s), plain, s, 0)
        own, own_valid = select_top_k(over_query_heads(own_weights, c.gqa), selectable, k)
        fetched_pos, fetched_valid = seg.fetched_pos[:, :, self.n_sinks:], seg.fetched_valid[:, :, self.n_sinks:]

        def hits(positions: Tensor, valid: Tensor) -> Tensor:
            found = (fetched_pos.unsqueeze(-1) == positions.unsqueeze(-2)) & fetched_valid.unsqueeze(-1)
            return (found.any(-2) & valid).sum(-1)

        sums = [hits(own, own_valid), own_valid.sum(-1), hits(oracle, oracle_valid), oracle_valid.sum(-1), coverage,
                oracle_coverage, torch.ones_like(coverage)]
        self.diagnostics += torch.stack([x.double() for x in sums]).sum(1)


class SpeCacheWindow(RingKVCache):
    """A sliding-window layer under SpeCache: its ring of 16-bit pairs, all in the fast tier."""

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
            SpeCacheLayer(state, c.n_head, c.n_local_heads, c.head_dim, dtype, device, executor) if window is None
            else SpeCacheWindow(state, window, c.n_local_heads, c.head_dim, dtype, device))
    model.setup_rope(capacity + 1)  # the speculative row can sit one past the last real position
    model.max_batch_size, model.max_seq_length = batch_size, capacity
    return state


def compiles_whole(config: SpeCacheConfig, device: torch.device) -> bool:
    """Whether a SpeCache layer's decode step is one graph for torch.compile: not on a GPU when the
    step waits for a fetch (the real row's picks) or reads the slow tier (stats)."""
    return device.type != "cuda" or not (config.stats or config.topk and (
        not config.speculative or config.oracle or config.real_share > 0 or config.correct_below is not None))


def specache_layers(model: Transformer) -> list[SpeCacheLayer]:
    """The SpeCache layers (the full-attention ones; sliding-window layers keep a ring)."""
    return [layer.attention.kv_cache for layer in model.layers if isinstance(layer.attention.kv_cache, SpeCacheLayer)]


def window_layers(model: Transformer) -> list[SpeCacheWindow]:
    return [layer.attention.kv_cache for layer in model.layers if isinstance(layer.attention.kv_cache, SpeCacheWindow)]


# --- a generation ------------------------------------------------------------------------------

@torch.no_grad()
def run_layers(model: Transformer, tokens: Tensor, input_pos: Tensor, start_fetches: bool) -> Tensor:
    """One forward pass of the new rows through every layer, with the GPU's fetch hand-offs between
    layers (a CPU layer fetches and stores within its step)."""
    x = model.embed(tokens)
    state = specache_layers(model)[0].state
    for layer, freqs_cis in zip(model.layers, model.rope(input_pos)):
        cache = layer.attention.kv_cache
        gpu = isinstance(cache, SpeCacheLayer) and cache.on_gpu
        if gpu and cache.fetcher is not None:
            cache.fetcher.wait()  # kappa_t's pairs have landed in this layer's fast tier
        x = layer(x, input_pos, freqs_cis, None)
        if gpu and state.append:
            cache.store_new_pairs()  # the real row's 16-bit pair goes to the slow tier
        if gpu and start_fetches and cache.fetcher is not None:
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


def greedy_guess(logits: Tensor, history: Tensor, lengths: Tensor) -> Tensor:
    """The paper's speculative token: the greedy choice of the speculative row's logits (B, V)."""
    return logits.argmax(-1, keepdim=True)


def prompt_lookup_guess(logits: Tensor, history: Tensor, lengths: Tensor, max_ngram: int = 3) -> Tensor:
    """The token that followed the most recent earlier occurrence of the last n tokens of each
    sequence's history (B, L; its first lengths[b] real), for n = max_ngram down to 1; where none
    occurs, the greedy choice. (transformers' prompt_lookup_num_tokens does the same for drafts.)"""
    guess, found = logits.argmax(-1), torch.zeros(len(lengths), dtype=torch.bool, device=logits.device)
    for n in range(max_ngram, 0, -1):
        tail = history.gather(1, (lengths[:, None] - n + torch.arange(n, device=history.device)).clamp(min=0))
        starts = torch.arange(history.shape[1] - n + 1, device=history.device)
        match = (history.unfold(1, n, 1) == tail[:, None, :]).all(-1) & (starts + n < lengths[:, None])
        latest = torch.where(match, starts, -1).amax(-1)
        hit = (latest >= 0) & ~found & (lengths > n)
        guess = torch.where(hit, history.gather(1, (latest + n).clamp(min=0)[:, None])[:, 0], guess)
        found |= hit
    return guess[:, None]


GUESSES = {"greedy": greedy_guess, "lookup": prompt_lookup_guess}


def wait_for_fetches(model: Transformer) -> None:
    for cache in specache_layers(model):
        if cache.fetcher is not None:
            cache.fetcher.wait()


@torch.no_grad()
def specache_generate(model: Transformer, state: SpeCacheState, prompts: list[list[int]], max_new_tokens: int, *,
                      stop_ids: frozenset = frozenset(), temperature: float = 0.0, top_k: Optional[int] = None,
                      callback: Callable[[Tensor], None] = lambda tokens: None,
                      guess_next: Optional[Callable[[Tensor, Tensor, Tensor], Tensor]] = None,
                      first_token: Optional[Tensor] = None) -> "GenerationResult":
    """generate.generate with SpeCache: prefill, the bootstrap step, then two-row decode steps.

    Prefill and the bootstrap step run eagerly (once per generation; prefill quantizes each prompt
    in Python); decode steps run whatever `compile_decode` compiled. `guess_next(logits (B, V),
    history (B, L), lengths (B,))` gives the next speculative token (B, 1) from the last row's
    logits and the real tokens so far (default: the config's `guess`).
    With `first_token` (B, 1), prefill has happened elsewhere (a prefill shared by several caches,
    see scripts/harness.py: `state.begin`, then each layer's `ingest_prompt`) and decoding starts
    from it.
    """
    from generate import GenerationResult, cut_at_stop, pad_prompts, prefill, sample, weight_bytes

    config, device = state.config, state.quantized_len.device
    guess_next = guess_next or GUESSES[config.guess]
    lengths = [len(p) for p in prompts]
    if max(lengths) + max_new_tokens > state.capacity:
        raise ValueError(f"{max(lengths)} prompt + {max_new_tokens} new tokens exceed the SpeCache capacity "
                         f"{state.capacity}; set it up with a larger max_seq_length")
    sampling = dict(temperature=temperature, top_k=top_k)
    tokens, prompt_lengths = pad_prompts(prompts, device)
    pos = prompt_lengths.unsqueeze(1).clone()
    history = torch.zeros(len(prompts), state.capacity + 1, dtype=torch.long, device=device)  # the real tokens
    history[:, : tokens.shape[1]] = tokens
    history_len = prompt_lengths.clone()
    batch = torch.arange(len(prompts), device=device)

    def keep(real: Tensor) -> None:
        history[batch, history_len] = real[:, 0]
        history_len.add_(1)

    # Prefill: full precision, then each layer's K, V go low-bit + window, and to the slow tier.
    t0 = time.perf_counter()
    if first_token is None:
        state.begin(lengths)
        with torch.compiler.set_stance("force_eager"):
            real = prefill(model, tokens, prompt_lengths, **sampling)
    else:
        real = first_token
    state.prefilling = False
    _sync(device)
    prefill_seconds = time.perf_counter() - t0
    keep(real)

    speculate = config.speculative and config.topk > 0
    if speculate:  # the bootstrap step: T1 picks kappa_1 and guesses T'2; its K, V are dropped
        state.append = False
        with torch.compiler.set_stance("force_eager"):
            guess = guess_next(run_layers(model, real, pos, start_fetches=True)[:, -1], history, history_len)
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
            keep(real)
            guess = guess_next(logits[:, 1], history, history_len)
            matches += int((guess_was == real).sum())
        else:
            real = sample(run_layers(model, real, pos, start_fetches=False), **sampling)
            keep(real)
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
    result.stats = cache_stats(model, state, matches / max(1, steps * len(prompts)) if speculate else None, steps)
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- accounting --------------------------------------------------------------------------------

def step_bytes(model: Transformer, state: SpeCacheState) -> int:
    """KV bytes one decode step reads: the low-bit copy up to each sequence's Lq, the window and
    the exact slots (the slow tier is read only by the fetches, counted apart), and the rings of
    sliding-window layers."""
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


def diagnostics(caches: list[SpeCacheLayer]) -> dict:
    """The `diagnose` sums as shares: overall and per SpeCache layer (the mean over its KV heads)."""
    sums = torch.stack([cache.diagnostics for cache in caches]).sum(-1)  # (layers, len(DIAGNOSTICS))
    named = dict(zip(DIAGNOSTICS, sums.T))
    rows = named["rows"].clamp_min(1)
    per_layer = {"recall_own_lowbit": named["own_hits"] / named["own_total"].clamp_min(1),
                 "recall_exact": named["exact_hits"] / named["exact_total"].clamp_min(1),
                 "coverage": named["coverage"] / rows, "oracle_coverage": named["oracle_coverage"] / rows}
    total = {key: float(sums[:, DIAGNOSTICS.index(a)].sum() / max(1.0, float(sums[:, DIAGNOSTICS.index(b)].sum())))
             for key, (a, b) in {"recall_own_lowbit": ("own_hits", "own_total"),
                                 "recall_exact": ("exact_hits", "exact_total"),
                                 "coverage": ("coverage", "rows"), "oracle_coverage": ("oracle_coverage", "rows")}.items()}
    return {**total, "per_layer": {key: [round(float(x), 4) for x in value] for key, value in per_layer.items()}}


def cache_stats(model: Transformer, state: SpeCacheState, speculative_match_rate: Optional[float],
                steps: int) -> dict:
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
    pairs_read = sum(int(cache.counts[0]) + (cache.fetcher.pairs_read if cache.fetcher else 0) for cache in caches)
    discarded, checked = (sum(int(cache.counts[i]) for cache in caches) for i in (1, 2))
    stats = {
        "cache": "specache" if cfg.topk and cfg.speculative else ("specache-nospec" if cfg.topk else "kivi"),
        "bits": cfg.bits, "group": cfg.group, "residual": cfg.residual,
        "topk": caches[0].k_spec + caches[0].k_real, "select": cfg.select_name(),
        "prefetched_pairs": caches[0].k_spec, "pairs_chosen_in_step": caches[0].k_real, "sinks": caches[0].n_sinks,
        "capacity_tokens": state.capacity,
        "fast_tier_bytes": fast,
        "slow_tier_bytes": slow,
        "fast_tier_ratio_to_16bit_cache": fast / full_16bit,
        "bytes_fetched_per_token": pairs_read * pair_bytes / max(1, steps * batch),
        "speculative_match_rate": speculative_match_rate,
        "prefetch_discarded_share": discarded / checked if checked else None,
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
        stats["diagnostics"] = diagnostics(caches)
    return stats
