"""The KV caches the one generation loop (generation.generate) drives, plugged into model.py's
Transformer, and the registry that makes them by name.

A cache is an object with these methods (FullCache and PluggedSpeCache below, and
eviction.EvictionCache; each plugs a module into every layer's `attention.kv_cache`):

    begin(tokens, lengths, held)  a generation of the right-padded prompts starts: per-generation
                                  state is reset (prefill follows, through the model's layers, in
                                  one piece or in chunks); `held` > 0 (caches that `chunks`): each
                                  sequence holds that many tokens already, which the prompts
                                  continue
    ingest(recorded)              instead of prefill: each layer's prompt (K, V, the attention each
                                  key got or None) from a prefill done elsewhere, after `begin`
                                  (scripts/harness.py shares one prefill among caches)
    bootstrap(model, first, pos)  once, before the first step (SpeCache: its first guess and fetch)
    step(model, token, pos)       one decode step of the real tokens (B, 1): their logits (B, 1, V)
    sampled(token)                the real tokens the loop sampled from them
    finish(keep)                  the generation ended (wait for whatever runs in the background);
                                  `keep`: what the cache holds stays for a continuation
    step_bytes(positions)         KV bytes a step reads, the sequences holding `positions` tokens
    stats(steps)                  tier sizes and the cache's own figures, for --json and the tables
    graph_breaks                  whether a compiled step must split its graph
    whole_step                    whether a step is one pass of `model.forward` (compile it whole)
    chunks                        whether prefill may come in chunks, on top of what the cache holds
                                  (`CausalPrompt.start` > 0: --prefill_chunk, a chat's next turn)

Methods are named as the evaluation scripts and generate.py's --cache name them: `full` (K, V in
the model's dtype) or `full-16bit`, `specache`, `specache-nospec`, `kivi` (bits and selection from
options), or with the bits and an optional selection in the name (`specache-1bit`,
`specache-2bit:paper`, `kivi-1bit`, `specache-nospec-1bit:split,sinks`), and the eviction baselines
`streaming` and `h2o`. A selection may name an oracle (`specache-1bit:oracle`, `:oracle=mass`):
diagnostics, not a method (specache_stats.py).
"""

import re
from dataclasses import replace
from functools import partial
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from disk_tier import DiskFolder, DiskTier
from eviction import EvictionCache, EvictionConfig, EvictionLayer, EvictionState
from kernels import dense_cpu
from model import FLEX_BLOCK_SIZE, KVCache, RingKVCache, Transformer
import specache.kernels
import specache.rows
from specache import Method, Placement, Selection, SpeCache, SpeCacheConfig, SpeCacheLayer
from specache.lowbit import sixteen_bit_dtype
from specache.state import SpeCacheState
from specache_stats import Diagnostics, cache_stats, step_bytes

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
except ImportError:  # torch without FlexAttention: the SDPA path still works
    BlockMask = None

KINDS = ("full", "specache", "specache-nospec", "kivi", "streaming", "h2o")
NAMED_METHODS = (
    "full",
    "full-16bit",
    "specache-1bit",
    "specache-2bit",
    "specache-nospec-1bit",
    "specache-nospec-2bit",
    "kivi-1bit",
    "kivi-2bit",
    "streaming",
    "h2o",
)
LOW_BIT_KINDS = ("specache", "specache-nospec", "kivi")
ORACLES = ("error", "mass")


# --- the full cache --------------------------------------------------------------------------


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
        # sequences that come and go at different times may share this cache, a row each (serve.py's
        # engine), where every layer's cache has rows to share: no sliding window's ring
        self.shares_rows = all(isinstance(layer, KVCache) for layer in self.layers)
        use_flex = use_flex and not kernel  # the kernel reads the cache by position: no block mask
        self.block_mask = (
            create_causal_block_mask(model.max_seq_length, device) if use_flex else None
        )

    # --- rows: sequences that come and go share this cache, a row each (serve.py's engine) ---

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
        return token, pos  # a pass of several caches' rows (serve.py) masks by position

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


# --- SpeCache --------------------------------------------------------------------------------


def accelerate_specache() -> None:
    """SpeCache's ops run on the package's C kernels (CPUs) and Triton kernels (GPUs) where those
    build: registered once per process, before anything compiles a step."""
    specache.kernels.register()


class PluggedSpeCache(SpeCache):
    """specache.SpeCache in every full-attention layer of `model` (a 16-bit ring in the fast tier
    in each sliding-window layer), for `batch_size` sequences of up to `max_seq_length` positions,
    the kernels registered. `slow_tier`: "ram", or "disk" (CPUs only: a file per layer in a fresh
    folder under `slow_tier_dir`, disk_tier.py). `probe`: diagnostics (specache_stats.py)."""

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
        """Each layer's prompt K, V from a prefill done elsewhere (scripts/harness.py), after
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


# --- by name ---------------------------------------------------------------------------------


def parse_method(method: str) -> tuple[str, Optional[int], Optional[str]]:
    """(kind, bits or None, selection or None) of a method name (see the module docstring)."""
    base, _, select = method.partition(":")
    named = re.fullmatch(r"(specache|specache-nospec|kivi)-([12])bit|(full)-(16)bit", base)
    if named:
        kind, bits = named.group(1) or named.group(3), int(named.group(2) or named.group(4))
    else:
        kind, bits = base, None
    if kind not in KINDS or (select and kind not in LOW_BIT_KINDS):
        raise ValueError(
            f"unknown method {method!r}: use one of {', '.join(NAMED_METHODS)}, or "
            f"{', '.join(LOW_BIT_KINDS)} with the bits as an option; SpeCache and "
            "KIVI methods take a selection after a colon (see --specache_select)"
        )
    if select:
        split_oracle(split_arithmetic(select)[0])
    return kind, bits, select or None


def split_arithmetic(select: str) -> tuple[str, Optional[str]]:
    """A --specache_select value without its `int8` item (the low-bit pass in integers:
    specache.Method.arithmetic), and "int8" where it named one, else None."""
    items = [item.strip() for item in select.split(",") if item.strip()]
    rest = [item for item in items if item != "int8"]
    return ",".join(rest), "int8" if len(rest) < len(items) else None


def split_oracle(select: str) -> tuple[Selection, Optional[str]]:
    """A --specache_select value's selection, and the oracle it names ("error" or "mass") or None.
    The oracle chooses all k pairs within the step (split=1) from the real row's exact scores."""
    oracle, rest = None, []
    for item in filter(None, (part.strip() for part in select.split(","))):
        name, _, value = item.partition("=")
        if name == "oracle":
            oracle = value or "error"
            if oracle not in ORACLES:
                raise ValueError(f"oracle must be error or mass, got {oracle!r}")
        else:
            rest.append(item)
    selection = Selection.parse(",".join(rest))
    return (selection, None) if oracle is None else (replace(selection, real_share=1.0), oracle)


