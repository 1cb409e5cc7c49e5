"""A layer's attention in a decode step, written once (`attend_and_choose`): the two rows over the
four segments, the real row's picks within the step, the next prefetch. The layer runs it op by op
where its slow tier is elsewhere (specache/layer.py); with the slow tier in the same RAM (a CPU) it
is one op per layer (`specache::step_attention`), whose CPU kernel (specache/kernels/step_cpu.cpp)
computes it KV head by KV head."""

from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from specache.config import ARITHMETICS
from specache.lowbit import LowBitKV
from specache.ops import (
    LowBitPart,
    Merged,
    Segments,
    declare,
    lowbit_partial_attention,
    merge_segments,
    top_positions,
)
from specache.select import (
    exact_slots,
    first_pick_slot,
    picks_placed,
    prefetch_missed,
    prefetch_positions,
    rank_shortlist,
    shortlist_listed,
    take_picks,
)
from specache.tiers import gather_pairs, prefetch_reads


class StepAttention(NamedTuple):
    """What a layer's attention in a decode step gives (`attend_and_choose`)."""

    out: Tensor  # (B, Hkv, M, D) fp32
    seg: Segments  # the slots as the step leaves them: the real row's picks placed
    placed: Tensor  # (B, Hkv, n_picks): which picks took a slot
    kappa_pos: Tensor  # (B, Hkv, n_spec): the next prefetch, best first
    kappa_valid: Tensor
    read: Tensor  # (B, Hkv): the pairs each KV head read from the slow tier for its picks


def attend_and_choose(
    rows: Tensor,
    kv: LowBitKV,
    arithmetic: str,
    min_weight: float,
    seg: Segments,
    read_pairs: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    n_picks: int,
    shortlist: int,
    discard: Optional[Tensor],
    gqa: str,
    n_sinks: int,
    n_spec: int,
    selectable_len: Tensor,
    oracle: Optional[Callable[[LowBitPart, Merged, Segments], tuple[Tensor, Tensor]]] = None,
) -> StepAttention:
    """A layer's attention in one decode step, written once: the one op's definition below, and
    the layer's step op by op (specache/layer.py), are this composition. The rows attend over the
    four segments of `seg` (its slots' validity as `exact_slots` says), the low-bit one in
    `arithmetic` (specache.Method's, the sparse pass at `min_weight`).
    - With n_picks, the real row (row 0) first picks that many positions by its low-bit weights
      (with a shortlist, by the exact weights of the `shortlist` x n_picks it lists:
      `rank_shortlist`; or as the `oracle` chooses). Their pairs, read with `read_pairs(positions,
      valid)`, fill its slots (`first_pick_slot`) and leave the low-bit segment.
    - With n_spec, the last row then chooses the prefetch, among [n_sinks, selectable_len[b]).
    Every slot from the first pick's on takes a pick: n_picks is 0, or at least the real row's
    slots (plus the prefetch's where a `discard` is given)."""
    s = seg.new_k.shape[2]
    part = lowbit_partial_attention(rows, kv, seg, arithmetic, min_weight)
    # fresh, not views: an op's outputs never alias its inputs
    nothing = seg.fetched_pos.new_empty(seg.fetched_pos.shape[:2] + (0,))
    placed, read = nothing.bool(), seg.quantized_len.new_zeros(seg.fetched_pos.shape[:2])
    if n_picks:
        merged = merge_segments(rows, part, seg)
        first = first_pick_slot(seg.fetched_pos, n_sinks, n_spec, discard)
        placed = picks_placed(n_picks, seg.fetched_pos.shape[-1], first)
        if oracle is not None:
            picks, valid = oracle(part, merged, seg)
        else:  # candidates: quantized, not held in a valid slot
            n_listed = min(n_picks * max(shortlist, 1), kv.k_packed.shape[2])
            picks, valid = top_positions(
                part,
                merged,
                seg,
                s,
                0,
                gqa,
                0,
                seg.quantized_len,
                seg.fetched_pos,
                seg.fetched_valid,
                n_listed,
            )
        if shortlist:  # the listed pairs read at once
            listed = shortlist_listed(valid, shortlist, placed)
            listed_k, listed_v = read_pairs(picks, listed)
            read = listed.sum(-1)
            chosen, valid = rank_shortlist(rows, part, merged, s, gqa, listed_k, listed, n_picks)
            picks = picks.gather(-1, chosen)
            pairs = gather_pairs(listed_k, chosen), gather_pairs(listed_v, chosen)
            placed = valid & placed
        else:
            placed = valid & placed
            pairs = read_pairs(picks, placed)
            read = placed.sum(-1)
        part, seg = take_picks(part, kv, seg, picks, placed, *pairs, first)
    merged = merge_segments(rows, part, seg)
    kappa_pos, kappa_valid = nothing, nothing.bool()
    if n_spec:
        kappa_pos, kappa_valid = prefetch_positions(
            part, merged, seg, gqa, n_sinks, selectable_len, n_spec
        )
    return StepAttention(merged.out, seg, placed, kappa_pos, kappa_valid, read)


# Why one op: on a CPU both tiers are in RAM, and what a step does between its kernels (the
# low-bit pass, two merges, two rankings, the picks' gather and drop, the prefetch's gather) is
# small: dispatching it op by op cost more than computing it (a SmolLM2 step at 1k made about 300
# calls).


