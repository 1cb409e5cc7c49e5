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
`gptfast::dense_decode_attention`, one opaque call under torch.compile, built at first use
(specache/kernels/cpu_build.py); without gcc, or when the build fails, `available()` is False
(with one warning) and the full cache keeps SDPA and FlexAttention. SPECACHE_NO_CPU_KERNEL=1
forces that. Results do not depend on the thread count. Inference only: no autograd formula.
"""

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F

from kernels import host_ops
from specache.kernels import cpu_build

SOURCE = Path(__file__).with_name("dense_cpu.c")
MAX_HEAD_DIM, MAX_ROWS = 256, 64  # the C file's MAX_D and MAX_ROWS (query rows per KV head)
DTYPES = cpu_build.DTYPES


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


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    return cpu_build.build(SOURCE, flags, include=(host_ops.SHARED_HEADERS,))


def load(path: Path) -> ctypes.CDLL:
    return cpu_build.load(path, "dense_decode_attention", _Problem)


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    lib = cpu_build.build_and_load(
        SOURCE,
        "dense_decode_attention",
        _Problem,
        "the CPU dense decode-attention kernel is unavailable, SDPA and FlexAttention serve",
        include=(host_ops.SHARED_HEADERS,),
    )
    if lib is None:
        return None
    # C++ dispatch where it builds
    host_ops.hand_over("dense_decode_attention", lib)
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
_LIBRARY = torch.library.Library("gptfast", "FRAGMENT")
_LIBRARY.define(
    "dense_decode_attention(Tensor q, Tensor k, Tensor v, Tensor input_pos, float? scale) -> Tensor"
)
# kernels/host_ops.cpp overrides it for CPU
_LIBRARY.impl("dense_decode_attention", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("gptfast::dense_decode_attention")
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
        return torch.ops.gptfast.dense_decode_attention(q, k, v, input_pos, scale)
    return dense_decode_attention_reference(q, k, v, input_pos, scale)
