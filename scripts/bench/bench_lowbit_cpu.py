"""SpeCache's low-bit pass on CPU, as a decode step runs it: the float, the integer and the sparse
C kernels against the DRAM floor of the bytes they read.

    python scripts/bench/bench_lowbit_cpu.py [--lengths 4096 16384 32768] [--layers 30] \
        [--repeats 5] [--tau 6] [--peaked [FACTOR]]

Per length, --layers separate low-bit copies (one per layer, as a step reads them: together far
larger than the caches, so the bytes come from DRAM) go through each kernel in turn, and a row
reports per layer (batch 1, every position visible, 64 excluded per KV head):
- float ms: `specache::lowbit_partial_attention` on specache/kernels/lowbit_cpu.c (nibble lookups);
- int8 ms: `specache::lowbit_partial_attention_int8` on specache/kernels/lowbit_int_cpu.c
  (VPDPBUSD where the CPU has AVX512-VNNI, VPMADDUBSW with AVX2, else plain C);
- sparse ms: `specache::lowbit_partial_attention_sparse` on specache/kernels/lowbit_sparse_cpu.c
  (the integer scores, then the values of only the positions some row weighs at least
  min_weight = e^-tau, and each key group's mean value, from `value_means`, for the rest), and
  kept %: the share of positions it mixed value by value (in the row's first layer);
- floor ms: the bytes the pass must read (codes, scales and zeros of keys and values) at the read
  bandwidth measured before and after the row (their mean, in the table), and each kernel's time
  over it; the weights it writes (M x T float32, read again by the ranking) are not counted.
Random K and V make flat attention, which keeps most positions at tau 6 or 8; a trained model's is
peaked at long context (5-25% kept is common), which --peaked FACTOR mimics by scaling the rows
by FACTOR (2 if not given): the scores' spread is FACTOR times wider.
Shapes: SmolLM2-135M (3 KV heads, 6 rows = 3 query heads x 2 new rows, head_dim 64) and
Llama-3-8B (8 KV heads, 8 rows = 4 x 2, head_dim 128); group 64, fp16 scales, 1 and 2 bits. Each
kernel is checked against its plain-PyTorch definition at the row's length first (the sparse
kernel's weights, row_max, row_sum and out); times are the fastest of --repeats passes over the
layers, on --threads threads (torch's count by default). The floor counts every byte of the copy,
though the sparse kernel reads the values of the kept positions alone.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.bench_peers import measure_read_bandwidth  # noqa: E402
from specache.config import Method  # noqa: E402
from specache.kernels import lowbit_cpu, lowbit_int_cpu, lowbit_sparse_cpu  # noqa: E402
from specache.ops import lowbit_partial_attention_int8_reference  # noqa: E402
from specache.lowbit import LowBitKV, quantize_keys, quantize_values  # noqa: E402
from specache.ops import lowbit_partial_attention_reference  # noqa: E402
from specache.ops import lowbit_partial_attention_sparse_reference  # noqa: E402
from specache.sparse import value_means  # noqa: E402

SHAPES = {"SmolLM2": (3, 6, 64), "Llama-3-8B": (8, 8, 128)}  # KV heads, rows per KV head, head_dim
GROUP, EXCLUDED = 64, 64


def make_inputs(t: int, n_kv: int, m: int, d: int, bits: int, seed: int = 0, peaked: float = 1.0):
    """One layer's op arguments: rows (scaled by `peaked`), the low-bit copy of random K, V, and
    the exclusions."""
    g = torch.Generator().manual_seed(t + seed)
    k = torch.randn(1, n_kv, t, d, generator=g) * torch.linspace(0.2, 4, d)
    v = torch.randn(1, n_kv, t, d, generator=g)
    kv = LowBitKV(
        *quantize_keys(k, bits, GROUP, torch.float16),
        *quantize_values(v, bits, GROUP, torch.float16),
        bits,
        GROUP,
    )
    rows = torch.randn(1, n_kv, m, d, generator=g) * d**-0.5 * peaked
    excluded = torch.stack(
        [torch.randperm(t, generator=g)[:EXCLUDED] for _ in range(n_kv)]
    ).unsqueeze(0)
    return (
        rows,
        *kv[:6],
        bits,
        GROUP,
        torch.tensor([t]),
        excluded,
        torch.ones_like(excluded, dtype=torch.bool),
    )


def sparse_inputs(inputs: tuple, min_weight: float) -> tuple:
    """The sparse op's arguments from the others': v_mean and min_weight added."""
    bits = inputs[7]
    v_mean = value_means(*inputs[4:7], bits, GROUP)
    return (*inputs[:7], v_mean, bits, GROUP, min_weight, *inputs[9:])


def time_layers(op, layers: list, repeats: int) -> float:
    """Seconds per layer: the fastest of `repeats` passes over every layer (on a shared machine the
    slower passes measure the neighbours too)."""
    for inputs in layers:
        op(*inputs)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for inputs in layers:
            op(*inputs)
        best = min(best, time.perf_counter() - t0)
    return best / len(layers)


def check(outputs, expected, tolerance: float) -> None:
    """Each float output within `tolerance` of the definition's largest magnitude (a row's out
    sums T terms); the integer kernel's out may differ by a weight's rounding step, so it gets
    1e-3."""
    for got, want in zip(outputs[:4], expected[:4]):
        finite = want.isfinite()
        scale = want[finite].abs().max().item() if finite.any() else 1.0
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * scale)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--layers", type=int, default=30, help="copies read per pass (default 30)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--tau",
        type=float,
        default=Method().tau,
        help=f"sparse: min_weight = e^-tau (default {Method().tau:g}, the method's)",
    )
    parser.add_argument(
        "--peaked",
        type=float,
        nargs="?",
        const=2.0,
        default=1.0,
        help="scale the rows by this factor (2 if given alone): peaked attention",
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    if not (lowbit_cpu.register() and lowbit_int_cpu.register() and lowbit_sparse_cpu.register()):
        raise SystemExit("a C kernel did not build (see the warning above)")
    path = lowbit_int_cpu.path_of(lowbit_int_cpu.load(lowbit_int_cpu.build()))
    min_weight = math.exp(-args.tau)
    kernels = (  # op, its definition, the tolerance, its arguments from the others'
        (
            torch.ops.specache.lowbit_partial_attention,
            lowbit_partial_attention_reference,
            1e-5,
            lambda x: x,
        ),
        (
            torch.ops.specache.lowbit_partial_attention_int8,
            lowbit_partial_attention_int8_reference,
            1e-3,
            lambda x: x,
        ),
        (  # a position kept by the kernel and not the definition, at the threshold: 1e-4
            torch.ops.specache.lowbit_partial_attention_sparse,
            lowbit_partial_attention_sparse_reference,
            1e-4,
            lambda x: sparse_inputs(x, min_weight),
        ),
    )
    print(
        f"\nbatch 1, group {GROUP}, fp16 scales, {EXCLUDED} excluded per KV head, {args.layers} "
        f"layers a pass, {torch.get_num_threads()} threads, integer and sparse kernels: "
        f"{path}, sparse at tau {args.tau:g}, rows scaled by {args.peaked:g}\n"
    )
    print(
        "| shape | bits | T | read GB/s | floor ms | float ms | int8 ms | sparse ms | kept % | "
        "int8 over float | sparse ms / int8 ms | float over floor | int8 over floor | "
        "sparse over floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (n_kv, m, d) in SHAPES.items():
        for bits in (1, 2):
            for t in args.lengths:
                layers = [
                    make_inputs(t, n_kv, m, d, bits, seed, args.peaked)
                    for seed in range(args.layers)
                ]
                times = []
                before = measure_read_bandwidth()
                for op, definition, tolerance, inputs_of in kernels:
                    inputs = [inputs_of(x) for x in layers]
                    outputs = op(*inputs[0])
                    check(outputs, definition(*inputs[0]), tolerance)
                    times.append(time_layers(op, inputs, args.repeats))
                kept = 100 * outputs[4].float().mean().item()  # the sparse kernel's, the last
                bandwidth = (before + measure_read_bandwidth()) / 2
                read = sum(x.nbytes for x in layers[0][1:7])
                floor = read / bandwidth / 1e9
                fl, i8, sp = times
                print(
                    f"| {name} | {bits} | {t} | {bandwidth:.0f} | {1e3 * floor:.3f} | "
                    f"{1e3 * fl:.3f} | {1e3 * i8:.3f} | {1e3 * sp:.3f} | {kept:.1f} | "
                    f"{fl / i8:.2f}x | {sp / i8:.2f}x | {fl / floor:.1f}x | {i8 / floor:.1f}x | "
                    f"{sp / floor:.1f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
