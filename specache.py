"""SpeCache: speculative key-value caching (Jie et al., ICML 2025, arXiv 2503.16163), in one file.

This file is the whole method, on PyTorch and the standard library alone: copy it into your own
project and plug it into your model (the last section shows how; docs/method.md explains every
choice, and marks as "ours" what the paper leaves open or what we do differently).

The complete 16-bit KV cache lives in the big slow tier (host RAM); the small fast tier (VRAM, or
on a CPU the working set a step reads) keeps a 1- or 2-bit copy of every key and value, a 16-bit
window of the newest tokens, and a few 16-bit pairs per layer and KV head read exactly. Every
decode step runs two tokens at once, the real one and a speculative guess of the next one; the
speculative row's attention decides which pairs to fetch for the next step, and the fetch runs
while the rest of this step computes.

The timeline (the paper's Appendix A; names as there):

  Prefill. Each layer attends over the prompt in full precision, then quantizes the prompt's
  keys and values into the low-bit copy (whole groups of g tokens, all but the newest R, which
  stay in the 16-bit window) and sends its 16-bit K, V to the slow tier, before the next layer
  runs.

  Bootstrap. The first token T1 attends over the low-bit copy and the window. Its attention gives
  kappa_1, the positions to fetch for the first step, and its logits the first guess T'2. Its K, V
  are dropped (the next step computes them again).

  Decode step t. Rows [T_t, T'_{t+1}] attend in mixed precision: 16-bit pairs at the fetched
  positions and in the window, the low-bit copy everywhere else (nothing is dropped). The real
  row does not see the speculative row's key. Per layer, the speculative row's weights give
  kappa_{t+1}, whose fetch starts as soon as the layer is done. The real row's K, V go to the slow
  tier and join the window, whose oldest group moves to the low-bit copy once it holds R + g
  tokens; the speculative row's are dropped. Row 0's logits give T_{t+1} (any sampler); the next
  guess comes from row 1's logits. A wrong guess is never rolled back: it only makes the next
  fetch less apt.

Choosing the exact pairs: the paper's rule and ours. With a 1-bit copy, the paper's rule (the
speculative row's top-k, averaged over each KV head's query heads) loses most needle retrievals on
the models measured here: the speculative row attends with pairs chosen for another query, its
choice for the next step is worse for it, and the real row pays. Ours lets the real row choose half
of the k pairs within the step from its own low-bit scores (`pick_within_step`): the copy lists 8
candidates per pick, whose 16-bit keys decide (the shortlist). Smaller changes follow; `Selection`
names every rule.

Variants: `speculative=False` is the paper's non-speculative baseline (each step's k pairs are the
real row's own low-bit top-k, fetched and waited for); `topk=0` is KIVI alone (the low-bit copy and
the window, nothing fetched).

The file, top to bottom: the configuration; what plugs in from outside (a slow tier, and
diagnostics: two protocols); the low-bit copy (quantizer and bit packing); the choice of pairs (its
rules, the speculative token); the ops a step runs, each defined here in plain PyTorch as a
torch.library op that faster kernels may register for their device (this repository's kernels/
does, for CPUs and GPUs; the results are the same either way); prefill over a history; the RAM and
pinned-host slow tiers; one layer's cache; the two-row step and the bootstrap that drive a
generation, with how a host plugs SpeCache in; last, rows: sequences that come and go in one cache
(a server's continuous batching).
"""

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, NamedTuple, Optional, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# --- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """The paper's settings."""

    bits: int = 1  # low-bit copy: 1 or 2 bits per element
    group: int = 64  # g: tokens per key group (per channel), channels per value group (per token)
    residual: int = 64  # R: the newest R tokens stay 16-bit; a multiple of g
    topk: int = 64  # k: 16-bit pairs read per layer and KV head each step; 0 = KIVI alone
    speculative: bool = True  # False: the paper's non-speculative baseline
    # the low-bit pass's products: "float", or "int8" (ours: 8-bit integers, what CPUs with
    # integer dot products run fastest; `lowbit_partial_attention_int8_reference`)
    arithmetic: str = "float"


@dataclass(frozen=True)
class Selection:
    """How the exact pairs are chosen. Its defaults are ours; `PAPER` below is the paper's rule.
    `parse` reads the names of the command line's --specache_select."""

    # split (ours): the share of the k pairs that the real row chooses within the step
    real_share: float = 0.5
    # gqa-max (ours): a KV head ranks positions by the max over its query heads ("mean": paper)
    gqa: str = "max"
    # correct (ours, FreeKV's): a KV head whose real query is less alike than this cosine to the
    # query that chose its prefetch discards it, and the real row picks all k (None: never)
    correct_below: Optional[float] = 0.9
    sinks: int = 4  # sinks (ours): the first positions, always exact
    # lloyd (ours): 1-bit levels from the data ("minmax": the paper's); midway (ours, an option):
    # the same for values, and for keys halfway between Lloyd's levels and the paper's
    levels: str = "lloyd"
    guess: str = "lookup"  # lookup (ours): the speculative token ("greedy": the paper's)
    reuse: bool = True  # reuse (ours): do not read again what the previous prefetch held
    # shortlist (ours): the real row reads the pairs of its copy's top n x picks and keeps the
    # picks their exact keys weigh most (0: the copy's top picks, read alone). It costs the slow
    # tier n x the real row's reads; what it buys is in docs/method.md#the-shortlist-ours
    shortlist: int = 8

    @classmethod
    def parse(cls, select: str) -> "Selection":
        """ "paper", "default" (ours), or a comma-separated list of changes to the paper's rule,
        named as in VARIANTS ("split=0.25" or "sinks=8" set a value)."""
        chosen = PAPER
        for item in filter(None, (part.strip() for part in select.split(","))):
            name, _, value = item.partition("=")
            if name in ("paper", "default"):
                if value:
                    raise ValueError(f"--specache_select: {name} takes no value")
                chosen = cls() if name == "default" else chosen
                continue
            if name not in VARIANTS:
                raise ValueError(
                    f"unknown --specache_select entry {name!r}: use paper, default or "
                    f"some of {', '.join(VARIANTS)}"
                )
            field, default, parser = VARIANTS[name]
            if value and parser is None:
                raise ValueError(f"--specache_select: {name} takes no value")
            try:
                chosen = replace(chosen, **{field: parser(value) if value else default})
            except ValueError:
                raise ValueError(
                    f"--specache_select: {name}={value} is not a valid {parser.__name__}"
                ) from None
        return chosen

    def name(self) -> str:
        """As --specache_select would name it."""
        names = []
        for name, (field, default, parser) in VARIANTS.items():
            value = getattr(self, field)
            if value == getattr(PAPER, field):
                continue
            if parser is not None:
                names.append(f"{name}={value}")
            elif value == default:  # a name without a value: only the one that sets this value
                names.append(name)
        return ",".join(names) or "paper"


PAPER = Selection(
    real_share=0.0,
    gqa="mean",
    correct_below=None,
    sinks=0,
    levels="minmax",
    guess="greedy",
    reuse=False,
    shortlist=0,
)
# name: (field, its value when the name comes without "=value", the value's type; None: no value)
VARIANTS = {
    "split": ("real_share", 0.5, float),
    "gqa-max": ("gqa", "max", None),
    "correct": ("correct_below", 0.9, float),
    "sinks": ("sinks", 4, int),
    "lloyd": ("levels", "lloyd", None),
    "midway": ("levels", "midway", None),
    "lookup": ("guess", "lookup", None),
    "reuse": ("reuse", True, None),
    "shortlist": ("shortlist", 8, int),
}


@dataclass(frozen=True)
class Placement:
    """Where the pairs live and how they move."""

    pair_dtype: Optional[torch.dtype] = None  # the exact pairs' dtype; None: 16-bit (see below)
    # a slow tier apart from the fast one (a GPU's host memory, a disk): False waits for each
    # prefetch as soon as it starts, which measures what the overlap buys
    overlap_fetch: bool = True
    # None: host RAM (pinned, beside a GPU); or a callable that makes each layer's slow tier
    # from its TierSpec (this repository's disk_tier.py makes one on disk)
    slow_tier: Optional[Callable[["TierSpec"], "SlowTier"]] = None

    def pair_dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.pair_dtype or sixteen_bit_dtype(model_dtype)


