"""SpeCache against the full cache, against its reference kernels, and against its own
invariants."""

from types import SimpleNamespace

import pytest
import torch

import specache
from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from config import ModelArgs
from conftest import reference_ops, specache_config, tiny_model
from generation import compile_decode, generate
from model import KVCache, Transformer
from reference_decoder import lookup_guess
from specache import SpeCacheConfig, SpeCacheLayer
from specache.lowbit import LowBitKV, dequantize_keys, quantize_keys, quantize_values
from caches.stats import Diagnostics

VOCAB = 97
# small groups so that a few dozen steps cross several window flushes
SMALL = dict(group=16, residual=16)
# Gemma-3's layout in small: layers 0 and 2 see a window of 16 positions (their own RoPE base),
# layer 1 everything
HYBRID = dict(
    n_layer=3,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_local_base=500.0,
    sandwich_norm=True,
    qk_norm=True,
    ffn_activation="gelu_tanh",
    scale_embeddings=True,
    norm_in_fp32=True,
)


# A capacity with room for slots at every position these prompts ever quantize: the fast tier
# never exceeds a 16-bit cache of its capacity (specache/config.py: fast_tier_plan), and fetching
# every position takes more slots than a capacity just above the context leaves.
ROOMY = 256


def prompts_of(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def plugged(model, batch, capacity, config, stats=False):
    """SpeCache in `model`, with its diagnostics when `stats`."""
    probe = (
        Diagnostics(model.config.n_layer, model.config.n_local_heads, torch.device("cpu"))
        if stats
        else None
    )
    return PluggedSpeCache(model, batch, capacity, config, probe=probe)


def run_specache(model, prompts, new_tokens, config, capacity=None, guess_next=None, stats=False):
    cache = plugged(
        model, len(prompts), capacity or max(map(len, prompts)) + new_tokens, config, stats
    )
    if guess_next is not None:
        cache.guess_next = guess_next
    return generate(model, cache, prompts, new_tokens, temperature=0)


def run_full(model, prompts, new_tokens):
    cache = FullCache(model, len(prompts), max(map(len, prompts)) + new_tokens)
    return generate(model, cache, prompts, new_tokens, temperature=0)


@pytest.mark.parametrize("layout", ["llama", "hybrid"])
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("bits", [1, 2])
def test_fetching_every_position_reproduces_the_full_cache(speculative, bits, layout):
    """With top-k at least the context, every quantized position is fetched in exact precision.
    Hybrid: the sliding-window layers' rings (ragged prompts, two-row steps) == the full cache's."""
    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    prompts = prompts_of(45, 83)
    full = run_full(model, prompts, 40)
    config = specache_config(
        bits=bits, topk=256, speculative=speculative, pair_dtype=torch.float32, **SMALL
    )
    assert run_specache(model, prompts, 40, config, capacity=ROOMY).tokens == full.tokens


def test_sixteen_bit_pairs_stay_close_to_the_fp32_full_cache():
    model = tiny_model()
    prompts = prompts_of(60)
    full = run_full(model, prompts, 24)
    # fp16 pairs
    result = run_specache(model, prompts, 24, specache_config(topk=256, **SMALL), capacity=ROOMY)
    assert model.layers[0].attention.kv_cache.tier.k.dtype == torch.float16
    assert result.tokens == full.tokens


@pytest.mark.parametrize(
    "cache, select, arithmetic",
    [
        ("specache", "paper", "float"),
        ("specache", "default", "float"),
        ("specache", "correct=0.99", "float"),
        ("specache-nospec", "default", "float"),
        ("kivi", "paper", "float"),
        ("specache", "default", "int8"),
        ("kivi", "paper", "int8"),
        ("specache", "default,shortlist=3", "float"),
        ("specache", "default,shortlist=0", "float"),
        ("specache-nospec", "split,shortlist=2", "int8"),
        ("specache", "default", "sparse"),
        ("kivi", "paper", "sparse"),
    ],
)
def test_fast_kernels_generate_what_the_reference_kernels_generate(
    cache, select, arithmetic, monkeypatch
):
    """Every variant (k = 0 is KIVI alone) through the C kernels, one op per layer and step
    (specache::step_attention) == through the plain-PyTorch definitions of specache's ops
    (head_dim 64: the kernels' vector paths); there, each step's low-bit pass runs in the
    configured arithmetic (the one op's is held to it in test_step_cpu.py)."""
    passes, fused = [], []
    real = specache.ops.lowbit_partial_attention
    monkeypatch.setattr(  # the step's one composition, op by op or as the one op's definition
        specache.step,
        "lowbit_partial_attention",
        lambda *args: passes.append(args[3]) or real(*args),
    )
    real_step = specache.SpeCacheLayer.step_in_ram
    monkeypatch.setattr(
        specache.SpeCacheLayer,
        "step_in_ram",
        lambda self, *args: fused.append(True) or real_step(self, *args),
    )
    config = specache_config(
        select,
        topk=0 if cache == "kivi" else 8,
        speculative=cache == "specache",
        arithmetic=arithmetic,
        **({"tau": 2.0} if arithmetic == "sparse" else {}),  # so that it skips positions
        **SMALL,
    )
    model = tiny_model(dim=256, n_head=4, n_local_heads=2)
    prompts = prompts_of(50, 77)
    fast = run_specache(model, prompts, 30, config)
    assert fused and not passes  # the C++ op ran the whole step
    with reference_ops():
        assert run_specache(model, prompts, 30, config).tokens == fast.tokens
    assert passes and set(passes) == {arithmetic}


def random_guesses(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda logits, history, lengths: torch.randint(
        0, VOCAB, (logits.shape[0], 1), generator=g
    )


def test_with_every_position_fetched_the_guesses_cannot_change_the_tokens():
    """With k at least the context, every quantized position is exact whatever the speculative row
    chose, so only a leak of the speculative row into the real row could change a token."""
    model = tiny_model()
    prompts = prompts_of(70, 40)
    config = specache_config("paper", topk=256, pair_dtype=torch.float32, **SMALL)
    paper = run_specache(model, prompts, 30, config, capacity=ROOMY)
    guessed = run_specache(model, prompts, 30, config, capacity=ROOMY, guess_next=random_guesses(5))
    assert guessed.tokens == paper.tokens
    assert guessed.stats["speculative_match_rate"] < paper.stats["speculative_match_rate"]


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
def test_repeated_generations_are_identical(speculative, bits, batch):
    """Three greedy generations on one setup, k below the context and window flushes included:
    the same tokens and the same statistics (no state leaks from one generation into the next)."""
    model = tiny_model()
    prompts = prompts_of(*[50, 97, 130][:batch])
    config = specache_config(bits=bits, topk=8, speculative=speculative, **SMALL)
    cache = plugged(model, batch, 130 + 40, config, stats=True)
    runs = [generate(model, cache, prompts, 40, temperature=0) for _ in range(3)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[0].stats == runs[1].stats == runs[2].stats
    # and the same as a fresh setup (what the first generation of a process sees)
    fresh = run_specache(model, prompts, 40, config, capacity=130 + 40, stats=True)
    assert fresh.tokens == runs[0].tokens and fresh.stats == runs[2].stats


def test_repeated_generations_in_one_process_match_after_a_different_prompt():
    """A generation after another prompt's equals the same generation alone: nothing chosen for
    the previous prompt (fetched positions, speculative queries, counts) survives."""
    model = tiny_model()
    config = specache_config("default,correct=0.95", topk=8, **SMALL)
    first, second = prompts_of(120, seed=1), prompts_of(90, seed=2)
    cache = plugged(model, 1, 160, config, stats=True)
    generate(model, cache, first, 30, temperature=0)
    after = generate(model, cache, second, 30, temperature=0)
    alone = run_specache(model, second, 30, config, capacity=160, stats=True)
    assert after.tokens == alone.tokens and after.stats == alone.stats


def test_real_row_logits_do_not_depend_on_the_speculative_token_within_a_step():
    model = tiny_model()
    prompt = prompts_of(90)[0]
    logits = []
    for guess in (5, 50):
        cache = plugged(model, 1, 120, specache_config(topk=8, **SMALL))
        generate(model, cache, [prompt], 1, temperature=0)
        pos = torch.tensor([[len(prompt)]])
        cache.bootstrap(model, torch.tensor([[7]]), pos)
        cache.guess = torch.tensor([[guess]])
        out = cache.step(model, torch.tensor([[7]]), pos)
        cache.finish()
        logits.append(out[0, 0])
    assert torch.equal(logits[0], logits[1])


def test_window_flushes_leave_every_position_in_exactly_one_place():
    """After many flushes: [0, Lq) is quantized from exactly the slow tier's pairs, the window holds
    [Lq, L) and nothing else, and together they are the full cache's K and V."""
    model = tiny_model()
    prompts = prompts_of(37, 90)
    full = run_full(model, prompts, 50)
    full_caches = [layer.attention.kv_cache for layer in model.layers]
    config = specache_config(topk=256, pair_dtype=torch.float32, **SMALL)
    cache = plugged(model, len(prompts), ROOMY, config)
    result = generate(model, cache, prompts, 50, temperature=0)
    assert result.tokens == full.tokens
    state = cache.state
    g, r, bits, levels = (
        config.method.group,
        config.method.residual,
        config.method.bits,
        config.selection.levels,
    )
    for b, prompt in enumerate(prompts):
        stored = len(prompt) + result.decode_steps  # the last generated token has not run yet
        lq, window = state.host_quantized_len[b], state.host_window_len[b]
        assert lq % g == 0 and r <= window < r + g and lq + window == stored
        assert int(state.quantized_len[b]) == lq and int(state.window_len[b]) == window
        for full_cache, layer in zip(full_caches, cache.layers):
            full_k = full_cache.k_cache[b, :, :stored]
            full_v = full_cache.v_cache[b, :, :stored]
            torch.testing.assert_close(
                layer.tier.k[b, :, :lq], full_k[:, :lq], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                layer.tier.v[b, :, :lq], full_v[:, :lq], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                layer.window_k[b, :, :window], full_k[:, lq:], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(
                layer.window_v[b, :, :window], full_v[:, lq:], atol=1e-5, rtol=1e-5
            )
            packed, scale, zero = quantize_keys(
                layer.tier.k[b, :, :lq], bits, g, layer.k_scale.dtype, levels
            )
            assert torch.equal(layer.k_packed[b, :, :lq], packed)
            assert torch.equal(layer.k_scale[b, :, : lq // g], scale)
            packed, scale, zero = quantize_values(
                layer.tier.v[b, :, :lq], bits, g, layer.v_scale.dtype, levels
            )
            assert torch.equal(layer.v_packed[b, :, :lq], packed) and torch.equal(
                layer.v_zero[b, :, :lq], zero
            )


@pytest.mark.parametrize("how", ["mean", "max"])
def test_gqa_top_k_ranks_by_the_groups_query_heads(how):
    """top_positions (the C kernel where registered, and the plain reference) == a per-KV-head
    reference: softmax per query head over the dequantized copy, the window and the new rows, then
    the mean (the paper) or the max (gqa-max) over the group."""
    torch.manual_seed(0)
    b, n_kv, group_size, t, d, k = 2, 3, 3, 128, 64, 10
    keys, values = (
        torch.randn(b, n_kv, t, d) * torch.linspace(0.2, 3, d),
        torch.randn(b, n_kv, t, d),
    )
    kv = LowBitKV(
        *quantize_keys(keys, 1, 32, torch.float16),
        *quantize_values(values, 1, 32, torch.float16),
        1,
        32,
    )
    window_k, new_k = torch.randn(b, n_kv, 48, d), torch.randn(b, n_kv, 2, d)
    segments = specache.ops.Segments(
        torch.tensor([80, 96]),
        torch.zeros(b, n_kv, k, d),
        torch.zeros(b, n_kv, k, d),
        torch.zeros(b, n_kv, k, dtype=torch.long),
        torch.zeros(b, n_kv, k, dtype=torch.bool),
        window_k,
        torch.randn(b, n_kv, 48, d),
        torch.tensor([48, 20]),
        new_k,
        torch.randn(b, n_kv, 2, d),
    )
    q = torch.randn(b, n_kv * group_size, 2, d)
    rows = specache.ops.query_rows(q, n_kv)
    part = specache.ops.lowbit_partial_attention(rows, kv, segments)
    merged = specache.ops.merge_segments(rows, part, segments)
    nothing = segments.fetched_pos[..., :0]
    args = (
        part.weights,
        merged.lowbit_scale,
        merged.p_fetched,
        segments.fetched_pos,
        merged.p_window,
        segments.quantized_len,
        2,
        1,
        how == "max",
        0,
        segments.quantized_len,
        nothing,
        nothing.bool(),
        k,
    )
    positions, valid = specache.ops.top_positions_reference(*args)
    fused, fused_valid = specache.ops.top_positions(
        part, merged, segments, 2, 1, how, 0, segments.quantized_len, nothing, nothing.bool(), k
    )
    assert torch.equal(fused, positions) and torch.equal(fused_valid, valid)
    dequantized = dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, 1, 32)
    for bi in range(b):
        lq, wl = int(segments.quantized_len[bi]), int(segments.window_len[bi])
        for h in range(n_kv):
            keys_seen = torch.cat([dequantized[bi, h, :lq], window_k[bi, h, :wl], new_k[bi, h]])
            heads = q[bi, h * group_size : (h + 1) * group_size, -1]
            probs = ((heads @ keys_seen.T) / d**0.5).softmax(-1)[:, :lq]
            ranked = probs.mean(0) if how == "mean" else probs.amax(0)
            assert (
                set(positions[bi, h].tolist()) == set(ranked.topk(k).indices.tolist())
                and valid[bi, h].all()
            )


def test_short_sequences_mark_missing_positions_invalid():
    """Five candidates for a top-8: five valid picks, the candidates themselves."""
    weights, nothing = torch.rand(1, 2, 1, 64), torch.zeros(1, 2, 0, dtype=torch.long)
    positions, valid = specache.ops.top_positions_reference(
        weights,
        torch.ones(1, 2, 1, 1),
        torch.zeros(1, 2, 1, 0),
        nothing,
        torch.zeros(1, 2, 1, 0),
        torch.tensor([64]),
        1,
        0,
        False,
        0,
        torch.tensor([5]),
        nothing,
        nothing.bool(),
        8,
    )
    assert valid.sum(-1).tolist() == [[5, 5]]
    assert (positions[valid] < 5).all()
    assert all(sorted(positions[0, h][valid[0, h]].tolist()) == list(range(5)) for h in range(2))


def test_fast_tier_at_4k_holds_only_the_low_bit_copy_the_window_and_k_pairs():
    """Memory truth: at 4k context no 16-bit K/V beyond R + g + sinks + k rows per layer and KV head
    stays in the fast tier, and its bytes match the formula (b + 32/g)/16 + (R + g + sinks + k)/L
    with our window of R + g."""
    config = ModelArgs.from_name("SmolLM2-135M")
    config.n_layer = 2
    torch.manual_seed(0)
    model = Transformer(config).eval()
    cache = plugged(model, 1, 4096, SpeCacheConfig())
    prompt = torch.randint(0, config.vocab_size, (4000,)).tolist()
    generate(model, cache, [prompt], 2, temperature=0)
    selection = cache.config.selection
    c = SimpleNamespace(
        **vars(cache.config.method), sinks=selection.sinks, real_share=selection.real_share
    )
    s = cache.state.capacity
    quantizable = s - c.residual  # the newest R positions are never quantized
    assert s == 4096
    assert not any(isinstance(module, KVCache) for module in model.modules())
    head_dim, n_kv = config.head_dim, config.n_local_heads
    for layer in model.layers:
        layer_cache = layer.attention.kv_cache
        assert isinstance(layer_cache, SpeCacheLayer)
        pairs = {
            name: t
            for name, t in layer_cache.named_buffers()
            if t.is_floating_point()
            and t.shape[-1] == head_dim
            and name not in ("k_scale", "k_zero", "last_query")
        }
        assert {name: tuple(t.shape) for name, t in pairs.items()} == {
            "window_k": (1, n_kv, c.residual + c.group, head_dim),
            "window_v": (1, n_kv, c.residual + c.group, head_dim),
            "fetched_k": (1, n_kv, c.sinks + c.topk, head_dim),
            "fetched_v": (1, n_kv, c.sinks + c.topk, head_dim),
        }
        assert all(t.dtype == torch.float16 for t in pairs.values())
        assert layer_cache.k_packed.dtype == layer_cache.v_packed.dtype == torch.uint8
        assert layer_cache.k_packed.shape == (1, n_kv, quantizable, head_dim * c.bits // 8)
        slow = {id(layer_cache.tier.k), id(layer_cache.tier.v)}
        assert not slow & {id(t) for t in layer_cache.buffers()}, (
            "the slow tier must not be a fast-tier buffer"
        )
        assert (
            layer_cache.tier.k.shape == (1, n_kv, s, head_dim)
            and layer_cache.tier.k.dtype == torch.float16
        )
    # counted from the layout, per layer and KV head: codes, fp16 scales and zeros, 16-bit pairs,
    # and each exact slot's position (8 bytes) and flag (1), the prefetch's chosen positions too
    codes = 2 * quantizable * head_dim * c.bits // 8
    scales = (
        2
        * 2
        * (quantizable // c.group * head_dim + quantizable * head_dim // min(c.group, head_dim))
    )
    pairs = 2 * 2 * head_dim * (c.residual + c.group + c.sinks + c.topk)
    k_spec = c.topk - int(c.topk * c.real_share + 0.5)
    bookkeeping = 9 * (c.sinks + c.topk) + 9 * k_spec
    counted = config.n_layer * n_kv * (codes + scales + pairs + bookkeeping)
    counted += config.n_layer * config.n_head * head_dim * 4  # correct: the last row's fp32 queries
    measured = sum(layer.attention.kv_cache.fast_tier_bytes() for layer in model.layers)
    assert measured == counted
    sixteen_bit_cache = 2 * 2 * config.n_layer * n_kv * head_dim * s
    formula = (c.bits + 32 / c.group) / 16 + (c.residual + c.group + c.sinks + c.topk) / s
    assert abs(counted / sixteen_bit_cache / formula - 1) < 0.03
    assert cache.stats(1)["fast_tier_ratio_to_16bit_cache"] == pytest.approx(
        counted / sixteen_bit_cache
    )


@pytest.mark.parametrize("new_tokens", [8, 100, 200])
def test_a_short_context_never_holds_more_than_a_16_bit_cache(new_tokens):
    """A 5-token prompt: nothing is ever quantized within R + g positions, so the fast tier is the
    window alone, the size of a 16-bit cache; at 105 positions it is below."""
    config = ModelArgs.from_name("SmolLM2-135M")
    config.n_layer = 2
    model = Transformer(config).eval()
    cache = plugged(model, 1, 5 + new_tokens, SpeCacheConfig())
    result = generate(model, cache, [[1, 2, 3, 4, 5]], new_tokens, temperature=0)
    ratio = result.stats["fast_tier_ratio_to_16bit_cache"]
    assert ratio <= 1.0 and (new_tokens > 8 or ratio == 1.0)


def test_batch_of_three_prompts_equals_each_alone():
    model = tiny_model()
    prompts = prompts_of(40, 97, 130)
    config = specache_config(topk=8, **SMALL)
    batched = run_specache(model, prompts, 24, config)
    for i, prompt in enumerate(prompts):
        assert run_specache(model, [prompt], 24, config).tokens[0] == batched.tokens[i]


@pytest.mark.parametrize(
    "cache, layout, whole_step, select",
    [
        ("specache", "llama", False, "default"),
        ("specache-nospec", "llama", False, "default"),
        ("specache", "hybrid", False, "default"),
        ("specache", "llama", True, "default"),
        ("specache", "hybrid", True, "default"),
        ("specache", "llama", False, "default,shortlist=3"),
    ],
)
def test_compiled_decode_matches_eager_and_never_recompiles(cache, layout, whole_step, select):
    """Hybrid: the sliding-window layers' rings wrap as positions move, in their own graph. Whole
    step: the two-row pass of every layer and the head in one graph."""
    from torch._dynamo.utils import counters

    config = specache_config(select, topk=8, speculative=cache == "specache", **SMALL)
    model = tiny_model(**(HYBRID if layout == "hybrid" else {}))
    prompts = prompts_of(50, 71)
    eager = run_specache(model, prompts, 40, config)
    torch._dynamo.reset()
    counters.clear()
    compile_decode(model, whole_step=whole_step)
    # compiles the decode step
    run_specache(model, [p[:20] for p in prompts], 3, config, capacity=71 + 40)
    graphs = counters["stats"]["unique_graphs"]
    # positions move, windows flush, kappa changes
    compiled = run_specache(model, prompts, 40, config)
    assert counters["stats"]["unique_graphs"] == graphs, "the SpeCache decode step recompiled"
    assert compiled.tokens == eager.tokens
    torch._dynamo.reset()


def test_a_failing_fetch_raises_instead_of_being_lost(monkeypatch, specache_kernels):
    """On a CPU the gather runs inside the step (here in the one op's definition: the C++ kernel
    copies pairs within RAM, which cannot fail); the GPU's background worker has its own test in
    tests/test_cuda.py."""
    model = tiny_model()

    def broken(*args, **kwargs):
        raise RuntimeError("injected fetch failure")

    monkeypatch.setattr(specache.step, "gather_pairs", broken)
    with pytest.raises(RuntimeError, match="injected fetch failure"), reference_ops():
        run_specache(model, prompts_of(60), 10, specache_config(topk=8, **SMALL))


def test_hybrid_models_offload_only_their_full_attention_layers():
    model = tiny_model(**HYBRID)
    result = run_specache(model, prompts_of(70), 8, specache_config(**SMALL))
    kinds = [type(layer.attention.kv_cache).__name__ for layer in model.layers]
    assert kinds == ["RingKVCache", "SpeCacheLayer", "RingKVCache"]
    stats = result.stats
    assert (stats["full_attention_layers"], stats["sliding_window_layers"]) == (1, 2)
    # a ring of 16-bit pairs, as the full cache's, plus each slot's position (8 bytes)
    pair_bytes = 2 * model.config.n_local_heads * model.config.head_dim * 2
    assert stats["fast_tier_ratio_sliding_window_layers"] == pytest.approx(1 + 8 / pair_bytes)
    assert stats["fast_tier_bytes"] == (
        stats["fast_tier_bytes_full_attention_layers"]
        + stats["fast_tier_bytes_sliding_window_layers"]
    )


def test_models_with_only_sliding_window_layers_are_refused():
    model = tiny_model(sliding_window=16)
    with pytest.raises(ValueError, match="nothing to offload"):
        plugged(model, 1, 64, specache_config(**SMALL))


def test_prompt_lookup_guesses_the_token_after_the_latest_earlier_match():
    g = torch.Generator().manual_seed(0)
    histories = [torch.randint(0, 6, (n,), generator=g).tolist() for n in (1, 2, 9, 40, 41)]
    histories += [[1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], [4, 4, 4, 4], [8, 1, 2, 8]]
    width = max(map(len, histories)) + 3
    history = torch.full((len(histories), width), 99)  # past each sequence's end: never a match
    for b, h in enumerate(histories):
        history[b, : len(h)] = torch.tensor(h)
    logits = torch.randn(len(histories), 12, generator=g)
    guess = specache.guess.prompt_lookup_guess(
        logits, history, torch.tensor([len(h) for h in histories])
    )
    # plain Python
    assert guess[:, 0].tolist() == [lookup_guess(h, logits[b]) for b, h in enumerate(histories)]
    # the latest trigram, a run, a unigram
    assert guess[5, 0] == 7 and guess[6, 0] == 4 and guess[7, 0] == 1
