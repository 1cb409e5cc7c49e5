"""Decode speed of a model shape at long context, with random weights, beside llama.cpp on the same
shape: the Llama-3-8B shape at 16k-64k by default.

    python scripts/bench/bench_shape.py                                 # int4, 16k 32k 64k
    python scripts/bench/bench_shape.py --weights int8 --lengths 65536
    python scripts/bench/bench_shape.py --lengths 4096 --steps 3 --out /tmp/shape  # a quick look

Speed only: the weights are random and the tokens mean nothing.

Ours: a model of the shape (config.py) with random int4 weights (group 128: 4.5 bits a weight, as
llama.cpp's Q4_0) or int8 ones, bf16 activations, decode compiled per block as generate.py
--compile does (`--eager`: not). Each cache is filled with synthetic K and V (random normal,
scripts/bench/bench_disk.py's `fill`) instead of a prefill, which on this shape would take hours on
a CPU. Methods: the full cache (FlexAttention when compiled) and SpeCache at 1 bit with our
selection and the paper's, its slow tier in RAM, or on disk where the 16-bit cache does not fit in
RAM beside the weights (the full cache is then left out; bench_disk.py measures that tier cold and
warm; here the page cache holds what it holds). Random keys spread attention evenly, so SpeCache's
positions change more from step to step than a real model's: a pessimistic case for its reuse.

llama.cpp (llama-cpp-python, `pip install -r requirements-bench.txt`): a GGUF of the same shape with
random Q4_0 (int4) or Q8_0 (int8) weights, written with the gguf package's writer; its KV cache
filled without a prefill (64 tokens prefilled, their cells saved, tiled to the context at
positions 0..N-1 and loaded back: bench_peers.write_tiled_state); an f16 KV cache (no flash
attention) and a 4-bit one (q4_0, with flash attention, as quantized V needs). Each runs in a child
process, before our model is built, so that each has the memory to itself; the same thread
count.

The fast-tier KV is what sits in fast memory: all of the full cache's and llama.cpp's, SpeCache's
low-bit copy, window and slots. Per row: warm-up steps (which compile), then `--steps` steps, the
median. Bytes per step are what the step must read: the weights, plus the full cache's K and V up
to the position, SpeCache's low-bit copy, window and fetched pairs, or llama.cpp's GGUF file and KV
cache. The machine's read bandwidth (a plain sum of a large tensor) is measured around each row.
Ratios are tok/s over our full cache's and over llama.cpp's f16 KV at the same context, in the same
run.

Writes {out}/bench_shape.md (the table under the command) and {out}/bench_shape.json.
"""

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from queue import Empty
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from caches.by_name import make_cache  # noqa: E402
from config import ModelArgs, transformer_configs  # noqa: E402
from generation import GenerateOptions, compile_decode, generate, weight_bytes  # noqa: E402
from scripts.bench.bench import full_cache_bytes, random_model, release_caches  # noqa: E402
from scripts.bench.bench_disk import fill  # noqa: E402
from scripts.bench.bench_peers import (  # noqa: E402
    bench_llama_cpp_at_length,
    llama_cpp_available,
    measure_read_bandwidth,
    write_random_gguf,
)
from scripts.eval.harness import RESULTS_DIR, write_report  # noqa: E402

METHODS = ["full", "specache-1bit", "specache-1bit:paper"]
WARMUP = 3  # steps before timing: the first ones compile
GGUF_WEIGHTS = {"int4": "q4_0", "int8": "q8_0"}
FULL = "full"
# RAM left beside a 16-bit cache for the rest: the low-bit copy (1.6 GB at 128k), activations, and
# the transient buffers of filling a layer (2.5 GB at 128k)
HEADROOM = 4e9
PEER = "llama.cpp, f16 KV"


def available_memory() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024


def fits_in_ram(model, length: int) -> tuple[bool, str]:
    """Whether a 16-bit cache of `length` positions fits in the RAM available beside the model (the
    full cache, or SpeCache's slow tier in RAM), with HEADROOM to spare; and why."""
    c = model.config
    cache = 2 * c.n_layer * c.n_local_heads * c.head_dim * length * 2
    available = available_memory()
    fits = cache + HEADROOM <= available
    why = (
        f"the 16-bit cache ({cache / 1e9:.1f} GB) {'fits' if fits else 'does not fit'} in the "
        f"{available / 1e9:.1f} GB of RAM available beside the weights with "
        f"{HEADROOM / 1e9:.0f} GB to spare"
    )
    return fits, why


