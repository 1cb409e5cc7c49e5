"""SpeCache with its slow tier on disk, at long context, for speed only.

    python scripts/bench/bench_disk.py                    # Llama-3-8B shape, int8, 64k and 128k, \
        cold and warm
    python scripts/bench/bench_disk.py --lengths 8192 --steps 4 --out /tmp/disk  # a quick look
    python scripts/bench/bench_disk.py --layout           # the file layout and read method, \
        measured

A model of a named shape (config.py) with random int8 weights, and each cache filled with synthetic
K and V (random normal, bf16) instead of a prefill: the figures are for speed only, the tokens mean
nothing. Random keys spread attention evenly, so the positions chosen change more from step to
step than a real model's do, and `reuse` saves less: a pessimistic case for the disk.

Per context and method, one generation: two steps of warm-up, then `--steps` steps timed warm (the
store's pages as the writes left them in the page cache; how much of it stayed there is the page
cache column), then `--steps` steps timed cold (before each, every file's dirty pages are written
out and its pages dropped with posix_fadvise(DONTNEED), outside the timing: each step's reads come
from the disk). A step's time is the median. Resident memory is the process's (VmRSS) after the
timed steps. Bytes read are whole positions (every KV head's K and V of a position that any head
needs) from the disk tier's own count, per step. The machine's read bandwidth (a plain sum of a
large tensor) is measured around each row; "% of bw" is the bytes a step reads from RAM (weights
and the fast tier) over the step's time, against it.

Methods: `specache-1bit` (ours: half of k prefetched speculatively, half chosen by the real token
within the step from a shortlist 8x as long, read then), `specache-1bit:paper` (all of k prefetched
speculatively), `specache-nospec-1bit` (all of k read within the step: the paper's non-speculative
baseline), each speculative one with its fetch overlapped (the default) and waited (each layer's
prefetch waited for as soon as it is queued). `--methods` runs others instead, each overlapped (ours
without the shortlist: `specache-1bit:default,shortlist=0`). The full cache in RAM runs where it
fits; where it does not, the allocation is tried in a child process limited to this machine's
memory, and its error reported.

`--layout` times one layer's fetch (64 positions per KV head, 8 KV heads, a 128k-position file of a
Llama-3-8B layer) from two layouts, position-major (B, T, Hkv, 2, D: caches/disk_tier.py's) and
per-head planes (Hkv, T, 2, D), read with os.preadv in runs of adjacent rows or gathered through a
memory map (caches/disk_tier.py's), from the same I/O threads, with heads that pick different
positions or the same ones, cold and warm.

Writes {out}/bench_disk.md (the tables under the command) and {out}/bench_disk.json.
"""

import argparse
import ctypes
import mmap
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from caches.full import FullCache  # noqa: E402
from caches.by_name import make_cache  # noqa: E402
from config import transformer_configs  # noqa: E402
from caches.disk_tier import IO_THREADS  # noqa: E402
from generation import GenerateOptions, generate, weight_bytes  # noqa: E402

# noqa: E402
from generate import exit_on_signal  # noqa: E402

# noqa: E402
from scripts.bench.bench import full_cache_bytes, random_model, release_caches  # noqa: E402
from scripts.bench.bench_peers import measure_read_bandwidth  # noqa: E402
from scripts.eval.harness import RESULTS_DIR, write_report  # noqa: E402
from scripts.eval.long_run import resident_bytes  # noqa: E402

