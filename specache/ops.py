"""The ops a decode step runs, each a torch.library op defined in plain PyTorch (the `_reference`
functions: the specification that every faster kernel is held to): the low-bit pass, the merge of
the four segments into one softmax, and the ranking of positions."""

import inspect
import typing
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from specache.integer import int8_scores, int8_value_mix
from specache.lowbit import LowBitKV, dequantize_keys, dequantize_values
from specache.sparse import kept_positions, sparse_value_mix

# Each is defined in plain PyTorch and registered as a torch.library op, which torch.compile
# keeps as one opaque call and which faster kernels can take over per device (specache/kernels
# registers C kernels for CPUs and Triton kernels for GPUs; the results are the same to
# float32 rounding). Ops are defined with torch.library.Library rather than custom_op: custom_op
# wraps every call in a Python autograd layer, 7 us a call in a compiled CPU step (measured), and a
# step makes about 150 calls.
#
# The new rows (S = 2 in a speculative step, S = 1 otherwise) attend over four segments of one
# sequence's history, in one softmax: the low-bit copy of the quantized positions [0, Lq) but the
# exact ones; the exact pairs in slots (chosen at the previous step, or within this one); the
# window of 16-bit pairs not quantized yet, positions [Lq, Lq + window_len); the new rows
# themselves, causally (the real row does not see the speculative row's key). Shapes: q (B, H, S,
# D); keys and values per KV head (B, Hkv, N, D); the rows sharing a KV head are (B, Hkv, M, D),
# M = G * S with G = H / Hkv query heads per KV head, row m = g * S + s.


class Segments(NamedTuple):
    """Everything but the low-bit copy that the new rows attend over."""

    quantized_len: Tensor  # (B,) Lq: positions [0, Lq) are in the low-bit copy
    fetched_k: Tensor  # (B, Hkv, K, D) exact pairs of the positions in fetched_pos
    fetched_v: Tensor
    fetched_pos: Tensor  # (B, Hkv, K) long
    fetched_valid: Tensor  # (B, Hkv, K) bool: which slots count
    window_k: Tensor  # (B, Hkv, R, D); slots [0, window_len) hold tokens
    window_v: Tensor
    window_len: Tensor  # (B,)
    new_k: Tensor  # (B, Hkv, S, D) the new rows' own keys and values
    new_v: Tensor


class LowBitPart(NamedTuple):
    """The low-bit segment's softmax pieces (`lowbit_partial_attention`)."""

    weights: Tensor  # (B, Hkv, M, T) exp(score - row_max) where attended in low bits, else 0
    row_max: Tensor  # (B, Hkv, M)
    row_sum: Tensor  # (B, Hkv, M)
    out: Tensor  # (B, Hkv, M, D), unnormalized


class SparsePart(NamedTuple):
    """`LowBitPart` of the sparse pass (`lowbit_partial_attention_sparse`), and which positions
    it mixed value by value."""

    weights: Tensor
    row_max: Tensor
    row_sum: Tensor
    out: Tensor
    kept: Tensor  # (B, Hkv, T) bool: mixed by its own value, not its key group's mean


class Merged(NamedTuple):
    """One softmax over the four segments (`merge_segments`)."""

    out: Tensor  # (B, Hkv, M, D) fp32: the attention output
    lowbit_scale: Tensor  # (B, Hkv, M, 1): turns the low-bit weights into probabilities
    p_fetched: Tensor  # (B, Hkv, M, K) probabilities of the exact pairs in slots
    p_window: Tensor  # (B, Hkv, M, R)
    p_new: Tensor  # (B, Hkv, M, S)


class Top(NamedTuple):
    """The positions chosen (`top_positions`)."""

    positions: Tensor  # (B, Hkv, k) int64, best first
    valid: Tensor  # (B, Hkv, k) bool: which are real (a short history has fewer than k)


