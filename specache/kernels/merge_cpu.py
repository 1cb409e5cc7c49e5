"""The kernel of `specache::merge_segments` on CPUs (merge_cpu.c): SpeCache's other dense attention,
the query rows over its three 16-bit segments merged with the low-bit pass in one softmax
(specache/ops.py's `merge_segments_reference` is the spec). It runs twice per layer and step; one C
call replaces 3 to 6 small matmuls (MKL: several microseconds each) and the loops between them.
`register()` registers it for CPU tensors (up to 64 rows and head_dim 256; the reference takes
larger ones), through the C++ dispatch where that builds (cpu_ops.py), else through ctypes."""

import ctypes
from functools import lru_cache, partial
from pathlib import Path

import torch
from torch import Tensor

from specache.kernels import cpu_build, cpu_ops
from specache.ops import arguments, merge_segments_reference

SOURCE = Path(__file__).with_name("merge_cpu.c")
MAX_HEAD_DIM, MAX_ROWS = 256, 64  # the C file's MAX_D and MAX_ROWS (query rows per KV head)
DTYPES = cpu_build.DTYPES


class _MergeProblem(ctypes.Structure):
    """merge_cpu.c's MergeProblem struct, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("rows", "row_max", "row_sum", "lowbit_out")]
    _fields_ += [("k", ctypes.c_void_p * 3), ("v", ctypes.c_void_p * 3)]
    _fields_ += [("k_stride", ctypes.c_int64 * 3 * 3), ("v_stride", ctypes.c_int64 * 3 * 3)]
    _fields_ += [
        (name, ctypes.c_void_p) for name in ("fetched_valid", "window_len", "out", "lowbit_scale")
    ]
    _fields_ += [("p", ctypes.c_void_p * 3)]
    _fields_ += [(name, ctypes.c_int64) for name in ("batch", "kv_heads", "m", "d")] + [
        ("n", ctypes.c_int64 * 3)
    ]
    _fields_ += [("dtype", ctypes.c_int32 * 3), ("threads", ctypes.c_int32)]


MergeOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _check_merge(
    rows: Tensor,
    row_max: Tensor,
    row_sum: Tensor,
    lowbit_out: Tensor,
    segments: list[tuple[Tensor, Tensor]],
    fetched_valid: Tensor,
    window_len: Tensor,
) -> None:
    """Raise ValueError unless the inputs have the layout in the module docstring."""

    def fail(message: str):
        raise ValueError(f"merge_segments: {message}")

    if rows.dim() != 4 or rows.dtype != torch.float32:
        fail(f"rows must be (B, Hkv, M, D) float32, got {tuple(rows.shape)} {rows.dtype}")
    b, h, m, d = rows.shape
    if not (1 <= m <= MAX_ROWS and 1 <= d <= MAX_HEAD_DIM):
        fail(f"need 1 <= M <= {MAX_ROWS} and 1 <= D <= {MAX_HEAD_DIM}, got M = {m}, D = {d}")
    for name, x, shape in (
        ("row_max", row_max, (b, h, m)),
        ("row_sum", row_sum, (b, h, m)),
        ("lowbit_out", lowbit_out, (b, h, m, d)),
    ):
        if x.shape != shape or x.dtype != torch.float32:
            fail(f"{name} must be {shape} float32, got {tuple(x.shape)} {x.dtype}")
    for name, (k, v) in zip(("fetched", "window", "new"), segments):
        if (
            k.dim() != 4
            or k.shape[:2] != (b, h)
            or k.shape[3] != d
            or k.dtype not in DTYPES
            or v.shape != k.shape
            or v.dtype != k.dtype
        ):
            fail(
                f"{name}_k and {name}_v must be ({b}, {h}, N, {d}) float32, bfloat16 or float16 "
                "alike, got "
                f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
            )
    s = segments[2][0].shape[2]
    if s < 1 or m % s:
        fail(f"need S >= 1 new pairs and M = {m} a multiple of S = {s}")
    if fetched_valid.shape != (b, h, segments[0][0].shape[2]) or fetched_valid.dtype != torch.bool:
        fail(
            f"fetched_valid must be ({b}, {h}, {segments[0][0].shape[2]}) bool, got "
            f"{tuple(fetched_valid.shape)} "
            f"{fetched_valid.dtype}"
        )
    if window_len.shape != (b,) or window_len.dtype != torch.int64:
        fail(f"window_len must be ({b},) int64, got {tuple(window_len.shape)} {window_len.dtype}")
    if any(
        x.device != rows.device
        for x in (
            row_max,
            row_sum,
            lowbit_out,
            fetched_valid,
            window_len,
            *segments[0],
            *segments[1],
            *segments[2],
        )
    ):
        fail("all tensors must be on one device")


def run_merge_kernel(lib: ctypes.CDLL, *inputs: Tensor) -> MergeOutputs:
    """Call the merge in `lib` (a `load`ed build) on CPU tensors: specache::merge_segments's
    arguments, in its order."""
    a = arguments(merge_segments_reference, inputs)
    rows, row_max, row_sum, lowbit_out = a.rows, a.row_max, a.row_sum, a.lowbit_out
    fetched_valid, window_len = a.fetched_valid, a.window_len
    segments = [(a.fetched_k, a.fetched_v), (a.window_k, a.window_v), (a.new_k, a.new_v)]
    _check_merge(rows, row_max, row_sum, lowbit_out, segments, fetched_valid, window_len)
    if rows.device.type != "cpu":
        raise ValueError(f"merge_segments: the C kernel takes CPU tensors, got {rows.device}")
    b, h, m, d = rows.shape
    segments = [
        tuple(x if x.stride(-1) == 1 else x.contiguous() for x in pair) for pair in segments
    ]
    rows, row_max, row_sum, lowbit_out, valid, window_len = (
        x.contiguous() for x in (rows, row_max, row_sum, lowbit_out, fetched_valid, window_len)
    )
    out, lowbit_scale = torch.empty_like(rows), rows.new_empty(b, h, m, 1)
    probs = [rows.new_empty(b, h, m, k.shape[2]) for k, _ in segments]
    problem = _MergeProblem(
        rows.data_ptr(),
        row_max.data_ptr(),
        row_sum.data_ptr(),
        lowbit_out.data_ptr(),
        (ctypes.c_void_p * 3)(*(k.data_ptr() for k, _ in segments)),
        (ctypes.c_void_p * 3)(*(v.data_ptr() for _, v in segments)),
        (ctypes.c_int64 * 3 * 3)(*((ctypes.c_int64 * 3)(*k.stride()[:3]) for k, _ in segments)),
        (ctypes.c_int64 * 3 * 3)(*((ctypes.c_int64 * 3)(*v.stride()[:3]) for _, v in segments)),
        valid.data_ptr(),
        window_len.data_ptr(),
        out.data_ptr(),
        lowbit_scale.data_ptr(),
        (ctypes.c_void_p * 3)(*(p.data_ptr() for p in probs)),
        b,
        h,
        m,
        d,
        (ctypes.c_int64 * 3)(*(k.shape[2] for k, _ in segments)),
        (ctypes.c_int32 * 3)(*(DTYPES[k.dtype] for k, _ in segments)),
        torch.get_num_threads(),
    )
    if lib.merge_segments(ctypes.byref(problem)) != 0:
        raise RuntimeError("merge_cpu.c rejected a merge that passed the checks")
    return out, lowbit_scale, *probs


def _serve_merge(lib: ctypes.CDLL, *inputs: Tensor) -> MergeOutputs:
    """specache::merge_segments for CPU tensors where the C++ dispatch does not build: the C kernel
    through ctypes for the shapes it takes, the reference otherwise."""
    rows = inputs[0]
    if rows.shape[2] <= MAX_ROWS and rows.shape[3] <= MAX_HEAD_DIM:
        return run_merge_kernel(lib, *inputs)
    return merge_segments_reference(*inputs)


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    return cpu_build.build(SOURCE, flags)


def load(path: Path) -> ctypes.CDLL:
    return cpu_build.load(path, "merge_segments", _MergeProblem)


@lru_cache(maxsize=None)
def register() -> bool:
    """Build the C kernel (once) and make it serve `specache::merge_segments` for CPU tensors;
    False where it cannot (the reference serves)."""
    if not cpu_build.enabled():
        return False
    unavailable = "the CPU merge kernel is unavailable, the reference serves"
    lib = cpu_build.build_and_load(SOURCE, "merge_segments", _MergeProblem, unavailable)
    if lib is None:
        return False
    if not cpu_ops.hand_over("merge_segments", lib, merge_segments_reference):
        torch.library.register_kernel("specache::merge_segments", "cpu", partial(_serve_merge, lib))
    return True