def run_ours(
    model, method: str, length: int, steps: int, compiled: bool, disk_dir: Optional[str]
) -> dict:
    """One generation from `length` synthetic positions: WARMUP steps, then `steps` timed.
    `disk_dir`: SpeCache's slow tier on disk, there (else in RAM)."""
    release_caches(model)
    capacity = length + WARMUP + steps + 2
    tier = dict(slow_tier="disk", slow_tier_dir=disk_dir) if disk_dir else {}
    cache = make_cache(method, model, 1, capacity, use_flex=compiled, **tier)
    cache.begin(torch.zeros(1, length, dtype=torch.long), torch.tensor([length]))
    fill(cache, model, length, seed=length)
    times = []
    bandwidth_before = measure_read_bandwidth()
    result = generate(
        model,
        cache,
        [[0] * length],
        WARMUP + steps + 1,
        callback=lambda tokens: times.append(time.perf_counter()),
        options=GenerateOptions(first_token=torch.zeros(1, 1, dtype=torch.long)),
    )
    bandwidth = (bandwidth_before + measure_read_bandwidth()) / 2
    # times[0] is the first token, given; times[i] ends step i
    seconds = statistics.median(b - a for a, b in zip(times[WARMUP:], times[WARMUP + 1 :]))
    kv = full_cache_bytes(model) if method == FULL else result.stats["fast_tier_bytes"]
    release_caches(model)
    return dict(
        length=length,
        method=method + (", slow tier on disk" if disk_dir else ""),
        ms_per_step=1e3 * seconds,
        tok_s=1 / seconds,
        gbps=result.decode_bytes / result.decode_steps / seconds / 1e9,
        bandwidth=bandwidth,
        fast=kv,
    )


def llama_cpp_child(
    gguf: Path, length: int, steps: int, kv_type: str, scratch: str, threads: int, queue
):
    """A child process's row (its memory is the OS's again once it exits)."""
    torch.set_num_threads(threads)
    try:
        queue.put(bench_llama_cpp_at_length(gguf, length, steps, kv_type, Path(scratch)))
    except Exception as error:  # reported as the row's note by the parent
        queue.put(f"{type(error).__name__}: {error}")


def run_llama_cpp(gguf: Path, length: int, steps: int, kv_type: str, scratch: str) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    threads = torch.get_num_threads()
    child = context.Process(
        target=llama_cpp_child, args=(gguf, length, steps, kv_type, scratch, threads, queue)
    )
    child.start()
    child.join()  # a child flushes what it put before it exits
    try:
        row = queue.get(timeout=10)
    except Empty:
        raise RuntimeError(
            f"llama.cpp at {length} ({kv_type} KV) died: exit code {child.exitcode}"
        ) from None
    if isinstance(row, str):
        raise RuntimeError(f"llama.cpp at {length} ({kv_type} KV): {row}")
    kv = "f16 KV" if kv_type == "f16" else f"{kv_type} KV, flash attention"
    return dict(row, length=length, method=f"llama.cpp, {kv}")


