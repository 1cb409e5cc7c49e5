"""The low-bit segment of SpeCache's attention on CPUs: a C kernel for the op
`specache::lowbit_partial_attention` that specache/ops.py defines (its plain-PyTorch definition,
`lowbit_partial_attention_reference`, is the spec).

The C kernel (lowbit_cpu.c) never dequantizes. Scales fold into the other operand
(q . (code * s + z) = (q * s) . code + q . z for keys, per channel and key group; w (code * s + z) =
(w * s) code + w z for values, per token and value group), and then both products are lookups in
16-entry tables indexed by 4 bits of packed codes, 16 lanes per vpermps:
- keys: a nibble of a token holds 4/bits channels; per row and key group, each nibble position
  gets the table of the 16 partial dot products it can give;
- values: a nibble of a channel holds its codes in 4/bits consecutive tokens; per row, those
  tokens get the table of the 16 partial weighted sums they can give a channel.
Dequantizing would take an FMA per channel, token and row; this takes one lookup and one add per
nibble and row, for 16 tokens (keys) or 16 channels (values) at a time. A first parallel pass writes
the scores into `weights` and takes the row maxima; a second exponentiates in place (a polynomial
exp, relative error ~1e-7) and mixes the values. Work is split over (batch, head, chunk of
positions) with OpenMP, on torch's thread count; results do not depend on it. It takes head dims
that are multiples of 16 up to 256 and groups that are multiples of 8 (`takes`); other shapes go to
the reference.

`register()` compiles the kernel at first use (cpu_build.py; without AVX-512 the same file
builds plain C that runs the same tables one lookup at a time) and registers it for CPU tensors:
dispatched in C++ (cpu_ops.cpp) where that builds, else through ctypes. Without gcc, or when
the build fails, it returns False (with one warning) and the reference serves;
SPECACHE_NO_CPU_KERNEL=1 forces that. `run_kernel(load(build(flags)), ...)` runs a given build.
"""

import ctypes
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from specache.kernels import cpu_build, cpu_ops
from specache.lowbit import SCALE_DTYPES, LowBitKV, value_group
from specache.ops import arguments, lowbit_partial_attention_reference

SOURCE = Path(__file__).with_name("lowbit_cpu.c")
FLAGS = cpu_build.FLAGS
MAX_HEAD_DIM = 256  # the C file's MAX_D
Outputs = tuple[Tensor, Tensor, Tensor, Tensor]