METHODS = [
    ("specache-1bit", True),
    ("specache-1bit", False),
    ("specache-1bit:paper", True),
    ("specache-1bit:paper", False),
    ("specache-nospec-1bit", True),
]
WARMUP = 2


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def page_cache_bytes(fd: int, size: int) -> int:
    """How much of a file sits in the page cache (mincore over a mapping that touches no page)."""
    if size == 0:
        return 0
    address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    try:
        if _libc.mincore(address, size, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    finally:
        _libc.munmap(address, size)
    return (
        int(torch.frombuffer(bytearray(vector), dtype=torch.uint8).bitwise_and(1).sum())
        * mmap.PAGESIZE
    )


def fill(cache, model, length: int, seed: int) -> None:
    """Synthetic K, V for every layer (instead of a prefill), after the cache's begin."""
    c, g = model.config, torch.Generator().manual_seed(seed)
    for layer in tqdm(model.layers, desc=f"filling {length} positions", unit="layer", leave=False):
        k, v = (
            torch.randn(1, c.n_local_heads, length, c.head_dim, generator=g).to(torch.bfloat16)
            for _ in range(2)
        )
        layer.attention.kv_cache.ingest_prompt(k, v)


def run_one(
    model, method: str, overlap: bool, length: int, steps: int, slow_tier_dir
) -> list[dict]:
    """One generation: warm-up, `steps` warm, `steps` cold (the disk tier); rows for warm and
    cold."""
    release_caches(model)
    capacity = length + WARMUP + 2 * steps + 2
    full = method == "full"
    if full:
        cache = FullCache(model, 1, capacity)
    else:
        cache = make_cache(
            method,
            model,
            1,
            capacity,
            overlap_fetch=overlap,
            slow_tier="disk",
            slow_tier_dir=slow_tier_dir,
        )
    cache.begin(torch.zeros(1, length, dtype=torch.long), torch.tensor([length]))
    fill(cache, model, length, seed=length)
    tiers = [] if full else [layer.tier for layer in cache.layers]
    phases = ["warm"] if full else ["warm", "cold"]
    starts, ends, marks = [], [], {}

    def read_so_far() -> int:
        return sum(tier.bytes_read for tier in tiers)

    def callback(tokens) -> None:
        starts.append(time.perf_counter())
        done = len(starts) - 1  # decode steps so far
        if done in (WARMUP, WARMUP + steps, WARMUP + 2 * steps):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            marks[done] = dict(
                read=read_so_far(),
                rss=resident_bytes(),
                user=usage.ru_utime,
                system=usage.ru_stime,
                cached=sum(page_cache_bytes(t.fd, t.nbytes()) for t in tiers if t.fd is not None),
            )
        if not full and done >= WARMUP + steps:
            cache.folder.drop_page_cache()
        ends.append(time.perf_counter())

    bandwidth_before = measure_read_bandwidth()
    options = GenerateOptions(first_token=torch.zeros(1, 1, dtype=torch.long))
    result = generate(
        model,
        cache,
        [[0] * length],
        WARMUP + len(phases) * steps + 1,
        callback=callback,
        options=options,
    )
    bandwidth = (bandwidth_before + measure_read_bandwidth()) / 2
    fast = full_cache_bytes(model) if full else result.stats["fast_tier_bytes"]
    ram_bytes = weight_bytes(model) + cache.step_bytes([length + WARMUP + steps])
    rows = []
    for i, phase in enumerate(phases):
        first = WARMUP + i * steps
        seconds = statistics.median(starts[j + 1] - ends[j] for j in range(first, first + steps))
        read = 0 if full else (marks[first + steps]["read"] - marks[first]["read"]) / steps
        cpu = {
            kind: (marks[first + steps][kind] - marks[first][kind]) / steps
            for kind in ("user", "system")
        }
        rows.append(
            dict(
                length=length,
                method=method + ("" if full else ("" if overlap else ", fetch waited")),
                overlap=overlap,
                cache=phase if not full else "RAM",
                ms_per_step=1e3 * seconds,
                rss=marks[first + steps]["rss"],
                fast=fast,
                slow=0 if full else cache.folder.nbytes(),
                disk_read=read,
                page_cache=marks[first]["cached"] if phase == "warm" else 0,
                gbps=ram_bytes / seconds / 1e9,
                bandwidth=bandwidth,
                user_cpu=cpu["user"],
                system_cpu=cpu["system"],
            )
        )
    release_caches(model)
    return rows


def try_full_cache(model, length: int) -> str:
    """Whether the full cache (in the model's dtype) fits beside the weights: allocated in a child
    process limited to this machine's memory (Linux overcommits, so an allocation in this one would
    succeed and filling it would be killed)."""
    c = model.config
    cache_bytes = (
        2
        * c.n_layer
        * c.n_local_heads
        * c.head_dim
        * length
        * model.tok_embeddings.weight.element_size()
    )
    code = (
        "import resource, torch; limit = %d; resource.setrlimit(resource.RLIMIT_AS, (limit, "
        "limit)); "
        "weights = torch.empty(%d, dtype=torch.uint8); cache = torch.empty(%d, dtype=torch.uint8)"
        % (mem_total(), weight_bytes(model), cache_bytes)
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if child.returncode == 0:
        return f"the full cache ({cache_bytes / 1e9:.1f} GB) fits beside the weights"
    error = next(
        (line for line in reversed(child.stderr.splitlines()) if "Error" in line),
        child.stderr[-200:],
    )
    return (
        f"the full cache at {length} tokens ({cache_bytes / 1e9:.1f} GB of K and V, beside "
        f"{weight_bytes(model) / 1e9:.1f} GB of weights, in {mem_total() / 2**30:.1f} GiB of RAM) "
        "cannot be "
        f"allocated: {error.strip()}"
    )


def table(rows: list[dict], title: str) -> str:
    lines = [
        title,
        "",
        "| context | method | pages | ms/step | tok/s | resident GB | fast-tier MB | slow tier GB "
        "(disk) | read from disk MB/step | store in page cache GB | CPU s/step: user, system | RAM "
        "GB/s | % of bw |",
        "|---" * 13 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['method']} | {r['cache']} | {r['ms_per_step']:.0f} | "
            f"{1e3 / r['ms_per_step']:.2f} | {r['rss'] / 1e9:.2f} | {r['fast'] / 1e6:.0f} | "
            f"{r['slow'] / 1e9:.1f} | {r['disk_read'] / 1e6:.1f} | {r['page_cache'] / 1e9:.1f} | "
            f"{r['user_cpu']:.2f}, {r['system_cpu']:.2f} | "
            f"{r['gbps']:.1f} | {100 * r['gbps'] / r['bandwidth']:.0f}% |"
        )
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    """Speculative over non-speculative, and overlapped over waited, per context and page-cache
    state."""
    find = {(r["length"], r["method"], r["cache"]): r["ms_per_step"] for r in rows}
    lines = [
        "| context | pages | ours over non-speculative | paper over non-speculative | ours: "
        "overlapped over "
        "waited | paper: overlapped over waited |",
        "|---|---|---|---|---|---|",
    ]
    for length, cache in dict.fromkeys(
        (r["length"], r["cache"]) for r in rows if r["cache"] != "RAM"
    ):

        def speedup(slow: str, fast: str) -> str:
            a, b = find.get((length, slow, cache)), find.get((length, fast, cache))
            return "-" if a is None or b is None else f"{a / b:.2f}x"

        lines.append(
            f"| {length} | {cache} | {speedup('specache-nospec-1bit', 'specache-1bit')} | "
            f"{speedup('specache-nospec-1bit', 'specache-1bit:paper')} | "
            f"{speedup('specache-1bit, fetch waited', 'specache-1bit')} | "
            f"{speedup('specache-1bit:paper, fetch waited', 'specache-1bit:paper')} |"
        )
    return "Speed-ups (ms/step of the first over the second, same run):\n\n" + "\n".join(lines)


def read_runs(fd: int, staging: memoryview, runs: list[tuple[int, int, int]]) -> None:
    """Fill staging[lo:hi] from the file at `offset`, for each run (offset, lo, hi) in bytes."""
    for offset, lo, hi in runs:
        while lo < hi:
            n = os.preadv(fd, [staging[lo:hi]], offset)
            lo, offset = lo + n, offset + n


def layout_bench(folder: str, repeats: int = 5) -> str:
    """One layer's fetch (8 KV heads x 64 positions of 128k) from each layout and read method."""
    heads, length, dim, k = 8, 131072, 128, 64
    pair = 2 * dim * 2  # K and V of one head, bf16
    data = torch.randint(0, 256, (length * heads * pair,), dtype=torch.uint8)
    files = {}
    for layout in ("position-major", "per-head planes"):
        path = os.path.join(folder, layout.replace(" ", "-"))
        (
            data
            if layout == "position-major"
            else data.view(length, heads, pair).transpose(0, 1).contiguous()
        ).numpy().tofile(path)
        files[layout] = os.open(path, os.O_RDONLY)
    pool = ThreadPoolExecutor(IO_THREADS)

    def units(layout: str, positions: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The file's rows to read and their size: whole positions, or each head's pair."""
        if layout == "position-major":
            return torch.unique(positions), heads * pair
        return torch.unique(positions + length * torch.arange(heads).unsqueeze(-1)), pair

    def merge(runs):
        merged = []
        for offset, size in runs:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            elif not merged or merged[-1][0] != offset:
                merged.append((offset, size))
        return merged

    def by_pread(fd: int, rows: torch.Tensor, size: int) -> int:
        runs = merge([(row * size, size) for row in rows.tolist()])
        staging = memoryview(bytearray(sum(size for _, size in runs)))
        spans, lo = [], 0
        for offset, size in runs:
            spans.append((offset, lo, lo + size))
            lo += size
        jobs = min(IO_THREADS, len(spans))
        for future in [pool.submit(read_runs, fd, staging, spans[j::jobs]) for j in range(jobs)]:
            future.result()
        return len(spans)

    def by_mmap(fd: int, rows: torch.Tensor, size: int) -> int:
        mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        mapping.madvise(mmap.MADV_RANDOM)
        view = torch.frombuffer(mapping, dtype=torch.uint8).view(-1, size)
        for future in [
            pool.submit(torch.index_select, view, 0, part) for part in rows.chunk(IO_THREADS)
        ]:
            future.result()
        del view
        mapping.close()
        return len(rows)

    columns = (
        "heads pick",
        "layout",
        "read with",
        "reads (runs or rows)",
        "KiB read",
        "cold µs",
        "warm µs",
    )
    lines = ["| " + " | ".join(columns) + " |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(0)
    for pattern in ("different positions", "the same positions"):
        for layout, fd in files.items():
            for name, method in (("preadv runs", by_pread), ("memory map", by_mmap)):
                cold, warm = [], []
                for _ in range(repeats):
                    one = torch.randperm(length, generator=g)[: k * heads].view(heads, k)
                    positions = one[:1].expand(heads, k) if pattern == "the same positions" else one
                    rows, size = units(layout, positions)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter()
                    reads = method(fd, rows, size)
                    cold.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    method(fd, rows, size)
                    warm.append(time.perf_counter() - t0)
                kib = len(rows) * size / 1024
                lines.append(
                    f"| {pattern} | {layout} | {name} | {reads} | {kib:.0f} | "
                    f"{1e6 * statistics.median(cold):.0f} | {1e6 * statistics.median(warm):.0f} |"
                )
    for fd in files.values():
        os.close(fd)
    return (
        "One layer's fetch: 8 KV heads x 64 of 131072 positions, Llama-3-8B layer (bf16 pairs), "
        f"{IO_THREADS} I/O threads, median of {repeats}; cold: the file's pages dropped first.\n\n"
        + "\n".join(lines)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default="Meta-Llama-3-8B",
        choices=list(transformer_configs),
        help="the shape (config.py), with random int8 weights",
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument(
        "--steps", type=int, default=6, help="decode steps timed warm, and again cold"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="activations and the embedding (weights are int8)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="SpeCache methods (scripts/bench/bench.py's names), each with its fetch overlapped "
        "(default: ours and the paper's, each overlapped and waited, and the non-speculative)",
    )
    parser.add_argument(
        "--no_full", action="store_true", help="skip the full cache even where it fits"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's compute threads (default: torch's, the cores); fewer leave cores to the I/O",
    )
    parser.add_argument(
        "--slow_tier_dir", default=None, help="where the disk tier's files go (default: temp)"
    )
    parser.add_argument(
        "--layout", action="store_true", help="time the file layouts and read methods instead"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR / "disk", help="where the report files go"
    )
    args = parser.parse_args()
    # a plain kill exits cleanly: the disk tier's files (GBs) go with it
    for name in (
        "SIGTERM",
        "SIGHUP",
    ):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), exit_on_signal)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.layout:
        with tempfile.TemporaryDirectory(dir=args.slow_tier_dir) as folder:
            markdown = layout_bench(folder)
        print(markdown)
        write_report(args.out, "layout", markdown, dict(table=markdown))
        return
    model = random_model(args.model, torch.device("cpu"), getattr(torch, args.dtype), "int8")
    print(
        f"{args.model} shape, random int8 weights: {weight_bytes(model) / 1e9:.2f} GB; resident "
        f"{resident_bytes() / 1e9:.2f} GB; read bandwidth {measure_read_bandwidth():.1f} GB/s",
        file=sys.stderr,
    )
    rows, notes = [], []
    for length in args.lengths:
        fits = try_full_cache(model, length)
        notes.append(f"- {length} tokens: {fits}.")
        print(notes[-1], file=sys.stderr)
        chosen = METHODS if args.methods is None else [(m, True) for m in args.methods]
        methods = chosen + (
            [("full", True)] if fits.endswith("beside the weights") and not args.no_full else []
        )
        for method, overlap in methods:
            for row in run_one(model, method, overlap, length, args.steps, args.slow_tier_dir):
                rows.append(row)
                print(
                    f"  {length} {row['method']} {row['cache']}: {row['ms_per_step']:.0f} ms/step, "
                    f"{row['disk_read'] / 1e6:.1f} MB/step from disk, resident "
                    f"{row['rss'] / 1e9:.2f} GB",
                    file=sys.stderr,
                )
    title = (
        f"SpeCache 1-bit, slow tier on disk: {args.model} shape, random int8 weights, {args.dtype} "
        "activations, "
        f"synthetic K and V (speed only), batch 1, k = 64, eager, {torch.get_num_threads()} CPU "
        "threads, "
        f"{IO_THREADS} I/O threads; {args.steps} steps timed warm, then cold."
    )
    speedups = [ratios(rows)] if args.methods is None else []  # its pairs are the default's
    markdown = "\n\n".join(
        [table(rows, title), *speedups, "The full cache:\n\n" + "\n".join(notes)]
    )
    print(markdown)
    write_report(args.out, "bench_disk", markdown, dict(rows=rows, full_cache=notes))


if __name__ == "__main__":
    main()
