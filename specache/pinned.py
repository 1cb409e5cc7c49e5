"""The slow tier beside a GPU: pinned host memory, written on a side stream, with the speculative
prefetch moved in the background (started after a layer at step t, landed just before the same
layer at step t + 1) and the pairs chosen within a step read at once."""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
from torch import Tensor

from specache.tiers import Kappa, TierSpec, gather_pairs, held_match


class PinnedTier:
    """The slow tier in pinned host memory beside a GPU. Writes go out on a side stream; the
    prefetch is copied down, gathered and copied up by a worker thread (`_fetch`) on another side
    stream, waited for by the compute stream only (the host never blocks on the GPU); pairs chosen
    within a step are fetched at once (`_read_now`, a graph break under torch.compile). With
    reuse, the staging buffer still holds the previous prefetch, and only positions it lacks are
    read."""

    gathered_in_step = False

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
