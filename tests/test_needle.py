"""The needle sweep's scoring, tables and heatmaps, driven by a fake runner (no model)."""

import argparse
import json
import types

import pytest

from scripts.eval.harness import SweepLog
from scripts.eval.haystack import NEEDLE
from scripts.eval.needle import coverage_plot, heatmap, rouge1_recall, sweep, tables


def test_rouge1_recall_of_the_needle():
    assert rouge1_recall(NEEDLE) == 1.0
    assert rouge1_recall("") == 0.0
    # The needle has 21 tokens after ROUGE's lowercasing and splitting ("in" and "a" twice); this
    # reply covers "the best thing to do in san francisco is" and one "a": 10 of them.
    assert rouge1_recall(
        "The best thing to do in San Francisco is to start a startup."
    ) == pytest.approx(10 / 21)


class FakeRunner:
    """Answers right only at depth 0, and only for `good`; the prompt itself is real."""

    methods = ["full", "good", "bad"]
    chat = True

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def run(self, prompt, max_new_tokens):
        self.calls += 1
        depth0 = self.calls % 2 == 1  # cells come length-major, depths [0, 100]

        def reply(right):
            return NEEDLE.strip() if right else "I do not know."

        stats = dict(
            fast_tier_ratio_to_16bit_cache=0.14,
            speculative_match_rate=0.5,
            bytes_fetched_per_token=2000.0,
            diagnostics=dict(
                coverage=0.8,
                oracle_coverage=0.9,
                recall_own_lowbit=0.25,
                recall_exact=0.5,
                per_layer=dict(coverage=[0.7, 0.9], oracle_coverage=[0.8, 1.0]),
            ),
        )
        return {
            "full": types.SimpleNamespace(text=reply(True), fast_tier_bytes=None, stats={}),
            "good": types.SimpleNamespace(text=reply(depth0), fast_tier_bytes=10, stats=stats),
            "bad": types.SimpleNamespace(text=reply(False), fast_tier_bytes=10, stats=stats),
        }


def test_sweep_tables_and_heatmaps(tmp_path):
    from checkpoint import prepare_default_checkpoint
    from tokenizer import get_tokenizer

    runner = FakeRunner(get_tokenizer(prepare_default_checkpoint().parent))
    rows = sweep(runner, [300, 600], [0, 100], new_tokens=8)
    assert runner.calls == 4 and len(rows) == 12
    assert all(abs(r["prompt_tokens"] - r["length"]) < 120 for r in rows)
    table = tables(rows, runner.methods, [300, 600], [0, 100]).splitlines()
    assert table[2] == "| full | 1 | 2/2 | 2/2 | 4/4 | 1.00 | - | - | - | - | - | - |"
    # 2 cells at 1, 2 at 1/21 ("do"); then the selection statistics
    assert table[3] == "| good | 0.140 | 1/2 | 1/2 | 2/4 | 0.52 | 50% | 2 | 80% | 90% | 25% | 50% |"
    assert table[4] == "| bad | 0.140 | 0/2 | 0/2 | 0/4 | 0.05 | 50% | 2 | 80% | 90% | 25% | 50% |"
    heatmap(rows, "good", [300, 600], [0, 100], tmp_path / "good.png")
    assert (tmp_path / "good.png").read_bytes()[:4] == b"\x89PNG"
    coverage_plot(rows, runner.methods, tmp_path / "coverage.png")
    assert (tmp_path / "coverage.png").read_bytes()[:4] == b"\x89PNG"


def test_a_stopped_sweep_resumes_with_the_cells_it_had_not_finished(tmp_path):
    from checkpoint import prepare_default_checkpoint
    from tokenizer import get_tokenizer

    tokenizer = get_tokenizer(prepare_default_checkpoint().parent)
    args = argparse.Namespace(out=tmp_path, resume=False, topk=64, lengths=[300, 600])
    grid = ([300, 600], [0, 100], 8)
    whole = sweep(FakeRunner(tokenizer), *grid, SweepLog(args, "needle", grid=("lengths",)))
    log_file = tmp_path / "needle.partial.jsonl"
    settings, *cells = log_file.read_text().splitlines()
    assert json.loads(settings) == dict(topk=64) and len(cells) == 4
    # Stopped while writing its third cell: the log holds two, then a line cut short.
    log_file.write_text(f"{settings}\n{cells[0]}\n{cells[1]}\n{cells[2][:40]}")

    args.resume = True
    runner = FakeRunner(tokenizer)
    resumed = sweep(runner, *grid, SweepLog(args, "needle", grid=("lengths",)))
    assert runner.calls == 2
    assert resumed == json.loads(json.dumps(whole))
    assert len(log_file.read_text().splitlines()) == 5  # the cut line gone, both new cells in

    args.topk = 32
    with pytest.raises(SystemExit, match=r"other settings \(topk\)"):
        SweepLog(args, "needle", grid=("lengths",))


def test_completion_prompts_end_where_the_answer_starts():
    from checkpoint import prepare_default_checkpoint
    from scripts.eval.haystack import ANSWER_PREFIX, needle_prompt
    from tokenizer import get_tokenizer

    tokenizer = get_tokenizer(prepare_default_checkpoint().parent)
    prompt = needle_prompt(tokenizer, 500, 50, chat=False)
    text = tokenizer.decode(prompt)
    assert text.endswith("Answer: " + ANSWER_PREFIX) and "<|im_start|>" not in text
    assert NEEDLE.strip() in text
