"""Faster kernels for SpeCache's ops, each held to the op's plain-PyTorch definition
(specache/ops.py, specache/step.py) by the tests: C kernels for CPUs (built with the machine's gcc
and g++ at first use, cached under ~/.cache/specache) and Triton kernels for GPUs.

    import specache.kernels
    print(specache.kernels.register())   # once per process, before anything compiles a step

`register()` makes them serve the ops where they build and says which path serves each op; where a
kernel cannot build (no compiler, say; a CPU without AVX-512 runs the kernels' plain C loops) the
plain definition serves, and one warning names what did not build and why. The tokens are the same
either way (the kernels equal the definitions to float32 rounding). SPECACHE_NO_CPU_KERNEL=1 keeps
every CPU op on its definition; SPECACHE_NO_CPU_OPS=1 keeps the C kernels behind Python's ctypes
calls (no C++ dispatch).
"""

import warnings
from functools import lru_cache

from specache.kernels import (
    cpu_ops,
    lowbit_cpu,
    lowbit_int_cpu,
    lowbit_sparse_cpu,
    lowbit_sparse_triton,
    lowbit_triton,
    merge_cpu,
    rank_cpu,
)
from specache.step import step_attention_reference

PLAIN = "plain PyTorch"


def register() -> dict[str, str]:
    """Register every kernel that builds here (once per process); per op, what serves it."""
    return dict(_register())


@lru_cache(maxsize=None)
def _register() -> dict[str, str]:
    with warnings.catch_warnings(record=True) as failures:  # each kernel's, gathered into one
        warnings.simplefilter("always")
        cpu = {
            "lowbit_partial_attention": lowbit_cpu.register(),
            "lowbit_partial_attention_int8": lowbit_int_cpu.register(),
            "lowbit_partial_attention_sparse": lowbit_sparse_cpu.register(),
            "top_positions": rank_cpu.register(),
            "merge_segments": merge_cpu.register(),
        }
        # after the kernels it chains are handed over
        fused = cpu_ops.fuse_step(step_attention_reference)
    ours = [w for w in failures if str(w.message).startswith("specache: ")]
    for other in failures:  # anything else said while building passes through as it was
        if other not in ours:
            warnings.warn_explicit(other.message, other.category, other.filename, other.lineno)
    if ours:
        reasons = "; ".join(str(w.message).removeprefix("specache: ") for w in ours)
        warnings.warn(f"specache.kernels: {reasons}. The tokens are the same, only slower.")
    dispatch = "C++" if cpu_ops.loaded() else "ctypes"
    paths = {f"{op} (CPU)": f"C, {dispatch}" if built else PLAIN for op, built in cpu.items()}
    paths["step_attention (CPU)"] = "C++, one call per layer" if fused else f"{PLAIN}, op by op"
    paths["lowbit_partial_attention (CUDA)"] = "Triton" if lowbit_triton.register() else PLAIN
    sparse = lowbit_sparse_triton.register()
    paths["lowbit_partial_attention_sparse (CUDA)"] = "Triton" if sparse else PLAIN
    return paths
