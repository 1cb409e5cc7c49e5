"""How SpeCache's 16-bit pairs move between its tiers.

- `SlowTier`: the complete 16-bit K and V of one layer; pinned host memory beside a GPU, plain RAM
  on a CPU.
- `gather_pairs`: the fetch on a CPU, where both tiers are the same RAM: a gather inside the
  layer's compiled step.
- `PairFetcher`: the GPU's background fetch of the speculative prefetch (a worker thread, a side
  stream and events), started right after a layer and waited for just before the same layer at the
  next step.
- `fetch_now`: the GPU's synchronous fetch of pairs chosen within a step (by the real row's own
  scores), waited for at once.
- `read_with_reuse`: a host-side gather that reads from the slow tier only the positions that the
  previous fetch did not already bring (temporal reuse).
"""
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch
from torch import Tensor


class SlowTier:
    """The complete 16-bit K and V of one layer, (B, Hkv, T, D) each: pinned host memory beside a
    GPU (written asynchronously on a side stream), else plain RAM."""

    def __init__(self, shape: tuple, dtype: torch.dtype, fast_device: torch.device):
        pin = fast_device.type == "cuda"
        self.k = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.v = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream(fast_device) if pin else None

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store k, v (Hkv, N, D) of sequence b at positions [start, start + N). On a GPU the copy
        is asynchronous; host-side readers call `wait_for_writes` first."""
        if self.copy_stream is None:
            self.k[b, :, start: start + k.shape[1]] = k
            self.v[b, :, start: start + v.shape[1]] = v
            return
        # Copy out on the side stream, and keep the source alive until the copy is done.
        self.copy_stream.wait_stream(torch.cuda.current_stream(k.device))
        with torch.cuda.stream(self.copy_stream):
            self.k[b, :, start: start + k.shape[1]].copy_(k, non_blocking=True)
            self.v[b, :, start: start + v.shape[1]].copy_(v, non_blocking=True)
        k.record_stream(self.copy_stream)
        v.record_stream(self.copy_stream)

    def wait_for_writes(self) -> None:
        """Block the calling thread until every write so far has landed in host memory."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def gather_pairs(store: Tensor, positions: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """out[b, h, i] = store[b, h, positions[b, h, i]]: the 16-bit pairs at `positions` (B, Hkv, K)."""
    index = positions.unsqueeze(-1).expand(*positions.shape, store.shape[-1])
    return torch.gather(store, 2, index) if out is None else torch.gather(store, 2, index, out=out)


def read_with_reuse(slow: SlowTier, positions: Tensor, valid: Tensor, held_positions: Tensor, held_valid: Tensor,
                    held_k: Tensor, held_v: Tensor) -> int:
    """Host tensors: turn held_k/held_v (B, Hkv, K, D), the pairs of held_positions, into the pairs
    of `positions` (B, Hkv, K), in place, reading from the slow tier only the valid positions not
    held already. Returns how many pairs it read."""
    match = (positions.unsqueeze(-1) == held_positions.unsqueeze(-2)) & held_valid.unsqueeze(-2)  # (B, Hkv, K, K)
    source = match.to(torch.uint8).argmax(-1, keepdim=True).expand(*positions.shape, held_k.shape[-1])
    reused_k, reused_v = held_k.gather(2, source), held_v.gather(2, source)
    missing = valid & ~match.any(-1)
    b, h, slot = missing.nonzero(as_tuple=True)
    reused_k[b, h, slot] = slow.k[b, h, positions[b, h, slot]]
    reused_v[b, h, slot] = slow.v[b, h, positions[b, h, slot]]
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
    read from the slow tier. `pairs_read` counts the pairs read.
    """

    def __init__(self, slow: SlowTier, fetched_k: Tensor, fetched_v: Tensor, fetched_pos: Tensor,
                 fetched_valid: Tensor, kappa_pos: Tensor, kappa_valid: Tensor, executor: ThreadPoolExecutor,
                 reuse: bool):
        self.slow, self.executor, self.reuse = slow, executor, reuse
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
        self.pairs_read = 0

    def reset(self) -> None:
        """A new generation: nothing is held."""
        self.wait()
        self.held_valid.zero_()
        self.pairs_read = 0

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
        self.slow.wait_for_writes()
        if self.reuse:
            self.pairs_read += read_with_reuse(self.slow, self.host_positions, self.host_valid, self.held_positions,
                                               self.held_valid, self.staging_k, self.staging_v)
            self.held_positions.copy_(self.host_positions)
            self.held_valid.copy_(self.host_valid)
        else:
            gather_pairs(self.slow.k, self.host_positions, self.staging_k)
            gather_pairs(self.slow.v, self.host_positions, self.staging_v)
            self.pairs_read += int(self.host_valid.sum())
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.fetched_k.copy_(self.staging_k, non_blocking=True)
            self.fetched_v.copy_(self.staging_v, non_blocking=True)
            self.landed.record(self.stream)


@torch.compiler.disable
def fetch_now(slow: SlowTier, positions: Tensor, staging_k: Tensor, staging_v: Tensor) -> tuple[Tensor, Tensor]:
    """GPU: the pairs at `positions` (B, Hkv, K, on the GPU) from the slow tier in pinned host
    memory, now: the positions come down (which waits for the compute stream), the host gathers
    into pinned staging buffers (B, Hkv, K, D), and the pairs go up on the compute stream. Outside
    any compiled graph (torch.compile breaks the layer's graph here)."""
    host = positions.cpu()
    slow.wait_for_writes()
    gather_pairs(slow.k, host, staging_k)
    gather_pairs(slow.v, host, staging_v)
    return staging_k.to(positions.device, non_blocking=True), staging_v.to(positions.device, non_blocking=True)


@torch.compiler.disable
def copy_keys_to(slow: SlowTier, device: torch.device) -> Tensor:
    """The slow tier's keys, copied whole to the GPU (for the diagnostics only: it reads them all)."""
    slow.wait_for_writes()
    return slow.k.to(device)
