"""SpeCache's slow tier on disk, for CPU-only machines whose 16-bit cache outgrows RAM.

On a GPU the tiers are VRAM and host RAM, and the speculative prefetch hides a PCIe transfer. On a
CPU with `--slow_tier ram` both tiers are the same RAM and there is nothing to hide. Here the fast
tier is RAM and the slow tier is one file per layer, so the prefetch has a real latency to hide,
and a context whose 16-bit cache does not fit in memory can still be decoded.

- Layout: a layer's file is (B, T, Hkv, 2, D) in the pairs' dtype: one position's K and V for
  every KV head are contiguous, so a fetched position is one read (4 KiB on a Llama-3-8B shape:
  one page), and a position that several heads pick is read once. Per-head planes read as many
  pages for scattered positions and 8x more when heads agree (scripts/bench/bench_disk.py --layout).
- Reads: a gather of whole positions through a read-only memory map of the file, split over a
  pool of I/O threads (torch releases the GIL, so their page faults run side by side); positions
  in one page cost one fault, and MADV_RANDOM stops readahead around them. Each thread maps the
  file for its share of one read only, so the pages it touched do not stay in the process's
  resident memory. A layer's cold fetch took 0.67-0.8x the time of os.preadv over runs of adjacent
  positions from the same threads (scripts/bench/bench_disk.py --layout). A disk error while reading
  through a map is a SIGBUS, which ends the process; a filesystem that cannot map files is
  refused when the generation begins.
- Writes: `os.pwrite`, so a full disk is an OSError (through a map it would be a SIGBUS): the
  prompt's pairs at prefill, then each step's real row, after its layer.
- The speculative prefetch of kappa_{t+1} is queued right after layer l at step t and waited for
  just before layer l at step t + 1, when its pairs go into the layer's fast-tier slots. Pairs
  chosen within a step (the real row's picks; the non-speculative baseline) are read and waited
  for at once, outside any compiled graph. With `reuse`, a read skips the positions the previous
  read of its kind holds.
- Files live in a fresh folder `specache-<pid>-*` under the chosen directory (default /var/tmp,
  meant for big temporary files and on disk where /tmp is often RAM; a directory on tmpfs gets a
  warning), made when a generation begins and removed when it ends, on Ctrl-C, on an error, and at
  interpreter exit for one left open (generate.py turns SIGTERM and SIGHUP into an exit); two
  processes never share one. `kill -9` leaves it.
"""

import errno
import mmap
import os
import shutil
import tempfile
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, NoReturn, Optional

import torch
from torch import Tensor

from specache import Kappa, SlowTierError, TierSpec
from specache.tiers import held_match

# Reads in flight: this box's virtio disk did 12k random 4 KiB reads/s with one, about 50k with 16.
IO_THREADS = 16


