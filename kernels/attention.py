"""SpeCache's mixed-precision decode attention, a fast path and its plain-PyTorch reference.

The new rows (S = 2 in a speculative step: the real token and the speculative one; S = 1 otherwise)
attend over four segments of one sequence's history:

- the low-bit copy of the quantized positions [0, Lq), except the fetched ones,
- the k fetched 16-bit pairs (kappa, chosen at the previous step),
- the residual window: the 16-bit keys and values not quantized yet,
- the new rows themselves, causally (the real row does not see the speculative row's key).

All four share one softmax. The low-bit segment is computed apart (`lowbit_partial_attention`: on a
CPU the C kernel of kernels/lowbit_cpu.py, on a GPU the Triton kernels of kernels/lowbit_triton.py,
elsewhere `key_scores` and `value_mix` below, which torch.compile fuses) and merged with the 16-bit
segments by the log-sum-exp rule (`merge_softmax`: kernels/dense_cpu.py's merge_segments, one C call
on a CPU, matmuls elsewhere). Besides the output, the attention returns how much weight each
position of the history got from the last new row (the fetched and window ones with their 16-bit
weight), averaged over the query heads that share a KV head (GQA): the speculative row's weights
choose the next kappa (the only row's, without speculation). The window holds positions [Lq, Lq + window_len).

Shapes: q (B, H, S, D); every key/value tensor is per KV head (B, Hkv, N, D); H = Hkv * G.
"""
from typing import NamedTuple

import torch
from torch import Tensor

from kernels import dense_cpu, lowbit_cpu, lowbit_triton, rank_cpu
from kernels.quant import LowBitKV, dequantize_keys, dequantize_values, unpack_bits


class Segments(NamedTuple):
    """Everything but the low-bit copy that the new rows attend over."""
    quantized_len: Tensor  # (B,) Lq: positions [0, Lq) are in the low-bit copy
    fetched_k: Tensor  # (B, Hkv, k, D) 16-bit pairs of the positions in fetched_pos
    fetched_v: Tensor
    fetched_pos: Tensor  # (B, Hkv, k) long
    fetched_valid: Tensor  # (B, Hkv, k) bool: only pairs of quantized positions count
    window_k: Tensor  # (B, Hkv, R, D) residual window; slots [0, window_len) hold tokens
    window_v: Tensor
    window_len: Tensor  # (B,)
    new_k: Tensor  # (B, Hkv, S, D) the new rows' own keys and values
    new_v: Tensor


# ---------------------------------------------------------------------------------------------
# Scoring against packed keys, and mixing packed values, without dequantizing first
# ---------------------------------------------------------------------------------------------

def key_scores(q: Tensor, kv: LowBitKV) -> Tensor:
    """q (B, Hkv, M, D) . low-bit keys -> scores (B, Hkv, M, T), unscaled.

    Per-channel scales fold into the query, per group j of tokens:
    q . (code * s_j + z_j) = (q * s_j) . code + q . z_j, so only the 0/1 (or 0..3) codes meet the
    query; under torch.compile their unpacking fuses into one kernel ahead of a batched matmul.
    """
    b, h, m, d = q.shape
    qf = q.float()
    q_scaled = qf.unsqueeze(-2) * kv.k_scale.float().unsqueeze(-3)  # (B, Hkv, M, J, D)
    bias = (qf.unsqueeze(-2) * kv.k_zero.float().unsqueeze(-3)).sum(-1)  # (B, Hkv, M, J)
    codes = unpack_bits(kv.k_packed, kv.bits, d).float()
    codes = codes.view(b, h, -1, kv.group, d)  # (B, Hkv, J, g, D)
    scores = torch.einsum("bhmjd,bhjgd->bhmjg", q_scaled, codes) + bias.unsqueeze(-1)
    return scores.flatten(-2)


def key_scores_reference(q: Tensor, kv: LowBitKV) -> Tensor:
    return q.float() @ dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, kv.bits, kv.group).transpose(-1, -2)


