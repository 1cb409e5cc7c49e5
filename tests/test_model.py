"""Our model == HF transformers on tiny random configs, through the real converter and loader."""
import pytest
import torch

from conftest import TINY_HF_KINDS, make_tiny_hf_model
from generate import load_model
from model import ModelArgs, Transformer, apply_rope_scaling
from scripts.convert_hf_checkpoint import convert_hf_checkpoint


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
            logits.append(model(ids[:, pos: pos + 1], torch.full((2, 1), pos)))
    ours = torch.cat(logits, dim=1)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-4)


def test_rope_scaling_matches_hf_llama3_frequencies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0, max_position_embeddings=131072,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192))
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
    expected = {"SmolLM2-135M": 135e6, "SmolLM2-360M": 362e6, "SmolLM2-1.7B": 1.71e9, "Qwen2.5-0.5B": 494e6,
                "Qwen2.5-1.5B": 1.54e9, "Qwen2.5-3B": 3.09e9, "Qwen2.5-7B": 7.62e9, "Llama-2-7b": 6.74e9,
                "Llama-2-13b": 13.0e9, "Meta-Llama-3-8B": 8.03e9, "Mistral-7B-v0.2": 7.24e9}
    for name, count in expected.items():
        with torch.device("meta"):
            model = Transformer.from_name(name)
        n = sum(p.numel() for p in model.parameters())
        assert abs(n - count) / count < 0.02, (name, n, count)


def test_sliding_window_models_refuse_longer_contexts():
    with torch.device("meta"):
        model = Transformer.from_name("Mistral-7B-v0.1")
    with pytest.raises(ValueError, match="sliding-window"):
        model.setup_caches(1, 8192)
