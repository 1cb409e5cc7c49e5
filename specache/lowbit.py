"""The low-bit copy: KIVI's quantizer at 1 or 2 bits, its bit packing, and one layer's copy
(`LowBitKV`)."""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# KIVI's layout: keys are quantized per channel over groups of g consecutive tokens, values per
# token over groups of min(g, head_dim) consecutive channels. A group with minimum m and maximum M
# stores a scale s and a zero z (16-bit) and dequantizes as code * s + z.
# - 2 bits: z = m, s = (M - m) / 3, codes 0..3 (nearest level).
# - 1 bit (the paper's): the levels m + range/4 and m + 3 range/4 (z = (3m + M)/4, s = range/2),
#   code 1 where x >= (m + M)/2. KIVI's own 1-bit levels, at the extremes, make models collapse.
# - 1 bit, Lloyd (ours): the levels are the means of the group's values below and above its
#   midpoint, one step of Lloyd-Max from the paper's, stored in the same scale and zero.
# - 1 bit, midway (ours, keys only, an option): each level halfway between Lloyd's and the
#   paper's. Lloyd's levels are nearest on average, but they pull a group's extreme keys, the ones
#   that score high, toward its crowd, and the copy's keys are read to rank positions. On three
#   models' own decode queries the attention output's error with the copy's top-k fell 4% and 8%
#   against Lloyd's (SmolLM2, Gemma-3) and held on Qwen2.5 (docs/RESULTS.md).
# Codes are chosen against the stored (rounded) scale and zero, so they are nearest for the levels
# dequantization uses. Keys and values are packed along channels, per token: token t's codes fill
# head_dim * bits / 8 bytes, element i at bits [i*bits % 8, ...) of byte i*bits // 8.

SCALE_DTYPES = (torch.float16, torch.bfloat16)
LEVELS = ("minmax", "lloyd", "midway")


def sixteen_bit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The model's dtype if it is 16-bit, else fp16: for scales and zeros, and for the exact
    pairs."""
    return dtype if dtype in SCALE_DTYPES else torch.float16


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Integer codes (..., N) below 2**bits, packed into bytes (..., ceil(N * bits / 8)), low bits
    first."""
    per_byte = 8 // bits
    n = codes.shape[-1]
    padded = (n + per_byte - 1) // per_byte * per_byte
    codes = F.pad(codes.to(torch.uint8), (0, padded - n))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    groups = codes.view(*codes.shape[:-1], padded // per_byte, per_byte) << shifts
    return groups.sum(-1, dtype=torch.uint8)  # disjoint bit fields: the sum is a bitwise or


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack_bits: the first `n` codes (..., n) as uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n]


def quantize_groups(
    x: Tensor, bits: int, dim: int, scale_dtype: torch.dtype, levels: str = "minmax"
) -> tuple[Tensor, Tensor, Tensor]:
    """Codes shaped like x (uint8), and a scale and zero per slice along `dim` (kept as size 1)."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    if bits == 1 and levels in ("lloyd", "midway"):
        upper = xf >= (lo + hi) / 2
        n_upper = upper.sum(dim, keepdim=True)
        n_lower = xf.shape[dim] - n_upper
        sum_upper = torch.where(upper, xf, 0.0).sum(dim, keepdim=True)
        sum_lower = xf.sum(dim, keepdim=True) - sum_upper
        low = torch.where(n_lower > 0, sum_lower / n_lower.clamp_min(1), lo)
        high = torch.where(n_upper > 0, sum_upper / n_upper.clamp_min(1), hi)
        if levels == "midway":
            low, high = (low + (3 * lo + hi) / 4) / 2, (high + (lo + 3 * hi) / 4) / 2
        zero, scale = low, high - low
    elif bits == 1:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    elif bits == 2:
        zero, scale = lo, (hi - lo) / 3
    else:
        raise ValueError(f"bits must be 1 or 2, got {bits}")
    scale, zero = scale.to(scale_dtype), zero.to(scale_dtype)
    s, z = scale.float(), zero.float()
    level = torch.floor((xf - z) / torch.where(s > 0, s, 1.0) + 0.5)  # ties go up
    codes = torch.where(s > 0, level, 0.0).clamp(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale, zero


def value_group(group: int, head_dim: int) -> int:
    return min(group, head_dim)


def quantize_keys(
    k: Tensor, bits: int, group: int, scale_dtype: torch.dtype, levels: str = "minmax"
) -> tuple[Tensor, Tensor, Tensor]:
    """Keys (..., T, D), T a multiple of `group`: packed codes (..., T, D*bits/8), scale and zero
    (..., T/group, D)."""
    *lead, t, d = k.shape
    grouped = k.reshape(*lead, t // group, group, d)
    codes, scale, zero = quantize_groups(grouped, bits, -2, scale_dtype, levels)
    return pack_bits(codes.reshape(*lead, t, d), bits), scale.squeeze(-2), zero.squeeze(-2)


def quantize_values(
    v: Tensor, bits: int, group: int, scale_dtype: torch.dtype, levels: str = "minmax"
) -> tuple[Tensor, Tensor, Tensor]:
    """Values (..., T, D): packed codes (..., T, D*bits/8), scale and zero (..., T, D/group_v).
    midway is a rule for keys: values take Lloyd's levels under it."""
    *lead, t, d = v.shape
    gv = value_group(group, d)
    grouped = v.reshape(*lead, t, d // gv, gv)
    levels = "lloyd" if levels == "midway" else levels
    codes, scale, zero = quantize_groups(grouped, bits, -1, scale_dtype, levels)
    return pack_bits(codes.reshape(*lead, t, d), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_keys(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int) -> Tensor:
    """fp32 keys (..., T, D) from quantize_keys' output."""
    d = scale.shape[-1]
    codes = unpack_bits(packed, bits, d).float()
    t = codes.shape[-2]
    codes = codes.view(*codes.shape[:-2], t // group, group, d)
    return (codes * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).flatten(-3, -2)


def dequantize_values(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int) -> Tensor:
    """fp32 values (..., T, D) from quantize_values' output."""
    n_groups = scale.shape[-1]
    head_dim = packed.shape[-1] * 8 // bits
    codes = unpack_bits(packed, bits, head_dim).float()
    codes = codes.view(*codes.shape[:-1], n_groups, head_dim // n_groups)
    return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


class LowBitKV(NamedTuple):
    """One layer's low-bit copy in the layout above."""

    k_packed: Tensor  # (B, Hkv, T, D*bits/8) uint8
    k_scale: Tensor  # (B, Hkv, T/group, D)
    k_zero: Tensor
    v_packed: Tensor  # (B, Hkv, T, D*bits/8) uint8
    v_scale: Tensor  # (B, Hkv, T, D/group_v)
    v_zero: Tensor
    bits: int
    group: int
    # (B, Hkv, T/group, D): each key group's mean value, kept for the sparse pass alone
    # (specache/sparse.py)
    v_mean: Optional[Tensor] = None

    def dequantized(self, first: int, last: int) -> tuple[Tensor, Tensor]:
        """fp32 keys and values (B, Hkv, last - first, D) of positions [first, last), whole
        groups."""
        groups = slice(first // self.group, last // self.group)
        k = dequantize_keys(
            self.k_packed[:, :, first:last],
            self.k_scale[:, :, groups],
            self.k_zero[:, :, groups],
            self.bits,
            self.group,
        )
        v = dequantize_values(
            self.v_packed[:, :, first:last],
            self.v_scale[:, :, first:last],
            self.v_zero[:, :, first:last],
            self.bits,
            self.group,
        )
        return k, v
