"""The sparse value mix (ours): the low-bit pass mixes, value by value, only the positions whose
weight can matter, and the rest of each key group's weight with that group's mean value (its op,
`specache::lowbit_partial_attention_sparse`, is in ops.py).

Half of the low-bit pass's work on a CPU is its value mix, a multiply-add per position, channel
and row, though at long context most of a row's weight sits on few positions (the reason a few
exact pairs correct it at all). A position is kept when, in some row of its KV head, its weight
exp(score - row_max) is at least `min_weight` (e^-tau: `Method.tau`); the others' weights, each
below e^-tau of their row's largest, still count in full in the row's sum (its softmax is
unchanged) but multiply their key group's mean low-bit value, stored once when the group is
quantized. What that moves is bounded: a row's output moves by at most its skipped weight times
how far a skipped value lies from its group's mean (as SparQ and Top-Theta compensate with a mean
value)."""

import torch
import torch.nn.functional as F
from torch import Tensor

from specache.lowbit import dequantize_values


def value_means(v_packed: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int, group: int) -> Tensor:
    """The mean low-bit value of each key group of `group` positions (from 0), (..., ceil(T /
    group), D), in the scales' dtype: what the sparse mix gives a group's skipped weight. A last
    group that is not whole averages the positions it has."""
    values = dequantize_values(v_packed, v_scale, v_zero, bits, group)
    t = values.shape[-2]
    pad = -t % group
    padded = F.pad(values, (0, 0, 0, pad)).unflatten(-2, ((t + pad) // group, group))
    counts = torch.full((padded.shape[-3], 1), group, dtype=values.dtype, device=values.device)
    counts[-1] = group - pad
    return (padded.sum(-2) / counts).to(v_scale.dtype)


def sparse_value_mix(
    weights: Tensor,
    kept: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    v_mean: Tensor,
    bits: int,
    group: int,
) -> Tensor:
    """weights (B, Hkv, M, T) times the values, (B, Hkv, M, D) fp32: the low-bit value of each
    `kept` (B, Hkv, T) position, and the rest of each key group's weight times its mean value
    `v_mean` (B, Hkv, ceil(T / group), D)."""
    b, h, m, t = weights.shape
    values = dequantize_values(v_packed, v_scale, v_zero, bits, group)
    kept = kept.unsqueeze(2)
    skipped = torch.where(kept, 0.0, weights)
    pad = -t % group
    per_group = F.pad(skipped, (0, pad)).view(b, h, m, -1, group).sum(-1)
    return torch.where(kept, weights, 0.0) @ values + per_group @ v_mean.float()


def kept_positions(weights: Tensor, min_weight: float) -> Tensor:
    """(B, Hkv, T) bool: the positions some row of their KV head weighs at least `min_weight`
    (weights are exp(score - row_max), so 1 at a row's largest), those of weight 0 never."""
    return ((weights > 0) & (weights >= min_weight)).any(2)