def _check(
    rows: Tensor, kv: LowBitKV, visible_len: Tensor, excluded_pos: Tensor, excluded_valid: Tensor
) -> None:
    """Raise ValueError unless the inputs have the op's layout and a shape the C kernel takes."""

    def fail(message: str):
        raise ValueError(f"lowbit_partial_attention: {message}")

    if rows.dim() != 4 or rows.dtype != torch.float32:
        fail(f"rows must be (B, Hkv, M, D) float32, got {tuple(rows.shape)} {rows.dtype}")
    b, h, _, d = rows.shape
    if b < 1 or h < 1:
        fail(f"need B and Hkv >= 1, got {tuple(rows.shape)}")
    if kv.bits not in (1, 2):
        fail(f"bits must be 1 or 2, got {kv.bits}")
    if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
        fail(f"head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {d}")
    if kv.group <= 0 or kv.group % 8 or d % value_group(kv.group, d):
        fail(
            f"group must be a positive multiple of 8 that makes whole value groups of head_dim "
            f"{d}, got {kv.group}"
        )
    if kv.k_packed.dim() != 4 or kv.k_packed.shape[2] == 0:
        fail(f"k_packed must be (B, Hkv, T > 0, D*bits/8), got {tuple(kv.k_packed.shape)}")
    if kv.k_scale.dtype not in SCALE_DTYPES:
        fail(f"scales must be float16 or bfloat16, got {kv.k_scale.dtype}")
    t, nbytes, groups = kv.k_packed.shape[2], d * kv.bits // 8, -(-kv.k_packed.shape[2] // kv.group)
    value_groups = d // value_group(kv.group, d)
    expected = (
        (kv.k_packed, (b, h, t, nbytes), torch.uint8),
        (kv.k_scale, (b, h, groups, d), kv.k_scale.dtype),
        (kv.k_zero, (b, h, groups, d), kv.k_scale.dtype),
        (kv.v_packed, (b, h, t, nbytes), torch.uint8),
        (kv.v_scale, (b, h, t, value_groups), kv.k_scale.dtype),
        (kv.v_zero, (b, h, t, value_groups), kv.k_scale.dtype),
    )
    for name, (x, shape, dtype) in zip(
        ("k_packed", "k_scale", "k_zero", "v_packed", "v_scale", "v_zero"), expected
    ):
        if x.shape != shape or x.dtype != dtype:
            fail(f"kv.{name} must be {shape} {dtype}, got {tuple(x.shape)} {x.dtype}")
    if visible_len.shape != (b,) or visible_len.dtype != torch.int64:
        fail(
            f"visible_len must be ({b},) int64, got {tuple(visible_len.shape)} {visible_len.dtype}"
        )
    if (
        excluded_pos.dim() != 3
        or excluded_pos.shape[:2] != (b, h)
        or excluded_pos.dtype != torch.int64
    ):
        fail(
            f"excluded_pos must be ({b}, {h}, K) int64, got {tuple(excluded_pos.shape)} "
            f"{excluded_pos.dtype}"
        )
    if excluded_valid.shape != excluded_pos.shape or excluded_valid.dtype != torch.bool:
        fail(
            f"excluded_valid must be bool shaped like excluded_pos, "
            f"got {tuple(excluded_valid.shape)} {excluded_valid.dtype}"
        )
    device = rows.device
    if any(x.device != device for x in (*kv[:6], visible_len, excluded_pos, excluded_valid)):
        fail("all tensors must be on one device")


# ---------------------------------------------------------------------------------------------
# Building and loading the C kernel
# ---------------------------------------------------------------------------------------------


class _Problem(ctypes.Structure):
    """The C file's Problem struct, field for field."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "rows",
            "k_packed",
            "v_packed",
            "k_scale",
            "k_zero",
            "v_scale",
            "v_zero",
            "visible_len",
            "excluded_pos",
            "excluded_valid",
            "weights",
            "row_max",
            "row_sum",
            "out",
        )
    ]
    _fields_ += [(name, ctypes.c_int64) for name in ("batch", "heads", "m", "d", "t", "k")]
    _fields_ += [
        (name, ctypes.c_int32) for name in ("bits", "group", "value_groups", "bf16", "threads")
    ]
    # the sparse pass's alone (lowbit_sparse_cpu.py), NULL and 0 for the others
    _fields_ += [("v_mean", ctypes.c_void_p), ("kept", ctypes.c_void_p)]
    _fields_ += [("min_weight", ctypes.c_double)]
    # the one-op step's alone (step_cpu.cpp): each row's largest weight per block; NULL here
    _fields_ += [("block_max", ctypes.c_void_p)]


def build(flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile lowbit_cpu.c with `flags` into the cache (once) and return the library's
    path."""
    return cpu_build.build(SOURCE, flags)


def load(path: Path) -> ctypes.CDLL:
    return cpu_build.load(path, "lowbit_partial_attention", _Problem)


def run_kernel(
    lib: ctypes.CDLL,
    rows: Tensor,
    kv: LowBitKV,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
    function: str = "lowbit_partial_attention",
) -> Outputs:
    """Call the C kernel `function` of `lib` (a `load`ed build) on CPU tensors."""
    problem, inputs, outputs = prepare(rows, kv, visible_len, excluded_pos, excluded_valid)
    call(lib, function, problem)  # `inputs` alive until here
    return outputs


