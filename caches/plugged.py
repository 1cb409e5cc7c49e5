"""SpeCache (the package specache/) plugged into model.py's Transformer: its layers in every
full-attention layer, a 16-bit ring in each sliding-window one, its slow tier in RAM or on disk
(disk_tier.py), its accounting and diagnostics from stats.py."""

from dataclasses import replace
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor

from caches.disk_tier import DiskFolder, DiskTier
from caches.stats import Diagnostics, cache_stats, step_bytes
from model import RingKVCache, Transformer
import specache.kernels
import specache.rows
from specache import SpeCache, SpeCacheConfig


def accelerate_specache() -> None:
    """SpeCache's ops run on the package's C kernels (CPUs) and Triton kernels (GPUs) where those
    build: registered once per process, before anything compiles a step."""
    specache.kernels.register()


class PluggedSpeCache(SpeCache):
    """specache.SpeCache in every full-attention layer of `model` (a 16-bit ring in the fast tier
    in each sliding-window layer), for `batch_size` sequences of up to `max_seq_length` positions,
    the kernels registered. `slow_tier`: "ram", or "disk" (CPUs only: a file per layer in a fresh
    folder under `slow_tier_dir`, disk_tier.py). `probe`: diagnostics (stats.py)."""

    chunks = True  # a prompt's chunk reads its history from the slow tier (KIVI: the low-bit copy)

    def __init__(
        self,
        model: Transformer,
        batch_size: int,
        max_seq_length: int,
        config: SpeCacheConfig,
        slow_tier: str = "ram",
        slow_tier_dir: Optional[str] = None,
        probe: Optional[Diagnostics] = None,
    ):
        c, layers = model.config, model.layers
        if all(layer.attention.window is not None for layer in layers):
            raise ValueError(
                "every layer of this model attends over a sliding window only, which "
                "stays in the fast tier whole: SpeCache has nothing to offload; use "
                "the full cache"
            )
        device, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
        if slow_tier not in ("ram", "disk"):
            raise ValueError(f"the slow tier is ram or disk, got {slow_tier!r}")
        if slow_tier == "disk" and device.type != "cpu":
            raise ValueError(
                "--slow_tier disk is for CPU-only machines: beside a GPU the slow tier is host RAM"
            )
        self.folder = DiskFolder(slow_tier_dir) if slow_tier == "disk" else None
        if self.folder is not None:
            disk = partial(DiskTier, folder=self.folder)
            config = replace(config, placement=replace(config.placement, slow_tier=disk))
        accelerate_specache()
        full = sum(layer.attention.window is None for layer in layers)
        super().__init__(
            config,
            full,
            c.n_head,
            c.n_local_heads,
            c.head_dim,
            batch_size,
            max_seq_length,
            device,
            dtype,
            probe,
        )
        ours = iter(self.layers)
        for layer in layers:
            window = layer.attention.window
            layer.attention.kv_cache = (
                next(ours)
                if window is None
                else RingKVCache(
                    batch_size, window, c.n_local_heads, c.head_dim, self.pair_dtype, device
                )
            )
        self.rings = [
            layer.attention.kv_cache
            for layer in layers
            if isinstance(layer.attention.kv_cache, RingKVCache)
        ]
        model.setup_rope(self.capacity + 1)  # the speculative row sits one past the last real one
        model.max_batch_size, model.max_seq_length = batch_size, self.capacity
        self.model = model
        # In a CPU's RAM the tiers move pairs inside each layer's step, and a step is one compiled
        # pass of the model; beside a GPU and from the disk, pairs move in the background, handed
        # over at graph breaks around each layer.
        self.whole_step = device.type == "cpu" and slow_tier == "ram"
        self.graph_breaks = not self.whole_step
        # sequences that come and go may share this cache, a row each (specache's "rows"),
        # where its slow tier is host RAM (a CPU's, or pinned beside a GPU; the disk tier is a
        # folder of files per cache), every layer is SpeCache's, and nothing watches
        self.shares_rows = slow_tier == "ram" and not self.rings and probe is None

    def row_cache(self, index: int) -> "SpeCacheRow":
        """The cache methods of the sequence on row `index`."""
        return SpeCacheRow(self, index)

    def row(self, index: int) -> list[torch.nn.Module]:
        """Row `index`'s module for each layer, for its prompt's chunks and its bootstrap."""
        return SpeCacheRow(self, index).layers()

    def decode_steps(self, rows: list[int]) -> list[Callable[..., Tensor]]:
        """For each layer, the attention of one pass's decode steps of the sequences on `rows`
        (their rows first in the pass, in this order): `step_on_rows`."""
        specache.rows.move_rows(self, rows)
        return [partial(specache.rows.step_on_rows, layer) for layer in self.layers]

    def save_row(self, index: int, n: int) -> list[Tensor]:
        """What row `index` holds, its n tokens, copied out to host RAM."""
        return SpeCacheRow(self, index).save(n)

    def restore_row(self, index: int, saved: list[Tensor]) -> None:
        """`save_row`'s copy into row `index`."""
        SpeCacheRow(self, index).restore(saved)

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        if held and self.folder is not None and self.folder.path is None:
            raise ValueError(
                "the slow tier's files went with the last generation (finish without keep)"
            )
        if self.folder is not None and held:
            self.folder.wake()  # the kept conversation's files, read by new threads
        elif self.folder is not None:
            self.folder.open()  # a fresh folder of empty files
        super().begin(tokens, lengths, held)

    def ingest(self, recorded: list[tuple[Tensor, Tensor, Optional[list[Tensor]]]]) -> None:
        """Each layer's prompt K, V from a prefill done elsewhere (scripts/eval/harness.py), after
        `begin`."""
        lengths = torch.tensor(self.state.held(), device=self.device)
        for layer, (k, v, _) in zip(self.model.layers, recorded):
            cache = layer.attention.kv_cache
            if isinstance(cache, RingKVCache):
                cache.ingest_prompt(k, v, lengths)
            else:
                cache.ingest_prompt(k, v)

    def finish(self, keep: bool = False) -> None:
        """The generation ended, or failed: the last prefetch has landed; the disk's files go
        unless `keep`."""
        try:
            super().finish(keep)
        finally:
            if self.folder is not None and keep:
                self.folder.idle()  # the files stay for the next turn; the threads go
            elif self.folder is not None:
                self.folder.close()

    def step_bytes(self, positions: list[int]) -> int:
        return step_bytes(self, positions)

    def stats(self, steps: int) -> dict:
        return cache_stats(self, steps)


class SpeCacheRow(specache.SpeCacheRow):
    """A cache's methods (as the module docstring lists them) for the sequence on row `index` of a
    PluggedSpeCache that sequences share a row each (specache/rows.py)."""

    chunks = True

    def stats(self, steps: int) -> dict:
        return cache_stats(self.cache, steps, row=self.b)
