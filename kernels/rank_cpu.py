"""SpeCache's choice of exact pairs on CPUs: a C kernel and its plain-PyTorch reference.

    top_positions(weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, gqa_max,
                  lower, upper, excluded_pos, excluded_valid, k) -> (indices, valid)

ranks the positions [0, T) of the history by the weight new row `row` (of S) of the mixed-precision
attention gives them, and returns each KV head's k best candidates, best first:

    weight[b,h,g,t] = weights[b,h,g*S+row,t] * scale[b,h,g*S+row]          (the low-bit weights)
                      + p_fetched[b,h,g*S+row,j] summed over the slots j with fetched_pos = t
                      + p_window[b,h,g*S+row,r] where t = window_start[b] + r < T
    ranking[b,h,t]  = max over g of weight (gqa_max), else their mean
    candidate       = lower <= t < upper[b], and t not a valid excluded_pos[b,h,:]
    indices         = the k candidates of highest ranking; valid: false where fewer than k exist

(kernels/attention.py's `row_position_weights` and `over_query_heads` give the same ranking from
LowBitPart and Merged; G = M / S query heads share a KV head.) Ties go to the earlier position in
the C kernel; the reference's torch.topk breaks them its own way. Invalid entries point at
position 0 in the kernel and at any non-candidate in the reference; callers ignore them.

The C kernel (kernels/rank_cpu.c) reads each query head's weights once, over the candidate range
only, and keeps the best k in a heap. It is the op `specache::top_positions`, one opaque call under
torch.compile, dispatched in C++ (kernels/cpu_ops.cpp) where that builds. Without gcc,
`available()` is False and the reference runs; SPECACHE_NO_CPU_KERNEL=1 forces that.
"""
import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import cpu_build, cpu_ops

SOURCE = Path(__file__).with_name("rank_cpu.c")
Outputs = tuple[Tensor, Tensor]


def _check(weights: Tensor, scale: Tensor, p_fetched: Tensor, fetched_pos: Tensor, p_window: Tensor,
           window_start: Tensor, s: int, row: int, upper: Tensor, excluded_pos: Tensor, excluded_valid: Tensor,
           k: int) -> None:
    """Raise ValueError unless the inputs have the layout in the module docstring."""
    def fail(message: str):
        raise ValueError(f"top_positions: {message}")

    if weights.dim() != 4 or weights.dtype != torch.float32:
        fail(f"weights must be (B, Hkv, M, T) float32, got {tuple(weights.shape)} {weights.dtype}")
    b, h, m, _ = weights.shape
    if b < 1 or h < 1 or s < 1 or m < s or m % s or not 0 <= row < s or k < 0:
        fail(f"need B = {b} and Hkv = {h} >= 1, M = {m} a positive multiple of S = {s}, 0 <= row = {row} < S and "
             f"k = {k} >= 0")
    if scale.numel() != b * h * m or scale.shape[:3] != (b, h, m) or scale.dtype != torch.float32:
        fail(f"scale must be ({b}, {h}, {m}) or ({b}, {h}, {m}, 1) float32, got {tuple(scale.shape)} {scale.dtype}")
    for name, x in (("p_fetched", p_fetched), ("p_window", p_window)):
        if x.dim() != 4 or x.shape[:3] != (b, h, m) or x.dtype != torch.float32:
            fail(f"{name} must be ({b}, {h}, {m}, N) float32, got {tuple(x.shape)} {x.dtype}")
    if fetched_pos.shape != (b, h, p_fetched.shape[3]) or fetched_pos.dtype != torch.int64:
        fail(f"fetched_pos must be ({b}, {h}, {p_fetched.shape[3]}) int64, got {tuple(fetched_pos.shape)} "
             f"{fetched_pos.dtype}")
    for name, x in (("window_start", window_start), ("upper", upper)):
        if x.shape != (b,) or x.dtype != torch.int64:
            fail(f"{name} must be ({b},) int64, got {tuple(x.shape)} {x.dtype}")
    if excluded_pos.dim() != 3 or excluded_pos.shape[:2] != (b, h) or excluded_pos.dtype != torch.int64:
        fail(f"excluded_pos must be ({b}, {h}, E) int64, got {tuple(excluded_pos.shape)} {excluded_pos.dtype}")
    if excluded_valid.shape != excluded_pos.shape or excluded_valid.dtype != torch.bool:
        fail(f"excluded_valid must be bool shaped like excluded_pos, got {tuple(excluded_valid.shape)} "
             f"{excluded_valid.dtype}")
    if any(x.device != weights.device for x in (scale, p_fetched, fetched_pos, p_window, window_start, upper,
                                                 excluded_pos, excluded_valid)):
        fail("all tensors must be on one device")


