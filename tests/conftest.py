import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from model import ModelArgs, Transformer  # noqa: E402

TINY_HF_KINDS = {
    "llama-mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "llama-gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "llama-tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "llama3.1-scaling": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=32)),
    "qwen2-bias": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def make_tiny_hf_model(kind: str, seed: int = 0):
    """A random 2-layer HF model; weights drawn wide enough that logits are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, **TINY_HF_KINDS[kind])
    if kind.startswith("qwen2"):
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    return model.eval()


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """Our own tiny random model (GQA), for tests that need no HF reference."""
    torch.manual_seed(seed)
    config = dict(block_size=1024, vocab_size=97, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                  intermediate_size=96, rope_base=10000)
    config.update(overrides)
    model = Transformer(ModelArgs(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.15)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The default model's model.pth (prepared once, from the GGUF, as generate.py does)."""
    from scripts.convert_gguf import prepare_default_checkpoint

    return prepare_default_checkpoint()


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    from scripts.convert_gguf import find_default_gguf

    return find_default_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def smollm2_model(smollm2_checkpoint):
    from generate import load_model

    return load_model(smollm2_checkpoint, torch.device("cpu"), torch.float32)
