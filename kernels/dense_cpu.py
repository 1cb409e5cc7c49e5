"""Decode attention over the full KV cache on CPUs: a C kernel and its plain-PyTorch reference.

    dense_decode_attention(q, k, v, input_pos, scale) -> out

- q (B, H, S, D) float32: S new rows per sequence (decode: 1, or 2 with a speculative row);
- k, v (B, Hkv, T, D) float32, bfloat16 or float16, H a multiple of Hkv (grouped-query attention);
- input_pos (B, S) int64: row s of sequence b attends to positions 0 .. input_pos[b, s] (its own
  K, V are in the cache already: the full cache writes them first);
- out (B, H, S, D) float32 = softmax(q k^T * scale over the visible positions) v; zeros for a row
  that sees nothing.
`dense_decode_attention_reference` is SDPA with that mask; it is the spec.

A decode step reads the whole cache up to the position, so its time is the time to stream K and V
once. The C kernel (kernels/dense_cpu.c) reads each position once for all the query rows of its KV
head, only up to the furthest position any row sees (a cache allocated for a long generation costs
nothing past it), and widens 16-bit elements in registers. It is the op
`specache::dense_decode_attention`, one opaque call under torch.compile, built at first use
(kernels/cpu_build.py); without gcc, or when the build fails, `available()` is False (with one
warning) and the full cache keeps SDPA and FlexAttention. SPECACHE_NO_CPU_KERNEL=1 forces that.
Results do not depend on the thread count. Inference only: no autograd formula.

The same C file holds the kernel of `specache::merge_segments`, the op specache.py defines (its
`merge_segments_reference` is the spec): SpeCache's other dense attention, the query rows over its
three 16-bit segments merged with the low-bit pass in one softmax. It runs twice per layer and step;
one C call replaces 3 to 6 small matmuls (MKL: several microseconds each) and the loops between
them. `register_merge()` registers it for CPU tensors (up to 64 rows and head_dim 256; the reference
takes larger ones).
"""

import ctypes
import warnings
from functools import lru_cache, partial
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F

import specache
from kernels import cpu_build, cpu_ops

SOURCE = Path(__file__).with_name("dense_cpu.c")
MAX_HEAD_DIM, MAX_ROWS = 256, 64  # the C file's MAX_D and MAX_ROWS (query rows per KV head)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check(q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> None:
    """Raise ValueError unless the inputs have the layout in the module docstring."""

    def fail(message: str):
        raise ValueError(f"dense_decode_attention: {message}")

    if q.dim() != 4 or q.dtype != torch.float32:
        fail(f"q must be (B, H, S, D) float32, got {tuple(q.shape)} {q.dtype}")
    b, h, s, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[3] != d or k.dtype not in DTYPES:
        fail(
            f"k must be ({b}, Hkv, T, {d}) float32, bfloat16 or float16, got {tuple(k.shape)} "
            f"{k.dtype}"
        )
    if v.shape != k.shape or v.dtype != k.dtype:
        fail(
            f"v must be shaped and typed like k {tuple(k.shape)} {k.dtype}, got {tuple(v.shape)} "
            f"{v.dtype}"
        )
    if h % k.shape[1] or h // k.shape[1] * s > MAX_ROWS or not 1 <= d <= MAX_HEAD_DIM:
        fail(
            f"need H a multiple of Hkv, (H / Hkv) x S <= {MAX_ROWS} and D <= {MAX_HEAD_DIM}; got "
            f"H={h}, "
            f"Hkv={k.shape[1]}, S={s}, D={d}"
        )
    if input_pos.shape != (b, s) or input_pos.dtype != torch.int64:
        fail(f"input_pos must be ({b}, {s}) int64, got {tuple(input_pos.shape)} {input_pos.dtype}")
    if any(x.device != q.device for x in (k, v, input_pos)):
        fail("all tensors must be on one device")


