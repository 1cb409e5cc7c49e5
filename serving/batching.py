"""Continuous batching (serve.py's engine): sequences join a running batch and leave it at pass
boundaries, and a conversation's cache can be kept for its next turn.

Each turn the engine runs the model once over every sequence that has work: one decode step's
rows of each decoding sequence and the next prompt chunk (`prefill_chunk`) of joining ones, packed
one after another in one pass, so the weights are read once per turn and a joining prompt costs the
running answers one slower turn, not a pause (chunked prefill beside decode, as Sarathi-Serve and
vLLM schedule it). In each layer, `Packed` hands each sequence's run of rows to its cache with its
own mask.

Where do the caches live? The full cache, and SpeCache with its slow tier in host RAM (a CPU's, or
pinned beside a GPU), are one cache set up for `max_batch_size` sequences, shared by the sequences
a row each (`shares_rows`): a pass's decode steps then attend in one call per layer for every
decoding sequence (the cache's `decode_steps`: caches.full.decode_on_rows, specache/rows.py), where
a cache per sequence would take one call per sequence and layer; a prompt chunk goes to its
sequence's row (the cache's `row`). Other caches (SpeCache's disk tier; eviction; a model with
sliding-window rings) give each sequence a cache of its own.

A sequence leaves as soon as its answer is complete. Its cache (or row) then serves the next one,
or, when the request allows it, goes into the kept conversations (`KeptConversations`; a row is
copied out first, `SavedRow`): a later request whose tokens extend what that cache holds continues
it and prefills only its new tokens, as chat.py does.

A sequence decodes exactly as `generation.generate` decodes it alone (the same prefill chunks,
bootstrap and steps), so greedy answers equal generate.py's; sampling draws from the sequence's own
generator, so a seeded request gives the same answer alone or beside others.
"""

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
from torch import Tensor

from generation import prefill_rows, sample
from model import Mask, Transformer

PREFILL_CHUNK = 256  # serve.py's --prefill_chunk default: a turn beside running answers stays short


class Packed(nn.Module):
    """One layer's attention over several sequences' rows in one pass: the pass's rows (1, N) are
    the sequences' rows one after another. With `decode` (a shared cache's attention of the decode
    steps that come first in the pass, and how many rows they take: its `decode_steps`), those go
    to it together. Then the i-th run of `rows[i]` goes to `members[i]` (that sequence's cache
    module) with `masks[i]`: None for a decode step's rows, a CausalPrompt for a prompt chunk's.
    The mask the model passes is not read."""

    def __init__(
        self,
        members: list[nn.Module],
        rows: list[int],
        masks: list[Mask],
        decode: Optional[tuple[Callable[..., Tensor], int]] = None,
    ):
        super().__init__()
        self.members = members  # a plain list: the modules belong to their caches, not to this
        self.rows, self.masks, self.decode = rows, masks, decode

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask: Mask) -> Tensor:
        out, first = [], 0
        if self.decode is not None:
            attend, first = self.decode
            part = slice(0, first)
            out.append(attend(q[:, :, part], k[:, :, part], v[:, :, part], input_pos[:, part]))
        for member, n, own in zip(self.members, self.rows, self.masks):
            part = slice(first, first + n)
            out.append(member(q[:, :, part], k[:, :, part], v[:, :, part], input_pos[:, part], own))
            first += n
        return torch.cat(out, 2)


def plug(model: Transformer, modules: list[nn.Module]) -> None:
    """Put one cache's per-layer modules (or `Packed`s) into the model's attention layers."""
    for layer, module in zip(model.layers, modules):
        layer.attention.kv_cache = module


@dataclass
class Slot:
    """A cache for one sequence and the modules it plugs into the model's layers: a cache of its
    own, or `row` of the engine's shared cache (then `cache` is the shared one)."""

    cache: Any
    modules: list[nn.Module]
    ids: list[int] = field(default_factory=list)  # the tokens the cache holds (a kept one)
    row: Optional[int] = None

    def nbytes(self) -> int:
        """The bytes this cache holds, as allocated (its capacity, not its length): every layer's
        buffers, and a SpeCache's slow tier, in RAM or in files on disk."""
        total = sum(b.nbytes for module in self.modules for b in module.buffers())
        for layer in getattr(self.cache, "layers", []):
            tier = getattr(layer, "tier", None)
            total += tier.nbytes() if tier is not None else 0
        return total


@dataclass
class SavedRow:
    """A finished conversation's row of the shared cache, copied out so that the row serves the
    next sequence (the cache's `save_row`: what it holds of len(ids) tokens). It goes back into a
    free row when the conversation goes on, and costs what it holds, not a row's capacity."""

    ids: list[int]
    saved: list[Tensor]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.saved)


