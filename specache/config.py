"""SpeCache's settings: the paper's (`Method`), how the exact pairs are chosen (`Selection`, with
the paper's rule as `PAPER`), where the pairs live (`Placement`), and the fast tier's size that
follows from them (`fast_tier_layout`, `fast_tier_plan`)."""

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

import torch

from specache.guess import GUESSES
from specache.lowbit import LEVELS, sixteen_bit_dtype, value_group
from specache.tiers import SlowTier, TierSpec

# the low-bit pass's products: float, 8-bit integers (ours, specache/integer.py), or the
# integers' scores with a sparse value mix (ours, specache/sparse.py)
ARITHMETICS = ("float", "int8", "sparse")


def setting(default: object, help: str, **more: object) -> Any:
    """A field of `Method`: its default and what it does, from which the command line's
    --specache_NAME is made (with `choices` where given; none where `command_line` is False)."""
    return field(default=default, metadata={"help": help, **more})


@dataclass(frozen=True)
class Method:
    """The paper's settings (and two of ours: the arithmetic, and tau for its sparse pass)."""

    bits: int = setting(1, "bits of the low-bit KV copy: 1 or 2")
    group: int = setting(64, "g: tokens per key group (per channel), channels per value group")
    residual: int = setting(64, "R: the newest R tokens stay 16-bit; a multiple of g")
    topk: int = setting(
        64, "k: 16-bit pairs read per layer and KV head each step; 0: KIVI alone, nothing read"
    )
    speculative: bool = setting(
        True, "False: the paper's non-speculative baseline", command_line=False
    )
    arithmetic: str = setting(
        "float",
        "the low-bit pass's products: float; int8 (ours: both operands rounded to 8-bit "
        "integers per row, what CPUs with integer dot products run fastest, AVX512-VNNI); or "
        "sparse (ours: int8's scores, and the values of only the positions some row weighs at "
        "least e^-tau of its largest weight, the rest of each key group's weight on the group's "
        "mean value); docs/method.md says what each costs in accuracy",
        choices=ARITHMETICS,
    )
    tau: float = setting(
        6.0,
        "sparse: a position whose low-bit weight is below e^-tau of the largest in every row of "
        "its KV head takes its key group's mean value; inf mixes every value",
    )

    @property
    def min_weight(self) -> float:
        """The sparse pass's threshold on a weight exp(score - row_max): e^-tau."""
        return math.exp(-self.tau)


def ours(default: object, name: str, help: str, *also: str) -> Any:
    """A field of `Selection`: one of our changes to the paper's rule, turned on by `name` in
    --specache_select (at `default`; "name=value" sets a value where the field is a number), or
    by each of `also` (which sets the field to that name)."""
    return field(default=default, metadata={"names": (name, *also), "help": help})


@dataclass(frozen=True)
class Selection:
    """How the exact pairs are chosen. Its defaults are ours; `PAPER` below is the paper's rule.
    `parse` reads the names of the command line's --specache_select, which each field declares."""

    real_share: float = ours(0.5, "split", "that share of k chosen by the real row within the step")
    gqa: str = ours(
        "max",
        "gqa-max",
        "a KV head ranks positions by the max over its query heads; the paper's: their mean",
    )
    # FreeKV's correction
    correct_below: Optional[float] = ours(
        0.9,
        "correct",
        "a KV head whose real query is less alike than this cosine to the query that chose its "
        "prefetch discards it, and the real row picks all k",
    )
    sinks: int = ours(4, "sinks", "the first n positions, always exact")
    levels: str = ours(
        "lloyd",
        "lloyd",
        "1-bit levels from the data, at the group's half means; the paper's: min and max; "
        "midway: key levels halfway between lloyd's and the paper's, values lloyd's",
        "midway",
    )
    guess: str = ours(
        "lookup", "lookup", "the speculative token by prompt lookup; the paper's: greedy"
    )
    reuse: bool = ours(True, "reuse", "do not read again what the previous prefetch held")
    # what the shortlist buys is in docs/method.md#the-shortlist-ours
    shortlist: int = ours(
        8,
        "shortlist",
        "the real row reads the pairs of its copy's top n x picks and keeps those its exact keys "
        "weigh most; 0: the copy's top picks, read alone; it costs the slow tier n x the real "
        "row's reads",
    )

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
            field_name, default, parser = VARIANTS[name]
            if value and parser is None:
                raise ValueError(f"--specache_select: {name} takes no value")
            try:
                chosen = replace(chosen, **{field_name: parser(value) if value else default})
            except ValueError:
                raise ValueError(
                    f"--specache_select: {name}={value} is not a valid {parser.__name__}"
                ) from None
        return chosen

    def name(self) -> str:
        """As --specache_select would name it."""
        names = []
        for name, (field_name, default, parser) in VARIANTS.items():
            value = getattr(self, field_name)
            if value == getattr(PAPER, field_name):
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


# the fields that "name=value" sets, by their type; the others take no value
NUMBERS = {int: int, float: float, Optional[float]: float}


def variants() -> dict[str, tuple[str, object, Optional[type]]]:
    """--specache_select's names, as `Selection`'s fields declare them: name -> (field, its value
    when the name comes without "=value", the value's type; None where it takes no value)."""
    named = {}
    for each in fields(Selection):
        name, *also = each.metadata["names"]
        named[name] = (each.name, each.default, NUMBERS.get(each.type))
        named.update({other: (each.name, other, None) for other in also})
    return named