def top_positions_reference(weights: Tensor, scale: Tensor, p_fetched: Tensor, fetched_pos: Tensor, p_window: Tensor,
                            window_start: Tensor, s: int, row: int, gqa_max: bool, lower: int, upper: Tensor,
                            excluded_pos: Tensor, excluded_valid: Tensor, k: int) -> Outputs:
    """The module docstring's definition in plain PyTorch: weights per query head, their max or
    mean, the candidates, torch.topk."""
    _check(weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, upper, excluded_pos,
           excluded_valid, k)
    b, h, m, t = weights.shape

    def pick(x: Tensor) -> Tensor:  # (B, Hkv, G, N): row `row` of each query head
        return x.reshape(b, h, m // s, s, -1)[:, :, :, row]

    position = torch.arange(t, device=weights.device)
    weight = pick(weights) * pick(scale.reshape(b, h, m, 1))
    if t:
        fetched = fetched_pos.clamp(0, t - 1)[:, :, None].expand(-1, -1, m // s, -1)
        window_pos = window_start[:, None] + torch.arange(p_window.shape[-1], device=weights.device)
        p_window_seen = pick(p_window) * (window_pos < t)[:, None, None, :]  # positions beyond the copy: no place
        weight = (weight.scatter_add(-1, fetched, pick(p_fetched))
                  .scatter_add(-1, window_pos.clamp(max=t - 1)[:, None, None, :].expand_as(p_window_seen),
                               p_window_seen))
    ranking = weight.amax(2) if gqa_max else weight.mean(2)
    # counted, not scattered as booleans: an invalid slot may repeat a valid slot's position
    hits = torch.zeros(b, h, t, dtype=torch.int32, device=weights.device)
    in_range = excluded_valid & (excluded_pos >= 0) & (excluded_pos < t)
    hits = hits.scatter_add(-1, excluded_pos.clamp(0, max(t - 1, 0)), in_range.to(torch.int32))
    candidates = (position >= lower) & (position < upper[:, None, None]) & (hits == 0)
    top = ranking.masked_fill(~candidates, -1.0).topk(k, dim=-1)
    return top.indices, top.values >= 0


class _Problem(ctypes.Structure):
    """The C file's Problem struct, field for field."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("weights", "scale", "p_fetched", "fetched_pos", "p_window", "window_start", "upper", "excluded_pos",
                 "excluded_valid", "indices", "valid")]
    _fields_ += [(name, ctypes.c_int64) for name in
                 ("batch", "heads", "m", "t", "n_fetched", "n_window", "n_excluded", "k", "lower")]
    _fields_ += [(name, ctypes.c_int32) for name in ("s", "row", "max_over_heads", "threads")]


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    return cpu_build.build(SOURCE, flags)


def load(path: Path) -> ctypes.CDLL:
    return cpu_build.load(path, "top_positions", _Problem)


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    lib = cpu_build.build_and_load(SOURCE, "top_positions", _Problem,
                                   "the CPU ranking kernel is unavailable, the PyTorch reference serves")
    if lib is not None:
        cpu_ops.hand_over("top_positions", lib.top_positions)  # C++ dispatch where it builds
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C kernel can run (builds it on first call). Under torch.compile, read once at tracing."""
    return cpu_build.enabled() and _library() is not None


def run_kernel(lib: ctypes.CDLL, weights: Tensor, scale: Tensor, p_fetched: Tensor, fetched_pos: Tensor,
               p_window: Tensor, window_start: Tensor, s: int, row: int, gqa_max: bool, lower: int, upper: Tensor,
               excluded_pos: Tensor, excluded_valid: Tensor, k: int) -> Outputs:
    """Call the C kernel of `lib` (a `load`ed build) on CPU tensors."""
    _check(weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, upper, excluded_pos,
           excluded_valid, k)
    if weights.device.type != "cpu":
        raise ValueError(f"top_positions: the C kernel takes CPU tensors, got {weights.device}")
    b, h, m, t = weights.shape
    inputs = [x.contiguous() for x in (weights, scale, p_fetched, fetched_pos, p_window, window_start, upper,
                                       excluded_pos, excluded_valid)]
    indices = torch.empty(b, h, k, dtype=torch.int64)
    valid = torch.empty(b, h, k, dtype=torch.bool)
    problem = _Problem(*(x.data_ptr() for x in inputs), indices.data_ptr(), valid.data_ptr(), b, h, m, t,
                       p_fetched.shape[3], p_window.shape[3], excluded_pos.shape[2], k, lower, s, row, gqa_max,
                       torch.get_num_threads())
    if lib.top_positions(ctypes.byref(problem)) != 0:
        raise RuntimeError("rank_cpu.c rejected a problem that passed the checks")
    return indices, valid


def _op(weights: Tensor, scale: Tensor, p_fetched: Tensor, fetched_pos: Tensor, p_window: Tensor,
        window_start: Tensor, s: int, row: int, gqa_max: bool, lower: int, upper: Tensor, excluded_pos: Tensor,
        excluded_valid: Tensor, k: int) -> Outputs:
    lib = _library()
    args = (weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, gqa_max, lower, upper,
            excluded_pos, excluded_valid, k)
    on_cpu = weights.device.type == "cpu"
    return run_kernel(lib, *args) if lib is not None and on_cpu else top_positions_reference(*args)


_LIBRARY = torch.library.Library("specache", "FRAGMENT")
_LIBRARY.define("top_positions(Tensor weights, Tensor scale, Tensor p_fetched, Tensor fetched_pos, Tensor p_window, "
                "Tensor window_start, int s, int row, bool gqa_max, int lower, Tensor upper, Tensor excluded_pos, "
                "Tensor excluded_valid, int k) -> (Tensor, Tensor)")
_LIBRARY.impl("top_positions", _op, "CompositeExplicitAutograd")  # kernels/cpu_ops.cpp overrides it for CPU


@torch.library.register_fake("specache::top_positions")
def _(weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, gqa_max, lower, upper, excluded_pos,
      excluded_valid, k):
    _check(weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, upper, excluded_pos,
           excluded_valid, k)
    b, h = weights.shape[:2]
    return weights.new_empty(b, h, k, dtype=torch.int64), weights.new_empty(b, h, k, dtype=torch.bool)


def top_positions(weights: Tensor, scale: Tensor, p_fetched: Tensor, fetched_pos: Tensor, p_window: Tensor,
                  window_start: Tensor, s: int, row: int, gqa_max: bool, lower: int, upper: Tensor,
                  excluded_pos: Tensor, excluded_valid: Tensor, k: int) -> Outputs:
    """(indices (B, Hkv, k) int64, valid (B, Hkv, k) bool), as in the module docstring: the C kernel
    for CPU tensors when it is available, else the reference."""
    args = (weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row, gqa_max, lower, upper,
            excluded_pos, excluded_valid, k)
    if weights.device.type == "cpu" and available():
        return torch.ops.specache.top_positions(*args)
    return top_positions_reference(*args)
