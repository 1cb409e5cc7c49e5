"""SpeCache's accounting and diagnostics: what its tiers hold, what a step reads and fetches, and
why a selection fails. Measurement, not the method: specache/ runs without this file, and calls
into it only through a probe (`Diagnostics`, a specache.Probe) that a cache is given.

The diagnostics (--specache_stats), per layer and KV head, over the real rows of decode steps:
- recall of the fetched pairs (all k: prefetched and picked within the step) against the real row's
  own low-bit top-k, and against its exact top-k, from the 16-bit keys of the slow tier;
- coverage: the share of the real row's exact attention that falls on positions read in 16 bits
  (window, sinks, fetched pairs, its own key), and what that share would be with the exact top-k
  fetched (the oracle's coverage, the most k positions can cover).
They read the whole slow tier each step, so they cost a pass over the 16-bit keys. The oracles
(`--specache_select oracle`, `oracle=mass`) choose the real row's k pairs from its exact scores:
where the low-bit weights are furthest off ("error") or the largest exact weights ("mass").
"""

from typing import Optional

import torch
from torch import Tensor

from caches.full import sixteen_bit_cache_bytes
from specache import SpeCacheLayer
from specache.ops import (
    LowBitPart,
    Merged,
    Segments,
    SparsePart,
    lowbit_partial_attention,
    merge_segments,
    position_weights,
    positions_mask,
)

# What `diagnose` sums per KV head
DIAGNOSTICS = (
    "own_hits",
    "own_total",
    "exact_hits",
    "exact_total",
    "coverage",
    "oracle_coverage",
    "rows",
    # the sparse pass's: the positions it mixed value by value, of those it saw, and the real
    # row's attention it gave its key groups' mean values
    "sparse_kept",
    "sparse_seen",
    "sparse_skipped_mass",
)


