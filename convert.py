"""Checkpoint conversion into this project's `model.pth` layout: from HF transformers files and from
GGUF files (llama.cpp's format), offline.

HF (`convert_hf_checkpoint`): reads `model.safetensors`, a sharded `*.index.json` (safetensors or
.bin) or `pytorch_model.bin`, renames the tensors, fuses q/k/v, and permutes q/k from HF's
rotate-half RoPE layout into the interleaved layout `model.py` uses. Gemma-3 also gets its q/k norm
weights permuted the same way (they scale the channels RoPE then pairs up), 1 added to every
RMSNorm weight (Gemma's norm multiplies by 1 + w), and, from a multimodal checkpoint (4B and up),
only its language model.

GGUF (`convert_gguf`, llama, gemma3 and qwen2 architectures): writes `model.pth` (tensors
dequantized to fp32 with llama.cpp's own `gguf` package), an HF-style `config.json`, and the
tokenizer rebuilt from the GGUF vocabulary: `tokenizer.json` + `tokenizer_config.json` for
byte-level BPE (llama; Qwen2 with its own split regex and NFC), a SentencePiece `tokenizer.model`
for Gemma-3 (`build_sentencepiece_model`). llama.cpp stores the llama architecture's q/k weights in
the interleaved layout already; it keeps Gemma-3's and Qwen2's in HF's rotate-half layout, so they
(with Gemma's q/k norm weights and Qwen2's q/k biases) are permuted here. Gemma's RMSNorm weights
are stored as 1 + w in the GGUF already. Gemma-3 facts the GGUF does not carry are llama.cpp's
(src/llama-model.cpp): local layers use RoPE base 10000, every 6th layer is global, and scores are
scaled by head_dim^-1/2 (dim / heads for the 27B model).

Files are written to a temporary name and renamed at the end, so an interrupted run never leaves a
half-written model.pth. The command-line tools are scripts/convert/convert_hf_checkpoint.py,
scripts/convert/convert_gguf.py and scripts/convert/gguf_sentencepiece.py.

Gemma 3's tokenizer from its GGUF: a GGUF of a SentencePiece model ("tokenizer.ggml.model" =
"llama") stores every piece with its score
and type, but not the ModelProto's trainer and normalizer specs, and llama.cpp's converter rewrote
some pieces on the way in. `build_sentencepiece_model` undoes that and fills in the specs so that
`sentencepiece` encodes exactly as Gemma 3's own tokenizer.model does:

- Specs: a BPE model with byte fallback; normalizer "identity" (no charsmap), no dummy prefix, no
  removal of extra whitespace, spaces escaped to U+2581 -- Gemma's "split digits, preserved
  whitespace, byte-level encodings" (the GGUF's add_space_prefix is False). split_digits and
  allow_whitespace_only_pieces are training options, set only to describe the model truthfully.
- Types: llama.cpp marks as CONTROL every token that HF's tokenizer_config calls special. In the
real
  model only <pad>, <eos> and <bos> are control and <unk> is unknown; the rest (<start_of_turn>,
  <end_of_turn>, <mask>, <unusedN>, ...) are user-defined, so text that spells them encodes to the
  one token and decodes back to the text. The real model counts 255474 normal, 6410 user-defined,
  256 byte, 3 control and 1 unknown pieces; this mapping gives the same counts for Gemma 3's GGUF.
- Spaces: llama.cpp respells a user-defined piece's U+2581 as a real space ("  " for
"\u2581\u2581").
  The normalizer turns every space into U+2581 before pieces are matched, so a piece holding a real
  space could never match; it is spelled back. In Gemma 3 these are exactly the 30 runs of 2 to 31
  spaces: no piece mixes spaces with newlines or tabs, and the newline and tab runs, which the
  normalizer leaves alone, stay as they are.
- Scores: as the file stores them. Normal pieces keep SentencePiece's own scores, which order BPE's
  merges. The -1000 llama.cpp wrote for the added tokens is never read: SentencePiece merges only
  into normal and user-defined pieces, and a merge never yields a user-defined piece, since the
  matcher would have taken that piece whole where it starts.

The ModelProto is built with the classes sentencepiece ships, which need `protobuf`.
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from config import ModelArgs

# --- HF transformers checkpoints --------------------------------------------------------------

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
LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def rotate_half_to_interleaved(w: torch.Tensor, n_head: int, head_dim: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection (weight or bias) from HF's layout to RoPE pairs."""
    rest = w.shape[1:]
    return (
        w.reshape(n_head, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_head * head_dim, *rest)
    )


