"""The KV caches the one generation loop (generate.generate) drives, and the registry that makes
them by name.

A cache is an object with these methods (specache.SpeCache, eviction.EvictionCache and FullCache
below; each also plugs a module into every layer's `attention.kv_cache`, see model.py):

    begin(tokens, lengths, held)  a generation of the right-padded prompts starts: per-generation
                                  state is reset (prefill follows, through the model's layers, in
                                  one piece or in chunks); `held` > 0 (caches that `chunks`): each
                                  sequence holds that many tokens already, which the prompts continue
    ingest(recorded)              instead of prefill: each layer's prompt (K, V, the attention each
                                  key got or None) from a prefill done elsewhere, after `begin`
                                  (scripts/harness.py shares one prefill among caches)
    bootstrap(model, first, pos)  once, before the first step (SpeCache: its first guess and fetch)
    step(model, token, pos)       one decode step of the real tokens (B, 1): their logits (B, 1, V)
    sampled(token)                the real tokens the loop sampled from them
    finish(keep)                  the generation ended (wait for whatever runs in the background);
                                  `keep`: what the cache holds stays for a continuation
    step_bytes(positions)         KV bytes a step reads, the sequences holding `positions` tokens
    stats(steps)                  tier sizes and the cache's own figures, for --json and the tables
    graph_breaks                  whether a compiled step must split its graph
    whole_step                    whether a step is one pass of `model.forward` (compile it whole)
    chunks                        whether prefill may come in chunks, on top of what the cache holds
                                  (`CausalPrompt.start` > 0: --prefill_chunk, a chat's next turn)

Methods are named as the evaluation scripts and generate.py's --cache name them: `full` (K, V in
the model's dtype) or `full-16bit`,
`specache`, `specache-nospec`, `kivi` (bits and selection from options), or with the bits and an
optional selection in the name (`specache-1bit`, `specache-2bit:paper`, `kivi-1bit`,
`specache-nospec-1bit:split,sinks`), and the eviction baselines `streaming` and `h2o`.
"""
import re
from typing import Optional

import torch
from torch import Tensor

from eviction import EvictionCache, EvictionConfig, EvictionLayer, EvictionState
from model import Transformer, create_causal_block_mask
from selection import parse_select
from kernels import dense_cpu
from kernels.quant import sixteen_bit_dtype
from specache import SpeCache, SpeCacheConfig, SpeCacheLayer, SpeCacheState

KINDS = ("full", "specache", "specache-nospec", "kivi", "streaming", "h2o")
NAMED_METHODS = ("full", "full-16bit", "specache-1bit", "specache-2bit", "specache-nospec-1bit", "specache-nospec-2bit",
                 "kivi-1bit", "kivi-2bit", "streaming", "h2o")
LOW_BIT_KINDS = ("specache", "specache-nospec", "kivi")


class FullCache:
    """The full cache of model.py (a ring for sliding-window layers), K and V in the model's dtype or,
    with `sixteen_bit`, in 16 bits (float16 beside a float32 model, as SpeCache's pairs); FlexAttention's
    block mask for compiled decode when `use_flex` (on a CPU, decode reads the cache through
    kernels/dense_cpu.c)."""

    graph_breaks = False
    whole_step = True
    chunks = True

    def __init__(self, model: Transformer, batch_size: int, max_seq_length: int, use_flex: bool = False,
                 sixteen_bit: bool = False):
        self.kv_dtype = sixteen_bit_dtype(model.tok_embeddings.weight.dtype) if sixteen_bit else \
            model.tok_embeddings.weight.dtype
        model.setup_caches(batch_size, max_seq_length, self.kv_dtype)
        device = model.tok_embeddings.weight.device
        self.model = model
        # a CPU's decode reads the cache through kernels/dense_cpu.c by position: no block mask needed
        use_flex = use_flex and not (device.type == "cpu" and dense_cpu.available())
        self.block_mask = create_causal_block_mask(model.max_seq_length, device) if use_flex else None

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        pass  # prefill overwrites every position a generation reads, from `held` on

    def ingest(self, recorded: list[tuple[Tensor, Tensor, Optional[list[Tensor]]]]) -> None:
        for layer, (k, v, _) in zip(self.model.layers, recorded):
            layer.attention.kv_cache.ingest_prompt(k, v)

    def bootstrap(self, model: Transformer, first: Tensor, pos: Tensor) -> None:
        pass

    def step(self, model: Transformer, token: Tensor, pos: Tensor) -> Tensor:
        return model(token, pos, model.make_mask(pos, self.block_mask))

    def sampled(self, token: Tensor) -> None:
        pass

    def finish(self, keep: bool = False) -> None:
        pass

    def step_bytes(self, positions: list[int]) -> int:
        return full_cache_step_bytes(self.model, positions, self.kv_dtype.itemsize)

    def stats(self, steps: int) -> dict:
        return {"cache": "full", "kv_dtype": str(self.kv_dtype)}


