"""A Llama-family transformer in the style of gpt-fast: one file, static shapes, compile-friendly.

Covers Llama-2/3/3.1, Mistral, SmolLM2, Qwen2.5 (q/k/v bias) and Gemma-3's text model through
`ModelArgs`. Gemma-3 is the same skeleton with options: RMSNorm after attention and FFN as well as
before, RMSNorm on each head's q and k, GeGLU (tanh GELU), embeddings scaled by sqrt(dim), and
hybrid attention: most layers see only a sliding window of the newest positions (with their own
RoPE base), every few layers one sees everything.

Conventions
- RoPE uses the interleaved layout (pairs (x[2i], x[2i+1]) rotate together), as gpt-fast and
  llama.cpp do; `scripts/convert/convert_hf_checkpoint.py` permutes HF's rotate-half q/k weights
  into it, and `scripts/convert/convert_gguf.py` does the same for Gemma-3 (whose GGUF keeps HF's
  layout), q/k norm weights included, so there is one RoPE here.
- Gemma's RMSNorm multiplies by (1 + w); the converters store 1 + w (llama.cpp's GGUF already
  does), so every RMSNorm here multiplies by its weight.
- Sliding-window layers keep a ring of the newest `window` positions (`RingKVCache`) instead of a
  cache as long as the context: they never look further back, so nothing else is worth keeping.
  A ring holds whatever rows it is given; a row whose position later rows rewrite (a speculative
  row) is never read again.
- Batches are ragged: sequence b occupies cache positions [0, length_b). `input_pos` is a (B, S)
  tensor of per-sequence positions, so sequences of different lengths decode side by side without
  left-padding (pad slots on the right hold garbage that the mask never lets anyone read).
- The KV cache is a seam: `Attention` computes q, k, v and hands them to `self.kv_cache`, whose
  forward stores k, v and returns the attention output. `KVCache` below is the full cache;
  specache's layers plug in through the same call (caches/ plugs every cache).
"""

import math
from typing import Optional, Union

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

from config import ModelArgs, find_multiple

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch without FlexAttention: the SDPA path still works
    BlockMask = None

FLEX_BLOCK_SIZE = 128


class CausalPrompt:
    """The mask of prompt rows at positions start..start+S-1: each query sees the keys up to its own
    position, those of the S rows and the `start` the cache holds already (a prompt prefilled in
    chunks, or a conversation's new turn on top of the earlier ones).

    `lengths` (B,), when given, says where each right-padded prompt ends (its last position + 1,
    counted from 0); caches that keep only a prompt's newest positions (RingKVCache) need it, full
    attention does not.
    """

    def __init__(self, lengths: Optional[Tensor] = None, start: int = 0):
        self.lengths, self.start = lengths, start


CAUSAL_PROMPT = CausalPrompt()
# None: each row sees the positions up to its own (a decode step's mask)
Mask = Union["BlockMask", Tensor, CausalPrompt, None]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """Softmax attention of q (B, H, S, D) over k, v (B, Hkv, T, D); GQA handled by the kernel.

    `mask` is a BlockMask (FlexAttention), a boolean (B, 1, S, T) tensor (SDPA), or a CausalPrompt
    (a cache turns None into the boolean mask of its rows' positions).
    """
    gqa = q.shape[1] != k.shape[1]
    # from position 0 (rows on top of a history get a boolean mask)
    if isinstance(mask, CausalPrompt):
        seqlen = q.shape[2]
        return F.scaled_dot_product_attention(
            q, k[:, :, :seqlen], v[:, :, :seqlen], is_causal=True, enable_gqa=gqa
        )
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)


def sliding_window_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Causal attention of a prompt (q, k, v at positions 0..S-1) where each query sees only the
    newest `window` keys (its own included), as HF's sliding-window mask does (q - kv < window).

    Queries go in blocks of `window`, each over the keys it can reach, so the work and memory grow
    with S x window rather than S x S.
    """
    seqlen = q.shape[2]
    if seqlen <= window:
        return attention(q, k, v, CAUSAL_PROMPT)
    gqa = q.shape[1] != k.shape[1]
    out = []
    for start in range(0, seqlen, window):
        end = min(seqlen, start + window)
        first = max(0, start - window + 1)
        q_pos = torch.arange(start, end, device=q.device)[:, None]
        kv_pos = torch.arange(first, end, device=q.device)[None, :]
        visible = (kv_pos <= q_pos) & (kv_pos > q_pos - window)
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end],
                k[:, :, first:end],
                v[:, :, first:end],
                attn_mask=visible,
                enable_gqa=gqa,
            )
        )
    return torch.cat(out, dim=2)


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, window: Optional[int]) -> Tensor:
    """A prompt's attention in a layer with this sliding window (None: over the whole prompt)."""
    if window is None:
        return attention(q, k, v, CAUSAL_PROMPT)
    return sliding_window_attention(q, k, v, window)


