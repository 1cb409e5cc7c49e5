"""How SpeCache's 16-bit pairs move between its tiers: the slow tier that holds all of them, and
the moves into the fast tier's slots. specache.py asks a tier to store, read and prefetch; the tier
decides how for its device.

- `RamTier` (a CPU): both tiers are the same RAM, so there is nothing to hide. Every move is a
  gather or a write inside the layer's compiled step; a prefetch gathers all its pairs, so `reuse`
  changes only the count of pairs a separate slow tier would have to send (SpeCache's `counts`). (A worker thread that gathered in the
  background made a SmolLM2 step at 1k slower, 50 vs 39 ms: the hand-off cost more than the 50 KB
  gather it hid.)
- `PinnedTier` (beside a GPU): the slow tier is pinned host memory. Pairs go out on a side stream;
  the speculative prefetch moves in the background between layers (`PairFetcher`: a worker
  thread, a side stream and events), started right after a layer and waited for just before the
  same layer at the next step; pairs chosen within a step are fetched and waited for at once
  (`fetch_now`, a graph break under torch.compile).

Both read the slow tier for SpeCache's diagnostics only through `keys_on`.
"""
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
from torch import Tensor


def gather_pairs(store: Tensor, positions: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """out[b, h, i] = store[b, h, positions[b, h, i]]: the 16-bit pairs at `positions` (B, Hkv, K)."""
    index = positions.unsqueeze(-1).expand(*positions.shape, store.shape[-1])
    return torch.gather(store, 2, index) if out is None else torch.gather(store, 2, index, out=out)


class RamTier:
    """The complete 16-bit K and V of one layer, (B, Hkv, T, D) each, in the same RAM as the fast
    tier: stores, reads and prefetches happen inside the layer's step."""

    def __init__(self, shape: tuple, dtype: torch.dtype):
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """A prompt's pairs k, v (Hkv, N, D) of sequence b at positions [start, start + N)."""
        self.k[b, :, start: start + k.shape[1]] = k
        self.v[b, :, start: start + v.shape[1]] = v

    def store(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """In the step: the real rows' pairs k, v (B, Hkv, D) at positions (B,)."""
        batch = torch.arange(k.shape[0], device=k.device)
        self.k[batch, :, positions] = k
        self.v[batch, :, positions] = v

    def read(self, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """In the step: the pairs at positions (B, Hkv, K) (all of them: gathering skips nothing)."""
        return gather_pairs(self.k, positions), gather_pairs(self.v, positions)

    def prefetch(self, positions: Tensor, valid: Tensor, buffers: tuple[Tensor, Tensor, Tensor, Tensor],
                 slots: slice) -> None:
        """In the step: the pairs at positions (B, Hkv, K), and the positions and which are valid,
        into `slots` of the fast tier's buffers (pairs K, V, positions, valid flags)."""
        slots_k, slots_v, slots_pos, slots_valid = buffers
        slots_k[:, :, slots] = gather_pairs(self.k, positions)
        slots_v[:, :, slots] = gather_pairs(self.v, positions)
        slots_pos[:, :, slots] = positions
        slots_valid[:, :, slots] = valid

    def read_range(self, first: int, last: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Every sequence's pairs at positions [first, last), (B, Hkv, last - first, D) each (a
        prefill on top of what the cache holds reads its history so)."""
        return self.k[:, :, first:last], self.v[:, :, first:last]

    def keys_on(self, device: torch.device) -> Tensor:
        return self.k

    # The hand-offs around a layer, for a tier whose moves run outside it: none here.
    def reset(self) -> None:
        pass

    def before_layer(self) -> None:
        pass

    def after_layer(self, window_k: Tensor, window_v: Tensor, quantized_len: list[int], window_len: list[int],
                    kept: bool, prefetched: bool, overlap: bool) -> None:
        pass

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def held_match(positions: Tensor, held_positions: Tensor, held_valid: Tensor) -> Tensor:
    """match[b, h, i, j]: position i of `positions` (B, Hkv, K) is held, valid, in slot j of
    held_positions (B, Hkv, K'): what a read with reuse need not read again."""
    return (positions.unsqueeze(-1) == held_positions.unsqueeze(-2)) & held_valid.unsqueeze(-2)


def read_with_reuse(store_k: Tensor, store_v: Tensor, positions: Tensor, valid: Tensor, held_positions: Tensor,
                    held_valid: Tensor, held_k: Tensor, held_v: Tensor) -> int:
    """Host tensors: turn held_k/held_v (B, Hkv, K, D), the pairs of held_positions, into the pairs
    of `positions` (B, Hkv, K), in place, reading from store_k/store_v only the valid positions not
    held already. Returns how many pairs it read."""
    match = held_match(positions, held_positions, held_valid)
    source = match.to(torch.uint8).argmax(-1, keepdim=True).expand(*positions.shape, held_k.shape[-1])
    reused_k, reused_v = held_k.gather(2, source), held_v.gather(2, source)
    missing = valid & ~match.any(-1)
    b, h, slot = missing.nonzero(as_tuple=True)
    reused_k[b, h, slot] = store_k[b, h, positions[b, h, slot]]
    reused_v[b, h, slot] = store_v[b, h, positions[b, h, slot]]
    held_k.copy_(reused_k)
    held_v.copy_(reused_v)
    return len(slot)


class PairFetcher:
    """Moves the pairs of a layer's speculative prefetch (kappa_pos / kappa_valid, on the GPU) from
    the slow tier (pinned host memory) into fast-tier slots (`fetched_*`, views of the layer's
    buffers), in the background: `start` returns at once, `wait` returns when they have landed (for
    the compute stream).

    A worker thread waits for kappa (an event on the compute stream), copies it to the host, gathers
    the pairs from pinned memory into a pinned staging buffer, and copies them up on a side stream;
    `wait` makes the compute stream wait for that copy, so the host never blocks on the GPU. With
    `reuse`, the staging buffer still holds the previous prefetch, and only positions it lacks are
    read from the slow tier.
    """

    def __init__(self, tier: "PinnedTier", fetched_k: Tensor, fetched_v: Tensor, fetched_pos: Tensor,
                 fetched_valid: Tensor, kappa_pos: Tensor, kappa_valid: Tensor, executor: ThreadPoolExecutor,
                 reuse: bool):
        self.tier, self.executor, self.reuse = tier, executor, reuse
        self.fetched_k, self.fetched_v, self.fetched_pos, self.fetched_valid = fetched_k, fetched_v, fetched_pos, \
            fetched_valid
        self.kappa_pos, self.kappa_valid = kappa_pos, kappa_valid
        self.pending: Optional[Future] = None
        self.device = fetched_k.device
        self.stream = torch.cuda.Stream(self.device)
        self.host_positions = torch.zeros(kappa_pos.shape, dtype=torch.long, pin_memory=True)
        self.host_valid = torch.zeros(kappa_pos.shape, dtype=torch.bool, pin_memory=True)
        self.held_positions = torch.zeros(kappa_pos.shape, dtype=torch.long)
        self.held_valid = torch.zeros(kappa_pos.shape, dtype=torch.bool)
        self.staging_k = torch.zeros(fetched_k.shape, dtype=fetched_k.dtype, pin_memory=True)
        self.staging_v = torch.zeros(fetched_v.shape, dtype=fetched_v.dtype, pin_memory=True)
        self.landed = torch.cuda.Event()

    def reset(self) -> None:
        """A new generation: nothing is held."""
        self.wait()
        self.held_valid.zero_()

    def start(self) -> None:
        """Fetch the pairs of the layer's new kappa."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.pending = self.executor.submit(self._fetch, ready)

    def wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()  # re-raises here whatever went wrong in the worker
        torch.cuda.current_stream(self.device).wait_event(self.landed)

    def _fetch(self, ready: "torch.cuda.Event") -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            self.host_positions.copy_(self.kappa_pos, non_blocking=True)
            self.host_valid.copy_(self.kappa_valid, non_blocking=True)
            self.fetched_pos.copy_(self.kappa_pos, non_blocking=True)
            self.fetched_valid.copy_(self.kappa_valid, non_blocking=True)
            positions_copied = torch.cuda.Event()
            positions_copied.record(self.stream)
        # Waiting here blocks this worker only. The stream is in order, so the previous step's
        # upload from the staging buffers is also done once the positions have arrived.
        positions_copied.synchronize()
        self.tier.wait_for_writes()
        if self.reuse:
            read_with_reuse(self.tier.k, self.tier.v, self.host_positions, self.host_valid, self.held_positions,
                            self.held_valid, self.staging_k, self.staging_v)
            self.held_positions.copy_(self.host_positions)
            self.held_valid.copy_(self.host_valid)
        else:
            gather_pairs(self.tier.k, self.host_positions, self.staging_k)
            gather_pairs(self.tier.v, self.host_positions, self.staging_v)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.fetched_k.copy_(self.staging_k, non_blocking=True)
            self.fetched_v.copy_(self.staging_v, non_blocking=True)
            self.landed.record(self.stream)


@torch.compiler.disable
def fetch_now(tier: "PinnedTier", positions: Tensor) -> tuple[Tensor, Tensor]:
    """The pairs at `positions` (B, Hkv, K, on the GPU), now: the positions come down (which waits
    for the compute stream), the host gathers into pinned staging buffers, and the pairs go up on
    the compute stream. Outside any compiled graph."""
    host = positions.cpu()
    tier.wait_for_writes()
    staging_k, staging_v = tier.staging(positions.shape)
    gather_pairs(tier.k, host, staging_k)
    gather_pairs(tier.v, host, staging_v)
    return staging_k.to(positions.device, non_blocking=True), staging_v.to(positions.device, non_blocking=True)


@torch.compiler.disable
def copy_keys_to(tier: "PinnedTier", device: torch.device) -> Tensor:
    """The slow tier's keys, copied whole to the GPU (for the diagnostics only: it reads them all)."""
    tier.wait_for_writes()
    return tier.k.to(device)


class PinnedTier(RamTier):
    """The complete 16-bit K and V of one layer in pinned host memory, beside a GPU: writes go out
    on a side stream, the prefetch moves in the background between layers, pairs chosen within a
    step are fetched at once. `slots`: the layer's fast-tier views that the prefetch fills
    (fetched_k, fetched_v, fetched_pos, fetched_valid, kappa_pos, kappa_valid), or None without one."""

    def __init__(self, shape: tuple, dtype: torch.dtype, device: torch.device, slots: Optional[tuple],
                 executor: ThreadPoolExecutor, reuse: bool):
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.copy_stream = torch.cuda.Stream(device)
        self.fetcher = PairFetcher(self, *slots, executor, reuse) if slots is not None else None
        self._staging: dict[tuple, tuple[Tensor, Tensor]] = {}

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Copy out on the side stream, and keep the source alive until the copy is done."""
        self.copy_stream.wait_stream(torch.cuda.current_stream(k.device))
        with torch.cuda.stream(self.copy_stream):
            self.k[b, :, start: start + k.shape[1]].copy_(k, non_blocking=True)
            self.v[b, :, start: start + v.shape[1]].copy_(v, non_blocking=True)
        k.record_stream(self.copy_stream)
        v.record_stream(self.copy_stream)

    def wait_for_writes(self) -> None:
        """Block the calling thread until every write so far has landed in host memory."""
        self.copy_stream.synchronize()

    def staging(self, shape: tuple) -> tuple[Tensor, Tensor]:
        """Pinned buffers for `fetch_now` (one pair per shape: a layer's picks keep their shape)."""
        if shape not in self._staging:
            self._staging[shape] = tuple(torch.zeros(*shape, self.k.shape[-1], dtype=self.k.dtype, pin_memory=True)
                                         for _ in range(2))
        return self._staging[shape]

    def store(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        pass  # the real rows' pairs leave after the layer (after_layer), outside the compiled step

    def read(self, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        return fetch_now(self, positions)

    def prefetch(self, positions: Tensor, valid: Tensor, buffers: tuple[Tensor, Tensor, Tensor, Tensor],
                 slots: slice) -> None:
        pass  # started after the layer (after_layer), in the background

    def read_range(self, first: int, last: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Up on the compute stream, once the writes so far have landed (prefill, outside any graph)."""
        self.wait_for_writes()
        # a slice of several sequences or heads is not contiguous: gathered into pinned memory first,
        # so that the upload is asynchronous (torch's pinned allocator keeps it until the copy is done)
        return tuple(torch.empty(x[:, :, first:last].shape, dtype=x.dtype, pin_memory=True)
                     .copy_(x[:, :, first:last]).to(device, non_blocking=True) for x in (self.k, self.v))

    def keys_on(self, device: torch.device) -> Tensor:
        return copy_keys_to(self, device)

    def reset(self) -> None:
        if self.fetcher is not None:
            self.fetcher.reset()

    def before_layer(self) -> None:
        if self.fetcher is not None:
            self.fetcher.wait()  # kappa_t's pairs have landed in this layer's fast tier

    def after_layer(self, window_k: Tensor, window_v: Tensor, quantized_len: list[int], window_len: list[int],
                    kept: bool, prefetched: bool, overlap: bool) -> None:
        """After the layer's step: the real rows' pairs (the windows' newest slots) go to host
        memory; the prefetch of kappa_{t+1} starts (and with `overlap` False, is waited for)."""
        if kept:
            for b, (lq, r) in enumerate(zip(quantized_len, window_len)):
                self.write(b, lq + r, window_k[b, :, r: r + 1].clone(), window_v[b, :, r: r + 1].clone())
        if prefetched and self.fetcher is not None:
            self.fetcher.start()
            if not overlap:
                self.fetcher.wait()
