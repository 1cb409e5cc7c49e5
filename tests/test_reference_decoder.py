"""specache/ against an independent reference decoder (tests/reference_decoder.py), with top-k
smaller than the context so that the selection matters.

Both decoders are greedy and fp32; they must produce the same tokens, and logits that differ only by
computation order: the implementation merges segments by log-sum-exp and subtracts the low-bit
contributions of the exact positions, the reference dequantizes everything and takes one softmax.
"""

import statistics

import pytest
import torch

from caches.plugged import PluggedSpeCache
from caches.by_name import parse_select
from conftest import tiny_model
from generation import generate
from reference_decoder import ReferenceDecoder
from specache import Method, Placement, SpeCacheConfig
from caches.stats import Diagnostics

NEW_TOKENS = 32

# Tiny model (logits up to ~5): the largest difference measured over the cases below is 1.4e-4
# (fp32 rounding); 1e-3 leaves room for that. Two legitimate effects exceed it, and the cases avoid
# both rather than loosen the tolerance:
# - a near-tie at the k-th place of a top-k: either order is right, and one swapped position moves
#   logits by 6e-3..4e-2 here. The reference reports its closest call (min_gap, relative); the
#   cases need it above TINY_MIN_GAP, 10x above how far the two decoders' probabilities differ.
#   Two equal tokens side by side get the same 1-bit key codes, hence exactly tied scores: prompts
#   here never repeat a token within 32 positions, but the random model's own output repeats. With
#   the lengths below, seeds 0-13 had a tie closer than that in some case (ties broken the other way
#   moved logits by up to 5); seed 14's closest call is 1.6e-5.
# - with fp32 pairs, a Lloyd level within 1e-7 of an fp16 rounding midpoint, where the order of the
#   fp32 mean decides which way it rounds: one fp16 step of one group's level, seen in
#   default-1bit-fp32pairs with seeds 0 and 4 (1.1e-3 and 6e-4). Seed 14 has none.
TINY_ATOL = 1e-3
TINY_MIN_GAP = 1e-5
TINY_SEED = 14
# ragged; 31 steps cross two window flushes (g = R = 16) in each; 47 leaves 31 = R + g - 1 in the
# window, so the bootstrap's prefetch may take window positions, which count only once quantized
TINY_LENGTHS = (70, 47, 130)

# SmolLM2 (logits up to ~45, 30 layers, k = 64 of ~1500): near-ties are unavoidable there (the
# closest call is ~1e-6), and a swapped pick in an early layer grows through the later ones.
# Measured:
# largest difference 0.065 (1-bit default) and 0.088 (2-bit paper), median over the passes of each
# pass's largest 2e-3 and 3.5e-3. Real errors are far larger even when the tokens still agree: with
# the reference's gqa mean/max swapped, or k_real off by one either way, the largest difference was
# 0.77..43 and the median 0.04..28. Hence 0.25 and 0.01.
SMOL_ATOL = 0.25
SMOL_MEDIAN_ATOL = 0.01


pytestmark = pytest.mark.usefixtures("one_thread")


def run_implementation(model, config, prompts, max_seq_length, oracle=None):
    """specache's tokens and every pass's logits after the prefill (bootstrap, then each step)."""
    probe = None
    if oracle is not None:
        probe = Diagnostics(
            model.config.n_layer,
            model.config.n_local_heads,
            torch.device("cpu"),
            oracle,
            observe=False,
        )
    cache = PluggedSpeCache(model, len(prompts), max_seq_length, config, probe=probe)
    # the capacities here are roomy: k and the sinks are the config's (see fast_tier_plan)
    layer = cache.layers[0]
    assert (layer.k_spec + layer.k_real, layer.n_sinks) == (
        config.method.topk,
        config.selection.sinks,
    )
    logits = []
    hook = model.output.register_forward_hook(
        lambda module, args, out: logits.append(out.detach().float().clone())
    )
    try:
        result = generate(model, cache, prompts, NEW_TOKENS, temperature=0)
    finally:
        hook.remove()
    return result.tokens, logits[1:]


def config_of(select, bits, group, residual, topk, speculative, fp32_pairs=False):
    """A SpeCacheConfig and the oracle its selection names (as --specache_select reads them)."""
    selection, _, _, oracle = parse_select(select)
    placement = Placement(pair_dtype=torch.float32 if fp32_pairs else None)
    return SpeCacheConfig(
        Method(bits, group, residual, topk, speculative), selection, placement
    ), oracle


