"""SpeCache on the real default model (SmolLM2-135M-Instruct, fp32, greedy) and a 2k-token
needle-in-a-haystack prompt (Paul Graham essays, needle at 10% depth), against the full cache.

Mismatch budget: "reproduces" means at most 2 of the first 32 generated tokens differ from the
full cache's (the full cache answers in 24 tokens and stops).
"""
import pytest

from generate import generate
from scripts.haystack import answered, needle_prompt
from specache import SpeCacheConfig, setup_specache, specache_generate
from tokenizer import get_tokenizer

NEW_TOKENS = 32
METHODS = {
    "specache-1bit": SpeCacheConfig(bits=1, stats=True),
    "specache-2bit": SpeCacheConfig(bits=2, stats=True),
    "specache-nospec-1bit": SpeCacheConfig(bits=1, speculative=False),
    "kivi-1bit": SpeCacheConfig(bits=1, topk=0),
    "fetch-everything": SpeCacheConfig(bits=1, topk=4096),
}


@pytest.fixture(scope="module")
def runs(smollm2_model, smollm2_checkpoint):
    tokenizer = get_tokenizer(smollm2_checkpoint.parent)
    stop_ids = frozenset(tokenizer.stop_ids)
    prompt = needle_prompt(tokenizer, 2000, 10)
    model = smollm2_model
    model.setup_caches(1, len(prompt) + NEW_TOKENS)
    results = {"full": generate(model, [prompt], NEW_TOKENS, temperature=0, stop_ids=stop_ids)}
    for name, config in METHODS.items():
        state = setup_specache(model, 1, len(prompt) + NEW_TOKENS, config)
        results[name] = specache_generate(model, state, [prompt], NEW_TOKENS, temperature=0, stop_ids=stop_ids)
    text = {name: tokenizer.decode(r.tokens[0]) for name, r in results.items()}
    return results, text


def mismatches(result, reference):
    ours, ref = result.tokens[0][:NEW_TOKENS], reference.tokens[0][:NEW_TOKENS]
    return sum(a != b for a, b in zip(ours, ref)) + abs(len(ours) - len(ref))


def test_the_full_cache_answers(runs):
    results, text = runs
    assert answered(text["full"]), text["full"]


def test_fetching_every_position_with_16_bit_pairs_reproduces_the_full_cache(runs):
    results, _ = runs
    assert mismatches(results["fetch-everything"], results["full"]) == 0


def test_specache_2bit_reproduces_the_full_cache_and_answers(runs):
    results, text = runs
    assert answered(text["specache-2bit"]), text["specache-2bit"]
    assert mismatches(results["specache-2bit"], results["full"]) <= 2


def test_one_bit_copy_answers_when_its_own_top_k_is_fetched(runs):
    """SpeCache's 1-bit copy with the exact top-k of the real token (the non-speculative baseline)."""
    results, text = runs
    assert answered(text["specache-nospec-1bit"]), text["specache-nospec-1bit"]
    assert mismatches(results["specache-nospec-1bit"], results["full"]) <= 2


def test_kivi_1bit_alone_forgets_the_needle(runs):
    results, text = runs
    assert not answered(text["kivi-1bit"])
    assert mismatches(results["kivi-1bit"], results["full"]) > 10
    assert mismatches(results["specache-nospec-1bit"], results["full"]) < mismatches(results["kivi-1bit"],
                                                                                     results["full"])


def test_speculative_1bit_is_measured(runs):
    """The paper's speculative rule at 1 bit on this model: recorded, not hidden (see the README).

    It is no worse than KIVI-1bit alone, and its statistics are in range; it does not answer this
    needle (the speculative row's top-k misses the needle at the token that needs it).
    """
    results, _ = runs
    spec = results["specache-1bit"]
    assert mismatches(spec, results["full"]) <= mismatches(results["kivi-1bit"], results["full"])
    assert 0 <= spec.stats["speculative_match_rate"] <= 1 and 0 < spec.stats["recall_at_k"] <= 1
    assert spec.stats["bytes_fetched_per_token"] == 64 * 2 * 64 * 2 * 3 * 30  # k pairs of fp16 K+V, 3 heads, 30 layers
