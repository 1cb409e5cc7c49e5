"""What all of a cache's layers share: each sequence's lengths, and what the next pass is."""

from typing import Optional

import torch
from torch import Tensor

from specache.config import SpeCacheConfig, fast_tier_plan

# What the layers' next pass is: the prompt (or a chunk of it), the bootstrap (T1 alone, nothing
# kept), or a decode step (the real row kept)
PREFILL, BOOTSTRAP, DECODE = "prefill", "bootstrap", "decode"


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
        self.every_row = torch.arange(batch_size, device=device)

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

    def at_moved(self, *per_row: Tensor) -> tuple[Tensor, ...]:
        """The rows a step moves (all, or those of a pass of some rows), and each of `per_row`
        (B, ...) at those rows."""
        if self.rows_index is None:  # as they are: no index op per tensor in an eager step
            return (self.every_row, *per_row)
        return (self.rows_index, *(x[self.rows_index] for x in per_row))

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