class KVCache(nn.Module):
    """The full cache: every position's K and V, preallocated, in the model's dtype or in 16
    bits."""

    def __init__(
        self,
        max_batch_size: int,
        max_seq_length: int,
        n_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: Union[str, torch.device, None] = None,
    ):
        super().__init__()
        shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer(
            "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )

    def update(
        self, input_pos: Tensor, k: Tensor, v: Tensor, rows: Optional[Tensor] = None
    ) -> None:
        """Write k, v (B, Hkv, S, D) at per-sequence positions input_pos (B, S), sequence b on row
        rows[b] of the cache (default: row b)."""
        if rows is None:
            rows = torch.arange(k.shape[0], device=k.device)
        batch = rows.unsqueeze(1)
        self.k_cache[batch, :, input_pos] = k.transpose(1, 2).to(self.k_cache.dtype)
        self.v_cache[batch, :, input_pos] = v.transpose(1, 2).to(self.v_cache.dtype)

    def ingest_prompt(self, k: Tensor, v: Tensor) -> None:
        """Hold prompts' k, v (B, Hkv, S, D) computed by a prefill elsewhere."""
        self.k_cache[: k.shape[0], :, : k.shape[2]] = k.to(self.k_cache.dtype)
        self.v_cache[: v.shape[0], :, : v.shape[2]] = v.to(self.v_cache.dtype)

    def row(self, index: int) -> "KVCache":
        """Row `index` of this cache as a cache of its own, for one sequence: a view, so what it
        writes lands here (the server's sequences, serving/batching.py, which come and go at
        different times, share one cache a row each)."""
        view = type(self).__new__(type(self))
        nn.Module.__init__(view)
        for name in ("k_cache", "v_cache"):
            view.register_buffer(name, getattr(self, name)[index : index + 1], persistent=False)
        return view

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask: Mask) -> Tensor:
        self.update(input_pos, k, v)
        return self.attend(q, input_pos, mask)

    def attend(self, q: Tensor, input_pos: Tensor, mask: Mask) -> Tensor:
        """The attention of rows q (B, H, S, D) at `input_pos` over what rows 0..B-1 of the cache
        hold, their own K, V written already."""
        k_all, v_all = self.k_cache[: q.shape[0]], self.v_cache[: q.shape[0]]
        if isinstance(mask, CausalPrompt) and mask.start:  # rows on top of what the cache holds
            end = mask.start + q.shape[2]
            k_all, v_all, mask = k_all[:, :, :end], v_all[:, :, :end], None
        if k_all.dtype != q.dtype:  # a 16-bit cache beside a float32 model
            k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
        if mask is None:  # each row sees the positions up to its own
            mask = torch.arange(k_all.shape[2], device=q.device) <= input_pos[:, None, :, None]
        return attention(q, k_all, v_all, mask)


