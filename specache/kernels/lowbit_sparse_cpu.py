"""SpeCache's sparse low-bit pass on CPUs (ours, specache/sparse.py): a C kernel for the op
`specache::lowbit_partial_attention_sparse` that specache/ops.py defines (its plain-PyTorch
definition, `lowbit_partial_attention_sparse_reference`, is the spec: the integer pass's scores and
softmax, then the values of only the positions some row of the KV head weighs at least
`min_weight`, and each key group's mean value `v_mean` for the rest of its weight).

The C kernel (lowbit_sparse_cpu.c) takes the float pass's inputs and layout (lowbit_cpu.py's
`_check` states them) plus v_mean (B, Hkv, ceil(T / group), D) in the scales' dtype, and shares the
integer pass's scoring (int_scores.h) and the driver (lowbit_driver.h): its weights, row_max and
row_sum are the integer kernel's bit for bit on the same build. Its mix dequantizes each kept
position once and multiplies it into every row (AVX512 where the integer pass has its VNNI path,
AVX2, else plain C: `path_of`); `out` differs from the twin's mix of the kernel's own weights and
kept only by float summation order. `kept` itself may differ from the twin's where a weight lies
within its last bits of min_weight (the weights differ from the twin's there).

`register()` compiles the kernel at first use (cpu_build.py) and registers it for CPU tensors,
dispatched in C++ (cpu_ops.cpp) where that builds, else through ctypes; False (one warning) where
it cannot build, and the twin serves. SPECACHE_NO_CPU_KERNEL=1 forces that.
"""

import ctypes
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from specache.kernels import cpu_build, lowbit_cpu, lowbit_int_cpu
from specache.lowbit import LowBitKV
from specache.ops import SparsePart, arguments, lowbit_partial_attention_sparse_reference

SOURCE = Path(__file__).with_name("lowbit_sparse_cpu.c")
FUNCTION = "lowbit_partial_attention_sparse"


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    """Compile lowbit_sparse_cpu.c with `flags` into the cache (once); the library's path."""
    return cpu_build.build(SOURCE, flags)


load = partial(lowbit_int_cpu.load, function=FUNCTION)
path_of = lowbit_int_cpu.path_of  # its vector paths, from int_scores.h, are the integer pass's


def run_kernel(
    lib: ctypes.CDLL,
    rows: Tensor,
    kv: LowBitKV,
    min_weight: float,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> SparsePart:
    """Call the sparse C kernel of `lib` (a `load`ed build) on CPU tensors; kv.v_mean is needed."""
    problem, inputs, outputs = lowbit_cpu.prepare(
        rows, kv, visible_len, excluded_pos, excluded_valid
    )
    b, h, t = kv.k_packed.shape[:3]
    means = (b, h, -(-t // kv.group), rows.shape[3])
    if kv.v_mean is None or kv.v_mean.shape != means or kv.v_mean.dtype != kv.k_scale.dtype:
        got = None if kv.v_mean is None else (tuple(kv.v_mean.shape), kv.v_mean.dtype)
        raise ValueError(f"{FUNCTION}: kv.v_mean must be {means} {kv.k_scale.dtype}, got {got}")
    if kv.v_mean.device != rows.device:
        raise ValueError(f"{FUNCTION}: all tensors must be on one device")
    v_mean = kv.v_mean.contiguous()
    kept = torch.empty(b, h, t, dtype=torch.bool)
    problem.v_mean, problem.kept, problem.min_weight = (
        v_mean.data_ptr(),
        kept.data_ptr(),
        min_weight,
    )
    lowbit_cpu.call(lib, FUNCTION, problem)  # `inputs` and v_mean alive until here
    return SparsePart(*outputs, kept)


def _serve(lib: ctypes.CDLL, function: str, reference: Callable, *inputs) -> SparsePart:
    """specache::lowbit_partial_attention_sparse for CPU tensors (its arguments, in its order)
    where the C++ dispatch does not build: the C kernel through ctypes for the shapes it takes,
    `reference` otherwise."""
    a = arguments(reference, inputs)
    if lowbit_cpu.takes(a.rows, a.bits, a.group) and a.k_packed.shape[2] > 0:
        kv = LowBitKV(**{field: getattr(a, field) for field in LowBitKV._fields})
        excluded = (a.excluded_pos, a.excluded_valid)
        return run_kernel(lib, a.rows, kv, a.min_weight, a.visible_len, *excluded)
    return reference(*inputs)


@lru_cache(maxsize=None)
def register() -> bool:
    """Build the C kernel (once) and make it serve `specache::lowbit_partial_attention_sparse` for
    CPU tensors; False where it cannot (the twin serves)."""
    return lowbit_cpu.register_build(
        SOURCE,
        FUNCTION,
        lowbit_partial_attention_sparse_reference,
        "the CPU sparse kernel is unavailable, its twin serves",
        _serve,
    )
