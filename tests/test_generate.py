"""Generation: cache vs recompute, compiled vs eager, ragged batches, reproducibility."""
import torch

from conftest import tiny_model
from generate import compile_decode, generate


def test_cached_decode_equals_full_recompute():
    model = tiny_model()
    model.setup_caches(1, 64)
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    result = generate(model, [prompt], 24, temperature=0)
    sequence = torch.tensor([prompt + result.tokens[0]])
    with torch.no_grad():
        model.setup_caches(1, 64)
        logits = model(sequence, torch.arange(sequence.shape[1])[None])
    recomputed = logits[0, len(prompt) - 1: -1].argmax(-1).tolist()
    assert recomputed == result.tokens[0]


def test_greedy_generation_is_reproducible_and_sampling_follows_the_seed():
    model = tiny_model()
    model.setup_caches(1, 64)
    prompt = list(range(10, 30))
    assert generate(model, [prompt], 20, temperature=0).tokens == generate(model, [prompt], 20, temperature=0).tokens
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate(model, [prompt], 20, temperature=1.0, top_k=20).tokens)
    assert runs[0] == runs[1]


def test_ragged_batch_equals_each_prompt_alone():
    model = tiny_model()
    prompts = [list(range(5, 12)), list(range(20, 53)), list(range(40, 60))]
    model.setup_caches(3, 80)
    batched = generate(model, prompts, 16, temperature=0)
    for i, prompt in enumerate(prompts):
        model.setup_caches(1, 80)
        alone = generate(model, [prompt], 16, temperature=0)
        assert alone.tokens[0] == batched.tokens[i]
    assert batched.prompt_lengths == [7, 33, 20]


def test_generation_stops_at_stop_tokens_per_sequence():
    model = tiny_model()
    model.setup_caches(2, 64)
    prompts = [list(range(5, 12)), list(range(20, 33))]
    free = generate(model, prompts, 12, temperature=0).tokens
    stop = free[0][3]
    stopped = generate(model, prompts, 12, temperature=0, stop_ids=frozenset({stop})).tokens
    assert stopped[0] == free[0][: free[0].index(stop) + 1]
    expected_second = free[1][: free[1].index(stop) + 1] if stop in free[1] else free[1]
    assert stopped[1] == expected_second


def test_compiled_flex_decode_matches_eager_and_never_recompiles():
    from torch._dynamo.utils import counters

    model = tiny_model()
    prompts = [list(range(5, 40)), list(range(20, 30))]
    model.setup_caches(2, 300)  # decode crosses FlexAttention block boundaries (128, 256)
    eager = generate(model, prompts, 240, temperature=0)
    torch._dynamo.reset()
    counters.clear()
    compile_decode(model)
    generate(model, [p[:5] for p in prompts], 4, temperature=0, use_flex=True)  # compile once
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate(model, prompts, 240, temperature=0, use_flex=True)
    assert compiled.tokens == eager.tokens
    assert counters["stats"]["unique_graphs"] == graphs, "decode recompiled as the position moved"
    torch._dynamo.reset()
