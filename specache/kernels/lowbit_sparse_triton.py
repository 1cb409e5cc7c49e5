"""SpeCache's sparse low-bit pass on GPUs (ours, specache/sparse.py): two Triton kernels for the
op `specache::lowbit_partial_attention_sparse` that specache/ops.py defines (its plain-PyTorch
`lowbit_partial_attention_sparse_reference` is the spec).

On a GPU the low-bit pass is bound by the bytes it reads, and half of them are the values'. So
where the CPU's sparse kernel saves the value mix's multiply-adds, this one saves its reads: a key
group none of whose positions some row weighs at least `min_weight` reads one mean value (D
numbers) instead of its `group` positions' codes and scales. How many groups that spares depends
on how peaked the attention is: every group reads its values where it is flat, few at long
context (scripts/bench/bench_lowbit_triton.py measures it).

Each program takes one (sequence, KV head) and one key group of positions (the block is the
group: its keys share one scale and zero per channel, and its skipped weight one mean value):
1. `_int8_scores`: the integer pass's scores as `specache.integer.int8_scores` defines them. Per
   row, the rows times the group's channel scales round to int8 against their largest (a true
   division, rounding half to even), score = alpha * (q8 . code) + rows . zero; the integer dot
   product runs in fp32 (input_precision="ieee"), exact since its terms are small integers.
   Masked like the float kernel's `_scores`; each block's row maxima.
2. `_sparse_mix`, after torch takes the maxima over blocks: weights = exp(score - row_max), in
   place; `kept` where some row's weight is positive and at least min_weight; each block's row
   sums, its skipped weight times the group's mean value, and, only where a position is kept,
   the kept weights times their values (code * scale + zero per value group).
torch sums the blocks' sums and outputs. `weights`, `row_max` and `row_sum` equal the reference to
float32 rounding (its zero-point products sum in another order); `out` also differs by the order
of its sums; `kept` may differ only where a weight lies within that rounding of min_weight.

`register()` registers them for CUDA tensors where Triton and a CUDA device are there; shapes they
do not take (`supports`) go to the reference.
"""

from functools import lru_cache

import torch
from torch import Tensor

from specache.kernels import lowbit_triton
from specache.ops import SparsePart, arguments, lowbit_partial_attention_sparse_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the GPU path falls back to the PyTorch one
    triton = None
else:
    from specache.kernels.lowbit_triton import _codes, _exponentiate, _store_scores, _values

BLOCK_M = lowbit_triton.BLOCK_M
HALF_EVEN = 12582912.0  # 1.5 * 2**23: x + it - it rounds |x| < 2**22 half to even in fp32


