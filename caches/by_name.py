"""The caches by name: make_cache makes the cache a method's name names.

Methods are named as the evaluation scripts and generate.py's --cache name them: `full` (K, V in
the model's dtype) or `full-16bit`, `specache`, `specache-nospec`, `kivi` (bits and selection from
options), or with the bits and an optional selection in the name (`specache-1bit`,
`specache-2bit:paper`, `kivi-1bit`, `specache-nospec-1bit:split,sinks`), and the eviction baselines
`streaming` and `h2o`. A selection may name an oracle (`specache-1bit:oracle`, `:oracle=mass`):
diagnostics, not a method (stats.py).
"""

import re
from dataclasses import replace
from typing import Optional

import torch

from caches.eviction import EvictionCache, EvictionConfig, EvictionLayer, EvictionState
from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from caches.stats import Diagnostics
from model import Transformer
from specache import Method, Placement, Selection, SpeCacheConfig, SpeCacheLayer
from specache.state import SpeCacheState

KINDS = ("full", "specache", "specache-nospec", "kivi", "streaming", "h2o")
NAMED_METHODS = (
    "full",
    "full-16bit",
    "specache-1bit",
    "specache-2bit",
    "specache-nospec-1bit",
    "specache-nospec-2bit",
    "kivi-1bit",
    "kivi-2bit",
    "streaming",
    "h2o",
)
LOW_BIT_KINDS = ("specache", "specache-nospec", "kivi")
ORACLES = ("error", "mass")
DEFAULT = Method()  # the settings a caller leaves out


def parse_method(method: str) -> tuple[str, Optional[int], Optional[str]]:
    """(kind, bits or None, selection or None) of a method name (see the module docstring)."""
    base, _, select = method.partition(":")
    named = re.fullmatch(r"(specache|specache-nospec|kivi)-([12])bit|(full)-(16)bit", base)
    if named:
        kind, bits = named.group(1) or named.group(3), int(named.group(2) or named.group(4))
    else:
        kind, bits = base, None
    if kind not in KINDS or (select and kind not in LOW_BIT_KINDS):
        raise ValueError(
            f"unknown method {method!r}: use one of {', '.join(NAMED_METHODS)}, or "
            f"{', '.join(LOW_BIT_KINDS)} with the bits as an option; SpeCache and "
            "KIVI methods take a selection after a colon (see --specache_select)"
        )
    if select:
        parse_select(select)
    return kind, bits, select or None


def parse_select(
    select: str, fallback: str = "default"
) -> tuple[Selection, Optional[str], Optional[float], Optional[str]]:
    """A --specache_select value (or a method name's part after the colon): its selection
    (`Selection.parse`; `fallback` where it names nothing but the arithmetic), the arithmetic an
    `int8` or `sparse[=TAU]` item names (specache.Method.arithmetic) or None, the tau a
    `sparse=TAU` item names or None, and the oracle an `oracle[=error|mass]` item names or None.
    The oracle (diagnostics, stats.py) chooses all k pairs within the step (split=1) from the
    real row's exact scores."""
    items = [item.strip() for item in select.split(",") if item.strip()]
    arithmetic, tau, oracle, rest = None, None, None, []
    for item in items:
        name, _, value = item.partition("=")
        if name in ("int8", "sparse"):
            if value and name == "int8":
                raise ValueError("--specache_select: int8 takes no value")
            arithmetic = name
            tau = parse_tau(value) if value else tau
        elif name == "oracle":
            oracle = value or "error"
            if oracle not in ORACLES:
                raise ValueError(f"oracle must be error or mass, got {oracle!r}")
        else:
            rest.append(item)
    # the fallback where nothing but the arithmetic is named (an oracle alone names the paper's)
    named = [item for item in items if item.partition("=")[0] not in ("int8", "sparse")]
    selection = Selection.parse(",".join(rest) if named else fallback)
    if oracle is not None:
        selection = replace(selection, real_share=1.0)
    return selection, arithmetic, tau, oracle


def parse_tau(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"--specache_select: sparse={value}: tau must be a number") from None


