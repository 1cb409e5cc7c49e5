"""Decode speed of every cache side by side, against the machine's read bandwidth and HF
transformers.

    python scripts/bench/bench.py                                    # 1k-16k x batch 1, 4; all \
        methods
    python scripts/bench/bench.py --lengths 16384 --batch_sizes 1 --methods full specache-1bit \
        --out /tmp/bench
    python scripts/bench/bench.py --lengths 1024 4096 --no_hf --dtype bfloat16
    python scripts/bench/bench.py --device cuda --random_weights Meta-Llama-3-8B --dtype bfloat16 \
        --lengths 32768 --batch_sizes 1 --max_batch --no_hf         # as scripts/gpu_check.sh runs
        it

Every figure comes from one run. Per context length, one random-token prompt is prefilled once
(batch 1, full precision, as every method does: scripts/eval/harness.py) and each method's cache
takes its K and V (`batch` copies of it), then decodes `--new_tokens` steps, compiled (`--eager`:
not), after a warm-up that compiles the method's graphs. SmolLM2's trained context is 8k: longer
prompts here measure speed only. A step's time is the median of the steps timed (the box may be
shared, and a spike in one step then moves no figure); HF's rows take the mean from the first new
token to the last. The full cache's fast-tier MB are its K and V as allocated, in the model's dtype
(rings for sliding-window layers). Bytes per step are what the step must read: the weights plus what
each tier's step reads (the full cache: its K and V up to the position, in the model's dtype, and
the rings; SpeCache: its low-bit copy, window and fetched pairs, and the rings; eviction: its kept
pairs, and the rings). The machine's read bandwidth (a plain sum of a large tensor) is measured at
the start and again around each row, since the box may be shared; "% of bw" uses the reading around
the row. Ratios to the full cache are tok/s over the full cache's tok/s at the same length and
batch, in the same run.

Also: the paper's Table 4 (speculative against not) is `specache-1bit` against
`specache-nospec-1bit`. On a GPU, `specache-1bit, fetch waited` waits for each fetch as soon as it
starts: what overlapping the host-to-GPU fetch buys (on a CPU the fetch is a gather inside the
step, so that row is left out there). HF transformers' `generate` with its DynamicCache and, when
optimum-quanto is installed, its QuantizedCache (quanto, 2 bits) run batch 1, same prompt and dtype
(embedded model only). On a CPU, llama.cpp (llama-cpp-python, `pip install -r
requirements-bench.txt`, else its rows are skipped with a note) runs the GGUF the default model
comes from, same prompt, torch's thread count, batch 1: its own prefill, then greedy steps timed
one by one (median), with an f16 KV cache and, up to --llama_cpp_q4_kv_max, a q4_0 one (flash
attention); its bytes per step are the GGUF file and its KV cache.

Long contexts with SpeCache's slow tier on disk, a Llama-3-8B shape at 64k-128k with int8 weights
and synthetic K and V (no prefill), cold and warm page cache: `scripts/bench/bench_disk.py`.

`--random_weights NAME` times a model of that shape (a name in config.py's transformer_configs, such
as Meta-Llama-3-8B) with random weights, where no checkpoint can travel (the GPU check): speed
only, the tokens mean nothing. `--max_batch` also finds, per method and length, the largest batch
that fits in memory (doubling, then bisecting, up to --max_batch_cap; on a GPU SpeCache's slow tier
is pinned host memory, so host RAM can be the limit) and reports its tok/s, as the paper's
throughput figure does.

Writes {out}/bench.md (the table under the command), {out}/bench.json and {out}/bench.png (ms per
step against context, batch 1).
"""

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import load_model  # noqa: E402
from caches.full import full_cache_step_bytes  # noqa: E402
from generation import weight_bytes  # noqa: E402
from config import ModelArgs, transformer_configs  # noqa: E402
from model import Transformer  # noqa: E402
from quantize import Int4Linear, Int8Linear, pack_int4, replace_linears  # noqa: E402
from checkpoint import find_default_gguf, prepare_default_checkpoint  # noqa: E402
from scripts.eval.harness import RESULTS_DIR, Runner, method_argument, write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402
from scripts.bench.bench_peers import (  # noqa: E402
    bench_hf,
    bench_llama_cpp,
    llama_cpp_available,
    measure_read_bandwidth,
    quanto_available,
)

