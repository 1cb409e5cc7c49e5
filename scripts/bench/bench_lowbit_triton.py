"""SpeCache's low-bit pass on a CUDA GPU: the float pass's Triton kernels against the sparse pass's
(specache/kernels/lowbit_triton.py, lowbit_sparse_triton.py), and both against the time the copy's
bytes take to read at the GPU's own copy bandwidth.

    python scripts/bench/bench_lowbit_triton.py [--lengths 32768 131072] [--tau 6] \
        [--peaked 1 4]

Per shape, length and row scale (`--peaked`: the rows times FACTOR, as
scripts/bench/bench_lowbit_cpu.py makes them; 1 is random K, V's flat attention, 4 about the
peaked attention of a trained model at long context), one layer's 1-bit copy (batch 1, group 64,
64 excluded per KV head) goes through each op, checked first against its plain-PyTorch
definition, then timed with CUDA events (the median of --repeats calls):
- float ms, sparse ms: `specache::lowbit_partial_attention` and its `_sparse` twin at
  min_weight = e^-tau;
- kept %: the positions the sparse pass mixed value by value; groups read %: the key groups with
  one such position, whose values it reads (the others read one mean value);
- floor ms: the copy's bytes (codes, scales and zeros of keys and values) at the bandwidth of a
  device-to-device copy measured in the same run; the weights both write (M x T float32, read
  again by the ranking) are not counted.
Prints one markdown table. Needs a CUDA GPU and Triton (scripts/gpu_check.sh runs it).
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.bench_lowbit_cpu import (  # noqa: E402
    GROUP,
    SHAPES,
    check,
    make_inputs,
    sparse_inputs,
)
from specache.config import Method  # noqa: E402
from specache.kernels import lowbit_sparse_triton, lowbit_triton  # noqa: E402
from specache.ops import (  # noqa: E402
    lowbit_partial_attention_reference,
    lowbit_partial_attention_sparse_reference,
)


def median_ms(call, repeats: int) -> float:
    """The median of `repeats` timed calls, in ms, CUDA events around each."""
    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return source.numel() / median_ms(lambda: target.copy_(source), 5) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--peaked", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--tau",
        type=float,
        default=Method().tau,
        help=f"sparse: min_weight = e^-tau (default {Method().tau:g}, the method's)",
    )
    args = parser.parse_args()
    if not (lowbit_triton.register() and lowbit_sparse_triton.register()):
        raise SystemExit("needs a CUDA GPU and Triton")
    torch.set_grad_enabled(False)
    min_weight = math.exp(-args.tau)
    bandwidth = copy_bandwidth()
    print(
        f"\n{torch.cuda.get_device_name()}, batch 1, 1 bit, group {GROUP}, fp16 scales, sparse at "
        f"tau {args.tau:g}; device-to-device copy {bandwidth:.0f} GB/s\n"
    )
    print(
        "| shape | T | rows x | floor ms | float ms | sparse ms | kept % | groups read % | "
        "sparse over float | float over floor | sparse over floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (n_kv, m, d) in SHAPES.items():
        for t in args.lengths:
            for peaked in args.peaked:
                on_cpu = make_inputs(t, n_kv, m, d, 1, peaked=peaked)
                inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in on_cpu]
                sparse = sparse_inputs(inputs, min_weight)
                float_op = torch.ops.specache.lowbit_partial_attention
                sparse_op = torch.ops.specache.lowbit_partial_attention_sparse
                check(float_op(*inputs), lowbit_partial_attention_reference(*inputs), 1e-4)
                outputs = sparse_op(*sparse)
                check(outputs, lowbit_partial_attention_sparse_reference(*sparse), 1e-4)
                kept = outputs[4]
                groups = torch.nn.functional.pad(kept, (0, -t % GROUP)).unflatten(-1, (-1, GROUP))
                float_ms = median_ms(lambda: float_op(*inputs), args.repeats)
                sparse_ms = median_ms(lambda: sparse_op(*sparse), args.repeats)
                floor = sum(x.nbytes for x in inputs[1:7]) / bandwidth / 1e6
                print(
                    f"| {name} | {t} | {peaked:g} | {floor:.3f} | {float_ms:.3f} | "
                    f"{sparse_ms:.3f} | {100 * kept.float().mean():.1f} | "
                    f"{100 * groups.any(-1).float().mean():.1f} | {sparse_ms / float_ms:.2f}x | "
                    f"{float_ms / floor:.1f}x | {sparse_ms / floor:.1f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