def table(rows: list[dict], title: str) -> str:
    lines = [
        title,
        "",
        "| context | method | ms/step | tok/s | GB/s | % of bw | fast-tier KV MB | vs our full "
        "cache | vs llama.cpp f16 KV |",
        "|---" * 9 + "|",
    ]
    full = {r["length"]: r["tok_s"] for r in rows if r["method"] == FULL}
    peer = {r["length"]: r["tok_s"] for r in rows if r["method"] == PEER}
    # ours, then llama.cpp, per context; methods keep their order
    for r in sorted(rows, key=lambda r: (r["length"], r["method"].startswith("llama.cpp"))):

        def ratio(base):
            return "-" if not base else f"{r['tok_s'] / base:.2f}x"

        lines.append(
            f"| {r['length']} | {r['method']} | {r['ms_per_step']:.0f} | {r['tok_s']:.2f} | "
            f"{r['gbps']:.1f} | {100 * r['gbps'] / r['bandwidth']:.0f}% | {r['fast'] / 1e6:.0f} | "
            f"{ratio(full.get(r['length']))} | {ratio(peer.get(r['length']))} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="Meta-Llama-3-8B", choices=list(transformer_configs), help="the shape"
    )
    parser.add_argument(
        "--weights",
        default="int4",
        choices=list(GGUF_WEIGHTS),
        help="ours int4 (group 128) against llama.cpp's Q4_0, or int8 against Q8_0",
    )
    parser.add_argument(
        "--groupsize", type=int, default=128, help="int4's group (128: 4.5 bits a weight)"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--methods", nargs="+", default=METHODS, help="our caches (caches/)")
    parser.add_argument("--steps", type=int, default=4, help="decode steps timed per row")
    parser.add_argument(
        "--llama_cpp_kv",
        nargs="*",
        default=["f16", "q4_0"],
        choices=["f16", "q4_0", "q8_0"],
        help="llama.cpp's KV cache types (none: skip llama.cpp)",
    )
    parser.add_argument("--eager", action="store_true", help="decode without torch.compile")
    parser.add_argument(
        "--scratch_dir",
        default=None,
        help="where the random GGUF and llama.cpp's state file go (GBs; default: temp)",
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR / "shape", help="where the report files go"
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    kv_types = args.llama_cpp_kv if llama_cpp_available() else []
    notes = [] if kv_types or not args.llama_cpp_kv else ["llama-cpp-python is not installed."]

    rows = []

    def report(row: dict) -> None:
        rows.append(row)
        print(
            f"  {row['length']} {row['method']}: {row['ms_per_step']:.0f} ms/step, "
            f"{row['gbps']:.1f} of {row['bandwidth']:.1f} GB/s",
            file=sys.stderr,
        )

    with tempfile.TemporaryDirectory(dir=args.scratch_dir) as scratch:
        # llama.cpp first, before our model takes its memory
        gguf = Path(scratch) / "random.gguf"
        if kv_types:
            print(f"writing a random {GGUF_WEIGHTS[args.weights]} GGUF", file=sys.stderr)
            write_random_gguf(ModelArgs.from_name(args.model), gguf, GGUF_WEIGHTS[args.weights])
        for length in args.lengths:
            for kv_type in kv_types:
                try:
                    report(run_llama_cpp(gguf, length, args.steps, kv_type, scratch))
                except RuntimeError as error:  # such as its KV cache not fitting in memory
                    notes.append(f"- {error}")
                    print(notes[-1], file=sys.stderr)
        if gguf.exists():
            gguf.unlink()

        model = random_model(
            args.model, torch.device("cpu"), torch.bfloat16, args.weights, args.groupsize
        )
        # whether the 16-bit cache fits in RAM beside the weights, per length
        fits = {length: fits_in_ram(model, length) for length in args.lengths}
        in_ram = {length: fits[length][0] for length in args.lengths}
        if not args.eager:  # the disk tier hands its reads over at graph breaks between blocks
            compile_decode(model, fullgraph=all(in_ram.values()))
        print(
            f"{args.model} shape, random {args.weights} weights: "
            f"{weight_bytes(model) / 1e9:.2f} GB; read bandwidth "
            f"{measure_read_bandwidth():.1f} GB/s",
            file=sys.stderr,
        )
        for length in args.lengths:
            if not in_ram[length]:
                notes.append(f"- {length} tokens: {fits[length][1]}: SpeCache's slow tier on disk.")
            for method in args.methods:
                if method != FULL or in_ram[length]:
                    disk_dir = None if in_ram[length] else scratch
                    report(run_ours(model, method, length, args.steps, not args.eager, disk_dir))
    title = (
        f"{args.model} shape, random {args.weights} weights (llama.cpp: random "
        f"{GGUF_WEIGHTS[args.weights].upper()}), bf16 activations, synthetic K and V (speed only), "
        f"batch 1, k = 64, {'eager' if args.eager else 'compiled per block'}, "
        f"{torch.get_num_threads()} CPU threads; median of {args.steps} steps after {WARMUP}."
    )
    markdown = "\n\n".join([table(rows, title), *notes])
    print(markdown)
    write_report(args.out, "bench_shape", markdown, dict(rows=rows, notes=notes))


if __name__ == "__main__":
    main()
