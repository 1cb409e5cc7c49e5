"""SpeCache's integer low-bit pass on CPUs: a C kernel for the op
`specache::lowbit_partial_attention_int8` that specache/ops.py defines (its plain-PyTorch
definition, `lowbit_partial_attention_int8_reference`, is the spec: both products on int8 operands,
rounded against each row's largest magnitude per key group and per tile of 64 positions).

The C kernel (lowbit_int_cpu.c) takes the float pass's inputs and layout
(lowbit_cpu.py's `_check` states them) and shares its softmax, tasks and threads
(lowbit_driver.h). With AVX512-VNNI, VBMI and BITALG, codes are widened to bytes and
multiplied by VPDPBUSD, 64 products an instruction; with AVX2, by VPMADDUBSW and VPMADDWD; other
builds run plain C loops with the same arithmetic (`path_of` names a build's path). The build
takes the best path the machine has (gcc -march=native). Given the same float inputs, its int8
operands are the twin's own and its integer sums exact; the outputs differ from the twin's by
float summation order and exp's last bits (simd.h), except that such a difference can move
a value weight across a rounding boundary: one step of its tile, 1/127 of the tile's largest
scaled weight.

`register()` compiles the kernel at first use (cpu_build.py) and registers it for CPU
tensors, dispatched in C++ (cpu_ops.cpp) where that builds, else through ctypes; False
(one warning) where it cannot build, and the twin serves. SPECACHE_NO_CPU_KERNEL=1 forces that.
"""

import ctypes
from functools import lru_cache
from pathlib import Path

from torch import Tensor

from specache.kernels import cpu_build, lowbit_cpu
from specache.lowbit import LowBitKV
from specache.ops import lowbit_partial_attention_int8_reference

SOURCE = Path(__file__).with_name("lowbit_int_cpu.c")
FUNCTION = "lowbit_partial_attention_int8"


def build(flags: tuple[str, ...] = cpu_build.FLAGS) -> Path:
    """Compile lowbit_int_cpu.c with `flags` into the cache (once); the library's path."""
    return cpu_build.build(SOURCE, flags)


PATHS = ("plain C", "AVX2", "AVX512-VNNI")


def load(path: Path, function: str = FUNCTION) -> ctypes.CDLL:
    """A built kernel on int_scores.h (this one, or the sparse pass's `function`), loaded."""
    lib = cpu_build.load(path, function, lowbit_cpu._Problem)
    lib.lowbit_int_path.restype = ctypes.c_int
    return lib


def path_of(lib: ctypes.CDLL) -> str:
    """The vector path a loaded build runs where the shape allows it (one of PATHS)."""
    return PATHS[lib.lowbit_int_path()]


def run_kernel(
    lib: ctypes.CDLL,
    rows: Tensor,
    kv: LowBitKV,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> lowbit_cpu.Outputs:
    """Call the integer C kernel of `lib` (a `load`ed build) on CPU tensors."""
    return lowbit_cpu.run_kernel(
        lib, rows, kv, visible_len, excluded_pos, excluded_valid, function=FUNCTION
    )


@lru_cache(maxsize=None)
def register() -> bool:
    """Build the C kernel (once) and make it serve `specache::lowbit_partial_attention_int8` for
    CPU tensors; False where it cannot (the twin serves)."""
    return lowbit_cpu.register_build(
        SOURCE,
        FUNCTION,
        lowbit_partial_attention_int8_reference,
        "the CPU integer kernel is unavailable, its twin serves",
    )
