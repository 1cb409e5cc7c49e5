"""SpeCache's choice of exact pairs on CPUs: a C kernel for the op `specache::top_positions` that
specache/ops.py defines (`top_positions_reference` there is the spec, and its signature the op's)
ranks the positions [0, T) of the history by the weight new row `row` (of S) of the mixed-precision
attention gives them, and returns each KV head's k best candidates, best first:

    weight[b,h,g,t] = weights[b,h,g*S+row,t] * scale[b,h,g*S+row]          (the low-bit weights)
                      + p_fetched[b,h,g*S+row,j] summed over the slots j with fetched_pos = t
                      + p_window[b,h,g*S+row,r] where t = window_start[b] + r < T
    ranking[b,h,t]  = max over g of weight (gqa_max), else their mean
    candidate       = lower <= t < upper[b], and t not a valid excluded_pos[b,h,:]
    indices         = the k candidates of highest ranking; valid: false where fewer than k exist

(G = M / S query heads share a KV head.) Ties go to the earlier position in the C kernel; the
reference's torch.topk breaks them its own way. Invalid entries point at position 0 in the kernel
and at any non-candidate in the reference; callers ignore them.

The C kernel (rank_cpu.c) reads each query head's weights once, over the candidate range
only, and keeps the best k in a heap. `register()` builds it at first use and registers it for CPU
tensors, dispatched in C++ (cpu_ops.cpp) where that builds, else through ctypes. Without
gcc it returns False and the reference serves; SPECACHE_NO_CPU_KERNEL=1 forces that.
"""

import ctypes
from functools import lru_cache, partial
from pathlib import Path
from typing import Optional
from types import SimpleNamespace

import torch
from torch import Tensor

from specache.kernels import cpu_build, cpu_ops
from specache.ops import arguments, top_positions_reference

SOURCE = Path(__file__).with_name("rank_cpu.c")
Outputs = tuple[Tensor, Tensor]


def _check(a: SimpleNamespace) -> None:
    """Raise ValueError unless the inputs have the layout in the module docstring."""

    def fail(message: str):
        raise ValueError(f"top_positions: {message}")

    weights, scale, p_fetched, fetched_pos = a.weights, a.scale, a.p_fetched, a.fetched_pos
    p_window, window_start, s, row, upper, k = a.p_window, a.window_start, a.s, a.row, a.upper, a.k
    excluded_pos, excluded_valid = a.excluded_pos, a.excluded_valid

    if weights.dim() != 4 or weights.dtype != torch.float32:
        fail(f"weights must be (B, Hkv, M, T) float32, got {tuple(weights.shape)} {weights.dtype}")
    b, h, m, _ = weights.shape
    if b < 1 or h < 1 or s < 1 or m < s or m % s or not 0 <= row < s or k < 0:
        fail(
            f"need B = {b} and Hkv = {h} >= 1, M = {m} a positive multiple of S = {s}, 0 <= row = "
            f"{row} < S and "
            f"k = {k} >= 0"
        )
    if scale.numel() != b * h * m or scale.shape[:3] != (b, h, m) or scale.dtype != torch.float32:
        fail(
            f"scale must be ({b}, {h}, {m}) or ({b}, {h}, {m}, 1) float32, got "
            f"{tuple(scale.shape)} {scale.dtype}"
        )
    for name, x in (("p_fetched", p_fetched), ("p_window", p_window)):
        if x.dim() != 4 or x.shape[:3] != (b, h, m) or x.dtype != torch.float32:
            fail(f"{name} must be ({b}, {h}, {m}, N) float32, got {tuple(x.shape)} {x.dtype}")
    if fetched_pos.shape != (b, h, p_fetched.shape[3]) or fetched_pos.dtype != torch.int64:
        fail(
            f"fetched_pos must be ({b}, {h}, {p_fetched.shape[3]}) int64, got "
            f"{tuple(fetched_pos.shape)} "
            f"{fetched_pos.dtype}"
        )
    for name, x in (("window_start", window_start), ("upper", upper)):
        if x.shape != (b,) or x.dtype != torch.int64:
            fail(f"{name} must be ({b},) int64, got {tuple(x.shape)} {x.dtype}")
    if (
        excluded_pos.dim() != 3
        or excluded_pos.shape[:2] != (b, h)
        or excluded_pos.dtype != torch.int64
    ):
        fail(
            f"excluded_pos must be ({b}, {h}, E) int64, got {tuple(excluded_pos.shape)} "
            f"{excluded_pos.dtype}"
        )
    if excluded_valid.shape != excluded_pos.shape or excluded_valid.dtype != torch.bool:
        fail(
            f"excluded_valid must be bool shaped like excluded_pos, got "
            f"{tuple(excluded_valid.shape)} "
            f"{excluded_valid.dtype}"
        )
    if any(
        x.device != weights.device
        for x in (
            scale,
            p_fetched,
            fetched_pos,
            p_window,
            window_start,
            upper,
            excluded_pos,
            excluded_valid,
        )
    ):
        fail("all tensors must be on one device")


