"""Decode speed of every cache side by side, against the machine's read bandwidth and HF transformers.

    python scripts/bench.py                                          # 1k-16k x batch 1, 4; all methods
    python scripts/bench.py --lengths 16384 --batch_sizes 1 --methods full specache-1bit --out /tmp/bench
    python scripts/bench.py --lengths 1024 4096 --no_hf --dtype bfloat16

Every figure comes from one run. Per context length, one random-token prompt is prefilled once
(batch 1, full precision, as every method does: scripts/harness.py) and each method's cache takes
its K and V (`batch` copies of it), then decodes `--new_tokens` steps, compiled, after a warm-up
that compiles the method's graphs. SmolLM2's trained context is 8k: longer prompts here measure
speed only. Bytes per step are what the step must read: the weights plus what each tier's step
reads (the full cache: its K and V up to the position, in the model's dtype; SpeCache: its low-bit
copy, window and fetched pairs; eviction: its kept pairs). The machine's read bandwidth
(a plain sum of a large tensor) is measured at the start and again around each row, since the box
may be shared; "% of bw" uses the reading around the row. Ratios to the full cache are tok/s over
the full cache's tok/s at the same length and batch, in the same run.

Also: `specache-1bit, fetch waited` (SpeCache with each fetch waited for as soon as it starts: what
overlapping the fetch buys; the paper's Table 4 compares with the non-speculative method, which
is `specache-nospec-1bit`), and HF transformers' `generate` with its DynamicCache and, when
optimum-quanto is installed, its QuantizedCache (quanto, 2 bits), batch 1, same prompt and dtype.

Writes {out}/bench.md (the table under the command), {out}/bench.json and {out}/bench.png (ms per
step against context, batch 1).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import kv_bytes_per_position, load_model, weight_bytes  # noqa: E402
from scripts.convert_gguf import find_default_gguf, prepare_default_checkpoint  # noqa: E402
from scripts.harness import METHODS, RESULTS_DIR, Runner, write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

DEFAULT_METHODS = ["full", "specache-1bit", "specache-2bit", "specache-nospec-1bit", "kivi-1bit"]
WAITED = "specache-1bit, fetch waited"


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


def prompt_of_length(length: int, vocab: int = 49152) -> list[int]:
    """A fixed pseudo-random prompt: the same tokens for every method."""
    g = torch.Generator().manual_seed(length)
    return torch.randint(100, vocab - 100, (length,), generator=g).tolist()


def bench_method(runner: Runner, method: str, prompt: list[int], prefilled, new_tokens: int, batch: int) -> dict:
    overlap = method != WAITED
    name = "specache-1bit" if method == WAITED else method
    runner.decode(name, prompt, prefilled, 4, batch, overlap)  # warm-up: compiles this method's graphs
    bandwidth_before = measure_read_bandwidth()
    result = runner.decode(name, prompt, prefilled, new_tokens, batch, overlap)
    bandwidth = (bandwidth_before + measure_read_bandwidth()) / 2
    seconds_per_step = result.decode_seconds / result.decode_steps
    return dict(ms_per_step=1e3 * seconds_per_step, tok_s=batch / seconds_per_step, gbps=result.decode_gbps,
                bandwidth=bandwidth, fast=result.stats.get("fast_tier_bytes"), slow=result.stats.get("slow_tier_bytes"))


class TokenClock:
    """A transformers streamer that timestamps every new token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        """Nothing to flush: only the timestamps matter."""


def bench_hf(hf_model, prompt: list[int], new_tokens: int, step_bytes: int, cache_implementation=None) -> dict:
    ids = torch.tensor([prompt])
    extra = {} if cache_implementation is None else dict(
        cache_implementation=cache_implementation, cache_config=dict(backend="quanto", nbits=2))
    hf_model.generate(ids[:, :64], max_new_tokens=4, do_sample=False, **extra)  # warm-up
    bandwidth_before = measure_read_bandwidth()
    clock = TokenClock()
    hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                      **extra)
    bandwidth = (bandwidth_before + measure_read_bandwidth()) / 2
    # put() is called once with the prompt, then once per new token; the first new token ends prefill.
    first, last = clock.times[1], clock.times[-1]
    seconds_per_step = (last - first) / (len(clock.times) - 2)
    return dict(ms_per_step=1e3 * seconds_per_step, tok_s=1 / seconds_per_step, gbps=step_bytes / seconds_per_step / 1e9,
                bandwidth=bandwidth, fast=None, slow=None, prefill=first - clock.times[0])


