"""The sparse pass's definition (specache/sparse.py, `lowbit_partial_attention_sparse_reference`)
against plain loops over positions, and the layer's mean values against the copy they average.
The C kernel is held to this definition in test_lowbit_sparse_cpu.py."""

import math

import pytest
import torch

import specache
from conftest import specache_config, tiny_model
from test_specache import prompts_of, run_specache
from specache.config import fast_tier_layout
from specache.lowbit import dequantize_values, quantize_keys, quantize_values
from specache.ops import (
    lowbit_partial_attention_int8_reference,
    lowbit_partial_attention_sparse_reference,
)
from specache.sparse import value_means

BITS, GROUP = 1, 16


def copy_of(t: int, seed: int = 0, d: int = 32, heads: int = 2):
    """A low-bit copy of t random positions (two sequences), its mean values, and rows whose
    attention is peaked: a few keys point along the rows."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, heads, t, d, generator=g)
    rows = torch.randn(2, heads, 4, d, generator=g)
    heavy = torch.randint(0, t, (6,), generator=g)
    keys[:, :, heavy] += 3 * rows[:, :, :1]
    values = torch.randn(2, heads, t, d, generator=g)
    padded = torch.nn.functional.pad(keys, (0, 0, 0, -t % GROUP))
    k_packed, k_scale, k_zero = quantize_keys(padded, BITS, GROUP, torch.float16, "lloyd")
    v_copy = quantize_values(values, BITS, GROUP, torch.float16, "lloyd")
    v_mean = value_means(*v_copy, BITS, GROUP)
    return 4 * rows * d**-0.5, (k_packed[:, :, :t], k_scale, k_zero, *v_copy), v_mean


def visible_all(t: int, heads: int = 2):
    excluded = torch.tensor([[[3, 5]] * heads, [[0, 1]] * heads])
    return torch.tensor([t, t - 7]), excluded, torch.tensor([[[True, False]] * heads] * 2)


def test_value_means_are_the_mean_of_each_groups_dequantized_values():
    _, copy, v_mean = copy_of(40)  # 40 = 2 groups of 16 and a last group of 8
    values = dequantize_values(*copy[3:], BITS, GROUP)
    for j, (first, last) in enumerate([(0, 16), (16, 32), (32, 40)]):
        expected = values[:, :, first:last].mean(2).to(torch.float16)
        torch.testing.assert_close(v_mean[:, :, j], expected, atol=1e-3, rtol=0)


def loop_sparse_mix(weights, kept, values, v_mean):
    """The sparse mix, position by position."""
    b, h, m, t = weights.shape
    out = torch.zeros(b, h, m, values.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for p in range(t):
                value = values[bi, hi, p] if kept[bi, hi, p] else v_mean[bi, hi, p // GROUP]
                out[bi, hi] += weights[bi, hi, :, p, None].double() * value.double()
    return out.float()


@pytest.mark.parametrize("tau", [0.0, 3.0, 8.0, math.inf])
def test_the_sparse_pass_mixes_kept_values_and_group_means(tau):
    t = 72
    rows, copy, v_mean = copy_of(t)
    visible = visible_all(t)
    part = lowbit_partial_attention_sparse_reference(
        rows, *copy, v_mean, BITS, GROUP, math.exp(-tau), *visible
    )
    dense = lowbit_partial_attention_int8_reference(rows, *copy, BITS, GROUP, *visible)
    # the integer pass's scores and softmax: weights, maxima and sums unchanged
    for a, b in zip(part[:3], dense[:3]):
        assert torch.equal(a, b)
    seen = part.weights > 0
    expected_kept = (seen & (part.weights >= math.exp(-tau))).any(2)
    assert torch.equal(part.kept, expected_kept)
    if tau == math.inf:
        assert torch.equal(part.kept, seen.any(2))
    if tau == 0.0:  # only each row's largest weight (1) is kept
        assert part.kept.sum() < 2 * 2 * 4 + 1
    if tau == 3.0:  # the heavy keys are kept, most others not
        assert 0 < part.kept[seen.any(2)].float().mean() < 0.6
    values = dequantize_values(*copy[3:], BITS, GROUP)
    expected = loop_sparse_mix(part.weights, part.kept, values, v_mean.float())
    torch.testing.assert_close(part.out, expected, atol=1e-5, rtol=1e-5)


def test_nothing_skipped_is_the_dense_float_mix_and_the_bound_holds():
    """min_weight 0: the plain float mix of the weights. Otherwise the output moves by at most the
    skipped weight times how far a skipped value lies from its group's mean."""
    t = 96
    rows, copy, v_mean = copy_of(t, seed=1)
    visible = visible_all(t)
    values = dequantize_values(*copy[3:], BITS, GROUP)
    every = lowbit_partial_attention_sparse_reference(
        rows, *copy, v_mean, BITS, GROUP, 0.0, *visible
    )
    torch.testing.assert_close(every.out, every.weights @ values, atol=1e-5, rtol=1e-5)
    some = lowbit_partial_attention_sparse_reference(
        rows, *copy, v_mean, BITS, GROUP, math.exp(-4), *visible
    )
    skipped = torch.where(some.kept.unsqueeze(2), 0.0, some.weights)
    assert (skipped <= math.exp(-4)).all()
    means = v_mean.float().repeat_interleave(GROUP, 2)[:, :, :t]
    distance = (values - means).norm(dim=-1).amax(-1)  # (B, Hkv)
    bound = skipped.sum(-1) * distance.unsqueeze(-1)
    moved = (some.out - every.out).norm(dim=-1)
    assert (moved <= bound * (1 + 1e-5) + 1e-5).all()
    assert moved.max() > 0