class RingKVCache(nn.Module):
    """A sliding-window layer's cache: each sequence's newest `window` positions, position p in
    slot p % window, with the position each slot holds (-1: empty).

    A step attends over the ring and its own new rows, masked by position (p <= query, and
    query - p < window), then writes its rows over the slots of the positions that just left the
    window. A slot whose position the new rows bring again holds a row that did not stay (a
    speculative row, the last turn's end) and is not read. Memory is window x heads x head_dim per
    sequence, however long the context.
    """

    def __init__(
        self,
        max_batch_size: int,
        window: int,
        n_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: Union[str, torch.device, None] = None,
    ):
        super().__init__()
        self.window = window
        shape = (max_batch_size, n_heads, window, head_dim)
        self.register_buffer(
            "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "slot_pos",
            torch.full((max_batch_size, window), -1, dtype=torch.long, device=device),
            persistent=False,
        )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Attention of new rows q, k, v (B, *, S, D) at positions input_pos (B, S) over the ring
        and each other, without writing anything."""
        batch, ring_pos = q.shape[0], self.slot_pos[: q.shape[0]]
        # not the rows' own positions
        ring_pos = torch.where(ring_pos < input_pos[:, :1], ring_pos, -1)
        kv_pos = torch.cat([ring_pos, input_pos], dim=1)[:, None, :]  # (B, 1, W + S)
        q_pos = input_pos[:, :, None]
        visible = (kv_pos >= 0) & (kv_pos <= q_pos) & (kv_pos > q_pos - self.window)
        keys = torch.cat([self.k_cache[:batch], k.to(self.k_cache.dtype)], dim=2).to(q.dtype)
        values = torch.cat([self.v_cache[:batch], v.to(self.v_cache.dtype)], dim=2).to(q.dtype)
        return attention(q, keys, values, visible.unsqueeze(1))

    def write(self, k: Tensor, v: Tensor, input_pos: Tensor) -> None:
        """Keep rows k, v (B, Hkv, S, D) at consecutive positions input_pos (B, S); of more than
        `window` rows only the newest `window` can ever be seen again."""
        k, v, input_pos = (
            k[:, :, -self.window :],
            v[:, :, -self.window :],
            input_pos[:, -self.window :],
        )
        batch = torch.arange(k.shape[0], device=k.device).unsqueeze(1)
        self._store(batch, input_pos % self.window, k.transpose(1, 2), v.transpose(1, 2), input_pos)

    def _store(self, batch: Tensor, slots: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Rows k, v (B, N, Hkv, D) into `slots` (B, N) of sequences `batch` (B, 1), holding
        `positions`."""
        self.k_cache[batch, :, slots] = k.to(self.k_cache.dtype)
        self.v_cache[batch, :, slots] = v.to(self.v_cache.dtype)
        self.slot_pos[batch, slots] = positions

    def ingest_prompt(
        self, k: Tensor, v: Tensor, lengths: Optional[Tensor] = None, start: int = 0
    ) -> None:
        """Keep, of prompt rows k, v (B, Hkv, S, D) at positions [start, start + S), those among
        each
        prompt's newest `window` positions, the prompts ending at `lengths` (B,) (default: all S
        rows are real). Rows past a prompt's end (right padding) are not kept."""
        batch, seqlen = k.shape[0], k.shape[2]
        ends = torch.full((batch,), start + seqlen, device=k.device)
        if lengths is not None:
            ends = torch.minimum(ends, lengths.to(k.device))
        # (B, window)
        positions = ends[:, None] - self.window + torch.arange(self.window, device=k.device)
        index = (
            (positions - start)
            .clamp(0, seqlen - 1)[:, None, :, None]
            .expand(-1, k.shape[1], -1, k.shape[3])
        )
        # (B, window, Hkv, D)
        new_k, new_v = (
            k.gather(2, index).transpose(1, 2),
            v.gather(2, index).transpose(1, 2),
        )
        # From position 0 every slot is written: the window positions before a short prompt's start
        # are negative, and the mask never shows them. Past it, positions before `start` keep what
        # the ring holds (the earlier chunks').
        batch_index, slots = torch.arange(batch, device=k.device)[:, None], positions % self.window
        if start > 0:
            from_rows = positions >= start
            new_k = torch.where(
                from_rows[..., None, None], new_k, self.k_cache[batch_index, :, slots]
            )
            new_v = torch.where(
                from_rows[..., None, None], new_v, self.v_cache[batch_index, :, slots]
            )
            positions = torch.where(from_rows, positions, self.slot_pos[batch_index, slots])
        self._store(batch_index, slots, new_k, new_v, positions)

    def fast_tier_bytes(self) -> int:
        """The ring's K, V and slot positions, all sequences."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask: Mask) -> Tensor:
        # from position 0 the ring holds nothing yet: only the rows count
        if isinstance(mask, CausalPrompt):
            y = (
                sliding_window_attention(q, k, v, self.window)
                if mask.start == 0
                else self.attend(q, k, v, input_pos)
            )
            self.ingest_prompt(k, v, mask.lengths, mask.start)
            return y
        y = self.attend(q, k, v, input_pos)
        self.write(k, v, input_pos)
        return y


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear, except for a few rows in compiled CPU code (decode), where it is a multiply-reduce.

    Inductor turns a row's multiply-reduce into one streaming pass over the weight (and fuses the
    passes of several rows into one), which on CPU reads the weight about 3x faster than MKL's
    GEMV for one row and 6x faster for two (measured: 34 vs 11 GB/s on the 576x49152 output head);
    SmolLM2's layers at 2, 4 and 8 rows: 28, 23 and 11 GB/s, against 9 for F.linear at 4 and 8.
    Eager code keeps F.linear, where the product would be materialised.
    """
    rows = x.shape[:-1].numel()
    if not (torch.compiler.is_compiling() and x.device.type == "cpu" and rows <= 8):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, -1)
    y = torch.stack([(flat[i] * weight).sum(-1) for i in range(rows)]).reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_in_fp32)
        self.output = Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self._register_load_state_dict_pre_hook(self._tie_on_load)
        self.freqs_cis: Optional[Tensor] = None
        self.freqs_cis_local: Optional[Tensor] = (
            None  # the sliding-window layers', where their base differs
        )
        self.max_batch_size = -1
        self.max_seq_length = -1

    def _tie_on_load(self, state_dict, prefix, *args):
        if self.config.tie_embeddings and prefix + "output.weight" not in state_dict:
            state_dict[prefix + "output.weight"] = state_dict[prefix + "tok_embeddings.weight"]

    def setup_caches(
        self,
        max_batch_size: int,
        max_seq_length: int,
        kv_dtype: Optional[torch.dtype] = None,
        kv_cache: type = None,
    ) -> None:
        """Allocate every layer's KV cache (in `kv_dtype`, default the model's) and the RoPE tables
        for
        `max_seq_length` positions: as long as that for full-attention layers (`kv_cache`, default
        KVCache), a ring of the window for sliding-window ones.

        The length is rounded up to FlexAttention's block size.
        """
        device, dtype = (
            self.tok_embeddings.weight.device,
            kv_dtype or self.tok_embeddings.weight.dtype,
        )
        max_seq_length = find_multiple(max_seq_length, FLEX_BLOCK_SIZE)
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        c = self.config
        for b in self.layers:
            if b.attention.window is None:
                b.attention.kv_cache = (kv_cache or KVCache)(
                    max_batch_size, max_seq_length, c.n_local_heads, c.head_dim, dtype, device
                )
            else:
                b.attention.kv_cache = RingKVCache(
                    max_batch_size, b.attention.window, c.n_local_heads, c.head_dim, dtype, device
                )
        self.setup_rope(max_seq_length)

    def setup_rope(self, max_seq_length: int) -> None:
        c, device = self.config, self.tok_embeddings.weight.device
        self.freqs_cis = precompute_freqs_cis(
            max_seq_length, c.head_dim, c.rope_base, c.rope_scaling
        ).to(device)
        if c.rope_local_base is not None:
            self.freqs_cis_local = precompute_freqs_cis(
                max_seq_length, c.head_dim, c.rope_local_base
            ).to(device)

    def rope(self, input_pos: Tensor) -> list[Tensor]:
        """Each layer's RoPE angles at positions input_pos (B, S)."""
        full = self.freqs_cis[input_pos]
        local = full if self.freqs_cis_local is None else self.freqs_cis_local[input_pos]
        return [full if layer.attention.window is None else local for layer in self.layers]

    def embed(self, idx: Tensor) -> Tensor:
        x = self.tok_embeddings(idx)
        if self.config.scale_embeddings:  # in the embeddings' dtype, as Gemma's own code rounds it
            x = x * torch.tensor(self.config.dim**0.5, dtype=x.dtype)
        return x

    def forward(
        self,
        idx: Tensor,
        input_pos: Tensor,
        mask: Optional[Mask] = None,
        output_index: Optional[Tensor] = None,
    ) -> Tensor:
        """Logits for tokens `idx` (B, S) at positions `input_pos` (B, S), with the attention mask
        `mask` (see `attention`; None: each row sees the positions up to its own, as decode steps
        do; prompts pass a CausalPrompt).

        `output_index` (B, K) picks which of the S positions get logits (prefill needs only the
        last real one of each sequence; the vocab projection of every prompt position is costly).
        """
        if self.freqs_cis is None:
            raise RuntimeError("call setup_caches() before forward()")
        x = self.embed(idx)
        for layer, freqs_cis in zip(self.layers, self.rope(input_pos)):
            x = layer(x, input_pos, freqs_cis, mask)
        return self.head(x, output_index)

    def head(self, x: Tensor, output_index: Optional[Tensor] = None) -> Tensor:
        if output_index is not None:
            x = torch.gather(x, 1, output_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        # in the model's dtype where prefill's products run in bfloat16 (autocast): bfloat16
        # logits would round a top token's lead of under 1/128 of its logit away
        with torch.autocast(x.device.type, enabled=False):
            return self.output(self.norm(x))

    @classmethod
    def from_name(cls, name: str) -> "Transformer":
        return cls(ModelArgs.from_name(name))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention = Attention(config, layer)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_in_fp32)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_in_fp32)
        if config.sandwich_norm:
            self.post_attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_in_fp32)
            self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_in_fp32)
        else:
            self.post_attention_norm = self.post_ffn_norm = nn.Identity()

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Mask) -> Tensor:
        h = x + self.post_attention_norm(
            self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        )
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