@dataclass(frozen=True)
class SpeCacheConfig:
    method: Method = Method()
    selection: Selection = Selection()
    placement: Placement = Placement()

    def validate(self, head_dim: int) -> None:
        """Raise ValueError, naming the setting, for a configuration this model cannot run."""
        m, s = self.method, self.selection
        checks = [
            (m.bits in (1, 2), f"SpeCache bits must be 1 or 2, got {m.bits}"),
            (
                m.group >= 1 and m.residual >= 1,
                f"SpeCache group and residual must be positive, got {m.group} and {m.residual}",
            ),
            (
                m.residual % max(m.group, 1) == 0,
                f"the residual window ({m.residual}) must be a multiple of the group size "
                f"({m.group}), so that groups of tokens leave the window whole",
            ),
            (m.topk >= 0, f"SpeCache top-k must be >= 0, got {m.topk}"),
            (
                m.arithmetic in ARITHMETICS,
                f"SpeCache arithmetic must be float or int8, got {m.arithmetic!r}",
            ),
            (
                0 <= s.real_share <= 1,
                f"split: the real row's share of k must be in [0, 1], got {s.real_share}",
            ),
            (
                s.gqa in ("mean", "max") and s.levels in LEVELS and s.guess in GUESSES,
                f"unknown selection setting: gqa={s.gqa!r}, levels={s.levels!r}, guess={s.guess!r}",
            ),
            (
                s.correct_below is None or -1 <= s.correct_below <= 1,
                f"correct: the threshold is a cosine in [-1, 1], got {s.correct_below}",
            ),
            (s.sinks >= 0, f"sinks must be >= 0, got {s.sinks}"),
            (s.shortlist >= 0, f"shortlist must be >= 0 (0: none), got {s.shortlist}"),
            (
                head_dim * m.bits % 8 == 0,
                f"SpeCache packs each token's {m.bits}-bit codes into whole bytes, so head_dim x "
                f"bits must be a multiple of 8; this model's head_dim is {head_dim}",
            ),
            (
                m.group < 1 or head_dim % value_group(m.group, head_dim) == 0,
                f"head_dim {head_dim} is not a multiple of the value group size {m.group}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# --- what plugs in from outside: a slow tier, and diagnostics -------------------------------
# A layer's slow tier is any object with SlowTier's methods, made from a TierSpec (Placement's
# slow_tier; by default host RAM, pinned beside a GPU: see "the slow tier" below). Diagnostics
# are a Probe, which the method calls only when one is given.


class PrefetchSlots(NamedTuple):
    """Where a layer's prefetch lands: its slot buffers (B, Hkv, slots, ...) and the slots."""

    k: Tensor
    v: Tensor
    pos: Tensor
    valid: Tensor
    where: slice


class Kappa(NamedTuple):
    """The positions a prefetch fetches (B, Hkv, k_spec), and which of them are real."""

    pos: Tensor
    valid: Tensor


class TierSpec(NamedTuple):
    """What a layer's slow tier is made from."""

    shape: tuple[int, int, int, int]  # (B, Hkv, T, D): every position of every sequence
    dtype: torch.dtype  # the pairs'
    device: torch.device  # the fast tier's
    slots: Optional[PrefetchSlots]  # None: the layer prefetches nothing
    reuse: bool  # a read need not read again what the previous read of its kind held
    overlap: bool  # Placement.overlap_fetch
    # where each sequence's next real row goes (next_position() on the device, held() on the host),
    # and the rows a step moves (moved())
    state: "SpeCacheState"


class SlowTier(Protocol):
    """One layer's complete 16-bit K and V, and the moves of its pairs into the fast tier. A layer
    calls, over a generation: reset; write (the prompt, in one piece or in chunks); read_range (a
    chunk's history); then per pass before_step, read (the real row's picks), after_step."""

    def reset(self, rows: Optional[list[int]] = None) -> None:
        """A generation begins (on `rows` only, see "rows"): nothing in flight, nothing held."""

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Sequence b's pairs k, v (Hkv, N, D) at positions [start, start + N)."""

    def read_range(
        self, first: int, last: int, rows: Optional[list[int]] = None
    ) -> tuple[Tensor, Tensor]:
        """Every sequence's pairs at [first, last), (B, Hkv, N, D) each, on the fast tier's
        device; or those of the sequences on `rows` only (len(rows), Hkv, N, D)."""

    def read(self, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Inside the step, now: the pairs (B, Hkv, K, D) at positions (B, Hkv, K) (those not
        valid may hold anything finite)."""

    def before_step(self) -> None:
        """The prefetch started after this layer's previous pass lands in its slots."""

    def after_step(
        self, new_k: Optional[Tensor], new_v: Optional[Tensor], kappa: Optional[Kappa]
    ) -> None:
        """The real rows' pairs (B, Hkv, D) join the tier at TierSpec.state.next_position (None:
        nothing kept), and the prefetch of kappa into the slots starts (None: no prefetch)."""

    def keys(self) -> Tensor:
        """Every key (B, Hkv, T, D) on the fast tier's device (diagnostics: it reads them all)."""

    def nbytes(self) -> int:
        """Bytes held."""


class Probe(Protocol):
    """Diagnostics plugged in from outside (this repository's specache_stats.py); the method
    never needs one. `oracle`: the real row's picks come from `oracle_picks` instead of its
    low-bit weights."""

    oracle: bool

    def reset(self) -> None:
        """A generation begins."""

    def oracle_picks(
        self,
        layer: "SpeCacheLayer",
        rows: Tensor,
        part: "LowBitPart",
        merged: "Merged",
        seg: "Segments",
        s: int,
    ) -> tuple[Tensor, Tensor]:
        """The real row's `layer.picks` positions (B, Hkv, picks), and which are real."""

    def observe(self, layer: "SpeCacheLayer", rows: Tensor, seg: "Segments", s: int) -> None:
        """A decode step's pass through `layer`, before the prefetch rewrites its slots."""


# --- the low-bit copy ------------------------------------------------------------------------
# KIVI's layout: keys are quantized per channel over groups of g consecutive tokens, values per
# token over groups of min(g, head_dim) consecutive channels. A group with minimum m and maximum M
# stores a scale s and a zero z (16-bit) and dequantizes as code * s + z.
# - 2 bits: z = m, s = (M - m) / 3, codes 0..3 (nearest level).
# - 1 bit (the paper's): the levels m + range/4 and m + 3 range/4 (z = (3m + M)/4, s = range/2),
#   code 1 where x >= (m + M)/2. KIVI's own 1-bit levels, at the extremes, make models collapse.
# - 1 bit, Lloyd (ours): the levels are the means of the group's values below and above its
#   midpoint, one step of Lloyd-Max from the paper's, stored in the same scale and zero.
# - 1 bit, midway (ours, keys only, an option): each level halfway between Lloyd's and the
#   paper's. Lloyd's levels are nearest on average, but they pull a group's extreme keys, the ones
#   that score high, toward its crowd, and the copy's keys are read to rank positions. On three
#   models' own decode queries the attention output's error with the copy's top-k fell 4% and 8%
#   against Lloyd's (SmolLM2, Gemma-3) and held on Qwen2.5 (docs/RESULTS.md).
# Codes are chosen against the stored (rounded) scale and zero, so they are nearest for the levels
# dequantization uses. Keys and values are packed along channels, per token: token t's codes fill
# head_dim * bits / 8 bytes, element i at bits [i*bits % 8, ...) of byte i*bits // 8.

SCALE_DTYPES = (torch.float16, torch.bfloat16)
LEVELS = ("minmax", "lloyd", "midway")


def sixteen_bit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The model's dtype if it is 16-bit, else fp16: for scales and zeros, and for the exact
    pairs."""
    return dtype if dtype in SCALE_DTYPES else torch.float16


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Integer codes (..., N) below 2**bits, packed into bytes (..., ceil(N * bits / 8)), low bits
    first."""
    per_byte = 8 // bits
    n = codes.shape[-1]
    padded = (n + per_byte - 1) // per_byte * per_byte
    codes = F.pad(codes.to(torch.uint8), (0, padded - n))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    groups = codes.view(*codes.shape[:-1], padded // per_byte, per_byte) << shifts
    return groups.sum(-1, dtype=torch.uint8)  # disjoint bit fields: the sum is a bitwise or


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack_bits: the first `n` codes (..., n) as uint8."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n]


def quantize_groups(
    x: Tensor, bits: int, dim: int, scale_dtype: torch.dtype, levels: str = "minmax"
) -> tuple[Tensor, Tensor, Tensor]:
    """Codes shaped like x (uint8), and a scale and zero per slice along `dim` (kept as size 1)."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    if bits == 1 and levels in ("lloyd", "midway"):
        upper = xf >= (lo + hi) / 2
        n_upper = upper.sum(dim, keepdim=True)
        n_lower = xf.shape[dim] - n_upper
        sum_upper = torch.where(upper, xf, 0.0).sum(dim, keepdim=True)
        sum_lower = xf.sum(dim, keepdim=True) - sum_upper
        low = torch.where(n_lower > 0, sum_lower / n_lower.clamp_min(1), lo)
        high = torch.where(n_upper > 0, sum_upper / n_upper.clamp_min(1), hi)
        if levels == "midway":
            low, high = (low + (3 * lo + hi) / 4) / 2, (high + (lo + 3 * hi) / 4) / 2
        zero, scale = low, high - low
    elif bits == 1:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    elif bits == 2:
        zero, scale = lo, (hi - lo) / 3
    else:
        raise ValueError(f"bits must be 1 or 2, got {bits}")
    scale, zero = scale.to(scale_dtype), zero.to(scale_dtype)
    s, z = scale.float(), zero.float()
    level = torch.floor((xf - z) / torch.where(s > 0, s, 1.0) + 0.5)  # ties go up
    codes = torch.where(s > 0, level, 0.0).clamp(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale, zero


def value_group(group: int, head_dim: int) -> int:
    return min(group, head_dim)


def quantize_keys(
    k: Tensor, bits: int, group: int, scale_dtype: torch.dtype, levels: str = "minmax"
) -> tuple[Tensor, Tensor, Tensor]:
    """Keys (..., T, D), T a multiple of `group`: packed codes (..., T, D*bits/8), scale and zero
    (..., T/group, D)."""
    *lead, t, d = k.shape
    grouped = k.reshape(*lead, t // group, group, d)
    codes, scale, zero = quantize_groups(grouped, bits, -2, scale_dtype, levels)
    return pack_bits(codes.reshape(*lead, t, d), bits), scale.squeeze(-2), zero.squeeze(-2)


def quantize_values(
    v: Tensor, bits: int, group: int, scale_dtype: torch.dtype, levels: str = "minmax"
) -> tuple[Tensor, Tensor, Tensor]:
    """Values (..., T, D): packed codes (..., T, D*bits/8), scale and zero (..., T, D/group_v).
    midway is a rule for keys: values take Lloyd's levels under it."""
    *lead, t, d = v.shape
    gv = value_group(group, d)
    grouped = v.reshape(*lead, t, d // gv, gv)
    levels = "lloyd" if levels == "midway" else levels
    codes, scale, zero = quantize_groups(grouped, bits, -1, scale_dtype, levels)
    return pack_bits(codes.reshape(*lead, t, d), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_keys(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int) -> Tensor:
    """fp32 keys (..., T, D) from quantize_keys' output."""
    d = scale.shape[-1]
    codes = unpack_bits(packed, bits, d).float()
    t = codes.shape[-2]
    codes = codes.view(*codes.shape[:-2], t // group, group, d)
    return (codes * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)).flatten(-3, -2)


def dequantize_values(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int) -> Tensor:
    """fp32 values (..., T, D) from quantize_values' output."""
    n_groups = scale.shape[-1]
    head_dim = packed.shape[-1] * 8 // bits
    codes = unpack_bits(packed, bits, head_dim).float()
    codes = codes.view(*codes.shape[:-1], n_groups, head_dim // n_groups)
    return (codes * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


class LowBitKV(NamedTuple):
    """One layer's low-bit copy in the layout above."""

    k_packed: Tensor  # (B, Hkv, T, D*bits/8) uint8
    k_scale: Tensor  # (B, Hkv, T/group, D)
    k_zero: Tensor
    v_packed: Tensor  # (B, Hkv, T, D*bits/8) uint8
    v_scale: Tensor  # (B, Hkv, T, D/group_v)
    v_zero: Tensor
    bits: int
    group: int

    def dequantized(self, first: int, last: int) -> tuple[Tensor, Tensor]:
        """fp32 keys and values (B, Hkv, last - first, D) of positions [first, last), whole
        groups."""
        groups = slice(first // self.group, last // self.group)
        k = dequantize_keys(
            self.k_packed[:, :, first:last],
            self.k_scale[:, :, groups],
            self.k_zero[:, :, groups],
            self.bits,
            self.group,
        )
        v = dequantize_values(
            self.v_packed[:, :, first:last],
            self.v_scale[:, :, first:last],
            self.v_zero[:, :, first:last],
            self.bits,
            self.group,
        )
        return k, v


# --- the choice of pairs ---------------------------------------------------------------------


def queries_disagree(q: Tensor, previous: Tensor, n_kv_heads: int, threshold: float) -> Tensor:
    """correct: (B, Hkv) bool, the KV heads whose real query rows q (B, H, D) and the queries
    that chose their prefetch (B, H, D) have a mean cosine (over the head's query heads) below
    `threshold`."""
    cosine = F.cosine_similarity(q.float(), previous.float(), dim=-1)  # (B, H)
    return cosine.unflatten(1, (n_kv_heads, -1)).mean(-1) < threshold


def greedy_guess(logits: Tensor, history: Tensor, lengths: Tensor) -> Tensor:
    """The paper's speculative token: the greedy choice of the speculative row's logits (B, V)."""
    return logits.argmax(-1, keepdim=True)


def prompt_lookup_guess(
    logits: Tensor, history: Tensor, lengths: Tensor, max_ngram: int = 3
) -> Tensor:
    """lookup (ours): the token that followed the latest earlier occurrence of the last n tokens of
    each sequence's history (B, L; its first lengths[b] real), for n = max_ngram down to 1; where
    none occurs, the greedy choice (transformers' prompt_lookup_num_tokens drafts the same way).

    An occurrence is found by where it ends: ends_n[j] says that history[j-n+1 .. j] are the last
    n tokens, and ends_n is ends_{n-1} and one more comparison, so each n costs one pass over the
    history (it runs every step, outside a compiled graph: 0.3 ms at 16k tokens on a CPU)."""
    b, length = history.shape
    position = torch.arange(length, device=history.device)
    followed = position + 1 < lengths[:, None]  # a token follows j, and j is not the last one
    ends = torch.ones(b, length, dtype=torch.bool, device=history.device)
    latest = []  # per n: the end of the latest occurrence (B,), -1 where none
    for n in range(1, max_ngram + 1):
        token = history.gather(1, (lengths[:, None] - n).clamp(min=0))  # the n-th last token
        ends = ends & F.pad(history[:, : length - n + 1] == token, (n - 1, 0))
        latest.append(torch.where(ends & followed, position, -1).amax(-1))
    guess = logits.argmax(-1)
    found = torch.zeros(b, dtype=torch.bool, device=logits.device)
    for n in range(max_ngram, 0, -1):
        hit = (latest[n - 1] >= 0) & ~found & (lengths > n)
        after = history.gather(1, (latest[n - 1] + 1).clamp(min=0)[:, None])[:, 0]
        guess = torch.where(hit, after, guess)
        found |= hit
    return guess[:, None]


GUESSES = {"greedy": greedy_guess, "lookup": prompt_lookup_guess}

# Bytes per exact slot beyond its pair: its position (int64) and flag, and the same for the
# prefetch's chosen position (kappa)
SLOT_BOOKKEEPING_BYTES = 2 * (8 + 1)


def fast_tier_plan(
    config: SpeCacheConfig,
    capacity: int,
    head_dim: int,
    pair_dtype: torch.dtype,
    query_heads_per_kv: int,
) -> tuple[int, int]:
    """(R, the most exact slots) such that a layer's fast tier never holds more than a cache of
    `capacity` pairs in `pair_dtype` (the 16-bit cache it replaces). Per KV head and sequence: the
    low-bit copy of the positions that can be quantized, the window, then per slot its pair and
    bookkeeping; a layer that corrects keeps its query heads' last queries too. When the copy and
    the window alone would exceed the cache (a capacity below about R + g + the copy's share),
    nothing is quantized: R becomes the capacity and every pair stays 16-bit in the window."""
    m = config.method
    pair = 2 * head_dim * pair_dtype.itemsize
    scale = sixteen_bit_dtype(pair_dtype).itemsize
    quantizable = max(0, capacity - m.residual) // m.group * m.group
    value_groups = head_dim // value_group(m.group, head_dim)
    per_position = 2 * head_dim * m.bits // 8 + 2 * value_groups * scale
    lowbit = quantizable * per_position + quantizable // m.group * 2 * head_dim * scale
    room = (capacity - min(m.residual + m.group, capacity)) * pair - lowbit
    if config.selection.correct_below is not None:
        room -= query_heads_per_kv * head_dim * 4
    if room < 0:
        return capacity, 0
    return m.residual, room // (pair + SLOT_BOOKKEEPING_BYTES)


# --- the ops a step runs ---------------------------------------------------------------------
# Each is defined here in plain PyTorch and registered as a torch.library op, which torch.compile
# keeps as one opaque call and which faster kernels can take over per device (this repository's
# kernels/ registers C kernels for CPUs and Triton kernels for GPUs; the results are the same to
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


class Merged(NamedTuple):
    """One softmax over the four segments (`merge_segments`)."""

    out: Tensor  # (B, Hkv, M, D) fp32: the attention output
    lowbit_scale: Tensor  # (B, Hkv, M, 1): turns the low-bit weights into probabilities
    p_fetched: Tensor  # (B, Hkv, M, K) probabilities of the exact pairs in slots
    p_window: Tensor  # (B, Hkv, M, R)
    p_new: Tensor  # (B, Hkv, M, S)


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
    return weights, row_max, weights.sum(-1), weights @ values


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


# The integer pass (ours). A CPU with integer dot products (x86's VPDPBUSD) multiplies 64 bytes
# in one instruction, four times the float lanes, and a 1-/2-bit code needs only widening to a
# byte. So both products of the low-bit pass can run on int8 operands: each float operand is
# rounded to integers in [-127, 127] against its largest magnitude, the products and their sums
# are exact integers, and one float step per slice scales them back. Only those two roundings
# differ from the float pass: about 0.4% of the largest element, far below what 1 or 2 bits lose.
ARITHMETICS = ("float", "int8")
INT8_BLOCK = 64  # positions whose weights round against one largest weight


def int8_round(x: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """x rounded to integers in [-127, 127] (as float32) against its largest magnitude along
    `dim`, and the step (kept as size 1): x ~ codes * step. An all-zero slice has step 0."""
    largest = x.abs().amax(dim, keepdim=True)
    # a true division (`127 / tensor` would multiply by a reciprocal), as the kernels divide
    inverse = largest.new_tensor(127.0) / largest
    return torch.where(largest > 0, x * inverse, 0.0).round(), largest / 127


def int8_scores(
    rows: Tensor, k_packed: Tensor, k_scale: Tensor, k_zero: Tensor, bits: int, group: int
) -> Tensor:
    """Scores (B, Hkv, M, T) of rows (B, Hkv, M, D) over the low-bit keys, in integers: per row
    and key group j, the rows times the group's channel scales round to int8, q * s_j ~ q8 *
    alpha, and

        score = alpha * (q8 . code) + q . z_j

    the integer dot product exact (in float32 too: |q8 . code| < 2**24)."""
    b, h, t, _ = k_packed.shape
    m, d = rows.shape[2:]
    n_groups = k_scale.shape[2]
    padded = F.pad(k_packed, (0, 0, 0, n_groups * group - t))
    codes = unpack_bits(padded, bits, d).float().view(b, h, n_groups, group, d)
    q8, alpha = int8_round(rows.unsqueeze(2) * k_scale.float().unsqueeze(3), -1)  # (B,H,J,M,D)
    bias = (rows @ k_zero.float().transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
    scores = alpha * (q8 @ codes.transpose(-1, -2)) + bias  # (B, Hkv, J, M, group)
    return scores.transpose(2, 3).reshape(b, h, m, n_groups * group)[..., :t]


def int8_value_mix(
    weights: Tensor, v_packed: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int
) -> Tensor:
    """weights (B, Hkv, M, T) times the low-bit values, in integers: per row, block of INT8_BLOCK
    positions (from 0) and value group g, the weights times the values' scales round to int8,
    w * s_g ~ w8 * beta, and

        out = sum over blocks of beta * (w8 . code) + w . z_g

    each block's integer dot product exact."""
    b, h, m, t = weights.shape
    d = v_packed.shape[-1] * 8 // bits
    n_value_groups = v_scale.shape[-1]
    pad = -t % INT8_BLOCK
    blocks = (t + pad) // INT8_BLOCK
    codes = unpack_bits(F.pad(v_packed, (0, 0, 0, pad)), bits, d).float()
    codes = codes.view(b, h, blocks, INT8_BLOCK, n_value_groups, d // n_value_groups)
    scaled = weights.unsqueeze(-1) * v_scale.float().unsqueeze(2)  # (B, Hkv, M, T, NV)
    scaled = F.pad(scaled, (0, 0, 0, pad)).view(b, h, m, blocks, INT8_BLOCK, n_value_groups)
    w8, beta = int8_round(scaled, -2)
    dots = torch.einsum("bhmntg,bhntgc->bhmngc", w8, codes)
    out = (beta.squeeze(-2).unsqueeze(-1) * dots).sum(3).flatten(-2)
    zero = (weights @ v_zero.float()).repeat_interleave(d // n_value_groups, -1)
    return out + zero


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`lowbit_partial_attention_reference` with both products in integers (`int8_scores`,
    `int8_value_mix`); the softmax between them is the same."""
    scores = int8_scores(rows, k_packed, k_scale, k_zero, bits, group)
    weights, row_max = lowbit_softmax(scores, visible_len, excluded_pos, excluded_valid)
    out = int8_value_mix(weights, v_packed, v_scale, v_zero, bits)
    return weights, row_max, weights.sum(-1), out


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
) -> tuple[Tensor, ...]:
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
    return lowbit_out * (lowbit_scale / total) + exact, lowbit_scale / total, *probs


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
) -> tuple[Tensor, Tensor]:
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
    return top.indices, top.values >= 0


_OPS = torch.library.Library("specache", "FRAGMENT")
for _name in ("lowbit_partial_attention", "lowbit_partial_attention_int8"):
    _OPS.define(
        f"{_name}(Tensor rows, Tensor k_packed, Tensor k_scale, "
        "Tensor k_zero, Tensor v_packed, Tensor v_scale, Tensor v_zero, int bits, int group, "
        "Tensor visible_len, Tensor excluded_pos, Tensor excluded_valid) "
        "-> (Tensor, Tensor, Tensor, Tensor)"
    )
_OPS.define(
    "merge_segments(Tensor rows, Tensor row_max, Tensor row_sum, Tensor lowbit_out, "
    "Tensor fetched_k, Tensor fetched_v, Tensor fetched_valid, Tensor window_k, "
    "Tensor window_v, Tensor window_len, Tensor new_k, Tensor new_v) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_OPS.define(
    "top_positions(Tensor weights, Tensor scale, Tensor p_fetched, Tensor fetched_pos, "
    "Tensor p_window, Tensor window_start, int s, int row, bool gqa_max, int lower, "
    "Tensor upper, Tensor excluded_pos, Tensor excluded_valid, int k) -> (Tensor, Tensor)"
)
for _name, _reference in (
    ("lowbit_partial_attention", lowbit_partial_attention_reference),
    ("lowbit_partial_attention_int8", lowbit_partial_attention_int8_reference),
    ("merge_segments", merge_segments_reference),
    ("top_positions", top_positions_reference),
):
    _OPS.impl(_name, _reference, "CompositeExplicitAutograd")


@torch.library.register_fake("specache::lowbit_partial_attention")
@torch.library.register_fake("specache::lowbit_partial_attention_int8")
def _(rows, k_packed, *args):
    b, h, m, d = rows.shape
    t = k_packed.shape[2]
    return (
        rows.new_empty(b, h, m, t),
        rows.new_empty(b, h, m),
        rows.new_empty(b, h, m),
        rows.new_empty(b, h, m, d),
    )


@torch.library.register_fake("specache::merge_segments")
def _(
    rows,
    row_max,
    row_sum,
    lowbit_out,
    fetched_k,
    fetched_v,
    fetched_valid,
    window_k,
    window_v,
    window_len,
    new_k,
    new_v,
):
    b, h, m, _ = rows.shape
    probs = (rows.new_empty(b, h, m, x.shape[2]) for x in (fetched_k, window_k, new_k))
    return torch.empty_like(rows), rows.new_empty(b, h, m, 1), *probs


@torch.library.register_fake("specache::top_positions")
def _(weights, *args):
    b, h, k = weights.shape[0], weights.shape[1], args[-1]
    return (
        weights.new_empty(b, h, k, dtype=torch.int64),
        weights.new_empty(b, h, k, dtype=torch.bool),
    )


def query_rows(q: Tensor, n_kv_heads: int) -> Tensor:
    """(B, H, S, D) -> (B, Hkv, G*S, D), fp32 and scaled by D**-0.5: the query rows that share
    each KV head; row = g*S + s."""
    b, h, s, d = q.shape
    return q.reshape(b, n_kv_heads, (h // n_kv_heads) * s, d).float() * d**-0.5


def lowbit_partial_attention(
    rows: Tensor, kv: LowBitKV, seg: Segments, arithmetic: str = "float"
) -> LowBitPart:
    """The low-bit segment of `seg`: positions [0, Lq) but the exact ones in valid slots
    (`specache::lowbit_partial_attention`, or its `_int8` twin). A copy of no positions (a
    capacity too short to quantize anything) contributes nothing."""
    if kv.k_packed.shape[2] == 0:
        b, h, m, d = rows.shape
        return LowBitPart(
            rows.new_zeros(b, h, m, 0),
            rows.new_full((b, h, m), float("-inf")),
            rows.new_zeros(b, h, m),
            rows.new_zeros(b, h, m, d),
        )
    op = (
        torch.ops.specache.lowbit_partial_attention_int8
        if arithmetic == "int8"
        else torch.ops.specache.lowbit_partial_attention
    )
    return LowBitPart(
        *op(rows, *kv[:6], kv.bits, kv.group, seg.quantized_len, seg.fetched_pos, seg.fetched_valid)
    )


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
) -> tuple[Tensor, Tensor]:
    """The k positions new row `row` weighs most, per KV head, among lower <= t < upper[b] but the
    valid excluded ones (`specache::top_positions`)."""
    return torch.ops.specache.top_positions(
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


def rank_shortlist(
    rows: Tensor,
    part: LowBitPart,
    merged: Merged,
    s: int,
    gqa: str,
    listed_k: Tensor,
    listed_valid: Tensor,
    k: int,
) -> tuple[Tensor, Tensor]:
    """shortlist (ours): of the positions the copy listed for the real row (row 0), whose 16-bit
    keys `listed_k` (B, Hkv, N, D) were read, the k its exact keys weigh most, per KV head: their
    indices into the list (B, Hkv, k), best first, and which are real. An exact key weighs
    exp(score - row_max) times the low-bit pass's scale, the probability the copy's own weights
    are ranked in, so that the max (or mean) over query heads compares like with like."""
    b, h, m, d = rows.shape
    real = rows.view(b, h, m // s, s, d)[:, :, :, 0]  # (B, Hkv, G, D)
    scores = real @ listed_k.to(real.dtype).transpose(-1, -2)  # (B, Hkv, G, N)
    row_max = part.row_max.view(b, h, m // s, s)[..., 0, None]
    scale = merged.lowbit_scale.view(b, h, m // s, s)[..., 0, None]
    # an exact score far above the copy's largest would overflow, and inf x a scale of 0 is NaN
    weight = torch.exp((scores - row_max).clamp(max=60.0)) * scale
    ranking = weight.amax(2) if gqa == "max" else weight.mean(2)
    top = ranking.masked_fill(~listed_valid, -1.0).topk(k, dim=-1)
    return top.indices, top.values >= 0


def shortlist_listed(valid: Tensor, shortlist: int, placed: Tensor) -> Tensor:
    """Which of the copy's ranked candidates (valid: B, Hkv, N) the shortlist lists and reads:
    `shortlist` per pick the KV head places (`placed`: B, Hkv, P)."""
    listed = torch.arange(valid.shape[-1], device=valid.device)
    return valid & (listed < shortlist * placed.sum(-1, keepdim=True))


def dequantize_values_at(kv: LowBitKV, positions: Tensor) -> Tensor:
    """The low-bit copy's values (B, Hkv, K, D), fp32, at positions (B, Hkv, K)."""

    def at(x: Tensor) -> Tensor:
        return x.gather(2, positions.unsqueeze(-1).expand(*positions.shape, x.shape[-1]))

    return dequantize_values(at(kv.v_packed), at(kv.v_scale), at(kv.v_zero), kv.bits, kv.group)


DROP_ROUNDING = 1e-5  # of a row's low-bit sum: what a subtraction from it can leave as noise


def drop_from_lowbit(
    part: LowBitPart, kv: LowBitKV, positions: Tensor, valid: Tensor
) -> LowBitPart:
    """`part` as if the valid `positions` (B, Hkv, K; the valid ones distinct per head, invalid
    ones anywhere) had been excluded from the low-bit pass: their weights and weighted values are
    subtracted. This is how positions chosen from the pass's own weights move to the 16-bit
    segment without a second pass; the error is that of the subtraction, a few ulps of the row's
    low-bit sum (a row left with less than DROP_ROUNDING of it is left with nothing). Positions
    already at weight 0 (excluded or invisible) change nothing."""
    m = part.weights.shape[2]
    index = positions.unsqueeze(2).expand(-1, -1, m, -1)  # (B, Hkv, M, K)
    dropped = part.weights.gather(-1, index) * valid.unsqueeze(2)
    out = part.out - dropped @ dequantize_values_at(kv, positions)
    row_sum = part.row_sum - dropped.sum(-1)
    # what is left below the subtraction's rounding is noise, and the merge would scale it up
    # where the picks held nearly all the low-bit weight: nothing is left
    left = row_sum > part.row_sum * DROP_ROUNDING
    row_sum, out = torch.where(left, row_sum, 0.0), torch.where(left.unsqueeze(-1), out, 0.0)
    # index_put, not scatter_add: torch.compile updates a buffer in place only for index_put (a
    # scatter copies the whole (B, Hkv, M, T) tensor first); invalid entries add 0, wherever they
    # point
    b, h, device = positions.shape[0], positions.shape[1], index.device
    at = (
        torch.arange(b, device=device)[:, None, None, None],
        torch.arange(h, device=device)[:, None, None],
        torch.arange(m, device=device)[:, None],
        index,
    )
    weights = part.weights.index_put(at, -dropped, accumulate=True)
    return LowBitPart(weights, part.row_max, row_sum, out)


# The exact pairs' slots (B, Hkv, K) of one layer: [sinks | the prefetch (k_spec) | the real row's
# picks (k_real)]. A step reads the sinks and the prefetch (unless a KV head discards it), and
# refills the real row's slots (or, where its KV head discards the prefetch, all k).


def exact_slots(
    fetched_valid: Tensor,
    fetched_pos: Tensor,
    quantized_len: Tensor,
    n_sinks: int,
    n_spec: int,
    discard: Optional[Tensor],
) -> Tensor:
    """Which slots count now (B, Hkv, K): sinks and the prefetch, at positions quantized already
    (a pair chosen while its position was in the window counts once it leaves it); not the real
    row's slots, which the step refills; not the prefetch of a KV head in `discard` (B, Hkv)."""
    exact = fetched_valid & (fetched_pos < quantized_len[:, None, None])
    exact[:, :, n_sinks + n_spec :] = False
    if discard is not None:
        exact[:, :, n_sinks : n_sinks + n_spec] &= ~discard.unsqueeze(-1)
    return exact


def first_pick_slot(
    fetched_pos: Tensor, n_sinks: int, n_spec: int, discard: Optional[Tensor]
) -> Tensor:
    """(B, Hkv, 1): the slot of the real row's first pick; the prefetch's first slot for a KV head
    in `discard`."""
    first = torch.full(fetched_pos.shape[:2] + (1,), n_sinks + n_spec, device=fetched_pos.device)
    return first if discard is None else torch.where(discard.unsqueeze(-1), n_sinks, first)


def picks_placed(n_picks: int, n_slots: int, first: Tensor) -> Tensor:
    """(B, Hkv, n_picks): which picks find a slot from `first` on."""
    return torch.arange(n_picks, device=first.device) < n_slots - first


def place_picks(picks: Tensor, slots: Tensor, first: Tensor) -> Tensor:
    """`slots` (B, Hkv, K, ...) with slot j >= first[b, h] holding pick j - first of `picks` (B,
    Hkv, P, ...), in order."""
    extra = [1] * (picks.dim() - 3)
    slot = torch.arange(slots.shape[2], device=slots.device)
    rank = (slot - first).clamp(0, picks.shape[2] - 1).view(*first.shape[:2], -1, *extra)
    index = rank.expand(*rank.shape[:3], *picks.shape[3:])
    taken = (slot >= first).view(*rank.shape)
    return torch.where(taken, picks.gather(2, index), slots)


def take_picks(
    part: LowBitPart,
    kv: LowBitKV,
    seg: Segments,
    picks: Tensor,
    placed: Tensor,
    pair_k: Tensor,
    pair_v: Tensor,
    first: Tensor,
) -> tuple[LowBitPart, Segments]:
    """The real row's picks (B, Hkv, P) in the slots from `first` on (`place_picks`), with their
    pairs pair_k, pair_v (B, Hkv, P, D) and as valid as `placed` says; the placed ones leave the
    low-bit segment (`drop_from_lowbit`)."""
    seg = seg._replace(
        fetched_k=place_picks(pair_k.to(seg.fetched_k.dtype), seg.fetched_k, first),
        fetched_v=place_picks(pair_v.to(seg.fetched_v.dtype), seg.fetched_v, first),
        fetched_pos=place_picks(picks, seg.fetched_pos, first),
        fetched_valid=place_picks(placed, seg.fetched_valid, first),
    )
    return drop_from_lowbit(part, kv, picks, placed), seg


def prefetch_positions(
    part: LowBitPart,
    merged: Merged,
    seg: Segments,
    gqa: str,
    lower: int,
    upper: Tensor,
    k: int,
) -> tuple[Tensor, Tensor]:
    """kappa_{t+1}: the k positions the last new row (the speculative one, or T1) weighs most, per
    KV head, among lower <= t < upper[b] (`top_positions`, nothing excluded)."""
    s = seg.new_k.shape[2]
    nothing = seg.fetched_pos.new_empty(seg.fetched_pos.shape[:2] + (0,))
    return top_positions(part, merged, seg, s, s - 1, gqa, lower, upper, nothing, nothing.bool(), k)


# --- prefill over a history ------------------------------------------------------------------
# A prompt's chunk, or a conversation's next turn, attends over what the cache holds already:
# exactly, from the slow tier, in blocks (prefill is bound by compute, and one block at a time is
# in memory), merged by each block's log-sum-exp as flash attention merges its tiles.


def history_block(
    batch: int, n_heads: int, rows: int, head_dim: int, multiple: int, budget: int = 1 << 24
) -> int:
    """How many history positions to take at a time for `rows` query rows per head: about
    `budget` float32 elements (64 MB) of scores or of K and V widened to every query head,
    whichever is larger; a multiple of `multiple`."""
    per_position = batch * n_heads * max(rows, 2 * head_dim)
    return max(multiple, budget // per_position // multiple * multiple)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """Softmax attention of q (B, H, S, D) over k, v (B, Hkv, N, D) in float32 (causal: N = S),
    and each row's log-sum-exp of scores (B, H, S). On a CPU, ATen's flash-attention kernel
    (several times faster than `attention_with_lse_reference`, which serves elsewhere)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if q.device.type == "cpu" and flash is not None:
        group = q.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        out, lse = flash(q.float(), k, v, 0.0, causal)
        return out, lse
    return attention_with_lse_reference(q, k, v, causal)


def attention_with_lse_reference(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, budget: int = 1 << 24
) -> tuple[Tensor, Tensor]:
    """The same in plain PyTorch, the rows in tiles of about `budget` scores."""
    b, n_heads, s, d = q.shape
    n_kv, n = k.shape[1], k.shape[2]
    rows = (q.float() * d**-0.5).view(b, n_kv, n_heads // n_kv, s, d)
    keys, values = k.float().unsqueeze(2), v.float().unsqueeze(2)
    tile = max(1, budget // (b * n_heads * n))
    outs, lses = [], []
    for first in range(0, s, tile):
        # (B, Hkv, G, tile, N)
        scores = rows[:, :, :, first : first + tile] @ keys.transpose(-1, -2)
        if causal:
            own = torch.arange(first, first + scores.shape[3], device=q.device)
            future = torch.arange(n, device=q.device) > own[:, None]
            scores = scores.masked_fill(future, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.exp(scores - lse.unsqueeze(-1)) @ values)
        lses.append(lse)
    return torch.cat(outs, 3).reshape(b, n_heads, s, d), torch.cat(lses, 3).reshape(b, n_heads, s)


def attention_after_history(q: Tensor, k: Tensor, v: Tensor, history) -> Tensor:
    """Attention of rows q (B, H, S, D) over the positions before them, given as `history`: (K, V)
    blocks (B, Hkv, n, D) in order, and causally over their own k, v (B, Hkv, S, D). One softmax,
    in float32, one block of the history in memory at a time."""
    out, lse = attention_with_lse(q, k, v, causal=True)
    for block_k, block_v in history:
        block_out, block_lse = attention_with_lse(q, block_k, block_v, causal=False)
        merged = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out * torch.exp(
            block_lse - merged
        ).unsqueeze(-1)
        lse = merged
    return out.to(q.dtype)


# --- the slow tier ---------------------------------------------------------------------------
# The complete 16-bit cache, and how pairs move from it into the fast tier's slots. In a CPU's RAM
# both tiers are the same memory and every move is a gather inside the layer's step (compiled with
# it). Beside a GPU the slow tier is pinned host memory: pairs go out on a side stream, and the
# speculative prefetch moves in the background, started after the layer at step t and landed just
# before the same layer at step t + 1; pairs chosen within a step are read and waited for at once.


def gather_pairs(store: Tensor, positions: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """out[b, h, i] = store[b, h, positions[b, h, i]]: the pairs at `positions` (B, Hkv, K)."""
    index = positions.unsqueeze(-1).expand(*positions.shape, store.shape[-1])
    return torch.gather(store, 2, index) if out is None else torch.gather(store, 2, index, out=out)


def held_match(
    positions: Tensor, valid: Tensor, held_pos: Tensor, held_valid: Tensor
) -> tuple[Tensor, Tensor]:
    """reuse: which valid positions (B, Hkv, K) a previous read (B, Hkv, K') holds already, and in
    which of its slots (B, Hkv, K; meaningful where held)."""
    match = (positions.unsqueeze(-1) == held_pos.unsqueeze(-2)) & held_valid.unsqueeze(-2)
    return valid & match.any(-1), match.to(torch.uint8).argmax(-1)


class RamTier:
    """The slow tier in the same RAM as the fast one (a CPU): every move happens inside the
    layer's step. A prefetch gathers all its pairs, so reuse changes only the count of pairs a
    separate slow tier would send. (A worker thread that gathered in the background made a SmolLM2
    step at 1k slower, 50 vs 39 ms: the hand-off cost more than the 50 KB gather it hid.)"""

    def __init__(self, spec: TierSpec):
        self.spec = spec
        self.k = torch.zeros(spec.shape, dtype=spec.dtype)
        self.v = torch.zeros(spec.shape, dtype=spec.dtype)

    def reset(self, rows: Optional[list[int]] = None) -> None:
        pass

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        self.k[b, :, start : start + k.shape[1]] = k
        self.v[b, :, start : start + v.shape[1]] = v

    def read_range(
        self, first: int, last: int, rows: Optional[list[int]] = None
    ) -> tuple[Tensor, Tensor]:
        at = slice(None) if rows is None else rows
        return self.k[at, :, first:last], self.v[at, :, first:last]

    def read(self, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        return gather_pairs(self.k, positions), gather_pairs(self.v, positions)

    def before_step(self) -> None:
        pass  # a prefetch landed within the previous step

    def after_step(
        self, new_k: Optional[Tensor], new_v: Optional[Tensor], kappa: Optional[Kappa]
    ) -> None:
        # the prefetch first: kappa never holds the new rows' positions, and reading the store
        # before writing it lets torch.compile write it in place
        if kappa is not None:
            slots = self.spec.slots
            slots.k[:, :, slots.where] = gather_pairs(self.k, kappa.pos)
            slots.v[:, :, slots.where] = gather_pairs(self.v, kappa.pos)
            slots.pos[:, :, slots.where] = kappa.pos
            slots.valid[:, :, slots.where] = kappa.valid
        if new_k is not None:
            rows = self.spec.state.moved()
            positions = self.spec.state.next_position()[rows]
            self.k[rows, :, positions] = new_k[rows]
            self.v[rows, :, positions] = new_v[rows]

    def keys(self) -> Tensor:
        return self.k

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


# --- one op per layer: a step with the slow tier in the same RAM -----------------------------
# On a CPU both tiers are in RAM, and what a step does between its kernels (the low-bit pass, two
# merges, two rankings, the picks' gather and drop, the prefetch's gather) is small: dispatching
# it op by op cost more than computing it (a SmolLM2 step at 1k made about 300 calls). So the
# whole of a layer's attention in a step is one op, which a CPU kernel computes KV head by KV head
# (kernels/step_cpu.cpp). Its definition is the composition the layer runs op by op elsewhere.


def step_attention_reference(
    rows: Tensor,
    k_packed: Tensor,
    k_scale: Tensor,
    k_zero: Tensor,
    v_packed: Tensor,
    v_scale: Tensor,
    v_zero: Tensor,
    bits: int,
    group: int,
    integer: bool,
    quantized_len: Tensor,
    fetched_k: Tensor,
    fetched_v: Tensor,
    fetched_pos: Tensor,
    fetched_valid: Tensor,
    window_k: Tensor,
    window_v: Tensor,
    window_len: Tensor,
    new_k: Tensor,
    new_v: Tensor,
    store_k: Tensor,
    store_v: Tensor,
    n_picks: int,
    shortlist: int,
    discard: Optional[Tensor],
    gqa_max: bool,
    n_sinks: int,
    n_spec: int,
    selectable_len: Tensor,
) -> tuple[Tensor, ...]:
    """A layer's attention in one step, over a slow tier `store_k`, `store_v` (B, Hkv, T, D) in
    the same memory. The rows attend over the four segments (`Segments`: the slots as
    `fetched_valid` and `exact_slots` say).
    - With n_picks, the real row (row 0) first picks that many positions by its low-bit weights
      (with a shortlist, by the exact weights of the `shortlist` x n_picks it lists:
      `rank_shortlist`). Their pairs fill its slots (`first_pick_slot`) and leave the low-bit
      segment.
    - With n_spec, the last row then chooses the prefetch, among [n_sinks, selectable_len[b]),
      and its pairs fill the prefetch's slots.
    Returns the output (B, Hkv, M, D); the slots' new k, v, pos and valid; which picks were placed
    (B, Hkv, n_picks); the prefetch (B, Hkv, n_spec), positions and which are real; and the pairs
    each KV head read from the tier for its picks (B, Hkv). Every slot from the first pick's on
    takes a pick: n_picks is 0, or at least the real row's slots (plus the prefetch's where a
    `discard` is given)."""
    real_slots = fetched_pos.shape[-1] - n_sinks - n_spec
    if n_picks and n_picks < real_slots + (n_spec if discard is not None else 0):
        raise ValueError(
            f"step_attention: {n_picks} picks cannot fill the {real_slots} real-row slots"
            + (f" and the {n_spec} of the prefetch" if discard is not None else "")
        )
    kv = LowBitKV(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, bits, group)
    exact = exact_slots(fetched_valid, fetched_pos, quantized_len, n_sinks, n_spec, discard)
    window = (window_k, window_v, window_len, new_k, new_v)
    seg = Segments(quantized_len, fetched_k, fetched_v, fetched_pos, exact, *window)
    s, gqa = new_k.shape[2], "max" if gqa_max else "mean"
    part = lowbit_partial_attention(rows, kv, seg, "int8" if integer else "float")
    # fresh, not views: an op's outputs never alias its inputs
    nothing = fetched_pos.new_empty(fetched_pos.shape[:2] + (0,))
    placed, read = nothing.bool(), quantized_len.new_zeros(fetched_pos.shape[:2])
    if n_picks:
        merged = merge_segments(rows, part, seg)
        n_listed = min(n_picks * shortlist, k_packed.shape[2]) if shortlist else n_picks
        picks, valid = top_positions(
            part, merged, seg, s, 0, gqa, 0, quantized_len, fetched_pos, exact, n_listed
        )
        first = first_pick_slot(fetched_pos, n_sinks, n_spec, discard)
        placed = picks_placed(n_picks, fetched_pos.shape[-1], first)
        if shortlist:
            listed = shortlist_listed(valid, shortlist, placed)
            listed_k = gather_pairs(store_k, picks)
            chosen, valid = rank_shortlist(rows, part, merged, s, gqa, listed_k, listed, n_picks)
            picks = picks.gather(-1, chosen)
        placed = valid & placed
        read = (listed if shortlist else placed).sum(-1)  # the pairs read from the tier
        pairs = gather_pairs(store_k, picks), gather_pairs(store_v, picks)
        part, seg = take_picks(part, kv, seg, picks, placed, *pairs, first)
    merged = merge_segments(rows, part, seg)
    kappa_pos, kappa_valid = nothing, nothing.bool()
    if n_spec:
        kappa_pos, kappa_valid = prefetch_positions(
            part, merged, seg, gqa, n_sinks, selectable_len, n_spec
        )
    prefetch = slice(n_sinks, n_sinks + n_spec)
    out_k, out_v, out_pos, out_valid = (
        x.clone(memory_format=torch.contiguous_format)
        # the other slots' validity stays as it was (exact_slots reads it)
        for x in (seg.fetched_k, seg.fetched_v, seg.fetched_pos, fetched_valid)
    )
    out_k[:, :, prefetch] = gather_pairs(store_k, kappa_pos).to(out_k.dtype)
    out_v[:, :, prefetch] = gather_pairs(store_v, kappa_pos).to(out_v.dtype)
    out_pos[:, :, prefetch] = kappa_pos
    out_valid[:, :, prefetch] = kappa_valid
    return merged.out, out_k, out_v, out_pos, out_valid, placed, kappa_pos, kappa_valid, read


_OPS.define(
    "step_attention(Tensor rows, Tensor k_packed, Tensor k_scale, Tensor k_zero, "
    "Tensor v_packed, Tensor v_scale, Tensor v_zero, int bits, int group, bool integer, "
    "Tensor quantized_len, Tensor fetched_k, Tensor fetched_v, Tensor fetched_pos, "
    "Tensor fetched_valid, Tensor window_k, Tensor window_v, Tensor window_len, Tensor new_k, "
    "Tensor new_v, Tensor store_k, Tensor store_v, int n_picks, int shortlist, Tensor? discard, "
    "bool gqa_max, int n_sinks, int n_spec, Tensor selectable_len) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_OPS.impl("step_attention", step_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("specache::step_attention")
def _(rows, *args):
    fetched_k, fetched_v, fetched_pos, fetched_valid = args[10:14]
    n_picks, n_spec = args[21], args[26]
    b, h = fetched_pos.shape[:2]
    return (  # contiguous, as the kernel's outputs are, whatever the inputs' strides
        rows.new_empty(rows.shape),
        fetched_k.new_empty(fetched_k.shape),
        fetched_v.new_empty(fetched_v.shape),
        fetched_pos.new_empty(fetched_pos.shape),
        fetched_valid.new_empty(fetched_valid.shape),
        fetched_valid.new_empty(b, h, n_picks),
        fetched_pos.new_empty(b, h, n_spec),
        fetched_valid.new_empty(b, h, n_spec),
        fetched_pos.new_empty(b, h),
    )


class PinnedTier:
    """The slow tier in pinned host memory beside a GPU. Writes go out on a side stream; the
    prefetch is copied down, gathered and copied up by a worker thread (`_fetch`) on another side
    stream, waited for by the compute stream only (the host never blocks on the GPU); pairs chosen
    within a step are fetched at once (`_read_now`, a graph break under torch.compile). With
    reuse, the staging buffer still holds the previous prefetch, and only positions it lacks are
    read."""

    def __init__(self, spec: TierSpec, executor: ThreadPoolExecutor):
        self.spec, self.executor = spec, executor
        self.k = torch.zeros(spec.shape, dtype=spec.dtype, pin_memory=True)
        self.v = torch.zeros(spec.shape, dtype=spec.dtype, pin_memory=True)
        self.copy_stream = torch.cuda.Stream(spec.device)
        self.staging: dict[tuple, tuple[Tensor, Tensor]] = {}  # _read_now's, one per shape
        self.pending: Optional[Future] = None
        if spec.slots is not None:
            shape = spec.slots.pos[:, :, spec.slots.where].shape
            self.fetch_stream = torch.cuda.Stream(spec.device)
            self.landed = torch.cuda.Event()
            self.host_pos = torch.zeros(shape, dtype=torch.long, pin_memory=True)
            self.host_valid = torch.zeros(shape, dtype=torch.bool, pin_memory=True)
            self.held_pos = torch.zeros(shape, dtype=torch.long)
            self.held_valid = torch.zeros(shape, dtype=torch.bool)
            pair_shape = (*shape, spec.shape[-1])
            self.prefetch_k = torch.zeros(pair_shape, dtype=spec.dtype, pin_memory=True)
            self.prefetch_v = torch.zeros(pair_shape, dtype=spec.dtype, pin_memory=True)

    def reset(self, rows: Optional[list[int]] = None) -> None:
        self.before_step()
        if self.spec.slots is not None:  # the other rows' staged pairs are still theirs
            self.held_valid[slice(None) if rows is None else rows] = False

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Copy out on the side stream, keeping the source alive until the copy is done."""
        self.copy_stream.wait_stream(torch.cuda.current_stream(k.device))
        with torch.cuda.stream(self.copy_stream):
            self.k[b, :, start : start + k.shape[1]].copy_(k, non_blocking=True)
            self.v[b, :, start : start + v.shape[1]].copy_(v, non_blocking=True)
        k.record_stream(self.copy_stream)
        v.record_stream(self.copy_stream)

    def read_range(
        self, first: int, last: int, rows: Optional[list[int]] = None
    ) -> tuple[Tensor, Tensor]:
        """Up on the compute stream, once the writes so far have landed (prefill, outside any
        graph). A slice of several sequences or heads is not contiguous: it is gathered into
        pinned memory first, so that the upload is asynchronous."""
        self.copy_stream.synchronize()
        at = slice(None) if rows is None else rows
        parts = [x[at, :, first:last] for x in (self.k, self.v)]
        return tuple(
            torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            .copy_(x)
            .to(self.spec.device, non_blocking=True)
            for x in parts
        )

    def read(self, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        return _read_now(self, positions)

    def before_step(self) -> None:
        _land(self)

    def after_step(
        self, new_k: Optional[Tensor], new_v: Optional[Tensor], kappa: Optional[Kappa]
    ) -> None:
        _leave_layer(self, new_k, new_v, kappa)

    def keys(self) -> Tensor:
        return _keys_up(self)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def _fetch(self, ready: "torch.cuda.Event", kappa: Kappa) -> None:
        """In the worker thread: kappa down, its pairs gathered into pinned staging, then up."""
        slots = self.spec.slots
        with torch.cuda.device(self.spec.device), torch.cuda.stream(self.fetch_stream):
            self.fetch_stream.wait_event(ready)
            self.host_pos.copy_(kappa.pos, non_blocking=True)
            self.host_valid.copy_(kappa.valid, non_blocking=True)
            slots.pos[:, :, slots.where].copy_(kappa.pos, non_blocking=True)
            slots.valid[:, :, slots.where].copy_(kappa.valid, non_blocking=True)
            positions_copied = torch.cuda.Event()
            positions_copied.record(self.fetch_stream)
        # Waiting here blocks this worker only. The stream is in order, so the previous step's
        # upload from the staging buffers is also done once the positions have arrived.
        positions_copied.synchronize()
        self.copy_stream.synchronize()  # the real rows written so far have landed
        if self.spec.reuse:
            read_with_reuse(
                self.k,
                self.v,
                self.host_pos,
                self.host_valid,
                self.held_pos,
                self.held_valid,
                self.prefetch_k,
                self.prefetch_v,
            )
            self.held_pos.copy_(self.host_pos)
            self.held_valid.copy_(self.host_valid)
        else:
            gather_pairs(self.k, self.host_pos, self.prefetch_k)
            gather_pairs(self.v, self.host_pos, self.prefetch_v)
        with torch.cuda.device(self.spec.device), torch.cuda.stream(self.fetch_stream):
            slots.k[:, :, slots.where].copy_(self.prefetch_k, non_blocking=True)
            slots.v[:, :, slots.where].copy_(self.prefetch_v, non_blocking=True)
            self.landed.record(self.fetch_stream)


def read_with_reuse(
    store_k: Tensor,
    store_v: Tensor,
    positions: Tensor,
    valid: Tensor,
    held_pos: Tensor,
    held_valid: Tensor,
    held_k: Tensor,
    held_v: Tensor,
) -> int:
    """Host tensors: turn held_k, held_v (B, Hkv, K, D), the pairs of held_pos, into the pairs of
    `positions` (B, Hkv, K), in place, reading from store_k, store_v (B, Hkv, T, D) only the valid
    positions not held already. Returns how many pairs it read."""
    held, source = held_match(positions, valid, held_pos, held_valid)
    index = source.unsqueeze(-1).expand(*source.shape, held_k.shape[-1])
    reused_k, reused_v = held_k.gather(2, index), held_v.gather(2, index)
    b, h, slot = (valid & ~held).nonzero(as_tuple=True)
    reused_k[b, h, slot] = store_k[b, h, positions[b, h, slot]]
    reused_v[b, h, slot] = store_v[b, h, positions[b, h, slot]]
    held_k.copy_(reused_k)
    held_v.copy_(reused_v)
    return len(slot)


@torch.compiler.disable
def _land(tier: PinnedTier) -> None:
    """The compute stream waits for the prefetch in flight (re-raising what went wrong in it)."""
    if tier.pending is None:
        return
    pending, tier.pending = tier.pending, None
    pending.result()
    torch.cuda.current_stream(tier.spec.device).wait_event(tier.landed)


@torch.compiler.disable
def _leave_layer(
    tier: PinnedTier, new_k: Optional[Tensor], new_v: Optional[Tensor], kappa: Optional[Kappa]
) -> None:
    """After the layer's pass: the real rows go to host memory; the prefetch of kappa starts
    (and, without overlap, is waited for)."""
    if new_k is not None:
        state = tier.spec.state
        held = state.held()  # next_position, on the host
        for b in range(len(held)) if state.rows is None else state.rows:
            tier.write(b, held[b], new_k[b, :, None].clone(), new_v[b, :, None].clone())
    if kappa is not None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tier.spec.device))
        tier.pending = tier.executor.submit(tier._fetch, ready, kappa)
        if not tier.spec.overlap:
            _land(tier)


@torch.compiler.disable
def _read_now(tier: PinnedTier, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The pairs at `positions` (on the GPU), now: the positions come down (which waits for the
    compute stream), the host gathers into pinned staging, and the pairs go up."""
    host = positions.cpu()
    tier.copy_stream.synchronize()
    if positions.shape not in tier.staging:
        tier.staging[positions.shape] = tuple(
            torch.zeros(*positions.shape, tier.k.shape[-1], dtype=tier.k.dtype, pin_memory=True)
            for _ in range(2)
        )
    staging_k, staging_v = tier.staging[positions.shape]
    gather_pairs(tier.k, host, staging_k)
    gather_pairs(tier.v, host, staging_v)
    device = positions.device
    return staging_k.to(device, non_blocking=True), staging_v.to(device, non_blocking=True)


@torch.compiler.disable
def _keys_up(tier: PinnedTier) -> Tensor:
    tier.copy_stream.synchronize()
    return tier.k.to(tier.spec.device)


# --- one layer -------------------------------------------------------------------------------


class SpeCacheState:
    """What all layers share: per-sequence lengths, on the device (for the kernels) and on the
    host (for the decisions the Python loop makes, so it never waits on the device), and what the
    next pass is."""

    def __init__(
        self,
        config: SpeCacheConfig,
        batch_size: int,
        capacity: int,
        device: torch.device,
        head_dim: int,
        pair_dtype: torch.dtype,
        query_heads_per_kv: int,
    ):
        self.config, self.capacity = config, capacity
        self.group = config.method.group
        # R, and the most exact slots, such that the fast tier stays within a 16-bit cache
        self.residual, self.max_slots = fast_tier_plan(
            config, capacity, head_dim, pair_dtype, query_heads_per_kv
        )
        self.quantized_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # Lq
        self.window_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # r
        # kappa is drawn from [0, selectable_len)
        self.selectable_len = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.host_quantized_len = [0] * batch_size
        self.host_window_len = [0] * batch_size
        self.phase = PREFILL
        # Rows of one cache for sequences that come and go (a server's continuous batching, "rows"
        # below): each row's own phase, and the rows the next step moves (None: all). The others
        # hold nothing as the step sees them (lengths 0 on the device), and it writes nothing there.
        self.row_phase = [PREFILL] * batch_size
        self.rows: Optional[list[int]] = None
        self.rows_index: Optional[Tensor] = None  # the same, on the device
        self.stepping = torch.ones(batch_size, dtype=torch.long, device=device)  # 1 at those rows

    def split(self, n: int) -> tuple[int, int]:
        """(Lq, r) of a sequence that holds n tokens: whole groups of all but the newest R are
        quantized, the rest (R to R + g - 1 tokens, or all n < R + g) stay in the window."""
        lq = max(0, n - self.residual) // self.group * self.group
        return lq, n - lq

    def begin(self, lengths: list[int]) -> None:
        """Sequence b will hold lengths[b] tokens once its prompt is in."""
        self.host_quantized_len, self.host_window_len = map(list, zip(*map(self.split, lengths)))
        self.phase = PREFILL
        self.rows = self.rows_index = None
        self.sync()

    def held(self) -> list[int]:
        """The tokens each sequence holds."""
        return [lq + r for lq, r in zip(self.host_quantized_len, self.host_window_len)]

    def next_position(self) -> Tensor:
        """(B,) where each sequence's next real row goes."""
        return self.quantized_len + self.window_len

    def sync(self) -> None:
        """The device copies of the host's lengths (pinned and asynchronous on a GPU); a row the
        next step does not move holds nothing there."""
        moved = [self.rows is None or b in self.rows for b in range(len(self.host_window_len))]
        for device_copy, values in (
            (self.quantized_len, self.host_quantized_len),
            (self.window_len, self.host_window_len),
            (self.selectable_len, self.host_selectable_len()),
            (self.stepping, [1] * len(moved)),
        ):
            values = [x if row_moves else 0 for x, row_moves in zip(values, moved)]
            host = torch.tensor(values, pin_memory=device_copy.is_cuda)
            device_copy.copy_(host, non_blocking=device_copy.is_cuda)

    def moved(self) -> Tensor:
        """The rows a step moves: all, or those of a pass of some rows."""
        if self.rows_index is None:
            return torch.arange(len(self.host_window_len), device=self.window_len.device)
        return self.rows_index

    def write_moved(self, buffer: Tensor, new: Tensor) -> None:
        """A step's new value of a per-row buffer, kept at the rows it moved."""
        if self.rows_index is None:
            buffer.copy_(new)
        else:
            buffer[self.rows_index] = new[self.rows_index].to(buffer.dtype)

    def host_selectable_len(self) -> list[int]:
        """Lq, or Lq + g when the next kept row fills the window and its oldest group gets
        quantized."""
        full = self.residual + self.group
        return [
            lq + (self.group if r + 1 == full else 0)
            for lq, r in zip(self.host_quantized_len, self.host_window_len)
        ]


# What the layers' next pass is: the prompt (or a chunk of it), the bootstrap (T1 alone, nothing
# kept), or a decode step (the real row kept)
PREFILL, BOOTSTRAP, DECODE = "prefill", "bootstrap", "decode"


class SpeCacheLayer(nn.Module):
    """One layer's SpeCache: the host's attention hands it the new rows' q, k, v and takes the
    attention output (`forward`).

    The exact pairs a step reads besides the window sit in one buffer of slots per KV head:
    [sinks | the speculative prefetch (k_spec) | the real row's picks (k_real)], k_spec + k_real =
    k. Buffers hold what the capacity can need: the low-bit copy the positions that can ever be
    quantized (all but the newest R), the window at most the capacity, the slots at most the
    positions the copy can hold.
    """

    def __init__(
        self,
        state: SpeCacheState,
        index: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        make_tier: Callable[[TierSpec], SlowTier],
        probe: Optional[Probe] = None,
    ):
        """`dtype`: the exact pairs' (window, slots, slow tier)."""
        super().__init__()
        c, b, t = state.config, state.quantized_len.shape[0], state.capacity
        m, sel = c.method, c.selection
        self.state, self.config, self.index, self.probe = state, c, index, probe
        scale_dtype = sixteen_bit_dtype(dtype)
        code_bytes = head_dim * m.bits // 8
        n_value_groups = head_dim // value_group(m.group, head_dim)
        quantizable = max(0, t - state.residual) // m.group * m.group
        self.n_sinks = min(sel.sinks, quantizable, state.max_slots)
        k = min(m.topk, quantizable, state.max_slots - self.n_sinks)
        self.k_real = k if not m.speculative else int(k * sel.real_share + 0.5)
        self.k_spec = k - self.k_real
        self.correcting = sel.correct_below is not None and self.k_spec > 0
        self.picks = k if self.correcting else self.k_real  # a head that discards its prefetch
        slots = self.n_sinks + k
        self.spec_slots = slice(self.n_sinks, self.n_sinks + self.k_spec)

        def fast(name, *shape, dtype=dtype):
            buffer = torch.zeros(shape, dtype=dtype, device=device)
            self.register_buffer(name, buffer, persistent=False)

        # Fast tier: the low-bit copy...
        fast("k_packed", b, n_kv_heads, quantizable, code_bytes, dtype=torch.uint8)
        fast("k_scale", b, n_kv_heads, quantizable // m.group, head_dim, dtype=scale_dtype)
        fast("k_zero", b, n_kv_heads, quantizable // m.group, head_dim, dtype=scale_dtype)
        fast("v_packed", b, n_kv_heads, quantizable, code_bytes, dtype=torch.uint8)
        fast("v_scale", b, n_kv_heads, quantizable, n_value_groups, dtype=scale_dtype)
        fast("v_zero", b, n_kv_heads, quantizable, n_value_groups, dtype=scale_dtype)
        # ... the 16-bit window: the newest R tokens and up to g more waiting for a group ...
        fast("window_k", b, n_kv_heads, min(state.residual + m.group, t), head_dim)
        fast("window_v", b, n_kv_heads, min(state.residual + m.group, t), head_dim)
        # ... and the exact pairs in slots: sinks, kappa_t's prefetch, the real row's picks.
        fast("fetched_k", b, n_kv_heads, slots, head_dim)
        fast("fetched_v", b, n_kv_heads, slots, head_dim)
        fast("fetched_pos", b, n_kv_heads, slots, dtype=torch.long)
        fast("fetched_valid", b, n_kv_heads, slots, dtype=torch.bool)
        fast("kappa_pos", b, n_kv_heads, self.k_spec, dtype=torch.long)  # kappa_{t+1}
        fast("kappa_valid", b, n_kv_heads, self.k_spec, dtype=torch.bool)
        if self.correcting:  # the last row's queries, which chose the prefetch the next step reads
            fast("last_query", b, n_heads, head_dim, dtype=torch.float32)
        # per sequence, this generation: pairs read from the slow tier; correct: the KV heads whose
        # prefetch was discarded, of those checked
        fast("pairs_read", b, dtype=torch.long)
        fast("heads_discarded", b, dtype=torch.long)
        fast("heads_checked", b, dtype=torch.long)
        self.fetched_pos[:, :, : self.n_sinks] = torch.arange(self.n_sinks, device=device)
        self.fetched_valid[:, :, : self.n_sinks] = True  # counted while quantized (below Lq)
        prefetch = None
        if self.k_spec:
            buffers = (self.fetched_k, self.fetched_v, self.fetched_pos, self.fetched_valid)
            prefetch = PrefetchSlots(*buffers, where=self.spec_slots)
        spec = TierSpec(
            shape=(b, n_kv_heads, t, head_dim),
            dtype=dtype,
            device=torch.device(device),
            slots=prefetch,
            reuse=sel.reuse,
            overlap=c.placement.overlap_fetch,
            state=state,
        )
        self.tier = make_tier(spec)

    def reset(self, rows: Optional[list[int]] = None) -> None:
        """A generation starts (in `rows` only: see "rows"): nothing fetched, chosen or counted
        yet."""
        self.tier.reset(rows)  # first: a prefetch in flight lands before the slots are cleared
        rows = slice(None) if rows is None else rows
        self.fetched_valid[rows, :, self.n_sinks :] = False
        self.kappa_valid[rows] = False
        for count in (self.pairs_read, self.heads_discarded, self.heads_checked):
            count[rows] = 0
        if self.correcting:
            self.last_query[rows] = 0

    # --- the low-bit copy and the window -------------------------------------------------------

    def lowbit(self) -> LowBitKV:
        m = self.config.method
        keys = (self.k_packed, self.k_scale, self.k_zero)
        return LowBitKV(*keys, self.v_packed, self.v_scale, self.v_zero, m.bits, m.group)

    def _quantize_into(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Quantize k, v (Hkv, N, D) of sequence b (N a multiple of g) into positions [start,
        start + N); the sinks among them keep their 16-bit pairs."""
        m, levels, n = self.config.method, self.config.selection.levels, k.shape[1]
        g, keys = m.group, slice(start // m.group, (start + n) // m.group)
        packed, scale, zero = quantize_keys(k, m.bits, g, self.k_scale.dtype, levels)
        self.k_packed[b, :, start : start + n] = packed
        self.k_scale[b, :, keys] = scale
        self.k_zero[b, :, keys] = zero
        packed, scale, zero = quantize_values(v, m.bits, g, self.v_scale.dtype, levels)
        self.v_packed[b, :, start : start + n] = packed
        self.v_scale[b, :, start : start + n] = scale
        self.v_zero[b, :, start : start + n] = zero
        sinks = max(0, min(self.n_sinks, start + n) - start)
        self.fetched_k[b, :, start : start + sinks] = k[:, :sinks].to(self.fetched_k.dtype)
        self.fetched_v[b, :, start : start + sinks] = v[:, :sinks].to(self.fetched_v.dtype)

    def ingest_prompt(
        self, k: Tensor, v: Tensor, start: int = 0, rows: Optional[list[int]] = None
    ) -> None:
        """After the prompt's attention: its rows k, v (B, Hkv, S, D) at positions [start, start
        + S), up to each prompt's end (as `SpeCache.begin` set it), join the window, whose whole
        groups beyond the newest R are quantized, and go to the slow tier: in one piece or in
        chunks, the same groups. `rows`: the cache rows of k's sequences (default: all)."""
        # quantized from the 16-bit pairs, as flushes are
        k, v = k.to(self.window_k.dtype), v.to(self.window_v.dtype)
        held = self.state.held()
        for i, b in enumerate(range(len(held)) if rows is None else rows):
            end = min(held[b], start + k.shape[2])
            if end <= start:
                continue  # right padding only, in this chunk
            (lq0, r0), (lq1, r1) = self.state.split(start), self.state.split(end)
            rows_k, rows_v = k[i, :, : end - start], v[i, :, : end - start]
            pending_k = torch.cat([self.window_k[b, :, :r0], rows_k], 1)  # positions [lq0, end)
            pending_v = torch.cat([self.window_v[b, :, :r0], rows_v], 1)
            if lq1 > lq0:
                self._quantize_into(b, lq0, pending_k[:, : lq1 - lq0], pending_v[:, : lq1 - lq0])
            self.window_k[b, :, :r1] = pending_k[:, lq1 - lq0 :]
            self.window_v[b, :, :r1] = pending_v[:, lq1 - lq0 :]
            self.tier.write(b, start, rows_k, rows_v)

    def history_blocks(self, start: int, block: int, rows: Optional[list[int]] = None):
        """The pairs of positions [0, start) as (K, V) blocks (B, Hkv, <= block, D), in order:
        exact, from the slow tier; with nothing to fetch (KIVI), as its decode steps read them:
        the low-bit copy below Lq, but the sinks. `rows`: those rows' only."""
        lq = self.state.split(start)[0] if self.config.method.topk == 0 else 0
        for first in range(0, start, block):
            k, v = self.tier.read_range(first, min(start, first + block), rows)
            # whole groups: block is a multiple of g
            low, sinks = min(lq, first + block) - first, max(0, self.n_sinks - first)
            if low > sinks:
                low_k, low_v = self.lowbit().dequantized(first, first + low)
                if rows is not None:
                    low_k, low_v = low_k[rows], low_v[rows]
                # a copy, never the tier's own storage
                k, v = k.to(torch.float32, copy=True), v.to(torch.float32, copy=True)
                k[:, :, sinks:low], v[:, :, sinks:low] = low_k[:, :, sinks:], low_v[:, :, sinks:]
            yield k, v

    def flush_window(self, b: int) -> None:
        """Sequence b's window holds R + g tokens: quantize the oldest g (their 16-bit pairs are
        in the slow tier already) and slide the window down by g. (Ours: KIVI quantizes its whole
        window when it reaches R, which leaves 0 to R - 1 recent tokens in 16 bits.)"""
        start, g = self.state.host_quantized_len[b], self.config.method.group
        self._quantize_into(b, start, self.window_k[b, :, :g], self.window_v[b, :, :g])
        self.window_k[b, :, :-g] = self.window_k[b, :, g:].clone()
        self.window_v[b, :, :-g] = self.window_v[b, :, g:].clone()

    # --- a pass ----------------------------------------------------------------------------------

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask=None) -> Tensor:
        """The attention of new rows q (B, H, S, D), with their k, v (B, Hkv, S, D) at positions
        input_pos (B, S), as the shared state's phase says; `mask` is not read (SpeCache knows
        what each row sees)."""
        if self.state.phase == PREFILL:
            return self.prefill(q, k, v, int(input_pos[0, 0]))
        self.tier.before_step()
        return self.step(q, k, v, keep=self.state.phase == DECODE)

    def prefill(
        self, q: Tensor, k: Tensor, v: Tensor, start: int, rows: Optional[list[int]] = None
    ) -> Tensor:
        """A prompt's rows from position `start` (every sequence's, right-padded; or those on
        `rows`): full precision, over the history as the slow tier holds it (prefill is bound by
        compute); then they join the cache."""
        if start == 0:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            block = history_block(*q.shape, self.config.method.group)
            y = attention_after_history(q, k, v, self.history_blocks(start, block, rows))
        self.ingest_prompt(k, v, start, rows)
        return y

    def step(self, q: Tensor, k: Tensor, v: Tensor, keep: bool) -> Tensor:
        """The new rows (B, H, S, D) over the history in mixed precision; the last row chooses the
        next prefetch; with `keep`, the real row's K, V join the window and the slow tier."""
        b, n_heads, s, d = q.shape
        rows = query_rows(q, k.shape[1])
        discard = self.prefetch_missed(q) if self.correcting and keep else None
        # RamTier itself: a subclass may read or count in its own way, op by op
        if type(self.tier) is RamTier and self.probe is None:
            out, kappa = self.step_in_ram(rows, k, v, discard)
        else:
            out, kappa = self.step_in_parts(rows, k, v, keep, discard)
        if self.correcting:
            self.state.write_moved(self.last_query, q[:, :, -1])
        new_k = new_v = None
        if keep:
            new_k, new_v = self.append_real_row(k[:, :, 0], v[:, :, 0])
        self.tier.after_step(new_k, new_v, kappa)
        return out.reshape(b, n_heads, s, d).to(q.dtype)

    def segments(self, k: Tensor, v: Tensor, fetched_valid: Tensor) -> Segments:
        state = self.state
        buffers = (self.fetched_k, self.fetched_v, self.fetched_pos, fetched_valid)
        window = (self.window_k, self.window_v, state.window_len)
        return Segments(state.quantized_len, *buffers, *window, k, v)

    def step_in_ram(
        self, rows: Tensor, k: Tensor, v: Tensor, discard: Optional[Tensor]
    ) -> tuple[Tensor, None]:
        """A step whose slow tier is in the same RAM: one op (`specache::step_attention`), which
        also places the prefetch; the tier then only stores the real row."""
        m, sel = self.config.method, self.config.selection
        out, fetched_k, fetched_v, fetched_pos, fetched_valid, _, kappa_pos, kappa_valid, read = (
            torch.ops.specache.step_attention(
                rows,
                *self.lowbit()[:6],
                m.bits,
                m.group,
                m.arithmetic == "int8",
                *self.segments(k, v, self.fetched_valid),
                self.tier.k,
                self.tier.v,
                self.picks,
                sel.shortlist,
                discard,
                sel.gqa == "max",
                self.n_sinks,
                self.k_spec,
                self.state.selectable_len,
            )
        )
        for buffer, new in zip(
            (self.fetched_k, self.fetched_v, self.fetched_pos, self.fetched_valid),
            (fetched_k, fetched_v, fetched_pos, fetched_valid),
        ):
            self.state.write_moved(buffer, new)
        self.pairs_read += read.sum(-1) * self.state.stepping
        if self.k_spec:
            self.choose_prefetch(kappa_pos, kappa_valid)
        return out, None

    def step_in_parts(
        self, rows: Tensor, k: Tensor, v: Tensor, keep: bool, discard: Optional[Tensor]
    ) -> tuple[Tensor, Optional[Kappa]]:
        """A step op by op, for a slow tier elsewhere (its reads) or a probe (which watches, or
        picks as the oracle): the output and the prefetch for the tier to place."""
        state, sel, s = self.state, self.config.selection, k.shape[2]
        exact = exact_slots(
            self.fetched_valid,
            self.fetched_pos,
            state.quantized_len,
            self.n_sinks,
            self.k_spec,
            discard,
        )
        seg = self.segments(k, v, exact)
        part = lowbit_partial_attention(rows, self.lowbit(), seg, self.config.method.arithmetic)
        if self.picks:
            part, seg = self.pick_within_step(rows, part, seg, s, discard)
        merged = merge_segments(rows, part, seg)
        if self.probe is not None and keep:  # before the prefetch rewrites the slots seg reads
            self.probe.observe(self, rows, seg, s)
        if not self.k_spec:
            return merged.out, None
        kappa = prefetch_positions(
            part, merged, seg, sel.gqa, self.n_sinks, state.selectable_len, self.k_spec
        )
        return merged.out, self.choose_prefetch(*kappa)

    def prefetch_missed(self, q: Tensor) -> Tensor:
        """correct: the KV heads (B, Hkv) whose real query moved away from the one that chose the
        prefetch."""
        threshold = self.config.selection.correct_below
        discard = queries_disagree(q[:, :, 0], self.last_query, self.fetched_k.shape[1], threshold)
        self.heads_discarded += discard.sum(-1) * self.state.stepping
        self.heads_checked += discard.shape[-1] * self.state.stepping
        return discard

    def pick_within_step(
        self, rows: Tensor, part: LowBitPart, seg: Segments, s: int, discard: Optional[Tensor]
    ) -> tuple[LowBitPart, Segments]:
        """split (ours): the real row (row 0) picks the positions its low-bit weights weigh most
        (or, as the oracle, those a probe chooses with exact scores); their 16-bit pairs are read
        now, fill the real row's slots (all k slots of a KV head in `discard`), and their low-bit
        share leaves `part`."""
        merged = merge_segments(rows, part, seg)
        sel = self.config.selection
        first = first_pick_slot(seg.fetched_pos, self.n_sinks, self.k_spec, discard)
        placed = picks_placed(self.picks, seg.fetched_pos.shape[-1], first)
        if self.probe is not None and self.probe.oracle:
            picks, valid = self.probe.oracle_picks(self, rows, part, merged, seg, s)
        else:  # candidates: quantized, not held in a valid slot
            picks, valid = top_positions(
                part,
                merged,
                seg,
                s,
                0,
                sel.gqa,
                0,
                seg.quantized_len,
                seg.fetched_pos,
                seg.fetched_valid,
                min(self.picks * max(sel.shortlist, 1), self.k_packed.shape[2]),
            )
        if sel.shortlist:  # the listed pairs read at once
            valid = shortlist_listed(valid, sel.shortlist, placed)
            listed_k, listed_v = self.tier.read(picks, valid)
            self.pairs_read += valid.sum((1, 2)) * self.state.stepping
            chosen, valid = rank_shortlist(
                rows, part, merged, s, sel.gqa, listed_k, valid, self.picks
            )
            picks = picks.gather(-1, chosen)
            pairs = gather_pairs(listed_k, chosen), gather_pairs(listed_v, chosen)
            valid = valid & placed
        else:
            valid = valid & placed
            pairs = self.tier.read(picks, valid)
            self.pairs_read += valid.sum((1, 2)) * self.state.stepping
        part, seg = take_picks(part, self.lowbit(), seg, picks, valid, *pairs, first)
        for buffer, new in zip(
            (self.fetched_k, self.fetched_v, self.fetched_pos),
            (seg.fetched_k, seg.fetched_v, seg.fetched_pos),
        ):
            self.state.write_moved(buffer, new)
        return part, seg

    def choose_prefetch(self, kappa_pos: Tensor, kappa_valid: Tensor) -> Kappa:
        """kappa_{t+1}: the last row's top-k_spec positions (B, Hkv, k_spec), among those
        quantized by the next step and not sinks. Counted as read: with reuse, only those the
        previous prefetch did not hold."""
        new = kappa_valid
        if self.config.selection.reuse:
            new = new & ~held_match(kappa_pos, kappa_valid, self.kappa_pos, self.kappa_valid)[0]
        self.pairs_read += new.sum((1, 2)) * self.state.stepping
        self.state.write_moved(self.kappa_pos, kappa_pos)
        self.state.write_moved(self.kappa_valid, kappa_valid)
        return Kappa(self.kappa_pos, self.kappa_valid)

    def append_real_row(self, new_k: Tensor, new_v: Tensor) -> tuple[Tensor, Tensor]:
        """The real row's K, V (B, Hkv, D) join the window (and, returned in the pairs' dtype,
        the slow tier); the speculative row's are dropped."""
        rows = self.state.moved()
        new_k, new_v = new_k.to(self.window_k.dtype), new_v.to(self.window_v.dtype)
        self.window_k[rows, :, self.state.window_len[rows]] = new_k[rows]
        self.window_v[rows, :, self.state.window_len[rows]] = new_v[rows]
        return new_k, new_v

    def step_on_rows(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """A step of the rows the state moves ("rows" below: `state.rows`, whose phase says
        whether the real rows are kept): q (1, H, n S, D) and k, v (1, Hkv, n S, D) are their
        rows, S a sequence, one sequence after another in the order of `state.rows`. Every row of
        the cache takes the step, the others with no query and nothing to attend, and are left as
        they were. The output (1, H, n S, D); `input_pos` is not read."""
        state, batch = self.state, self.fetched_k.shape[0]
        at, n = state.rows_index, len(state.rows)

        def on_every_row(x: Tensor) -> Tensor:  # (1, h, n S, D) -> (B, h, S, D), zeros elsewhere
            every = x.new_zeros(batch, x.shape[1], x.shape[2] // n, x.shape[3])
            every[at] = x[0].unflatten(1, (n, -1)).transpose(0, 1)
            return every

        self.tier.before_step()
        keep = state.row_phase[state.rows[0]] == DECODE
        out = self.step(on_every_row(q), on_every_row(k), on_every_row(v), keep)
        return out[at].transpose(0, 1).flatten(1, 2).unsqueeze(0)

    def fast_tier_bytes(self) -> int:
        """The layer's fast-tier buffers, all sequences (not its counters)."""
        counters = ("pairs_read", "heads_discarded", "heads_checked")
        return sum(
            t.numel() * t.element_size() for name, t in self.named_buffers() if name not in counters
        )


class RowOfLayer(nn.Module):
    """Row b of a layer ("rows" below), plugged into the host's attention layer for that row's
    prompt chunks and its bootstrap; its decode steps go with the other rows' (`step_on_rows`)."""

    def __init__(self, layer: SpeCacheLayer, b: int):
        super().__init__()
        self.layer, self.b = layer, b

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask=None) -> Tensor:
        if self.layer.state.row_phase[self.b] == PREFILL:
            return self.layer.prefill(q, k, v, int(input_pos[0, 0]), rows=[self.b])
        return self.layer.step_on_rows(q, k, v, input_pos)


# --- the two-row step and the bootstrap: a generation ----------------------------------------


class SpeCache:
    """SpeCache for `n_layers` attention layers of a model with `n_heads` query and `n_kv_heads`
    KV heads of `head_dim`, in `dtype` on `device`, for `batch_size` sequences of up to
    `max_seq_length` positions (rounded up to a whole group: `capacity`).

    Plug `layers[i]` in as the i-th attention layer's KV cache: the layer hands it the new rows'
    q (B, H, S, D) and k, v (B, Hkv, S, D) after RoPE, with their positions (B, S), and uses what
    it returns as the attention output (B, H, S, D). The host's positional table must reach
    position `capacity` (the speculative row sits one past the last real one). Then, with
    `forward(tokens (B, S), positions (B, S)) -> logits (B, S, V)` the host model's pass:

        cache.begin(prompts, lengths)     # right-padded prompts (B, S) and their lengths (B,)
        logits = forward(prompts, positions)   # prefill, in one piece or in chunks
        cache.sampled(first)              # the first new token (B, 1)
        cache.bootstrap(forward, first, lengths[:, None])
        for each step:                    # positions: where `token` sits (B, 1)
            logits = cache.step(forward, token, positions)   # the real row's logits (B, 1, V)
            token = sample(logits); cache.sampled(token)
        cache.finish()
    """

    def __init__(
        self,
        config: SpeCacheConfig,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        batch_size: int,
        max_seq_length: int,
        device: torch.device,
        dtype: torch.dtype,
        probe: Optional[Probe] = None,
    ):
        config.validate(head_dim)
        group = config.method.group
        self.capacity = -(-max_seq_length // group) * group
        self.config, self.device, self.probe = config, torch.device(device), probe
        self.pair_dtype = config.placement.pair_dtype_for(dtype)  # window, slots, slow tier
        self.state = SpeCacheState(
            config,
            batch_size,
            self.capacity,
            self.device,
            head_dim,
            self.pair_dtype,
            n_heads // n_kv_heads,
        )
        make_tier = config.placement.slow_tier
        if make_tier is None and self.device.type == "cuda":
            executor = ThreadPoolExecutor(1, thread_name_prefix="specache-fetch")
            make_tier = partial(PinnedTier, executor=executor)
        self.layers = [
            SpeCacheLayer(
                self.state,
                i,
                n_heads,
                n_kv_heads,
                head_dim,
                self.pair_dtype,
                self.device,
                make_tier or RamTier,
                probe,
            )
            for i in range(n_layers)
        ]
        self.speculative = config.method.speculative and config.method.topk > 0
        self.guess_next: Callable[[Tensor, Tensor, Tensor], Tensor] = GUESSES[
            config.selection.guess
        ]
        # per sequence: its real tokens (for prompt lookup), the next guess, the guesses that held
        ids = dict(dtype=torch.long, device=self.device)
        self.token_history = torch.zeros(batch_size, self.capacity + 1, **ids)
        self.history_len = torch.zeros(batch_size, **ids)
        self.guess = torch.zeros(batch_size, 1, **ids)
        self.matches = torch.zeros(batch_size, **ids)
        self.guessed_from: Optional[Tensor] = None  # the speculative rows' logits, last step
        self.row_guessed: dict[int, tuple[Tensor, Tensor]] = {}  # the same, per row ("rows")

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        """A generation of the prompts `tokens` (B, S, right-padded to `lengths`) starts: every
        per-generation buffer and count is reset, and the next passes are its prefill. `held` >
        0: each sequence holds that many tokens already (earlier turns, kept by the last
        `finish(keep=True)`), which the prompts continue."""
        if held and self.state.held() != [held] * len(self.state.held()):
            raise ValueError(
                f"the cache holds {self.state.held()} tokens per sequence, not "
                f"{held}: a continued generation starts where the last one ended"
            )
        self.state.begin((held + lengths).tolist())
        for layer in self.layers:
            layer.reset()
        if self.probe is not None:
            self.probe.reset()
        if not held:
            self.token_history.zero_()
        self.token_history[:, held : held + tokens.shape[1]] = tokens
        self.history_len = held + lengths
        self.guessed_from = None
        self.matches.zero_()

    def bootstrap(
        self, forward: Callable[[Tensor, Tensor], Tensor], first: Tensor, positions: Tensor
    ) -> None:
        """T1 alone: it chooses kappa_1 and guesses T'2; its K, V are not kept. Eager (once per
        generation)."""
        if self.speculative:
            self.state.phase = BOOTSTRAP
            with torch.compiler.set_stance("force_eager"):
                logits = forward(first, positions)
            self.guess = self.guess_next(logits[:, -1], self.token_history, self.history_len)

    def step(
        self, forward: Callable[[Tensor, Tensor], Tensor], token: Tensor, positions: Tensor
    ) -> Tensor:
        """A decode step: rows [T_t, T'_{t+1}] at [p, p + 1] (or T_t alone, not speculative); the
        real row's logits (B, 1, V)."""
        return self.stepped(forward(*self.step_rows(token, positions)))

    def step_rows(self, token: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`step`'s first half: the rows the step's pass takes, and their positions. A caller
        that runs several caches' rows in one pass (serve.py) calls the halves itself."""
        self.state.phase = DECODE
        if not self.speculative:
            return token, positions
        return torch.cat([token, self.guess], 1), torch.cat([positions, positions + 1], 1)

    def stepped(self, logits: Tensor) -> Tensor:
        """`step`'s second half, after the pass: the real row's logits (B, 1, V)."""
        if self.speculative:
            self.guessed_from, self.guess_was = logits[:, 1], self.guess
        self.advance()
        return logits[:, :1]

    def sampled(self, token: Tensor) -> None:
        """The real token (B, 1) the host sampled: kept in the history; the next guess, from the
        speculative row's logits."""
        batch = torch.arange(token.shape[0], device=token.device)
        self.token_history[batch, self.history_len] = token[:, 0]
        self.history_len.add_(1)
        if self.guessed_from is not None:
            self.matches += (self.guess_was == token)[:, 0]
            self.guess = self.guess_next(self.guessed_from, self.token_history, self.history_len)

    def finish(self, keep: bool = False) -> None:
        """The generation ended, or failed: the last prefetch has landed. With `keep`, what the
        cache holds stays for a continuation (`begin(..., held)`)."""
        for layer in self.layers:
            layer.tier.before_step()

    def advance(self) -> None:
        """After a step that kept the real rows: count them into the windows, and flush full
        windows."""
        state = self.state
        selectable = state.host_selectable_len()
        state.window_len += 1
        state.host_window_len = [r + 1 for r in state.host_window_len]
        full = [b for b in range(len(state.host_window_len)) if self.flush_if_full(b)]
        if full or state.host_selectable_len() != selectable:
            state.sync()

    def flush_if_full(self, b: int) -> bool:
        """Sequence b's window holds R + g tokens (its newest counted on the host): every layer
        flushes its oldest group into the low-bit copy. Whether it did."""
        state, g = self.state, self.config.method.group
        if state.host_window_len[b] != state.residual + g:
            return False
        for layer in self.layers:
            layer.flush_window(b)
        state.host_quantized_len[b] += g
        state.host_window_len[b] -= g
        return True

    # --- rows: one cache for sequences that come and go ----------------------------------------
    # A server that batches continuously (serve.py) runs sequences that join and leave at their
    # own times. Here they share one cache, a row each: a row begins, prefills, bootstraps and is
    # kept on its own, and one pass steps every decoding row together (`move_rows`, then each
    # layer's `step_on_rows`) while other rows take prompt chunks in the same pass. A row the step
    # does not move holds nothing as the step sees it (its lengths are 0 on the device), so it
    # costs the kernels next to nothing, and the step writes nothing of it (`write_moved`, and the
    # slow tier takes the moved rows' real rows only). Its prefetch slots are filled again from
    # its kappa, which the step left as it was: the pairs they hold already. A kept row is copied
    # out of the tiers to host RAM and back into a row reset anew (`save_row`, `restore_row`), once
    # the moves in the background have landed.

    def row(self, b: int) -> list[nn.Module]:
        """Row b's module for each layer: plugged in for its prompt's chunks and its bootstrap."""
        return [RowOfLayer(layer, b) for layer in self.layers]

    def begin_row(self, b: int, tokens: Tensor, held: int = 0) -> None:
        """`begin` for row b alone: its prompt `tokens` (1, S), on top of the `held` tokens the row
        holds already (restored with `restore_row`)."""
        state, n = self.state, held + tokens.shape[1]
        if held and state.held()[b] != held:
            raise ValueError(f"row {b} holds {state.held()[b]} tokens, not {held}")
        state.host_quantized_len[b], state.host_window_len[b] = state.split(n)
        state.row_phase[b] = PREFILL
        for layer in self.layers:
            layer.reset([b])
        if not held:
            self.token_history[b] = 0
        self.token_history[b, held:n] = tokens[0]
        self.history_len[b] = n
        self.matches[b] = 0

    def move_rows(self, rows: list[int]) -> None:
        """The next pass steps `rows` (in this order, each in its phase): the device's lengths
        follow (those of the other rows are 0)."""
        self.state.rows = rows
        self.state.rows_index = torch.tensor(rows, device=self.device)
        self.state.sync()

    def bootstrap_row(
        self, b: int, forward: Callable[[Tensor, Tensor], Tensor], first: Tensor, position: Tensor
    ) -> None:
        """`bootstrap` of row b alone: `forward` runs the model with `row(b)` plugged in."""
        if self.speculative:
            self.state.row_phase[b] = BOOTSTRAP
            self.move_rows([b])
            with torch.compiler.set_stance("force_eager"):
                logits = forward(first, position)
            history = self.token_history[b : b + 1], self.history_len[b : b + 1]
            self.guess[b] = self.guess_next(logits[:, -1], *history)[0]

    def step_rows_of(self, b: int, token: Tensor, position: Tensor) -> tuple[Tensor, Tensor]:
        """`step_rows` of row b: the rows (1, S) its sequence adds to the next decode pass."""
        self.state.row_phase[b] = DECODE
        if not self.speculative:
            return token, position
        guess = self.guess[b : b + 1]
        return torch.cat([token, guess], 1), torch.cat([position, position + 1], 1)

    def stepped_row(self, b: int, logits: Tensor) -> Tensor:
        """`stepped` of row b, its logits (1, S, V) from the pass: the real row's (1, 1, V)."""
        if self.speculative:
            self.row_guessed[b] = logits[:, 1], self.guess[b : b + 1].clone()
        self.state.host_window_len[b] += 1  # the device's follow at the next `move_rows`
        self.flush_if_full(b)
        return logits[:, :1]

    def sampled_row(self, b: int, token: Tensor) -> None:
        """`sampled` of row b: its real token (1, 1)."""
        self.token_history[b, self.history_len[b]] = token[0, 0]
        self.history_len[b] += 1
        if b in self.row_guessed:
            guessed_from, guess = self.row_guessed.pop(b)
            self.matches[b] += (guess == token).sum()
            history = self.token_history[b : b + 1], self.history_len[b : b + 1]
            self.guess[b] = self.guess_next(guessed_from, *history)[0]

    def save_row(self, b: int, n: int) -> list[Tensor]:
        """What row b holds, its n tokens, copied out (a kept conversation, whose row then serves
        another sequence): the tokens, and each layer's low-bit copy, window, sinks and slow tier
        up to them, so a copy costs what it holds, in host RAM."""
        if n != self.state.held()[b]:
            raise ValueError(f"row {b} holds {self.state.held()[b]} tokens, not {n}")
        self._settle()
        saved = [self.token_history[b, :n].to("cpu", copy=True)]
        for layer in self.layers:  # to host RAM, whatever device a buffer is on
            saved += [
                buffer[b, :, :end].to("cpu", copy=True) for buffer, end in self._row_parts(layer, n)
            ]
        return saved

    def restore_row(self, b: int, saved: list[Tensor]) -> None:
        """`save_row`'s copy into row b, which then holds what the saved row held."""
        history, *parts = saved
        n = history.shape[0]
        self._settle()  # no copy in flight may land on the row afterwards
        for layer in self.layers:  # nothing fetched or chosen for it: it begins anew
            layer.reset([b])
        self.token_history[b, :n] = history
        self.state.host_quantized_len[b], self.state.host_window_len[b] = self.state.split(n)
        parts = iter(parts)
        for layer in self.layers:
            for (buffer, end), part in zip(self._row_parts(layer, n), parts):
                buffer[b, :, :end] = part

    def _settle(self) -> None:
        """Every move in the background has landed: the prefetches, and beside a GPU the copies of
        real rows to the host's slow tier (on a side stream), so the host reads and writes the
        tiers itself."""
        for layer in self.layers:
            layer.tier.before_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _row_parts(self, layer: SpeCacheLayer, n: int) -> list[tuple[Tensor, int]]:
        """A layer's per-row buffers, each with how far a row that holds n tokens fills it."""
        lq, r = self.state.split(n)
        groups = lq // self.config.method.group
        return [
            (layer.k_packed, lq),
            (layer.k_scale, groups),
            (layer.k_zero, groups),
            (layer.v_packed, lq),
            (layer.v_scale, lq),
            (layer.v_zero, lq),
            (layer.window_k, r),
            (layer.window_v, r),
            (layer.fetched_k, layer.n_sinks),  # the sinks' exact pairs
            (layer.fetched_v, layer.n_sinks),
            (layer.tier.k, n),
            (layer.tier.v, n),
        ]
