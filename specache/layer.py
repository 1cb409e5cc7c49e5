"""One layer's SpeCache: its fast tier (the low-bit copy, the 16-bit window, the exact pairs in
slots), its slow tier, and its passes: a prompt's, and a decode step's."""

from typing import Callable, Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from specache.config import ARITHMETICS, fast_tier_layout
from specache.lowbit import LowBitKV, quantize_keys, quantize_values
from specache.ops import LowBitPart, Merged, Segments, query_rows
from specache.prefill import attention_after_history, history_block
from specache.select import exact_slots, prefetch_missed
from specache.sparse import value_means
from specache.state import DECODE, PREFILL, SpeCacheState
from specache.step import StepOutputs, attend_and_choose, step_attention
from specache.tiers import Kappa, PrefetchSlots, SlowTier, TierSpec, prefetch_reads


class Probe(Protocol):
    """Diagnostics plugged in from outside (this repository's caches/stats.py); the method
    never needs one. `oracle`: the real row's picks come from `oracle_picks` instead of its
    low-bit weights."""

    oracle: bool

    def reset(self) -> None:
        """A generation begins."""

    def oracle_picks(
        self,
        layer: "SpeCacheLayer",
        rows: Tensor,
        part: "LowBitPart",
        merged: "Merged",
        seg: "Segments",
        s: int,
    ) -> tuple[Tensor, Tensor]:
        """The real row's `layer.picks` positions (B, Hkv, picks), and which are real."""

    def observe(self, layer: "SpeCacheLayer", rows: Tensor, seg: "Segments", s: int) -> None:
        """A decode step's pass through `layer`, before the prefetch rewrites its slots."""