def specache_config(
    kind: str,
    bits: Optional[int] = None,
    select: Optional[str] = None,
    topk: int = DEFAULT.topk,
    group: int = DEFAULT.group,
    residual: int = DEFAULT.residual,
    pair_dtype: Optional[torch.dtype] = None,
    overlap_fetch: bool = True,
    arithmetic: str = DEFAULT.arithmetic,
    tau: float = DEFAULT.tau,
) -> tuple[SpeCacheConfig, Optional[str]]:
    """The SpeCacheConfig of a low-bit kind, and the oracle its selection names: SpeCache
    (speculative or not) with our selection unless `select` names another, or KIVI (nothing
    fetched) with the paper's levels unless it names others. An `int8` or `sparse[=TAU]` item in
    `select` sets the arithmetic (and alone leaves the selection at its default)."""
    fallback = "paper" if kind == "kivi" else "default"
    selection, named_arithmetic, named_tau, oracle = parse_select(select or "", fallback)
    method = Method(
        bits=bits or DEFAULT.bits,
        group=group,
        residual=residual,
        topk=0 if kind == "kivi" else topk,
        speculative=kind == "specache",
        arithmetic=named_arithmetic or arithmetic,
        tau=tau if named_tau is None else named_tau,
    )
    placement = Placement(pair_dtype=pair_dtype, overlap_fetch=overlap_fetch)
    return SpeCacheConfig(method, selection, placement), oracle


def equal_budget_tokens(model: Transformer, capacity: int, config: SpeCacheConfig) -> int:
    """The eviction budget (tokens per layer and KV head) whose 16-bit pairs take the fast-tier
    bytes of a SpeCache layer with `config` at this capacity."""
    c = model.config
    dtype = config.placement.pair_dtype_for(model.tok_embeddings.weight.dtype)
    capacity = -(-capacity // config.method.group) * config.method.group
    meta = torch.device("meta")  # sizes only: nothing is allocated
    query_heads = c.n_head // c.n_local_heads
    state = SpeCacheState(config, 1, capacity, meta, c.head_dim, dtype, query_heads)
    layer = SpeCacheLayer(
        state, 0, c.n_head, c.n_local_heads, c.head_dim, dtype, meta, make_tier=lambda spec: None
    )
    one_slot = EvictionLayer(
        EvictionState(EvictionConfig("h2o", budget=1), 1), c.n_local_heads, c.head_dim, dtype, meta
    )
    return layer.fast_tier_bytes() // one_slot.fast_tier_bytes()


def make_cache(
    method: str,
    model: Transformer,
    batch_size: int,
    capacity: int,
    *,
    bits: int = DEFAULT.bits,
    select: Optional[str] = None,
    topk: int = DEFAULT.topk,
    budget_tokens: Optional[int] = None,
    budget_bits: int = DEFAULT.bits,
    sink_tokens: int = 4,
    use_flex: bool = False,
    stats: bool = False,
    slow_tier: str = "ram",
    slow_tier_dir: Optional[str] = None,
    **options,
):
    """The cache `method` names, set up in `model` for `batch_size` sequences of `capacity`
    positions.

    Bits and a selection in the name win over `bits` and `select`. SpeCache and KIVI take `topk`,
    `stats` (the diagnostics), the slow tier, and specache_config's `options` (group, residual,
    pair_dtype, overlap_fetch, arithmetic, tau); the eviction baselines keep `budget_tokens` per
    layer and KV head (default: as many as fit in SpeCache's fast-tier bytes at `budget_bits` bits
    at this capacity) and StreamingLLM `sink_tokens` sinks; the full cache uses FlexAttention with
    `use_flex`.
    """
    kind, named_bits, named_select = parse_method(method)
    if kind == "full":
        return FullCache(
            model, batch_size, capacity, use_flex, sixteen_bit=(named_bits or bits) == 16
        )
    if kind in ("streaming", "h2o"):
        budget_config = SpeCacheConfig(Method(bits=budget_bits, topk=topk))
        budget = budget_tokens or equal_budget_tokens(model, capacity, budget_config)
        return EvictionCache(model, batch_size, capacity, EvictionConfig(kind, budget, sink_tokens))
    config, oracle = specache_config(
        kind, named_bits or bits, named_select or select, topk, **options
    )
    probe = None
    if stats or oracle:
        c, device = model.config, model.tok_embeddings.weight.device
        full_layers = sum(c.window(i) is None for i in range(c.n_layer))
        probe = Diagnostics(full_layers, c.n_local_heads, device, oracle, observe=stats)
    return PluggedSpeCache(model, batch_size, capacity, config, slow_tier, slow_tier_dir, probe)