def prepare(
    rows: Tensor, kv: LowBitKV, visible_len: Tensor, excluded_pos: Tensor, excluded_valid: Tensor
) -> tuple[_Problem, list[Tensor], Outputs]:
    """The checked arguments as a Problem, the contiguous inputs it points into (which must live
    through the call) and the outputs it points to."""
    _check(rows, kv, visible_len, excluded_pos, excluded_valid)
    if rows.device.type != "cpu":
        raise ValueError(
            f"lowbit_partial_attention: the C kernel takes CPU tensors, got {rows.device}"
        )
    b, h, m, d = rows.shape
    t = kv.k_packed.shape[2]
    inputs = [
        x.contiguous()
        for x in (
            rows,
            kv.k_packed,
            kv.v_packed,
            kv.k_scale,
            kv.k_zero,
            kv.v_scale,
            kv.v_zero,
            visible_len,
            excluded_pos,
            excluded_valid,
        )
    ]
    outputs = [
        rows.new_empty(b, h, m, t),
        rows.new_empty(b, h, m),
        rows.new_empty(b, h, m),
        rows.new_empty(b, h, m, d),
    ]
    problem = _Problem(
        *(x.data_ptr() for x in inputs + outputs),
        b,
        h,
        m,
        d,
        t,
        excluded_pos.shape[2],
        kv.bits,
        kv.group,
        kv.v_scale.shape[3],
        kv.k_scale.dtype == torch.bfloat16,
        torch.get_num_threads(),
    )
    return problem, inputs, tuple(outputs)


def call(lib: ctypes.CDLL, function: str, problem: _Problem) -> None:
    """Run the C kernel `function` of `lib` on a `prepare`d problem."""
    if getattr(lib, function)(ctypes.byref(problem)) != 0:
        raise RuntimeError(f"{function}: the C kernel rejected a problem that passed the checks")


def takes(rows: Tensor, bits: int, group: int) -> bool:
    """Whether the C kernel takes rows (B, Hkv, M, D) of a copy with these bits and group."""
    d = rows.shape[-1]
    return (
        d % 16 == 0
        and 16 <= d <= MAX_HEAD_DIM
        and group % 8 == 0
        and group > 0
        and d % value_group(group, d) == 0
        and bits in (1, 2)
    )


def _serve(lib: ctypes.CDLL, function: str, reference: Callable, *inputs) -> Outputs:
    """specache::`function` for CPU tensors (its arguments, in its order) where the C++ dispatch
    does not build: the C kernel `function` through ctypes for the shapes it takes, `reference`
    otherwise."""
    a = arguments(reference, inputs)
    if takes(a.rows, a.bits, a.group) and a.k_packed.shape[2] > 0:
        kv = LowBitKV(**{field: getattr(a, field, None) for field in LowBitKV._fields})
        excluded = (a.excluded_pos, a.excluded_valid)
        return run_kernel(lib, a.rows, kv, a.visible_len, *excluded, function)
    return reference(*inputs)


def register_build(
    source: Path, function: str, reference: Callable, unavailable: str, serve: Callable = _serve
) -> bool:
    """Build the C file `source` (once) and make its `function` serve the op specache::`function`
    for CPU tensors (the low-bit passes share inputs and layout); False, with one warning saying
    `unavailable`, where it cannot (`reference` serves). `serve`: the ctypes implementation where
    the C++ dispatch does not build, called as `_serve` is."""
    if not cpu_build.enabled():
        return False
    lib = cpu_build.build_and_load(source, function, _Problem, unavailable)
    if lib is None:
        return False
    if not cpu_ops.hand_over(function, lib, reference):
        torch.library.register_kernel(
            f"specache::{function}", "cpu", partial(serve, lib, function, reference)
        )
    return True


@lru_cache(maxsize=None)
def register() -> bool:
    """Build the C kernel (once) and make it serve `specache::lowbit_partial_attention` for CPU
    tensors; False where it cannot (the reference serves)."""
    return register_build(
        SOURCE,
        "lowbit_partial_attention",
        lowbit_partial_attention_reference,
        "the CPU low-bit kernel is unavailable, the reference serves",
    )
