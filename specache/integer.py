"""The integer pass (ours): the low-bit pass's two products on int8 operands, what CPUs with
integer dot products run fastest (its op, `specache::lowbit_partial_attention_int8`, is in
ops.py)."""

import torch
import torch.nn.functional as F
from torch import Tensor

from specache.lowbit import unpack_bits

# A CPU with integer dot products (x86's VPDPBUSD) multiplies 64 bytes
# in one instruction, four times the float lanes, and a 1-/2-bit code needs only widening to a
# byte. So both products of the low-bit pass can run on int8 operands: each float operand is
# rounded to integers in [-127, 127] against its largest magnitude, the products and their sums
# are exact integers, and one float step per slice scales them back. Only those two roundings
# differ from the float pass: about 0.4% of the largest element, far below what 1 or 2 bits lose.
INT8_BLOCK = 64  # positions whose weights round against one largest weight


def int8_round(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """x rounded to integers in [-127, 127] (as float32) against its largest magnitude along
    `dim`, and the step (kept as size 1): x ~ codes * step. An all-zero slice has step 0."""
    largest = x.abs().amax(dim, keepdim=True)
    # a true division (`127 / tensor` would multiply by a reciprocal), as the kernels divide
    inverse = largest.new_tensor(127.0) / largest
    return torch.where(largest > 0, x * inverse, 0.0).round(), largest / 127


def int8_scores(
    rows: Tensor, k_packed: Tensor, k_scale: Tensor, k_zero: Tensor, bits: int, group: int
) -> Tensor:
    """Scores (B, Hkv, M, T) of rows (B, Hkv, M, D) over the low-bit keys, in integers: per row
    and key group j, the rows times the group's channel scales round to int8, q * s_j ~ q8 *
    alpha, and

        score = alpha * (q8 . code) + q . z_j

    the integer dot product exact (in float32 too: |q8 . code| < 2**24)."""
    b, h, t, _ = k_packed.shape
    m, d = rows.shape[2:]
    n_groups = k_scale.shape[2]
    padded = F.pad(k_packed, (0, 0, 0, n_groups * group - t))
    codes = unpack_bits(padded, bits, d).float().view(b, h, n_groups, group, d)
    q8, alpha = int8_round(rows.unsqueeze(2) * k_scale.float().unsqueeze(3), -1)  # (B,H,J,M,D)
    bias = (rows @ k_zero.float().transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
    scores = alpha * (q8 @ codes.transpose(-1, -2)) + bias  # (B, Hkv, J, M, group)
    return scores.transpose(2, 3).reshape(b, h, m, n_groups * group)[..., :t]


def int8_value_mix(
    weights: Tensor, v_packed: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int
) -> Tensor:
    """weights (B, Hkv, M, T) times the low-bit values, in integers: per row, block of INT8_BLOCK
    positions (from 0) and value group g, the weights times the values' scales round to int8,
    w * s_g ~ w8 * beta, and

        out = sum over blocks of beta * (w8 . code) + w . z_g

    each block's integer dot product exact."""
    b, h, m, t = weights.shape
    d = v_packed.shape[-1] * 8 // bits
    n_value_groups = v_scale.shape[-1]
    pad = -t % INT8_BLOCK
    blocks = (t + pad) // INT8_BLOCK
    codes = unpack_bits(F.pad(v_packed, (0, 0, 0, pad)), bits, d).float()
    codes = codes.view(b, h, blocks, INT8_BLOCK, n_value_groups, d // n_value_groups)
    scaled = weights.unsqueeze(-1) * v_scale.float().unsqueeze(2)  # (B, Hkv, M, T, NV)
    scaled = F.pad(scaled, (0, 0, 0, pad)).view(b, h, m, blocks, INT8_BLOCK, n_value_groups)
    w8, beta = int8_round(scaled, -2)
    dots = torch.einsum("bhmntg,bhntgc->bhmngc", w8, codes)
    out = (beta.squeeze(-2).unsqueeze(-1) * dots).sum(3).flatten(-2)
    zero = (weights @ v_zero.float()).repeat_interleave(d // n_value_groups, -1)
    return out + zero
