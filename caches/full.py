"""The full cache of model.py: K and V in the model's dtype or in 16 bits, every position (a ring
for sliding-window layers), read on a CPU through kernels/dense_cpu.c; and the bytes of 16-bit
caches that the other caches compare with."""

from functools import partial
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from kernels import dense_cpu
from model import FLEX_BLOCK_SIZE, KVCache, Transformer
from specache.lowbit import sixteen_bit_dtype

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # torch without FlexAttention: the SDPA path still works
    BlockMask = None


def flex_attention_available(device: Union[str, torch.device]) -> bool:
    return BlockMask is not None and torch.device(device).type in ("cpu", "cuda")


def causal_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def create_causal_block_mask(max_seq_length: int, device: Union[str, torch.device]) -> "BlockMask":
    """The one causal BlockMask of a generation; each step slices the rows it needs from it."""
    return create_block_mask(
        causal_mask_mod,
        1,
        1,
        max_seq_length,
        max_seq_length,
        device=device,
        BLOCK_SIZE=FLEX_BLOCK_SIZE,
    )


def slice_block_mask(causal: "BlockMask", input_pos: Tensor) -> "BlockMask":
    """Rows of the causal BlockMask for one query per sequence at positions `input_pos` (B, 1):
    each sequence b takes the block row that holds its own position, so one mask serves a ragged
    batch and no shape depends on the position (no recompiles as it moves)."""
    rows = input_pos[:, 0] // causal.BLOCK_SIZE[0]
    pos = input_pos[:, 0]

    def pick(t: Tensor) -> Tensor:
        return t[0, 0, rows].unsqueeze(1).unsqueeze(1)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= pos[b]

    return BlockMask.from_kv_blocks(
        pick(causal.kv_num_blocks),
        pick(causal.kv_indices),
        pick(causal.full_kv_num_blocks),
        pick(causal.full_kv_indices),
        BLOCK_SIZE=causal.BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(1, causal.seq_lengths[1]),
        compute_q_blocks=False,
    )


class KernelKVCache(KVCache):
    """The full cache whose decode steps on a CPU read K and V through kernels/dense_cpu.c (up to
    each row's position, 16-bit elements widened in registers); prompts, other masks and shapes
    the kernel does not take go through KVCache's attention."""

    def attend(self, q: Tensor, input_pos: Tensor, mask) -> Tensor:
        if mask is not None or not dense_cpu.takes(q, self.k_cache):
            return super().attend(q, input_pos, mask)
        k_all, v_all = self.k_cache[: q.shape[0]], self.v_cache[: q.shape[0]]
        return dense_cpu.dense_decode_attention(q.float(), k_all, v_all, input_pos).to(q.dtype)


def decode_on_rows(
    shared: KVCache, at: Tensor, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor
) -> Tensor:
    """One layer's decode step of several sequences in one attention call: q, k, v (1, H, n, D) at
    positions (1, n) are n sequences' rows, the i-th on row at[i] of the `shared` cache. Each row's
    K, V are written there, then every row of the cache attends: the n sequences' at their
    positions, the others (free, or a joining sequence's) at position 0, a query of zeros whose
    output is dropped, and what those rows hold is not touched. The output (1, H, n, D)."""

    def per_sequence(x: Tensor) -> Tensor:  # (1, H, n, D) -> (n, H, 1, D): a batch of one row each
        return x[0].transpose(0, 1).unsqueeze(2)

    pos = input_pos.transpose(0, 1)  # (n, 1)
    shared.update(pos, per_sequence(k), per_sequence(v), rows=at)
    rows = shared.k_cache.shape[0]
    queries = q.new_zeros(rows, q.shape[1], 1, q.shape[3])
    queries[at] = per_sequence(q)
    positions = pos.new_zeros(rows, 1)
    positions[at] = pos
    out = shared.attend(queries, positions, None)
    return out[at, :, 0].transpose(0, 1).unsqueeze(0)


