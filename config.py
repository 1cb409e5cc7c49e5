"""The model's shape: `ModelArgs`, its presets by name, and how a HF config.json maps onto it.

A checkpoint's config is its config.json when one sits beside it (`ModelArgs.for_checkpoint`),
else the preset its directory is named after (`ModelArgs.from_name`).
"""

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Union


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:
    block_size: int = 2048  # longest context the model was trained for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: Optional[int] = None
    n_local_heads: int = -1  # KV heads (GQA); -1 means as many as query heads
    head_dim: Optional[int] = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    rope_scaling: Optional[dict] = (
        None  # Llama-3.1 style: factor, low/high_freq_factor, original_max_position_embeddings
    )
    tie_embeddings: bool = False
    qkv_bias: bool = False
    # Sliding-window attention: layers listed "sliding_attention" in layer_types (all layers when
    # layer_types is None, as in Mistral-7B-v0.1) see only the newest `sliding_window` positions.
    sliding_window: Optional[int] = None
    layer_types: Optional[list] = (
        None  # per layer: "sliding_attention" or "full_attention" (HF's names)
    )
    rope_local_base: Optional[float] = None  # the sliding-window layers' RoPE base, when it differs
    # Gemma-3's options
    ffn_activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norm: bool = False  # RMSNorm after attention and after the FFN too
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE
    scale_embeddings: bool = False  # embeddings times sqrt(dim)
    query_pre_attn_scalar: Optional[float] = (
        None  # attention scores scaled by its -1/2 (default head_dim)
    )
    norm_in_fp32: bool = (
        False  # RMSNorm multiplies by its weight before casting back (Gemma), not after
    )
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            hidden_dim = 4 * self.dim
            self.intermediate_size = find_multiple(int(2 * hidden_dim / 3), 256)
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.n_head % self.n_local_heads:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})"
            )
        if self.ffn_activation not in ("silu", "gelu_tanh"):
            raise ValueError(
                f"ffn_activation must be silu or gelu_tanh, got {self.ffn_activation!r}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.n_layer:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers; the model has {self.n_layer}"
            )

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of layer `layer`, or None where it attends over everything."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_name(cls, name: str) -> "ModelArgs":
        """The preset whose name best matches `name` (a checkpoint directory name, say)."""
        if name in transformer_configs:
            return cls(name=name, **transformer_configs[name])
        matches = [c for c in transformer_configs if c.lower() in str(name).lower()]
        if not matches:
            raise ValueError(
                f"no preset matches {name!r}; put the model's HF config.json beside the "
                "checkpoint, "
                f"or name its directory after one of: {', '.join(transformer_configs)}"
            )
        # "Mistral-7B" and "7B" both match "Mistral-7B-v0.1": the longest match is the most
        # specific.
        matches.sort(key=len, reverse=True)
        if len(matches) > 1 and len(matches[0]) == len(matches[1]):
            raise ValueError(f"{name!r} matches several presets equally well: {matches}")
        return cls(name=matches[0], **transformer_configs[matches[0]])

    @classmethod
    def from_hf_config(cls, config: dict, name: str = "") -> "ModelArgs":
        """ModelArgs from a HF transformers config.json (llama, mistral, qwen2 or gemma3
        model_type)."""
        model_type = config.get("model_type", "llama")
        if model_type == "gemma3":  # the multimodal wrapper: its text model is what we run
            config = config["text_config"]
            model_type = config.get("model_type", "gemma3_text")
        if model_type not in ("llama", "mistral", "qwen2", "gemma3_text"):
            raise ValueError(
                f"config.json has model_type {model_type!r}; supported: llama, mistral, qwen2, "
                "gemma3"
            )
        gemma = model_type == "gemma3_text"
        rope = config.get("rope_parameters") or {}
        local_rope = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention", rope)  # Gemma-3 keeps one set per layer type
        rope_base = config.get("rope_theta", rope.get("rope_theta", 1e6 if gemma else 10000.0))
        scaling = config.get("rope_scaling") or rope
        rope_scaling = None
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type == "llama3":
            rope_scaling = {
                k: scaling[k]
                for k in (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                )
            }
        elif rope_type == "linear":
            rope_scaling = {"factor": scaling["factor"]}
        elif rope_type not in (None, "default"):
            raise ValueError(f"RoPE scaling {scaling} is not supported (only llama3 and linear)")
        for softcap in ("final_logit_softcapping", "attn_logit_softcapping"):
            if config.get(softcap) is not None:
                raise ValueError(
                    f"config.json sets {softcap}, which this model code does not implement"
                )
        n_head = config["num_attention_heads"]
        layer_types = config.get("layer_types")
        if gemma and layer_types is None:  # older Gemma-3 configs give the pattern instead
            pattern = config.get("sliding_window_pattern", 6)
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(config["num_hidden_layers"])
            ]
        gemma_options = (
            dict(
                layer_types=layer_types,
                ffn_activation="gelu_tanh",
                sandwich_norm=True,
                qk_norm=True,
                scale_embeddings=True,
                norm_in_fp32=True,
                rope_local_base=float(
                    config.get("rope_local_base_freq", local_rope.get("rope_theta", 10000.0))
                ),
                query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            )
            if gemma
            else {}
        )
        return cls(
            name=name,
            block_size=config.get("max_position_embeddings", 2048),
            vocab_size=config["vocab_size"],
            n_layer=config["num_hidden_layers"],
            n_head=n_head,
            dim=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            n_local_heads=config.get("num_key_value_heads") or n_head,
            head_dim=config.get("head_dim") or config["hidden_size"] // n_head,
            rope_base=float(rope_base),
            norm_eps=config.get("rms_norm_eps", 1e-6 if gemma else 1e-5),
            rope_scaling=rope_scaling,
            tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            sliding_window=config.get("sliding_window")
            if config.get("use_sliding_window", True)
            else None,
            **gemma_options,
        )

    @classmethod
    def for_checkpoint(cls, checkpoint_path: Union[str, Path]) -> "ModelArgs":
        """A config.json beside the checkpoint wins; otherwise the preset named by its directory."""
        checkpoint_path = Path(checkpoint_path)
        config_file = checkpoint_path.parent / "config.json"
        if config_file.is_file():
            return cls.from_hf_config(
                json.loads(config_file.read_text()), name=checkpoint_path.parent.name
            )
        return cls.from_name(checkpoint_path.parent.name)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_LLAMA31_SCALING = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _gemma3(n_layer: int, **shape) -> dict:
    """A Gemma-3 text model: every 6th layer global, the others a 512-token window."""
    return dict(
        n_layer=n_layer,
        block_size=32768,
        head_dim=256,
        vocab_size=262144,
        rope_base=1000000,
        norm_eps=1e-6,
        tie_embeddings=True,
        sliding_window=512,
        rope_local_base=10000.0,
        ffn_activation="gelu_tanh",
        layer_types=[
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layer)
        ],
        sandwich_norm=True,
        qk_norm=True,
        scale_embeddings=True,
        query_pre_attn_scalar=256.0,
        norm_in_fp32=True,
        **shape,
    )