VARIANTS = variants()


@dataclass(frozen=True)
class Placement:
    """Where the pairs live and how they move."""

    pair_dtype: Optional[torch.dtype] = None  # the exact pairs' dtype; None: 16-bit (see below)
    # a slow tier apart from the fast one (a GPU's host memory, a disk): False waits for each
    # prefetch as soon as it starts, which measures what the overlap buys
    overlap_fetch: bool = True
    # None: host RAM (pinned, beside a GPU); or a callable that makes each layer's slow tier
    # from its TierSpec (the host's caches/disk_tier.py makes one on disk)
    slow_tier: Optional[Callable[[TierSpec], SlowTier]] = None

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
                f"SpeCache arithmetic must be one of {', '.join(ARITHMETICS)}, got "
                f"{m.arithmetic!r}",
            ),
            (m.tau >= 0, f"SpeCache tau must be >= 0 (inf: no position skipped), got {m.tau}"),
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


# --- the fast tier's size --------------------------------------------------------------------


def fast_tier_layout(
    config: SpeCacheConfig,
    capacity: int,
    residual: int,
    slots: int,
    prefetch_slots: int,
    head_dim: int,
    query_heads_per_kv: int,
    pair_dtype: torch.dtype,
    correcting: bool,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every fast-tier buffer of a layer, per sequence and KV head: its shape and dtype, for a
    cache of `capacity` positions whose newest `residual` stay 16-bit, with `slots` exact slots of
    which `prefetch_slots` the prefetch's. The one place the fast tier's size is written: the
    layer allocates it (times the batch and the KV heads), `fast_tier_plan` sizes the slots by it,
    and the stats and the equal-budget baselines count it. Buffers hold what the capacity can need:
    the low-bit copy the positions that can ever be quantized (all but the newest R), the window at
    most the capacity (R and up to g more waiting for a group), the slots at most the positions the
    copy can hold."""
    m = config.method
    quantizable = max(0, capacity - residual) // m.group * m.group
    code_bytes = head_dim * m.bits // 8
    scale = sixteen_bit_dtype(pair_dtype)
    value_groups = head_dim // value_group(m.group, head_dim)
    window = min(residual + m.group, capacity)
    layout = {
        # the low-bit copy...
        "k_packed": ((quantizable, code_bytes), torch.uint8),
        "k_scale": ((quantizable // m.group, head_dim), scale),
        "k_zero": ((quantizable // m.group, head_dim), scale),
        "v_packed": ((quantizable, code_bytes), torch.uint8),
        "v_scale": ((quantizable, value_groups), scale),
        "v_zero": ((quantizable, value_groups), scale),
        # ... the 16-bit window: the newest R tokens and up to g more waiting for a group ...
        "window_k": ((window, head_dim), pair_dtype),
        "window_v": ((window, head_dim), pair_dtype),
        # ... and the exact pairs in slots: sinks, kappa_t's prefetch, the real row's picks; with
        # kappa_{t+1}, the positions the next prefetch fetches
        "fetched_k": ((slots, head_dim), pair_dtype),
        "fetched_v": ((slots, head_dim), pair_dtype),
        "fetched_pos": ((slots,), torch.long),
        "fetched_valid": ((slots,), torch.bool),
        "kappa_pos": ((prefetch_slots,), torch.long),
        "kappa_valid": ((prefetch_slots,), torch.bool),
    }
    if m.arithmetic == "sparse":  # each key group's mean value (specache/sparse.py)
        layout["v_mean"] = ((quantizable // m.group, head_dim), scale)
    if correcting:  # the last row's queries, which chose the prefetch the next step reads
        layout["last_query"] = ((query_heads_per_kv, head_dim), torch.float32)
    return layout


def layout_bytes(layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes of a `fast_tier_layout`."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())


def fast_tier_plan(
    config: SpeCacheConfig,
    capacity: int,
    head_dim: int,
    pair_dtype: torch.dtype,
    query_heads_per_kv: int,
) -> tuple[int, int]:
    """(R, the most exact slots) such that a layer's fast tier never holds more than a cache of
    `capacity` pairs in `pair_dtype` (the 16-bit cache it replaces), per KV head and sequence:
    what the fast tier holds without slots, then as many slots as fit, each counted with a
    prefetch position of its own (a bound: the prefetch takes some of the slots) and a layer that
    corrects keeping its query heads' last queries. When the copy and the window alone would
    exceed the cache (a capacity below about R + g + the copy's share), nothing is quantized: R
    becomes the capacity and every pair stays 16-bit in the window."""
    m = config.method
    correcting = config.selection.correct_below is not None

    def size(slots: int) -> int:
        return layout_bytes(
            fast_tier_layout(
                config, capacity, m.residual, slots, slots, head_dim, query_heads_per_kv,
                pair_dtype, correcting,
            )
        )  # fmt: skip

    room = capacity * 2 * head_dim * pair_dtype.itemsize - size(0)
    if room < 0:
        return capacity, 0
    return m.residual, room // (size(1) - size(0))
