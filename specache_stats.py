"""SpeCache's accounting and diagnostics: what its tiers hold, what a step reads and fetches, and
why a selection fails (measurement, not the method; specache.py calls these).

The diagnostics (`SpeCacheConfig.stats`), per layer and KV head, over the real rows of decode steps:
- recall of the fetched pairs (all k: prefetched and picked within the step) against the real row's
  own low-bit top-k, and against its exact top-k, from the 16-bit keys of the slow tier;
- coverage: the share of the real row's exact attention that falls on positions read in 16 bits
  (window, sinks, fetched pairs, its own key), and what that share would be with the exact top-k
  fetched (the oracle's coverage, the most k positions can cover).
They read the whole slow tier each step, so they cost a pass over the 16-bit keys.
"""
import torch
from torch import Tensor

from kernels.attention import (Segments, lowbit_part, merge_softmax, over_query_heads, positions_mask,
                               row_position_weights, select_top_k)
from kernels.quant import sixteen_bit_dtype, value_group
from model import Transformer

# What `diagnose` sums per KV head
DIAGNOSTICS = ("own_hits", "own_total", "exact_hits", "exact_total", "coverage", "oracle_coverage", "rows")


def exact_real_row_probs(layer, rows: Tensor, seg: Segments, s: int) -> tuple[Tensor, Tensor]:
    """The real row's exact attention, from the 16-bit keys in the slow tier, the window and its
    own key: the probabilities of the history's positions [0, T) (B, Hkv, G, T), per query head,
    and the probability of the window and its own key together (B, Hkv, G)."""
    b, n_kv, m, d = rows.shape
    real = rows.view(b, n_kv, m // s, s, d)[:, :, :, 0]
    t = layer.k_packed.shape[2]  # the positions that can be quantized; the rest are in the window
    keys = layer.tier.keys_on(rows.device)[:, :, :t]
    quantized = torch.arange(t, device=rows.device) < layer.state.quantized_len[:, None, None, None]
    in_window = torch.arange(seg.window_k.shape[2], device=rows.device) < seg.window_len[:, None, None, None]
    scores = torch.cat([(real @ keys.float().transpose(-1, -2)).masked_fill(~quantized, float("-inf")),
                        (real @ seg.window_k.float().transpose(-1, -2)).masked_fill(~in_window, float("-inf")),
                        (real * seg.new_k[:, :, None, 0].float()).sum(-1, keepdim=True)], -1)
    probs = scores.softmax(-1)
    return probs[..., :t], probs[..., t:].sum(-1)


def diagnose(layer, rows: Tensor, seg: Segments, s: int) -> Tensor:
    """Why a selection fails, per KV head: recall of the fetched pairs (all k, prefetched and
    picked) against the real row's own low-bit top-k and against its exact top-k (the oracle,
    from the 16-bit keys), the share of its exact attention mass read in 16 bits (coverage), and
    that share had the oracle's k been fetched."""
    c = layer.config
    probs, elsewhere = exact_real_row_probs(layer, rows, seg, s)
    mass, elsewhere = probs.mean(2), elsewhere.mean(2)  # a KV head's share: the mean over its query heads
    t, k = mass.shape[-1], layer.k_spec + layer.k_real
    position = torch.arange(t, device=rows.device)
    selectable = (position < layer.state.quantized_len[:, None, None]) & (position >= layer.n_sinks)
    sinks = seg.fetched_valid & (torch.arange(seg.fetched_valid.shape[-1], device=rows.device) < layer.n_sinks)
    coverage = (mass * positions_mask(seg.fetched_pos, seg.fetched_valid, t)).sum(-1) + elsewhere
    oracle, oracle_valid = select_top_k(mass, selectable, k)
    covered = positions_mask(oracle, oracle_valid, t) | positions_mask(seg.fetched_pos, sinks, t)
    oracle_coverage = (mass * covered).sum(-1) + elsewhere
    plain = seg._replace(fetched_valid=sinks)  # the real row's own low-bit pass: only the sinks exact
    plain_part = lowbit_part(rows, layer.lowbit(), plain)
    own_weights = row_position_weights(plain_part, merge_softmax(rows, plain_part, plain), plain, s, 0)
    own, own_valid = select_top_k(over_query_heads(own_weights, c.gqa), selectable, k)
    fetched_pos, fetched_valid = seg.fetched_pos[:, :, layer.n_sinks:], seg.fetched_valid[:, :, layer.n_sinks:]

    def hits(positions: Tensor, valid: Tensor) -> Tensor:
        found = (fetched_pos.unsqueeze(-1) == positions.unsqueeze(-2)) & fetched_valid.unsqueeze(-1)
        return (found.any(-2) & valid).sum(-1)

    sums = [hits(own, own_valid), own_valid.sum(-1), hits(oracle, oracle_valid), oracle_valid.sum(-1), coverage,
            oracle_coverage, torch.ones_like(coverage)]
    return torch.stack([x.double() for x in sums]).sum(1)


def step_bytes(cache) -> int:
    """KV bytes one decode step of a `specache.SpeCache` reads: the low-bit copy up to each
    sequence's Lq, the window and the slots (the slow tier is read only by the fetches, counted
    apart), and the rings of sliding-window layers."""
    layer, state = cache.layers[0], cache.state
    per_position = sum(t.shape[-1] * t.element_size() for t in (layer.k_packed, layer.v_packed, layer.v_scale,
                                                                   layer.v_zero))
    per_position += 2 * layer.k_scale.shape[-1] * layer.k_scale.element_size() / layer.config.group
    pairs = layer.window_k.shape[2] + layer.fetched_k.shape[2]
    per_pair = 2 * layer.window_k.shape[-1] * layer.window_k.element_size()
    heads = layer.k_packed.shape[1] * len(cache.layers)
    rings = sum(ring.k_cache[0].nbytes + ring.v_cache[0].nbytes for ring in cache.rings)
    lowbit = heads * sum(lq * per_position + pairs * per_pair for lq in state.host_quantized_len)
    return int(lowbit + rings * len(state.host_quantized_len))


def cache_stats(cache, steps: int) -> dict:
    """A `specache.SpeCache`'s tier sizes, the ratio to a 16-bit cache of the same length, fetch
    volume, speculation quality, and the diagnostics with `stats`."""
    c, cfg, state = cache.model.config, cache.config, cache.state
    layer = cache.layers[0]
    fast_global = sum(each.fast_tier_bytes() for each in cache.layers)
    fast_rings = sum(ring.fast_tier_bytes() for ring in cache.rings)
    fast, batch = fast_global + fast_rings, state.quantized_len.shape[0]
    full_16bit = sixteen_bit_cache_bytes(cache.model, state.capacity, batch)
    pair_bytes = 2 * c.head_dim * layer.fetched_k.element_size()
    pairs_read = sum(int(each.counts[0]) for each in cache.layers)
    discarded, checked = (sum(int(each.counts[i]) for each in cache.layers) for i in (1, 2))
    stats = {
        "cache": "specache" if cfg.topk and cfg.speculative else ("specache-nospec" if cfg.topk else "kivi"),
        "bits": cfg.bits, "group": cfg.group, "residual": cfg.residual,
        "topk": layer.k_spec + layer.k_real, "select": cfg.select_name(),
        "prefetched_pairs": layer.k_spec, "pairs_chosen_in_step": layer.k_real, "sinks": layer.n_sinks,
        "capacity_tokens": state.capacity,
        "fast_tier_bytes": fast,
        "slow_tier_bytes": sum(each.tier.nbytes() for each in cache.layers),
        "fast_tier_ratio_to_16bit_cache": fast / full_16bit,
        "bytes_fetched_per_token": pairs_read * pair_bytes / max(1, steps * batch),
        "speculative_match_rate": int(cache.matches) / max(1, steps * batch) if cache.speculative else None,
        "prefetch_discarded_share": discarded / checked if checked else None,
    }
    if cache.folder is not None:  # what the disk tier read: whole positions, each once, not what reuse held
        stats["slow_tier"] = "disk"
        stats["slow_tier_bytes_read_per_step"] = sum(each.tier.bytes_read for each in cache.layers) / max(1, steps)
    if cache.rings:  # a hybrid model: each layer type's fast tier against its own 16-bit cache
        global_16bit = 2 * 2 * c.n_local_heads * c.head_dim * state.capacity * batch * len(cache.layers)
        stats.update({
            "full_attention_layers": len(cache.layers), "sliding_window_layers": len(cache.rings),
            "fast_tier_bytes_full_attention_layers": fast_global,
            "fast_tier_bytes_sliding_window_layers": fast_rings,
            "fast_tier_ratio_full_attention_layers": fast_global / global_16bit,
            "fast_tier_ratio_sliding_window_layers": fast_rings / (full_16bit - global_16bit),
            "fast_tier_ratio_to_16bit_cache_without_windows": fast / sixteen_bit_cache_bytes(
                cache.model, state.capacity, batch, windows=False),
        })
    if cfg.stats:
        stats["diagnostics"] = diagnostics(cache.layers)
    return stats


def fast_tier_plan(config, capacity: int, head_dim: int, pair_dtype: torch.dtype, group_size: int) -> tuple[int, int]:
    """(R, the most exact slots) for a `SpeCacheConfig` at this capacity, such that a layer's fast
    tier never holds more than a cache of `capacity` pairs in `pair_dtype` (the 16-bit cache it
    replaces). Per KV head and sequence: the low-bit copy of the positions that can be quantized,
    the window, then per slot its pair, position and flag (and the prefetch's chosen position); a
    layer that corrects keeps its query heads' last queries too. When the copy and the window alone
    would exceed the cache (a capacity below about R + g + the copy's share), nothing is quantized:
    R becomes the capacity and every pair stays 16-bit in the window, the size of the cache."""
    g, bits = config.group, config.bits
    pair = 2 * head_dim * pair_dtype.itemsize
    scale = sixteen_bit_dtype(pair_dtype).itemsize
    quantizable = max(0, capacity - config.residual) // g * g
    lowbit = quantizable * (2 * head_dim * bits // 8 + 2 * head_dim // value_group(g, head_dim) * scale)
    lowbit += quantizable // g * 2 * head_dim * scale
    room = (capacity - min(config.residual + g, capacity)) * pair - lowbit
    if config.correct_below is not None:
        room -= group_size * head_dim * 4
    if room < 0:
        return capacity, 0
    return config.residual, room // (pair + 18)


def sixteen_bit_cache_bytes(model: Transformer, capacity: int, batch: int = 1, windows: bool = True) -> int:
    """Bytes of 16-bit K and V caches for `batch` sequences of `capacity` positions: what the
    fast-tier ratios compare with. Sliding-window layers hold their window only (as the full cache
    here does), or with `windows=False` the whole capacity (as a cache that ignores them would)."""
    c = model.config
    per_position = 2 * 2 * c.n_local_heads * c.head_dim
    held = [capacity if w is None or not windows else w for w in map(c.window, range(c.n_layer))]
    return batch * per_position * sum(held)


def diagnostics(caches: list) -> dict:
    """The `diagnose` sums as shares: overall and per SpeCache layer (the mean over its KV heads)."""
    sums = torch.stack([cache.diagnostics for cache in caches]).sum(-1)  # (layers, len(DIAGNOSTICS))
    named = dict(zip(DIAGNOSTICS, sums.T))
    rows = named["rows"].clamp_min(1)
    per_layer = {"recall_own_lowbit": named["own_hits"] / named["own_total"].clamp_min(1),
                 "recall_exact": named["exact_hits"] / named["exact_total"].clamp_min(1),
                 "coverage": named["coverage"] / rows, "oracle_coverage": named["oracle_coverage"] / rows}
    total = {key: float(sums[:, DIAGNOSTICS.index(a)].sum() / max(1.0, float(sums[:, DIAGNOSTICS.index(b)].sum())))
             for key, (a, b) in {"recall_own_lowbit": ("own_hits", "own_total"),
                                 "recall_exact": ("exact_hits", "exact_total"),
                                 "coverage": ("coverage", "rows"), "oracle_coverage": ("oracle_coverage", "rows")}.items()}
    return {**total, "per_layer": {key: [round(float(x), 4) for x in value] for key, value in per_layer.items()}}