def default_directory() -> str:
    """/var/tmp where it can be written, else the system's temp directory."""
    return "/var/tmp" if os.access("/var/tmp", os.W_OK | os.X_OK) else tempfile.gettempdir()


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path` (Linux: the longest mount point above it), or
    ''."""
    path, found = os.path.realpath(path), ("", "")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(
                    point
                ) >= len(found[0]):
                    found = (point, fields[2])
    except OSError:
        pass
    return found[1]


def _remove(live: dict) -> None:
    """Close the files and remove the folder in `live` (kept apart from DiskFolder, so that the
    interpreter's exit can run it for a folder nobody closed)."""
    for fd in live["fds"]:
        os.close(fd)
    live["fds"].clear()
    if live["path"] is not None:
        shutil.rmtree(live["path"], ignore_errors=True)
        live["path"] = None


class DiskFolder:
    """The folder of one generation's slow-tier files, shared by a SpeCache's layers (each a
    DiskTier), and the threads that read them."""

    def __init__(self, parent: Optional[str] = None):
        self.parent = str(parent) if parent else default_directory()
        self.tiers: list["DiskTier"] = []
        self.pools: dict[str, ThreadPoolExecutor] = {}
        self._live = {"path": None, "fds": []}
        weakref.finalize(self, _remove, self._live)

    @property
    def path(self) -> Optional[str]:
        return self._live["path"]

    def nbytes(self) -> int:
        return sum(tier.nbytes() for tier in self.tiers)

    def open(self) -> None:
        """A generation begins: a fresh folder, and an empty file per layer (sparse: the prompt and
        each step fill it)."""
        self.close()
        if not os.path.isdir(self.parent):
            raise SlowTierError(
                f"the slow tier's directory {self.parent} does not exist (--slow_tier_dir)"
            )
        filesystem = filesystem_type(self.parent)
        if filesystem in ("tmpfs", "ramfs"):
            warnings.warn(
                f"the slow tier's directory {self.parent} is on {filesystem}, which is RAM: give "
                "--slow_tier_dir on a disk",
                stacklevel=2,
            )
        try:
            self._live["path"] = tempfile.mkdtemp(
                prefix=f"specache-{os.getpid()}-", dir=self.parent
            )
            free = shutil.disk_usage(self.path).free
            if free < self.nbytes():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            for i, tier in enumerate(self.tiers):
                fd = os.open(
                    os.path.join(self.path, f"layer{i:03d}.kv"),
                    os.O_RDWR | os.O_CREAT | os.O_EXCL,
                    0o600,
                )
                self._live["fds"].append(fd)
                os.ftruncate(fd, tier.nbytes())
                tier.open(fd)
        except OSError as error:
            self.fail(error, "making")
        self.wake()

    def wake(self) -> None:
        """The reading threads, for a generation on these files (a new one, or one that continues
        a kept conversation)."""
        # One pool per kind of read: a read the step waits for must not queue behind prefetches
        # still in flight (in one pool it did: 1.6x slower cold at 64k than waiting for each
        # prefetch).
        self.pools = self.pools or {
            kind: ThreadPoolExecutor(IO_THREADS, thread_name_prefix=f"specache-disk-{kind}")
            for kind in ("prefetch", "picks")
        }

    def idle(self) -> None:
        """Between generations (a kept conversation): the reads in flight end, and so do the
        threads; the files stay."""
        for pool in self.pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        self.pools = {}

    def close(self) -> None:
        """The generation ended (or failed): wait for the reads in flight, remove the files."""
        self.idle()
        for tier in self.tiers:
            tier.fd = None
        _remove(self._live)

    def fail(self, error: OSError, doing: str) -> NoReturn:
        """Remove the files and raise one clear SlowTierError for `error`."""
        where = self.path or self.parent
        self.close()
        if error.errno == errno.ENODEV:
            message = (
                f"the filesystem of {self.parent} cannot memory-map files, which the disk tier "
                "reads "
                "through; give --slow_tier_dir on a local disk"
            )
        elif error.errno == errno.ENOSPC:
            message = (
                f"no space left for SpeCache's slow tier in {self.parent}: it needs "
                f"{self.nbytes() / 1e9:.2f} GB at this capacity; free some, or give "
                "--slow_tier_dir on a "
                "disk with room"
            )
        else:
            message = f"{doing} SpeCache's slow tier in {where} failed: {error.strerror or error}"
        raise SlowTierError(message + " (its files were removed)") from error

    def drop_page_cache(self) -> None:
        """Write every file's dirty pages out and drop its pages from the page cache (the bench's
        cold case: the next reads come from the disk)."""
        for tier in self.tiers:
            os.fdatasync(tier.fd)
            os.posix_fadvise(tier.fd, 0, 0, os.POSIX_FADV_DONTNEED)


class PendingRead(NamedTuple):
    """Reads in flight for the pairs at `positions` (B, Hkv, K) where `valid`: per sequence, the
    sorted positions read and their staging buffer (N, Hkv, 2, D), or None; which pairs come from
    the previous read of this kind (`reused`, at `source`) instead."""

    positions: Tensor
    valid: Tensor
    staged: list[Optional[tuple[Tensor, Tensor]]]
    futures: list[Future]
    reused: Tensor
    source: Optional[Tensor]
    held: Optional[tuple]


def _gather(tier: "DiskTier", rows: Tensor, out: Tensor) -> None:
    """One I/O thread's share of a read: `rows` of the file into `out`, through a map of its own
    that goes when this returns, so the pages it touched leave the process's resident memory at
    once (a fault maps the whole page-cache folio around a position, up to ~170 KiB here)."""
    torch.index_select(tier.mapped(), 0, rows, out=out)


class DiskTier:
    """A specache.SlowTier: the complete 16-bit K and V of one layer (TierSpec.shape (B, Hkv, T,
    D)) in a file of `folder`."""

    gathered_in_step = False

    def __init__(self, spec: TierSpec, folder: DiskFolder):
        self.batch, self.n_kv_heads, self.capacity, self.head_dim = spec.shape
        self.spec, self.dtype, self.folder, self.reuse = spec, spec.dtype, folder, spec.reuse
        self.position_bytes = self.n_kv_heads * 2 * self.head_dim * spec.dtype.itemsize
        self.fd: Optional[int] = None
        self.pending: Optional[PendingRead] = None
        self.held: dict[str, Optional[tuple]] = {"prefetch": None, "picks": None}
        self.bytes_read = 0
        folder.tiers.append(self)

    def open(self, fd: int) -> None:
        self.fd = fd
        # torch warns, once per process, that the map is read-only: it is meant to be
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # and a filesystem that cannot map files fails here, when the generation begins
            self.mapped()

    def mapped(self) -> Tensor:
        """The file as (B x T, Hkv, 2, D), through a fresh read-only map (shared with the page
        cache;
        a private writable one would be charged against the memory the kernel commits)."""
        mapping = mmap.mmap(self.fd, self.nbytes(), access=mmap.ACCESS_READ)
        mapping.madvise(mmap.MADV_RANDOM)  # no readahead around scattered positions
        return torch.frombuffer(mapping, dtype=self.dtype).view(
            -1, self.n_kv_heads, 2, self.head_dim
        )

    def reset(self, rows: Optional[list[int]] = None) -> None:
        """A generation begins (on `rows`): nothing in flight, nothing held (a read holds the
        whole batch's pairs, so a row's reset forgets them all)."""
        self.pending = None
        self.held = dict.fromkeys(self.held)
        if rows is None:
            self.bytes_read = 0

    def nbytes(self) -> int:
        return self.batch * self.capacity * self.position_bytes

    # --- writes --------------------------------------------------------------------------------

    def write(self, b: int, start: int, k: Tensor, v: Tensor) -> None:
        """Pairs k, v (Hkv, N, D) of sequence b at positions [start, start + N)."""
        pairs = torch.stack((k, v), 2).transpose(0, 1).to(self.dtype).contiguous()  # (N, Hkv, 2, D)
        data = memoryview(pairs.view(-1).view(torch.uint8).numpy())
        offset = (b * self.capacity + start) * self.position_bytes
        try:
            while data:
                n = os.pwrite(self.fd, data, offset)
                data, offset = data[n:], offset + n
        except OSError as error:
            self.folder.fail(error, "writing")

    # --- reads ---------------------------------------------------------------------------------

    def start_read(self, positions: Tensor, valid: Tensor, kind: str) -> PendingRead:
        """Queue the reads of the valid pairs at `positions` (B, Hkv, K) that the previous read of
        `kind` ("prefetch" or "picks") does not hold: per sequence, each position once, adjacent
        positions in one read, spread over the I/O threads."""
        positions, valid = positions.clone(), valid.clone()
        reused, source = torch.zeros_like(valid), None
        held = self.held[kind] if self.reuse else None
        if held is not None and held[0].shape == positions.shape:
            reused, source = held_match(positions, valid, held[0], held[1])
        need = valid & ~reused
        staged, futures = [], []
        for b in range(self.batch):
            wanted = torch.unique(positions[b][need[b]])  # sorted
            if wanted.numel() == 0:
                staged.append(None)
                continue
            staging = torch.empty(
                wanted.numel(), self.n_kv_heads, 2, self.head_dim, dtype=self.dtype
            )
            jobs = min(IO_THREADS, wanted.numel())
            futures += [
                self.folder.pools[kind].submit(_gather, self, rows, out)
                for rows, out in zip((wanted + b * self.capacity).chunk(jobs), staging.chunk(jobs))
            ]
            staged.append((wanted, staging))
            self.bytes_read += wanted.numel() * self.position_bytes
        return PendingRead(positions, valid, staged, futures, reused, source, held)

    def finish_read(self, pending: PendingRead, kind: str) -> tuple[Tensor, Tensor]:
        """Wait for `pending`'s reads: the pairs k, v (B, Hkv, K, D) at its positions, zeros where a
        position is not valid (the attention weighs those slots by exactly 0, and 0 x NaN would
        still be NaN)."""
        try:
            for future in pending.futures:
                future.result()
        except OSError as error:
            self.folder.fail(error, "reading")
        shape = (*pending.positions.shape, self.head_dim)
        k, v = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
        if pending.source is not None:
            index = pending.source.unsqueeze(-1).expand(shape)
            keep = pending.reused.unsqueeze(-1)
            k = torch.where(keep, pending.held[2].gather(2, index), k)
            v = torch.where(keep, pending.held[3].gather(2, index), v)
        heads = torch.arange(self.n_kv_heads).unsqueeze(-1)
        for b, entry in enumerate(pending.staged):
            if entry is None:
                continue
            wanted, staging = entry
            # (Hkv, K)
            row = torch.searchsorted(wanted, pending.positions[b]).clamp_(max=wanted.numel() - 1)
            read = (pending.valid[b] & ~pending.reused[b]).unsqueeze(-1)
            pairs = staging[row, heads]  # (Hkv, K, 2, D)
            k[b] = torch.where(read, pairs[:, :, 0], k[b])
            v[b] = torch.where(read, pairs[:, :, 1], v[b])
        self.held[kind] = (pending.positions, pending.valid, k, v)
        return k, v

    def read(self, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """In the step: the pairs at positions (B, Hkv, K), read and waited for now."""
        return read_now(self, positions, valid)

    def read_range(
        self, first: int, last: int, rows: Optional[list[int]] = None
    ) -> tuple[Tensor, Tensor]:
        """Every sequence's pairs at positions [first, last), (B, Hkv, last - first, D) each (or
        those of the sequences on `rows`): one sequential read per sequence (a prefill on top of
        what the cache holds reads its history so; the map's reads would go a page at a time,
        without readahead)."""
        sequences = range(self.batch) if rows is None else rows
        pairs = torch.empty(
            len(sequences), last - first, self.n_kv_heads, 2, self.head_dim, dtype=self.dtype
        )
        try:
            for i, b in enumerate(sequences):
                view, offset = (
                    memoryview(pairs[i].view(-1).view(torch.uint8).numpy()),
                    (b * self.capacity + first) * self.position_bytes,
                )
                while view:
                    n = os.preadv(self.fd, [view], offset)
                    if n == 0:
                        raise OSError(errno.EIO, "the slow tier's file ended early")
                    view, offset = view[n:], offset + n
        except OSError as error:
            self.folder.fail(error, "reading")
        pairs = pairs.permute(3, 0, 2, 1, 4)  # (2, B, Hkv, N, D)
        return pairs[0], pairs[1]

    def keys(self) -> Tensor:
        """Every key (B, Hkv, T, D), read whole (for the diagnostics only)."""
        return read_all_keys(self)

    # --- the hand-offs around a layer's pass ------------------------------------------------------

    def before_step(self) -> None:
        land(self)

    def after_step(
        self, new_k: Optional[Tensor], new_v: Optional[Tensor], kappa: Optional[Kappa]
    ) -> None:
        leave_layer(self, new_k, new_v, kappa)


@torch.compiler.disable
def land(tier: DiskTier) -> None:
    """kappa_t's pairs land in the layer's prefetch slots."""
    pending, tier.pending = tier.pending, None
    if pending is None or tier.fd is None:
        return
    k, v = tier.finish_read(pending, "prefetch")
    slots = tier.spec.slots
    slots.k[:, :, slots.where] = k
    slots.v[:, :, slots.where] = v
    slots.pos[:, :, slots.where] = pending.positions
    slots.valid[:, :, slots.where] = pending.valid


@torch.compiler.disable
def leave_layer(
    tier: DiskTier, new_k: Optional[Tensor], new_v: Optional[Tensor], kappa: Optional[Kappa]
) -> None:
    """After the layer's pass: the real rows' pairs are written; the reads of kappa_{t+1} are
    queued (and without overlap, waited for)."""
    if new_k is not None:
        for b, position in enumerate(tier.spec.state.held()):  # next_position, on the host
            tier.write(b, position, new_k[b, :, None], new_v[b, :, None])
    if kappa is not None:
        tier.pending = tier.start_read(kappa.pos, kappa.valid, "prefetch")
        if not tier.spec.overlap:
            land(tier)


@torch.compiler.disable
def read_now(tier: DiskTier, positions: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    return tier.finish_read(tier.start_read(positions, valid, "picks"), "picks")


@torch.compiler.disable
def read_all_keys(tier: DiskTier) -> Tensor:
    keys = tier.mapped()[:, :, 0].reshape(tier.batch, tier.capacity, tier.n_kv_heads, tier.head_dim)
    return keys.transpose(1, 2).clone()
