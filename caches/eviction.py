"""Eviction baselines for SpeCache's comparisons: StreamingLLM and H2O, in the same cache seam.

Both keep a fixed number of 16-bit K, V pairs (the budget) per layer, KV head and sequence, and
drop the rest for good, which is what SpeCache avoids by keeping every pair in the slow tier:

  StreamingLLM (Xiao et al., 2023): the first `sink_tokens` tokens ("attention sinks") and the
  newest tokens.
  H2O (Zhang et al., 2023): the "heavy hitters", the tokens that received the most attention so
  far, and the newest tokens.

Choices (ours, where the papers leave room or where our setting differs):
- Equal budget: the same fast-tier bytes as SpeCache at the same capacity.
`caches.by_name.equal_budget_tokens`
  divides SpeCache's fast-tier bytes per layer and sequence (low-bit copy, scales, window, fetched
  pairs, their positions) by what one kept token costs over all KV heads: its 16-bit K and V, its
  position and its score. Pairs are 16-bit as SpeCache's are (fp16 when the model runs in fp32).
- Keys keep the RoPE positions they were rotated with. (StreamingLLM renumbers positions inside its
  cache, which matters only past the trained context; these evaluations stay within it.)
- StreamingLLM keeps 4 sink tokens, its paper's setting.
- H2O gives half the budget to heavy hitters and half to the newest tokens, its paper's setting. A
  token's score is the attention it received from every query so far (all the prompt's queries at
  prefill, then one per decode step), summed over the query heads of its KV head; each KV head
  evicts on its own.
- Decode steps take one row (the plain decode loop); both run eagerly or compiled alike.
- Hybrid models (Gemma-3): only full-attention layers evict; sliding-window layers keep their ring
  of the newest positions (model.RingKVCache), as the full cache and SpeCache do.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from caches.full import sixteen_bit_cache_bytes
from specache.lowbit import sixteen_bit_dtype
from model import CAUSAL_PROMPT, CausalPrompt, RingKVCache, Transformer, attention

POLICIES = ("streaming", "h2o")


@dataclass(frozen=True)
class EvictionConfig:
    policy: str  # "streaming" or "h2o"
    budget: int  # tokens kept per layer, KV head and sequence
    sink_tokens: int = 4  # StreamingLLM's attention sinks
    pair_dtype: Optional[torch.dtype] = None  # None: 16-bit, as SpeCache's exact pairs

    @property
    def recent(self) -> int:
        """How many of the newest tokens are never evicted."""
        return self.budget - self.sink_tokens if self.policy == "streaming" else self.budget // 2

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown eviction policy {self.policy!r}: use one of {', '.join(POLICIES)}"
            )
        if self.budget < 2:
            raise ValueError(
                f"an eviction cache needs a budget of at least 2 tokens, got {self.budget}"
            )
        if self.policy == "streaming" and not 0 <= self.sink_tokens < self.budget:
            raise ValueError(
                f"StreamingLLM's {self.sink_tokens} sink tokens must leave room in its budget of "
                f"{self.budget} tokens for recent ones"
            )


class EvictionState:
    """What all layers share: each sequence's prompt length, given before prefill (prompts are
    right-padded, so the layers cannot tell it from the positions)."""

    def __init__(self, config: EvictionConfig, batch_size: int):
        self.config = config
        self.prompt_lengths = [0] * batch_size

    def begin(self, lengths: list[int]) -> None:
        self.prompt_lengths = list(lengths)


def prompt_attention_mass(q: Tensor, k: Tensor, chunk: int = 512) -> Tensor:
    """H2O's prefill scores for one sequence: the causal attention each key receives, summed over
    all queries and the query heads of its KV head. q (H, N, D), k (Hkv, N, D) -> (Hkv, N), fp32.
    Queries go in chunks so that the N x N weights are never held at once."""
    n_kv, n = k.shape[0], k.shape[1]
    grouped = q.float().view(n_kv, q.shape[0] // n_kv, n, q.shape[-1])
    keys = k.float()
    mass = torch.zeros(n_kv, n, dtype=torch.float32, device=q.device)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        logits = (
            torch.einsum("hgqd,hkd->hgqk", grouped[:, :, start:end], keys[:, :end])
            * q.shape[-1] ** -0.5
        )
        future = (
            torch.arange(end, device=q.device) > torch.arange(start, end, device=q.device)[:, None]
        )
        mass[:, :end] += logits.masked_fill(future, float("-inf")).softmax(-1).sum((1, 2))
    return mass


class EvictionLayer(nn.Module):
    """One layer's eviction cache, plugged in as `Attention.kv_cache` (see model.py)."""

    def __init__(
        self,
        state: EvictionState,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.state, self.config = state, state.config
        shape = (len(state.prompt_lengths), n_kv_heads, state.config.budget)
        self.register_buffer(
            "k", torch.zeros(*shape, head_dim, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v", torch.zeros(*shape, head_dim, dtype=dtype, device=device), persistent=False
        )
        # Each slot's token position (-1: empty) and its accumulated attention (H2O's score).
        self.register_buffer(
            "pos", torch.full(shape, -1, dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer(
            "score", torch.zeros(shape, dtype=torch.float32, device=device), persistent=False
        )

    def prompt_keep(self, n: int, mass: Optional[Tensor]) -> Tensor:
        """The positions (Hkv, min(n, budget)) of an n-token prompt that the cache keeps."""
        c, heads, device = self.config, self.k.shape[1], self.k.device
        if n <= c.budget:
            return torch.arange(n, device=device).expand(heads, n)
        recent = torch.arange(n - c.recent, n, device=device).expand(heads, c.recent)
        if c.policy == "streaming":
            older = torch.arange(c.sink_tokens, device=device).expand(heads, c.sink_tokens)
        else:
            older = mass[:, : n - c.recent].topk(c.budget - c.recent, dim=-1).indices
        return torch.cat([older, recent], dim=-1)

    def ingest_prompt(self, k: Tensor, v: Tensor, mass: Optional[list[Tensor]] = None) -> None:
        """Keep each prompt's chosen pairs. k, v (B, Hkv, S, D); mass: H2O's (Hkv, n) per
        sequence."""
        self.pos.fill_(-1)
        self.score.zero_()
        for b, n in enumerate(self.state.prompt_lengths):
            scores = mass[b] if mass is not None else None
            keep = self.prompt_keep(n, scores)
            m = keep.shape[1]
            index = keep.unsqueeze(-1).expand(-1, -1, k.shape[-1])
            self.k[b, :, :m] = k[b].gather(1, index)
            self.v[b, :, :m] = v[b].gather(1, index)
            self.pos[b, :, :m] = keep
            if scores is not None:
                self.score[b, :, :m] = scores.gather(1, keep)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask) -> Tensor:
        # prefill: full attention over the prompt, then keep the budget
        if isinstance(mask, CausalPrompt):
            if mask.start or q.shape[2] < max(self.state.prompt_lengths):
                raise ValueError(
                    "eviction caches take the prompt in one piece (no --prefill_chunk)"
                )
            y = attention(q, k, v, CAUSAL_PROMPT)
            mass = None
            if self.config.policy == "h2o":
                mass = [
                    prompt_attention_mass(q[b, :, :n], k[b, :, :n])
                    for b, n in enumerate(self.state.prompt_lengths)
                ]
            self.ingest_prompt(k, v, mass)
            return y
        if q.shape[2] != 1:
            raise ValueError("eviction caches decode one token per step")
        return self.decode_step(q, k, v, input_pos)

    def decode_step(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Attend over the kept pairs and the new one; then the new pair takes the slot of the
        kept one that scores lowest (an empty slot first)."""
        b, n_kv, _, d = self.k.shape
        keys = torch.cat([self.k, k.to(self.k.dtype)], 2).to(q.dtype)  # (B, Hkv, budget + 1, D)
        values = torch.cat([self.v, v.to(self.v.dtype)], 2).to(q.dtype)
        new_pos = input_pos[:, None, :].expand(b, n_kv, 1)
        positions = torch.cat([self.pos, new_pos], 2)
        grouped = q.view(b, n_kv, q.shape[1] // n_kv, d)
        logits = torch.einsum("bhgd,bhkd->bhgk", grouped, keys) * d**-0.5
        weights = (
            logits.float().masked_fill((positions < 0).unsqueeze(2), float("-inf")).softmax(-1)
        )
        y = torch.einsum("bhgk,bhkd->bhgd", weights.to(values.dtype), values).reshape(q.shape)
        received = weights.sum(2)  # attention each slot received, over the KV head's query heads
        self.score.add_(received[..., :-1])
        slot = self.eviction_priority(input_pos).argmin(-1, keepdim=True)  # (B, Hkv, 1)
        self.k.scatter_(2, slot.unsqueeze(-1).expand(b, n_kv, 1, d), k.to(self.k.dtype))
        self.v.scatter_(2, slot.unsqueeze(-1).expand(b, n_kv, 1, d), v.to(self.v.dtype))
        self.pos.scatter_(2, slot, new_pos)
        self.score.scatter_(2, slot, received[..., -1:])
        return y

    def eviction_priority(self, input_pos: Tensor) -> Tensor:
        """Per slot, lower goes first: empty slots, then the oldest non-sink (StreamingLLM) or the
        lowest score outside the newest `recent` tokens (H2O); protected slots never."""
        c, pos = self.config, self.pos
        protected = torch.tensor(float("inf"), device=pos.device)
        if c.policy == "streaming":
            priority = torch.where(pos < c.sink_tokens, protected, pos.float())
        else:
            newest = input_pos[:, None, :] - c.recent  # the new token is the newest of the `recent`
            priority = torch.where(pos > newest, protected, self.score)
        return torch.where(pos < 0, -protected, priority)

    def fast_tier_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos, self.score))


class EvictionCache:
    """An eviction cache in every full-attention layer of `model` (a ring in each sliding-window
    layer), for `batch_size` sequences of up to `max_seq_length` positions, driven by
    generation.generate (see caches/__init__.py for the protocol). Decode steps take one row."""

    graph_breaks = False
    whole_step = True
    chunks = False  # what to keep is chosen over the whole prompt at once, and what left is gone

    def __init__(
        self, model: Transformer, batch_size: int, max_seq_length: int, config: EvictionConfig
    ):
        config.validate()
        c = model.config
        device, model_dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
        dtype = config.pair_dtype or sixteen_bit_dtype(model_dtype)
        self.model, self.state = model, EvictionState(config, batch_size)
        for layer in model.layers:
            window = layer.attention.window
            layer.attention.kv_cache = (
                EvictionLayer(self.state, c.n_local_heads, c.head_dim, dtype, device)
                if window is None
                else RingKVCache(batch_size, window, c.n_local_heads, c.head_dim, dtype, device)
            )
        model.setup_rope(max_seq_length)
        model.max_batch_size, model.max_seq_length = batch_size, max_seq_length
        self.layers = [
            layer.attention.kv_cache
            for layer in model.layers
            if isinstance(layer.attention.kv_cache, EvictionLayer)
        ]
        self.rings = [
            layer.attention.kv_cache
            for layer in model.layers
            if isinstance(layer.attention.kv_cache, RingKVCache)
        ]

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        if held:
            raise ValueError(
                f"the {self.state.config.policy} cache cannot continue a generation: a new turn "
                "would "
                "have to attend to the tokens it evicted"
            )
        self.state.begin(lengths.tolist())

    def ingest(self, recorded: list[tuple[Tensor, Tensor, Optional[list[Tensor]]]]) -> None:
        """Each layer's prompt K, V, and for H2O the attention each key received (per sequence)."""
        for layer, (k, v, mass) in zip(self.model.layers, recorded):
            cache = layer.attention.kv_cache
            if isinstance(cache, EvictionLayer):
                cache.ingest_prompt(k, v, mass)
            else:
                cache.ingest_prompt(k, v)

    def bootstrap(self, model: Transformer, first: Tensor, pos: Tensor) -> None:
        pass

    def step(self, model: Transformer, token: Tensor, pos: Tensor) -> Tensor:
        return self.stepped(model(*self.step_rows(token, pos)))

    def step_rows(self, token: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        return token, pos

    def stepped(self, logits: Tensor) -> Tensor:
        return logits

    def sampled(self, token: Tensor) -> None:
        pass

    def finish(self, keep: bool = False) -> None:
        pass

    def step_bytes(self, positions: list[int]) -> int:
        """The kept pairs of every sequence, and the rings."""
        kept = sum(cache.k[0].nbytes + cache.v[0].nbytes for cache in self.layers)
        return len(positions) * kept + sum(ring.fast_tier_bytes() for ring in self.rings)

    def stats(self, steps: int) -> dict:
        fast = sum(cache.fast_tier_bytes() for cache in self.layers + self.rings)
        batch, capacity = len(self.state.prompt_lengths), self.model.max_seq_length
        full_16bit = sixteen_bit_cache_bytes(self.model, capacity, batch)
        return {
            "cache": self.state.config.policy,
            "budget_tokens": self.state.config.budget,
            "capacity_tokens": capacity,
            "fast_tier_bytes": fast,
            "fast_tier_ratio_to_16bit_cache": fast / full_16bit,
        }
