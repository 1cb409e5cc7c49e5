"""The ways to run a quantized Linear on this CPU, timed over one decode step's Linears.

    python scripts/bench/bench_quant.py [--rows 1] [--repeats 8]

The Linears of SmolLM2-135M's 30 blocks (wqkv folded into one 960x576, wo, w1 and w3 as one
3072x576, w2), random weights, `--rows` activation rows (1: batch-1 decode). Per path: ms for the
whole set (the fastest of --repeats), GB/s over the bytes that path reads, and the speed against
the fp32 multiply-reduce. Each path is first checked against the float product of its dequantized
weight (bf16 paths to bf16's precision). quantize.py takes the fastest paths per format from this
(kernels/linear_cpu.c, where it builds).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import linear_cpu  # noqa: E402
from specache.lowbit import unpack_bits  # noqa: E402
from model import linear  # noqa: E402
from quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def best_time(step, repeats: int) -> float:
    step()
    step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    weights = [torch.randn(*shape) * 0.05 for shape in SHAPES]
    inputs = {576: torch.randn(args.rows, 576), 1536: torch.randn(args.rows, 1536)}
    int8 = [quantize_int8(w) for w in weights]
    int4 = [quantize_int4(w, 32) for w in weights]

    def packed_int4(dtype):
        packed = []
        for w, (codes, scales, zeros) in zip(weights, int4):
            unpacked = unpack_bits(codes, 4, w.shape[1]).to(torch.int32)
            scales_and_zeros = (
                torch.stack([scales.t(), (zeros + 8 * scales).t()], -1).contiguous().to(dtype)
            )
            packed.append(
                (torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpacked, 8), scales_and_zeros)
            )
        return packed

    compiled = torch.compile(linear, dynamic=False)
    int8_fused = torch.compile(lambda x, c, s: linear(x, c.to(x.dtype)) * s, dynamic=False)
    int4_fused = torch.compile(
        lambda x, p, s, z: linear(x, dequantize_int4(p, s, z)), dynamic=False
    )
    bytes_of = dict(
        fp32=sum(w.numel() * 4 for w in weights),
        int8=sum(c.numel() + s.numel() * 4 for c, s in int8),
        int4=sum(p.numel() + s.numel() * 8 for p, s, _ in int4),
    )

    def x_of(w, dtype=torch.float32):
        return inputs[w.shape[1]].to(dtype)

    packed = {dtype: packed_int4(dtype) for dtype in (torch.float32, torch.bfloat16)}
    paths = {
        "fp32 multiply-reduce, compiled": (
            "fp32",
            lambda i: compiled(x_of(weights[i]), weights[i]),
        ),
        "int8 fused cast and multiply-reduce, compiled": (
            "int8",
            lambda i: int8_fused(x_of(weights[i]), *int8[i]),
        ),
        "_weight_int8pack_mm, fp32": (
            "int8",
            lambda i: torch.ops.aten._weight_int8pack_mm(x_of(weights[i]), *int8[i]),
        ),
        "_weight_int8pack_mm, bf16": (
            "int8",
            lambda i: torch.ops.aten._weight_int8pack_mm(
                x_of(weights[i], torch.bfloat16), int8[i][0], int8[i][1].to(torch.bfloat16)
            ),
        ),
        "int8, kernels/linear_cpu.c": (
            "int8",
            lambda i: linear_cpu.quantized_linear(x_of(weights[i]), *int8[i]),
        ),
        "int4, kernels/linear_cpu.c": (
            "int4",
            lambda i: linear_cpu.quantized_linear(x_of(weights[i]), *int4[i], 32),
        ),
        "int4 fused dequantize and multiply-reduce, compiled": (
            "int4",
            lambda i: int4_fused(x_of(weights[i]), *int4[i]),
        ),
        "_weight_int4pack_mm_for_cpu, fp32": (
            "int4",
            lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x_of(weights[i]), packed[torch.float32][i][0], 32, packed[torch.float32][i][1]
            ),
        ),
        "_weight_int4pack_mm_for_cpu, bf16": (
            "int4",
            lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x_of(weights[i], torch.bfloat16),
                packed[torch.bfloat16][i][0],
                32,
                packed[torch.bfloat16][i][1],
            ),
        ),
    }
    reference = {
        "fp32": lambda i: weights[i],
        "int8": lambda i: dequantize_int8(*int8[i]),
        "int4": lambda i: dequantize_int4(*int4[i]),
    }
    rows, base = [], None
    for name, (fmt, run) in paths.items():
        expected = F.linear(x_of(weights[0]), reference[fmt](0))
        tolerance = 1e-2 if "bf16" in name else 1e-4
        torch.testing.assert_close(
            run(0).float(), expected, rtol=0, atol=tolerance * expected.abs().max().item()
        )
        seconds = best_time(lambda: [run(i) for i in range(len(weights))], args.repeats)
        base = base or seconds
        rows.append(
            f"| {name} | {1e3 * seconds:.1f} | {bytes_of[fmt] / seconds / 1e9:.1f} | "
            f"{base / seconds:.2f}x |"
        )
    print(f"SmolLM2-135M's Linears, {args.rows} row(s), {torch.get_num_threads()} threads\n")
    print("| path | ms per step | GB/s | speed vs fp32 |\n|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
