"""Convert a HF transformers Llama-family or Gemma-3 checkpoint into this project's `model.pth`.

Reads `model.safetensors`, a sharded `*.index.json` (safetensors or .bin) or `pytorch_model.bin`
from the checkpoint directory, renames the tensors, fuses q/k/v, and permutes q/k from HF's
rotate-half RoPE layout into the interleaved layout `model.py` uses. Gemma-3 also gets its q/k
norm weights permuted the same way (they scale the channels RoPE then pairs up), 1 added to every
RMSNorm weight (Gemma's norm multiplies by 1 + w), and, from a multimodal checkpoint (4B and up),
only its language model. The file is written to a
temporary name and renamed at the end, so an interrupted run never leaves a half-written model.pth.

    python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-360M-Instruct
"""
import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import ModelArgs  # noqa: E402

WEIGHT_MAP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


# Gemma-3 names its four norms differently; the rest is Llama's.
GEMMA3_WEIGHT_MAP = {
    **WEIGHT_MAP,
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_norm.weight",
    "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.post_ffn_norm.weight",
}
# A multimodal Gemma-3 keeps its language model under one of these prefixes (old and new
# transformers), beside a vision tower and projector that a text model has no use for.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                           "language_model.lm_head.": "lm_head."}
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def rotate_half_to_interleaved(w: torch.Tensor, n_head: int, head_dim: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection (weight or bias) from HF's layout to RoPE pairs."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_head * head_dim, *rest)


def permute_qk(state_dict: dict, config: ModelArgs) -> None:
    """q/k projections (and q/k norm weights, which scale the same channels) from rotate-half to
    interleaved, in place."""
    for key in [k for k in state_dict if ".wq." in k]:
        state_dict[key] = rotate_half_to_interleaved(state_dict[key], config.n_head, config.head_dim)
        k_key = key.replace(".wq.", ".wk.")
        state_dict[k_key] = rotate_half_to_interleaved(state_dict[k_key], config.n_local_heads, config.head_dim)
    for key in [k for k in state_dict if k.endswith((".q_norm.weight", ".k_norm.weight"))]:
        state_dict[key] = rotate_half_to_interleaved(state_dict[key], 1, config.head_dim)


def fuse_qkv(state_dict: dict) -> None:
    """Replace each layer's separate wq, wk, wv (weight and bias) by one fused wqkv, in place."""
    for key in [k for k in state_dict if ".wq." in k]:
        parts = [state_dict.pop(key.replace(".wq.", f".w{n}.")) for n in "qkv"]
        state_dict[key.replace(".wq.", ".wqkv.")] = torch.cat(parts)


def load_hf_state_dict(checkpoint_dir: Path) -> dict:
    from safetensors.torch import load_file

    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = checkpoint_dir / index_name
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            break
    else:
        files = [name for name in ("model.safetensors", "pytorch_model.bin") if (checkpoint_dir / name).is_file()][:1]
    if not files:
        raise FileNotFoundError(
            f"{checkpoint_dir} has no model.safetensors, pytorch_model.bin or sharded index; "
            "download the model first (scripts/download.py)")
    state_dict = {}
    for name in files:
        path = checkpoint_dir / name
        if name.endswith(".safetensors"):
            state_dict.update(load_file(str(path), device="cpu"))
        else:
            state_dict.update(torch.load(str(path), map_location="cpu", mmap=True, weights_only=True))
    return state_dict


def convert_state_dict(hf_state_dict: dict, config: ModelArgs) -> dict:
    gemma = config.sandwich_norm
    weight_map = GEMMA3_WEIGHT_MAP if gemma else WEIGHT_MAP
    converted = {}
    for key, value in hf_state_dict.items():
        if key.startswith(VISION_PREFIXES):
            continue
        for prefix, replacement in LANGUAGE_MODEL_PREFIXES.items():
            if key.startswith(prefix):
                key = replacement + key[len(prefix):]
        abstract_key = re.sub(r"\.(\d+)\.", ".{}.", key, count=1)
        if abstract_key not in weight_map:
            raise KeyError(f"unexpected tensor {key!r} in the HF checkpoint (not a Llama-family or Gemma-3 model?)")
        new_key = weight_map[abstract_key]
        if new_key is None:
            continue
        layer = re.search(r"\.(\d+)\.", key)
        converted[new_key.format(layer.group(1)) if layer else new_key] = value
    permute_qk(converted, config)
    if gemma:
        for key in [k for k in converted if k.endswith("norm.weight")]:
            converted[key] = converted[key].float() + 1
    fuse_qkv(converted)
    if config.tie_embeddings:
        converted.pop("output.weight", None)
    return converted


def save_atomically(state_dict: dict, path: Path) -> None:
    """torch.save to a temporary file in the same directory, then rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(state_dict, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@torch.inference_mode()
def convert_hf_checkpoint(checkpoint_dir: Path, model_name: Optional[str] = None) -> Path:
    config_file = checkpoint_dir / "config.json"
    if config_file.is_file():
        config = ModelArgs.from_hf_config(json.loads(config_file.read_text()), name=checkpoint_dir.name)
    else:
        config = ModelArgs.from_name(model_name or checkpoint_dir.name)
    state_dict = convert_state_dict(load_hf_state_dict(checkpoint_dir), config)
    out = checkpoint_dir / "model.pth"
    print(f"Saving checkpoint to {out}", file=sys.stderr)
    save_atomically(state_dict, out)
    # Llama-3 ships its tiktoken vocabulary as original/tokenizer.model.
    original_tokenizer = checkpoint_dir / "original" / "tokenizer.model"
    if original_tokenizer.is_file() and not (checkpoint_dir / "tokenizer.json").is_file():
        shutil.copy(original_tokenizer, checkpoint_dir / "tokenizer.model")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", type=Path, required=True,
                        help="directory holding the HF checkpoint (config.json, *.safetensors or *.bin)")
    parser.add_argument("--model_name", type=str, default=None,
                        help="preset name, used only when the directory has no config.json")
    args = parser.parse_args()
    convert_hf_checkpoint(args.checkpoint_dir, args.model_name)


if __name__ == "__main__":
    main()