DEFAULT_METHODS = ["full", "specache-1bit", "specache-2bit", "specache-nospec-1bit", "kivi-1bit"]
WAITED = "specache-1bit, fetch waited"
LLAMA_CPP = "llama.cpp, f16 KV"


def random_model(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    weights: Optional[str] = None,
    groupsize: int = 128,
) -> Transformer:
    """A model of `name`'s shape with random weights (speed only). `weights` "int8" or "int4" (of
    `groupsize`): quantized Linears (as quantize.py makes), built without ever holding the float
    weights, so that a Llama-3-8B shape fits in 9 GB (int8) or 5 GB (int4); their scales keep
    activations at unit scale."""
    if weights is None:
        with torch.device(device):
            model = Transformer(ModelArgs.from_name(name))
        return model.to(dtype).eval()
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_name(name))
    replace_linears(model, weights, groupsize)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Int8Linear):
                module.weight.random_(-127, 128)
                module.scales.fill_(1 / (73 * module.in_features**0.5))  # codes' std is 73
            elif isinstance(module, Int4Linear):
                module.weight.random_(0, 256)
                # codes 0..15 centred on 7.5 (std 4.6)
                module.scales.fill_(1 / (4.6 * module.in_features**0.5))
                module.zeros.copy_(-7.5 * module.scales)
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_()
    pack_int4(model)
    return model.eval()


class NoTokenizer:
    """What the runner needs of a tokenizer, for random weights: no stop tokens, no text."""

    stop_ids = ()

    def decode(self, ids: list[int]) -> str:
        return ""


def largest_batch(fits: Callable[[int], bool], cap: int) -> int:
    """The largest batch in [1, cap] for which fits(batch) holds (0 if none), assuming that a batch
    that fits means every smaller one fits: double until one does not, then bisect."""
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None and good < cap:
        trial = min(2 * good, cap)
        good, bad = (trial, None) if fits(trial) else (good, trial)
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


def prompt_of_length(length: int, vocab: int = 49152) -> list[int]:
    """A fixed pseudo-random prompt: the same tokens for every method."""
    g = torch.Generator().manual_seed(length)
    return torch.randint(100, vocab - 100, (length,), generator=g).tolist()


def bench_method(
    runner: Runner, method: str, prompt: list[int], prefilled, new_tokens: int, batch: int
) -> dict:
    overlap = method != WAITED
    name = "specache-1bit" if method == WAITED else method
    device = runner.model.tok_embeddings.weight.device
    t0 = time.perf_counter()
    # warm-up: compiles this method's graphs
    runner.decode(name, prompt, prefilled, 4, batch, overlap)
    compile_seconds = time.perf_counter() - t0
    bandwidth_before = measure_read_bandwidth(device)
    # the decode loops read each token back, so these times are the steps' on a GPU too
    token_times = []
    result = runner.decode(
        name,
        prompt,
        prefilled,
        new_tokens,
        batch,
        overlap,
        callback=lambda tokens: token_times.append(time.perf_counter()),
    )
    bandwidth = (bandwidth_before + measure_read_bandwidth(device)) / 2
    seconds_per_step = statistics.median(b - a for a, b in zip(token_times, token_times[1:]))
    fast = (
        full_cache_bytes(runner.model)
        if name.startswith("full")
        else result.stats.get("fast_tier_bytes")
    )
    return dict(
        ms_per_step=1e3 * seconds_per_step,
        tok_s=batch / seconds_per_step,
        gbps=result.decode_bytes / result.decode_steps / seconds_per_step / 1e9,
        bandwidth=bandwidth,
        fast=fast,
        slow=result.stats.get("slow_tier_bytes"),
        fetched=result.stats.get("bytes_fetched_per_token"),
        discarded=result.stats.get("prefetch_discarded_share"),
        compile=compile_seconds if runner.compiled else None,
    )