Kept = Union[Slot, SavedRow]


class KeptConversations:
    """Caches (or saved rows) of finished requests, least recently used first out, up to `budget`
    bytes (RAM, and a disk tier's files)."""

    def __init__(self, budget: int, release: Callable[[Kept], None]):
        self.budget, self.release = budget, release
        self.slots: OrderedDict[int, Kept] = OrderedDict()  # by id(slot), oldest first
        self.bytes = 0  # theirs, as allocated (an int, which /health reads from another thread)

    def keep(self, slot: Kept) -> None:
        if self.budget <= 0 or slot.nbytes() > self.budget:
            return self.release(slot)
        self.slots[id(slot)] = slot
        self.bytes += slot.nbytes()
        while self.bytes > self.budget:
            self.release(self._leave(next(iter(self.slots))))

    def take(self, prompt: list[int]) -> Optional[Kept]:
        """The kept cache whose tokens the prompt extends, token for token (the longest such); it
        leaves the kept ones."""
        best = None
        for slot in self.slots.values():
            n = len(slot.ids)
            if n < len(prompt) and prompt[:n] == slot.ids and (best is None or n > len(best.ids)):
                best = slot
        return best if best is None else self._leave(id(best))

    def clear(self) -> None:
        while self.slots:
            self.release(self._leave(next(iter(self.slots))))

    def _leave(self, key: int) -> Kept:
        slot = self.slots.pop(key)
        self.bytes -= slot.nbytes()
        return slot


@dataclass
class Sequence:
    """A request in the batch: its cache, the new tokens its prefill takes, where it stands."""

    job: Any  # serve.Job: prompt_ids, max_tokens, sampling, keep, feed, finish, fail, finished
    slot: Slot
    held: int  # tokens the cache held when it joined (a kept conversation's)
    generator: Optional[torch.Generator]
    tokens: Tensor  # the prompt's tokens past `held` (1, S)
    prefilled: int = 0
    token: Optional[Tensor] = None  # the last sampled token (1, 1), not yet in the cache
    pos: Optional[Tensor] = None  # its position (1, 1)
    sampled: list[int] = field(default_factory=list)
    steps: int = 0
    passed_over: int = 0  # times another joining sequence was prefilled before this one

    def sample(self, logits: Tensor) -> Tensor:
        temperature, top_k, _ = self.job.sampling
        return sample(logits, temperature, top_k, generator=self.generator)


class QueueFull(Exception):
    pass