transformer_configs = {
    "Llama-2-7b": dict(block_size=4096, n_layer=32, n_head=32, dim=4096, intermediate_size=11008),
    "Llama-2-13b": dict(block_size=4096, n_layer=40, n_head=40, dim=5120, intermediate_size=13824),
    "Llama-2-70b": dict(
        block_size=4096, n_layer=80, n_head=64, n_local_heads=8, dim=8192, intermediate_size=28672
    ),
    "Meta-Llama-3-8B": dict(
        block_size=8192,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        vocab_size=128256,
        rope_base=500000,
    ),
    "Meta-Llama-3-70B": dict(
        block_size=8192,
        n_layer=80,
        n_head=64,
        n_local_heads=8,
        dim=8192,
        intermediate_size=28672,
        vocab_size=128256,
        rope_base=500000,
    ),
    "Llama-3.1-8B": dict(
        block_size=131072,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        vocab_size=128256,
        rope_base=500000,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "Llama-3.1-70B": dict(
        block_size=131072,
        n_layer=80,
        n_head=64,
        n_local_heads=8,
        dim=8192,
        intermediate_size=28672,
        vocab_size=128256,
        rope_base=500000,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "Mistral-7B-v0.1": dict(
        block_size=32768,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        sliding_window=4096,
    ),
    "Mistral-7B-Instruct-v0.1": dict(
        block_size=32768,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        sliding_window=4096,
    ),
    "Mistral-7B-v0.2": dict(
        block_size=32768,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        rope_base=1000000,
    ),
    "Mistral-7B-Instruct-v0.2": dict(
        block_size=32768,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        rope_base=1000000,
    ),
    "SmolLM2-135M": dict(
        block_size=8192,
        n_layer=30,
        n_head=9,
        n_local_heads=3,
        dim=576,
        intermediate_size=1536,
        vocab_size=49152,
        rope_base=100000,
        tie_embeddings=True,
    ),
    "SmolLM2-360M": dict(
        block_size=8192,
        n_layer=32,
        n_head=15,
        n_local_heads=5,
        dim=960,
        intermediate_size=2560,
        vocab_size=49152,
        rope_base=100000,
        tie_embeddings=True,
    ),
    "SmolLM2-1.7B": dict(
        block_size=8192,
        n_layer=24,
        n_head=32,
        n_local_heads=32,
        dim=2048,
        intermediate_size=8192,
        vocab_size=49152,
        rope_base=130000,
        tie_embeddings=True,
    ),
    "Qwen2.5-0.5B": dict(
        block_size=32768,
        n_layer=24,
        n_head=14,
        n_local_heads=2,
        dim=896,
        intermediate_size=4864,
        vocab_size=151936,
        rope_base=1000000,
        norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    "Qwen2.5-1.5B": dict(
        block_size=32768,
        n_layer=28,
        n_head=12,
        n_local_heads=2,
        dim=1536,
        intermediate_size=8960,
        vocab_size=151936,
        rope_base=1000000,
        norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    "Qwen2.5-3B": dict(
        block_size=32768,
        n_layer=36,
        n_head=16,
        n_local_heads=2,
        dim=2048,
        intermediate_size=11008,
        vocab_size=151936,
        rope_base=1000000,
        norm_eps=1e-6,
        tie_embeddings=True,
        qkv_bias=True,
    ),
    "gemma-3-270m": _gemma3(18, n_head=4, n_local_heads=1, dim=640, intermediate_size=2048),
    "gemma-3-1b": _gemma3(26, n_head=4, n_local_heads=1, dim=1152, intermediate_size=6912),
    "Qwen2.5-7B": dict(
        block_size=32768,
        n_layer=28,
        n_head=28,
        n_local_heads=4,
        dim=3584,
        intermediate_size=18944,
        vocab_size=152064,
        rope_base=1000000,
        norm_eps=1e-6,
        qkv_bias=True,
    ),
}
