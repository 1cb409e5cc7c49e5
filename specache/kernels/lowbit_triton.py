"""The low-bit segment of SpeCache's attention on GPUs: two Triton kernels.

The op `specache::lowbit_partial_attention` that specache/ops.py defines (its
`lowbit_partial_attention_reference` is the spec), for CUDA tensors: for rows (B, Hkv, M, D,
already scaled) and the packed low-bit copy, the softmax pieces over the
positions [0, visible_len) less the valid excluded ones: weights exp(score - row_max) (B, Hkv, M,
T),
row_max, row_sum (B, Hkv, M) and the unnormalized output (B, Hkv, M, D).

Each program takes one (sequence, KV head) and BLOCK_T positions, and unpacks their codes in
registers (code = byte >> (channel * bits % 8) & mask, the layout of specache/lowbit.py), never
writing a dequantized copy to memory:
1. `_scores`: keys = code * scale + zero per (key group, channel); scores = rows . keys (one
   tl.dot, the M rows padded to 16), masked, written into `weights`; each block's row maxima.
2. `_mix`, after torch takes the maxima over blocks: weights = exp(score - row_max), in place;
   values = code * scale + zero per (token, value group); each block's row sums and weights .
   values.
torch then sums the blocks' sums and outputs. Products run in full fp32 (input_precision="ieee"),
not TF32, so that the result matches the reference as the CPU kernel does.

`register()` registers them for CUDA tensors where Triton and a CUDA device are there
(`available()`); shapes they do not take (`supports`) go to the reference.
"""

import math
from functools import lru_cache

import torch
from torch import Tensor

from specache.ops import arguments, lowbit_partial_attention_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the GPU path falls back to the PyTorch one
    triton = None

Outputs = tuple[Tensor, Tensor, Tensor, Tensor]
BLOCK_T = 64
BLOCK_M = 16  # tl.dot's smallest tile: rows beyond M are padding


@lru_cache(maxsize=None)
def available() -> bool:
    return triton is not None and torch.cuda.is_available()