def full_cache_bytes(model: Transformer) -> int:
    """The full cache set up in `model`, all of it fast tier: K and V in the model's dtype (rings
    for
    sliding-window layers)."""
    return sum(b.nbytes for layer in model.layers for b in layer.attention.kv_cache.buffers())


def release_caches(model: Transformer) -> None:
    """Drop every layer's cache, so that the next setup does not have to fit beside it."""
    for layer in model.layers:
        layer.attention.kv_cache = None
    gc.collect()
    if model.tok_embeddings.weight.device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory(error: Exception) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def max_batch(runner: Runner, method: str, prompt: list[int], prefilled, cap: int) -> int:
    """The largest batch of `prompt` whose cache fits with two decode steps (eager: memory only)."""

    def fits(batch: int) -> bool:
        release_caches(runner.model)
        try:
            with torch.compiler.set_stance("force_eager"):
                runner.decode(method, prompt, prefilled, 2, batch)
            return True
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not out_of_memory(error):
                raise
            return False
        finally:
            release_caches(runner.model)

    return largest_batch(fits, cap)


def table(rows: list[dict], title: str) -> str:
    """The rows as markdown. Ratios are tok/s over the fastest full cache (`full` or `full-16bit`,
    any
    checkpoint) at the same context and batch, and over llama.cpp's f16-KV row at the same
    context."""
    lines = [
        title,
        "",
        "| context | batch | method | prefill s | compile s | decode ms/step | tok/s | GB/s | % of "
        "bw "
        "| fast-tier KV MB | slow-tier KV MB | fetched kB/token | prefetch discarded | vs fastest "
        "full | vs llama.cpp |",
        "|---" * 15 + "|",
    ]
    rows = sorted(rows, key=lambda r: (r["length"], r["batch"]))  # stable: methods keep their order
    full, peer = {}, {}
    for r in rows:
        if r["method"].split(" [")[0] in ("full", "full-16bit"):
            key = (r["length"], r["batch"])
            full[key] = max(full.get(key, 0.0), r["tok_s"])
        if r["method"] == LLAMA_CPP:
            peer[r["length"]] = r["tok_s"]
    for r in rows:

        def ratio(base):
            return "-" if not base else f"{r['tok_s'] / base:.2f}x"

        def mb(x):
            return "-" if x is None else f"{x / 1e6:.1f}"

        kb = "-" if r.get("fetched") is None else f"{r['fetched'] / 1e3:.0f}"
        discarded = "-" if r.get("discarded") is None else f"{100 * r['discarded']:.0f}%"
        compiled = "-" if r.get("compile") is None else f"{r['compile']:.0f}"
        lines.append(
            f"| {r['length']} | {r['batch']} | {r['method']} | {r['prefill']:.1f} | {compiled} | "
            f"{r['ms_per_step']:.1f} | {r['tok_s']:.1f} | {r['gbps']:.1f} | "
            f"{100 * r['gbps'] / r['bandwidth']:.0f}% | "
            f"{mb(r['fast'])} | {mb(r['slow'])} | {kb} | {discarded} | "
            f"{ratio(full.get((r['length'], r['batch'])))} | "
            f"{ratio(peer.get(r['length']) if r['batch'] == 1 else None)} |"
        )
    return "\n".join(lines)


