"""Rows: one cache for sequences that come and go (a server's continuous batching).

A server that batches continuously runs sequences that join and leave at their own times. Here
they share one `SpeCache`, a row each. A row begins, prefills, bootstraps and is kept on its own
(`SpeCacheRow`, which drives like a `SpeCache` of one sequence), and one pass steps every decoding
row together (`move_rows`, then each layer's `step_on_rows`) while other rows take prompt chunks in
the same pass (`SpeCacheRow.layers`).

A row the step does not move holds nothing as the step sees it (the state's lengths are 0 there
on the device), so it costs the kernels next to nothing, and the step writes nothing of it
(`SpeCacheState.write_moved`, and the slow tier takes the moved rows' real rows only). Its
prefetch slots are filled again from its kappa, which the step left as it was: the pairs they
hold already. A kept row is copied out of the tiers to host RAM and back into a row reset anew
(`SpeCacheRow.save`, `SpeCacheRow.restore`), once the moves in the background have landed.
"""

from typing import Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from specache.cache import SpeCache
from specache.layer import SpeCacheLayer
from specache.state import BOOTSTRAP, DECODE, PREFILL


def move_rows(cache: SpeCache, rows: list[int]) -> None:
    """The next pass steps `rows` (in this order, each in its phase): the device's lengths follow
    (those of the other rows are 0)."""
    cache.state.rows = rows
    cache.state.rows_index = torch.tensor(rows, device=cache.device)
    cache.state.sync()


def step_on_rows(
    layer: SpeCacheLayer, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor
) -> Tensor:
    """A step of the rows the state moves (`state.rows`, whose phase says whether the real rows
    are kept): q (1, H, n S, D) and k, v (1, Hkv, n S, D) are their rows, S a sequence, one
    sequence after another in the order of `state.rows`. Every row of the cache takes the step,
    the others with no query and nothing to attend, and are left as they were. The output (1, H,
    n S, D); `input_pos` is not read."""
    state, batch = layer.state, layer.fetched_k.shape[0]
    at, n = state.rows_index, len(state.rows)

    def on_every_row(x: Tensor) -> Tensor:  # (1, h, n S, D) -> (B, h, S, D), zeros elsewhere
        every = x.new_zeros(batch, x.shape[1], x.shape[2] // n, x.shape[3])
        every[at] = x[0].unflatten(1, (n, -1)).transpose(0, 1)
        return every

    layer.tier.before_step()
    keep = state.row_phase[state.rows[0]] == DECODE
    out = layer.step(on_every_row(q), on_every_row(k), on_every_row(v), keep)
    return out[at].transpose(0, 1).flatten(1, 2).unsqueeze(0)


class RowOfLayer(nn.Module):
    """Row b of a layer, plugged into the host's attention layer for that row's prompt chunks and
    its bootstrap; its decode steps go with the other rows' (`step_on_rows`)."""

    def __init__(self, layer: SpeCacheLayer, b: int):
        super().__init__()
        self.layer, self.b = layer, b

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask=None) -> Tensor:
        if self.layer.state.row_phase[self.b] == PREFILL:
            return self.layer.prefill(q, k, v, int(input_pos[0, 0]), rows=[self.b])
        return step_on_rows(self.layer, q, k, v, input_pos)


def settle(cache: SpeCache) -> None:
    """Every move in the background has landed: the prefetches, and beside a GPU the copies of
    real rows to the host's slow tier (on a side stream), so the host reads and writes the tiers
    itself."""
    for layer in cache.layers:
        layer.tier.before_step()
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