def full_cache_step_bytes(model: Transformer, positions: list[int], element_size: Optional[int] = None) -> int:
    """KV bytes a full-cache decode step reads when its sequences hold `positions` tokens each:
    full-attention layers read every position, sliding-window layers their whole ring (elements of
    `element_size` bytes, default the model's)."""
    c = model.config
    per_layer_position = 2 * c.n_local_heads * c.head_dim * (element_size or model.tok_embeddings.weight.element_size())
    windows = [c.window(i) for i in range(c.n_layer)]
    return per_layer_position * sum(n if w is None else w for w in windows for n in positions)


def parse_method(method: str) -> tuple[str, Optional[int], Optional[str]]:
    """(kind, bits or None, selection or None) of a method name (see the module docstring)."""
    base, _, select = method.partition(":")
    named = re.fullmatch(r"(specache|specache-nospec|kivi)-([12])bit|(full)-(16)bit", base)
    kind, bits = (named.group(1) or named.group(3), int(named.group(2) or named.group(4))) if named else (base, None)
    if kind not in KINDS or (select and kind not in LOW_BIT_KINDS):
        raise ValueError(f"unknown method {method!r}: use one of {', '.join(NAMED_METHODS)}, or "
                         f"{', '.join(LOW_BIT_KINDS)} with the bits as an option; SpeCache and KIVI methods take "
                         "a selection after a colon (see --specache_select)")
    if select:
        parse_select(select)
    return kind, bits, select or None


def specache_config(kind: str, bits: Optional[int] = None, select: Optional[str] = None, topk: int = 64,
                    **options) -> SpeCacheConfig:
    """The SpeCacheConfig of a low-bit kind: SpeCache (speculative or not) with our selection unless
    `select` names another, or KIVI (nothing fetched) with the paper's levels unless it names others.
    `options`: other SpeCacheConfig fields (group, residual, stats, overlap_fetch, pair_dtype)."""
    config = SpeCacheConfig(bits=bits or 1, topk=0 if kind == "kivi" else topk, speculative=kind == "specache",
                            **options)
    return config.with_select(select or ("paper" if kind == "kivi" else "default"))


def equal_budget_tokens(model: Transformer, capacity: int, config: SpeCacheConfig) -> int:
    """The eviction budget (tokens per layer and KV head) whose 16-bit pairs take the fast-tier bytes
    of a SpeCache layer with `config` at this capacity."""
    c = model.config
    dtype = config.pair_dtype_for(model.tok_embeddings.weight.dtype)
    capacity = -(-capacity // config.group) * config.group
    meta = torch.device("meta")  # sizes only: nothing is allocated
    state = SpeCacheState(config, 1, capacity, meta, c.head_dim, dtype, c.n_head // c.n_local_heads)
    layer = SpeCacheLayer(state, c.n_head, c.n_local_heads, c.head_dim, dtype, meta, executor=None)
    one_slot = EvictionLayer(EvictionState(EvictionConfig("h2o", budget=1), 1), c.n_local_heads, c.head_dim, dtype, meta)
    return layer.fast_tier_bytes() // one_slot.fast_tier_bytes()


def make_cache(method: str, model: Transformer, batch_size: int, capacity: int, *, bits: int = 1,
               select: Optional[str] = None, topk: int = 64, budget_tokens: Optional[int] = None,
               budget_bits: int = 1, sink_tokens: int = 4, use_flex: bool = False, **options):
    """The cache `method` names, set up in `model` for `batch_size` sequences of `capacity` positions.

    Bits and a selection in the name win over `bits` and `select`. SpeCache and KIVI take `topk` and
    SpeCacheConfig fields as `options`; the eviction baselines keep `budget_tokens` per layer and KV
    head (default: as many as fit in SpeCache's fast-tier bytes at `budget_bits` bits at this
    capacity) and StreamingLLM `sink_tokens` sinks; the full cache uses FlexAttention with `use_flex`.
    """
    kind, named_bits, named_select = parse_method(method)
    if kind == "full":
        return FullCache(model, batch_size, capacity, use_flex, sixteen_bit=(named_bits or bits) == 16)
    if kind in ("streaming", "h2o"):
        budget = budget_tokens or equal_budget_tokens(model, capacity, SpeCacheConfig(bits=budget_bits, topk=topk))
        return EvictionCache(model, batch_size, capacity, EvictionConfig(kind, budget, sink_tokens))
    config = specache_config(kind, named_bits or bits, named_select or select, topk, **options)
    return SpeCache(model, batch_size, capacity, config)