class FullCache:
    """The full cache of model.py (a ring for sliding-window layers), K and V in the model's dtype
    or, with `sixteen_bit`, in 16 bits (float16 beside a float32 model, as SpeCache's pairs). On a
    CPU, decode reads it through kernels/dense_cpu.c; elsewhere compiled decode uses FlexAttention's
    block mask when `use_flex`."""

    graph_breaks = False
    whole_step = True
    chunks = True

    def __init__(
        self,
        model: Transformer,
        batch_size: int,
        max_seq_length: int,
        use_flex: bool = False,
        sixteen_bit: bool = False,
    ):
        model_dtype = model.tok_embeddings.weight.dtype
        self.kv_dtype = sixteen_bit_dtype(model_dtype) if sixteen_bit else model_dtype
        device = model.tok_embeddings.weight.device
        kernel = device.type == "cpu" and dense_cpu.available()
        model.setup_caches(
            batch_size, max_seq_length, self.kv_dtype, kv_cache=KernelKVCache if kernel else KVCache
        )
        self.model = model
        self.layers = [layer.attention.kv_cache for layer in model.layers]
        # sequences that come and go at different times may share this cache, a row each (the
        # server's engine, serving/batching.py), where every layer's cache has rows to share: no
        # sliding window's ring
        self.shares_rows = all(isinstance(layer, KVCache) for layer in self.layers)
        use_flex = use_flex and not kernel  # the kernel reads the cache by position: no block mask
        self.block_mask = (
            create_causal_block_mask(model.max_seq_length, device) if use_flex else None
        )

    # --- rows: sequences that come and go share this cache, a row each (serving/batching.py) ---

    def row(self, index: int) -> list[KVCache]:
        """Row `index` of every layer's cache, as caches of their own (views: see KVCache.row), to
        plug into the model for the prompt chunks of the sequence on that row."""
        return [layer.row(index) for layer in self.layers]

    def row_cache(self, index: int) -> "FullCache":
        """The cache methods of the sequence on row `index`: this cache's (they are per-batch)."""
        return self

    def decode_steps(self, rows: list[int]) -> list[Callable[..., Tensor]]:
        """For each layer, the attention of one pass's decode steps of the sequences on `rows`
        (their rows first in the pass, one each): `decode_on_rows`."""
        if len(rows) == 1:  # its row alone: a batch of one, its heads spread over the threads
            return [partial(view, mask=None) for view in self.row(rows[0])]
        at = torch.tensor(rows, device=self.layers[0].k_cache.device)
        return [partial(decode_on_rows, layer, at) for layer in self.layers]

    def save_row(self, index: int, n: int) -> list[Tensor]:
        """Every layer's K and V of row `index` up to position n, copied out to host RAM."""
        return [x[index, :, :n].to("cpu", copy=True) for x in self._buffers()]

    def restore_row(self, index: int, saved: list[Tensor]) -> None:
        """`save_row`'s copy into row `index`."""
        for buffer, part in zip(self._buffers(), saved):
            buffer[index, :, : part.shape[1]] = part

    def _buffers(self) -> list[Tensor]:
        return [x for layer in self.layers for x in (layer.k_cache, layer.v_cache)]

    def begin(self, tokens: Tensor, lengths: Tensor, held: int = 0) -> None:
        pass  # prefill overwrites every position a generation reads, from `held` on

    def ingest(self, recorded: list[tuple[Tensor, Tensor, Optional[list[Tensor]]]]) -> None:
        for layer, (k, v, _) in zip(self.model.layers, recorded):
            layer.attention.kv_cache.ingest_prompt(k, v)

    def bootstrap(self, model: Transformer, first: Tensor, pos: Tensor) -> None:
        pass

    def step(self, model: Transformer, token: Tensor, pos: Tensor) -> Tensor:
        if self.block_mask is None:
            return model(token, pos)
        return model(token, pos, slice_block_mask(self.block_mask, pos))

    def step_rows(self, token: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        return token, pos  # a pass of several caches' rows (serving/) masks by position

    def stepped(self, logits: Tensor) -> Tensor:
        return logits

    def sampled(self, token: Tensor) -> None:
        pass

    def finish(self, keep: bool = False) -> None:
        pass

    def step_bytes(self, positions: list[int]) -> int:
        return full_cache_step_bytes(self.model, positions, self.kv_dtype.itemsize)

    def stats(self, steps: int) -> dict:
        return {"cache": "full", "kv_dtype": str(self.kv_dtype)}


def full_cache_step_bytes(
    model: Transformer, positions: list[int], element_size: Optional[int] = None
) -> int:
    """KV bytes a full-cache decode step reads when its sequences hold `positions` tokens each:
    full-attention layers read every position, sliding-window layers their whole ring (elements of
    `element_size` bytes, default the model's)."""
    c = model.config
    element_size = element_size or model.tok_embeddings.weight.element_size()
    per_layer_position = 2 * c.n_local_heads * c.head_dim * element_size
    windows = [c.window(i) for i in range(c.n_layer)]
    return per_layer_position * sum(n if w is None else w for w in windows for n in positions)


def sixteen_bit_cache_bytes(
    model: Transformer, capacity: int, batch: int = 1, windows: bool = True
) -> int:
    """Bytes of 16-bit K and V caches for `batch` sequences of `capacity` positions: what the
    fast-tier ratios compare with. Sliding-window layers hold their window only (as the full cache
    here does), or with `windows=False` the whole capacity (as a cache that ignores them would)."""
    c = model.config
    per_position = 2 * 2 * c.n_local_heads * c.head_dim
    held = [capacity if w is None or not windows else w for w in map(c.window, range(c.n_layer))]
    return batch * per_position * sum(held)