class StepOutputs(NamedTuple):
    """What the one op gives (`step_attention_reference`)."""

    out: Tensor  # (B, Hkv, M, D) fp32
    fetched_k: Tensor  # the slots' new contents, the prefetch's filled
    fetched_v: Tensor
    fetched_pos: Tensor
    fetched_valid: Tensor
    placed: Tensor  # (B, Hkv, n_picks): which picks took a slot
    kappa_pos: Tensor  # (B, Hkv, n_spec): the prefetch, best first
    kappa_valid: Tensor  # which of them are real
    # (B, Hkv): the pairs each KV head read from the tier, for its picks and for the prefetch (with
    # reuse, the prefetch's that `held_pos` did not hold)
    read: Tensor
    discarded: Tensor  # (B, Hkv) bool: the KV heads whose prefetch was discarded (correct)


def step_attention_reference(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    v_mean: Optional[Tensor],
    bits: int,
    group: int,
    arithmetic: int,
    min_weight: float,
    quantized_len: Tensor,
    fetched_k: Tensor,
    fetched_v: Tensor,
    fetched_pos: Tensor,
    fetched_valid: Tensor,
    window_k: Tensor,
    window_v: Tensor,
    window_len: Tensor,
    new_k: Tensor,
    new_v: Tensor,
    store_k: Tensor,
    store_v: Tensor,
    n_picks: int,
    shortlist: int,
    last_query: Optional[Tensor],
    correct_below: float,
    gqa_max: bool,
    n_sinks: int,
    n_spec: int,
    selectable_len: Tensor,
    held_pos: Tensor,
    held_valid: Tensor,
    reuse: bool,
) -> StepOutputs:
    """`attend_and_choose` over a slow tier `store_k`, `store_v` (B, Hkv, T, D) in the same
    memory, whose pairs it gathers itself, the prefetch's too; `arithmetic` indexes
    specache.config.ARITHMETICS. With `last_query` (B, H, D), the rows that chose the prefetch
    now in the slots, a KV head whose real rows' mean cosine to them is below `correct_below`
    discards it (`prefetch_missed`); `held_pos`, `held_valid` (B, Hkv, n_spec): that prefetch's
    positions, which `read` does not count again where the new prefetch holds them (`reuse`).
    What the step did in Python around an op of its own (a decode step's eager dispatch), in
    one."""
    real_slots = fetched_pos.shape[-1] - n_sinks - n_spec
    s = new_k.shape[2]
    discard = None if last_query is None else prefetch_missed(rows, last_query, s, correct_below)
    if n_picks and n_picks < real_slots + (n_spec if discard is not None else 0):
        raise ValueError(
            f"step_attention: {n_picks} picks cannot fill the {real_slots} real-row slots"
            + (f" and the {n_spec} of the prefetch" if discard is not None else "")
        )
    kv = LowBitKV(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, bits, group, v_mean)
    exact = exact_slots(fetched_valid, fetched_pos, quantized_len, n_sinks, n_spec, discard)
    window = (window_k, window_v, window_len, new_k, new_v)
    seg = Segments(quantized_len, fetched_k, fetched_v, fetched_pos, exact, *window)

    def read_pairs(positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        return gather_pairs(store_k, positions), gather_pairs(store_v, positions)

    step = attend_and_choose(
        rows,
        kv,
        ARITHMETICS[arithmetic],
        min_weight,
        seg,
        read_pairs,
        n_picks,
        shortlist,
        discard,
        "max" if gqa_max else "mean",
        n_sinks,
        n_spec,
        selectable_len,
    )
    prefetch = slice(n_sinks, n_sinks + n_spec)
    out_k, out_v, out_pos, out_valid = (
        x.clone(memory_format=torch.contiguous_format)
        # the other slots' validity stays as it was (exact_slots reads it)
        for x in (step.seg.fetched_k, step.seg.fetched_v, step.seg.fetched_pos, fetched_valid)
    )
    out_k[:, :, prefetch] = gather_pairs(store_k, step.kappa_pos).to(out_k.dtype)
    out_v[:, :, prefetch] = gather_pairs(store_v, step.kappa_pos).to(out_v.dtype)
    out_pos[:, :, prefetch] = step.kappa_pos
    out_valid[:, :, prefetch] = step.kappa_valid
    placed, kappa = step.placed, (step.kappa_pos, step.kappa_valid)
    read = step.read + prefetch_reads(*kappa, held_pos, held_valid, reuse)
    discarded = torch.zeros_like(read, dtype=torch.bool) if discard is None else discard
    return StepOutputs(step.out, out_k, out_v, out_pos, out_valid, placed, *kappa, read, discarded)


def step_shapes(a: SimpleNamespace) -> StepOutputs:
    b, h = a.fetched_pos.shape[:2]
    return StepOutputs(  # contiguous, as the kernel's outputs are, whatever the inputs' strides
        a.rows.new_empty(a.rows.shape),
        a.fetched_k.new_empty(a.fetched_k.shape),
        a.fetched_v.new_empty(a.fetched_v.shape),
        a.fetched_pos.new_empty(a.fetched_pos.shape),
        a.fetched_valid.new_empty(a.fetched_valid.shape),
        a.fetched_valid.new_empty(b, h, a.n_picks),
        a.fetched_pos.new_empty(b, h, a.n_spec),
        a.fetched_valid.new_empty(b, h, a.n_spec),
        a.fetched_pos.new_empty(b, h),
        a.fetched_valid.new_empty(b, h),
    )


declare(step_attention_reference, step_shapes)
step_attention = torch.ops.specache.step_attention  # what the layer calls