def dense_decode_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, scale: Optional[float] = None
) -> Tensor:
    """The module docstring's definition: SDPA over the cache, masked to each row's position."""
    _check(q, k, v, input_pos)
    # (B, 1, S, T)
    visible = torch.arange(k.shape[2], device=q.device) <= input_pos[:, None, :, None]
    out = F.scaled_dot_product_attention(
        q, k.float(), v.float(), attn_mask=visible, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return torch.where(visible.any(-1, keepdim=True), out, 0.0)


class _Problem(ctypes.Structure):
    """The C file's Problem struct, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v", "input_pos", "out")]
    _fields_ += [(name, ctypes.c_int64) for name in ("batch", "heads", "kv_heads", "s", "d", "t")]
    _fields_ += [("scale", ctypes.c_float), ("dtype", ctypes.c_int32), ("threads", ctypes.c_int32)]


class _MergeProblem(ctypes.Structure):
    """The C file's MergeProblem struct, field for field."""

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


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    return cpu_build.build(SOURCE, flags)


def load(path: Path) -> ctypes.CDLL:
    lib = cpu_build.load(path, "dense_decode_attention", _Problem)
    lib.merge_segments.argtypes = [ctypes.POINTER(_MergeProblem)]
    lib.merge_segments.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    try:
        lib = load(build())
    except (RuntimeError, OSError) as error:
        warnings.warn(
            "specache: the CPU dense decode-attention kernel is unavailable, SDPA, FlexAttention "
            "and the "
            f"plain merge of SpeCache's segments serve ({error})"
        )
        return None
    # C++ dispatch where it builds
    cpu_ops.hand_over("dense_decode_attention", lib.dense_decode_attention)
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C kernel can run (builds it on first call). Under torch.compile, read once at
    tracing."""
    return cpu_build.enabled() and _library() is not None


def run_kernel(
    lib: ctypes.CDLL,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    input_pos: Tensor,
    scale: Optional[float] = None,
) -> Tensor:
    """Call the C kernel of `lib` (a `load`ed build) on CPU tensors."""
    _check(q, k, v, input_pos)
    if q.device.type != "cpu":
        raise ValueError(f"dense_decode_attention: the C kernel takes CPU tensors, got {q.device}")
    inputs = [x.contiguous() for x in (q, k, v, input_pos)]
    out = torch.empty_like(inputs[0])
    b, h, s, d = q.shape
    problem = _Problem(
        *(x.data_ptr() for x in inputs),
        out.data_ptr(),
        b,
        h,
        k.shape[1],
        s,
        d,
        k.shape[2],
        d**-0.5 if scale is None else scale,
        DTYPES[k.dtype],
        torch.get_num_threads(),
    )
    if lib.dense_decode_attention(ctypes.byref(problem)) != 0:
        raise RuntimeError("dense_cpu.c rejected a problem that passed the checks")
    return out


def _op(q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, scale: Optional[float]) -> Tensor:
    lib = _library()
    if lib is None:  # called directly, where the kernel cannot run
        return dense_decode_attention_reference(q, k, v, input_pos, scale)
    return run_kernel(lib, q, k, v, input_pos, scale)


# torch.library.Library rather than custom_op: its wrapper costs 13 us more per call (one per layer
# and step)
_LIBRARY = torch.library.Library("specache", "FRAGMENT")
_LIBRARY.define(
    "dense_decode_attention(Tensor q, Tensor k, Tensor v, Tensor input_pos, float? scale) -> Tensor"
)
# kernels/cpu_ops.cpp overrides it for CPU
_LIBRARY.impl("dense_decode_attention", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("specache::dense_decode_attention")
def _(q, k, v, input_pos, scale):
    _check(q, k, v, input_pos)
    return torch.empty_like(q)


def takes(q: Tensor, k: Tensor) -> bool:
    """Whether the C kernel runs queries q (B, H, S, D) over a cache k: CPU tensors of a shape it
    handles (decode: S a few rows), the kernel built."""
    rows = q.shape[1] // k.shape[1] * q.shape[2]
    return (
        q.device.type == "cpu"
        and rows <= MAX_ROWS
        and q.shape[-1] <= MAX_HEAD_DIM
        and k.dtype in DTYPES
        and available()
    )


def dense_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, scale: Optional[float] = None
) -> Tensor:
    """(B, H, S, D) float32, as in the module docstring (scale: default D**-0.5): the C kernel for
    CPU tensors when it is available, else the reference."""
    if q.device.type == "cpu" and available():
        return torch.ops.specache.dense_decode_attention(q, k, v, input_pos, scale)
    return dense_decode_attention_reference(q, k, v, input_pos, scale)


# ---------------------------------------------------------------------------------------------
# SpeCache's 16-bit segments merged with the low-bit pass
# ---------------------------------------------------------------------------------------------

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


def run_merge_kernel(
    lib: ctypes.CDLL,
    rows: Tensor,
    row_max: Tensor,
    row_sum: Tensor,
    lowbit_out: Tensor,
    fetched_k: Tensor,
    fetched_v: Tensor,
    fetched_valid: Tensor,
    window_k: Tensor,
    window_v: Tensor,
    window_len: Tensor,
    new_k: Tensor,
    new_v: Tensor,
) -> MergeOutputs:
    """Call the merge in `lib` (a `load`ed build) on CPU tensors."""
    segments = [(fetched_k, fetched_v), (window_k, window_v), (new_k, new_v)]
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
        raise RuntimeError("dense_cpu.c rejected a merge that passed the checks")
    return out, lowbit_scale, *probs


def _serve_merge(lib: ctypes.CDLL, *inputs: Tensor) -> MergeOutputs:
    """specache::merge_segments for CPU tensors where the C++ dispatch does not build: the C kernel
    through ctypes for the shapes it takes, the reference otherwise."""
    rows = inputs[0]
    if rows.shape[2] <= MAX_ROWS and rows.shape[3] <= MAX_HEAD_DIM:
        return run_merge_kernel(lib, *inputs)
    return specache.ops.merge_segments_reference(*inputs)


@lru_cache(maxsize=None)
def register_merge() -> bool:
    """Build the C kernel (once) and make it serve `specache::merge_segments` for CPU tensors;
    False where it cannot (the reference serves)."""
    lib = _library() if cpu_build.enabled() else None
    if lib is None:
        return False
    if not cpu_ops.hand_over(
        "merge_segments", lib.merge_segments, specache.ops.merge_segments_reference
    ):
        torch.library.register_kernel("specache::merge_segments", "cpu", partial(_serve_merge, lib))
    return True