def test_the_fast_tier_holds_mean_values_only_for_the_sparse_pass():
    """The float and int8 passes' buffers (and so their tokens and the equal-budget baselines)
    are unchanged; the sparse pass adds one mean value per key group."""
    kwargs = dict(
        capacity=1024, residual=64, slots=16, prefetch_slots=8, head_dim=64,
        query_heads_per_kv=3, pair_dtype=torch.float16, correcting=True,
    )  # fmt: skip
    layouts = {
        arithmetic: fast_tier_layout(specache_config("default", arithmetic=arithmetic), **kwargs)
        for arithmetic in ("float", "int8", "sparse")
    }
    assert layouts["float"] == layouts["int8"]
    assert "v_mean" not in layouts["float"]
    extra = {k: v for k, v in layouts["sparse"].items() if k not in layouts["float"]}
    assert extra == {"v_mean": (((1024 - 64) // 64, 64), torch.float16)}


def test_the_layer_keeps_each_groups_mean_through_prompt_and_flushes():
    """After a prompt and decode steps that flush groups: every quantized group's mean value is
    `value_means` of the copy as it stands (a flush that skipped the means, or wrote them to the
    wrong groups, fails)."""
    config = specache_config("default", arithmetic="sparse", tau=4.0, group=16, residual=16)
    model = tiny_model()
    run_specache(model, prompts_of(90, 75), 40, config)
    for block in model.layers:
        layer = block.attention.kv_cache
        lq = int(layer.state.quantized_len.min())
        assert lq >= 96  # the prompt's groups and at least two flushes
        copy = (layer.v_packed[:, :, :lq], layer.v_scale[:, :, :lq], layer.v_zero[:, :, :lq])
        expected = value_means(*copy, 1, 16)
        assert torch.equal(layer.v_mean[:, :, : lq // 16], expected[:, :, : lq // 16])


def test_tau_and_the_sparse_item_reach_the_method():
    from caches.by_name import specache_config as named_config

    config, _ = named_config("specache", 1, "default,sparse=5")
    assert (config.method.arithmetic, config.method.tau) == ("sparse", 5.0)
    config, _ = named_config("specache", 1, "sparse", arithmetic="float", tau=3.0)
    assert (config.method.arithmetic, config.method.tau) == ("sparse", 3.0)
    with pytest.raises(ValueError, match="tau must be a number"):
        named_config("specache", 1, "sparse=x")
    with pytest.raises(ValueError, match="tau must be >= 0"):
        specache.SpeCacheConfig(specache.Method(arithmetic="sparse", tau=-1.0)).validate(64)


def test_the_statistics_report_what_the_sparse_pass_skipped():
    """--specache_stats: the share of positions mixed by value and of the real token's attention
    given to mean values; absent where the pass is not sparse."""
    from options import cache_summary

    model = tiny_model(dim=256, n_head=4, n_local_heads=2)
    prompts = prompts_of(50, 77)
    sparse = specache_config("default", topk=8, arithmetic="sparse", tau=2.0, group=16, residual=16)
    stats = run_specache(model, prompts, 20, sparse, stats=True).stats
    diagnostics = stats["diagnostics"]
    assert 0 < diagnostics["sparse_kept"] < 0.5
    assert 0 < diagnostics["sparse_skipped_mass"] < 0.05
    assert stats["tau"] == 2.0
    assert "the sparse pass mixed" in cache_summary(stats)
    dense = specache_config("default", topk=8, group=16, residual=16)
    stats = run_specache(model, prompts, 20, dense, stats=True).stats
    assert "sparse_kept" not in stats["diagnostics"] and "tau" not in stats


def test_an_arithmetic_item_alone_leaves_the_fallback_selection_and_an_oracle_the_papers():
    """parse_select: `int8` or `sparse` alone names no selection (the fallback, ours), while an
    oracle alone is the paper's rule with the oracle's split, as before the sparse item came."""
    from caches.by_name import parse_select
    from specache import PAPER, Selection

    for item in ("int8", "sparse", "sparse=4"):
        assert parse_select(item)[0] == Selection()
    assert parse_select("sparse", fallback="paper")[0] == PAPER
    selection, arithmetic, tau, oracle = parse_select("oracle")
    assert (selection.real_share, arithmetic, tau, oracle) == (1.0, None, None, "error")
    assert selection == PAPER.__class__(**{**vars(PAPER), "real_share": 1.0})
