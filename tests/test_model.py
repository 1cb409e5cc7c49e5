"""Our model == HF transformers on tiny random configs, through the real converter and loader."""

import pytest
import torch

from conftest import TINY_HF_KINDS, make_tiny_hf_model
from checkpoint import load_model
from config import ModelArgs
from model import Transformer, apply_rope_scaling
from convert import convert_hf_checkpoint


def converted(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    return load_model(convert_hf_checkpoint(tmp_path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("kind", list(TINY_HF_KINDS))
def test_logits_match_hf_prefill_and_cached_decode(kind, tmp_path):
    hf = make_tiny_hf_model(kind)
    model = converted(hf, tmp_path)
    assert model.config.qkv_bias == kind.startswith("qwen2")
    assert model.config.tie_embeddings == bool(TINY_HF_KINDS[kind].get("tie_word_embeddings"))

    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 80))
    with torch.no_grad():
        reference = hf(ids).logits
        model.setup_caches(max_batch_size=2, max_seq_length=96)
        prompt = 60
        logits = [model(ids[:, :prompt], torch.arange(prompt).expand(2, -1))]
        for pos in range(prompt, ids.shape[1]):  # token-by-token decode reading the cache
            logits.append(model(ids[:, pos : pos + 1], torch.full((2, 1), pos)))
    ours = torch.cat(logits, dim=1)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


def test_rope_scaling_matches_hf_llama3_frequencies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    hf_freqs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    ours = apply_rope_scaling(base, ModelArgs.from_hf_config(config.to_dict()).rope_scaling)
    torch.testing.assert_close(ours.float(), hf_freqs.float())


def test_presets_resolve_by_directory_name():
    assert ModelArgs.from_name("SmolLM2-135M-Instruct").n_layer == 30
    assert ModelArgs.from_name("Mistral-7B-Instruct-v0.2").rope_base == 1000000
    assert ModelArgs.from_name("Meta-Llama-3-8B-Instruct").vocab_size == 128256
    assert ModelArgs.from_name("Llama-3.1-8B-Instruct").rope_scaling["factor"] == 8.0
    assert ModelArgs.from_name("Qwen2.5-0.5B-Instruct").qkv_bias
    with pytest.raises(ValueError, match="no preset"):
        ModelArgs.from_name("gpt2")


def test_preset_shapes_match_parameter_counts():
    """The preset table against the published sizes (within 2%: sizes are rounded)."""
    expected = {
        "SmolLM2-135M": 135e6,
        "SmolLM2-360M": 362e6,
        "SmolLM2-1.7B": 1.71e9,
        "Qwen2.5-0.5B": 494e6,
        "Qwen2.5-1.5B": 1.54e9,
        "Qwen2.5-3B": 3.09e9,
        "Qwen2.5-7B": 7.62e9,
        "Llama-2-7b": 6.74e9,
        "Llama-2-13b": 13.0e9,
        "Meta-Llama-3-8B": 8.03e9,
        "Mistral-7B-v0.2": 7.24e9,
    }
    for name, count in expected.items():
        with torch.device("meta"):
            model = Transformer.from_name(name)
        n = sum(p.numel() for p in model.parameters())
        assert abs(n - count) / count < 0.02, (name, n, count)


def test_ring_buffer_equals_full_attention_with_a_window_mask():
    """A sliding-window layer's ring of 16 slots, through a ragged prefill (prompts of 40 and 23,
    padded to 40) and decode steps, against full attention over all positions with the window
    mask."""
    from model import CausalPrompt, RingKVCache

    torch.manual_seed(0)
    window, heads, kv_heads, dim, total = 16, 4, 2, 8, 60
    q = torch.randn(2, heads, total, dim)
    k, v = torch.randn(2, kv_heads, total, dim), torch.randn(2, kv_heads, total, dim)
    pos = torch.arange(total)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, enable_gqa=True
    )

    ring = RingKVCache(2, window, kv_heads, dim, torch.float32)
    lengths = torch.tensor([40, 23])
    prompt = ring(
        q[:, :, :40], k[:, :, :40], v[:, :, :40], pos[:40].expand(2, -1), CausalPrompt(lengths)
    )
    torch.testing.assert_close(prompt[0], expected[0, :, :40])
    torch.testing.assert_close(prompt[1, :, :23], expected[1, :, :23])
    steps = [lengths.clone()]
    for _ in range(total - 41):  # one new position per sequence per step, each at its own position
        at = steps[-1]
        b = torch.arange(2)
        y = ring(
            q[b, :, at].unsqueeze(2),
            k[b, :, at].unsqueeze(2),
            v[b, :, at].unsqueeze(2),
            at[:, None],
            None,
        )
        torch.testing.assert_close(y[:, :, 0], expected[b, :, at])
        steps.append(at + 1)


def test_mistral_sliding_window_preset_sets_up_rings():
    from model import RingKVCache

    with torch.device("meta"):
        model = Transformer.from_name("Mistral-7B-v0.1")
    model.setup_caches(1, 8192)
    assert all(
        isinstance(b.attention.kv_cache, RingKVCache)
        and b.attention.kv_cache.k_cache.shape[2] == 4096
        for b in model.layers
    )


def test_gemma3_preset_layer_layout():
    config = ModelArgs.from_name("gemma-3-270m")
    assert [i for i in range(config.n_layer) if config.window(i) is None] == [5, 11, 17]
    with torch.device("meta"):
        model = Transformer(config)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 268e6) / 268e6 < 0.02, n