class Engine:
    """The worker thread that owns the model: a queue of jobs, the sequences joining (prefilling)
    and decoding, the free caches (or rows of the shared cache), and the kept conversations.
    `make_cache(n)` sets up a cache for n sequences in the model.

    Each turn of its loop admits waiting jobs while fewer than `max_batch_size` run, then runs one
    pass: a decode step of every decoding sequence and the next prompt chunks of joining ones, up
    to `prefill_chunk` prompt tokens (`_to_prefill` chooses)."""

    def __init__(
        self,
        model: Transformer,
        make_cache: Callable[[int], Any],
        capacity: int,
        max_batch_size: int = 8,
        max_queue: int = 64,
        prefill_chunk: Optional[int] = None,
        keep_bytes: int = 0,
        static: bool = False,
    ):
        self.model, self.make_cache, self.capacity = model, make_cache, capacity
        # static: jobs join only an empty batch (the baseline continuous batching beats)
        self.static, self.max_batch_size, self.max_queue = static, max_batch_size, max_queue
        self.pending: deque = deque()
        self.ready = threading.Condition()
        self.joining: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []
        self.free: list[Slot] = []
        self.kept = KeptConversations(keep_bytes, self._let_go)
        probe = self._new_slot()  # a bad cache setting fails here, before anything is served
        self.chunks = probe.cache.chunks  # whether prompts may go in chunks, on top of a history
        self.prefill_chunk = prefill_chunk if self.chunks else None
        self.shared = None  # one cache for every sequence, a row each, where its kind allows it
        if getattr(probe.cache, "shares_rows", False):
            self.shared = make_cache(max_batch_size)
            self.free = [
                Slot(self.shared.row_cache(r), self.shared.row(r), row=r)
                for r in range(max_batch_size)
            ]
        else:
            self.free.append(probe)
        # what /health reports; written by the worker only
        self.started = time.monotonic()
        self.finished_jobs, self.tokens_generated, self.prompt_tokens_reused = 0, 0, 0
        self.busy_seconds = 0.0
        # how full the batch runs: passes that hold a prompt chunk cost as much in any batching,
        # and a step of many sequences reads the weights once for all of them
        self.prompt_pass_seconds = 0.0
        self.decode_steps, self.decode_step_sequences = 0, 0
        self.first_token_seconds: deque[float] = deque(maxlen=256)  # the latest requests'
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="decode", daemon=True)

    # --- the queue -------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """The server stops: the worker ends after its current turn, and every cache goes (a disk
        tier's files with it)."""
        with self.ready:
            self.closing = True
            self.ready.notify()
        self.thread.join(timeout=60)
        for seq in [*self.joining, *self.decoding]:
            seq.job.fail("the server stopped")
            self._drop(seq)
        self.kept.clear()
        for slot in self.free:
            slot.cache.finish()
        if self.shared is not None:
            self.shared.finish()  # its last moves in the background land
        self.free.clear()

    def submit(self, job) -> None:
        with self.ready:
            if len(self.pending) >= self.max_queue:
                raise QueueFull
            job.submitted = time.monotonic()
            self.pending.append(job)
            self.ready.notify()

    def running(self) -> int:
        return len(self.joining) + len(self.decoding)

    def _admit(self) -> None:
        """Jobs join while there is room; with nothing to do, wait for one."""
        with self.ready:
            while not self.pending and not self.running() and not self.closing:
                self.ready.wait()
            if (self.static and self.running()) or self.closing:
                return
            while self.pending and self.running() < self.max_batch_size:
                job = self.pending.popleft()
                if not job.finished:  # a client may have gone while queued
                    self._join(job)

    # --- caches ----------------------------------------------------------------------------

    def _new_slot(self) -> Slot:
        cache = self.make_cache(1)  # it plugs its modules into the model
        return Slot(cache, [layer.attention.kv_cache for layer in self.model.layers])

    def _release(self, slot: Slot) -> None:
        """A cache (or row) no sequence holds any more: its files go (a disk tier); it waits for
        the next sequence, up to one per batch row. A row's old K, V need no clearing: a prompt's
        prefill writes every position its sequence reads."""
        slot.cache.finish()
        slot.ids = []
        if len(self.free) < self.max_batch_size:
            self.free.append(slot)

    def _let_go(self, kept: Kept) -> None:
        """A kept conversation leaves the kept ones: its cache is released (a saved row's copy
        just goes)."""
        if isinstance(kept, Slot):
            self._release(kept)

    def _join(self, job) -> None:
        kept = self.kept.take(job.prompt_ids) if job.keep and self.chunks else None
        held = len(kept.ids) if kept is not None else 0
        if isinstance(kept, Slot):
            slot = kept
        else:  # a free row is there: rows are as many as sequences may run
            slot = self.free.pop() if self.free else self._new_slot()
            if kept is not None:
                try:
                    self.shared.restore_row(slot.row, kept.saved)
                except Exception as error:  # this request fails; the row is free again
                    self.free.append(slot)
                    job.fail(f"{type(error).__name__}: {error}")
                    return
        device = self.model.tok_embeddings.weight.device
        seed = job.sampling[2]
        generator = None
        if seed is not None:
            generator = torch.Generator(device).manual_seed(seed)
        tokens = torch.tensor([job.prompt_ids[held:]], device=device)
        job.reused = held
        self.joining.append(Sequence(job, slot, held, generator, tokens))

    # --- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self.closing:
            self._admit()
            start = time.monotonic()
            prefilling = self._to_prefill()
            if self.decoding:  # counted first: the pass may finish the last request
                self.decode_steps += 1
                self.decode_step_sequences += len(self.decoding)
            self._pass(prefilling)
            seconds = time.monotonic() - start
            self.busy_seconds += seconds
            if prefilling:
                self.prompt_pass_seconds += seconds

    def health(self) -> dict:
        """What /health reports: the queue, the batch, throughput, time to first token, how full
        the batch runs (the sequences a decode step advances, on average, and the busy seconds
        spent in passes that hold a prompt chunk), and the kept conversations."""
        latest = sorted(self.first_token_seconds)
        return {
            "waiting": len(self.pending),
            "running": self.running(),
            "finished": self.finished_jobs,
            "tokens_generated": self.tokens_generated,
            "tokens_per_second": self.tokens_generated / max(self.busy_seconds, 1e-9),
            "time_to_first_token_median_s": latest[len(latest) // 2] if latest else None,
            "busy_s": self.busy_seconds,
            "prompt_pass_s": self.prompt_pass_seconds,
            "decode_steps": self.decode_steps,
            "sequences_per_step_mean": self.decode_step_sequences / max(self.decode_steps, 1),
            "kept_conversations": len(self.kept.slots),
            "kept_conversations_bytes": self.kept.bytes,
            "prompt_tokens_reused": self.prompt_tokens_reused,
            "uptime_s": time.monotonic() - self.started,
        }

    def _to_prefill(self) -> list[Sequence]:
        """The joining sequences whose next chunks this turn's pass takes: the fewest prompt
        tokens left first, so that a short request's first token does not wait for a long
        prompt's every chunk, while their chunks fit in `prefill_chunk` tokens (always one); but
        the oldest goes first once it has been passed over max_batch_size times, so that a stream
        of short requests cannot starve it. Without chunks, one whole prompt."""
        for seq in [seq for seq in self.joining if seq.job.finished]:
            self.joining.remove(seq)  # gone while joining: its cache holds no whole prompt
            self._release(seq.slot)
        if not self.joining:
            return []
        oldest = self.joining[0]
        order = sorted(self.joining, key=lambda seq: seq.tokens.shape[1] - seq.prefilled)
        if oldest.passed_over >= self.max_batch_size:
            order.remove(oldest)
            order.insert(0, oldest)
        chosen, spent = [], 0
        for seq in order if self.prefill_chunk else order[:1]:
            piece = self._piece_length(seq)
            if chosen and spent + piece > self.prefill_chunk:
                break
            chosen.append(seq)
            spent += piece
        if oldest not in chosen:
            oldest.passed_over += 1
        return chosen

    def _piece_length(self, seq: Sequence) -> int:
        """The prompt tokens of `seq` its next pass takes: a whole chunk, as generate's prefill
        cuts them (the same chunks give the same answer), or what is left."""
        left = seq.tokens.shape[1] - seq.prefilled
        return min(self.prefill_chunk or left, left)

    @torch.no_grad()
    def _pass(self, prefilling: list[Sequence]) -> None:
        """One pass of the model over the rows of a decode step of every decoding sequence and
        the next chunk of each sequence in `prefilling`. A decoding sequence samples its next
        token; a joining one that took its prompt's last chunk samples its first and decodes from
        the next turn. If the pass fails, every sequence in it fails (their caches are left
        half-updated)."""
        decoding = list(self.decoding)
        prefilling = [seq for seq in prefilling if seq.prefilled or self._begin(seq)]
        if not decoding and not prefilling:
            return
        device = self.model.tok_embeddings.weight.device
        tokens, positions, masks, outputs = [], [], [], []
        try:
            for seq in decoding:
                rows, where = seq.slot.cache.step_rows(seq.token, seq.pos)
                tokens.append(rows)
                positions.append(where)
                masks.append(None)
            for seq in prefilling:
                length = torch.tensor([seq.tokens.shape[1]], device=device)
                chunk = self._piece_length(seq)
                rows, where, mask = prefill_rows(seq.tokens, length, seq.held, seq.prefilled, chunk)
                tokens.append(rows)
                positions.append(where)
                masks.append(mask)
            rows = [t.shape[1] for t in tokens]
            # logits for every row of a step (the speculative one too), and a prompt's last row
            outputs, at = [], 0
            for i, (seq, n) in enumerate(zip([*decoding, *prefilling], rows)):
                if i < len(decoding):
                    outputs.extend(range(at, at + n))
                elif seq.prefilled + n == seq.tokens.shape[1]:
                    outputs.append(at + n - 1)
                at += n
            members = [seq.slot.modules for seq in [*decoding, *prefilling]]
            if self.shared is not None and decoding:  # the decode steps in one call per layer
                first = len(decoding)
                steps = self.shared.decode_steps([seq.slot.row for seq in decoding])
                decoded = sum(rows[:first])
                per_layer = zip(steps, *members[first:])
                chunks = [
                    Packed(list(joining), rows[first:], masks[first:], (attend, decoded))
                    for attend, *joining in per_layer
                ]
                plug(self.model, chunks)
                mask = None
            elif len(members) == 1:
                plug(self.model, members[0])
                mask = masks[0]
            else:
                plug(self.model, [Packed(list(m), rows, masks) for m in zip(*members)])
                mask = None
            output_index = torch.tensor([outputs or [at - 1]], device=device)
            logits = self.model(
                torch.cat(tokens, 1), torch.cat(positions, 1), mask, output_index=output_index
            )
            fed = self._after_pass(decoding, prefilling, rows, logits)
        except Exception as error:
            message = f"{type(error).__name__}: {error}"
            count = len(decoding) + len(prefilling)
            print(f"error: a pass of {count} sequences failed: {message}", flush=True)
            for seq in [*decoding, *prefilling]:
                for running in (self.decoding, self.joining):
                    if seq in running:
                        running.remove(seq)
                        seq.job.fail(f"the pass this request was in failed: {message}")
                        self._drop(seq)
            return
        for seq, token in fed:
            self._feed(seq, token)

    def _begin(self, seq: Sequence) -> bool:
        """A joining sequence's first chunk: its cache starts a generation (a disk tier checks its
        free space here). False if that failed: the sequence has failed and left."""
        lengths = torch.tensor([seq.tokens.shape[1]], device=seq.tokens.device)
        try:
            seq.slot.cache.begin(seq.tokens, lengths, seq.held)
            return True
        except Exception as error:
            self.joining.remove(seq)
            seq.job.fail(f"{type(error).__name__}: {error}")
            self._drop(seq)
            return False

    def _after_pass(
        self, decoding: list[Sequence], prefilling: list[Sequence], rows: list[int], logits: Tensor
    ) -> list[tuple[Sequence, Tensor]]:
        """The pass's logits to its sequences: each decoding one samples its next token; a joining
        one that finished its prompt samples its first, then takes the bootstrap pass (alone) and
        decodes from the next turn. Returns the tokens to feed to their jobs."""
        fed, at = [], 0
        for seq, n in zip(decoding, rows):
            cache = seq.slot.cache
            token = seq.sample(cache.stepped(logits[:, at : at + n]))
            cache.sampled(token)
            seq.pos = seq.pos + 1
            seq.steps += 1
            fed.append((seq, token))
            at += n
        for seq, n in zip(prefilling, rows[len(decoding) :]):
            seq.prefilled += n
            if seq.prefilled < seq.tokens.shape[1]:
                continue
            cache, last_row = seq.slot.cache, logits[:, at : at + 1]
            at += 1
            self.joining.remove(seq)
            try:
                first = seq.sample(last_row)
                seq.pos = torch.tensor([[seq.held + seq.tokens.shape[1]]], device=first.device)
                cache.sampled(first)
                plug(self.model, seq.slot.modules)
                cache.bootstrap(self.model, first, seq.pos)
            except Exception as error:  # its own: the others' caches are whole
                seq.job.fail(f"{type(error).__name__}: {error}")
                self._drop(seq)
                continue
            self.decoding.append(seq)
            seq.job.stats_source = lambda cache=cache, seq=seq: cache.stats(max(1, seq.steps))
            self.first_token_seconds.append(time.monotonic() - seq.job.submitted)
            self.prompt_tokens_reused += seq.held
            fed.append((seq, first))
        return fed

    def _feed(self, seq: Sequence, token: Tensor) -> None:
        """The sequence's new token to its job; a finished job's sequence leaves at once."""
        seq.token = token
        seq.sampled.append(int(token))
        self.tokens_generated += 1
        job = seq.job
        try:
            job.feed(int(token))
        except Exception as error:  # one request's failure (its text, say) is its own
            job.fail(f"{type(error).__name__}: {error}")
        if job.finished:
            self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        try:
            if seq.job.keep and self.chunks:
                self._keep(seq)
            else:
                self._release(seq.slot)
        except Exception as error:  # a move in the background failed: the answer stands, unkept
            print(f"error: a finished sequence's cache was not kept: {error}", flush=True)
            self._drop(seq)
        self.finished_jobs += 1
        self.decoding.remove(seq)  # last: a sequence counts as running until its cache is put away

    def _keep(self, seq: Sequence) -> None:
        """A finished conversation's cache goes into the kept ones (a row, copied out first)."""
        slot = seq.slot
        # the cache holds the prompt and every sampled token but the last (chat.py's rule)
        ids = list(seq.job.prompt_ids) + seq.sampled[:-1]
        if slot.row is None:
            slot.cache.finish(keep=True)
            slot.ids = ids
            self.kept.keep(slot)
        else:
            if self.kept.budget > 0:  # no copy where none is kept
                self.kept.keep(SavedRow(ids, self.shared.save_row(slot.row, len(ids))))
            self._release(slot)

    def _drop(self, seq: Sequence) -> None:
        """A cache left in an unknown state by an error: its files go, the cache is not reused (a
        row is: the next prompt's prefill writes every position its sequence reads)."""
        try:
            seq.slot.cache.finish()
        except Exception as error:
            print(f"error: a failed sequence's cache did not finish: {error}", flush=True)
        if seq.slot.row is not None:
            self.free.append(seq.slot)
