"""The benchmarks' parts that decide figures: bench.py's largest-batch search and report tables,
bench_batch_step.py's timings, the mixed load's report (bench_batching.py), all in
scripts/bench/."""

import pytest

from conftest import tiny_model
from scripts.bench.bench import (
    NoTokenizer,
    largest_batch,
    max_batch,
    max_batch_table,
    release_caches,
    table,
)
from scripts.bench.bench_batch_step import engine_step_seconds, one_cache_step_seconds
from scripts.bench.bench_batching import mixed_report
from scripts.eval.harness import Runner


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 7, 8, 9, 40, 64, 100])
def test_largest_batch_finds_the_limit_in_few_tries(limit):
    tried = []

    def fits(batch):
        tried.append(batch)
        return batch <= limit

    assert largest_batch(fits, cap=64) == min(limit, 64)
    assert len(tried) <= 2 * 7 + 1 and max(tried) <= 64


def test_max_batch_stops_where_memory_runs_out(monkeypatch):
    runner = Runner(tiny_model(), NoTokenizer(), ["full"])
    prompt = list(range(40))
    prefilled = runner.prefill(prompt, 4)
    real_decode = runner.decode

    def decode(method, prompt, prefilled, new_tokens, batch_size=1, overlap_fetch=True):
        if batch_size > 5:
            raise RuntimeError(
                "DefaultCPUAllocator: not enough memory: you tried to allocate... out of memory"
            )
        return real_decode(method, prompt, prefilled, new_tokens, batch_size, overlap_fetch)

    monkeypatch.setattr(runner, "decode", decode)
    assert max_batch(runner, "full", prompt, prefilled, cap=16) == 5
    assert all(layer.attention.kv_cache is None for layer in runner.model.layers)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a lack of memory")

    monkeypatch.setattr(runner, "decode", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        max_batch(runner, "full", prompt, prefilled, cap=16)
    release_caches(runner.model)


def test_tables_give_ratios_to_the_fastest_full_cache_and_llama_cpp_of_the_same_run():
    row = dict(prefill=1.0, gbps=10.0, bandwidth=20.0, fast=None, slow=None)
    rows = [
        dict(row, length=1024, batch=1, method="full", ms_per_step=50.0, tok_s=20.0, compile=30.0),
        dict(row, length=1024, batch=1, method="full-16bit", ms_per_step=40.0, tok_s=25.0),
        dict(
            row,
            length=1024,
            batch=1,
            method="specache-1bit",
            ms_per_step=40.0,
            tok_s=30.0,
            fast=2e6,
            slow=9e6,
            fetched=1.5e6,
            discarded=0.125,
            compile=120.0,
        ),
        dict(row, length=1024, batch=1, method="llama.cpp, f16 KV", ms_per_step=20.0, tok_s=50.0),
        dict(row, length=1024, batch=4, method="specache-1bit", ms_per_step=40.0, tok_s=100.0),
    ]
    text = table(rows, "title")
    # over full-16bit, the faster full cache
    assert (
        "| 1024 | 1 | specache-1bit | 1.0 | 120 | 40.0 | 30.0 | 10.0 | 50% | 2.0 | 9.0 | 1500 | "
        "12% | 1.20x | 0.60x |" in text
    )
    assert (
        "| 1024 | 1 | full | 1.0 | 30 | 50.0 | 20.0 | 10.0 | 50% | - | - | - | - | 0.80x | 0.40x |"
        in text
    )
    assert (
        "| 1024 | 4 | specache-1bit | 1.0 | - | 40.0 | 100.0 | 10.0 | 50% | - | - | - | - | - | - |"
        in text
    )
    largest = [
        dict(length=32768, method="full", batch=3, tok_s=10.0),
        dict(length=32768, method="specache-1bit", batch=36, tok_s=47.0),
    ]
    assert "| 32768 | specache-1bit | 36 | 47.0 | 4.70x |" in max_batch_table(largest, 64)


def test_profile_parts_name_the_kernels_and_leave_wrappers_to_dispatch():
    from scripts.bench.profile_step import part_of

    assert part_of("gptfast::quantized_linear") == "weights"
    assert part_of("gptfast::dense_decode_attention") == "full-cache attention"
    assert part_of("specache::lowbit_partial_attention") == "low-bit read"
    assert part_of("specache::top_positions") == "choice and top-k" == part_of("aten::topk")
    assert part_of("aten::gather") == "gather"
    assert part_of("graph_0_cpp_fused_add_mean_mul_pow_rsqrt_view_10") == "other compiled kernels"
    assert part_of("specache::merge_segments") == "16-bit pairs and merge"
    # aten::bmm as the C++ wrapper calls it: aoti_torch_cpu_bmm_out
    assert part_of("aten::bmm") == "16-bit pairs and merge" == part_of("aoti_torch_cpu_bmm_out")
    assert part_of("aten::mul") == "other ops"
    assert part_of("aoti_torch_cpu_gather_out") == "gather"
    assert part_of("Torch-Compiled Region: 0/0") == "" and part_of("TorchDynamo Cache Lookup") == ""


@pytest.mark.parametrize("method", ["full", "specache-1bit"])
def test_bench_batch_step_times_steps_of_the_whole_batch(method):
    """Its two timings run to the end on a tiny model (the engine's jobs fit their capacity and
    all decode before its window opens) and give a time per step."""
    model = tiny_model()
    prompts = [[1 + (i * 7 + j) % 90 for j in range(40)] for i in range(3)]
    for timing in (engine_step_seconds, one_cache_step_seconds):
        seconds = timing(model, method, prompts, 128, 4)
        assert 0 < seconds < 10


def test_the_mixed_load_report_gives_ratios_over_the_static_run_and_at_a_full_batch():
    """Continuous over static of the same method and run; at a full batch, the continuous run's
    wall-clock less what its decode-only passes would not have taken with 8 sequences each: 40 s
    of them at 6 sequences a step, 10 s less, 80 -> 70 s."""
    figures = dict(short_ttft_median_s=1.0, long_ttft_median_s=2.0, prompt_pass_share=0.5)
    rows = [
        dict(method="m", run=1, batching="static", wall_s=100.0, tokens_per_s=10.0, **figures),
        dict(method="m", run=1, batching="static", wall_s=50.0, tokens_per_s=20.0, **figures),
        dict(method="m", run=1, batching="continuous", wall_s=80.0, tokens_per_s=12.5, **figures),
    ]
    rows[1]["run"] = 2  # another run's static: not this continuous run's baseline
    for row, steps in zip(rows, (3.0, 3.0, 6.0)):
        row.update(sequences_per_step=steps, decode_only_s=40.0)
    report = mixed_report(rows, "header", ["m"], repeats=1)
    continuous = rows[2]
    assert continuous["tokens_per_s_ratio"] == pytest.approx(1.25)
    assert continuous["full_batch_ratio"] == pytest.approx(1.25 * 80 / 70)
    assert "| m | 1 | continuous | 80.0 | 12.5 |" in report and "| 1.43x |" in report
