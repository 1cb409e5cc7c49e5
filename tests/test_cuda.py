"""The CUDA path: pinned slow tier, side-stream fetches with events. Skipped without a GPU;
scripts/gpu_check.sh runs these on a GPU machine."""

import pytest
import torch

import specache
from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from conftest import specache_config, tiny_model
from generation import compile_decode, generate
from caches.stats import Diagnostics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SMALL = dict(group=16, residual=16)


def prompts_of(*lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


def run(model, prompts, config, new_tokens=30, capacity=None):
    cache = PluggedSpeCache(
        model, len(prompts), capacity or max(map(len, prompts)) + new_tokens, config
    )
    return generate(model, cache, prompts, new_tokens, temperature=0)


def test_mixed_attention_on_cuda_matches_the_cpu_reference(specache_kernels):
    """specache's ops on the GPU (the Triton kernels for the low-bit pass) against attention
    spelled out over every key a row sees."""
    from test_lowbit_copy import lowbit_copy, mixed_attention, mixed_attention_reference, segments

    kv, k, v = lowbit_copy(1, 64)
    seg = segments(kv, k, v, 2)
    q = torch.randn(2, 9, 2, 64)

    def to_cuda(x):
        return x.cuda() if isinstance(x, torch.Tensor) else x

    out, weights = mixed_attention(
        q.cuda(), type(kv)(*map(to_cuda, kv)), type(seg)(*map(to_cuda, seg))
    )
    ref_out, ref_weights = mixed_attention_reference(q, kv, seg)
    torch.testing.assert_close(out.cpu(), ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "cache, layout, select",
    [
        ("specache", "llama", "paper"),
        ("specache", "llama", "default"),
        ("specache", "llama", "default,correct=0.99"),
        ("specache", "llama", "default,shortlist=3"),
        ("specache", "llama", "default,shortlist=0"),
        ("specache-nospec", "llama", "default"),
        ("kivi", "llama", "paper"),
        ("specache", "hybrid", "default"),
    ],
)
def test_specache_on_cuda_generates_what_it_generates_on_cpu(cache, layout, select):
    """Hybrid: sliding-window layers keep their rings on the GPU and fetch nothing, between layers
    whose fetches run in the background. The default selection also waits, inside the layer, for
    the pairs the real row picks (the pinned tier's read); correct=0.99 discards most prefetches."""
    from test_specache import HYBRID

    shape = HYBRID if layout == "hybrid" else {}
    config = specache_config(
        select, topk=0 if cache == "kivi" else 8, speculative=cache == "specache", **SMALL
    )
    prompts = prompts_of(50, 83)
    on_cpu = run(tiny_model(**shape), prompts, config)
    model = tiny_model(**shape).cuda()
    on_gpu = run(model, prompts, config)
    layer = (
        model.layers[1].attention.kv_cache
        if layout == "hybrid"
        else model.layers[0].attention.kv_cache
    )
    assert layer.tier.k.device.type == "cpu" and layer.tier.k.is_pinned()
    assert layer.fetched_k.device.type == "cuda" and layer.k_packed.device.type == "cuda"
    assert on_gpu.tokens == on_cpu.tokens


def test_the_sparse_pass_on_cuda_generates_what_it_generates_on_cpu():
    """The sparse pass's Triton kernels on the GPU, the C kernel on the CPU: the same tokens,
    with tau low enough that most positions take their group's mean value."""
    config = specache_config(topk=8, arithmetic="sparse", tau=2.0, **SMALL)
    prompts = prompts_of(50, 83)
    on_cpu = run(tiny_model(), prompts, config)
    assert run(tiny_model().cuda(), prompts, config).tokens == on_cpu.tokens


def test_waiting_for_each_fetch_changes_nothing():
    prompts = prompts_of(50, 83)
    overlapped = run(tiny_model().cuda(), prompts, specache_config(topk=8, **SMALL))
    waited = run(
        tiny_model().cuda(), prompts, specache_config(topk=8, overlap_fetch=False, **SMALL)
    )
    assert waited.tokens == overlapped.tokens


def test_fetching_everything_on_cuda_reproduces_the_full_cache():
    model = tiny_model().cuda()
    prompts = prompts_of(45, 83)
    full = generate(model, FullCache(model, 2, 83 + 40), prompts, 40, temperature=0)
    config = specache_config(topk=256, pair_dtype=torch.float32, **SMALL)
    # room for a slot everywhere
    assert run(model, prompts, config, 40, capacity=256).tokens == full.tokens


@pytest.mark.parametrize(
    "cache, select",
    [
        ("specache", "paper"),
        ("specache", "default"),
        ("specache", "default,shortlist=3"),
        ("specache-nospec", "default"),
    ],
)
def test_compiled_cuda_decode_matches_eager(cache, select):
    config = specache_config(select, topk=8, speculative=cache == "specache", **SMALL)
    model = tiny_model().cuda()
    prompts = prompts_of(50, 71)
    eager = run(model, prompts, config)
    torch._dynamo.reset()
    # the pinned tier's hand-offs (the prefetch landed and started, the picks read) break the graph
    compile_decode(model, fullgraph=False)
    assert run(model, prompts, config).tokens == eager.tokens
    torch._dynamo.reset()


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
def test_repeated_generations_on_cuda_are_identical(speculative, bits, batch):
    """tests/test_specache.py's test on the GPU: three generations on one setup (k below the
    context, window flushes), identical tokens and statistics, and the CPU's tokens."""
    prompts = prompts_of(*[50, 97, 130][:batch])
    config = specache_config(bits=bits, topk=8, speculative=speculative, **SMALL)
    model = tiny_model().cuda()
    probe = Diagnostics(model.config.n_layer, model.config.n_local_heads, torch.device("cuda"))
    cache = PluggedSpeCache(model, batch, 130 + 40, config, probe=probe)
    runs = [generate(model, cache, prompts, 40, temperature=0) for _ in range(3)]
    assert runs[0].tokens == runs[1].tokens == runs[2].tokens
    assert runs[0].stats == runs[1].stats == runs[2].stats
    cpu = tiny_model()
    on_cpu = generate(
        cpu, PluggedSpeCache(cpu, batch, 130 + 40, config), prompts, 40, temperature=0
    )
    assert on_cpu.tokens == runs[0].tokens


@pytest.mark.parametrize("whole_step", [False, True])
def test_full_cache_flex_decode_on_cuda_matches_cpu(whole_step):
    """Per block, and the whole step replayed as a CUDA graph (mode reduce-overhead)."""
    prompts = prompts_of(40, 200)
    cpu_model = tiny_model()
    expected = generate(cpu_model, FullCache(cpu_model, 2, 300), prompts, 40, temperature=0).tokens
    model = tiny_model().cuda()
    compile_decode(model, whole_step=whole_step)
    assert (
        generate(model, FullCache(model, 2, 300, use_flex=True), prompts, 40, temperature=0).tokens
        == expected
    )
    torch._dynamo.reset()


def test_an_error_in_the_fetch_worker_surfaces_within_one_step(monkeypatch):
    def broken(self, ready, kappa):
        raise RuntimeError("injected fetch failure")

    monkeypatch.setattr(specache.PinnedTier, "_fetch", broken)
    model, prompts, tokens_seen = tiny_model().cuda(), prompts_of(50), []
    cache = PluggedSpeCache(model, 1, 80, specache_config(topk=8, **SMALL))
    with pytest.raises(RuntimeError, match="injected fetch failure"):
        generate(model, cache, prompts, 20, temperature=0, callback=tokens_seen.append)
    # the bootstrap step started the fetches; the first decode step waited on them
    assert len(tokens_seen) == 1


def test_quantized_linears_on_cuda_match_their_references():
    import torch.nn.functional as F

    from quantize import (
        Int4Linear,
        Int8Linear,
        dequantize_int4,
        dequantize_int8,
        quantize_int4,
        quantize_int8,
    )

    w, x = torch.randn(256, 256), torch.randn(3, 256)
    int8 = Int8Linear(256, 256)
    int8.weight, int8.scales = quantize_int8(w)
    expected = F.linear(x, dequantize_int8(int8.weight, int8.scales))
    torch.testing.assert_close(int8.cuda()(x.cuda()).cpu(), expected, rtol=1e-4, atol=1e-4)
    int4 = Int4Linear(256, 256, 32)
    int4.weight, int4.scales, int4.zeros = quantize_int4(w, 32)
    expected = F.linear(x, dequantize_int4(int4.weight, int4.scales, int4.zeros))
    int4 = int4.cuda()
    int4.pack()  # gpt-fast's packing for _weight_int4pack_mm; bf16 activations, hence the tolerance
    assert int4.packed is not None
    torch.testing.assert_close(
        int4(x.cuda()).cpu(), expected, rtol=0, atol=1e-2 * expected.abs().max().item()
    )


@pytest.mark.parametrize("name", ["full", "specache"])
def test_the_engine_on_cuda_shares_one_cache_a_row_each(name, monkeypatch):
    """The server's engine (serving/batching.py) on the GPU, its sequences a row each of one cache
    (SpeCache's slow tier pinned in host RAM, its real rows written and its prefetches fetched on
    side streams, each fetch slowed down here so that more of them are in flight when the host moves
    rows). A conversation is kept (copied out of its row once the moves in flight have landed); six
    requests through a batch of 3 overwrite its row and answer what generate answers for each prompt
    alone on the GPU; the conversation then continues from a copy back, beside other requests, as
    generate continues a kept cache."""
    import time

    from test_batching import METHODS, Collect, alone, engine_for, prompts, settled

    real_fetch = specache.PinnedTier._fetch

    def slow_fetch(tier, *args):
        time.sleep(0.002)
        return real_fetch(tier, *args)

    monkeypatch.setattr(specache.PinnedTier, "_fetch", slow_fetch)
    method, options = METHODS[name]
    model = tiny_model().cuda()
    engine = engine_for(model, method, options, max_batch_size=3, keep_bytes=10**9)
    try:
        assert engine.shared is not None
        if name == "specache":
            assert isinstance(engine.shared.layers[0].tier, specache.PinnedTier)
        turn1 = Collect(prompts(1)[0], 8, keep=True)
        engine.submit(turn1)
        answer1 = turn1.result()
        held = len(turn1.prompt_ids) + len(answer1) - 1
        jobs = [Collect(p, 6 + 5 * i) for i, p in enumerate(prompts(6))]
        for job in jobs:
            engine.submit(job)
        answers = [job.result() for job in jobs]
        settled(engine)
        references = [
            alone(model, method, options, job.prompt_ids, job.max_tokens)[0] for job in jobs
        ]
        assert answers == references
        new = [answer1[-1], 5, 6, 7]
        turn2 = Collect(turn1.prompt_ids + answer1[:-1] + new, 8, keep=True)
        beside = [Collect(p, 12) for p in prompts(2, seed=3)]
        for job in [beside[0], turn2, beside[1]]:
            engine.submit(job)
        answer2 = turn2.result()
        assert [job.result() for job in beside] == [
            alone(model, method, options, job.prompt_ids, 12)[0] for job in beside
        ]
        assert turn2.reused == held
        _, cache = alone(model, method, options, turn1.prompt_ids, 8)
        assert answer2 == alone(model, method, options, new, 8, held=held, cache=cache)[0]
    finally:
        engine.close()