if triton is not None:

    @triton.jit
    def _int8_scores(
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
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        bh, block = tl.program_id(0), tl.program_id(1)
        offs_t = block * GROUP + tl.arange(0, GROUP)
        offs_d, offs_m = tl.arange(0, D), tl.arange(0, BLOCK_M)
        t_ok, m_ok = offs_t < T, offs_m < M
        codes = _codes(k_packed + bh * T * (D * BITS // 8), offs_t, t_ok, offs_d, D, BITS)
        group_at = (bh * N_BLOCKS + block) * D + offs_d
        scale = tl.load(k_scale + group_at).to(tl.float32)
        zero = tl.load(k_zero + group_at).to(tl.float32)
        q = tl.load(
            rows + bh * M * D + offs_m[:, None] * D + offs_d[None, :], mask=m_ok[:, None], other=0
        )
        scaled = q * scale[None, :]
        largest = tl.max(tl.abs(scaled), axis=1)
        inverse = tl.math.div_rn(tl.full([BLOCK_M], 127.0, tl.float32), largest)
        q8 = tl.where(largest[:, None] > 0, scaled * inverse[:, None], 0.0)
        q8 = (q8 + HALF_EVEN) - HALF_EVEN
        alpha = tl.math.div_rn(largest, tl.full([BLOCK_M], 127.0, tl.float32))
        dots = tl.dot(q8, tl.trans(codes), input_precision="ieee")  # (BLOCK_M, GROUP)
        bias = tl.sum(q * zero[None, :], axis=1)
        score = alpha[:, None] * dots + bias[:, None]
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
    def _sparse_mix(
        weights,
        row_max,
        v_packed,
        v_scale,
        v_zero,
        v_mean,
        min_weight,
        kept,
        block_sum,
        block_out,
        T,
        M,
        N_BLOCKS,
        D: tl.constexpr,
        BITS: tl.constexpr,
        VALUE_GROUPS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        bh, block = tl.program_id(0), tl.program_id(1)
        offs_t = block * GROUP + tl.arange(0, GROUP)
        offs_d, offs_m = tl.arange(0, D), tl.arange(0, BLOCK_M)
        t_ok, m_ok = offs_t < T, offs_m < M
        p = _exponentiate(weights, row_max, bh, offs_t, offs_m, T, M)
        heavy = tl.sum(((p > 0) & (p >= min_weight)).to(tl.int32), axis=0) > 0  # (GROUP,)
        tl.store(kept + bh * T + offs_t, heavy.to(tl.int8), mask=t_ok)
        skipped = tl.sum(tl.where(heavy[None, :], 0.0, p), axis=1)
        mean = tl.load(v_mean + (bh * N_BLOCKS + block) * D + offs_d).to(tl.float32)
        out = skipped[:, None] * mean[None, :]
        if tl.sum(heavy.to(tl.int32), axis=0) > 0:  # only then are the group's values read
            read = t_ok & heavy
            values = _values(
                v_packed, v_scale, v_zero, bh, offs_t, read, offs_d, T, D, BITS, VALUE_GROUPS
            )
            p_kept = tl.where(heavy[None, :], p, 0.0)
            out += tl.dot(p_kept, values, input_precision="ieee")  # (BLOCK_M, D)
        at = (bh * N_BLOCKS + block) * M
        tl.store(block_sum + at + offs_m, tl.sum(p, axis=1), mask=m_ok)
        tl.store(block_out + (at + offs_m[:, None]) * D + offs_d[None, :], out, mask=m_ok[:, None])


def supports(rows: Tensor, bits: int, group: int) -> bool:
    """The shapes these kernels take: the float kernels' (`lowbit_triton.supports`), and a key
    group of 16 to 256 positions, a power of two (a program's block)."""
    fits = 16 <= group <= 256 and group & (group - 1) == 0
    return fits and lowbit_triton.supports(rows, bits, group)


def run_kernels(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    v_mean: Tensor,
    bits: int,
    group: int,
    min_weight: float,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> SparsePart:
    """Launch both kernels on CUDA tensors (or CPU ones under TRITON_INTERPRET=1), the op's
    arguments in its order; returns (weights, row_max, row_sum, out, kept)."""
    b, h, m, d = rows.shape
    # nothing fetched (KIVI): one invalid slot keeps the pointers real
    if excluded_pos.shape[2] == 0:
        excluded_pos = excluded_pos.new_full((b, h, 1), -1)
        excluded_valid = excluded_valid.new_zeros((b, h, 1))
    t, k = k_packed.shape[2], excluded_pos.shape[2]
    n_blocks = triton.cdiv(t, group)
    rows = rows.contiguous()
    weights = rows.new_empty(b, h, m, t)
    block_max, block_sum = rows.new_empty(b * h, n_blocks, m), rows.new_empty(b * h, n_blocks, m)
    block_out = rows.new_empty(b * h, n_blocks, m, d)
    kept = torch.empty(b, h, t, dtype=torch.int8, device=rows.device)
    grid = (b * h, n_blocks)
    _int8_scores[grid](
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
        BLOCK_M=BLOCK_M,
        BLOCK_K=max(16, triton.next_power_of_2(k)),
    )
    row_max = block_max.amax(1)
    _sparse_mix[grid](
        weights,
        row_max,
        v_packed.contiguous(),
        v_scale.contiguous(),
        v_zero.contiguous(),
        v_mean.contiguous(),
        min_weight,
        kept,
        block_sum,
        block_out,
        t,
        m,
        n_blocks,
        D=d,
        BITS=bits,
        VALUE_GROUPS=v_scale.shape[3],
        GROUP=group,
        BLOCK_M=BLOCK_M,
    )
    return SparsePart(
        weights,
        row_max.view(b, h, m),
        block_sum.sum(1).view(b, h, m),
        block_out.sum(1).view(b, h, m, d),
        kept.view(torch.bool),
    )


def _serve(*inputs) -> SparsePart:
    """specache::lowbit_partial_attention_sparse for CUDA tensors (its arguments, in its order):
    the Triton kernels for the shapes they take, the reference otherwise."""
    a = arguments(lowbit_partial_attention_sparse_reference, inputs)
    if supports(a.rows, a.bits, a.group) and a.k_packed.shape[2] > 0:
        return run_kernels(*inputs)
    return lowbit_partial_attention_sparse_reference(*inputs)


@lru_cache(maxsize=None)
def register() -> bool:
    """Make the Triton kernels serve `specache::lowbit_partial_attention_sparse` for CUDA tensors;
    False without Triton or a CUDA device (the reference serves)."""
    if not lowbit_triton.available():
        return False
    torch.library.register_kernel("specache::lowbit_partial_attention_sparse", "cuda", _serve)
    return True
