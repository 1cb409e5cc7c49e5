"""Tensor parallelism on torch.distributed, as gpt-fast's tp.py: every rank holds its share of the
attention heads and of the FFN, and the KV cache of its own KV heads.

    torchrun --standalone --nproc_per_node 2 generate.py --specache --prompt "..." --temperature 0

Sharding (each rank r of N takes the r-th N-th of each part):
- `wqkv` by heads: it is one Linear whose rows are q (H heads), k and v (Hkv heads each); each part
is
  cut apart, so that a rank holds H/N query heads and the Hkv/N KV heads they read (query head h
  reads
  KV head h // G; consecutive blocks of heads keep that pairing). Its bias (Qwen) goes with the
  rows.
- `wo` and `w2` by their input (columns): each rank's product is a partial sum, and one all-reduce
  after each (a forward hook on `Attention` and `FeedForward`, so before Gemma's post-norms) adds
  them.
- `w1` and `w3` by their output (rows).
- The embedding, the output head and every RMSNorm (Gemma's per-head q/k norms too) are replicated:
  the simplest choice; each rank computes the whole logits, so every rank samples the same token
  (same seed, same logits) and no token is sent around.
int8 weights shard as floats do (per-output-channel scales go with the rows, and stay whole where
the
input is cut); int4 weights keep a scale and zero per group of input channels, so cutting `wo` or
`w2` by their input needs a group-aligned share per rank, or it is refused.

Each rank's model gets a config with its own head counts and FFN width (`n_head`, `n_local_heads`,
`intermediate_size` divided by N), and each Attention its own `n_head` and `n_local_heads`; the
caches
are built from them, so every cache (full, SpeCache with each rank's fetches on its own tier, KIVI,
StreamingLLM, H2O, Gemma-3's sliding-window rings) holds the rank's KV heads only. Nothing in them
mixes KV heads (H2O's scores and SpeCache's choices are per KV head), so a sharded run reads the
same
pairs a single process would.

Processes: torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) says who
is who; gloo joins CPU ranks, NCCL CUDA ones (rank r on cuda:LOCAL_RANK). Every collective is
bounded
by the process group's timeout, so a rank that dies or stops answering ends the others' runs within
it instead of hanging them (gloo notices a dead peer at once: its connection closes). Setting up
(loading, sharding, the cache) ends in `agree`: every rank learns whether any failed, and all stop
with the same error.
"""

import os
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch import Tensor

from checkpoint import UserError, load_model
from model import Linear, Transformer
from quantize import Int4Linear
from specache import SlowTierError

T = TypeVar("T")
_set_up = False  # whether `agree` has passed: errors after it are each rank's own


def world_size() -> int:
    """The processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launched() -> bool:
    """Whether this process is one of several ranks of a tensor-parallel run."""
    return world_size() > 1


def join(device_name: str, timeout_s: float) -> torch.device:
    """Join the process group that torchrun's environment describes: gloo on CPUs, NCCL on CUDA GPUs
    (this rank on cuda:LOCAL_RANK); every collective fails after `timeout_s` seconds without an
    answer.
    The rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank()))
    if device_name not in ("auto", "cpu", "cuda"):
        raise UserError(
            f"--device {device_name!r} under torchrun: use auto, cpu or cuda (each rank takes "
            "cuda:LOCAL_RANK)"
        )
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() <= local_rank:
        raise UserError(
            f"rank {rank()} needs GPU {local_rank}, but this machine has "
            f"{torch.cuda.device_count()}; "
            "start at most one process per GPU (--nproc_per_node)"
        )
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return device


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def past_setup() -> bool:
    """Whether every rank has set up (`agree`): an error from here on is this rank's alone."""
    return _set_up