if triton is not None:

    @triton.jit
    def _codes(packed, offs_t, t_ok, offs_d, D: tl.constexpr, BITS: tl.constexpr):
        """The (BLOCK_T, D) codes of positions offs_t, unpacked from `packed` (T, D * BITS / 8)."""
        bytes_per_token: tl.constexpr = D * BITS // 8
        byte = tl.load(
            packed + offs_t[:, None] * bytes_per_token + (offs_d[None, :] * BITS) // 8,
            mask=t_ok[:, None],
            other=0,
        )
        return ((byte >> ((offs_d[None, :] * BITS) % 8)) & ((1 << BITS) - 1)).to(tl.float32)

    @triton.jit
    def _store_scores(
        score,
        visible_len,
        excluded_pos,
        excluded_valid,
        weights,
        block_max,
        bh,
        block,
        offs_t,
        offs_m,
        T,
        M,
        K,
        HEADS,
        N_BLOCKS,
        BLOCK_K: tl.constexpr,
    ):
        """The block's scores (BLOCK_M, BLOCK_T) of positions offs_t, -inf where not allowed
        (beyond visible_len, or a valid excluded position), into `weights`; each row's largest
        into `block_max`."""
        t_ok, m_ok, offs_k = offs_t < T, offs_m < M, tl.arange(0, BLOCK_K)
        excluded = tl.load(excluded_pos + bh * K + offs_k, mask=offs_k < K, other=-1)
        valid = tl.load(excluded_valid + bh * K + offs_k, mask=offs_k < K, other=0) != 0
        hit = (
            tl.sum(((offs_t[:, None] == excluded[None, :]) & valid[None, :]).to(tl.int32), axis=1)
            > 0
        )
        allowed = t_ok & (offs_t < tl.load(visible_len + bh // HEADS)) & ~hit
        score = tl.where(allowed[None, :], score, float("-inf"))
        tl.store(
            weights + bh * M * T + offs_m[:, None] * T + offs_t[None, :],
            score,
            mask=m_ok[:, None] & t_ok[None, :],
        )
        tl.store(block_max + (bh * N_BLOCKS + block) * M + offs_m, tl.max(score, axis=1), mask=m_ok)

    @triton.jit
    def _exponentiate(weights, row_max, bh, offs_t, offs_m, T, M):
        """The block's weights exp(score - row_max) (BLOCK_M, BLOCK_T), written over its scores
        in `weights`."""
        t_ok, m_ok = offs_t < T, offs_m < M
        where = weights + bh * M * T + offs_m[:, None] * T + offs_t[None, :]
        ok = m_ok[:, None] & t_ok[None, :]
        score = tl.load(where, mask=ok, other=float("-inf"))
        top = tl.load(row_max + bh * M + offs_m, mask=m_ok, other=0)
        # nothing allowed: every weight is exp(-inf) = 0
        top = tl.where(top == float("-inf"), 0.0, top)
        p = tl.exp(score - top[:, None])
        tl.store(where, p, mask=ok)
        return p

    @triton.jit
    def _values(
        v_packed,
        v_scale,
        v_zero,
        bh,
        offs_t,
        read,
        offs_d,
        T,
        D: tl.constexpr,
        BITS: tl.constexpr,
        VALUE_GROUPS: tl.constexpr,
    ):
        """The (BLOCK_T, D) low-bit values of positions offs_t, code * scale + zero per (token,
        value group); 0 where not `read`."""
        codes = _codes(v_packed + bh * T * (D * BITS // 8), offs_t, read, offs_d, D, BITS)
        group_of = (
            bh * T * VALUE_GROUPS
            + offs_t[:, None] * VALUE_GROUPS
            + (offs_d // (D // VALUE_GROUPS))[None, :]
        )
        scale = tl.load(v_scale + group_of, mask=read[:, None], other=0).to(tl.float32)
        zero = tl.load(v_zero + group_of, mask=read[:, None], other=0).to(tl.float32)
        return codes * scale + zero

    @triton.jit
    def _scores(
        rows,
        k_packed,
        k_scale,
        k_zero,
        visible_len,
        excluded_pos,
        excluded_valid,
        weights,
        block_max,
        T,
        M,
        K,
        HEADS,
        N_BLOCKS,
        D: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        bh, block = tl.program_id(0), tl.program_id(1)
        offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d, offs_m = tl.arange(0, D), tl.arange(0, BLOCK_M)
        t_ok, m_ok = offs_t < T, offs_m < M
        codes = _codes(k_packed + bh * T * (D * BITS // 8), offs_t, t_ok, offs_d, D, BITS)
        n_groups = (T + GROUP - 1) // GROUP
        where = bh * n_groups * D + (offs_t // GROUP)[:, None] * D + offs_d[None, :]
        scale = tl.load(k_scale + where, mask=t_ok[:, None], other=0).to(tl.float32)
        zero = tl.load(k_zero + where, mask=t_ok[:, None], other=0).to(tl.float32)
        keys = codes * scale + zero
        q = tl.load(
            rows + bh * M * D + offs_m[:, None] * D + offs_d[None, :], mask=m_ok[:, None], other=0
        )
        score = tl.dot(q, tl.trans(keys), input_precision="ieee")  # (BLOCK_M, BLOCK_T)
        _store_scores(
            score,
            visible_len,
            excluded_pos,
            excluded_valid,
            weights,
            block_max,
            bh,
            block,
            offs_t,
            offs_m,
            T,
            M,
            K,
            HEADS,
            N_BLOCKS,
            BLOCK_K,
        )

    @triton.jit
    def _mix(
        weights,
        row_max,
        v_packed,
        v_scale,
        v_zero,
        block_sum,
        block_out,
        T,
        M,
        N_BLOCKS,
        D: tl.constexpr,
        BITS: tl.constexpr,
        VALUE_GROUPS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        bh, block = tl.program_id(0), tl.program_id(1)
        offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d, offs_m = tl.arange(0, D), tl.arange(0, BLOCK_M)
        t_ok, m_ok = offs_t < T, offs_m < M
        p = _exponentiate(weights, row_max, bh, offs_t, offs_m, T, M)
        values = _values(
            v_packed, v_scale, v_zero, bh, offs_t, t_ok, offs_d, T, D, BITS, VALUE_GROUPS
        )
        out = tl.dot(p, values, input_precision="ieee")  # (BLOCK_M, D)
        at = (bh * N_BLOCKS + block) * M
        tl.store(block_sum + at + offs_m, tl.sum(p, axis=1), mask=m_ok)
        tl.store(block_out + (at + offs_m[:, None]) * D + offs_d[None, :], out, mask=m_ok[:, None])


def supports(rows: Tensor, bits: int, group: int) -> bool:
    """The shapes these kernels take: a power-of-two head_dim of at least 16 (tl.arange), M <= 16
    rows."""
    d, m = rows.shape[-1], rows.shape[-2]
    return d >= 16 and d & (d - 1) == 0 and m <= BLOCK_M and bits in (1, 2) and group >= 1


def run_kernels(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    bits: int,
    group: int,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> Outputs:
    """Launch both kernels on CUDA tensors (or CPU ones under TRITON_INTERPRET=1) of the layout that
    lowbit_cpu.py checks; returns (weights, row_max, row_sum, out)."""
    b, h, m, d = rows.shape
    # nothing fetched (KIVI): one invalid slot keeps the pointers real
    if excluded_pos.shape[2] == 0:
        excluded_pos = excluded_pos.new_full((b, h, 1), -1)
        excluded_valid = excluded_valid.new_zeros((b, h, 1))
    t, k = k_packed.shape[2], excluded_pos.shape[2]
    n_blocks = triton.cdiv(t, BLOCK_T)
    rows = rows.contiguous()
    weights = rows.new_empty(b, h, m, t)
    block_max, block_sum = rows.new_empty(b * h, n_blocks, m), rows.new_empty(b * h, n_blocks, m)
    block_out = rows.new_empty(b * h, n_blocks, m, d)
    grid = (b * h, n_blocks)
    _scores[grid](
        rows,
        k_packed.contiguous(),
        k_scale.contiguous(),
        k_zero.contiguous(),
        visible_len.contiguous(),
        excluded_pos.contiguous(),
        excluded_valid.contiguous(),
        weights,
        block_max,
        t,
        m,
        k,
        h,
        n_blocks,
        D=d,
        BITS=bits,
        GROUP=group,
        BLOCK_T=BLOCK_T,
        BLOCK_M=BLOCK_M,
        BLOCK_K=max(16, 1 << math.ceil(math.log2(max(k, 1)))),
    )
    row_max = block_max.amax(1)
    _mix[grid](
        weights,
        row_max,
        v_packed.contiguous(),
        v_scale.contiguous(),
        v_zero.contiguous(),
        block_sum,
        block_out,
        t,
        m,
        n_blocks,
        D=d,
        BITS=bits,
        VALUE_GROUPS=v_scale.shape[3],
        BLOCK_T=BLOCK_T,
        BLOCK_M=BLOCK_M,
    )
    return (
        weights,
        row_max.view(b, h, m),
        block_sum.sum(1).view(b, h, m),
        block_out.sum(1).view(b, h, m, d),
    )


def _serve(*inputs) -> Outputs:
    """specache::lowbit_partial_attention for CUDA tensors (its arguments, in its order): the
    Triton kernels for the shapes they take, the reference otherwise."""
    a = arguments(lowbit_partial_attention_reference, inputs)
    if supports(a.rows, a.bits, a.group):
        return run_kernels(*inputs)
    return lowbit_partial_attention_reference(*inputs)


@lru_cache(maxsize=None)
def register() -> bool:
    """Make the Triton kernels serve `specache::lowbit_partial_attention` for CUDA tensors; False
    without Triton or a CUDA device (the reference serves)."""
    if not available():
        return False
    torch.library.register_kernel("specache::lowbit_partial_attention", "cuda", _serve)
    return True
