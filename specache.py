"""SpeCache: speculative key-value caching (Jie et al., ICML 2025, arXiv 2503.16163), in one file.

The complete 16-bit KV cache lives in the big slow tier (host RAM); the small fast tier (VRAM, or
on a CPU the working set a step reads) keeps a 1- or 2-bit copy of every key and value, a 16-bit
window of the newest tokens, and a few 16-bit pairs per layer and KV head read exactly. Every
decode step runs two tokens at once, the real one and a speculative guess of the next one; the
speculative row's attention decides which pairs to fetch for the next step, and the fetch runs
while the rest of this step computes. docs/method.md explains each choice; this file is the code.

The timeline (the paper's Appendix A; names as there):

  Prefill. Each layer attends over the prompt in full precision, then quantizes the prompt's
  keys and values into the low-bit copy (whole groups of g tokens, all but the newest R, which
  stay in the 16-bit window) and sends its 16-bit K, V to the slow tier, before the next layer runs.

  Bootstrap. The first token T1 attends over the low-bit copy and the window. Its attention gives
  kappa_1, the positions to fetch for the first step, and its logits the first guess T'2. Its K, V
  are dropped (the next step computes them again).

  Decode step t. Rows [T_t, T'_{t+1}] attend in mixed precision: 16-bit pairs at the fetched
  positions and in the window, the low-bit copy everywhere else (nothing is dropped). The real row
  does not see the speculative row's key. Per layer, the speculative row's weights give kappa_{t+1},
  whose fetch starts as soon as the layer is done. The real row's K, V go to the slow tier and join
  the window, whose oldest group moves to the low-bit copy once it holds R + g tokens; the
  speculative row's are dropped. Row 0's logits give T_{t+1} (any sampler); the next guess comes
  from row 1's logits. A wrong guess is never rolled back: it only makes the next fetch less apt.

Choosing the exact pairs: the paper's rule and ours. With a 1-bit copy, the paper's rule (the
speculative row's top-k, averaged over each KV head's query heads) loses most needle retrievals on
the models measured here: the speculative row attends with pairs chosen for another query, its
choice for the next step is worse for it, and the real row pays. Ours lets the real row choose half
of the k pairs within the step from its own low-bit scores (`pick_within_step`), and adds smaller
changes. selection.py names every rule; each is a `SpeCacheConfig` field, commented below.

Variants: `speculative=False` is the paper's non-speculative baseline (each step's k pairs are the
real row's own low-bit top-k, fetched and waited for); `topk=0` is KIVI alone (the low-bit copy and
the window, nothing fetched).
"""
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from disk_tier import DiskFolder, DiskTier
from kernels import lowbit_cpu
from kernels.attention import (Segments, drop_from_lowbit, lowbit_part, merge_softmax, positions_mask,
                               query_rows, row_position_weights, select_top_k, top_positions)
from kernels.quant import LEVELS, LowBitKV, quantize_keys, quantize_values, sixteen_bit_dtype, value_group
from model import CausalPrompt, Pass, RingKVCache, Transformer, attention, attention_after_history, history_block
from offload import PinnedTier, RamTier, held_match
from selection import GUESSES, parse_select, queries_disagree, select_name
from specache_stats import DIAGNOSTICS, cache_stats, diagnose, exact_real_row_probs, fast_tier_plan, step_bytes