def positions_mask(positions: Tensor, valid: Tensor, t: int) -> Tensor:
    """(B, Hkv, T) bool: which of the positions [0, T) some valid entry of `positions` (B, Hkv, K)
    holds. Counted, not scattered as booleans: an invalid entry may repeat a valid one's
    position."""
    counts = torch.zeros(positions.shape[:2] + (t,), dtype=torch.int32, device=positions.device)
    in_range = valid & (positions >= 0) & (positions < t)
    return counts.scatter_add(-1, positions.clamp(0, max(t - 1, 0)), in_range.to(torch.int32)) > 0


def lowbit_partial_attention_reference(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    bits: int,
    group: int,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> LowBitPart:
    """The low-bit segment: the softmax pieces of rows (B, Hkv, M, D, fp32, already scaled by
    D**-0.5) over the copy's positions [0, visible_len[b]) but the valid excluded ones (B, Hkv, E):

        score = rows . key[t];   row_max = max over allowed t (-inf when none is allowed)
        weights = exp(score - row_max) where allowed, exactly 0 elsewhere  (B, Hkv, M, T)
        row_sum = sum of weights;  out = sum of weights * value[t]  (unnormalized)

    T need not be a multiple of the group: k_scale holds ceil(T/group) key groups."""
    t = k_packed.shape[2]
    padded = k_scale.shape[2] * group  # whole key groups to dequantize; the padding is cut off
    keys = dequantize_keys(F.pad(k_packed, (0, 0, 0, padded - t)), k_scale, k_zero, bits, group)
    values = dequantize_values(v_packed, v_scale, v_zero, bits, group)
    scores = rows @ keys[:, :, :t].transpose(-1, -2)
    weights, row_max = lowbit_softmax(scores, visible_len, excluded_pos, excluded_valid)
    return LowBitPart(weights, row_max, weights.sum(-1), weights @ values)


def lowbit_softmax(
    scores: Tensor, visible_len: Tensor, excluded_pos: Tensor, excluded_valid: Tensor
) -> tuple[Tensor, Tensor]:
    """The low-bit pass's weights exp(score - row_max) over the allowed positions (exactly 0
    elsewhere) and row_max (-inf where none is allowed), from scores (B, Hkv, M, T)."""
    t = scores.shape[-1]
    visible = torch.arange(t, device=scores.device) < visible_len[:, None, None]
    allowed = (visible & ~positions_mask(excluded_pos, excluded_valid, t)).unsqueeze(2)
    row_max = scores.masked_fill(~allowed, float("-inf")).amax(-1)
    return torch.where(allowed, torch.exp(scores - row_max.unsqueeze(-1)), 0.0), row_max


def lowbit_partial_attention_int8_reference(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    bits: int,
    group: int,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> LowBitPart:
    """`lowbit_partial_attention_reference` with both products in integers (`int8_scores`,
    `int8_value_mix`); the softmax between them is the same."""
    scores = int8_scores(rows, k_packed, k_scale, k_zero, bits, group)
    weights, row_max = lowbit_softmax(scores, visible_len, excluded_pos, excluded_valid)
    out = int8_value_mix(weights, v_packed, v_scale, v_zero, bits)
    return LowBitPart(weights, row_max, weights.sum(-1), out)


def lowbit_partial_attention_sparse_reference(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    v_mean: Tensor,
    bits: int,
    group: int,
    min_weight: float,
    visible_len: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
) -> SparsePart:
    """The sparse pass (ours, specache/sparse.py): the integer pass's scores and softmax, then
    the values of the positions some row weighs at least `min_weight` (`kept_positions`), and
    the rest of each key group's weight times its mean value `v_mean` (B, Hkv, ceil(T/group), D)
    (`sparse_value_mix`). row_sum counts every weight."""
    scores = int8_scores(rows, k_packed, k_scale, k_zero, bits, group)
    weights, row_max = lowbit_softmax(scores, visible_len, excluded_pos, excluded_valid)
    kept = kept_positions(weights, min_weight)
    out = sparse_value_mix(weights, kept, v_packed, v_scale, v_zero, v_mean, bits, group)
    return SparsePart(weights, row_max, weights.sum(-1), out, kept)


def merge_segments_reference(
    rows: Tensor,
    row_max: Tensor,
    row_sum: Tensor,
    lowbit_out: Tensor,
    fetched_k: Tensor,
    fetched_v: Tensor,
    fetched_valid: Tensor,
    window_k: Tensor,
    window_v: Tensor,
    window_len: Tensor,
    new_k: Tensor,
    new_v: Tensor,
) -> Merged:
    """The rows over the three 16-bit segments (the valid slots, the first window_len[b] of the
    window, the new pairs causally: row m sees 0 .. m % S), in one softmax with the low-bit pass
    given as its row_max, row_sum and unnormalized output, by the log-sum-exp rule. Returns the
    output (B, Hkv, M, D), the factor that turns the low-bit weights into probabilities
    (B, Hkv, M, 1), and each segment's probabilities (B, Hkv, M, N)."""
    segments = [(fetched_k, fetched_v), (window_k, window_v), (new_k, new_v)]
    device, m, s = rows.device, rows.shape[2], new_k.shape[2]
    window_ok = torch.arange(window_k.shape[2], device=device) < window_len[:, None, None, None]
    new_ok = torch.arange(s, device=device) <= (torch.arange(m, device=device) % s)[:, None]
    oks = (fetched_valid.unsqueeze(2), window_ok, new_ok)
    scores = [
        (rows @ k.float().transpose(-1, -2)).masked_fill(~ok, float("-inf"))
        for (k, _), ok in zip(segments, oks)
    ]
    # every row sees its own pair, so the maximum is finite
    maxima = [row_max] + [x.amax(-1) for x in scores if x.shape[-1]]
    top = torch.stack(maxima, -1).amax(-1, keepdim=True)
    lowbit_scale = torch.exp(row_max.unsqueeze(-1) - top)  # 0 where nothing is low-bit yet
    weights = [torch.exp(x - top) for x in scores]
    total = row_sum.unsqueeze(-1) * lowbit_scale + sum(w.sum(-1, keepdim=True) for w in weights)
    probs = [w / total for w in weights]
    exact = sum(p @ v.float() for p, (_, v) in zip(probs, segments))
    return Merged(lowbit_out * (lowbit_scale / total) + exact, lowbit_scale / total, *probs)


def position_weights(
    weights: Tensor,
    scale: Tensor,
    p_fetched: Tensor,
    fetched_pos: Tensor,
    p_window: Tensor,
    window_start: Tensor,
    s: int,
    row: int,
) -> Tensor:
    """How much weight each position of the history [0, T) gets from new row `row` (of S), per
    query head (B, Hkv, G, T): the low-bit weights times their scale, plus the probabilities of
    the slots holding it, plus those of the window (positions window_start[b] + r)."""
    b, h, m, t = weights.shape

    def pick(x: Tensor) -> Tensor:  # (B, Hkv, G, N): row `row` of each query head
        return x.reshape(b, h, m // s, s, -1)[:, :, :, row]

    weight = pick(weights) * pick(scale.reshape(b, h, m, 1))
    if t == 0:
        return weight
    fetched = fetched_pos.clamp(0, t - 1)[:, :, None].expand(-1, -1, m // s, -1)
    window_pos = window_start[:, None] + torch.arange(p_window.shape[-1], device=weights.device)
    # positions beyond the copy (never quantized) have no place in the ranking
    p_window_seen = pick(p_window) * (window_pos < t)[:, None, None, :]
    window_index = window_pos.clamp(max=t - 1)[:, None, None, :].expand_as(p_window_seen)
    return weight.scatter_add(-1, fetched, pick(p_fetched)).scatter_add(
        -1, window_index, p_window_seen
    )


def top_positions_reference(
    weights: Tensor,
    scale: Tensor,
    p_fetched: Tensor,
    fetched_pos: Tensor,
    p_window: Tensor,
    window_start: Tensor,
    s: int,
    row: int,
    gqa_max: bool,
    lower: int,
    upper: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
    k: int,
) -> Top:
    """The choice of positions: each KV head ranks the history by `position_weights`, their max
    over its query heads (gqa_max) or their mean, and returns its k best candidates (B, Hkv, k),
    best first, and which of them are real (a short history has fewer than k). Candidates: lower
    <= t < upper[b], but the valid excluded positions (B, Hkv, E)."""
    t = weights.shape[-1]
    weight = position_weights(
        weights, scale, p_fetched, fetched_pos, p_window, window_start, s, row
    )
    ranking = weight.amax(2) if gqa_max else weight.mean(2)
    position = torch.arange(t, device=weights.device)
    candidates = (
        (position >= lower)
        & (position < upper[:, None, None])
        & ~positions_mask(excluded_pos, excluded_valid, t)
    )
    top = ranking.masked_fill(~candidates, -1.0).topk(k, dim=-1)
    return Top(top.indices, top.values >= 0)


# --- each op declared once --------------------------------------------------------------------
# An op's signature is its reference's: `declare` derives the schema from the reference's
# annotations (the outputs from the NamedTuple it returns), makes the reference the op's
# definition, and registers the fake (shapes only, for torch.compile), which reads the arguments
# by name, as the kernels' wrappers do (`arguments`). The C++ implementations restate it in C++
# types; torch checks those against the schema when it registers them.
OPS = torch.library.Library("specache", "FRAGMENT")
SCHEMA_TYPES = {
    Tensor: "Tensor",
    Optional[Tensor]: "Tensor?",
    int: "int",
    bool: "bool",
    float: "float",
}


@lru_cache(maxsize=None)
def parameter_names(reference: Callable) -> tuple[str, ...]:
    """The names of an op's arguments, its reference's, read once: the kernels' wrappers bind them
    at every call, and inspecting a signature costs about as much as the call (~17 us)."""
    return tuple(inspect.signature(reference).parameters)


def arguments(reference: Callable, args: tuple, kwargs: Optional[dict] = None) -> SimpleNamespace:
    """An op's arguments `args` (its schema's order), named as its reference names them."""
    return SimpleNamespace(**dict(zip(parameter_names(reference), args)), **(kwargs or {}))


def declare(reference: Callable, fake: Callable[[SimpleNamespace], tuple]) -> None:
    """Define the op specache::NAME of `reference` (NAME_reference), computed by it, with `fake`
    giving its outputs' shapes from its named `arguments`."""
    name = reference.__name__.removesuffix("_reference")
    hints = typing.get_type_hints(reference)
    inputs = ", ".join(f"{SCHEMA_TYPES[hints[arg]]} {arg}" for arg in parameter_names(reference))
    outputs = ", ".join("Tensor" for _ in hints["return"]._fields)
    OPS.define(f"{name}({inputs}) -> ({outputs})")
    OPS.impl(name, reference, "CompositeExplicitAutograd")

    def shapes(*args, **kwargs) -> tuple:
        return fake(arguments(reference, args, kwargs))

    torch.library.register_fake(f"specache::{name}", shapes)


def lowbit_part_shapes(a: SimpleNamespace) -> LowBitPart:
    b, h, m, d = a.rows.shape
    t = a.k_packed.shape[2]
    new = a.rows.new_empty
    return LowBitPart(new(b, h, m, t), new(b, h, m), new(b, h, m), new(b, h, m, d))


def sparse_part_shapes(a: SimpleNamespace) -> SparsePart:
    b, h, t, _ = a.k_packed.shape
    kept = a.rows.new_empty(b, h, t, dtype=torch.bool)
    return SparsePart(*lowbit_part_shapes(a), kept)


def merged_shapes(a: SimpleNamespace) -> Merged:
    b, h, m, _ = a.rows.shape
    probs = (a.rows.new_empty(b, h, m, x.shape[2]) for x in (a.fetched_k, a.window_k, a.new_k))
    return Merged(torch.empty_like(a.rows), a.rows.new_empty(b, h, m, 1), *probs)


def top_shapes(a: SimpleNamespace) -> Top:
    b, h = a.weights.shape[:2]
    return Top(
        a.weights.new_empty(b, h, a.k, dtype=torch.int64),
        a.weights.new_empty(b, h, a.k, dtype=torch.bool),
    )


declare(lowbit_partial_attention_reference, lowbit_part_shapes)
declare(lowbit_partial_attention_int8_reference, lowbit_part_shapes)
declare(lowbit_partial_attention_sparse_reference, sparse_part_shapes)
declare(merge_segments_reference, merged_shapes)
declare(top_positions_reference, top_shapes)


def query_rows(q: Tensor, n_kv_heads: int) -> Tensor:
    """(B, H, S, D) -> (B, Hkv, G*S, D), fp32 and scaled by D**-0.5: the query rows that share
    each KV head; row = g*S + s."""
    b, h, s, d = q.shape
    return q.reshape(b, n_kv_heads, (h // n_kv_heads) * s, d).float() * d**-0.5


def lowbit_partial_attention(
    rows: Tensor, kv: LowBitKV, seg: Segments, arithmetic: str = "float", min_weight: float = 0.0
) -> LowBitPart:
    """The low-bit segment of `seg`: positions [0, Lq) but the exact ones in valid slots
    (`specache::lowbit_partial_attention`, or its `_int8` or `_sparse` twin: the sparse pass
    mixes by their key group's mean value the positions no row weighs `min_weight`, and needs
    kv.v_mean). A copy of no positions (a capacity too short to quantize anything) contributes
    nothing."""
    if kv.k_packed.shape[2] == 0:
        b, h, m, d = rows.shape
        return LowBitPart(
            rows.new_zeros(b, h, m, 0),
            rows.new_full((b, h, m), float("-inf")),
            rows.new_zeros(b, h, m),
            rows.new_zeros(b, h, m, d),
        )
    visible = (seg.quantized_len, seg.fetched_pos, seg.fetched_valid)
    if arithmetic == "sparse":
        if kv.v_mean is None:
            raise ValueError("the sparse pass needs the copy's mean values (LowBitKV.v_mean)")
        sparse = torch.ops.specache.lowbit_partial_attention_sparse
        return LowBitPart(
            *sparse(rows, *kv[:6], kv.v_mean, kv.bits, kv.group, min_weight, *visible)[:4]
        )
    op = (
        torch.ops.specache.lowbit_partial_attention_int8
        if arithmetic == "int8"
        else torch.ops.specache.lowbit_partial_attention
    )
    return LowBitPart(*op(rows, *kv[:6], kv.bits, kv.group, *visible))


def merge_segments(rows: Tensor, part: LowBitPart, seg: Segments) -> Merged:
    """The low-bit segment merged with the three 16-bit ones: the output and every segment's
    probabilities (`specache::merge_segments`)."""
    return Merged(
        *torch.ops.specache.merge_segments(
            rows,
            part.row_max,
            part.row_sum,
            part.out,
            seg.fetched_k,
            seg.fetched_v,
            seg.fetched_valid,
            seg.window_k,
            seg.window_v,
            seg.window_len,
            seg.new_k,
            seg.new_v,
        )
    )


def top_positions(
    part: LowBitPart,
    merged: Merged,
    seg: Segments,
    s: int,
    row: int,
    gqa: str,
    lower: int,
    upper: Tensor,
    excluded_pos: Tensor,
    excluded_valid: Tensor,
    k: int,
) -> Top:
    """The k positions new row `row` weighs most, per KV head, among lower <= t < upper[b] but the
    valid excluded ones (`specache::top_positions`)."""
    return Top(
        *torch.ops.specache.top_positions(
            part.weights,
            merged.lowbit_scale,
            merged.p_fetched,
            seg.fetched_pos,
            merged.p_window,
            seg.quantized_len,
            s,
            row,
            gqa == "max",
            lower,
            upper,
            excluded_pos,
            excluded_valid,
            k,
        )
    )