def agree(setup: Callable[[], T]) -> T:
    """`setup()` on every rank, then a check that all succeeded: if a UserError (or a disk tier's
    SlowTierError) stopped any, every rank raises the first failing rank's as a UserError, so that
    rank 0 can report it (a rank that crashes instead makes the others' check fail, within the
    timeout)."""
    global _set_up
    if not dist.is_initialized():
        return setup()
    try:
        result, error = setup(), None
    except (UserError, SlowTierError) as e:
        result, error = None, str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        first, message = failed[0]
        raise UserError(message if first == 0 else f"rank {first}: {message}")
    _set_up = True
    return result


# --- sharding ------------------------------------------------------------------------------------


def rank_share(t: Tensor, dim: int, sizes: list[int], r: int, ranks: int) -> Tensor:
    """Of t's consecutive parts of `sizes` along `dim`, the r-th of `ranks` equal pieces of each,
    joined."""
    return torch.cat([part.chunk(ranks, dim)[r] for part in t.split(sizes, dim)], dim)


def shard_by_output(linear: nn.Module, sizes: list[int], r: int, ranks: int) -> None:
    """Keep rank r's rows of each part (of `sizes` output channels) of a Linear, Int8Linear or
    Int4Linear:
    its weight, bias, and a quantized weight's scales and zeros (all are per output channel)."""
    for name in ("weight", "bias", "scales", "zeros"):
        t = getattr(linear, name, None)
        if t is None:
            continue
        shard = rank_share(t.detach(), 0, sizes, r, ranks)
        setattr(
            linear,
            name,
            nn.Parameter(shard, t.requires_grad) if isinstance(t, nn.Parameter) else shard,
        )
    linear.out_features //= ranks


def shard_by_input(linear: nn.Module, r: int, ranks: int) -> None:
    """Keep rank r's input columns of a Linear, Int8Linear or Int4Linear: its product becomes a
    partial
    sum. int8 scales are per output channel and stay whole; int4 scales and zeros are per group of
    input channels, cut with them (`check_shares` has made sure the groups stay whole)."""
    if isinstance(linear, Int4Linear):
        linear.scales = linear.scales.chunk(ranks, 1)[r].contiguous()
        linear.zeros = linear.zeros.chunk(ranks, 1)[r].contiguous()
    # int4: two codes a byte, columns stay even
    shard = linear.weight.detach().chunk(ranks, 1)[r].contiguous()
    linear.weight = (
        nn.Parameter(shard, linear.weight.requires_grad) if isinstance(linear, Linear) else shard
    )
    linear.in_features //= ranks


def check_shares(model: Transformer, ranks: int) -> None:
    """ValueError, before anything is cut, unless `ranks` divides the KV heads (each rank holds
    whole
    ones) and the FFN width, and each rank's share of wo's and w2's inputs is whole int4 groups; a
    Linear cut by its input must have no bias (each rank's partial sum would add it)."""
    c = model.config
    if any(isinstance(m, Int4Linear) and m.packed is not None for m in model.modules()):
        raise ValueError(
            "int4 weights are cut in their stored layout: shard the model before pack_int4"
        )
    if c.n_local_heads % ranks:
        divisors = [d for d in range(1, c.n_local_heads + 1) if c.n_local_heads % d == 0]
        raise ValueError(
            f"{ranks} ranks cannot share this model's {c.n_local_heads} KV heads: each rank holds "
            "whole "
            f"KV heads and their query heads; run with a world size of "
            f"{', '.join(map(str, divisors))} "
            "(torchrun --nproc_per_node)"
        )
    if c.intermediate_size % ranks:
        raise ValueError(
            f"{ranks} ranks cannot share this model's FFN width of {c.intermediate_size}"
        )
    for i, block in enumerate(model.layers):
        for name, linear in (
            ("attention.wo", block.attention.wo),
            ("feed_forward.w2", block.feed_forward.w2),
        ):
            share = linear.in_features // ranks
            if linear.bias is not None:
                raise ValueError(
                    f"layers.{i}.{name} has a bias, which each rank's partial sum would add"
                )
            if isinstance(linear, Int4Linear) and share % linear.groupsize:
                raise ValueError(
                    f"layers.{i}.{name}: {ranks} ranks would cut its {linear.in_features} int4 "
                    "input "
                    f"channels into {share} per rank, not whole groups of {linear.groupsize}; use "
                    "fewer "
                    "ranks or a checkpoint quantized with a group size that divides the share"
                )


