"""The C++ dispatch of the host's CPU kernels (kernels/host_ops.cpp): `gptfast::quantized_linear`
(about 150 calls a decode step on SmolLM2's int8/int4 weights) and `gptfast::dense_decode_attention`
(one per layer of the full cache). Their Python implementations (linear_cpu.py, dense_cpu.py) call
the C kernel through ctypes, some 12 us a call beyond the kernel; the C++ implementations do the
same in about 2. It is built as SpeCache's own dispatch is (specache/kernels/cpu_ops.py, whose
header it includes); without g++, or when the build fails, the Python implementations serve (one
warning); SPECACHE_NO_CPU_OPS=1 keeps them.
"""

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from specache.kernels import cpu_ops

SOURCE = Path(__file__).with_name("host_ops.cpp")
# SpeCache's kernel folder: the headers the host's kernels share with it (cpu_ops.h, simd.h,
# elements.h)
SHARED_HEADERS = cpu_ops.SOURCE.parent


def build() -> Path:
    """host_ops.cpp, built on the package's dispatch header."""
    return cpu_ops.build_extension(SOURCE, include=(SHARED_HEADERS,))


@lru_cache(maxsize=None)
def loaded() -> bool:
    """Whether this dispatch is built and loaded (once per process)."""
    return cpu_ops.load_extension(
        build, "the C++ dispatch of the host's CPU kernels is unavailable"
    )


def hand_over(op: str, lib: ctypes.CDLL) -> bool:
    """Register the C++ implementation of `op` (quantized_linear or dense_decode_attention) around
    the C kernel of that name in `lib` (a loaded build); False where it cannot be built (the Python
    implementation serves)."""
    if not loaded():
        return False
    torch.ops.gptfast.set_cpu_kernel(op, cpu_ops.address(lib, op), lib.problem_bytes())
    return True
