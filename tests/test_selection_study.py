"""scripts/eval/selection_study.py: the decode it records is the one the full cache attended over,
and its per-step figures behave as their definitions say."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from scripts.eval.harness import Runner
from scripts.eval.ruler import make_sample
from scripts.eval.selection_study import (
    CHOICES,
    copy_values_packed,
    hadamard,
    one_bit_copy,
    per_layer_k,
    record_decode,
    step_figures,
)
from scripts.eval.sparse_study import group_means, sparse_choice, sparse_figures
from specache.ops import lowbit_softmax
from specache.sparse import kept_positions, sparse_value_mix, value_means
from tokenizer import get_tokenizer


def random_step(seed: int, n_kv: int = 2, groups: int = 3, n: int = 300, d: int = 32):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_kv, groups, d, generator=generator) * 0.6
    keys = torch.randn(n_kv, n, d, generator=generator)
    keys[:, 100:103] += 3 * rows[:, 0, None]  # a few positions the rows attend to strongly
    values = torch.randn(n_kv, n, d, generator=generator)
    return rows, keys, values


def test_figures_follow_their_definitions():
    rows, keys, values = random_step(0)
    quantized_len = 256
    copy = one_bit_copy(keys[:, :quantized_len], values[:, :quantized_len], "lloyd", 64, torch.half)
    figures = step_figures(rows, keys, values, copy, quantized_len, 4, topk=16)
    assert set(figures) == set(CHOICES)
    kivi, ranked, shortlisted, oracle = (
        figures[c] for c in ("kivi", "copy", "shortlist", "exact top-k (oracle)")
    )
    # fetching helps; the exact keys' second look helps more; the exact top-k covers the most
    # exact attention k positions can
    assert oracle[1] >= shortlisted[1] > ranked[1] > kivi[1] and ranked[0] < kivi[0]
    # a shortlist of k is the copy's own top-k
    short = step_figures(rows, keys, values, copy, quantized_len, 4, topk=16, shortlist=1)
    assert short["shortlist"] == short["copy"]
    # kivi, spelled out: the copy below quantized_len but the sinks, one softmax, per query head
    mixed_k = torch.cat([keys[:, :4], copy[0][:, 4:quantized_len], keys[:, quantized_len:]], 1)
    mixed_v = torch.cat([values[:, :4], copy[1][:, 4:quantized_len], values[:, quantized_len:]], 1)
    out = F.scaled_dot_product_attention(rows, mixed_k, mixed_v, scale=1.0)
    exact = F.scaled_dot_product_attention(rows, keys, values, scale=1.0)
    error = ((out - exact).norm(dim=-1) / exact.norm(dim=-1)).mean()
    assert kivi[0] == pytest.approx(float(error), rel=1e-4)
    # a k that reaches every quantized position reads everything exactly
    everything = step_figures(rows, keys, values, copy, quantized_len, 4, topk=quantized_len)
    for choice in CHOICES[1:]:
        assert everything[choice][0] == pytest.approx(0.0, abs=1e-5)
        assert everything[choice][1] == pytest.approx(1.0, abs=1e-5)
    # the outliers are read beside the k picks, never instead of them
    assert figures["copy + outliers"][1] >= ranked[1]
    assert figures["shortlist + outliers"][1] >= shortlisted[1]
    none = step_figures(rows, keys, values, copy, quantized_len, 4, topk=16, outlier_share=0.0)
    assert none["copy + outliers"] == none["copy"]
    assert none["shortlist + outliers"] == none["shortlist"]
    # the error bound's shortlist of k is the bound's own top-k
    assert short["shortlist by error bound"] == short["error bound"]
    # an exact copy leaves nothing to correct
    exact_copy = (keys[:, :quantized_len], values[:, :quantized_len])
    for error, _ in step_figures(rows, keys, values, exact_copy, quantized_len, 4, 16).values():
        assert error == pytest.approx(0.0, abs=1e-5)


def test_sparse_choices_follow_the_shortlist_and_the_pass():
    rows, keys, values = random_step(0)
    quantized_len, taus = 256, (0.0, 2.0, 4.0, 8.0, 1000.0)
    copy = one_bit_copy(keys[:, :quantized_len], values[:, :quantized_len], "lloyd", 64, torch.half)
    packed = copy_values_packed(values[:, :quantized_len], "lloyd", 64, torch.half)
    means = group_means(packed, 64)
    figures = step_figures(rows, keys, values, copy, quantized_len, 4, 16, taus=taus, means=means)
    assert set(figures) == set(CHOICES) | {sparse_choice(tau) for tau in taus}
    shortlisted = figures["shortlist"]
    sparse = [figures[sparse_choice(tau)] for tau in taus]
    # the same exact reads; tau -> inf keeps every low-bit value: the shortlist itself
    assert all(coverage == shortlisted[1] for _, coverage, _, _ in sparse)
    assert sparse[-1][0] == pytest.approx(shortlisted[0], rel=1e-6)
    assert sparse[-1][2:] == (1.0, 0.0)
    # tau = 0 keeps only each row's largest: means elsewhere cost error; more kept as tau grows
    assert sparse[0][0] > shortlisted[0]
    kept, skipped = [f[2] for f in sparse], [f[3] for f in sparse]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    assert skipped == sorted(skipped, reverse=True) and skipped[0] > 0
    # without taus, the figures are the study's own
    assert step_figures(rows, keys, values, copy, quantized_len, 4, 16) == {
        choice: figures[choice] for choice in CHOICES
    }


def test_sparse_mix_is_the_pass_mix_on_the_float_scores():
    """The study's sparse mix, spelled out with the pass's own pieces (specache/ops.py and
    sparse.py) on the copy's float scores: its weights over the low-bit segment, the positions
    kept, and the mix of their values with the group means."""
    rows, keys, values = random_step(1)
    n_kv, n, q, tau = keys.shape[0], keys.shape[1], 256, 4.0
    read = torch.zeros(n_kv, n, dtype=torch.bool)
    read[:, :4] = read[:, q:] = True
    read[:, torch.randperm(q - 4, generator=torch.Generator().manual_seed(1))[:16] + 4] = True
    k_copy, v_copy = one_bit_copy(keys[:, :q], values[:, :q], "lloyd", 64, torch.half)
    packed = copy_values_packed(values[:, :q], "lloyd", 64, torch.half)
    exact_scores = rows @ keys.transpose(-1, -2)
    copy_scores = torch.cat([rows @ k_copy.transpose(-1, -2), exact_scores[..., q:]], -1)
    copy_values = torch.cat([v_copy, values[:, q:]], 1)
    scores = torch.where(read[:, None], exact_scores, copy_scores)
    mixed_values = torch.where(read[..., None], values, copy_values)
    means = torch.cat([group_means(packed, 64), values[:, q:]], 1)
    exact_out = exact_scores.softmax(-1) @ values
    (error, kept, skipped), *_ = sparse_figures(
        scores, copy_scores, mixed_values, means, read, exact_out, [tau]
    ).values()
    # the pass: the low-bit segment [0, q) less the positions read exactly
    excluded_pos = torch.arange(q).expand(1, n_kv, q)
    excluded = read[None, :, :q]  # an entry per position, valid where it is read exactly
    weights, _ = lowbit_softmax(
        copy_scores[None, ..., :q], torch.tensor([q]), excluded_pos, excluded
    )
    pass_kept = kept_positions(weights, math.exp(-tau))[0]
    p = scores.softmax(-1)
    v_mean = value_means(*packed, 1, 64)
    lowbit = torch.where(read[:, None, :q], 0.0, p[..., :q])
    out = (p * read[:, None]) @ values + sparse_value_mix(
        lowbit[None], pass_kept[None], *(x[None] for x in packed), v_mean[None], 1, 64
    )[0]
    pass_error = ((out - exact_out).norm(dim=-1) / exact_out.norm(dim=-1)).mean()
    assert error == pytest.approx(float(pass_error), rel=1e-5)
    unread = ~read[:, :q]
    assert kept == pytest.approx(float(pass_kept.sum() / unread.sum())) and 0 < kept < 1
    assert skipped == pytest.approx(float((lowbit * (unread & ~pass_kept)[:, None]).sum(-1).mean()))


def test_recorded_decode_reproduces_what_each_layer_attended(smollm2_model, smollm2_checkpoint):
    """The recorded queries over the recorded K and V give each step's attention output as the
    full cache computed it (positions, heads and the prompt's K/V all aligned)."""
    model = smollm2_model
    runner = Runner(model, get_tokenizer(smollm2_checkpoint.parent), ["full"])
    prompt, _, _ = make_sample("niah_single_1", runner.tokenizer, 400, random.Random("test"))
    outputs = {}

    def keep_output(i):
        def hook(module, args, out):
            if args[0].shape[2] == 1:
                outputs.setdefault(i, []).append(out[0, :, 0].float())

        return hook

    recorded = record_decode_with_outputs(runner, prompt, keep_output, [])
    assert [r.layer for r in recorded] == list(range(len(model.layers)))
    for rec in recorded:
        steps, n_heads, head_dim = rec.queries.shape
        assert steps >= 2 and rec.keys.shape[1] == len(prompt) + steps
        n_kv = rec.keys.shape[0]
        for step in (0, steps - 1):
            visible = len(prompt) + step + 1
            q = rec.queries[step].view(n_kv, -1, head_dim)
            out = F.scaled_dot_product_attention(
                q, rec.keys[:, :visible], rec.values[:, :visible]
            ).reshape(n_heads, head_dim)
            torch.testing.assert_close(out, outputs[rec.layer][step], rtol=1e-3, atol=1e-4)


def record_decode_with_outputs(runner, prompt, keep_output, handles):
    """record_decode, with each full cache's outputs kept too (hooks placed once the caches are)."""
    model = runner.model
    original = runner.decode

    def decode(method, prompt, prefilled, max_new_tokens, callback):
        def first(token):
            if not handles:
                for i, layer in enumerate(model.layers):
                    handles.append(layer.attention.kv_cache.register_forward_hook(keep_output(i)))
            callback(token)

        return original(method, prompt, prefilled, max_new_tokens, callback=first)

    runner.decode = decode
    try:
        return record_decode(runner, prompt, 8)
    finally:
        for handle in handles:
            handle.remove()


def test_hadamard_copy_rotates_the_keys_quantizes_and_rotates_back():
    h = hadamard(32)
    torch.testing.assert_close(h @ h, torch.eye(32))
    # Keys whose rotation holds two values per channel in each group of 64 tokens: Lloyd's 1-bit
    # levels hold the rotated keys exactly, so the copy rotated back is the keys themselves,
    # while the copy of the unrotated keys is not.
    generator = torch.Generator().manual_seed(0)
    low, high = torch.randn(2, 2, 2, 1, 32, generator=generator)  # (Hkv, groups, 1, D) each
    upper = torch.rand(2, 2, 64, 32, generator=generator) < 0.5
    rotated = torch.where(upper, high, low).reshape(2, 128, 32).half().float()
    keys = rotated @ h
    values = torch.randn(2, 128, 32, generator=generator)
    k_copy, _ = one_bit_copy(keys, values, "hadamard", 64, torch.float32)
    torch.testing.assert_close(k_copy, keys, rtol=1e-4, atol=1e-4)
    plain, _ = one_bit_copy(keys, values, "lloyd", 64, torch.float32)
    assert (plain - keys).abs().max() > 0.1


def test_per_layer_k_moves_pairs_to_the_layer_that_gains_most():
    # layer 0 gains much from k = 128, layers 1 and 2 lose little at 32; two samples each
    errors = {0: {32: 0.5, 64: 0.4, 128: 0.1}, 1: {32: 0.2, 64: 0.19, 128: 0.18}}
    errors[2] = errors[1]
    layers = [0, 1, 2, 0, 1, 2]
    results = {
        "lloyd": {
            str(k): [{"copy": (errors[layer][k], 0.0)} for layer in layers] for k in (32, 64, 128)
        }
    }
    uniform, split_error, split = per_layer_k(results, layers, [32, 64, 128], "lloyd", "copy")
    assert uniform == pytest.approx((0.4 + 0.19 + 0.19) / 3)
    assert split == {0: 128, 1: 32, 2: 32}  # the same 192 pairs in all
    assert split_error == pytest.approx((0.1 + 0.2 + 0.2) / 3)
