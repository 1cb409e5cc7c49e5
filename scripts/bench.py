"""Decode speed of this implementation against HF transformers and the machine's read bandwidth.

    python scripts/bench.py                                  # 1k and 4k context, fp32, default model
    python scripts/bench.py --lengths 1024 4096 --dtypes float32 bfloat16 --new_tokens 64

Every figure comes from one run: the machine's read bandwidth (a plain sum of a large tensor) is
measured just before and after each row, since the box may be shared and its bandwidth drifts, and
each method's achieved GB/s is quoted against that. Bytes per decode step = the weights + the KV cache up to the current position
(what any implementation must read); tok/s ratios are to HF transformers' `generate` (DynamicCache)
on the same prompt, greedy, same dtype.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import compile_decode, generate, kv_bytes_per_position, load_model, weight_bytes  # noqa: E402
from model import flex_attention_available  # noqa: E402
from scripts.convert_gguf import find_default_gguf, prepare_default_checkpoint  # noqa: E402


def measure_read_bandwidth(gib: float = 0.5, repeats: int = 7) -> float:
    """Median GB/s of summing a tensor far larger than the caches, with torch's threads."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def bracketed(measure):
    """Run `measure()` between two bandwidth readings: the box is shared and its bandwidth drifts."""
    before = measure_read_bandwidth()
    result = measure()
    result["bandwidth"] = (before + measure_read_bandwidth()) / 2
    return result


def prompt_of_length(length: int, vocab: int = 49152) -> list[int]:
    """A fixed pseudo-random prompt: the same tokens for every method."""
    g = torch.Generator().manual_seed(length)
    return torch.randint(100, vocab - 100, (length,), generator=g).tolist()


def bench_ours(model, prompt: list[int], new_tokens: int, compiled: bool) -> dict:
    model.setup_caches(1, len(prompt) + new_tokens)
    use_flex = compiled and flex_attention_available("cpu")
    generate(model, [prompt[:64]], 8, temperature=0, use_flex=use_flex)  # warm-up (and compile)
    result = generate(model, [prompt], new_tokens, temperature=0, use_flex=use_flex)
    return dict(prefill=result.prefill_seconds, tok_s=result.decode_tokens_per_second,
                seconds_per_step=result.decode_seconds / result.decode_steps)


class TokenClock:
    """A transformers streamer that timestamps every new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        """Nothing to flush: only the timestamps matter."""


def bench_hf(hf_model, prompt: list[int], new_tokens: int) -> dict:
    ids = torch.tensor([prompt])
    hf_model.generate(ids[:, :64], max_new_tokens=8, do_sample=False)  # warm-up
    clock = TokenClock()
    t0 = time.perf_counter()
    hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    # put() is called once with the prompt, then once per new token; the first new token ends prefill.
    first, last = clock.times[1], clock.times[-1]
    steps = len(clock.times) - 2
    return dict(prefill=first - t0, tok_s=steps / (last - first), seconds_per_step=(last - first) / steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt lengths in tokens")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--new_tokens", type=int, default=64, help="decode steps timed per measurement")
    parser.add_argument("--no_hf", action="store_true", help="skip HF transformers")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    checkpoint = prepare_default_checkpoint()
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        eager = load_model(checkpoint, torch.device("cpu"), dtype)
        compiled = load_model(checkpoint, torch.device("cpu"), dtype)
        compile_decode(compiled)
        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM, GgufConfig

            gguf = find_default_gguf()
            hf = AutoModelForCausalLM.from_pretrained(  # dense weights, as ours: no on-the-fly dequantization
                str(gguf.parent), gguf_file=gguf.name, dtype=dtype,
                quantization_config=GgufConfig(dequantize=True)).eval()
        for length in args.lengths:
            prompt = prompt_of_length(length)
            step_bytes = weight_bytes(eager) + kv_bytes_per_position(eager) * (length + args.new_tokens // 2)
            measured = {
                "ours, eager": bracketed(lambda: bench_ours(eager, prompt, args.new_tokens, compiled=False)),
                "ours, --compile": bracketed(lambda: bench_ours(compiled, prompt, args.new_tokens, compiled=True)),
            }
            if hf is not None:
                measured["HF transformers generate"] = bracketed(lambda: bench_hf(hf, prompt, args.new_tokens))
            for method, m in measured.items():
                rows.append(dict(dtype=dtype_name, length=length, method=method, **m,
                                 gbps=step_bytes / m["seconds_per_step"] / 1e9,
                                 vs_hf=m["tok_s"] / measured["HF transformers generate"]["tok_s"] if hf else None))
                print(f"  {dtype_name} {length} {method}: {m['tok_s']:.1f} tok/s", file=sys.stderr)
    print(f"\nSmolLM2-135M-Instruct, batch 1, greedy, {args.new_tokens} new tokens, {torch.get_num_threads()} threads. "
          "Bandwidth: median of 7 sums of a 0.5 GiB tensor, read just before and after each row.\n")
    print("| dtype | context | method | prefill s | decode tok/s | GB/s | bandwidth GB/s | % of bandwidth | vs HF |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs_hf = f"{r['vs_hf']:.2f}x" if r["vs_hf"] is not None else "-"
        print(f"| {r['dtype']} | {r['length']} | {r['method']} | {r['prefill']:.2f} | {r['tok_s']:.1f} | "
              f"{r['gbps']:.1f} | {r['bandwidth']:.1f} | {100 * r['gbps'] / r['bandwidth']:.0f}% | {vs_hf} |")


if __name__ == "__main__":
    main()