def value_mix(p: Tensor, kv: LowBitKV) -> Tensor:
    """Weights p (B, Hkv, M, T) . low-bit values -> (B, Hkv, M, D).

    Per-token scales fold into the weights: sum_t p_t (code_t * s_t + z_t)
    = sum_t (p_t * s_t) code_t + sum_t p_t z_t, per channel group.
    """
    b, h, m, t = p.shape
    n_groups = kv.v_scale.shape[-1]
    d = kv.v_packed.shape[-1] * 8 // kv.bits
    p_scaled = p.unsqueeze(-1) * kv.v_scale.float().unsqueeze(-3)  # (B, Hkv, M, T, G)
    offset = (p.unsqueeze(-1) * kv.v_zero.float().unsqueeze(-3)).sum(-2)  # (B, Hkv, M, G)
    codes = unpack_bits(kv.v_packed, kv.bits, d).float().view(b, h, t, n_groups, d // n_groups)
    mixed = torch.einsum("bhmtg,bhtgc->bhmgc", p_scaled, codes) + offset.unsqueeze(-1)
    return mixed.flatten(-2)


def value_mix_reference(p: Tensor, kv: LowBitKV) -> Tensor:
    return p.float() @ dequantize_values(kv.v_packed, kv.v_scale, kv.v_zero, kv.bits, kv.group)


# ---------------------------------------------------------------------------------------------
# The mixed-precision attention
# ---------------------------------------------------------------------------------------------

def query_rows(q: Tensor, n_kv_heads: int) -> Tensor:
    """(B, H, S, D) -> (B, Hkv, G*S, D), fp32 and scaled by D**-0.5: the query rows that share each
    KV head; row = g*S + s."""
    b, h, s, d = q.shape
    return q.reshape(b, n_kv_heads, (h // n_kv_heads) * s, d).float() * d ** -0.5


def lowbit_partial_attention(rows: Tensor, kv: LowBitKV, visible_len: Tensor, excluded_pos: Tensor,
                             excluded_valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The softmax pieces of rows (B, Hkv, M, D, already scaled) over the low-bit copy's positions
    [0, visible_len) less the valid excluded ones: weights exp(score - row_max) (B, Hkv, M, T),
    row_max and row_sum (B, Hkv, M), and the unnormalized output (B, Hkv, M, D); see
    kernels/lowbit_cpu.py, whose reference is the spec. The C kernel on a CPU, the Triton kernels of
    kernels/lowbit_triton.py on a GPU; elsewhere (no C compiler or Triton, or head dims and groups
    they do not cover) the scale-folding einsums above."""
    d = rows.shape[-1]
    kernel_shape = d % 16 == 0 and d <= lowbit_cpu.MAX_HEAD_DIM and kv.group % 8 == 0
    if rows.device.type == "cpu" and kernel_shape and lowbit_cpu.available():
        return torch.ops.specache.lowbit_partial_attention(rows, *kv[:6], kv.bits, kv.group, visible_len,
                                                           excluded_pos, excluded_valid)
    if rows.is_cuda and lowbit_triton.available() and lowbit_triton.supports(rows, kv.bits, kv.group):
        return torch.ops.specache.lowbit_partial_attention_triton(rows, *kv[:6], kv.bits, kv.group, visible_len,
                                                                  excluded_pos, excluded_valid)
    return lowbit_partial_attention_torch(rows, kv, visible_len, excluded_pos, excluded_valid)


def positions_mask(positions: Tensor, valid: Tensor, t: int) -> Tensor:
    """(B, Hkv, T) bool: which of the positions [0, T) some valid slot of `positions` (B, Hkv, K)
    holds. Counted, not scattered as booleans: an invalid slot may repeat a valid slot's position."""
    counts = torch.zeros(positions.shape[:2] + (t,), dtype=torch.int32, device=positions.device)
    in_range = valid & (positions >= 0) & (positions < t)
    return counts.scatter_add(-1, positions.clamp(0, t - 1), in_range.to(torch.int32)) > 0


def lowbit_partial_attention_torch(rows: Tensor, kv: LowBitKV, visible_len: Tensor, excluded_pos: Tensor,
                                   excluded_valid: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """lowbit_partial_attention from `key_scores` and `value_mix` (where neither kernel runs)."""
    t = kv.k_packed.shape[2]
    allowed = (torch.arange(t, device=rows.device) < visible_len[:, None, None]) & ~positions_mask(
        excluded_pos, excluded_valid, t)
    scores = key_scores(rows, kv).masked_fill(~allowed.unsqueeze(2), float("-inf"))
    row_max = scores.amax(-1)
    weights = torch.exp(scores - torch.where(row_max.isfinite(), row_max, 0.0).unsqueeze(-1))
    return weights, row_max, weights.sum(-1), value_mix(weights, kv)


class LowBitPart(NamedTuple):
    """The low-bit segment's softmax pieces (see `lowbit_partial_attention`)."""
    weights: Tensor  # (B, Hkv, M, T) exp(score - row_max) at the positions attended in low bits, 0 elsewhere
    row_max: Tensor  # (B, Hkv, M)
    row_sum: Tensor  # (B, Hkv, M)
    out: Tensor  # (B, Hkv, M, D), unnormalized


def lowbit_part(rows: Tensor, kv: LowBitKV, seg: Segments) -> LowBitPart:
    """The low-bit segment of `seg`: positions [0, Lq) less the valid fetched ones. A copy of no
    positions (a capacity too short to quantize anything) contributes nothing."""
    if kv.k_packed.shape[2] == 0:
        b, h, m, d = rows.shape
        return LowBitPart(rows.new_zeros(b, h, m, 0), rows.new_full((b, h, m), float("-inf")), rows.new_zeros(b, h, m),
                          rows.new_zeros(b, h, m, d))
    return LowBitPart(*lowbit_partial_attention(rows, kv, seg.quantized_len, seg.fetched_pos, seg.fetched_valid))


def dequantize_values_at(kv: LowBitKV, positions: Tensor) -> Tensor:
    """The low-bit copy's values (B, Hkv, K, D), fp32, at positions (B, Hkv, K)."""
    def at(x: Tensor) -> Tensor:
        return x.gather(2, positions.unsqueeze(-1).expand(*positions.shape, x.shape[-1]))

    return dequantize_values(at(kv.v_packed), at(kv.v_scale), at(kv.v_zero), kv.bits, kv.group)


def drop_from_lowbit(part: LowBitPart, kv: LowBitKV, positions: Tensor, valid: Tensor) -> LowBitPart:
    """`part` as if the valid `positions` (B, Hkv, K; the valid ones distinct per head, the invalid
    ones anywhere) had been excluded from the low-bit pass: their weights and weighted values are
    subtracted. This is how positions chosen
    from the low-bit pass's own weights move to the 16-bit segment without a second pass; the
    error is that of the subtraction, a few ulps of the row's low-bit sum (tested against a pass
    that excludes them). Positions already at weight 0 (excluded or invisible) change nothing."""
    m = part.weights.shape[2]
    index = positions.unsqueeze(2).expand(-1, -1, m, -1)  # (B, Hkv, M, K)
    dropped = part.weights.gather(-1, index) * valid.unsqueeze(2)
    out = part.out - dropped @ dequantize_values_at(kv, positions)
    row_sum = (part.row_sum - dropped.sum(-1)).clamp_min(0.0)
    # index_put, not scatter_add: torch.compile updates a buffer in place only for index_put (a scatter
    # copies the whole (B, Hkv, M, T) tensor first); invalid entries add 0, wherever they point
    b, h, device = positions.shape[0], positions.shape[1], index.device
    at = (torch.arange(b, device=device)[:, None, None, None], torch.arange(h, device=device)[:, None, None],
          torch.arange(m, device=device)[:, None], index)
    weights = part.weights.index_put(at, -dropped, accumulate=True)
    return LowBitPart(weights, part.row_max, row_sum, out)


class Merged(NamedTuple):
    """One softmax over the four segments, for rows (B, Hkv, M, D) with M = G*S, row = g*S + s."""
    out: Tensor  # (B, Hkv, M, D) fp32: the attention output
    lowbit_scale: Tensor  # (B, Hkv, M, 1): the factor that turns the low-bit weights into probabilities
    p_fetched: Tensor  # (B, Hkv, M, k) probabilities of the fetched pairs
    p_window: Tensor  # (B, Hkv, M, R)
    p_new: Tensor  # (B, Hkv, M, S)


def merge_softmax(rows: Tensor, part: LowBitPart, seg: Segments) -> Merged:
    """The log-sum-exp merge of the low-bit segment with the three 16-bit ones, and the output:
    kernels/dense_cpu.py's merge_segments (one C call on a CPU; matmuls and masks elsewhere)."""
    return Merged(*dense_cpu.merge_segments(rows, part.row_max, part.row_sum, part.out, seg.fetched_k, seg.fetched_v,
                                            seg.fetched_valid, seg.window_k, seg.window_v, seg.window_len, seg.new_k,
                                            seg.new_v))


def row_position_weights(part: LowBitPart, merged: Merged, seg: Segments, s: int, row: int) -> Tensor:
    """How much weight each position of the history [0, T) gets from new row `row` (0 <= row < S), per
    query head: (B, Hkv, G, T); fetched and window positions with their 16-bit weight."""
    b, n_kv, m, t = part.weights.shape
    g = m // s
    pick = lambda x: x.view(b, n_kv, g, s, x.shape[-1])[:, :, :, row]  # (B, Hkv, G, N): that row's
    window_pos = (seg.quantized_len[:, None] + torch.arange(seg.window_k.shape[2], device=part.weights.device))
    # positions beyond the copy (never quantized) have no place in the ranking
    p_fetched, p_window = pick(merged.p_fetched), pick(merged.p_window) * (window_pos < t)[:, None, None, :]
    weights = pick(part.weights) * pick(merged.lowbit_scale)
    if t == 0:
        return weights
    return (weights.scatter_add(-1, seg.fetched_pos.clamp(0, t - 1).unsqueeze(2).expand_as(p_fetched), p_fetched)
            .scatter_add(-1, window_pos.clamp(max=t - 1)[:, None, None, :].expand_as(p_window), p_window))


def over_query_heads(weights: Tensor, how: str) -> Tensor:
    """A KV head's ranking of positions from its query heads' weights (B, Hkv, G, T, as
    `row_position_weights` gives them): their mean or their max."""
    return weights.amax(2) if how == "max" else weights.mean(2)


def select_top_k(scores: Tensor, candidates: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k candidate positions (candidates: (B, Hkv, T) bool) with the highest scores (B, Hkv, T,
    non-negative), best first, and which of them are real (a short sequence has fewer than k)."""
    top = scores.masked_fill(~candidates, -1.0).topk(k, dim=-1)
    return top.indices, top.values >= 0


def top_positions(part: LowBitPart, merged: Merged, seg: Segments, s: int, row: int, how: str, lower: int,
                  upper: Tensor, excluded_pos: Tensor, excluded_valid: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """select_top_k(over_query_heads(row_position_weights(part, merged, seg, s, row), how), candidates, k)
    in one op, the candidates being lower <= t < upper[b] less the valid excluded positions (B, Hkv, E):
    kernels/rank_cpu.py's C kernel on a CPU, its plain-PyTorch reference elsewhere."""
    return rank_cpu.top_positions(part.weights, merged.lowbit_scale, merged.p_fetched, seg.fetched_pos, merged.p_window,
                                  seg.quantized_len, s, row, how == "max", lower, upper, excluded_pos, excluded_valid,
                                  k)


def mixed_attention(q: Tensor, kv: LowBitKV, seg: Segments) -> tuple[Tensor, Tensor]:
    """Attention of q (B, H, S, D) over the four segments; see the module docstring.

    Returns the output (B, H, S, D) in q's dtype and the last row's weights of the history's
    positions [0, T), averaged over each KV head's query heads: (B, Hkv, T).
    """
    b, n_heads, s, d = q.shape
    n_kv = kv.k_packed.shape[1]
    rows = query_rows(q, n_kv)
    part = lowbit_part(rows, kv, seg)
    merged = merge_softmax(rows, part, seg)
    return merged.out.reshape(b, n_heads, s, d).to(q.dtype), row_position_weights(part, merged, seg, s, s - 1).mean(2)


def mixed_attention_reference(q: Tensor, kv: LowBitKV, seg: Segments) -> tuple[Tensor, Tensor]:
    """The same, spelled out: dequantize the copy, put the fetched 16-bit pairs in their places,
    append the window and the new rows, and run one masked softmax."""
    b, n_heads, s, d = q.shape
    n_kv, t = kv.k_packed.shape[1], kv.k_packed.shape[2]
    g = n_heads // n_kv
    keys = dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, kv.bits, kv.group)
    values = dequantize_values(kv.v_packed, kv.v_scale, kv.v_zero, kv.bits, kv.group)
    for bi in range(b):
        for hi in range(n_kv):
            for slot in range(seg.fetched_pos.shape[-1]):
                if seg.fetched_valid[bi, hi, slot]:
                    pos = seg.fetched_pos[bi, hi, slot]
                    keys[bi, hi, pos] = seg.fetched_k[bi, hi, slot].float()
                    values[bi, hi, pos] = seg.fetched_v[bi, hi, slot].float()
    keys = torch.cat([keys, seg.window_k.float(), seg.new_k.float()], dim=2)
    values = torch.cat([values, seg.window_v.float(), seg.new_v.float()], dim=2)
    r = seg.window_k.shape[2]
    visible = torch.zeros(b, 1, s, t + r + s, dtype=torch.bool)
    for bi in range(b):
        visible[bi, :, :, : seg.quantized_len[bi]] = True
        visible[bi, :, :, t: t + seg.window_len[bi]] = True
        for row in range(s):
            visible[bi, :, row, t + r: t + r + row + 1] = True
    scores = (q.float() @ keys.repeat_interleave(g, 1).transpose(-1, -2)) * d ** -0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = probs @ values.repeat_interleave(g, 1)
    position_weights = probs[:, :, -1, :t].clone()
    for bi in range(b):
        lq, wl = int(seg.quantized_len[bi]), int(seg.window_len[bi])
        position_weights[bi, :, lq: lq + wl] += probs[bi, :, -1, t: t + wl]
    position_weights = position_weights.view(b, n_kv, g, t).mean(2)
    return out.to(q.dtype), position_weights
