"""Where a compiled decode step's time goes, by part, from torch.profiler.

    python scripts/bench/profile_step.py --checkpoint \
        checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int8.pth \\
        --length 1024 --methods full-16bit specache-1bit specache-1bit:paper

Per length and method: one random-token prompt of that many tokens prefilled (as
scripts/bench/bench.py does), the decode step compiled whole (or per block with
--compile_per_block), warmed up, then --steps steps timed without the profiler (the median step) and
again under it. The profiled time of each op, summed over the steps and divided by them, goes into a
part:

  weights        the quantized Linears' op (kernels/linear_cpu.c); float weights are fused into
                 inductor's kernels and count under "other compiled kernels"
  full-cache attention   the full cache's decode attention (kernels/dense_cpu.c)
  SpeCache attention, one op   a layer's whole SpeCache attention with its slow tier in RAM
                 (specache::step_attention, specache/kernels/step_cpu.cpp: the four parts
                 below in one call, which the profiler does not split)
  low-bit read   SpeCache's pass over the 1-bit copy (specache/kernels/lowbit_cpu.c), where it runs
                 op by op (a slow tier on disk, or the profile of an older step)
  16-bit pairs and merge   SpeCache's attention over its fetched pairs, window and new rows, merged
                 with the low-bit pass (specache/kernels/merge_cpu.c; matmuls elsewhere)
  choice and top-k   SpeCache's ranking of positions and top-k (specache/kernels/rank_cpu.c;
  torch's topk elsewhere)
  gather         gather and indexing (SpeCache's fetch of pairs from the slow tier in RAM)
  other compiled kernels   inductor's generated loops (norms, RoPE, masks, ...)
  other ops      the rest of torch's ops in the step
  dispatch       the median step's time less all of the above: Python, guards, op dispatch

The profiler slows small ops down, so the parts are approximate; the step time is from the
unprofiled run. Prints one markdown table, and writes it to {out}/profile.md (and .json) with --out.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import load_model, prepare_default_checkpoint  # noqa: E402
from scripts.bench.bench import prompt_of_length  # noqa: E402
from scripts.bench.bench_step_op import step_ms  # noqa: E402
from scripts.eval.harness import Runner, method_argument, write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

PARTS = [
    (
        "weights",
        ("gptfast::quantized_linear", "aten::_weight_int8pack_mm", "gptfast::int4_matmul"),
    ),
    ("full-cache attention", ("gptfast::dense_decode_attention",)),
    ("SpeCache attention, one op", ("specache::step_attention",)),
    (
        "low-bit read",
        ("specache::lowbit_partial_attention", "specache::lowbit_partial_attention_int8"),
    ),
    ("16-bit pairs and merge", ("specache::merge_segments", "aten::bmm")),
    ("choice and top-k", ("aten::topk", "specache::top_positions")),
    ("gather", ("aten::gather", "aten::index", "aten::index_select")),
]


def part_of(name: str) -> str:
    # an aten op as the C++ wrapper calls it: aoti_torch_cpu_bmm_out
    if name.startswith("aoti_torch_cpu_"):
        name = "aten::" + name.removeprefix("aoti_torch_cpu_").removesuffix("_out")
    for part, names in PARTS:
        if name in names:
            return part
    if name.startswith("graph_") and "cpp_fused" in name:
        return "other compiled kernels"
    if name.startswith("aten::") or name.startswith("specache::"):
        return "other ops"
    return ""  # wrappers (compiled regions, graph calls): their own time is dispatch


def profile(runner: Runner, method: str, prompt: list[int], prefilled, steps: int) -> dict:
    runner.decode(method, prompt, prefilled, 4)  # compiles
    step = step_ms(runner, method, prompt, prefilled, steps)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def start_at_first_token(tokens) -> None:  # the prompt's ingestion and the bootstrap stay out
        if prof.profiler is None:
            prof.start()

    runner.decode(method, prompt, prefilled, steps + 1, callback=start_at_first_token)
    prof.stop()
    parts = dict.fromkeys([p for p, _ in PARTS] + ["other compiled kernels", "other ops"], 0.0)
    for event in prof.key_averages():
        part = part_of(event.key)
        if part:
            parts[part] += event.self_cpu_time_total / 1e3 / steps  # ms per step
    parts["dispatch"] = max(0.0, step - sum(parts.values()))
    return dict(step=step, **parts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument(
        "--methods", nargs="+", type=method_argument, default=["full-16bit", "specache-1bit"]
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--compile_per_block", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=None, help="also write profile.md and profile.json here"
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    inductor_config.cpp.enable_kernel_profile = (
        True  # inductor's loops appear in the profile by name
    )
    checkpoint = args.checkpoint or prepare_default_checkpoint()
    model = load_model(checkpoint, torch.device("cpu"), torch.float32)
    runner = Runner(
        model,
        get_tokenizer(checkpoint.parent),
        args.methods,
        compile=True,
        round_capacity=False,
        whole_step=not args.compile_per_block,
    )
    rows = []
    for length in args.lengths:
        prompt = prompt_of_length(length, model.config.vocab_size)
        prefilled = runner.prefill(prompt, args.steps + 8)
        rows += [
            dict(
                length=length,
                method=method,
                **profile(runner, method, prompt, prefilled, args.steps),
            )
            for method in args.methods
        ]
    names = [n for n in rows[0] if n not in ("length", "method")]
    lines = [
        f"{checkpoint.parent.name}/{checkpoint.name}, batch 1, "
        f"{'per block' if args.compile_per_block else 'whole step'} compiled, "
        f"{torch.get_num_threads()} threads; "
        "ms per step by part (torch.profiler; the step from an unprofiled run)",
        "",
        "| context | method | " + " | ".join(names) + " |",
        "|---" * (len(names) + 2) + "|",
    ]
    lines += [
        f"| {r['length']} | {r['method']} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |"
        for r in rows
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write_report(args.out, "profile", markdown, dict(rows=rows))


if __name__ == "__main__":
    main()
