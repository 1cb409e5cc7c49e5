"""SpeCache against the full cache, against its reference kernels, and against its own invariants."""
import pytest
import torch

import specache
from conftest import tiny_model
from generate import compile_decode, generate
from kernels.attention import mixed_attention_reference
from kernels.quant import dequantize_keys, quantize_keys, quantize_values
from model import KVCache, ModelArgs, Transformer
from specache import SpeCacheConfig, SpeCacheLayer, select_top_k, setup_specache, specache_generate

VOCAB = 97
# small groups so that a few dozen steps cross several window flushes
SMALL = dict(group=16, residual=16)
# Gemma-3's layout in small: layers 0 and 2 see a window of 16 positions (their own RoPE base), layer 1 everything
HYBRID = dict(n_layer=3, sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_local_base=500.0, sandwich_norm=True, qk_norm=True, ffn_activation="gelu_tanh",
              scale_embeddings=True, norm_in_fp32=True)


def prompts_of(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run_specache(model, prompts, new_tokens, config, capacity=None, **kwargs):
    state = setup_specache(model, len(prompts), capacity or max(map(len, prompts)) + new_tokens, config)
    return specache_generate(model, state, prompts, new_tokens, temperature=0, **kwargs)


def run_full(model, prompts, new_tokens):
    model.setup_caches(len(prompts), max(map(len, prompts)) + new_tokens)
    return generate(model, prompts, new_tokens, temperature=0)


@pytest.mark.parametrize("layout", ["llama", "hybrid"])
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("bits", [1, 2])
def test_fetching_every_position_reproduces_the_full_cache(speculative, bits, layout):
    """With top-k at least the context, every quantized position is fetched in exact precision.
    Hybrid: the sliding-window layers' rings (ragged prompts, two-row steps) == the full cache's."""
    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    prompts = prompts_of(45, 83)
    full = run_full(model, prompts, 40)
    config = SpeCacheConfig(bits=bits, topk=256, speculative=speculative, pair_dtype=torch.float32, **SMALL)
    assert run_specache(model, prompts, 40, config).tokens == full.tokens


def test_sixteen_bit_pairs_stay_close_to_the_fp32_full_cache():
    model = tiny_model()
    prompts = prompts_of(60)
    full = run_full(model, prompts, 24)
    result = run_specache(model, prompts, 24, SpeCacheConfig(topk=256, **SMALL))  # fp16 pairs by default
    assert specache.specache_layers(model)[0].slow.k.dtype == torch.float16
    assert result.tokens == full.tokens


@pytest.mark.parametrize("cache", ["specache", "specache-nospec", "kivi"])
def test_fast_kernels_generate_what_the_reference_kernels_generate(cache, monkeypatch):
    """Every variant (k = 0 is KIVI alone) through the fast kernels == through the plain reference."""
    config = SpeCacheConfig(topk=0 if cache == "kivi" else 8, speculative=cache == "specache", **SMALL)
    model = tiny_model()
    prompts = prompts_of(50, 77)
    fast = run_specache(model, prompts, 30, config)
    monkeypatch.setattr(specache, "mixed_attention", mixed_attention_reference)
    assert run_specache(model, prompts, 30, config).tokens == fast.tokens


def test_speculative_row_never_changes_the_real_rows_output():
    model = tiny_model()
    prompts = prompts_of(70, 40)
    config = SpeCacheConfig(topk=256, pair_dtype=torch.float32, **SMALL)
    paper = run_specache(model, prompts, 30, config)
    g = torch.Generator().manual_seed(5)
    random_guesses = run_specache(model, prompts, 30, config,
                                  guess_next=lambda logits: torch.randint(0, VOCAB, (logits.shape[0], 1), generator=g))
    assert random_guesses.tokens == paper.tokens
    assert random_guesses.stats["speculative_match_rate"] < paper.stats["speculative_match_rate"]


def test_real_row_logits_do_not_depend_on_the_speculative_token_within_a_step():
    model = tiny_model()
    prompt = prompts_of(90)[0]
    logits = []
    for guess in (5, 50):
        state = setup_specache(model, 1, 120, SpeCacheConfig(topk=8, **SMALL))
        specache_generate(model, state, [prompt], 1, temperature=0)
        state.append = False
        pos = torch.tensor([[len(prompt)]])
        specache.run_layers(model, torch.tensor([[7]]), pos, start_fetches=True)
        state.append = True
        out = specache.run_layers(model, torch.tensor([[7, guess]]), torch.cat([pos, pos + 1], 1), start_fetches=True)
        specache.wait_for_fetches(model)
        logits.append(out[0, 0])
    assert torch.equal(logits[0], logits[1])


def test_window_flushes_leave_every_position_in_exactly_one_place():
    """After many flushes: [0, Lq) is quantized from exactly the slow tier's pairs, the window holds
    [Lq, L) and nothing else, and together they are the full cache's K and V."""
    model = tiny_model()
    prompts = prompts_of(37, 90)
    full = run_full(model, prompts, 50)
    full_caches = [layer.attention.kv_cache for layer in model.layers]
    config = SpeCacheConfig(topk=256, pair_dtype=torch.float32, **SMALL)
    result = run_specache(model, prompts, 50, config)
    assert result.tokens == full.tokens
    state = specache.specache_layers(model)[0].state
    g, r = config.group, config.residual
    for b, prompt in enumerate(prompts):
        stored = len(prompt) + result.decode_steps  # the last generated token has not run yet
        lq, window = state.host_quantized_len[b], state.host_window_len[b]
        assert lq % g == 0 and r <= window < r + g and lq + window == stored
        assert int(state.quantized_len[b]) == lq and int(state.window_len[b]) == window
        for full_cache, cache in zip(full_caches, specache.specache_layers(model)):
            full_k = full_cache.k_cache[b, :, :stored]
            full_v = full_cache.v_cache[b, :, :stored]
            torch.testing.assert_close(cache.slow.k[b, :, :lq], full_k[:, :lq], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.slow.v[b, :, :lq], full_v[:, :lq], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.window_k[b, :, :window], full_k[:, lq:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.window_v[b, :, :window], full_v[:, lq:], atol=1e-5, rtol=1e-5)
            packed, scale, zero = quantize_keys(cache.slow.k[b, :, :lq], config.bits, g, cache.k_scale.dtype)
            assert torch.equal(cache.k_packed[b, :, :lq], packed)
            assert torch.equal(cache.k_scale[b, :, : lq // g], scale)
            packed, scale, zero = quantize_values(cache.slow.v[b, :, :lq], config.bits, g, cache.v_scale.dtype)
            assert torch.equal(cache.v_packed[b, :, :lq], packed) and torch.equal(cache.v_zero[b, :, :lq], zero)


def test_gqa_top_k_averages_the_groups_query_heads():
    """select_top_k on mixed_attention's weights == a per-KV-head reference: softmax per query
    head over the dequantized copy, the window and the new rows, averaged over the group."""
    torch.manual_seed(0)
    b, n_kv, group_size, t, d, k = 2, 3, 3, 128, 64, 10
    keys, values = torch.randn(b, n_kv, t, d) * torch.linspace(0.2, 3, d), torch.randn(b, n_kv, t, d)
    kv = specache.LowBitKV(*quantize_keys(keys, 1, 32, torch.float16), *quantize_values(values, 1, 32, torch.float16),
                           1, 32)
    window_k, new_k = torch.randn(b, n_kv, 48, d), torch.randn(b, n_kv, 2, d)
    segments = specache.Segments(torch.tensor([80, 96]), torch.zeros(b, n_kv, k, d), torch.zeros(b, n_kv, k, d),
                                 torch.zeros(b, n_kv, k, dtype=torch.long), torch.zeros(b, n_kv, k, dtype=torch.bool),
                                 window_k, torch.randn(b, n_kv, 48, d), torch.tensor([48, 20]), new_k,
                                 torch.randn(b, n_kv, 2, d))
    q = torch.randn(b, n_kv * group_size, 2, d)
    _, weights = specache.mixed_attention(q, kv, segments)
    positions, valid = select_top_k(weights, segments.quantized_len, k)
    dequantized = dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, 1, 32)
    for bi in range(b):
        lq, wl = int(segments.quantized_len[bi]), int(segments.window_len[bi])
        for h in range(n_kv):
            keys_seen = torch.cat([dequantized[bi, h, :lq], window_k[bi, h, :wl], new_k[bi, h]])
            heads = q[bi, h * group_size: (h + 1) * group_size, -1]
            probs = ((heads @ keys_seen.T) / d ** 0.5).softmax(-1)[:, :lq].mean(0)
            expected = set(probs.topk(k).indices.tolist())
            assert set(positions[bi, h].tolist()) == expected and valid[bi, h].all()


def test_short_sequences_mark_missing_positions_invalid():
    weights = torch.rand(1, 2, 64)
    positions, valid = select_top_k(weights, torch.tensor([5]), 8)
    assert valid.sum(-1).tolist() == [[5, 5]]
    assert (positions[valid] < 5).all()


def test_fast_tier_at_4k_holds_only_the_low_bit_copy_the_window_and_k_pairs():
    """Memory truth: at 4k context no 16-bit K/V beyond R + g + k rows per layer and KV head stays
    in the fast tier, and its bytes match SPECACHE.md's formula with our window of R + g."""
    config = ModelArgs.from_name("SmolLM2-135M")
    config.n_layer = 2
    torch.manual_seed(0)
    model = Transformer(config).eval()
    state = setup_specache(model, 1, 4096, SpeCacheConfig())
    prompt = torch.randint(0, config.vocab_size, (4000,)).tolist()
    specache_generate(model, state, [prompt], 2, temperature=0)
    c, s = state.config, state.capacity
    assert s == 4096
    assert not any(isinstance(m, KVCache) for m in model.modules())
    head_dim, n_kv = config.head_dim, config.n_local_heads
    for layer in model.layers:
        cache = layer.attention.kv_cache
        assert isinstance(cache, SpeCacheLayer)
        pairs = {name: t for name, t in cache.named_buffers() if t.is_floating_point() and t.shape[-1] == head_dim
                 and name not in ("k_scale", "k_zero")}
        assert {name: tuple(t.shape) for name, t in pairs.items()} == {
            "window_k": (1, n_kv, c.residual + c.group, head_dim), "window_v": (1, n_kv, c.residual + c.group, head_dim),
            "fetched_k": (1, n_kv, c.topk, head_dim), "fetched_v": (1, n_kv, c.topk, head_dim)}
        assert all(t.dtype == torch.float16 for t in pairs.values())
        assert cache.k_packed.dtype == cache.v_packed.dtype == torch.uint8
        assert cache.k_packed.shape == (1, n_kv, s, head_dim * c.bits // 8)
        slow = {id(cache.slow.k), id(cache.slow.v)}
        assert not slow & {id(t) for t in cache.buffers()}, "the slow tier must not be a fast-tier buffer"
        assert cache.slow.k.shape == (1, n_kv, s, head_dim) and cache.slow.k.dtype == torch.float16
    measured = sum(layer.attention.kv_cache.fast_tier_bytes() for layer in model.layers)
    sixteen_bit_cache = 2 * 2 * config.n_layer * n_kv * head_dim * s
    formula = (c.bits + 32 / c.group) / 16 + (c.residual + c.group + c.topk) / s
    assert abs(measured / sixteen_bit_cache / formula - 1) < 0.03
    assert abs(state_ratio(model, state) - measured / sixteen_bit_cache) < 1e-9


def state_ratio(model, state):
    return specache.cache_stats(model, state, None)["fast_tier_ratio_to_16bit_cache"]


def test_batch_of_three_prompts_equals_each_alone():
    model = tiny_model()
    prompts = prompts_of(40, 97, 130)
    config = SpeCacheConfig(topk=8, **SMALL)
    batched = run_specache(model, prompts, 24, config)
    for i, prompt in enumerate(prompts):
        assert run_specache(model, [prompt], 24, config).tokens[0] == batched.tokens[i]


@pytest.mark.parametrize("cache, layout", [("specache", "llama"), ("specache-nospec", "llama"),
                                           ("specache", "hybrid")])
def test_compiled_decode_matches_eager_and_never_recompiles(cache, layout):
    """Hybrid: the sliding-window layers' rings wrap as positions move, in their own graph."""
    from torch._dynamo.utils import counters

    config = SpeCacheConfig(topk=8, speculative=cache == "specache", **SMALL)
    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    prompts = prompts_of(50, 71)
    eager = run_specache(model, prompts, 40, config)
    torch._dynamo.reset()
    counters.clear()
    compile_decode(model)
    run_specache(model, [p[:20] for p in prompts], 3, config, capacity=71 + 40)  # compiles the decode step
    graphs = counters["stats"]["unique_graphs"]
    compiled = run_specache(model, prompts, 40, config)  # positions move, windows flush, kappa changes
    assert counters["stats"]["unique_graphs"] == graphs, "the SpeCache decode step recompiled"
    assert compiled.tokens == eager.tokens
    torch._dynamo.reset()


def test_a_failing_fetch_raises_instead_of_being_lost(monkeypatch):
    """On a CPU the gather runs inside the step; the GPU's background worker has its own test in
    tests/test_cuda.py."""
    model = tiny_model()

    def broken(*args, **kwargs):
        raise RuntimeError("injected fetch failure")

    monkeypatch.setattr(specache, "gather_pairs", broken)
    with pytest.raises(RuntimeError, match="injected fetch failure"):
        run_specache(model, prompts_of(60), 10, SpeCacheConfig(topk=8, **SMALL))


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), "bits must be 1 or 2"),
    (dict(group=48, residual=64), "multiple of the group size"),
    (dict(topk=-1), "top-k must be >= 0"),
])
def test_invalid_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeCacheConfig(**kwargs).validate(64)


