"""One op per layer: a decode step's whole attention (`specache::step_attention`), for a slow tier
in the same RAM as the fast one (a CPU)."""

from typing import Optional

import torch
from torch import Tensor

from specache.lowbit import LowBitKV
from specache.ops import (
    OPS,
    Segments,
    lowbit_partial_attention,
    merge_segments,
    top_positions,
)
from specache.select import (
    exact_slots,
    first_pick_slot,
    picks_placed,
    prefetch_positions,
    rank_shortlist,
    shortlist_listed,
    take_picks,
)
from specache.tiers import gather_pairs

# On a CPU both tiers are in RAM, and what a step does between its kernels (the low-bit pass, two
# merges, two rankings, the picks' gather and drop, the prefetch's gather) is small: dispatching
# it op by op cost more than computing it (a SmolLM2 step at 1k made about 300 calls). So the
# whole of a layer's attention in a step is one op, which a CPU kernel computes KV head by KV head
# (specache/kernels/step_cpu.cpp). Its definition is the composition the layer runs op by op
# elsewhere.


def step_attention_reference(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    bits: int,
    group: int,
    integer: bool,
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
    discard: Optional[Tensor],
    gqa_max: bool,
    n_sinks: int,
    n_spec: int,
    selectable_len: Tensor,
) -> tuple[Tensor, ...]:
    """A layer's attention in one step, over a slow tier `store_k`, `store_v` (B, Hkv, T, D) in
    the same memory. The rows attend over the four segments (`Segments`: the slots as
    `fetched_valid` and `exact_slots` say).
    - With n_picks, the real row (row 0) first picks that many positions by its low-bit weights
      (with a shortlist, by the exact weights of the `shortlist` x n_picks it lists:
      `rank_shortlist`). Their pairs fill its slots (`first_pick_slot`) and leave the low-bit
      segment.
    - With n_spec, the last row then chooses the prefetch, among [n_sinks, selectable_len[b]),
      and its pairs fill the prefetch's slots.
    Returns the output (B, Hkv, M, D); the slots' new k, v, pos and valid; which picks were placed
    (B, Hkv, n_picks); the prefetch (B, Hkv, n_spec), positions and which are real; and the pairs
    each KV head read from the tier for its picks (B, Hkv). Every slot from the first pick's on
    takes a pick: n_picks is 0, or at least the real row's slots (plus the prefetch's where a
    `discard` is given)."""
    real_slots = fetched_pos.shape[-1] - n_sinks - n_spec
    if n_picks and n_picks < real_slots + (n_spec if discard is not None else 0):
        raise ValueError(
            f"step_attention: {n_picks} picks cannot fill the {real_slots} real-row slots"
            + (f" and the {n_spec} of the prefetch" if discard is not None else "")
        )
    kv = LowBitKV(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, bits, group)
    exact = exact_slots(fetched_valid, fetched_pos, quantized_len, n_sinks, n_spec, discard)
    window = (window_k, window_v, window_len, new_k, new_v)
    seg = Segments(quantized_len, fetched_k, fetched_v, fetched_pos, exact, *window)
    s, gqa = new_k.shape[2], "max" if gqa_max else "mean"
    part = lowbit_partial_attention(rows, kv, seg, "int8" if integer else "float")
    # fresh, not views: an op's outputs never alias its inputs
    nothing = fetched_pos.new_empty(fetched_pos.shape[:2] + (0,))
    placed, read = nothing.bool(), quantized_len.new_zeros(fetched_pos.shape[:2])
    if n_picks:
        merged = merge_segments(rows, part, seg)
        n_listed = min(n_picks * shortlist, k_packed.shape[2]) if shortlist else n_picks
        picks, valid = top_positions(
            part, merged, seg, s, 0, gqa, 0, quantized_len, fetched_pos, exact, n_listed
        )
        first = first_pick_slot(fetched_pos, n_sinks, n_spec, discard)
        placed = picks_placed(n_picks, fetched_pos.shape[-1], first)
        if shortlist:
            listed = shortlist_listed(valid, shortlist, placed)
            listed_k = gather_pairs(store_k, picks)
            chosen, valid = rank_shortlist(rows, part, merged, s, gqa, listed_k, listed, n_picks)
            picks = picks.gather(-1, chosen)
        placed = valid & placed
        read = (listed if shortlist else placed).sum(-1)  # the pairs read from the tier
        pairs = gather_pairs(store_k, picks), gather_pairs(store_v, picks)
        part, seg = take_picks(part, kv, seg, picks, placed, *pairs, first)
    merged = merge_segments(rows, part, seg)
    kappa_pos, kappa_valid = nothing, nothing.bool()
    if n_spec:
        kappa_pos, kappa_valid = prefetch_positions(
            part, merged, seg, gqa, n_sinks, selectable_len, n_spec
        )
    prefetch = slice(n_sinks, n_sinks + n_spec)
    out_k, out_v, out_pos, out_valid = (
        x.clone(memory_format=torch.contiguous_format)
        # the other slots' validity stays as it was (exact_slots reads it)
        for x in (seg.fetched_k, seg.fetched_v, seg.fetched_pos, fetched_valid)
    )
    out_k[:, :, prefetch] = gather_pairs(store_k, kappa_pos).to(out_k.dtype)
    out_v[:, :, prefetch] = gather_pairs(store_v, kappa_pos).to(out_v.dtype)
    out_pos[:, :, prefetch] = kappa_pos
    out_valid[:, :, prefetch] = kappa_valid
    return merged.out, out_k, out_v, out_pos, out_valid, placed, kappa_pos, kappa_valid, read


OPS.define(
    "step_attention(Tensor rows, Tensor k_packed, Tensor k_scale, Tensor k_zero, "
    "Tensor v_packed, Tensor v_scale, Tensor v_zero, int bits, int group, bool integer, "
    "Tensor quantized_len, Tensor fetched_k, Tensor fetched_v, Tensor fetched_pos, "
    "Tensor fetched_valid, Tensor window_k, Tensor window_v, Tensor window_len, Tensor new_k, "
    "Tensor new_v, Tensor store_k, Tensor store_v, int n_picks, int shortlist, Tensor? discard, "
    "bool gqa_max, int n_sinks, int n_spec, Tensor selectable_len) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
OPS.impl("step_attention", step_attention_reference, "CompositeExplicitAutograd")
step_attention = torch.ops.specache.step_attention  # what the layer calls


@torch.library.register_fake("specache::step_attention")
def _(rows, *args):
    fetched_k, fetched_v, fetched_pos, fetched_valid = args[10:14]
    n_picks, n_spec = args[21], args[26]
    b, h = fetched_pos.shape[:2]
    return (  # contiguous, as the kernel's outputs are, whatever the inputs' strides
        rows.new_empty(rows.shape),
        fetched_k.new_empty(fetched_k.shape),
        fetched_v.new_empty(fetched_v.shape),
        fetched_pos.new_empty(fetched_pos.shape),
        fetched_valid.new_empty(fetched_valid.shape),
        fetched_valid.new_empty(b, h, n_picks),
        fetched_pos.new_empty(b, h, n_spec),
        fetched_valid.new_empty(b, h, n_spec),
        fetched_pos.new_empty(b, h),
    )
