"""The choice of exact pairs within a step, beyond the ranking op: the real row's picks (the
shortlist, their placement in the slots and their drop from the low-bit pass), the prefetch's
positions, and the correction of a missed prefetch."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from specache.lowbit import LowBitKV, dequantize_values
from specache.ops import LowBitPart, Merged, Segments, top_positions


def prefetch_missed(rows: Tensor, last_query: Tensor, s: int, threshold: float) -> Tensor:
    """correct: (B, Hkv) bool, the KV heads whose real rows (row 0 of each query head's s rows in
    rows (B, Hkv, G*s, D), as `query_rows` lays them out) and the rows that chose their prefetch,
    last_query (B, Hkv*G, D), have a mean cosine (over the head's query heads) below
    `threshold`."""
    b, h, m, d = rows.shape
    real = rows.view(b, h, m // s, s, d)[:, :, :, 0]
    cosine = F.cosine_similarity(real, last_query.view(b, h, m // s, d).float(), dim=-1)
    return cosine.mean(-1) < threshold


def rank_shortlist(
    rows: Tensor,
    part: LowBitPart,
    merged: Merged,
    s: int,
    gqa: str,
    listed_k: Tensor,
    listed_valid: Tensor,
    k: int,
) -> tuple[Tensor, Tensor]:
    """shortlist (ours): of the positions the copy listed for the real row (row 0), whose 16-bit
    keys `listed_k` (B, Hkv, N, D) were read, the k its exact keys weigh most, per KV head: their
    indices into the list (B, Hkv, k), best first, and which are real. An exact key weighs
    exp(score - row_max) times the low-bit pass's scale, the probability the copy's own weights
    are ranked in, so that the max (or mean) over query heads compares like with like."""
    b, h, m, d = rows.shape
    real = rows.view(b, h, m // s, s, d)[:, :, :, 0]  # (B, Hkv, G, D)
    scores = real @ listed_k.to(real.dtype).transpose(-1, -2)  # (B, Hkv, G, N)
    row_max = part.row_max.view(b, h, m // s, s)[..., 0, None]
    scale = merged.lowbit_scale.view(b, h, m // s, s)[..., 0, None]
    # an exact score far above the copy's largest would overflow, and inf x a scale of 0 is NaN
    weight = torch.exp((scores - row_max).clamp(max=60.0)) * scale
    ranking = weight.amax(2) if gqa == "max" else weight.mean(2)
    top = ranking.masked_fill(~listed_valid, -1.0).topk(k, dim=-1)
    return top.indices, top.values >= 0


def shortlist_listed(valid: Tensor, shortlist: int, placed: Tensor) -> Tensor:
    """Which of the copy's ranked candidates (valid: B, Hkv, N) the shortlist lists and reads:
    `shortlist` per pick the KV head places (`placed`: B, Hkv, P)."""
    listed = torch.arange(valid.shape[-1], device=valid.device)
    return valid & (listed < shortlist * placed.sum(-1, keepdim=True))


def dequantize_values_at(kv: LowBitKV, positions: Tensor) -> Tensor:
    """The low-bit copy's values (B, Hkv, K, D), fp32, at positions (B, Hkv, K)."""

    def at(x: Tensor) -> Tensor:
        return x.gather(2, positions.unsqueeze(-1).expand(*positions.shape, x.shape[-1]))

    return dequantize_values(at(kv.v_packed), at(kv.v_scale), at(kv.v_zero), kv.bits, kv.group)


DROP_ROUNDING = 1e-5  # of a row's low-bit sum: what a subtraction from it can leave as noise


def drop_from_lowbit(
    part: LowBitPart, kv: LowBitKV, positions: Tensor, valid: Tensor
) -> LowBitPart:
    """`part` as if the valid `positions` (B, Hkv, K; the valid ones distinct per head, invalid
    ones anywhere) had been excluded from the low-bit pass: their weights and weighted values are
    subtracted. This is how positions chosen from the pass's own weights move to the 16-bit
    segment without a second pass; the error is that of the subtraction, a few ulps of the row's
    low-bit sum (a row left with less than DROP_ROUNDING of it is left with nothing). Positions
    already at weight 0 (excluded or invisible) change nothing."""
    m = part.weights.shape[2]
    index = positions.unsqueeze(2).expand(-1, -1, m, -1)  # (B, Hkv, M, K)
    dropped = part.weights.gather(-1, index) * valid.unsqueeze(2)
    out = part.out - dropped @ dequantize_values_at(kv, positions)
    row_sum = part.row_sum - dropped.sum(-1)
    # what is left below the subtraction's rounding is noise, and the merge would scale it up
    # where the picks held nearly all the low-bit weight: nothing is left
    left = row_sum > part.row_sum * DROP_ROUNDING
    row_sum, out = torch.where(left, row_sum, 0.0), torch.where(left.unsqueeze(-1), out, 0.0)
    # index_put, not scatter_add: torch.compile updates a buffer in place only for index_put (a
    # scatter copies the whole (B, Hkv, M, T) tensor first); invalid entries add 0, wherever they
    # point
    b, h, device = positions.shape[0], positions.shape[1], index.device
    at = (
        torch.arange(b, device=device)[:, None, None, None],
        torch.arange(h, device=device)[:, None, None],
        torch.arange(m, device=device)[:, None],
        index,
    )
    weights = part.weights.index_put(at, -dropped, accumulate=True)
    return LowBitPart(weights, part.row_max, row_sum, out)


# The exact pairs' slots (B, Hkv, K) of one layer: [sinks | the prefetch (k_spec) | the real row's
# picks (k_real)]. A step reads the sinks and the prefetch (unless a KV head discards it), and
# refills the real row's slots (or, where its KV head discards the prefetch, all k).


def exact_slots(
    fetched_valid: Tensor,
    fetched_pos: Tensor,
    quantized_len: Tensor,
    n_sinks: int,
    n_spec: int,
    discard: Optional[Tensor],
) -> Tensor:
    """Which slots count now (B, Hkv, K): sinks and the prefetch, at positions quantized already
    (a pair chosen while its position was in the window counts once it leaves it); not the real
    row's slots, which the step refills; not the prefetch of a KV head in `discard` (B, Hkv)."""
    exact = fetched_valid & (fetched_pos < quantized_len[:, None, None])
    exact[:, :, n_sinks + n_spec :] = False
    if discard is not None:
        exact[:, :, n_sinks : n_sinks + n_spec] &= ~discard.unsqueeze(-1)
    return exact


def first_pick_slot(
    fetched_pos: Tensor, n_sinks: int, n_spec: int, discard: Optional[Tensor]
) -> Tensor:
    """(B, Hkv, 1): the slot of the real row's first pick; the prefetch's first slot for a KV head
    in `discard`."""
    first = torch.full(fetched_pos.shape[:2] + (1,), n_sinks + n_spec, device=fetched_pos.device)
    return first if discard is None else torch.where(discard.unsqueeze(-1), n_sinks, first)


def picks_placed(n_picks: int, n_slots: int, first: Tensor) -> Tensor:
    """(B, Hkv, n_picks): which picks find a slot from `first` on."""
    return torch.arange(n_picks, device=first.device) < n_slots - first


def place_picks(picks: Tensor, slots: Tensor, first: Tensor) -> Tensor:
    """`slots` (B, Hkv, K, ...) with slot j >= first[b, h] holding pick j - first of `picks` (B,
    Hkv, P, ...), in order."""
    extra = [1] * (picks.dim() - 3)
    slot = torch.arange(slots.shape[2], device=slots.device)
    rank = (slot - first).clamp(0, picks.shape[2] - 1).view(*first.shape[:2], -1, *extra)
    index = rank.expand(*rank.shape[:3], *picks.shape[3:])
    taken = (slot >= first).view(*rank.shape)
    return torch.where(taken, picks.gather(2, index), slots)


def take_picks(
    part: LowBitPart,
    kv: LowBitKV,
    seg: Segments,
    picks: Tensor,
    placed: Tensor,
    pair_k: Tensor,
    pair_v: Tensor,
    first: Tensor,
) -> tuple[LowBitPart, Segments]:
    """The real row's picks (B, Hkv, P) in the slots from `first` on (`place_picks`), with their
    pairs pair_k, pair_v (B, Hkv, P, D) and as valid as `placed` says; the placed ones leave the
    low-bit segment (`drop_from_lowbit`)."""
    seg = seg._replace(
        fetched_k=place_picks(pair_k.to(seg.fetched_k.dtype), seg.fetched_k, first),
        fetched_v=place_picks(pair_v.to(seg.fetched_v.dtype), seg.fetched_v, first),
        fetched_pos=place_picks(picks, seg.fetched_pos, first),
        fetched_valid=place_picks(placed, seg.fetched_valid, first),
    )
    return drop_from_lowbit(part, kv, picks, placed), seg


def prefetch_positions(
    part: LowBitPart,
    merged: Merged,
    seg: Segments,
    gqa: str,
    lower: int,
    upper: Tensor,
    k: int,
) -> tuple[Tensor, Tensor]:
    """kappa_{t+1}: the k positions the last new row (the speculative one, or T1) weighs most, per
    KV head, among lower <= t < upper[b] (`top_positions`, nothing excluded)."""
    s = seg.new_k.shape[2]
    nothing = seg.fetched_pos.new_empty(seg.fetched_pos.shape[:2] + (0,))
    return top_positions(part, merged, seg, s, s - 1, gqa, lower, upper, nothing, nothing.bool(), k)