def max_batch_table(largest: list[dict], cap: int) -> str:
    lines = [
        f"Largest batch that fits (tried up to {cap}) and its decode tok/s:",
        "",
        "| context | method | max batch | tok/s | tok/s vs full |",
        "|---|---|---|---|---|",
    ]
    full = {r["length"]: r["tok_s"] for r in largest if r["method"] == "full"}
    for r in largest:
        ratio = f"{r['tok_s'] / full[r['length']]:.2f}x" if full.get(r["length"]) else "-"
        lines.append(
            f"| {r['length']} | {r['method']} | {r['batch']} | {r['tok_s']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted(
            (r["length"], r["ms_per_step"])
            for r in rows
            if r["method"] == method and r["batch"] == 1
        )
        ax.plot([x for x, _ in mine], [y for _, y in mine], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode ms per step (batch 1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384], help="context lengths"
    )
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="METHOD",
        type=lambda m: m if m == WAITED else method_argument(m),
        help=f"default: {' '.join(DEFAULT_METHODS)}, and '{WAITED}' on a GPU; SpeCache methods "
        "take "
        "a selection after a colon (specache-1bit:paper), as in the evaluation scripts",
    )
    parser.add_argument(
        "--new_tokens", type=int, default=32, help="decode steps timed per measurement"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--checkpoint",
        type=Path,
        nargs="+",
        default=None,
        help="model.pth, or quantize.py's model_int8.pth / model_int4.g<N>.pth; several are timed "
        "one after the other, each row naming its file, ratios to the first one's full cache "
        "(default: the embedded SmolLM2; HF rows only for that)",
    )
    parser.add_argument(
        "--random_weights",
        default=None,
        metavar="NAME",
        choices=list(transformer_configs),
        help="time a model of this shape with random weights instead of the embedded SmolLM2 "
        "(speed only; implies --no_hf)",
    )
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument(
        "--compile_per_block",
        action="store_true",
        help="on a CPU, compile each transformer block rather than each method's whole step "
        "(seconds "
        "of compiling rather than minutes per method and length; slower steps)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="decode without torch.compile, as generate.py and chat.py do by default",
    )
    parser.add_argument(
        "--max_batch",
        action="store_true",
        help="also find each method's largest batch at each length, and its tok/s",
    )
    parser.add_argument(
        "--max_batch_cap", type=int, default=64, help="the largest batch --max_batch tries"
    )
    parser.add_argument("--no_hf", action="store_true", help="skip HF transformers")
    parser.add_argument(
        "--no_llama_cpp",
        action="store_true",
        help="skip llama.cpp (its rows run on a CPU for the default model, its int8 and int4 "
        "files, "
        "when llama-cpp-python is installed: pip install -r requirements-bench.txt)",
    )
    parser.add_argument(
        "--llama_cpp_max",
        type=int,
        default=16384,
        metavar="N",
        help="run llama.cpp up to this context (default 16384: its prefill of 16k tokens took 3.5 "
        "minutes on a 2-core CPU, and grows with the square of the context)",
    )
    parser.add_argument(
        "--llama_cpp_q4_kv_max",
        type=int,
        default=4096,
        metavar="N",
        help="also time llama.cpp's q4_0 KV cache (with flash attention) up to this context "
        "(default 4096: at 16k its prefill did not finish in 15 minutes on a 2-core CPU); 0: never",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help="where the report files go (default docs/results)",
    )
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible")
    methods = args.methods or DEFAULT_METHODS + ([WAITED] if device.type == "cuda" else [])
    print(f"Read bandwidth at start: {measure_read_bandwidth(device):.1f} GB/s", file=sys.stderr)
    names = [m for m in methods if m != WAITED]
    if args.random_weights:
        model_name, checkpoints = f"{args.random_weights} shape, random weights", [None]
    else:
        checkpoints = args.checkpoint or [prepare_default_checkpoint()]
        model_name = ", ".join(f"{c.parent.name}/{c.name}" for c in checkpoints)
    hf, hf_methods = None, []
    if not (args.no_hf or args.random_weights or args.checkpoint):
        from transformers import AutoModelForCausalLM, GgufConfig

        gguf = find_default_gguf()
        # dense weights, as ours: no on-the-fly dequantization
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),
        )
        hf = hf.to(device).eval()
        hf_methods = [("HF DynamicCache", None)]
        if quanto_available():
            hf_methods.append(("HF QuantizedCache (quanto 2-bit)", "quantized"))
        else:
            print("optimum-quanto is not installed: HF QuantizedCache skipped", file=sys.stderr)
    default = None if args.random_weights else prepare_default_checkpoint()
    llama_rows = not (args.no_llama_cpp or args.random_weights or device.type != "cpu") and all(
        c.resolve().parent == default.resolve().parent for c in checkpoints
    )
    if llama_rows and not llama_cpp_available():
        print(
            "llama-cpp-python is not installed (pip install -r requirements-bench.txt): llama.cpp "
            "rows skipped",
            file=sys.stderr,
        )
        llama_rows = False
    llama_gguf = find_default_gguf() if llama_rows else None
    rows, largest = [], []
    for checkpoint in checkpoints:
        if checkpoint is None:
            model, tokenizer = random_model(args.random_weights, device, dtype), NoTokenizer()
        else:
            model, tokenizer = (
                load_model(checkpoint, device, dtype),
                get_tokenizer(checkpoint.parent),
            )
        runner = Runner(
            model,
            tokenizer,
            names,
            topk=args.topk,
            compile=not args.eager,
            round_capacity=False,
            whole_step=not args.compile_per_block,
        )
        label = f" [{checkpoint.name}]" if len(checkpoints) > 1 else ""
        for length in args.lengths:
            prompt = prompt_of_length(length, model.config.vocab_size)
            prefilled = runner.prefill(prompt, args.new_tokens)
            for batch in args.batch_sizes:
                for method in methods:
                    measured = bench_method(
                        runner, method, prompt, prefilled, args.new_tokens, batch
                    )
                    rows.append(
                        dict(
                            length=length,
                            batch=batch,
                            method=method + label,
                            prefill=prefilled.seconds,
                            **measured,
                        )
                    )
                    print(
                        f"  {length} x{batch} {method}{label}: {measured['ms_per_step']:.1f} "
                        "ms/step",
                        file=sys.stderr,
                    )
    # the last checkpoint's model
    for length in args.lengths if args.max_batch or hf_methods or llama_rows else []:
        prompt = prompt_of_length(length, model.config.vocab_size)
        prefilled = runner.prefill(prompt, args.new_tokens) if args.max_batch else None
        for method in names if args.max_batch else []:
            batch = max_batch(runner, method, prompt, prefilled, args.max_batch_cap)
            measured = (
                bench_method(runner, method, prompt, prefilled, args.new_tokens, batch)
                if batch
                else {}
            )
            largest.append(
                dict(length=length, method=method, batch=batch, tok_s=measured.get("tok_s", 0.0))
            )
            print(f"  {length} {method}: max batch {batch}", file=sys.stderr)
            release_caches(model)
        for name, implementation in hf_methods:
            step_bytes = weight_bytes(model) + full_cache_step_bytes(
                model, [length + args.new_tokens // 2]
            )
            measured = bench_hf(hf, prompt, args.new_tokens, step_bytes, implementation)
            rows.append(dict(length=length, batch=1, method=name, **measured))
            print(f"  {length} x1 {name}: {measured['ms_per_step']:.1f} ms/step", file=sys.stderr)
        for quantized_kv in (
            [False, True][: 1 + (length <= args.llama_cpp_q4_kv_max)]
            if llama_rows and length <= args.llama_cpp_max
            else []
        ):
            name = "llama.cpp, q4_0 KV (flash attention)" if quantized_kv else LLAMA_CPP
            measured = bench_llama_cpp(llama_gguf, prompt, args.new_tokens, quantized_kv)
            rows.append(dict(length=length, batch=1, method=name, **measured))
            print(f"  {length} x1 {name}: {measured['ms_per_step']:.1f} ms/step", file=sys.stderr)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{torch.get_num_threads()} CPU threads"
    )
    markdown = table(
        rows,
        f"{model_name}, {args.dtype}, greedy, {args.new_tokens} decode steps, "
        f"{'eager' if args.eager else 'compiled'} (ours), "
        f"k = {args.topk}, {where}. Prefill: ours, batch 1, shared by our methods; HF's and "
        "llama.cpp's "
        f"their own. llama.cpp: "
        f"{'the GGUF the default model comes from' if llama_rows else 'not run'}.",
    )
    if largest:
        markdown += "\n\n" + max_batch_table(largest, args.max_batch_cap)
    print(markdown)
    write_report(
        args.out,
        "bench",
        markdown + "\n\n![ms per step](bench.png)",
        dict(rows=rows, max_batch=largest),
    )
    plot(rows, args.out / "bench.png")


if __name__ == "__main__":
    main()