class Attention(nn.Module):
    def __init__(self, config: ModelArgs, layer: int = 0):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.window = config.window(layer)  # None: attends over the whole context
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_in_fp32)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_in_fp32)
        else:
            self.q_norm = self.k_norm = nn.Identity()
        # Every attention kernel here scales scores by head_dim^-1/2; a model that wants
        # query_pre_attn_scalar^-1/2 gets the ratio folded into q.
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.q_scale = (config.head_dim / scalar) ** 0.5
        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        self.wqkv = Linear(config.dim, total_head_dim, bias=config.qkv_bias)
        self.wo = Linear(config.n_head * config.head_dim, config.dim, bias=False)
        self.kv_cache: Optional[nn.Module] = None
        self._register_load_state_dict_pre_hook(self._fuse_qkv_on_load)

    def _fuse_qkv_on_load(self, state_dict, prefix, *args):
        for suffix in ("weight", "bias"):
            if prefix + f"wq.{suffix}" in state_dict:
                parts = [state_dict.pop(prefix + f"w{n}.{suffix}") for n in "qkv"]
                state_dict[prefix + f"wqkv.{suffix}"] = torch.cat(parts)

    def project(self, x: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, S, D), k and v (B, Hkv, S, D), with RoPE applied to q and k."""
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.view(bsz, seqlen, self.n_head, self.head_dim))
        k = self.k_norm(k.view(bsz, seqlen, self.n_local_heads, self.head_dim))
        if self.q_scale != 1:
            q = q * self.q_scale
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Mask, input_pos: Tensor) -> Tensor:
        bsz, seqlen, _ = x.shape
        q, k, v = self.project(x, freqs_cis)
        if torch.is_autocast_enabled(x.device.type):
            # prefill's products in bfloat16 (GenerateOptions.prefill_products): the caches and
            # attention stay in the model's dtype, the one their buffers and ops were built for
            with torch.autocast(x.device.type, enabled=False):
                y = self.kv_cache(q.to(x.dtype), k.to(x.dtype), v.to(x.dtype), input_pos, mask)
        else:
            y = self.kv_cache(q, k, v, input_pos, mask)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = Linear(config.intermediate_size, config.dim, bias=False)
        self.gelu = config.ffn_activation == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate = self.w1(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(gate * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, weight_in_fp32: bool = False):
        super().__init__()
        self.eps = eps
        self.weight_in_fp32 = (
            weight_in_fp32  # Gemma: (x * w) cast back; Llama: x cast back, then * w
        )
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (normed * self.weight.float()).type_as(x)
        return normed.type_as(x) * self.weight


def apply_rope_scaling(freqs: Tensor, rope_scaling: dict) -> Tensor:
    """Llama-3.1's frequency-dependent RoPE scaling, or linear scaling (Gemma-3 4B+) when the dict
    holds only a factor."""
    factor = rope_scaling["factor"]
    if "low_freq_factor" not in rope_scaling:
        return freqs / factor
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(
        wavelen < high_freq_wavelen,
        freqs,
        torch.where(wavelen > low_freq_wavelen, freqs / factor, mid),
    )


def precompute_freqs_cis(
    seq_len: int, n_elem: int, base: float = 10000, rope_scaling: Optional[dict] = None
) -> Tensor:
    """(seq_len, n_elem/2, 2) table of cos, sin in fp32 (low-precision angles hurt long
    contexts)."""
    freqs = 1.0 / (
        base ** (torch.arange(0, n_elem, 2, dtype=torch.float64)[: n_elem // 2] / n_elem)
    )
    if rope_scaling is not None:
        freqs = apply_rope_scaling(freqs, rope_scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotate x (B, S, H, D) by per-sequence angles freqs_cis (B, S, D/2, 2)."""
    xf = x.float()
    cos = freqs_cis[..., 0].repeat_interleave(2, dim=-1).unsqueeze(2)
    sin = freqs_cis[..., 1].repeat_interleave(2, dim=-1).unsqueeze(2)
    # (x0, x1) -> (-x1, x0) pairwise, written as one 4-D expression so that compilers keep q and k
    # as plain (B, S, H, D) buffers (the CPU FlexAttention template needs that).
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.cat([-pairs[..., 1:], pairs[..., :1]], dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).type_as(x)
