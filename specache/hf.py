"""SpeCache inside a Hugging Face transformers causal LM (Llama and the decoders built like it:
Mistral, Qwen2, SmolLM2), with the plain `transformers` package.

    from transformers import AutoModelForCausalLM
    import specache
    import specache.hf

    model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
    cache = specache.hf.plug(model, 1, max_seq_length=4096, config=specache.SpeCacheConfig())
    new_tokens = specache.hf.generate(model, cache, [prompt_ids], max_new_tokens=64)

How: transformers' attention-function interface. `plug` registers an attention implementation
named "specache" and switches the model to it: each attention module computes q, k, v and RoPE as
usual, then hands the new rows' q, k, v and their positions to its SpeCache layer, which attends
over everything the cache holds and keeps what it must (specache/layer.py). The model runs with
`use_cache=False`: SpeCache is the cache, and transformers' Cache objects, whose update must return
the whole 16-bit K and V, are not used. `generate` below is SpeCache's two-row decode loop
(transformers' own generate runs one row per step). This module needs torch and transformers (the
package's `hf` extra); it is imported only when asked for (`import specache.hf`). `plug` registers
the package's C and Triton kernels (specache.kernels; the tokens are the same without them).
"""

from typing import Callable, Sequence

import torch
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

import specache.kernels
from specache import SpeCache, SpeCacheConfig


def specache_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    """The attention function transformers calls per layer: the new rows q (B, H, S, D) and k, v
    (B, Hkv, S, D) after RoPE, to the layer's SpeCache; (B, S, H, D) back."""
    if "position_ids" not in kwargs:
        raise ValueError("SpeCache needs each row's position: call the model with position_ids")
    head_dim = query.shape[-1]
    if scaling != head_dim**-0.5:  # SpeCache scales scores by head_dim^-1/2: fold the rest into q
        query = query * (scaling * head_dim**0.5)
    positions = kwargs["position_ids"].expand(query.shape[0], -1)
    return module.specache_layer(query, key, value, positions).transpose(1, 2), None


AttentionInterface.register("specache", specache_attention)
# SpeCache knows what each row sees: no mask to build
AttentionMaskInterface.register("specache", lambda *args, **kwargs: None)


def plug(
    model: PreTrainedModel,
    batch_size: int,
    max_seq_length: int,
    config: SpeCacheConfig = SpeCacheConfig(),
    kernels: bool = True,
) -> SpeCache:
    """SpeCache in every decoder layer of `model`, for `batch_size` sequences of up to
    `max_seq_length` positions, and the model switched to it (back: set_attn_implementation).
    `kernels`: register the package's kernels first (`specache.kernels.register()`)."""
    c = model.config
    sliding = getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True)
    if sliding or any(kind != "full_attention" for kind in getattr(c, "layer_types", None) or []):
        raise ValueError(
            "this adapter serves models whose layers all attend over the whole context"
        )
    if kernels:
        specache.kernels.register()
    layers = model.get_decoder().layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = SpeCache(
        config,
        len(layers),
        c.num_attention_heads,
        c.num_key_value_heads,
        head_dim,
        batch_size,
        max_seq_length,
        model.device,
        model.dtype,
    )
    for layer, specache_layer in zip(layers, cache.layers):
        layer.self_attn.specache_layer = specache_layer
    model.set_attn_implementation("specache")
    return cache


def greedy(logits: Tensor) -> Tensor:
    return logits.argmax(-1, keepdim=True)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    cache: SpeCache,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sample: Callable[[Tensor], Tensor] = greedy,
    stop_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Up to `max_new_tokens` new tokens for each prompt (a ragged batch of at most the plugged
    batch size), each chosen by `sample` from the real row's logits (B, V), up to and including a
    stop id."""

    def forward(tokens: Tensor, positions: Tensor) -> Tensor:
        return model(input_ids=tokens, position_ids=positions, use_cache=False).logits

    device, batch = model.device, len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(batch, int(lengths.max()), dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = torch.tensor(prompt, device=device)
    cache.begin(tokens, lengths)
    logits = forward(tokens, torch.arange(tokens.shape[1], device=device).expand(batch, -1))
    token = sample(logits[torch.arange(batch, device=device), lengths - 1])
    cache.sampled(token)
    position = lengths[:, None]
    cache.bootstrap(forward, token, position)
    out, stops = [token], torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    done = torch.isin(token[:, 0], stops)
    for _ in range(max_new_tokens - 1):
        if bool(done.all()):
            break
        token = sample(cache.step(forward, token, position)[:, -1])
        cache.sampled(token)
        out.append(token)
        done |= torch.isin(token[:, 0], stops)
        position = position + 1
    cache.finish()
    new = torch.cat(out, 1).tolist()
    ends = [next((i + 1 for i, t in enumerate(seq) if t in stop_ids), len(seq)) for seq in new]
    return [seq[:end] for seq, end in zip(new, ends)]
