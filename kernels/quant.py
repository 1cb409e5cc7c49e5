"""Low-bit KV quantization in KIVI's layout with SpeCache's 1-bit rule, and bit packing.

Keys are quantized per channel over groups of `group` consecutive tokens; values per token over
groups of `min(group, head_dim)` consecutive channels. A group with minimum m and maximum M stores a
scale s and zero z (fp16 or bf16) and dequantizes as `x' = code * s + z`:

- 2-bit: z = m, s = (M - m) / 3, codes 0..3 (nearest level, so the error is at most s/2 = range/6).
- 1-bit: z = (3m + M) / 4, s = (M - m) / 2, so the two levels are m + range/4 and m + 3*range/4;
  code 1 when x >= (m + M) / 2. KIVI's own 1-bit levels sit at the extremes and make models
  collapse; a naive round((x - z) / s) would also give code 2 at the maximum, hence the clamp.

1-bit copies may instead take their two levels from the data (`levels="lloyd"`): the means of the
group's values below and above its midpoint (m + M) / 2, one step of Lloyd-Max from SpeCache's
levels, stored in the same scale and zero (z = the lower mean, s = the upper mean - z), so nothing
downstream changes. 2-bit copies always take the uniform levels.

Codes are chosen against the stored (rounded) scale and zero, so they are nearest for the levels
that dequantization will actually use. Both keys and values are packed along channels, per token:
token t's codes fill `head_dim * bits / 8` bytes (head_dim * bits must be a multiple of 8), element
i at bits [i*bits % 8, ...) of byte i*bits // 8 (low bits first). `pack_bits` itself pads any length.
"""
from typing import NamedTuple

import torch
from torch import Tensor

SCALE_DTYPES = (torch.float16, torch.bfloat16)
LEVELS = ("minmax", "lloyd")


def sixteen_bit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The model's dtype if it is 16-bit, else fp16: for scales and zeros, and for the 16-bit pairs
    SpeCache and the eviction baselines keep."""
    return dtype if dtype in SCALE_DTYPES else torch.float16


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes (..., N) below 2**bits into bytes (..., ceil(N * bits / 8)), low bits first."""
    per_byte = 8 // bits
    n = codes.shape[-1]
    padded = (n + per_byte - 1) // per_byte * per_byte
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, padded - n))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    groups = codes.view(*codes.shape[:-1], padded // per_byte, per_byte) << shifts
    return groups.sum(-1, dtype=torch.uint8)  # disjoint bit fields: the sum is a bitwise or


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack_bits: the first `n` codes (..., n) as uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n]


def quantize_groups(x: Tensor, bits: int, dim: int, scale_dtype: torch.dtype,
                    levels: str = "minmax") -> tuple[Tensor, Tensor, Tensor]:
    """Quantize x with one (scale, zero) per slice along `dim` (min and max taken over `dim`).

    Returns integer codes shaped like x (uint8), and scale and zero with `dim` kept as size 1.
    """
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    if bits == 1 and levels == "lloyd":
        upper = xf >= (lo + hi) / 2
        n_upper = upper.sum(dim, keepdim=True)
        n_lower = xf.shape[dim] - n_upper
        sum_upper = torch.where(upper, xf, 0.0).sum(dim, keepdim=True)
        sum_lower = xf.sum(dim, keepdim=True) - sum_upper
        zero = torch.where(n_lower > 0, sum_lower / n_lower.clamp_min(1), lo)
        scale = torch.where(n_upper > 0, sum_upper / n_upper.clamp_min(1), hi) - zero
    elif bits == 1:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    elif bits == 2:
        zero, scale = lo, (hi - lo) / 3
    else:
        raise ValueError(f"bits must be 1 or 2, got {bits}")
    scale, zero = scale.to(scale_dtype), zero.to(scale_dtype)
    s, z = scale.float(), zero.float()
    level = torch.floor((xf - z) / torch.where(s > 0, s, 1.0) + 0.5)  # ties go up: x = (m+M)/2 -> 1
    codes = torch.where(s > 0, level, 0.0).clamp(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale, zero


def quantize_keys(k: Tensor, bits: int, group: int, scale_dtype: torch.dtype,
                  levels: str = "minmax") -> tuple[Tensor, Tensor, Tensor]:
    """Keys (..., T, D), T a multiple of `group`: packed codes (..., T, D*bits/8), scale and zero (..., T/group, D)."""
    *lead, t, d = k.shape
    codes, scale, zero = quantize_groups(k.reshape(*lead, t // group, group, d), bits, -2, scale_dtype, levels)
    return pack_bits(codes.reshape(*lead, t, d), bits), scale.squeeze(-2), zero.squeeze(-2)


def value_group(group: int, head_dim: int) -> int:
    return min(group, head_dim)


def quantize_values(v: Tensor, bits: int, group: int, scale_dtype: torch.dtype,
                    levels: str = "minmax") -> tuple[Tensor, Tensor, Tensor]:
    """Values (..., T, D): packed codes (..., T, D*bits/8), scale and zero (..., T, D/group_v)."""
    *lead, t, d = v.shape
    gv = value_group(group, d)
    codes, scale, zero = quantize_groups(v.reshape(*lead, t, d // gv, gv), bits, -1, scale_dtype, levels)
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
    gv = head_dim // n_groups
    codes = codes.view(*codes.shape[:-1], n_groups, gv)
    return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


class LowBitKV(NamedTuple):
    """One layer's low-bit copy in the layout above: packed codes and per-group scales and zeros."""
    k_packed: Tensor  # (B, Hkv, T, D*bits/8) uint8
    k_scale: Tensor  # (B, Hkv, T/group, D)
    k_zero: Tensor
    v_packed: Tensor  # (B, Hkv, T, D*bits/8) uint8
    v_scale: Tensor  # (B, Hkv, T, D/group_v)
    v_zero: Tensor
    bits: int
    group: int

    def dequantized(self, first: int, last: int) -> tuple[Tensor, Tensor]:
        """fp32 keys and values (B, Hkv, last - first, D) of positions [first, last), whole groups."""
        g = self.group
        k = dequantize_keys(self.k_packed[:, :, first:last], self.k_scale[:, :, first // g: last // g],
                            self.k_zero[:, :, first // g: last // g], self.bits, g)
        v = dequantize_values(self.v_packed[:, :, first:last], self.v_scale[:, :, first:last],
                              self.v_zero[:, :, first:last], self.bits, g)
        return k, v
