"""The low-bit segment of SpeCache's attention on CPU: the C kernel against specache.py's plain
PyTorch definition of the op.

    python scripts/bench_lowbit_cpu.py [--lengths 2048 16384 65536] [--repeats 20] [--threads N]

Per call (one layer, batch 1, every position visible, 64 excluded per KV head), ms of:
- reference: `specache.lowbit_partial_attention_reference` (dequantize, matmul, masked exp), what
  the op runs where no kernel is registered;
- kernel: the op once kernels/lowbit_cpu.py has registered the C kernel, and its GB/s over the
  packed bytes it reads (codes, scales and zeros of keys and values).
Shapes: SmolLM2-135M (3 KV heads, 6 rows = 3 query heads x 2 new rows, head_dim 64) and
Llama-3-8B (8 KV heads, 8 rows = 4 x 2, head_dim 128); group 64, fp16 scales, 1 and 2 bits. Each
method is checked against the reference before it is timed; times are the fastest of --repeats
calls (the reference gets a tenth as many), on --threads threads (torch's count by default). The
kernel reads few bytes per flop, so its GB/s shows how far it is from memory bound, not a limit.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernels import lowbit_cpu  # noqa: E402
from specache import LowBitKV, quantize_keys, quantize_values  # noqa: E402
from specache import lowbit_partial_attention_reference as reference  # noqa: E402

SHAPES = {"SmolLM2": (3, 6, 64), "Llama-3-8B": (8, 8, 128)}  # KV heads, rows per KV head, head_dim
GROUP, EXCLUDED = 64, 64


def make_inputs(t: int, n_kv: int, m: int, d: int, bits: int):
    g = torch.Generator().manual_seed(t)
    k = torch.randn(1, n_kv, t, d, generator=g) * torch.linspace(0.2, 4, d)
    v = torch.randn(1, n_kv, t, d, generator=g)
    kv = LowBitKV(
        *quantize_keys(k, bits, GROUP, torch.float16),
        *quantize_values(v, bits, GROUP, torch.float16),
        bits,
        GROUP,
    )
    rows = torch.randn(1, n_kv, m, d, generator=g) * d**-0.5
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


def time_call(fn, *args, repeats: int) -> float:
    """The fastest of `repeats` calls: on a shared machine the others measure the neighbours too."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def check(outputs, expected, tolerance: float) -> None:
    """Each output within `tolerance` of the reference's largest magnitude (a row's out sums T
    terms)."""
    for got, want in zip(outputs, expected):
        finite = want.isfinite()
        scale = want[finite].abs().max().item() if finite.any() else 1.0
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance * scale)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    if not lowbit_cpu.register():
        raise SystemExit("the C kernel did not build (see the warning above)")
    kernel = torch.ops.specache.lowbit_partial_attention
    print(
        f"\nbatch 1, group {GROUP}, fp16 scales, {EXCLUDED} excluded per KV head, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| shape | bits | T | reference ms | kernel ms | kernel GB/s | vs reference |")
    print("|---|---|---|---|---|---|---|")
    for name, (n_kv, m, d) in SHAPES.items():
        for bits in (1, 2):
            for t in args.lengths:
                inputs = make_inputs(t, n_kv, m, d, bits)
                expected = reference(*inputs)
                check(kernel(*inputs), expected, 1e-5)
                times = [
                    time_call(reference, *inputs, repeats=max(1, args.repeats // 10)),
                    time_call(kernel, *inputs, repeats=args.repeats),
                ]
                packed_bytes = sum(x.nbytes for x in inputs[1:7])
                print(
                    f"| {name} | {bits} | {t} | {1e3 * times[0]:.2f} | {1e3 * times[1]:.3f} | "
                    f"{packed_bytes / times[1] / 1e9:.1f} | {times[0] / times[1]:.0f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