def specache_config(
    kind: str,
    bits: Optional[int] = None,
    select: Optional[str] = None,
    topk: int = 64,
    group: int = 64,
    residual: int = 64,
    pair_dtype: Optional[torch.dtype] = None,
    overlap_fetch: bool = True,
    arithmetic: str = "float",
) -> tuple[SpeCacheConfig, Optional[str]]:
    """The SpeCacheConfig of a low-bit kind, and the oracle its selection names: SpeCache
    (speculative or not) with our selection unless `select` names another, or KIVI (nothing
    fetched) with the paper's levels unless it names others. An `int8` item in `select` sets the
    arithmetic (and alone leaves the selection at its default)."""
    select, named_arithmetic = split_arithmetic(select or "")
    method = Method(
        bits=bits or 1,
        group=group,
        residual=residual,
        topk=0 if kind == "kivi" else topk,
        speculative=kind == "specache",
        arithmetic=named_arithmetic or arithmetic,
    )
    selection, oracle = split_oracle(select or ("paper" if kind == "kivi" else "default"))
    placement = Placement(pair_dtype=pair_dtype, overlap_fetch=overlap_fetch)
    return SpeCacheConfig(method, selection, placement), oracle


def equal_budget_tokens(model: Transformer, capacity: int, config: SpeCacheConfig) -> int:
    """The eviction budget (tokens per layer and KV head) whose 16-bit pairs take the fast-tier
    bytes of a SpeCache layer with `config` at this capacity."""
    c = model.config
    dtype = config.placement.pair_dtype_for(model.tok_embeddings.weight.dtype)
    capacity = -(-capacity // config.method.group) * config.method.group
    meta = torch.device("meta")  # sizes only: nothing is allocated
    query_heads = c.n_head // c.n_local_heads
    state = SpeCacheState(config, 1, capacity, meta, c.head_dim, dtype, query_heads)
    layer = SpeCacheLayer(
        state, 0, c.n_head, c.n_local_heads, c.head_dim, dtype, meta, make_tier=lambda spec: None
    )
    one_slot = EvictionLayer(
        EvictionState(EvictionConfig("h2o", budget=1), 1), c.n_local_heads, c.head_dim, dtype, meta
    )
    return layer.fast_tier_bytes() // one_slot.fast_tier_bytes()


def make_cache(
    method: str,
    model: Transformer,
    batch_size: int,
    capacity: int,
    *,
    bits: int = 1,
    select: Optional[str] = None,
    topk: int = 64,
    budget_tokens: Optional[int] = None,
    budget_bits: int = 1,
    sink_tokens: int = 4,
    use_flex: bool = False,
    stats: bool = False,
    slow_tier: str = "ram",
    slow_tier_dir: Optional[str] = None,
    **options,
):
    """The cache `method` names, set up in `model` for `batch_size` sequences of `capacity`
    positions.

    Bits and a selection in the name win over `bits` and `select`. SpeCache and KIVI take `topk`,
    `stats` (the diagnostics), the slow tier, and specache_config's `options` (group, residual,
    pair_dtype, overlap_fetch, arithmetic); the eviction baselines keep `budget_tokens` per layer
    and KV head (default: as many as fit in SpeCache's fast-tier bytes at `budget_bits` bits at
    this capacity) and StreamingLLM `sink_tokens` sinks; the full cache uses FlexAttention with
    `use_flex`.
    """
    kind, named_bits, named_select = parse_method(method)
    if kind == "full":
        return FullCache(
            model, batch_size, capacity, use_flex, sixteen_bit=(named_bits or bits) == 16
        )
    if kind in ("streaming", "h2o"):
        budget_config = SpeCacheConfig(Method(bits=budget_bits, topk=topk))
        budget = budget_tokens or equal_budget_tokens(model, capacity, budget_config)
        return EvictionCache(model, batch_size, capacity, EvictionConfig(kind, budget, sink_tokens))
    config, oracle = specache_config(
        kind, named_bits or bits, named_select or select, topk, **options
    )
    probe = None
    if stats or oracle:
        c, device = model.config, model.tok_embeddings.weight.device
        full_layers = sum(c.window(i) is None for i in range(c.n_layer))
        probe = Diagnostics(full_layers, c.n_local_heads, device, oracle, observe=stats)
    return PluggedSpeCache(model, batch_size, capacity, config, slow_tier, slow_tier_dir, probe)
