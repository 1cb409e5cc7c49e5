"""Generation: cache vs recompute, compiled vs eager, ragged batches, reproducibility."""

import pytest
import torch

from conftest import tiny_model
from caches.by_name import make_cache
from caches.full import FullCache
from generation import GenerateOptions, compile_decode, generate, pad_prompts, prefill_pass


def test_cached_decode_equals_full_recompute():
    model = tiny_model()
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    result = generate(model, FullCache(model, 1, 64), [prompt], 24, temperature=0)
    sequence = torch.tensor([prompt + result.tokens[0]])
    with torch.no_grad():
        model.setup_caches(1, 64)
        logits = model(sequence, torch.arange(sequence.shape[1])[None])
    recomputed = logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert recomputed == result.tokens[0]


def test_greedy_generation_is_reproducible_and_sampling_follows_the_seed():
    model = tiny_model()
    cache = FullCache(model, 1, 64)
    prompt = list(range(10, 30))
    assert (
        generate(model, cache, [prompt], 20, temperature=0).tokens
        == generate(model, cache, [prompt], 20, temperature=0).tokens
    )
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate(model, cache, [prompt], 20, temperature=1.0, top_k=20).tokens)
    assert runs[0] == runs[1]


def test_ragged_batch_equals_each_prompt_alone():
    model = tiny_model()
    prompts = [list(range(5, 12)), list(range(20, 53)), list(range(40, 60))]
    batched = generate(model, FullCache(model, 3, 80), prompts, 16, temperature=0)
    for i, prompt in enumerate(prompts):
        alone = generate(model, FullCache(model, 1, 80), [prompt], 16, temperature=0)
        assert alone.tokens[0] == batched.tokens[i]
    assert batched.prompt_lengths == [7, 33, 20]


def test_generation_stops_at_stop_tokens_per_sequence():
    model = tiny_model()
    cache = FullCache(model, 2, 64)
    prompts = [list(range(5, 12)), list(range(20, 33))]
    free = generate(model, cache, prompts, 12, temperature=0).tokens
    stop = free[0][3]
    stopped = generate(model, cache, prompts, 12, temperature=0, stop_ids=frozenset({stop})).tokens
    assert stopped[0] == free[0][: free[0].index(stop) + 1]
    expected_second = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert stopped[1] == expected_second


@pytest.mark.parametrize("whole_step", [False, True])
def test_compiled_flex_decode_matches_eager_and_never_recompiles(whole_step):
    """Per block (FlexAttention's block mask, or on a CPU the dense kernel) and the whole step."""
    from torch._dynamo.utils import counters

    model = tiny_model()
    prompts = [list(range(5, 40)), list(range(20, 30))]
    # crosses blocks 128, 256
    eager = generate(model, FullCache(model, 2, 300), prompts, 240, temperature=0)
    torch._dynamo.reset()
    counters.clear()
    compile_decode(model, whole_step=whole_step)
    flex = FullCache(model, 2, 300, use_flex=True)
    generate(model, flex, [p[:5] for p in prompts], 4, temperature=0)  # compile once
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate(model, flex, prompts, 240, temperature=0)
    assert compiled.tokens == eager.tokens
    assert counters["stats"]["unique_graphs"] == graphs, "decode recompiled as the position moved"
    torch._dynamo.reset()


@pytest.mark.parametrize("method", ["full-16bit", "specache-1bit", "kivi-1bit", "h2o"])
def test_bfloat16_prefill_products_round_the_linears_alone(method):
    """GenerateOptions.prefill_products (--prefill_dtype bfloat16): prefill's
    Linears multiply in bfloat16, decode's in float32; the caches take float32 rows (no error in
    their own ops: SpeCache's window is float16, which CPU autocast cannot promote) and the logits
    stay float32, close to the float32 prefill's."""
    model = tiny_model()
    prompt = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    seen = []
    hook = model.layers[0].feed_forward.w1.register_forward_hook(
        lambda module, inputs, output: seen.append((output.shape[1], output.dtype))
    )
    options = GenerateOptions(prefill_products=torch.bfloat16)
    result = generate(
        model, make_cache(method, model, 1, 200, topk=8), [prompt], 6, options=options
    )
    hook.remove()
    assert seen[0] == (150, torch.bfloat16) and {dtype for _, dtype in seen[1:]} == {torch.float32}
    assert len(result.tokens[0]) == 6

    tokens, lengths = pad_prompts([prompt], torch.device("cpu"))
    logits = {}
    for products in (None, torch.bfloat16):
        cache = make_cache(method, model, 1, 200, topk=8)
        cache.begin(tokens, lengths, 0)
        autocast = torch.autocast(
            "cpu", dtype=torch.bfloat16, enabled=products is not None, cache_enabled=False
        )
        with torch.no_grad(), autocast:
            logits[products] = prefill_pass(model, tokens, lengths, 0, 0, len(prompt))
    assert logits[torch.bfloat16].dtype == torch.float32
    moved = (logits[torch.bfloat16] - logits[None]).abs().max()
    assert 0 < moved < 0.02 * logits[None].abs().max()