def permute_qk(state_dict: dict, config: ModelArgs) -> None:
    """q/k projections (and q/k norm weights, which scale the same channels) from rotate-half to
    interleaved, in place."""
    for key in [k for k in state_dict if ".wq." in k]:
        state_dict[key] = rotate_half_to_interleaved(
            state_dict[key], config.n_head, config.head_dim
        )
        k_key = key.replace(".wq.", ".wk.")
        state_dict[k_key] = rotate_half_to_interleaved(
            state_dict[k_key], config.n_local_heads, config.head_dim
        )
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
        files = [
            name
            for name in ("model.safetensors", "pytorch_model.bin")
            if (checkpoint_dir / name).is_file()
        ][:1]
    if not files:
        raise FileNotFoundError(
            f"{checkpoint_dir} has no model.safetensors, pytorch_model.bin or sharded index; "
            "download the model first (scripts/convert/download.py)"
        )
    state_dict = {}
    for name in files:
        path = checkpoint_dir / name
        if name.endswith(".safetensors"):
            state_dict.update(load_file(str(path), device="cpu"))
        else:
            state_dict.update(
                torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            )
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
                key = replacement + key[len(prefix) :]
        abstract_key = re.sub(r"\.(\d+)\.", ".{}.", key, count=1)
        if abstract_key not in weight_map:
            raise KeyError(
                f"unexpected tensor {key!r} in the HF checkpoint (not a Llama-family or Gemma-3 "
                "model?)"
            )
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
        config = ModelArgs.from_hf_config(
            json.loads(config_file.read_text()), name=checkpoint_dir.name
        )
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


# --- GGUF files --------------------------------------------------------------------------------

# GGUF's token types use SentencePiece's numbering (1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

TENSOR_NAMES = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "blk.{}.attn_norm.weight": "layers.{}.attention_norm.weight",
    "blk.{}.attn_q.weight": "layers.{}.attention.wq.weight",
    "blk.{}.attn_k.weight": "layers.{}.attention.wk.weight",
    "blk.{}.attn_v.weight": "layers.{}.attention.wv.weight",
    # Qwen2
    "blk.{}.attn_q.bias": "layers.{}.attention.wq.bias",
    "blk.{}.attn_k.bias": "layers.{}.attention.wk.bias",
    "blk.{}.attn_v.bias": "layers.{}.attention.wv.bias",
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

# llama.cpp names the pre-tokenizer; these are the byte-level BPE ones whose regex we can express:
# the splits before the byte-level step, and whether that step splits with GPT-2's regex too.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    # "\p{N}" first, then GPT-2's regex
    "smollm": ([{"type": "Digits", "individual_digits": True}], True),
    "gpt2": ([], True),
    "default": ([], True),
    # Qwen2's own regex (digits one by one), as its tokenizer.json has it
    "qwen2": (
        [
            {
                "type": "Split",
                "pattern": {"Regex": QWEN2_SPLIT},
                "behavior": "Isolated",
                "invert": False,
            }
        ],
        False,
    ),
}
# text normalized before the splits (Qwen2: NFC)
NORMALIZERS = {"qwen2": {"type": "NFC"}}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "gemma3", "qwen2"):
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported here (only llama, gemma3 and qwen2)"
        )
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
    if arch == "qwen2":
        tokens = _field(reader, "tokenizer.ggml.tokens")
        config.update(
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "attention_bias": True,
                # an instruct model's turn ends with <|im_end|>, a document with <|endoftext|>
                "eos_token_id": [config["eos_token_id"]]
                + [tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokens],
            }
        )
        config["eos_token_id"] = list(dict.fromkeys(config["eos_token_id"]))
    if arch == "gemma3":
        head_dim = _field(reader, "gemma3.attention.key_length")
        scaling = _field(reader, "gemma3.rope.scaling.type")
        config.update(
            {
                "model_type": "gemma3_text",
                "architectures": ["Gemma3ForCausalLM"],
                "head_dim": head_dim,
                "sliding_window": _field(reader, "gemma3.attention.sliding_window"),
                "sliding_window_pattern": 6,
                "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": dim // n_head if n_layer == 62 else head_dim,
                "rope_scaling": {
                    "rope_type": "linear",
                    "factor": _field(reader, "gemma3.rope.scaling.factor"),
                }
                if scaling == "linear"
                else None,
            }
        )
        tokens = _field(reader, "tokenizer.ggml.tokens")
        # Gemma's chat turns end with it; generation should stop there too
        if "<end_of_turn>" in tokens:
            config["eos_token_id"] = [config["eos_token_id"], tokens.index("<end_of_turn>")]
    return config


