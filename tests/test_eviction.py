"""StreamingLLM and H2O caches: what they keep, and that what they keep is attended exactly."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from caches.full import FullCache
from caches.by_name import equal_budget_tokens
from caches.eviction import (
    EvictionCache,
    EvictionConfig,
    EvictionLayer,
    EvictionState,
    prompt_attention_mass,
)
from generation import generate
from model import CausalPrompt
from caches.plugged import PluggedSpeCache
from conftest import specache_config


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("layout", ["llama", "hybrid"])
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_budget_above_length_is_the_full_cache(policy, layout):
    """Hybrid: only the full-attention layer evicts; the sliding-window layers keep their rings."""
    from test_specache import HYBRID

    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    prompts = [prompt(40), prompt(33, seed=2)]
    full = generate(model, FullCache(model, 2, 60), prompts, 12)
    cache = EvictionCache(model, 2, 60, EvictionConfig(policy, budget=60, pair_dtype=torch.float32))
    assert generate(model, cache, prompts, 12).tokens == full.tokens


@torch.no_grad()
def streaming_reference(model, prompts, new_tokens, budget, sinks):
    """Greedy decoding with the full cache and a mask that shows each new token only what
    StreamingLLM keeps: the first `sinks` positions and the newest budget - sinks, then itself."""
    FullCache(model, len(prompts), max(map(len, prompts)) + new_tokens)
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    positions = torch.arange(tokens.shape[1]).expand(len(prompts), -1)
    token = model(
        tokens, positions, CausalPrompt(lengths), output_index=(lengths - 1)[:, None]
    ).argmax(-1)
    out, pos = [token], lengths[:, None].clone()
    kv = torch.arange(model.max_seq_length)
    for _ in range(new_tokens - 1):
        recent = budget - sinks
        visible = (kv < sinks) | ((kv >= pos - recent) & (kv <= pos))  # (B, T)
        token = model(token, pos, visible[:, None, None, :]).argmax(-1)
        out.append(token)
        pos = pos + 1
    return torch.cat(out, 1).tolist()


def test_streaming_that_evicts_equals_full_attention_masked_to_what_it_keeps():
    """Budget 24 of 60- and 45-token prompts, 30 more tokens: most positions are evicted, and
    every step attends exactly over the sinks and the newest tokens."""
    model = tiny_model()
    prompts = [prompt(60), prompt(45, seed=2)]
    expected = streaming_reference(model, prompts, 30, budget=24, sinks=4)
    cache = EvictionCache(
        model, 2, 90, EvictionConfig("streaming", budget=24, pair_dtype=torch.float32)
    )
    assert generate(model, cache, prompts, 30, temperature=0).tokens == expected
    unlimited = generate(model, FullCache(model, 2, 90), prompts, 30, temperature=0).tokens
    # the eviction changes what is generated, so the comparison can tell
    assert unlimited != expected


def test_prompt_attention_mass_is_the_column_sum_of_causal_attention():
    torch.manual_seed(0)
    q, k = torch.randn(4, 300, 16), torch.randn(2, 300, 16)
    weights = torch.softmax(
        (q.view(2, 2, 300, 16) @ k.unsqueeze(1).transpose(-1, -2)) / 4
        + torch.full((300, 300), float("-inf")).triu(1),
        -1,
    )
    torch.testing.assert_close(prompt_attention_mass(q, k, chunk=64), weights.sum((1, 2)))


def layer_with(policy: str, budget: int, n_prompt: int, mass=None) -> EvictionLayer:
    state = EvictionState(EvictionConfig(policy, budget), 1)
    state.begin([n_prompt])
    layer = EvictionLayer(state, 2, 8, torch.float32, torch.device("cpu"))
    k = (
        torch.arange(n_prompt, dtype=torch.float32)
        .view(1, 1, n_prompt, 1)
        .expand(1, 2, n_prompt, 8)
    )
    layer.ingest_prompt(k, k.clone(), mass)
    return layer


def test_streaming_keeps_sinks_and_the_newest_tokens():
    layer = layer_with("streaming", budget=10, n_prompt=30)
    assert layer.pos[0, 0].tolist() == [0, 1, 2, 3, 24, 25, 26, 27, 28, 29]
    # the pairs went with them
    assert layer.k[0, 1, :, 0].tolist() == [
        0,
        1,
        2,
        3,
        24,
        25,
        26,
        27,
        28,
        29,
    ]
    for position in (30, 31):
        q, k = torch.randn(1, 4, 1, 8), torch.full((1, 2, 1, 8), float(position))
        layer.decode_step(q, k, k.clone(), torch.tensor([[position]]))
    assert sorted(layer.pos[0, 0].tolist()) == [0, 1, 2, 3] + list(range(26, 32))


def test_h2o_keeps_heavy_hitters_and_evicts_the_lightest_outside_the_recent_half():
    mass = torch.zeros(2, 30)
    mass[0, [3, 7, 11, 15, 19]] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    mass[1, [2, 4, 6, 8, 10]] = 1.0
    layer = layer_with("h2o", budget=10, n_prompt=30, mass=[mass])
    assert sorted(layer.pos[0, 0].tolist()) == [3, 7, 11, 15, 19] + list(range(25, 30))
    assert sorted(layer.pos[0, 1].tolist()) == [2, 4, 6, 8, 10] + list(range(25, 30))
    # A query that attends to nothing but position 25: it leaves the recent half next step and,
    # having received the most, stays; the lightest heavy hitter (19, head 0) goes.
    layer.score[0, 0, layer.pos[0, 0] == 25] = 100.0
    q, k = torch.zeros(1, 4, 1, 8), torch.full((1, 2, 1, 8), 30.0)
    layer.decode_step(q, k, k.clone(), torch.tensor([[30]]))
    assert sorted(layer.pos[0, 0].tolist()) == [3, 7, 11, 15, 25, 26, 27, 28, 29, 30]


def test_decode_step_attends_exactly_over_the_kept_pairs():
    torch.manual_seed(0)
    state = EvictionState(EvictionConfig("streaming", budget=6, sink_tokens=2), 1)
    state.begin([20])
    layer = EvictionLayer(state, 2, 8, torch.float32, torch.device("cpu"))
    k_all, v_all = torch.randn(1, 2, 21, 8), torch.randn(1, 2, 21, 8)
    layer.ingest_prompt(k_all[:, :, :20], v_all[:, :, :20])
    q = torch.randn(1, 4, 1, 8)
    y = layer.decode_step(q, k_all[:, :, 20:], v_all[:, :, 20:], torch.tensor([[20]]))
    kept = [0, 1, 16, 17, 18, 19, 20]
    expected = F.scaled_dot_product_attention(
        q, k_all[:, :, kept], v_all[:, :, kept], enable_gqa=True
    )
    torch.testing.assert_close(y, expected)


def test_equal_budget_matches_specache_fast_tier_bytes():
    model = tiny_model()
    config = specache_config(bits=1, group=32, residual=32, topk=16)
    budget = equal_budget_tokens(model, 1000, config)
    specache_bytes = PluggedSpeCache(model, 1, 1000, config).layers[0].fast_tier_bytes()
    eviction_bytes = (
        EvictionCache(model, 1, 1000, EvictionConfig("h2o", budget)).layers[0].fast_tier_bytes()
    )
    per_token = eviction_bytes / budget
    assert specache_bytes - per_token < eviction_bytes <= specache_bytes


@pytest.mark.parametrize(
    "config, message",
    [
        (EvictionConfig("lru", 10), "unknown eviction policy"),
        (EvictionConfig("h2o", 1), "at least 2"),
        (EvictionConfig("streaming", 4, sink_tokens=4), "sink tokens"),
    ],
)
def test_invalid_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        EvictionCache(tiny_model(), 1, 100, config)
