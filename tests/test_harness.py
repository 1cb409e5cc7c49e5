"""The evaluation harness: one prefill branched into each cache gives what each cache gives
alone."""

import json
import types

import pytest
import torch

from conftest import tiny_model
from caches.by_name import NAMED_METHODS, make_cache, parse_method, specache_config
from caches.full import FullCache
from caches.eviction import EvictionCache, EvictionConfig
from generation import generate
from scripts.eval.harness import Runner, write_report

TOPK = 16


@pytest.mark.parametrize("layout", ["llama", "hybrid"])
def test_shared_prefill_gives_each_method_its_own_generation(layout):
    """Hybrid: the recorded prefill runs each sliding-window layer's own windowed attention, and
    every method's rings take the prompt from the record."""
    from test_specache import HYBRID

    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    tokenizer = types.SimpleNamespace(stop_ids=[5], decode=lambda ids: " ".join(map(str, ids)))
    prompt = torch.randint(0, 97, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    new, capacity = 16, 316
    methods = list(NAMED_METHODS) + ["specache-1bit:paper", "kivi-1bit:lloyd"]
    runner = Runner(model, tokenizer, methods, topk=TOPK)
    shared = runner.run(prompt, new)

    stop = frozenset([5])
    for method in methods:
        if method in ("full", "full-16bit"):
            cache = FullCache(model, 1, capacity, sixteen_bit=method == "full-16bit")
        elif method in ("streaming", "h2o"):
            cache = EvictionCache(
                model, 1, capacity, EvictionConfig(method, runner.budget(capacity))
            )
        else:
            kind, bits, select = parse_method(method)
            cache = make_cache(method, model, 1, capacity, topk=TOPK)
        alone = generate(model, cache, [prompt], new, stop_ids=stop)
        assert shared[method].tokens == alone.tokens[0], method
        assert shared[method].text == " ".join(str(t) for t in alone.tokens[0] if t != 5)
    assert shared["full"].fast_tier_bytes is None
    assert shared["streaming"].fast_tier_bytes <= shared["specache-1bit"].fast_tier_bytes
    # The methods differ, so the comparison above can tell them apart.
    assert len({tuple(out.tokens) for out in shared.values()}) > 3


def test_write_report(tmp_path):
    write_report(tmp_path, "x", "| a |\n|---|\n| 1 |", dict(rows=[1, 2]))
    assert "| a |" in (tmp_path / "x.md").read_text()
    raw = json.loads((tmp_path / "x.json").read_text())
    assert raw["rows"] == [1, 2] and raw["command"].startswith("python ")


def test_batched_copies_change_nothing():
    model = tiny_model()
    tokenizer = types.SimpleNamespace(stop_ids=[], decode=lambda ids: "")
    prompt = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = Runner(model, tokenizer, ["full", "specache-1bit", "h2o"], topk=TOPK)
    prefilled = runner.prefill(prompt, 12)
    for method in runner.methods:
        alone = runner.decode(method, prompt, prefilled, 12).tokens[0]
        assert runner.decode(method, prompt, prefilled, 12, batch_size=3).tokens == [alone] * 3, (
            method
        )


def test_prompt_format_auto_picks_chat_for_chat_tuned_names_only():
    from scripts.eval.harness import wants_chat

    assert wants_chat("auto", "SmolLM2-135M-Instruct") and wants_chat("auto", "gemma-3-1b-it")
    assert not wants_chat("auto", "gemma-3-270m") and not wants_chat("auto", "Meta-Llama-3-8B")
    assert wants_chat("chat", "gemma-3-270m") and not wants_chat(
        "completion", "SmolLM2-135M-Instruct"
    )


def test_method_names_carry_a_selection():
    def config(method):
        return specache_config(*parse_method(method), topk=64)

    paper, oracle = config("specache-1bit:paper")
    assert oracle is None and paper.method.speculative
    assert (paper.selection.real_share, paper.selection.gqa, paper.selection.levels) == (
        0.0,
        "mean",
        "minmax",
    )
    assert config("specache-1bit") == config("specache-1bit:default")
    kivi, _ = config("kivi-2bit")
    assert (kivi.method.topk, kivi.method.bits, kivi.selection.name()) == (0, 2, "paper")
    nospec, _ = config("specache-nospec-1bit:split,sinks=8")
    assert (nospec.method.speculative, nospec.selection.real_share, nospec.selection.sinks) == (
        False,
        0.5,
        8,
    )
    # an oracle: diagnostics that choose all k within the step, on top of the selection named with
    # it
    mass, oracle = config("specache-1bit:oracle=mass,sinks=2")
    assert oracle == "mass" and (mass.selection.real_share, mass.selection.sinks) == (1.0, 2)
    assert config("specache-1bit:oracle")[1] == "error"
    for bad, message in [
        ("full:paper", "unknown method"),
        ("specache-3bit", "unknown method"),
        ("specache-1bit:sideways", "unknown --specache_select entry"),
        ("specache-1bit:oracle=maybe", "oracle must be error or mass"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad)