def compare(model, config, prompts, max_seq_length, oracle=None):
    """Per pass, the largest logit difference; and the reference's closest top-k call."""
    tokens, logits = run_implementation(model, config, prompts, max_seq_length, oracle)
    reference = ReferenceDecoder(model, config, max_seq_length, oracle)
    ref_tokens, ref_logits = reference.generate(prompts, NEW_TOKENS)
    assert [len(t) for t in ref_tokens] == [NEW_TOKENS] * len(prompts)
    assert [x.shape for x in logits] == [x.shape for x in ref_logits]
    diffs = [(a - b.float()).abs().max().item() for a, b in zip(logits, ref_logits)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return tokens, ref_tokens, diffs, worst, reference.min_gap


def spread_prompt(length, generator, spread=32):
    """Random tokens, none repeated within `spread` positions (see TINY_ATOL)."""
    out = []
    while len(out) < length:
        token = int(torch.randint(0, 97, (1,), generator=generator))
        if token not in out[-spread:]:
            out.append(token)
    return out


# id: (select, bits, speculative, topk, fp32 pairs)
TINY_CASES = {
    "paper-1bit": ("paper", 1, True, 8, False),
    "paper-2bit-fp32pairs": ("paper", 2, True, 8, True),
    "default-1bit-fp32pairs": ("default", 1, True, 8, True),
    "default-2bit": ("default", 2, True, 8, False),
    "split": ("split", 1, True, 8, False),
    "gqa-max": ("gqa-max", 1, True, 8, True),
    "correct": ("correct", 1, True, 8, False),
    "sinks": ("sinks", 1, True, 8, True),
    "lloyd": ("lloyd", 1, True, 8, False),
    "midway": ("midway", 1, True, 8, False),
    "default-midway-fp32pairs": ("default,midway", 1, True, 8, True),
    "lookup": ("lookup", 1, True, 8, True),
    "reuse": ("reuse", 1, True, 8, False),
    "default-shortlist": ("default,shortlist=3", 1, True, 8, False),
    "default-no-shortlist": ("default,shortlist=0", 1, True, 8, False),
    "split-shortlist-fp32pairs": ("split,gqa-max,shortlist", 1, True, 8, True),
    "nonspec-shortlist-2bit": ("default,shortlist=2", 2, False, 8, False),
    "oracle": ("oracle", 1, True, 8, True),
    "oracle-mass": ("oracle=mass", 1, False, 8, False),
    # correct=0.2 discards about half the heads' prefetches on this model (0.9: most of them)
    "values": ("split=0.25,sinks=2,correct=0.2,gqa-max", 1, True, 8, False),
    "nonspec-paper-1bit": ("paper", 1, False, 8, False),
    "nonspec-default-2bit-fp32pairs": ("default", 2, False, 8, True),
    "kivi-1bit": ("paper", 1, True, 0, False),
    "kivi-2bit-fp32pairs": ("default", 2, False, 0, True),
}


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_model_matches_reference(case):
    select, bits, speculative, topk, fp32_pairs = TINY_CASES[case]
    config, oracle = config_of(select, bits, 16, 16, topk, speculative, fp32_pairs)
    model = tiny_model(TINY_SEED)
    generator = torch.Generator().manual_seed(TINY_SEED)
    prompts = [spread_prompt(n, generator) for n in TINY_LENGTHS]
    max_seq_length = max(TINY_LENGTHS) + NEW_TOKENS + 8
    tokens, ref_tokens, diffs, worst, min_gap = compare(
        model, config, prompts, max_seq_length, oracle
    )
    assert min_gap > TINY_MIN_GAP, (
        f"a near-tie in a top-k ({min_gap:.1e}): choose another seed or prompt"
    )
    assert tokens == ref_tokens
    assert diffs[worst] < TINY_ATOL, (
        f"pass {worst} of {len(diffs)}: logits differ by {diffs[worst]:.2e}"
    )


@pytest.fixture(scope="module")
def smollm2_prompt(smollm2_checkpoint):
    import tokenizer
    from scripts.eval.haystack import needle_prompt

    return needle_prompt(tokenizer.get_tokenizer(smollm2_checkpoint.parent), 1500, 50)


@pytest.mark.parametrize("bits, select", [(1, "default"), (2, "paper")])
def test_smollm2_matches_reference(smollm2_model, smollm2_prompt, bits, select):
    config, _ = config_of(select, bits, 64, 64, 64, True)
    max_seq_length = len(smollm2_prompt) + NEW_TOKENS + 8
    tokens, ref_tokens, diffs, worst, _ = compare(
        smollm2_model, config, [smollm2_prompt], max_seq_length
    )
    assert tokens == ref_tokens
    assert diffs[worst] < SMOL_ATOL, (
        f"pass {worst} of {len(diffs)}: logits differ by {diffs[worst]:.3f}"
    )
    assert statistics.median(diffs) < SMOL_MEDIAN_ATOL, [round(d, 4) for d in diffs]
