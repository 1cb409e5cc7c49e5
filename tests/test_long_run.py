"""scripts/eval/long_run.py: the drift and memory checks, shortened."""

import types

import torch

from conftest import tiny_model
from scripts.eval.harness import Runner
from scripts.eval.long_run import (
    distinct_ngrams,
    drift,
    first_difference,
    full_cache_choices,
    memory,
    windows,
)

STUB = types.SimpleNamespace(stop_ids=[], decode=lambda ids: " ".join(map(str, ids)))


def test_helpers():
    assert windows(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert distinct_ngrams([1, 2, 3, 4, 5]) == 1.0
    assert distinct_ngrams([7, 8] * 20) == 2 / 37
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 3]) == 2


def test_full_cache_choices_are_what_greedy_decoding_picks():
    model = tiny_model()
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    from caches.full import FullCache
    from generation import generate

    generated = generate(model, FullCache(model, 1, 50), [prompt], 20, temperature=0).tokens[0]
    assert full_cache_choices(model, prompt, generated) == generated


def test_shortened_drift_run_on_the_real_model(smollm2_checkpoint):
    from checkpoint import load_model
    from scripts.eval.haystack import haystack_tokens
    from tokenizer import get_tokenizer

    model = load_model(smollm2_checkpoint, torch.device("cpu"), torch.float32)
    tokenizer = get_tokenizer(smollm2_checkpoint.parent)
    runner = Runner(model, tokenizer, ["full", "specache-2bit", "specache-1bit"])
    markdown, raw = drift(runner, haystack_tokens(tokenizer, 400), 60, 20)
    rows = raw["rows"]
    assert len(rows["full"]["agreement"]) == 3 and "| 40-60 |" in markdown
    # the floor numerics set: a broken comparison would not reach it
    assert min(rows["full"]["agreement"]) >= 0.95
    assert sum(rows["specache-2bit"]["agreement"]) / 3 >= 0.8
    assert all(len(tokens) == 60 for tokens in raw["tokens"].values())
    assert rows["full"]["leaves_full_at"] == 60


def test_memory_stays_flat_over_repeated_generations():
    runner = Runner(tiny_model(), STUB, ["full", "specache-1bit"])
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    _, raw = memory(runner, prompt, 16, 6)
    rows = [r for r in raw["rows"] if r["method"] == "specache-1bit"]
    assert len({r["fast"] for r in rows}) == 1 and all(r["tokens"] == 16 for r in rows)
    settled = [r["rss"] for r in raw["rows"][4:]]  # after two runs of allocator warm-up
    assert max(settled) - min(settled) < 30e6, settled