class _Problem(ctypes.Structure):
    """The C file's Problem struct, field for field."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "weights",
            "scale",
            "p_fetched",
            "fetched_pos",
            "p_window",
            "window_start",
            "upper",
            "excluded_pos",
            "excluded_valid",
            "indices",
            "valid",
        )
    ]
    _fields_ += [
        (name, ctypes.c_int64)
        for name in (
            "batch",
            "heads",
            "m",
            "t",
            "n_fetched",
            "n_window",
            "n_excluded",
            "k",
            "lower",
        )
    ]
    _fields_ += [(name, ctypes.c_int32) for name in ("s", "row", "max_over_heads", "threads")]
    # (B, Hkv, M, ceil(T / BLOCK)) float32 or NULL: each row's largest low-bit weight per block,
    # which the one-op step passes and the op leaves NULL (tests pass it: `run_kernel`)
    _fields_ += [("block_max", ctypes.c_void_p)]


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    return cpu_build.build(SOURCE, flags)


def load(path: Path) -> ctypes.CDLL:
    return cpu_build.load(path, "top_positions", _Problem)


def run_kernel(lib: ctypes.CDLL, *inputs, block_max: Optional[Tensor] = None) -> Outputs:
    """Call the C kernel of `lib` (a `load`ed build) on CPU tensors: specache::top_positions's
    arguments, in its order; with `block_max` (B, Hkv, M, ceil(T / 64)), at least each row's
    largest weight per block of 64 positions, as the one-op step passes it (the result is the
    same, found by skipping blocks)."""
    a = arguments(top_positions_reference, inputs)
    _check(a)
    if a.weights.device.type != "cpu":
        raise ValueError(f"top_positions: the C kernel takes CPU tensors, got {a.weights.device}")
    b, h, m, t = a.weights.shape
    pointed = (
        a.weights, a.scale, a.p_fetched, a.fetched_pos, a.p_window, a.window_start, a.upper,
        a.excluded_pos, a.excluded_valid,
    )  # fmt: skip
    tensors = [x.contiguous() for x in pointed]  # the struct's pointers, in its order
    indices = torch.empty(b, h, a.k, dtype=torch.int64)
    valid = torch.empty(b, h, a.k, dtype=torch.bool)
    bounds = None if block_max is None else block_max.float().contiguous()
    problem = _Problem(
        *(x.data_ptr() for x in tensors),
        indices.data_ptr(),
        valid.data_ptr(),
        b,
        h,
        m,
        t,
        a.p_fetched.shape[3],
        a.p_window.shape[3],
        a.excluded_pos.shape[2],
        a.k,
        a.lower,
        a.s,
        a.row,
        a.gqa_max,
        torch.get_num_threads(),
        None if bounds is None else bounds.data_ptr(),
    )
    if lib.top_positions(ctypes.byref(problem)) != 0:
        raise RuntimeError("rank_cpu.c rejected a problem that passed the checks")
    return indices, valid


@lru_cache(maxsize=None)
def register() -> bool:
    """Build the C kernel (once) and make it serve `specache::top_positions` for CPU tensors; False
    where it cannot (the reference serves)."""
    if not cpu_build.enabled():
        return False
    lib = cpu_build.build_and_load(
        SOURCE,
        "top_positions",
        _Problem,
        "the CPU ranking kernel is unavailable, the reference serves",
    )
    if lib is None:
        return False
    if not cpu_ops.hand_over("top_positions", lib):
        torch.library.register_kernel("specache::top_positions", "cpu", partial(run_kernel, lib))
    return True