def read_state_dict(reader, config: Optional[dict] = None) -> dict:
    """model.pth's tensors, fp32; `config` (read_config's) says whether q/k need permuting."""
    from gguf.quants import dequantize

    state_dict = {}
    for tensor in tqdm(
        reader.tensors, desc="Dequantizing GGUF tensors", unit="tensor", file=sys.stderr
    ):
        parts = tensor.name.split(".")
        layer = parts[1] if parts[0] == "blk" else None
        key = ".".join(parts[:1] + ["{}"] + parts[2:]) if layer is not None else tensor.name
        if key not in TENSOR_NAMES:
            raise KeyError(f"unexpected GGUF tensor {tensor.name!r}")
        array = dequantize(tensor.data, tensor.tensor_type)
        state_dict[TENSOR_NAMES[key].format(layer)] = torch.from_numpy(array.copy()).float()
    # llama.cpp keeps the q/k rows of architectures with rotate-half RoPE as HF has them
    if config is not None and config["model_type"] in ("gemma3_text", "qwen2"):
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
    # control tokens are special (skipped in decoding); user-defined ones (Qwen's <tool_call>) are
    # text that encodes to the one token
    added = [
        {
            "id": i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": kind == CONTROL,
        }
        for i, (tok, kind) in enumerate(zip(tokens, token_types))
        if kind in (CONTROL, USER_DEFINED)
    ]
    splits, byte_level_regex = PRE_TOKENIZERS[pre]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": byte_level_regex,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": NORMALIZERS.get(pre),
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": splits + [byte_level]},
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges") or []],
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
        files += [
            ("tokenizer.json", build_tokenizer_json(reader)),
            ("tokenizer_config.json", build_tokenizer_config(reader)),
        ]
    for name, content in files:
        (checkpoint_dir / name).write_text(json.dumps(content, ensure_ascii=False, indent=1))
    out = checkpoint_dir / "model.pth"
    # last: a present model.pth means a complete directory
    save_atomically(read_state_dict(reader, config), out)
    return out


# --- SentencePiece from a GGUF vocabulary (Gemma 3) -----------------------------------------------


def build_sentencepiece_model(reader) -> bytes:
    """A serialized SentencePiece ModelProto for the GGUF vocabulary `reader` (a `gguf.GGUFReader`)
    holds."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if _field(reader, "tokenizer.ggml.model") != "llama":
        raise ValueError("the GGUF does not describe a SentencePiece ('llama') vocabulary")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    special = {
        name: _field(reader, f"tokenizer.ggml.{key}")
        for name, key in (
            ("unk", "unknown_token_id"),
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
        )
    }
    control_ids = {special["bos"], special["eos"], special["pad"]} - {None}

    model = pb.ModelProto()
    for i, (token, score, token_type) in enumerate(zip(tokens, scores, types)):
        if i == special["unk"]:
            token_type = UNKNOWN  # SentencePiece needs exactly one; llama.cpp marks it control
        elif token_type == CONTROL and i not in control_ids:
            token_type = USER_DEFINED
        if " " in token:
            token = token.replace(" ", "\u2581")
        model.pieces.add(piece=token, score=score, type=token_type)

    trainer = model.trainer_spec
    trainer.model_type = pb.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = True
    trainer.split_digits = True
    trainer.allow_whitespace_only_pieces = True
    trainer.treat_whitespace_as_suffix = False
    for name in ("unk", "bos", "eos", "pad"):  # an absent one is -1, as SentencePiece writes it
        i = special[name]
        setattr(trainer, f"{name}_id", -1 if i is None else i)
        if i is not None:
            setattr(trainer, f"{name}_piece", model.pieces[i].piece)

    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    # llama.cpp's default for a SentencePiece vocabulary that does not say (Llama-2); Gemma says
    # False.
    normalizer.add_dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return model.SerializeToString()
