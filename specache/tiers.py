"""The slow tier: the complete 16-bit cache, and how pairs move from it into the fast tier's slots.
A layer's slow tier is any object with `SlowTier`'s methods, made from a `TierSpec` (Placement's
slow_tier); by default host RAM (`RamTier`), pinned beside a GPU (specache/pinned.py)."""

from typing import NamedTuple, Optional, Protocol

import torch
from torch import Tensor

# In a CPU's RAM both tiers are the same memory and every move is a gather inside the layer's step
# (compiled with it). Beside a GPU the slow tier is pinned host memory: pairs go out on a side
# stream, and the speculative prefetch moves in the background, started after the layer at step t
# and landed just before the same layer at step t + 1; pairs chosen within a step are read and
# waited for at once.


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


class TierState(Protocol):
    """What a tier reads of the layers' shared state (specache/state.py)."""

    rows: Optional[list[int]]  # the rows the next step moves (None: all)

    def next_position(self) -> Tensor:
        """(B,) where each sequence's next real row goes, on the device."""

    def held(self) -> list[int]:
        """The same on the host: the tokens each sequence holds."""

    def at_moved(self, *per_row: Tensor) -> tuple[Tensor, ...]:
        """The rows a step moves, on the device, and each of `per_row` (B, ...) at them."""


class TierSpec(NamedTuple):
    """What a layer's slow tier is made from."""

    shape: tuple[int, int, int, int]  # (B, Hkv, T, D): every position of every sequence
    dtype: torch.dtype  # the pairs'
    device: torch.device  # the fast tier's
    slots: Optional[PrefetchSlots]  # None: the layer prefetches nothing
    reuse: bool  # a read need not read again what the previous read of its kind held
    overlap: bool  # Placement.overlap_fetch
    state: "TierState"  # where each sequence's next real row goes, and which rows a step moves


class SlowTier(Protocol):
    """One layer's complete 16-bit K and V, and the moves of its pairs into the fast tier. A layer
    calls, over a generation: reset; write (the prompt, in one piece or in chunks); read_range (a
    chunk's history); then per pass before_step, read (the real row's picks), after_step."""

    # its pairs sit in the fast tier's memory as `k` and `v` (B, Hkv, T, D), so a step's one op
    # gathers them itself (specache::step_attention) and calls none of the moves below in between
    gathered_in_step: bool

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


class SlowTierError(RuntimeError):
    """A slow tier could not be made, written or read because its storage failed (a full disk, an
    unwritable folder), not the method: a host reports it as one error line, whatever the tier
    (the host's disk tier raises it)."""


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


def prefetch_reads(
    kappa_pos: Tensor, kappa_valid: Tensor, held_pos: Tensor, held_valid: Tensor, reuse: bool
) -> Tensor:
    """(B, Hkv): the pairs a prefetch of kappa reads from the slow tier: every valid one, or with
    reuse only those the previous prefetch (held_pos, held_valid) does not hold already."""
    new = kappa_valid
    if reuse and held_pos.shape[-1]:
        new = new & ~held_match(kappa_pos, kappa_valid, held_pos, held_valid)[0]
    return new.sum(-1)


class RamTier:
    """The slow tier in the same RAM as the fast one (a CPU): every move happens inside the
    layer's step. A prefetch gathers all its pairs, so reuse changes only the count of pairs a
    separate slow tier would send. (A worker thread that gathered in the background made a SmolLM2
    step at 1k slower, 50 vs 39 ms: the hand-off cost more than the 50 KB gather it hid.)"""

    gathered_in_step = True

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
            state = self.spec.state
            rows, positions, k_rows, v_rows = state.at_moved(state.next_position(), new_k, new_v)
            self.k[rows, :, positions] = k_rows
            self.v[rows, :, positions] = v_rows

    def keys(self) -> Tensor:
        return self.k

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