def shard_model(model: Transformer, r: int, ranks: int) -> None:
    """Cut `model` down to rank r's share of `ranks` (see the module docstring), in place, its
    weights in
    their stored layout (int4 before `pack_int4`); ValueError if it cannot be cut (`check_shares`).
    Without `all_reduce_partial_sums` its attentions and FFNs give partial sums."""
    check_shares(model, ranks)
    c = model.config
    q, kv = c.n_head * c.head_dim, c.n_local_heads * c.head_dim
    for block in model.layers:
        attention, ffn = block.attention, block.feed_forward
        shard_by_output(attention.wqkv, [q, kv, kv], r, ranks)
        shard_by_input(attention.wo, r, ranks)
        shard_by_output(ffn.w1, [c.intermediate_size], r, ranks)
        shard_by_output(ffn.w3, [c.intermediate_size], r, ranks)
        shard_by_input(ffn.w2, r, ranks)
        attention.n_head, attention.n_local_heads = c.n_head // ranks, c.n_local_heads // ranks
    model.config = replace(
        c,
        n_head=c.n_head // ranks,
        n_local_heads=c.n_local_heads // ranks,
        intermediate_size=c.intermediate_size // ranks,
    )


def _sum_over_ranks(module: nn.Module, inputs, output: Tensor) -> Tensor:
    # a functional collective, which torch.compile traces into its graph
    if torch.compiler.is_compiling():
        return funcol.all_reduce(output, "sum", dist.group.WORLD)
    # eager: in place, about half the time of the functional one with gloo (0.8 ms, not 1.8)
    dist.all_reduce(output)
    return output


def all_reduce_partial_sums(model: Transformer) -> None:
    """Add the ranks' partial sums after each attention's wo and each FFN's w2."""
    for block in model.layers:
        block.attention.register_forward_hook(_sum_over_ranks)
        block.feed_forward.register_forward_hook(_sum_over_ranks)


def load_model_shard(
    checkpoint_path: Path, device: torch.device, dtype: torch.dtype
) -> Transformer:
    """This rank's shard of a checkpoint (model.pth, model_int8.pth or model_int4.g<N>.pth), ready
    to
    run with the other ranks: cut on the host before the model moves to its device (only the shard
    moves, and int4 codes are cut before they are packed)."""
    model = load_model(
        checkpoint_path, device, dtype, shard=lambda model: shard_model(model, rank(), world_size())
    )
    all_reduce_partial_sums(model)
    return model


# --- what rank 0 reports -------------------------------------------------------------------------


def _gathered(value: T) -> list[T]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def sum_over_ranks(n: int) -> int:
    return sum(_gathered(n)) if dist.is_initialized() else n


def max_over_ranks(n: int) -> int:
    return max(_gathered(n)) if dist.is_initialized() else n


def combine_stats(stats: dict) -> dict:
    """A cache's statistics (caches/: `stats`) over all ranks: bytes (every key that names them)
    summed, what all ranks hold or move together; other numbers with a fraction (ratios, rates,
    shares, the diagnostics) the mean over ranks, which is the ratio of the sums wherever the ranks'
    denominators are equal (every rank holds as many heads of the same capacity, and all see the
    same tokens); settings (bits, k, capacity, budget) are the same on every rank."""
    return _combine(_gathered(stats), "") if dist.is_initialized() else stats


def _combine(values: list, key: str):
    first = values[0]
    if isinstance(first, dict):
        return {k: _combine([v[k] for v in values], k) for k in first}
    if isinstance(first, list):
        return [_combine(list(column), key) for column in zip(*values)]
    if isinstance(first, (int, float)) and not isinstance(first, bool) and "bytes" in key:
        return sum(values)
    if isinstance(first, float):
        return sum(values) / len(values)
    return first