def select_top_k(scores: Tensor, candidates: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k candidate positions (candidates: (B, Hkv, T) bool) with the highest scores (B, Hkv, T,
    non-negative), best first, and which of them are real (a short sequence has fewer than k)."""
    top = scores.masked_fill(~candidates, -1.0).topk(k, dim=-1)
    return top.indices, top.values >= 0


def real_row_weights(part: LowBitPart, merged: Merged, seg: Segments, s: int) -> Tensor:
    """The weight the real row (row 0) gives each position of the history, per query head
    (B, Hkv, G, T)."""
    return position_weights(
        part.weights,
        merged.lowbit_scale,
        merged.p_fetched,
        seg.fetched_pos,
        merged.p_window,
        seg.quantized_len,
        s,
        0,
    )


def exact_real_row_probs(
    layer: SpeCacheLayer, rows: Tensor, seg: Segments, s: int
) -> tuple[Tensor, Tensor]:
    """The real row's exact attention, from the 16-bit keys in the slow tier, the window and its
    own key: the probabilities of the history's positions [0, T) (B, Hkv, G, T), per query head,
    and the probability of the window and its own key together (B, Hkv, G)."""
    b, n_kv, m, d = rows.shape
    real = rows.view(b, n_kv, m // s, s, d)[:, :, :, 0]
    t = layer.k_packed.shape[2]  # the positions that can be quantized; the rest are in the window
    keys = layer.tier.keys()[:, :, :t]
    device = rows.device
    quantized = torch.arange(t, device=device) < layer.state.quantized_len[:, None, None, None]
    window = torch.arange(seg.window_k.shape[2], device=device)
    in_window = window < seg.window_len[:, None, None, None]
    history = (real @ keys.float().transpose(-1, -2)).masked_fill(~quantized, float("-inf"))
    recent = (real @ seg.window_k.float().transpose(-1, -2)).masked_fill(~in_window, float("-inf"))
    own = (real * seg.new_k[:, :, None, 0].float()).sum(-1, keepdim=True)
    probs = torch.cat([history, recent, own], -1).softmax(-1)
    return probs[..., :t], probs[..., t:].sum(-1)


def diagnose(layer: SpeCacheLayer, rows: Tensor, seg: Segments, s: int) -> Tensor:
    """Why a selection fails, per KV head (len(DIAGNOSTICS), Hkv): recall of the fetched pairs
    (all k, prefetched and picked) against the real row's own low-bit top-k and against its exact
    top-k (from the 16-bit keys), the share of its exact attention mass read in 16 bits
    (coverage), and that share had the exact top-k been fetched."""
    probs, elsewhere = exact_real_row_probs(layer, rows, seg, s)
    mass, elsewhere = probs.mean(2), elsewhere.mean(2)  # a KV head's: the mean over its query heads
    t, k = mass.shape[-1], layer.k_spec + layer.k_real
    position = torch.arange(t, device=rows.device)
    selectable = (position < layer.state.quantized_len[:, None, None]) & (position >= layer.n_sinks)
    slot = torch.arange(seg.fetched_valid.shape[-1], device=rows.device)
    sinks = seg.fetched_valid & (slot < layer.n_sinks)
    coverage = (mass * positions_mask(seg.fetched_pos, seg.fetched_valid, t)).sum(-1) + elsewhere
    oracle, oracle_valid = select_top_k(mass, selectable, k)
    covered = positions_mask(oracle, oracle_valid, t) | positions_mask(seg.fetched_pos, sinks, t)
    oracle_coverage = (mass * covered).sum(-1) + elsewhere
    plain = seg._replace(fetched_valid=sinks)  # the real row's own low-bit pass: only sinks exact
    plain_part = lowbit_partial_attention(rows, layer.lowbit(), plain)
    own_weights = real_row_weights(plain_part, merge_segments(rows, plain_part, plain), plain, s)
    ranking = own_weights.amax(2) if layer.config.selection.gqa == "max" else own_weights.mean(2)
    own, own_valid = select_top_k(ranking, selectable, k)
    fetched_pos = seg.fetched_pos[:, :, layer.n_sinks :]
    fetched_valid = seg.fetched_valid[:, :, layer.n_sinks :]

    def hits(positions: Tensor, valid: Tensor) -> Tensor:
        found = (fetched_pos.unsqueeze(-1) == positions.unsqueeze(-2)) & fetched_valid.unsqueeze(-1)
        return (found.any(-2) & valid).sum(-1)

    sums = [
        hits(own, own_valid),
        own_valid.sum(-1),
        hits(oracle, oracle_valid),
        oracle_valid.sum(-1),
        coverage,
        oracle_coverage,
        torch.ones_like(coverage),
        *sparse_skipped(layer, rows, seg, s),
    ]
    return torch.stack([x.double() for x in sums]).sum(1)


def sparse_skipped(
    layer: SpeCacheLayer, rows: Tensor, seg: Segments, s: int
) -> tuple[Tensor, Tensor, Tensor]:
    """What the sparse pass skipped in this step's low-bit segment, per sequence and KV head: the
    positions it mixed value by value, those it saw, and the share of the real row's attention
    (the mean over its query heads) that it gave to key groups' mean values instead (zeros where
    the layer's pass is not sparse)."""
    method, kv = layer.config.method, layer.lowbit()
    nothing = torch.zeros(seg.fetched_pos.shape[:2], dtype=torch.float64, device=rows.device)
    if method.arithmetic != "sparse" or kv.k_packed.shape[2] == 0:
        return nothing, nothing, nothing
    visible = (seg.quantized_len, seg.fetched_pos, seg.fetched_valid)
    sparse = SparsePart(
        *torch.ops.specache.lowbit_partial_attention_sparse(
            rows, *kv[:6], kv.v_mean, kv.bits, kv.group, method.min_weight, *visible
        )
    )
    merged = merge_segments(rows, LowBitPart(*sparse[:4]), seg)
    skipped = torch.where(sparse.kept.unsqueeze(2), 0.0, sparse.weights).sum(-1)
    real = (skipped * merged.lowbit_scale.squeeze(-1))[:, :, ::s]  # row 0 of each query head
    seen = (sparse.weights > 0).any(2).sum(-1)
    return sparse.kept.sum(-1), seen, real.mean(-1)


class Diagnostics:
    """A specache.Probe: the diagnostics above summed per layer and KV head of `n_layers` SpeCache
    layers with `n_kv_heads` (with `observe`), and the oracle's choice of the real row's pairs
    (with `oracle`, "error" or "mass")."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        device: torch.device,
        oracle: Optional[str] = None,
        observe: bool = True,
    ):
        self.kind, self.observing = oracle, observe
        self.oracle = oracle is not None
        self.sums = torch.zeros(
            n_layers, len(DIAGNOSTICS), n_kv_heads, dtype=torch.float64, device=device
        )

    def reset(self) -> None:
        self.sums.zero_()

    def oracle_picks(
        self,
        layer: SpeCacheLayer,
        rows: Tensor,
        part: LowBitPart,
        merged: Merged,
        seg: Segments,
        s: int,
    ) -> tuple[Tensor, Tensor]:
        exact, _ = exact_real_row_probs(layer, rows, seg, s)
        if self.kind == "mass":
            scores = exact.mean(2)
        else:
            scores = (exact - real_row_weights(part, merged, seg, s)).abs().mean(2)
        t = part.weights.shape[-1]
        quantized = torch.arange(t, device=rows.device) < seg.quantized_len[:, None, None]
        candidates = quantized & ~positions_mask(seg.fetched_pos, seg.fetched_valid, t)
        return select_top_k(scores, candidates, layer.picks)

    def observe(self, layer: SpeCacheLayer, rows: Tensor, seg: Segments, s: int) -> None:
        if self.observing:
            self.sums[layer.index] += diagnose(layer, rows, seg, s)

    def summary(self) -> dict:
        """The sums as shares: overall and per layer (the mean over its KV heads)."""
        sums = self.sums.sum(-1)  # (layers, len(DIAGNOSTICS))
        named = dict(zip(DIAGNOSTICS, sums.T))
        shares = {
            "recall_own_lowbit": ("own_hits", "own_total"),
            "recall_exact": ("exact_hits", "exact_total"),
            "coverage": ("coverage", "rows"),
            "oracle_coverage": ("oracle_coverage", "rows"),
        }
        if named["sparse_seen"].sum() > 0:  # a sparse pass ran
            shares["sparse_kept"] = ("sparse_kept", "sparse_seen")
            shares["sparse_skipped_mass"] = ("sparse_skipped_mass", "rows")
        total = {
            key: float(named[a].sum() / max(1.0, float(named[b].sum())))
            for key, (a, b) in shares.items()
        }
        per_layer = {
            key: [round(float(x), 4) for x in named[a] / named[b].clamp_min(1)]
            for key, (a, b) in shares.items()
        }
        return {**total, "per_layer": per_layer}


def step_bytes(cache, positions: list[int]) -> int:
    """KV bytes one decode step of a SpeCache (plugged.PluggedSpeCache) reads when its sequences
    hold `positions` tokens: the low-bit copy up to each sequence's Lq, the window and the slots
    (the slow tier is read only by the fetches, counted apart), and the rings of sliding-window
    layers."""
    layer = cache.layers[0]
    copy = (layer.k_packed, layer.v_packed, layer.v_scale, layer.v_zero)
    per_position = sum(t.shape[-1] * t.element_size() for t in copy)
    per_position += 2 * layer.k_scale.shape[-1] * layer.k_scale.element_size() / layer.state.group
    pairs = layer.window_k.shape[2] + layer.fetched_k.shape[2]
    per_pair = 2 * layer.window_k.shape[-1] * layer.window_k.element_size()
    heads = layer.k_packed.shape[1] * len(cache.layers)
    rings = sum(ring.k_cache[0].nbytes + ring.v_cache[0].nbytes for ring in cache.rings)
    quantized = [cache.state.split(n)[0] for n in positions]
    lowbit = heads * sum(lq * per_position + pairs * per_pair for lq in quantized)
    return int(lowbit + rings * len(positions))


def cache_stats(cache, steps: int, row: Optional[int] = None) -> dict:
    """A SpeCache's (plugged.PluggedSpeCache) tier sizes, the ratio to a 16-bit cache of the same
    length, fetch volume, speculation quality, and the diagnostics when it has them: of every
    sequence, or of the one on `row` (specache/rows.py: its share of the tiers)."""
    c, method, state = cache.model.config, cache.config.method, cache.state
    layer, batch = cache.layers[0], state.quantized_len.shape[0]
    fast_global = sum(each.fast_tier_bytes() for each in cache.layers)
    fast_rings = sum(ring.fast_tier_bytes() for ring in cache.rings)
    fast, slow = fast_global + fast_rings, sum(each.tier.nbytes() for each in cache.layers)
    picked = slice(None)
    if row is not None:  # its share of the tiers, and its own counts
        fast, slow, batch, picked = fast // batch, slow // batch, 1, slice(row, row + 1)
    full_16bit = sixteen_bit_cache_bytes(cache.model, state.capacity, batch)
    pair_bytes = 2 * c.head_dim * layer.fetched_k.element_size()

    def total(counts: list[Tensor]) -> int:
        return sum(int(count[picked].sum()) for count in counts)

    pairs_read = total([each.pairs_read for each in cache.layers])
    discarded = total([each.heads_discarded for each in cache.layers])
    checked = total([each.heads_checked for each in cache.layers])
    select = cache.config.selection.name()
    if cache.probe is not None and cache.probe.oracle:
        select = f"oracle={cache.probe.kind} ({select})"
    kind = "specache" if method.speculative else "specache-nospec"
    stats = {
        "cache": kind if method.topk else "kivi",
        "bits": method.bits,
        "group": method.group,
        "residual": method.residual,
        "topk": layer.k_spec + layer.k_real,
        "select": select,
        "arithmetic": method.arithmetic,
        **({"tau": method.tau} if method.arithmetic == "sparse" else {}),
        "prefetched_pairs": layer.k_spec,
        "pairs_chosen_in_step": layer.k_real,
        "sinks": layer.n_sinks,
        "capacity_tokens": state.capacity,
        "fast_tier_bytes": fast,
        "slow_tier_bytes": slow,
        "fast_tier_ratio_to_16bit_cache": fast / full_16bit,
        "bytes_fetched_per_token": pairs_read * pair_bytes / max(1, steps * batch),
        "speculative_match_rate": (
            total([cache.matches]) / max(1, steps * batch) if cache.speculative else None
        ),
        "prefetch_discarded_share": discarded / checked if checked else None,
    }
    if cache.folder is not None:  # what the disk tier read: whole positions, each once
        stats["slow_tier"] = "disk"
        read = sum(each.tier.bytes_read for each in cache.layers)
        stats["slow_tier_bytes_read_per_step"] = read / max(1, steps)
    if cache.rings:  # a hybrid model: each layer type's fast tier against its own 16-bit cache
        global_16bit = 2 * 2 * c.n_local_heads * c.head_dim * state.capacity * batch
        global_16bit *= len(cache.layers)
        without_windows = sixteen_bit_cache_bytes(cache.model, state.capacity, batch, windows=False)
        stats.update(
            {
                "full_attention_layers": len(cache.layers),
                "sliding_window_layers": len(cache.rings),
                "fast_tier_bytes_full_attention_layers": fast_global,
                "fast_tier_bytes_sliding_window_layers": fast_rings,
                "fast_tier_ratio_full_attention_layers": fast_global / global_16bit,
                "fast_tier_ratio_sliding_window_layers": fast_rings / (full_16bit - global_16bit),
                "fast_tier_ratio_to_16bit_cache_without_windows": fast / without_windows,
            }
        )
    if cache.probe is not None and cache.probe.observing:
        stats["diagnostics"] = cache.probe.summary()
    return stats
