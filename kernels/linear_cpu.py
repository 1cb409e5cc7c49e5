"""A few float rows times int8 or int4 weights on CPUs: a C kernel and its plain-PyTorch reference.

    quantized_linear(x, codes, scales, zeros=None, group=0) -> x @ W.T    (x (M, K) float32, M <=
    16)

The weights are quantize.py's layouts:
- int8 (`group` 0): codes (N, K) int8, scales (N,): W[n, k] = codes[n, k] * scales[n];
- int4: codes (N, K/2) uint8, two a byte with the even channel in the low nibble, scales and zeros
  (N, K/group): W[n, k] = code[n, k] * scales[n, k // group] + zeros[n, k // group].
`quantized_linear_reference` dequantizes and multiplies; it is the spec.

A decode step multiplies one row per sequence (two with SpeCache's speculative row) by every
weight, so its time is the time to read the weights once. kernels/linear_cpu.c reads each weight
once per call and widens it in registers, at about the machine's read bandwidth where inductor's
fused multiply-reduce over int8 codes reached a third of it (scripts/bench/bench_quant.py measures
every way to run a quantized Linear here). It is the op `gptfast::quantized_linear`, one opaque
call under torch.compile, dispatched in C++ where kernels/host_ops.cpp builds, built at first use
(specache/kernels/cpu_build.py); without gcc, or when the build fails, `available()` is
False (with one warning) and the quantized Linears keep their other paths. SPECACHE_NO_CPU_KERNEL=1
forces that. Results do not depend on the thread count. Inference only: no autograd formula.
"""

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import host_ops
from specache.kernels import cpu_build

SOURCE = Path(__file__).with_name("linear_cpu.c")
MAX_ROWS = 16  # the C file's MAX_ROWS


def unpack_int4(codes: Tensor, in_features: int) -> Tensor:
    """(N, K/2) uint8 -> (N, K) codes in [0, 15], the even channel from the low nibble."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], in_features)


def _check(x: Tensor, codes: Tensor, scales: Tensor, zeros: Optional[Tensor], group: int) -> None:
    """Raise ValueError unless the inputs have the layout in the module docstring."""

    def fail(message: str):
        raise ValueError(f"quantized_linear: {message}")

    if x.dim() != 2 or x.dtype != torch.float32 or not 1 <= x.shape[0] <= MAX_ROWS:
        fail(f"x must be (M, K) float32 with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)} {x.dtype}")
    k = x.shape[1]
    if group == 0:
        if codes.dim() != 2 or codes.dtype != torch.int8 or codes.shape[1] != k:
            fail(f"int8 codes must be (N, {k}) int8, got {tuple(codes.shape)} {codes.dtype}")
        if scales.shape != (codes.shape[0],) or scales.dtype != torch.float32:
            fail(
                f"int8 scales must be ({codes.shape[0]},) float32, got {tuple(scales.shape)} "
                f"{scales.dtype}"
            )
        return
    if group < 2 or group % 2 or k % group:
        fail(f"the int4 group must be even and divide K = {k}, got {group}")
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] * 2 != k:
        fail(f"int4 codes must be (N, {k // 2}) uint8, got {tuple(codes.shape)} {codes.dtype}")
    shape = (codes.shape[0], k // group)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is None or t.shape != shape or t.dtype != torch.float32:
            fail(
                f"int4 {name} must be {shape} float32, got "
                f"{None if t is None else (tuple(t.shape), t.dtype)}"
            )


def quantized_linear_reference(
    x: Tensor, codes: Tensor, scales: Tensor, zeros: Optional[Tensor] = None, group: int = 0
) -> Tensor:
    """The module docstring's definition: dequantize W, then x @ W.T."""
    _check(x, codes, scales, zeros, group)
    if group == 0:
        weight = codes.float() * scales[:, None]
    else:
        n, k = codes.shape[0], x.shape[1]
        grouped = unpack_int4(codes, k).float().view(n, k // group, group)
        weight = (grouped * scales[..., None] + zeros[..., None]).view(n, k)
    return x @ weight.T


class _Problem(ctypes.Structure):
    """The C file's Problem struct, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "w", "scales", "zeros", "y")]
    _fields_ += [(name, ctypes.c_int64) for name in ("m", "n", "k")]
    _fields_ += [(name, ctypes.c_int32) for name in ("group", "threads")]


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    return cpu_build.build(SOURCE, flags, include=(host_ops.SHARED_HEADERS,))


def load(path: Path) -> ctypes.CDLL:
    return cpu_build.load(path, "quantized_linear", _Problem)


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    lib = cpu_build.build_and_load(
        SOURCE,
        "quantized_linear",
        _Problem,
        "the CPU quantized-Linear kernel is unavailable, torch's paths serve",
        include=(host_ops.SHARED_HEADERS,),
    )
    if lib is None:
        return None
    host_ops.hand_over("quantized_linear", lib)  # C++ dispatch where it builds
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the C kernel can run (builds it on first call). Under torch.compile, read once at
    tracing."""
    return cpu_build.enabled() and _library() is not None


def run_kernel(
    lib: ctypes.CDLL,
    x: Tensor,
    codes: Tensor,
    scales: Tensor,
    zeros: Optional[Tensor] = None,
    group: int = 0,
) -> Tensor:
    """Call the C kernel of `lib` (a `load`ed build) on CPU tensors."""
    _check(x, codes, scales, zeros, group)
    if x.device.type != "cpu":
        raise ValueError(f"quantized_linear: the C kernel takes CPU tensors, got {x.device}")
    inputs = [t.contiguous() for t in (x, codes, scales, scales if zeros is None else zeros)]
    y = x.new_empty(x.shape[0], codes.shape[0])
    problem = _Problem(
        *(t.data_ptr() for t in inputs),
        y.data_ptr(),
        x.shape[0],
        codes.shape[0],
        x.shape[1],
        group,
        torch.get_num_threads(),
    )
    if lib.quantized_linear(ctypes.byref(problem)) != 0:
        raise RuntimeError("linear_cpu.c rejected a problem that passed the checks")
    return y


def _op(x: Tensor, codes: Tensor, scales: Tensor, zeros: Optional[Tensor], group: int) -> Tensor:
    lib = _library()
    if lib is None:  # called directly, where the kernel cannot run
        return quantized_linear_reference(x, codes, scales, zeros, group)
    return run_kernel(lib, x, codes, scales, zeros, group)


# Defined with torch.library.Library rather than torch.library.custom_op: a decode step makes
# about 150 of these calls, and custom_op's wrapper costs 13 us more per call (measured here).
_LIBRARY = torch.library.Library("gptfast", "FRAGMENT")
_LIBRARY.define(
    "quantized_linear(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int group) -> Tensor"
)
# kernels/host_ops.cpp overrides it for CPU
_LIBRARY.impl("quantized_linear", _op, "CompositeExplicitAutograd")


@torch.library.register_fake("gptfast::quantized_linear")
def _(x, codes, scales, zeros, group):
    _check(x, codes, scales, zeros, group)
    return x.new_empty(x.shape[0], codes.shape[0])


def quantized_linear(
    x: Tensor, codes: Tensor, scales: Tensor, zeros: Optional[Tensor] = None, group: int = 0
) -> Tensor:
    """x @ W.T (M, N) float32, as in the module docstring: the C kernel for CPU tensors when it is
    available, else the reference."""
    if x.device.type == "cpu" and available():
        return torch.ops.gptfast.quantized_linear(x, codes, scales, zeros, group)
    return quantized_linear_reference(x, codes, scales, zeros, group)