# --- configuration ---------------------------------------------------------------------------


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
    correct_below: Optional[float] = 0.9  # correct: discard a KV head's prefetch below this query cosine (None: never)
    sinks: int = 4  # the first positions, always exact
    levels: str = "lloyd"  # 1-bit levels: "minmax" (the paper's) or "lloyd"
    guess: str = "lookup"  # the speculative token: "greedy" (the paper's) or "lookup"
    reuse: bool = True  # do not read again what the previous prefetch held
    oracle: Optional[str] = None  # diagnostics: "error" or "mass", chosen with exact scores from the slow tier
    stats: bool = False  # also measure recall and exact-mass coverage (extra scoring passes per layer)
    overlap_fetch: bool = True  # GPU or disk: False waits for each fetch as soon as it starts (what overlap buys)
    pair_dtype: Optional[torch.dtype] = None  # the exact pairs' dtype; None: 16-bit (see above)
    slow_tier: str = "ram"  # CPU: "ram", or "disk" (a file per layer, disk_tier.py); beside a GPU, host RAM
    slow_tier_dir: Optional[str] = None  # disk: where its folder goes (None: the system's temp directory)

    def with_select(self, select: str) -> "SpeCacheConfig":
        return replace(self, **parse_select(select))

    def select_name(self) -> str:
        """The selection as --specache_select would name it."""
        return select_name(self)

    def splits_graph_on(self, device: torch.device) -> bool:
        """Whether a compiled step must split its graph: on a GPU or from disk, a step that reads the
        slow tier inside the layer (the real row's picks, the diagnostics) waits for a fetch there."""
        picks = self.topk > 0 and (not self.speculative or self.oracle or self.real_share > 0
                                   or self.correct_below is not None)
        return (device.type == "cuda" or self.slow_tier == "disk") and bool(picks or self.stats)

    def pair_dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.pair_dtype or sixteen_bit_dtype(model_dtype)

    def validate(self, head_dim: int) -> None:
        """Raise ValueError, naming the setting, for a configuration this model cannot run."""
        checks = [
            (self.bits in (1, 2), f"SpeCache bits must be 1 or 2, got {self.bits}"),
            (self.group >= 1 and self.residual >= 1,
             f"SpeCache group and residual must be positive, got {self.group} and {self.residual}"),
            (self.residual % max(self.group, 1) == 0, f"the residual window ({self.residual}) must be a multiple of "
             f"the group size ({self.group}), so that groups of tokens leave the window whole"),
            (self.topk >= 0, f"SpeCache top-k must be >= 0, got {self.topk}"),
            (0 <= self.real_share <= 1, f"split: the real row's share of k must be in [0, 1], got {self.real_share}"),
            (self.gqa in ("mean", "max") and self.levels in LEVELS and self.guess in GUESSES,
             f"unknown selection setting: gqa={self.gqa!r}, levels={self.levels!r}, guess={self.guess!r}"),
            (self.oracle in (None, "error", "mass"), f"oracle must be error or mass, got {self.oracle!r}"),
            (self.correct_below is None or -1 <= self.correct_below <= 1,
             f"correct: the threshold is a cosine in [-1, 1], got {self.correct_below}"),
            (self.sinks >= 0, f"sinks must be >= 0, got {self.sinks}"),
            (self.slow_tier in ("ram", "disk"), f"the slow tier is ram or disk, got {self.slow_tier!r}"),
            (head_dim * self.bits % 8 == 0, f"SpeCache packs each token's {self.bits}-bit codes into whole bytes, so "
             f"head_dim x bits must be a multiple of 8; this model's head_dim is {head_dim}"),
            (self.group < 1 or head_dim % value_group(self.group, head_dim) == 0,
             f"head_dim {head_dim} is not a multiple of the value group size {self.group}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class SpeCacheState:
    """What all layers share: per-sequence lengths, on the device (for the kernels) and on the host
    (for the decisions the Python loop makes, so it never waits on the device)."""

    def __init__(self, config: SpeCacheConfig, batch_size: int, capacity: int, device: torch.device,
                 head_dim: int, pair_dtype: torch.dtype, group_size: int):
        self.config, self.capacity = config, capacity
        # R, and the most exact slots, with which the fast tier stays within a 16-bit cache (specache_stats)
        self.residual, self.max_slots = fast_tier_plan(config, capacity, head_dim, pair_dtype, group_size)
        self.quantized_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # Lq
        self.window_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # r
        self.selectable_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # kappa is drawn from [0, this)
        self.host_quantized_len = [0] * batch_size
        self.host_window_len = [0] * batch_size

    def split(self, n: int) -> tuple[int, int]:
        """(Lq, r) of a sequence that holds n tokens: whole groups of all but the newest R are
        quantized, the rest (R to R + g - 1 tokens, or all n < R + g) stay in the window. Decode steps
        keep this as they go (SpeCache.advance)."""
        lq = max(0, n - self.residual) // self.config.group * self.config.group
        return lq, n - lq

    def begin(self, lengths: list[int]) -> None:
        """Sequence b will hold lengths[b] tokens once its prompt is in."""
        self.host_quantized_len, self.host_window_len = map(list, zip(*map(self.split, lengths)))
        self.sync()

    def held(self) -> list[int]:
        """The tokens each sequence holds."""
        return [lq + r for lq, r in zip(self.host_quantized_len, self.host_window_len)]

    def sync(self) -> None:
        """The device copies of the host's lengths (pinned and asynchronous on a GPU: no wait)."""
        for device_copy, values in ((self.quantized_len, self.host_quantized_len),
                                    (self.window_len, self.host_window_len),
                                    (self.selectable_len, self.host_selectable_len())):
            host = torch.tensor(values, pin_memory=device_copy.is_cuda)
            device_copy.copy_(host, non_blocking=device_copy.is_cuda)

    def host_selectable_len(self) -> list[int]:
        """Lq, or Lq + g when the next kept row fills the window and its oldest group gets quantized."""
        full = self.residual + self.config.group
        return [lq + (self.config.group if r + 1 == full else 0)
                for lq, r in zip(self.host_quantized_len, self.host_window_len)]


# --- one layer ---------------------------------------------------------------------------------
# Which positions a step reads in 16 bits: selection.py names the rules (the paper's, ours, each
# change alone), the layer applies them: `exact_slots` (which fetched pairs count),
# `pick_within_step` (the real row's own choice, and the correction), `choose_prefetch` (the
# speculative row's choice for the next step); kernels/attention.py ranks positions. The mask each
# layer gets is a model.Pass: the bootstrap (T1 alone, nothing kept), a decode step (the real row kept).
BOOTSTRAP, DECODE = Pass(keep=False), Pass(keep=True)


class SpeCacheLayer(nn.Module):
    """One layer's SpeCache, plugged in as `Attention.kv_cache` (see model.py).

    The exact pairs a step reads besides the window sit in one buffer of slots per KV head:
    [sinks | the speculative prefetch (k_spec) | the real row's picks (k_real)], k_spec + k_real = k.
    Buffers hold what the capacity can need: the low-bit copy the positions that can ever be
    quantized (all but the newest R), the window at most the capacity, the slots at most the
    positions the copy can hold.
    """

    def __init__(self, state: SpeCacheState, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, executor: Optional[ThreadPoolExecutor], folder: Optional[DiskFolder] = None):
        """`dtype`: the exact pairs' dtype (window, slots, slow tier); `executor` moves pairs beside a
        GPU, `folder` holds them on disk."""
        super().__init__()
        c, b, t = state.config, state.quantized_len.shape[0], state.capacity
        self.state, self.config = state, c
        scale_dtype = sixteen_bit_dtype(dtype)
        code_bytes = head_dim * c.bits // 8
        n_value_groups = head_dim // value_group(c.group, head_dim)
        quantizable = max(0, t - state.residual) // c.group * c.group
        self.n_sinks = min(c.sinks, quantizable, state.max_slots)
        k = min(c.topk, quantizable, state.max_slots - self.n_sinks)
        self.k_real = k if not c.speculative or c.oracle else int(k * c.real_share + 0.5)
        self.k_spec = k - self.k_real
        self.correcting = c.correct_below is not None and self.k_spec > 0
        self.picks = k if self.correcting else self.k_real  # a head that discards its prefetch picks all k
        slots = self.n_sinks + k
        self.spec_slots = slice(self.n_sinks, self.n_sinks + self.k_spec)
        self.real_slots = slice(self.n_sinks + self.k_spec, slots)

        def fast(name, *shape, dtype=dtype):
            self.register_buffer(name, torch.zeros(*shape, dtype=dtype, device=device), persistent=False)

        # Fast tier: the low-bit copy...
        fast("k_packed", b, n_kv_heads, quantizable, code_bytes, dtype=torch.uint8)
        fast("k_scale", b, n_kv_heads, quantizable // c.group, head_dim, dtype=scale_dtype)
        fast("k_zero", b, n_kv_heads, quantizable // c.group, head_dim, dtype=scale_dtype)
        fast("v_packed", b, n_kv_heads, quantizable, code_bytes, dtype=torch.uint8)
        fast("v_scale", b, n_kv_heads, quantizable, n_value_groups, dtype=scale_dtype)
        fast("v_zero", b, n_kv_heads, quantizable, n_value_groups, dtype=scale_dtype)
        # ... the 16-bit window: the newest R tokens and up to g more waiting for a group ...
        fast("window_k", b, n_kv_heads, min(state.residual + c.group, t), head_dim)
        fast("window_v", b, n_kv_heads, min(state.residual + c.group, t), head_dim)
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
        if c.stats:  # per KV head, summed: see specache_stats.diagnose
            fast("diagnostics", len(DIAGNOSTICS), n_kv_heads, dtype=torch.float64)
        self.fetched_pos[:, :, : self.n_sinks] = torch.arange(self.n_sinks, device=device)
        self.fetched_valid[:, :, : self.n_sinks] = True  # counted while quantized (below Lq)
        # Slow tier: the complete 16-bit cache (offload.py); beside a GPU host memory, or on disk.
        shape, spec = (b, n_kv_heads, t, head_dim), self.spec_slots
        prefetch_slots = (self.fetched_k[:, :, spec], self.fetched_v[:, :, spec], self.fetched_pos[:, :, spec],
                          self.fetched_valid[:, :, spec], self.kappa_pos, self.kappa_valid) if self.k_spec else None
        if device.type == "cuda":
            self.tier = PinnedTier(shape, dtype, device, prefetch_slots, executor, c.reuse)
        elif folder is not None:
            self.tier = DiskTier(shape, dtype, prefetch_slots, folder, c.reuse)
        else:
            self.tier = RamTier(shape, dtype)

    def reset(self) -> None:
        """A generation starts: nothing fetched, chosen or counted yet."""
        self.fetched_valid[:, :, self.n_sinks:] = False
        self.kappa_valid.zero_()
        self.counts.zero_()
        if self.config.stats:
            self.diagnostics.zero_()
        if self.correcting:
            self.last_query.zero_()
        self.tier.reset()

    # --- the low-bit copy and the window -------------------------------------------------------

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

    def ingest_prompt(self, k: Tensor, v: Tensor, start: int = 0) -> None:
        """After the prompt's attention: its rows k, v (B, Hkv, S, D) at positions [start, start + S), up
        to each prompt's end (as `begin` set it), join the window, whose whole groups beyond the newest R
        are quantized, and go to the slow tier: in one piece or in chunks, the same groups."""
        k, v = k.to(self.window_k.dtype), v.to(self.window_v.dtype)  # quantized from the 16-bit pairs, as flushes are
        for b, total in enumerate(self.state.held()):
            end = min(total, start + k.shape[2])
            if end <= start:
                continue  # right padding only, in this chunk
            (lq0, r0), (lq1, r1) = self.state.split(start), self.state.split(end)
            rows_k, rows_v = k[b, :, : end - start], v[b, :, : end - start]
            pending_k = torch.cat([self.window_k[b, :, :r0], rows_k], 1)  # positions [lq0, end)
            pending_v = torch.cat([self.window_v[b, :, :r0], rows_v], 1)
            if lq1 > lq0:
                self._quantize_into(b, lq0, pending_k[:, : lq1 - lq0], pending_v[:, : lq1 - lq0])
            self.window_k[b, :, :r1] = pending_k[:, lq1 - lq0:]
            self.window_v[b, :, :r1] = pending_v[:, lq1 - lq0:]
            self.tier.write(b, start, rows_k, rows_v)

    def history(self, start: int, block: int):
        """The pairs of positions [0, start) as (K, V) blocks (B, Hkv, <= block, D), in order, on the
        layer's device: exact, from the slow tier; with nothing to fetch (KIVI), as its decode steps
        read them: the low-bit copy below Lq, but the sinks."""
        lq = self.state.split(start)[0] if self.config.topk == 0 else 0
        for first in range(0, start, block):
            k, v = self.tier.read_range(first, min(start, first + block), self.window_k.device)
            low, sinks = min(lq, first + block) - first, max(0, self.n_sinks - first)  # whole groups: block % g == 0
            if low > sinks:
                low_k, low_v = self.lowbit().dequantized(first, first + low)
                k, v = k.to(torch.float32, copy=True), v.to(torch.float32, copy=True)  # never the tier's storage
                k[:, :, sinks: low], v[:, :, sinks: low] = low_k[:, :, sinks:], low_v[:, :, sinks:]
            yield k, v

    def flush_window(self, b: int) -> None:
        """Sequence b's window holds R + g tokens: quantize the oldest g (their 16-bit pairs are in
        the slow tier already) and slide the window down by g."""
        start, g = self.state.host_quantized_len[b], self.config.group
        self._quantize_into(b, start, self.window_k[b, :, :g], self.window_v[b, :, :g])
        self.window_k[b, :, :-g] = self.window_k[b, :, g:].clone()
        self.window_v[b, :, :-g] = self.window_v[b, :, g:].clone()

    # --- a pass ----------------------------------------------------------------------------------

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask) -> Tensor:
        if isinstance(mask, CausalPrompt):  # prefill: full precision, then the prompt is ingested
            if mask.start == 0:
                y = attention(q, k, v, mask)
            else:  # over the history as the slow tier holds it, in blocks (prefill is compute-bound)
                block = history_block(*q.shape, self.config.group)
                y = attention_after_history(q, k, v, self.history(mask.start, block))
            self.ingest_prompt(k, v, mask.start)
            return y
        return self.step(q, k, v, keep=mask.keep)

    def step(self, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> Tensor:
        """The new rows (B, H, S, D) over the history in mixed precision; the last row chooses the
        next prefetch; with `keep`, the real row's K, V join the window and the slow tier."""
        state, c = self.state, self.config
        b, n_heads, s, d = q.shape
        rows = query_rows(q, k.shape[1])
        discard = self.prefetch_missed(q) if self.correcting and keep else None
        seg = Segments(state.quantized_len, self.fetched_k, self.fetched_v, self.fetched_pos, self.exact_slots(discard),
                       self.window_k, self.window_v, state.window_len, k, v)
        part = lowbit_part(rows, self.lowbit(), seg)
        if self.picks:
            part, seg = self.pick_within_step(rows, part, seg, s, discard)
        merged = merge_softmax(rows, part, seg)
        y = merged.out
        if c.stats and keep:  # before the prefetch rewrites the slots that seg reads
            self.diagnostics += diagnose(self, rows, seg, s)
        if self.k_spec:  # the last row (the speculative one, or T1 in the bootstrap) chooses kappa_{t+1}
            self.choose_prefetch(*top_positions(part, merged, seg, s, s - 1, c.gqa, self.n_sinks, state.selectable_len,
                                                seg.fetched_pos[..., :0], seg.fetched_valid[..., :0], self.k_spec))
        if self.correcting:
            self.last_query.copy_(q[:, :, -1])
        if keep:
            self.append_real_row(k[:, :, 0], v[:, :, 0])
        return y.reshape(b, n_heads, s, d).to(q.dtype)

    def prefetch_missed(self, q: Tensor) -> Tensor:
        """correct: the KV heads (B, Hkv) whose real query moved away from the one that chose the prefetch."""
        discard = queries_disagree(q[:, :, 0], self.last_query, self.fetched_k.shape[1], self.config.correct_below)
        self.counts[1] += discard.sum()
        self.counts[2] += discard.numel()
        return discard

    def exact_slots(self, discard: Optional[Tensor]) -> Tensor:
        """Which slots count now: sinks and the prefetch, at positions quantized already (a pair
        chosen while its position was in the window counts once it leaves it); not the real row's
        slots, which this step refills; not the prefetch of a head that discards it."""
        exact = self.fetched_valid & (self.fetched_pos < self.state.quantized_len[:, None, None])
        exact[:, :, self.real_slots] = False
        if discard is not None:
            exact[:, :, self.spec_slots] &= ~discard.unsqueeze(-1)
        return exact

    def pick_within_step(self, rows: Tensor, part, seg: Segments, s: int, discard: Optional[Tensor]):
        """The real row (row 0) picks positions of the low-bit pass by its own weights (or, as the
        oracle, with its exact scores); their 16-bit pairs are read now, fill the real row's slots
        (all k slots of a KV head in `discard`), and their low-bit share leaves `part`."""
        c, t, lq = self.config, part.weights.shape[-1], self.state.quantized_len
        merged = merge_softmax(rows, part, seg)
        if c.oracle:
            weights = row_position_weights(part, merged, seg, s, 0)  # (B, Hkv, G, T)
            exact, _ = exact_real_row_probs(self, rows, seg, s)
            scores = (exact if c.oracle == "mass" else (exact - weights).abs()).mean(2)
            candidates = (torch.arange(t, device=rows.device) < lq[:, None, None]) & ~positions_mask(
                seg.fetched_pos, seg.fetched_valid, t)
            picks, valid = select_top_k(scores, candidates, self.picks)
        else:  # candidates: quantized, not fetched
            picks, valid = top_positions(part, merged, seg, s, 0, c.gqa, 0, lq, seg.fetched_pos, seg.fetched_valid,
                                         self.picks)
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

        pair_k, pair_v = self.tier.read(picks, valid)
        self.fetched_k.copy_(place(pair_k.to(self.fetched_k.dtype), self.fetched_k))
        self.fetched_v.copy_(place(pair_v.to(self.fetched_v.dtype), self.fetched_v))
        self.fetched_pos.copy_(place(picks, self.fetched_pos))
        self.counts[0] += valid.sum()
        exact = place(valid, seg.fetched_valid)
        return drop_from_lowbit(part, self.lowbit(), picks, valid), seg._replace(fetched_valid=exact)

    def choose_prefetch(self, kappa_pos: Tensor, kappa_valid: Tensor) -> None:
        """kappa_{t+1}: the last row's top-k_spec positions (B, Hkv, k_spec), among those quantized by the
        next step and not sinks; the tier moves their pairs into the prefetch slots (RAM within this
        step; a GPU or the disk in the background after the layer)."""
        new = kappa_valid  # the pairs to read: with reuse, those the previous prefetch did not hold
        if self.config.reuse:
            new = new & ~held_match(kappa_pos, self.kappa_pos, self.kappa_valid).any(-1)
        self.counts[0] += new.sum()
        self.kappa_pos.copy_(kappa_pos)
        self.kappa_valid.copy_(kappa_valid)
        self.tier.prefetch(kappa_pos, kappa_valid, (self.fetched_k, self.fetched_v, self.fetched_pos, self.fetched_valid),
                           self.spec_slots)

    def append_real_row(self, new_k: Tensor, new_v: Tensor) -> None:
        """The real row's K, V (B, Hkv, D) join the window and the slow tier; the speculative row's are dropped."""
        state = self.state
        batch = torch.arange(new_k.shape[0], device=new_k.device)
        new_k, new_v = new_k.to(self.window_k.dtype), new_v.to(self.window_v.dtype)
        self.window_k[batch, :, state.window_len] = new_k
        self.window_v[batch, :, state.window_len] = new_v
        self.tier.store(state.quantized_len + state.window_len, new_k, new_v)

    def fast_tier_bytes(self) -> int:
        """The layer's fast-tier buffers, all sequences (not its counters)."""
        return sum(t.numel() * t.element_size() for name, t in self.named_buffers()
                   if name not in ("counts", "diagnostics"))



# --- the two-row step and the bootstrap: SpeCache as the generation loop drives it -------------


class SpeCache:
    """SpeCache in every full-attention layer of `model` (a ring in each sliding-window layer), for
    `batch_size` sequences of up to `max_seq_length` positions (rounded up to a whole group), driven
    by generate.generate (see caches.py for the protocol): `begin`, `bootstrap`, then per token
    `step` and `sampled`, then `finish`."""

    chunks = True  # a prompt's chunk reads its history from the slow tier (KIVI: the low-bit copy)

    def __init__(self, model: Transformer, batch_size: int, max_seq_length: int, config: SpeCacheConfig):
        c = model.config
        config.validate(c.head_dim)
        if all(layer.attention.window is not None for layer in model.layers):
            raise ValueError("every layer of this model attends over a sliding window only, which stays in the fast "
                             "tier whole: SpeCache has nothing to offload; use the full cache")
        capacity = -(-max_seq_length // config.group) * config.group
        device, dtype = model.tok_embeddings.weight.device, config.pair_dtype_for(model.tok_embeddings.weight.dtype)
        self.model, self.config, self.device = model, config, device
        self.state = SpeCacheState(config, batch_size, capacity, device, c.head_dim, dtype, c.n_head // c.n_local_heads)
        if device.type == "cpu":
            lowbit_cpu.available()  # builds the C kernel now (once per machine), not while torch.compile traces
        executor = ThreadPoolExecutor(1, thread_name_prefix="specache-fetch") if device.type == "cuda" else None
        if config.slow_tier == "disk" and device.type != "cpu":
            raise ValueError("--slow_tier disk is for CPU-only machines: beside a GPU the slow tier is host RAM")
        self.folder = DiskFolder(config.slow_tier_dir) if config.slow_tier == "disk" else None
        for layer in model.layers:
            window = layer.attention.window
            layer.attention.kv_cache = (
                SpeCacheLayer(self.state, c.n_head, c.n_local_heads, c.head_dim, dtype, device, executor, self.folder)
                if window is None else RingKVCache(batch_size, window, c.n_local_heads, c.head_dim, dtype, device))
        model.setup_rope(capacity + 1)  # the speculative row can sit one past the last real position
        model.max_batch_size, model.max_seq_length = batch_size, capacity
        caches = [layer.attention.kv_cache for layer in model.layers]
        self.layers = [cache for cache in caches if isinstance(cache, SpeCacheLayer)]
        self.rings = [cache for cache in caches if isinstance(cache, RingKVCache)]  # 16-bit, in the fast tier
        self.speculative = config.speculative and config.topk > 0
        self.guess_next: Callable[[Tensor, Tensor, Tensor], Tensor] = GUESSES[config.guess]
        self.graph_breaks = config.splits_graph_on(device)
        # Beside a GPU and from the disk, fetches are handed to the background between layers; in a
        # CPU's RAM the tiers move nothing outside the layers, and a step is one pass of the model.
        self.whole_step = device.type == "cpu" and config.slow_tier == "ram"

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        """A generation of the prompts `tokens` (B, S, right-padded to `lengths`) starts: every per-generation
        buffer and count is reset. `held` > 0: each sequence holds that many tokens already (earlier
        turns, kept by the last `finish(keep=True)`), which the prompts continue."""
        if held and self.state.held() != [held] * len(self.state.held()):
            raise ValueError(f"the cache holds {self.state.held()} tokens per sequence, not {held}: a continued "
                             "generation starts where the last one ended")
        if held and self.folder is not None and self.folder.path is None:
            raise ValueError("the slow tier's files went with the last generation (finish without keep)")
        self.state.begin((held + lengths).tolist())
        if self.folder is not None and not held:
            self.folder.open()  # a fresh folder of empty files
        for layer in self.layers:
            layer.reset()
        if not held:
            self.history = lengths.new_zeros(lengths.shape[0], self.state.capacity + 1)  # real tokens, for lookup
        self.history[:, held: held + tokens.shape[1]] = tokens
        self.history_len = held + lengths
        self.guess = self.guessed_from = None
        self.matches = torch.zeros((), dtype=torch.long, device=self.device)

    def ingest(self, recorded: list[tuple[Tensor, Tensor, Optional[list[Tensor]]]]) -> None:
        """Each layer's prompt K, V from a prefill done elsewhere (scripts/harness.py), after `begin`."""
        lengths = torch.tensor(self.state.held(), device=self.device)
        for layer, (k, v, _) in zip(self.model.layers, recorded):
            cache = layer.attention.kv_cache
            if isinstance(cache, RingKVCache):
                cache.ingest_prompt(k, v, lengths)
            else:
                cache.ingest_prompt(k, v)

    def bootstrap(self, model: Transformer, first: Tensor, pos: Tensor) -> None:
        """T1 alone: it chooses kappa_1 and guesses T'2; its K, V are not kept. Eager (once per generation)."""
        if self.speculative:
            with torch.compiler.set_stance("force_eager"):
                self.guess = self.guess_next(self.run(model, first, pos, BOOTSTRAP)[:, -1], self.history,
                                             self.history_len)

    def step(self, model: Transformer, token: Tensor, pos: Tensor) -> Tensor:
        """A decode step: rows [T_t, T'_{t+1}] at [p, p + 1] (or T_t alone, not speculative); the real
        row's logits (B, 1, V)."""
        if not self.speculative:
            logits = self.run(model, token, pos, DECODE)
        else:
            logits = self.run(model, torch.cat([token, self.guess], 1), torch.cat([pos, pos + 1], 1), DECODE)
            self.guessed_from, self.guess_was = logits[:, 1], self.guess
        self.advance()
        return logits[:, :1]

    def sampled(self, token: Tensor) -> None:
        """The real token (B, 1) the loop sampled: kept in the history; the next guess, from the
        speculative row's logits."""
        batch = torch.arange(token.shape[0], device=token.device)
        self.history[batch, self.history_len] = token[:, 0]
        self.history_len.add_(1)
        if self.guessed_from is not None:
            self.matches += (self.guess_was == token).sum()
            self.guess = self.guess_next(self.guessed_from, self.history, self.history_len)

    def finish(self, keep: bool = False) -> None:
        """The generation ended, or failed: the last prefetch has landed (a GPU); the disk's files go unless `keep`."""
        try:
            for layer in self.layers:
                layer.tier.before_layer()
        finally:
            if self.folder is not None and not keep:
                self.folder.close()

    def step_bytes(self, positions: list[int]) -> int:
        return step_bytes(self)

    def stats(self, steps: int) -> dict:
        return cache_stats(self, steps)

    @torch.no_grad()
    def run(self, model: Transformer, tokens: Tensor, input_pos: Tensor, kind: Pass) -> Tensor:
        """One pass of the new rows through every layer, with each tier's hand-offs around its layer
        (none with the slow tier in a CPU's RAM, whose moves happen within the layer's step: there it
        is the model's own pass, which compile_decode can compile whole)."""
        if self.whole_step:
            return model(tokens, input_pos, kind)
        x = model.embed(tokens)
        state = self.state
        for layer, freqs_cis in zip(model.layers, model.rope(input_pos)):
            cache = layer.attention.kv_cache
            tier = cache.tier if isinstance(cache, SpeCacheLayer) else None
            if tier is not None:
                tier.before_layer()
            x = layer(x, input_pos, freqs_cis, kind)
            if tier is not None:
                tier.after_layer(cache.window_k, cache.window_v, state.host_quantized_len, state.host_window_len,
                                 kept=kind.keep, prefetched=bool(cache.k_spec), overlap=self.config.overlap_fetch)
        return model.head(x)

    def advance(self) -> None:
        """After a step that kept the real rows: count them into the windows, and flush full windows."""
        state, g = self.state, self.config.group
        selectable = state.host_selectable_len()
        state.window_len += 1
        state.host_window_len = [r + 1 for r in state.host_window_len]
        full = [b for b, r in enumerate(state.host_window_len) if r == state.residual + g]
        for b in full:
            for layer in self.layers:
                layer.flush_window(b)
            state.host_quantized_len[b] += g
            state.host_window_len[b] -= g
        if full or state.host_selectable_len() != selectable:
            state.sync()