def test_head_dims_that_do_not_fill_bytes_are_refused():
    with pytest.raises(ValueError, match="head_dim x bits must be a multiple of 8"):
        SpeCacheConfig(bits=1).validate(36)
    SpeCacheConfig(bits=2).validate(36)


def test_hybrid_models_offload_only_their_full_attention_layers():
    model = tiny_model(**HYBRID)
    result = run_specache(model, prompts_of(70), 8, SpeCacheConfig(**SMALL))
    kinds = [type(layer.attention.kv_cache).__name__ for layer in model.layers]
    assert kinds == ["SpeCacheWindow", "SpeCacheLayer", "SpeCacheWindow"]
    stats = result.stats
    assert (stats["full_attention_layers"], stats["sliding_window_layers"]) == (1, 2)
    # a ring of 16-bit pairs, as the full cache's, plus each slot's position (8 bytes)
    pair_bytes = 2 * model.config.n_local_heads * model.config.head_dim * 2
    assert stats["fast_tier_ratio_sliding_window_layers"] == pytest.approx(1 + 8 / pair_bytes)
    assert stats["fast_tier_bytes"] == (stats["fast_tier_bytes_full_attention_layers"]
                                        + stats["fast_tier_bytes_sliding_window_layers"])


def test_models_with_only_sliding_window_layers_are_refused():
    model = tiny_model(sliding_window=16)
    with pytest.raises(ValueError, match="nothing to offload"):
        setup_specache(model, 1, 64, SpeCacheConfig(**SMALL))