def row_parts(cache: SpeCache, layer: SpeCacheLayer, n: int) -> list[tuple[Tensor, int]]:
    """A layer's per-row buffers, each with how far a row that holds n tokens fills it."""
    lq, r = cache.state.split(n)
    groups = lq // cache.config.method.group
    means = [(layer.v_mean, groups)] if cache.config.method.arithmetic == "sparse" else []
    return means + [
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


class SpeCacheRow:
    """Row b of `cache`: `SpeCache`'s driver methods for the one sequence on that row, with the
    same signatures (its tensors have a batch of 1), so a host's loop drives a row as it drives a
    cache; its decode steps run in one pass with the other rows' (`move_rows`, `step_on_rows`)."""

    def __init__(self, cache: SpeCache, b: int):
        self.cache, self.b = cache, b
        # the speculative row's logits and the guess they were run beside, between `stepped` and
        # `sampled`
        self.guessed: Optional[tuple[Tensor, Tensor]] = None

    def layers(self) -> list[nn.Module]:
        """The row's module for each layer: plugged in for its prompt's chunks and its
        bootstrap."""
        return [RowOfLayer(layer, self.b) for layer in self.cache.layers]

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        """`SpeCache.begin` for the row: its prompt `tokens` (1, S, right-padded to lengths[0]),
        on top of the `held` tokens the row holds already (`restore`)."""
        cache, b = self.cache, self.b
        tokens = tokens[:, : int(lengths[0])]
        state, n = cache.state, held + tokens.shape[1]
        if held and state.held()[b] != held:
            raise ValueError(f"row {b} holds {state.held()[b]} tokens, not {held}")
        state.host_quantized_len[b], state.host_window_len[b] = state.split(n)
        state.row_phase[b] = PREFILL
        for layer in cache.layers:
            layer.reset([b])
        if not held:
            cache.token_history[b] = 0
        cache.token_history[b, held:n] = tokens[0]
        cache.history_len[b] = n
        cache.matches[b] = 0

    def bootstrap(
        self, forward: Callable[[Tensor, Tensor], Tensor], first: Tensor, positions: Tensor
    ) -> None:
        """`SpeCache.bootstrap` of the row: `forward` runs the model with `layers()` plugged in."""
        cache, b = self.cache, self.b
        if cache.speculative:
            cache.state.row_phase[b] = BOOTSTRAP
            move_rows(cache, [b])
            with torch.compiler.set_stance("force_eager"):
                logits = forward(first, positions)
            history = cache.token_history[b : b + 1], cache.history_len[b : b + 1]
            cache.guess[b] = cache.guess_next(logits[:, -1], *history)[0]

    def step_rows(self, token: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """`SpeCache.step_rows` of the row: the rows (1, S) its sequence adds to the next decode
        pass."""
        cache = self.cache
        cache.state.row_phase[self.b] = DECODE
        if not cache.speculative:
            return token, positions
        guess = cache.guess[self.b : self.b + 1]
        return torch.cat([token, guess], 1), torch.cat([positions, positions + 1], 1)

    def stepped(self, logits: Tensor) -> Tensor:
        """`SpeCache.stepped` of the row, its logits (1, S, V) from the pass: the real row's (1, 1,
        V)."""
        cache, b = self.cache, self.b
        if cache.speculative:
            self.guessed = logits[:, 1], cache.guess[b : b + 1].clone()
        cache.state.host_window_len[b] += 1  # the device's follow at the next `move_rows`
        cache.flush_if_full(b)
        return logits[:, :1]

    def sampled(self, token: Tensor) -> None:
        """`SpeCache.sampled` of the row: its real token (1, 1)."""
        cache, b = self.cache, self.b
        cache.token_history[b, cache.history_len[b]] = token[0, 0]
        cache.history_len[b] += 1
        if self.guessed is not None:
            (guessed_from, guess), self.guessed = self.guessed, None
            cache.matches[b] += (guess == token).sum()
            history = cache.token_history[b : b + 1], cache.history_len[b : b + 1]
            cache.guess[b] = cache.guess_next(guessed_from, *history)[0]

    def finish(self, keep: bool = False) -> None:
        """Nothing to wait for: a prefetch in flight lands at the next step, or before the tiers
        are read or reset."""

    def save(self, n: int) -> list[Tensor]:
        """What the row holds, its n tokens, copied out (a kept conversation, whose row then
        serves another sequence): the tokens, and each layer's low-bit copy, window, sinks and
        slow tier up to them, so a copy costs what it holds, in host RAM."""
        cache, b = self.cache, self.b
        if n != cache.state.held()[b]:
            raise ValueError(f"row {b} holds {cache.state.held()[b]} tokens, not {n}")
        settle(cache)
        saved = [cache.token_history[b, :n].to("cpu", copy=True)]
        for layer in cache.layers:  # to host RAM, whatever device a buffer is on
            saved += [
                buffer[b, :, :end].to("cpu", copy=True)
                for buffer, end in row_parts(cache, layer, n)
            ]
        return saved

    def restore(self, saved: list[Tensor]) -> None:
        """`save`'s copy into the row, which then holds what the saved row held."""
        cache, b = self.cache, self.b
        history, *parts = saved
        n = history.shape[0]
        settle(cache)  # no copy in flight may land on the row afterwards
        for layer in cache.layers:  # nothing fetched or chosen for it: it begins anew
            layer.reset([b])
        cache.token_history[b, :n] = history
        cache.state.host_quantized_len[b], cache.state.host_window_len[b] = cache.state.split(n)
        parts = iter(parts)
        for layer in cache.layers:
            for (buffer, end), part in zip(row_parts(cache, layer, n), parts):
                buffer[b, :, :end] = part