def quanto_available() -> bool:
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        return False
    return True


def table(rows: list[dict], title: str) -> str:
    lines = [title, "", "| context | batch | method | prefill s | decode ms/step | tok/s | GB/s | % of bw | fast-tier KV MB "
             "| slow-tier KV MB | tok/s vs full |", "|---" * 11 + "|"]
    full = {(r["length"], r["batch"]): r["tok_s"] for r in rows if r["method"] == "full"}
    for r in rows:
        full_tok_s = full.get((r["length"], r["batch"]))
        ratio = "-" if full_tok_s is None else f"{r['tok_s'] / full_tok_s:.2f}x"
        mb = lambda x: "-" if x is None else f"{x / 1e6:.1f}"
        lines.append(f"| {r['length']} | {r['batch']} | {r['method']} | {r['prefill']:.1f} | {r['ms_per_step']:.1f} | "
                     f"{r['tok_s']:.1f} | {r['gbps']:.1f} | {100 * r['gbps'] / r['bandwidth']:.0f}% | {mb(r['fast'])} | "
                     f"{mb(r['slow'])} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r["length"], r["ms_per_step"]) for r in rows if r["method"] == method and r["batch"] == 1)
        ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms per step (batch 1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384], help="context lengths")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS + [WAITED],
                        choices=list(METHODS) + [WAITED], metavar="METHOD",
                        help=f"default: {' '.join(DEFAULT_METHODS)} '{WAITED}'")
    parser.add_argument("--new_tokens", type=int, default=32, help="decode steps timed per measurement")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--no_hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the report files go (default docs/results)")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    print(f"Read bandwidth at start: {measure_read_bandwidth():.1f} GB/s", file=sys.stderr)
    checkpoint = prepare_default_checkpoint()
    dtype = getattr(torch, args.dtype)
    model = load_model(checkpoint, torch.device("cpu"), dtype)
    names = [m for m in args.methods if m != WAITED]
    runner = Runner(model, get_tokenizer(checkpoint.parent), names, topk=args.topk, compile=True, round_capacity=False)
    hf, hf_methods = None, []
    if not args.no_hf:
        from transformers import AutoModelForCausalLM, GgufConfig

        gguf = find_default_gguf()
        hf = AutoModelForCausalLM.from_pretrained(  # dense weights, as ours: no on-the-fly dequantization
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)).eval()
        hf_methods = [("HF DynamicCache", None)]
        if quanto_available():
            hf_methods.append(("HF QuantizedCache (quanto 2-bit)", "quantized"))
        else:
            print("optimum-quanto is not installed: HF QuantizedCache skipped", file=sys.stderr)
    rows = []
    for length in args.lengths:
        prompt = prompt_of_length(length)
        prefilled = runner.prefill(prompt, args.new_tokens)
        for batch in args.batch_sizes:
            for method in args.methods:
                measured = bench_method(runner, method, prompt, prefilled, args.new_tokens, batch)
                rows.append(dict(length=length, batch=batch, method=method, prefill=prefilled.seconds, **measured))
                print(f"  {length} x{batch} {method}: {measured['ms_per_step']:.1f} ms/step", file=sys.stderr)
        for name, implementation in hf_methods:
            step_bytes = weight_bytes(model) + kv_bytes_per_position(model) * (length + args.new_tokens // 2)
            measured = bench_hf(hf, prompt, args.new_tokens, step_bytes, implementation)
            rows.append(dict(length=length, batch=1, method=name, **measured))
            print(f"  {length} x1 {name}: {measured['ms_per_step']:.1f} ms/step", file=sys.stderr)
    markdown = table(rows, f"SmolLM2-135M-Instruct, {args.dtype}, greedy, {args.new_tokens} decode steps, compiled "
                           f"(ours), k = {args.topk}, {torch.get_num_threads()} threads. Prefill: ours, batch 1, "
                           "shared by our methods; HF's own.")
    print(markdown)
    write_report(args.out, "bench", markdown + "\n\n![ms per step](bench.png)", dict(rows=rows))
    plot(rows, args.out / "bench.png")


if __name__ == "__main__":
    main()