class SpeCacheLayer(nn.Module):
    """One layer's SpeCache: the host's attention hands it the new rows' q, k, v and takes the
    attention output (`forward`).

    The exact pairs a step reads besides the window sit in one buffer of slots per KV head:
    [sinks | the speculative prefetch (k_spec) | the real row's picks (k_real)], k_spec + k_real =
    k. The buffers are `fast_tier_layout`'s.

    Our changes to the paper's rule act where marked "(ours: NAME)", NAME as --specache_select
    calls it; the paper's rule (`PAPER`) sets each to nothing: no sinks, no split (the prefetch
    takes all k), no correction, no reuse. The others act elsewhere: the picks' shortlist in
    select.py, gqa-max in ops.py's ranking, the levels in lowbit.py, the guess in guess.py.
    """

    def __init__(
        self,
        state: SpeCacheState,
        index: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        make_tier: Callable[[TierSpec], SlowTier],
        probe: Optional[Probe] = None,
    ):
        """`dtype`: the exact pairs' (window, slots, slow tier)."""
        super().__init__()
        c, b, t = state.config, state.quantized_len.shape[0], state.capacity
        m, sel = c.method, c.selection
        self.state, self.config, self.index, self.probe = state, c, index, probe
        quantizable = max(0, t - state.residual) // m.group * m.group
        self.n_sinks = min(sel.sinks, quantizable, state.max_slots)  # (ours: sinks)
        k = min(m.topk, quantizable, state.max_slots - self.n_sinks)
        self.k_real = k if not m.speculative else int(k * sel.real_share + 0.5)  # (ours: split)
        self.k_spec = k - self.k_real
        self.correcting = sel.correct_below is not None and self.k_spec > 0  # (ours: correct)
        self.picks = k if self.correcting else self.k_real  # a head that discards its prefetch
        slots = self.n_sinks + k
        self.spec_slots = slice(self.n_sinks, self.n_sinks + self.k_spec)
        query_heads = n_heads // n_kv_heads
        layout = fast_tier_layout(
            c, t, state.residual, slots, self.k_spec, head_dim, query_heads, dtype, self.correcting
        )
        for name, (shape, buffer_dtype) in layout.items():
            buffer = torch.zeros(b, n_kv_heads, *shape, dtype=buffer_dtype, device=device)
            if name == "last_query":  # kept per query head: (B, H, D)
                buffer = buffer.flatten(1, 2)
            self.register_buffer(name, buffer, persistent=False)
        # per sequence, this generation: pairs read from the slow tier; correct: the KV heads whose
        # prefetch was discarded, of those checked
        for name in ("pairs_read", "heads_discarded", "heads_checked"):
            counter = torch.zeros(b, dtype=torch.long, device=device)
            self.register_buffer(name, counter, persistent=False)
        self.fetched_pos[:, :, : self.n_sinks] = torch.arange(self.n_sinks, device=device)
        self.fetched_valid[:, :, : self.n_sinks] = True  # counted while quantized (below Lq)
        prefetch = None
        if self.k_spec:
            buffers = (self.fetched_k, self.fetched_v, self.fetched_pos, self.fetched_valid)
            prefetch = PrefetchSlots(*buffers, where=self.spec_slots)
        spec = TierSpec(
            shape=(b, n_kv_heads, t, head_dim),
            dtype=dtype,
            device=torch.device(device),
            slots=prefetch,
            reuse=sel.reuse,
            overlap=c.placement.overlap_fetch,
            state=state,
        )
        self.tier = make_tier(spec)

    def reset(self, rows: Optional[list[int]] = None) -> None:
        """A generation starts (in `rows` only: see "rows"): nothing fetched, chosen or counted
        yet."""
        self.tier.reset(rows)  # first: a prefetch in flight lands before the slots are cleared
        rows = slice(None) if rows is None else rows
        self.fetched_valid[rows, :, self.n_sinks :] = False
        self.kappa_valid[rows] = False
        for count in (self.pairs_read, self.heads_discarded, self.heads_checked):
            count[rows] = 0
        if self.correcting:  # (ours: correct)
            self.last_query[rows] = 0

    # --- the low-bit copy and the window -------------------------------------------------------

    def lowbit(self) -> LowBitKV:
        m = self.config.method
        keys = (self.k_packed, self.k_scale, self.k_zero)
        values = (self.v_packed, self.v_scale, self.v_zero)
        v_mean = self.v_mean if m.arithmetic == "sparse" else None  # (ours: the sparse pass)
        return LowBitKV(*keys, *values, m.bits, m.group, v_mean)

    def _quantize_into(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Quantize k, v (Hkv, N, D) of sequence b (N a multiple of g) into positions [start,
        start + N); the sinks among them keep their 16-bit pairs."""
        m, levels, n = self.config.method, self.config.selection.levels, k.shape[1]
        g, keys = m.group, slice(start // m.group, (start + n) // m.group)
        packed, scale, zero = quantize_keys(k, m.bits, g, self.k_scale.dtype, levels)
        self.k_packed[b, :, start : start + n] = packed
        self.k_scale[b, :, keys] = scale
        self.k_zero[b, :, keys] = zero
        packed, scale, zero = quantize_values(v, m.bits, g, self.v_scale.dtype, levels)
        self.v_packed[b, :, start : start + n] = packed
        self.v_scale[b, :, start : start + n] = scale
        self.v_zero[b, :, start : start + n] = zero
        if m.arithmetic == "sparse":  # (ours: the sparse pass) each new group's mean value
            self.v_mean[b, :, keys] = value_means(packed, scale, zero, m.bits, g)
        sinks = max(0, min(self.n_sinks, start + n) - start)  # (ours: sinks)
        self.fetched_k[b, :, start : start + sinks] = k[:, :sinks].to(self.fetched_k.dtype)
        self.fetched_v[b, :, start : start + sinks] = v[:, :sinks].to(self.fetched_v.dtype)

    def ingest_prompt(
        self, k: Tensor, v: Tensor, start: int = 0, rows: Optional[list[int]] = None
    ) -> None:
        """After the prompt's attention: its rows k, v (B, Hkv, S, D) at positions [start, start
        + S), up to each prompt's end (as `SpeCache.begin` set it), join the window, whose whole
        groups beyond the newest R are quantized, and go to the slow tier: in one piece or in
        chunks, the same groups. `rows`: the cache rows of k's sequences (default: all)."""
        # quantized from the 16-bit pairs, as flushes are
        k, v = k.to(self.window_k.dtype), v.to(self.window_v.dtype)
        held = self.state.held()
        for i, b in enumerate(range(len(held)) if rows is None else rows):
            end = min(held[b], start + k.shape[2])
            if end <= start:
                continue  # right padding only, in this chunk
            (lq0, r0), (lq1, r1) = self.state.split(start), self.state.split(end)
            rows_k, rows_v = k[i, :, : end - start], v[i, :, : end - start]
            pending_k = torch.cat([self.window_k[b, :, :r0], rows_k], 1)  # positions [lq0, end)
            pending_v = torch.cat([self.window_v[b, :, :r0], rows_v], 1)
            if lq1 > lq0:
                self._quantize_into(b, lq0, pending_k[:, : lq1 - lq0], pending_v[:, : lq1 - lq0])
            self.window_k[b, :, :r1] = pending_k[:, lq1 - lq0 :]
            self.window_v[b, :, :r1] = pending_v[:, lq1 - lq0 :]
            self.tier.write(b, start, rows_k, rows_v)

    def history_blocks(self, start: int, block: int, rows: Optional[list[int]] = None):
        """The pairs of positions [0, start) as (K, V) blocks (B, Hkv, <= block, D), in order:
        exact, from the slow tier; with nothing to fetch (KIVI), as its decode steps read them:
        the low-bit copy below Lq, but the sinks. `rows`: those rows' only."""
        lq = self.state.split(start)[0] if self.config.method.topk == 0 else 0
        for first in range(0, start, block):
            k, v = self.tier.read_range(first, min(start, first + block), rows)
            # whole groups: block is a multiple of g
            # (ours: sinks) exact, from the tier, even where KIVI reads the copy
            low, sinks = min(lq, first + block) - first, max(0, self.n_sinks - first)
            if low > sinks:
                low_k, low_v = self.lowbit().dequantized(first, first + low)
                if rows is not None:
                    low_k, low_v = low_k[rows], low_v[rows]
                # a copy, never the tier's own storage
                k, v = k.to(torch.float32, copy=True), v.to(torch.float32, copy=True)
                k[:, :, sinks:low], v[:, :, sinks:low] = low_k[:, :, sinks:], low_v[:, :, sinks:]
            yield k, v

    def flush_window(self, b: int) -> None:
        """Sequence b's window holds R + g tokens: quantize the oldest g (their 16-bit pairs are
        in the slow tier already) and slide the window down by g. (Ours: KIVI quantizes its whole
        window when it reaches R, which leaves 0 to R - 1 recent tokens in 16 bits.)"""
        start, g = self.state.host_quantized_len[b], self.config.method.group
        self._quantize_into(b, start, self.window_k[b, :, :g], self.window_v[b, :, :g])
        self.window_k[b, :, :-g] = self.window_k[b, :, g:].clone()
        self.window_v[b, :, :-g] = self.window_v[b, :, g:].clone()

    # --- a pass ----------------------------------------------------------------------------------

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask=None) -> Tensor:
        """The attention of new rows q (B, H, S, D), with their k, v (B, Hkv, S, D) at positions
        input_pos (B, S), as the shared state's phase says; `mask` is not read (SpeCache knows
        what each row sees)."""
        if self.state.phase == PREFILL:
            return self.prefill(q, k, v, int(input_pos[0, 0]))
        self.tier.before_step()
        return self.step(q, k, v, keep=self.state.phase == DECODE)

    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, start: int, rows: Optional[list[int]] = None
    ) -> Tensor:
        """A prompt's rows from position `start` (every sequence's, right-padded; or those on
        `rows`): full precision, over the history as the slow tier holds it (prefill is bound by
        compute); then they join the cache."""
        if start == 0:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            block = history_block(*q.shape, self.config.method.group)
            y = attention_after_history(q, k, v, self.history_blocks(start, block, rows))
        self.ingest_prompt(k, v, start, rows)
        return y

    def step(self, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> Tensor:
        """The new rows (B, H, S, D) over the history in mixed precision; the last row chooses the
        next prefetch; with `keep`, the real row's K, V join the window and the slow tier."""
        b, n_heads, s, d = q.shape
        rows = query_rows(q, k.shape[1])
        correct = self.correcting and keep  # (ours: correct)
        if self.tier.gathered_in_step and self.probe is None:
            out, kappa = self.step_in_ram(rows, k, v, correct)
        else:
            discard = self.prefetch_missed(rows, s) if correct else None
            out, kappa = self.step_in_parts(rows, k, v, keep, discard)
        if self.correcting:  # (ours: correct) the rows that chose the next prefetch
            last = rows.unflatten(2, (-1, s))[:, :, :, -1].flatten(1, 2)  # (B, H, D)
            self.state.write_moved(self.last_query, last)
        new_k = new_v = None
        if keep:
            new_k, new_v = self.append_real_row(k[:, :, 0], v[:, :, 0])
        self.tier.after_step(new_k, new_v, kappa)
        return out.reshape(b, n_heads, s, d).to(q.dtype)

    def segments(self, k: Tensor, v: Tensor, fetched_valid: Tensor) -> Segments:
        state = self.state
        buffers = (self.fetched_k, self.fetched_v, self.fetched_pos, fetched_valid)
        window = (self.window_k, self.window_v, state.window_len)
        return Segments(state.quantized_len, *buffers, *window, k, v)

    def step_in_ram(self, rows: Tensor, k: Tensor, v: Tensor, correct: bool) -> tuple[Tensor, None]:
        """A step whose slow tier is in the same RAM: one op (`specache::step_attention`), which
        also checks the prefetch (correct), places the next one and counts the pairs read; the
        tier then only stores the real row."""
        m, sel, kv, state = self.config.method, self.config.selection, self.lowbit(), self.state
        step = StepOutputs(
            *step_attention(
                rows,
                *kv[:6],
                kv.v_mean,
                m.bits,
                m.group,
                ARITHMETICS.index(m.arithmetic),
                m.min_weight,
                *self.segments(k, v, self.fetched_valid),
                self.tier.k,
                self.tier.v,
                self.picks,
                sel.shortlist,
                self.last_query if correct else None,
                sel.correct_below if correct else 0.0,
                sel.gqa == "max",
                self.n_sinks,
                self.k_spec,
                state.selectable_len,
                self.kappa_pos,
                self.kappa_valid,
                sel.reuse,
            )
        )
        for buffer, new in zip(
            (self.fetched_k, self.fetched_v, self.fetched_pos, self.fetched_valid),
            (step.fetched_k, step.fetched_v, step.fetched_pos, step.fetched_valid),
        ):
            state.write_moved(buffer, new)
        self.pairs_read += step.read.sum(-1) * state.stepping
        if correct:
            self.count_discards(step.discarded)
        if self.k_spec:
            state.write_moved(self.kappa_pos, step.kappa_pos)
            state.write_moved(self.kappa_valid, step.kappa_valid)
        return step.out, None

    def step_in_parts(
        self, rows: Tensor, k: Tensor, v: Tensor, keep: bool, discard: Optional[Tensor]
    ) -> tuple[Tensor, Optional[Kappa]]:
        """A step op by op (`attend_and_choose`, the one op's composition), for a slow tier
        elsewhere (it reads the picks' pairs, and places the prefetch) or a probe (which watches,
        or picks as the oracle): the output and the prefetch for the tier to place."""
        state, sel, s = self.state, self.config.selection, k.shape[2]
        exact = exact_slots(
            self.fetched_valid,
            self.fetched_pos,
            state.quantized_len,
            self.n_sinks,
            self.k_spec,
            discard,
        )
        oracle = None
        if self.probe is not None and self.probe.oracle:

            def oracle(part: LowBitPart, merged: Merged, seg: Segments) -> tuple[Tensor, Tensor]:
                return self.probe.oracle_picks(self, rows, part, merged, seg, s)

        step = attend_and_choose(
            rows,
            self.lowbit(),
            self.config.method.arithmetic,
            self.config.method.min_weight,
            self.segments(k, v, exact),
            self.tier.read,
            self.picks,
            sel.shortlist,
            discard,
            sel.gqa,
            self.n_sinks,
            self.k_spec,
            state.selectable_len,
            oracle,
        )
        if self.picks:
            self.pairs_read += step.read.sum(-1) * state.stepping
            picked = (step.seg.fetched_k, step.seg.fetched_v, step.seg.fetched_pos)
            for buffer, new in zip((self.fetched_k, self.fetched_v, self.fetched_pos), picked):
                state.write_moved(buffer, new)
        if self.probe is not None and keep:  # before the prefetch rewrites the slots seg reads
            self.probe.observe(self, rows, step.seg, s)
        if not self.k_spec:
            return step.out, None
        return step.out, self.choose_prefetch(step.kappa_pos, step.kappa_valid)

    def prefetch_missed(self, rows: Tensor, s: int) -> Tensor:
        """correct: the KV heads (B, Hkv) whose real rows moved away from those that chose the
        prefetch."""
        threshold = self.config.selection.correct_below
        discard = prefetch_missed(rows, self.last_query, s, threshold)
        self.count_discards(discard)
        return discard

    def count_discards(self, discard: Tensor) -> None:
        self.heads_discarded += discard.sum(-1) * self.state.stepping
        self.heads_checked += discard.shape[-1] * self.state.stepping

    def choose_prefetch(self, kappa_pos: Tensor, kappa_valid: Tensor) -> Kappa:
        """kappa_{t+1}: the last row's top-k_spec positions (B, Hkv, k_spec), among those
        quantized by the next step and not sinks. Counted as read: with reuse (ours), only those
        the previous prefetch did not hold."""
        reuse = self.config.selection.reuse
        new = prefetch_reads(kappa_pos, kappa_valid, self.kappa_pos, self.kappa_valid, reuse)
        self.pairs_read += new.sum(-1) * self.state.stepping
        self.state.write_moved(self.kappa_pos, kappa_pos)
        self.state.write_moved(self.kappa_valid, kappa_valid)
        return Kappa(self.kappa_pos, self.kappa_valid)

    def append_real_row(self, new_k: Tensor, new_v: Tensor) -> tuple[Tensor, Tensor]:
        """The real row's K, V (B, Hkv, D) join the window (and, returned in the pairs' dtype,
        the slow tier); the speculative row's are dropped."""
        new_k, new_v = new_k.to(self.window_k.dtype), new_v.to(self.window_v.dtype)
        rows, at, k_rows, v_rows = self.state.at_moved(self.state.window_len, new_k, new_v)
        self.window_k[rows, :, at] = k_rows
        self.window_v[rows, :, at] = v_rows
        return new_k, new_v

    def fast_tier_bytes(self) -> int:
        """The layer's fast-tier buffers, all sequences (not its counters)."""
        counters = ("pairs_read", "heads_discarded", "heads_checked")
        return sum(
            t.numel() * t.element_size() for name, t in self.named_buffers() if name not in counters
        )
