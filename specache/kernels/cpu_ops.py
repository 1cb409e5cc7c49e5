"""The C++ dispatch of SpeCache's CPU kernels (cpu_ops.cpp), and its one op per layer
(`specache::step_attention`, step_cpu.cpp), which chains them.

A decode step calls the low-bit pass, the merge and the ranking several times per layer. Their
Python implementations (lowbit_cpu.py, merge_cpu.py, rank_cpu.py) check the inputs and call the C
kernel through ctypes, some 12 us a call beyond the kernel; the C++ implementations do the same in
about 2. When a kernel's module has built its C library it calls `hand_over`, which builds the two
files once (g++ against the running torch's headers, cached as cpu_build.py caches the C kernels)
and registers the C++ implementation of that op for CPU tensors, ahead of the Python one. Without
g++, or when the build fails, the Python implementations serve (one warning);
SPECACHE_NO_CPU_OPS=1 keeps them. `build_extension` also builds the host's own dispatch (this
repository's kernels/host_ops.cpp).
"""

import ctypes
import os
import subprocess
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

import torch

from specache.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
STEP_SOURCE = Path(__file__).with_name("step_cpu.cpp")  # specache::step_attention


def build_extension(
    source: Path, also: tuple[Path, ...] = (), include: tuple[Path, ...] = ()
) -> Path:
    """Compile the C++ `source` (and `also`) against this torch (once per torch build) into one
    library, with the headers of `include` on the path, and return its path."""
    # the headers' location; imported here, only when building
    from torch.utils import (
        cpp_extension,
    )

    lib = Path(torch.__file__).parent / "lib"
    flags = (
        "-O2",
        # the machine's vector units (built where it runs, as the C kernels are), without fused
        # multiply-adds, which would round the float sums differently from the plain build's
        "-march=native",
        "-ffp-contract=off",
        "-std=c++20",  # as torch builds its own extensions: its headers need C++20 from 2.14 on
        "-shared",
        "-fPIC",
        "-fopenmp",  # at::parallel_for is inline: without it, one thread runs it all
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DSPECACHE_TORCH_VERSION={torch.__version__}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
    )
    libraries = (f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}")
    return cpu_build.build(source, flags, "g++", libraries, also=also, include=include)


def build() -> Path:
    """cpu_ops.cpp and step_cpu.cpp, built."""
    return build_extension(SOURCE, also=(STEP_SOURCE,))


def load_extension(build: Callable[[], Path], unavailable: str) -> bool:
    """Load the C++ library `build` makes into torch; False where it cannot be built, with one
    warning that says `unavailable`, or with SPECACHE_NO_CPU_OPS=1."""
    if os.environ.get("SPECACHE_NO_CPU_OPS") == "1":
        return False
    try:
        torch.ops.load_library(str(build()))
        return True
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        warnings.warn(f"{unavailable}, Python serves ({error})")
        return False


@lru_cache(maxsize=None)
def loaded() -> bool:
    """Whether this dispatch is built and loaded (once per process)."""
    return load_extension(build, "specache: the C++ dispatch of the CPU kernels is unavailable")


_PLAIN = torch.library.Library("specache_plain", "FRAGMENT")


def hand_over(op: str, lib: ctypes.CDLL, fallback: Optional[Callable] = None) -> bool:
    """Register the C++ implementation of `op` (merge_segments, lowbit_partial_attention, its
    _int8 and _sparse twins, or top_positions) around the C kernel of that name in `lib` (a
    loaded build); False where it cannot be built (the Python implementation serves).
    `fallback`: the op's plain-PyTorch definition, which the C++ implementation calls, as the op
    specache_plain::`op`, for shapes the C kernel does not take."""
    if not loaded():
        return False
    if fallback is not None:
        _define_plain(op, fallback)
    torch.ops.specache.set_cpu_kernel(op, address(lib, op), lib.problem_bytes())
    return True


def address(lib: ctypes.CDLL, function: str) -> int:
    """Where `lib`'s C function `function` is."""
    return ctypes.cast(getattr(lib, function), ctypes.c_void_p).value


def fuse_step(reference: Callable) -> bool:
    """Register the C++ implementation of `specache::step_attention`, which chains the C kernels
    of the low-bit pass, the merge and the ranking KV head by KV head, once those are handed over;
    False where it cannot (the reference, op by op, serves). `reference`: the op's plain-PyTorch
    definition, which it calls for shapes the kernels do not take."""
    if not loaded():
        return False
    _define_plain("step_attention", reference)
    return torch.ops.specache.enable_step_attention()


def _define_plain(op: str, definition: Callable) -> None:
    """specache_plain::`op`: specache::`op`'s schema, implemented by its plain definition."""
    if not hasattr(torch.ops.specache_plain, op):
        schema = str(getattr(torch.ops.specache, op).default._schema).split("::", 1)[1]
        _PLAIN.define(schema)
        _PLAIN.impl(op, definition, "CompositeExplicitAutograd")
