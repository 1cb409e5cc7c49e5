"""Building C kernels (those beside this file, and the host's) at first use.

Each is compiled with gcc -O3 -march=native -fopenmp into $XDG_CACHE_HOME/specache (or
~/.cache/specache), named by a hash of the source and the headers it may include (beside it, and in
the folders it is given), the flags, `gcc --version` and the macros -march=native defines here (so
that a shared home directory never loads another CPU's build), and published by an atomic rename,
so that concurrent processes see no file or a whole one. The
kernels' OpenMP threads come from the libgomp that torch has loaded already (one thread pool).
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

# the element types of elements.h (FLOAT32, BFLOAT16, FLOAT16), as the dense kernels take them
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# what machines without AVX-512 build
PORTABLE_FLAGS = (
    "-O3",
    "-march=x86-64",
    "-fopenmp",
    "-shared",
    "-fPIC",
)


def build(
    source: Path,
    flags: tuple[str, ...] = FLAGS,
    compiler: str = "gcc",
    libraries: tuple[str, ...] = (),
    also: tuple[Path, ...] = (),
    include: tuple[Path, ...] = (),
) -> Path:
    """Compile `source` with `flags` (and the sources `also` beside it, into one library, linked
    with the `libraries` flags, the headers in the folders `include` on the path) into the cache
    (once) and return the library's path."""
    gcc = shutil.which(compiler)
    if gcc is None:
        raise RuntimeError(f"{compiler} not found")

    def run(*args):
        return subprocess.run([gcc, *args], capture_output=True, text=True, check=True).stdout

    # the macros -march=native turns on here
    target = run(*flags, "-dM", "-E", "-x", "c", os.devnull)
    flags = (*flags, *(f"-I{folder}" for folder in include))
    # what the sources may include
    folders = (source.parent, *include)
    headers = [h.read_text() for folder in folders for h in sorted(folder.glob("*.h"))]
    parts = [
        source.read_text(),
        *(s.read_text() for s in also),
        *headers,
        *flags,
        *libraries,
        run("--version"),
        target,
    ]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specache"
    path = cache / f"{source.stem}-{key}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=path.stem, suffix=".tmp")
        os.close(fd)
        try:
            subprocess.run(
                [gcc, *flags, str(source), *map(str, also), "-o", tmp, "-lm", *libraries],
                capture_output=True,
                text=True,
                check=True,
            )
            os.replace(tmp, path)  # atomic: another process sees no file or a whole one
        except subprocess.CalledProcessError as error:
            raise RuntimeError(f"{compiler} failed:\n{error.stderr}") from error
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


def load(path: Path, function: str, problem: type[ctypes.Structure]) -> ctypes.CDLL:
    """Load a C kernel's library; its `function` takes a pointer to its Problem struct and returns 0
    on success. `problem`, the struct's ctypes copy, must have the C struct's size (the library's
    `problem_bytes()`): a copy that lost or gained a field would have the kernel read past it."""
    lib = ctypes.CDLL(str(path))
    lib.problem_bytes.restype = ctypes.c_int64
    if lib.problem_bytes() != ctypes.sizeof(problem):
        raise RuntimeError(
            f"{path.name}: its Problem struct is {lib.problem_bytes()} bytes, the ctypes copy "
            f"{problem.__name__} {ctypes.sizeof(problem)}; they must agree field for field"
        )
    kernel = getattr(lib, function)
    kernel.argtypes = [ctypes.POINTER(problem)]
    kernel.restype = ctypes.c_int
    return lib


def build_and_load(
    source: Path,
    function: str,
    problem: type[ctypes.Structure],
    unavailable: str,
    include: tuple[Path, ...] = (),
) -> Optional[ctypes.CDLL]:
    """The native build of `source` (`include`: as `build` takes it), loaded; None where it cannot
    be built, with one warning that says `unavailable` (what stands in for the kernel)."""
    try:
        return load(build(source, include=include), function, problem)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        warnings.warn(f"specache: {unavailable} ({error})")
        return None


def enabled() -> bool:
    """Whether the C kernels may run: SPECACHE_NO_CPU_KERNEL=1 keeps every kernel's reference
    path."""
    return os.environ.get("SPECACHE_NO_CPU_KERNEL") != "1"
