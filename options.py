"""The command-line options that generate.py, chat.py and serving/serve.py share: the model, the
device, and the KV cache (which one, SpeCache's settings, the slow tier, the eviction budgets), with
their checks, the cache they make, and the one-line summary of its statistics."""

import argparse
import os
from dataclasses import fields
from pathlib import Path
from typing import Callable, Optional

import torch

from caches.by_name import KINDS, make_cache
from checkpoint import UserError
from model import Transformer
from specache import VARIANTS, Method, Selection

EVICTION_CACHES = ("streaming", "h2o")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """--checkpoint, --device and --dtype."""
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="model.pth, or the directory holding it (default: SmolLM2-135M-Instruct, prepared "
        "offline)",
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="model dtype; auto = bfloat16 on CUDA, float32 on CPU (measured faster there)",
    )
    p.add_argument(
        "--prefill_dtype",
        choices=["model", "bfloat16"],
        default="model",
        help="generate.py and chat.py: prefill's matrix products in the model's dtype (default), "
        "or in bfloat16 (torch.autocast; the weights, caches, attention and logits keep the "
        "model's): faster on a CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX), "
        "slower on one that does not; tokens may differ (docs/cli.md, 'Prefill in bfloat16')",
    )


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """The --dtype named, or for auto the device's default: bfloat16 on CUDA, float32 on CPU."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def prefill_products(name: str) -> Optional[torch.dtype]:
    """--prefill_dtype as `GenerateOptions.prefill_products`: None for the model's dtype."""
    return None if name == "model" else getattr(torch, name)


def context_length(max_seq_length: Optional[int], model: Transformer) -> int:
    """The positions a server's or a chat's cache holds per sequence: --max_seq_length, else the
    model's context, at most 4096 (the cache is allocated for all of it at once)."""
    return max_seq_length or min(model.config.block_size, 4096)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"unknown --device {name!r}: use auto, cpu or cuda[:N]") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "--device cuda was asked for, but this torch sees no CUDA GPU; use --device cpu"
        )
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r} is not supported: use auto, cpu or cuda[:N]")
    return device


def add_cache_arguments(
    p: argparse.ArgumentParser, whole_prompt: str = "the whole prompt in one pass"
) -> None:
    """The KV-cache options (--cache, --specache, --specache_*, --slow_tier*, the eviction
    budgets); `whole_prompt`: what no --prefill_chunk means to this command, for its help."""
    g = p.add_argument_group("KV cache", "see docs/method.md and docs/cli.md")
    g.add_argument(
        "--cache",
        default=None,
        help="full (16-bit cache, default), specache, specache-nospec (fetch synchronously, no "
        "speculative token), kivi (the low-bit copy alone, nothing fetched), or the eviction "
        "baselines streaming (StreamingLLM: sinks + newest) and h2o (heavy hitters + newest)",
    )
    g.add_argument("--specache", action="store_true", help="same as --cache specache")
    g.add_argument(
        "--full_16bit",
        action="store_true",
        help="--cache full: keep K and V in 16 bits (float16 beside a float32 model, as SpeCache's "
        "exact "
        "pairs), half the bytes a step reads (default: the model's dtype)",
    )
    for setting in fields(Method):  # --specache_bits, _group, _residual, _topk, _arithmetic, _tau
        if setting.metadata.get("command_line", True):
            g.add_argument(
                f"--specache_{setting.name}",
                type=setting.type,
                choices=setting.metadata.get("choices"),
                default=setting.default,
                help=f"{setting.metadata['help']} (default {setting.default})",
            )
    g.add_argument(
        "--specache_select",
        default="default",
        metavar="SELECTION",
        help=selection_help(),
    )
    g.add_argument(
        "--specache_stats",
        action="store_true",
        help="also measure, per layer and KV head, recall of the fetched pairs against the real "
        "token's "
        "own low-bit and exact top-k, and the share of its exact attention read in 16 bits "
        "(extra scoring passes per layer)",
    )
    g.add_argument(
        "--slow_tier",
        choices=("ram", "disk"),
        default="ram",
        help="SpeCache on a CPU: where the complete 16-bit cache lives. ram (default), or disk: a "
        "file "
        "per layer, read in the background by the speculative prefetch, for contexts whose 16-bit "
        "cache outgrows RAM (beside a GPU it is always host RAM)",
    )
    g.add_argument(
        "--slow_tier_dir",
        default=None,
        metavar="DIR",
        help="--slow_tier disk: the directory its files go in, in a fresh folder per generation "
        "(chat.py: "
        "per conversation) that is removed after it (default: the system's temp directory)",
    )
    g.add_argument(
        "--budget_tokens",
        type=int,
        default=None,
        help="streaming/h2o: tokens kept per layer and KV head (default: as many as fit in the "
        "fast-tier bytes SpeCache would use with the --specache_* settings at this length; see "
        "caches/eviction.py)",
    )
    g.add_argument(
        "--sink_tokens",
        type=int,
        default=4,
        help="streaming: attention-sink tokens kept (default 4)",
    )
    g.add_argument(
        "--prefill_chunk",
        type=int,
        default=None,
        metavar="N",
        help=f"prefill at most N positions per pass, each on top of the ones before (default: "
        f"{whole_prompt}): only one chunk's activations, and with SpeCache one chunk's 16-bit K "
        "and V, are in memory at a time; SpeCache's chunks read the history's exact pairs from the "
        "slow tier (KIVI: its low-bit copy); not for streaming/h2o",
    )


def selection_help() -> str:
    """--specache_select's help, from the names and descriptions `Selection`'s fields declare."""
    changes = []
    for setting in fields(Selection):
        name, *also = setting.metadata["names"]
        number = VARIANTS[name][2]
        value = f"[={number.__name__}]" if number else ""
        default = f", default {setting.default}" if number else ""
        named = " or ".join([name + value, *also])
        changes.append(f"{named} ({setting.metadata['help']}{default})")
    return (
        "how the k pairs are chosen: 'paper' (the paper's rule: the speculative row's top-k, mean "
        f"over query heads), 'default' (ours: {Selection().name()}), or a comma-separated list of "
        f"changes to the paper's rule: {'; '.join(changes)}. Three more items: int8 (the same as "
        "--specache_arithmetic int8), sparse[=TAU] (--specache_arithmetic sparse, at "
        "--specache_tau TAU) and oracle[=error|mass] (diagnostics: the real row's k from its "
        "exact scores). See docs/method.md and docs/RESULTS.md"
    )


def validate_cache_args(args: argparse.Namespace) -> None:
    """Check the KV-cache options (UserError on a bad one) and settle `args.cache` to a kind."""
    if args.specache:
        if args.cache not in (None, "specache"):
            raise UserError(f"--specache contradicts --cache {args.cache}; give one of them")
        args.cache = "specache"
    args.cache = args.cache or "full"
    if args.cache not in KINDS:
        raise UserError(f"unknown --cache {args.cache!r}: use one of {', '.join(KINDS)}")
    if (args.slow_tier != "ram" or args.slow_tier_dir) and args.cache not in (
        "specache",
        "specache-nospec",
    ):
        raise UserError(
            f"--slow_tier and --slow_tier_dir apply to SpeCache, not --cache {args.cache}"
        )
    if args.slow_tier_dir and args.slow_tier != "disk":
        raise UserError("--slow_tier_dir needs --slow_tier disk")
    if args.slow_tier_dir and not os.path.isdir(args.slow_tier_dir):
        raise UserError(
            f"the slow tier's directory {args.slow_tier_dir} does not exist (--slow_tier_dir)"
        )
    if args.full_16bit and args.cache != "full":
        raise UserError(f"--full_16bit applies to --cache full, not {args.cache}")
    if args.budget_tokens is not None and args.cache not in EVICTION_CACHES:
        raise UserError(f"--budget_tokens applies to --cache streaming or h2o, not {args.cache}")
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        raise UserError(f"--prefill_chunk must be at least 1 (got {args.prefill_chunk})")
    if args.prefill_chunk is not None and args.cache in EVICTION_CACHES:
        raise UserError(
            f"--prefill_chunk does not apply to --cache {args.cache}: it chooses what to keep over "
            "the "
            "whole prompt at once"
        )


def cache_from_args(
    args: argparse.Namespace,
    model: Transformer,
    batch_size: int,
    capacity: int,
    use_flex: bool = False,
    log: Callable[[str], None] = lambda line: None,
):
    """The cache the (validated) options name, set up in `model` for `batch_size` sequences of
    `capacity` positions; `log` gets the notes a user should see (a clamped k, the disk tier's
    size)."""
    try:
        method = "full-16bit" if args.full_16bit else args.cache
        cache = make_cache(
            method,
            model,
            batch_size,
            capacity,
            bits=args.specache_bits,
            select=args.specache_select,
            topk=args.specache_topk,
            group=args.specache_group,
            residual=args.specache_residual,
            arithmetic=args.specache_arithmetic,
            tau=args.specache_tau,
            stats=args.specache_stats,
            budget_tokens=args.budget_tokens,
            budget_bits=args.specache_bits,
            sink_tokens=args.sink_tokens,
            use_flex=use_flex,
            slow_tier=args.slow_tier,
            slow_tier_dir=args.slow_tier_dir,
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    if args.cache in ("specache", "specache-nospec"):
        k = cache.layers[0].k_spec + cache.layers[0].k_real
        if k < args.specache_topk:
            log(
                f"Note: --specache_topk {args.specache_topk} clamped to {k}: at this capacity "
                "SpeCache has room for "
                f"{k} exact pairs per layer and KV head beside its window (its fast tier never "
                "exceeds a 16-bit "
                "cache, and it fetches only positions it quantized)"
            )
    if args.slow_tier == "disk":
        log(
            f"Slow tier on disk: {cache.folder.nbytes() / 1e9:.2f} GB of files at this capacity, "
            "in a fresh folder "
            f"under {cache.folder.parent} that goes when each generation (chat.py: each "
            "conversation) ends"
        )
    return cache


def cache_summary(stats: dict) -> str:
    if stats["cache"] in EVICTION_CACHES:
        return (
            f"{stats['cache']}: {stats['budget_tokens']} tokens kept per layer and KV head, fast "
            "tier "
            f"{stats['fast_tier_bytes'] / 1e6:.1f} MB "
            f"({stats['fast_tier_ratio_to_16bit_cache']:.3f}x a 16-bit "
            "cache); evicted tokens are gone"
        )
    line = (
        f"{stats['cache']} {stats['bits']}-bit: fast tier {stats['fast_tier_bytes'] / 1e6:.1f} MB "
        f"({stats['fast_tier_ratio_to_16bit_cache']:.3f}x a 16-bit cache), slow tier "
        f"{stats['slow_tier_bytes'] / 1e6:.1f} MB{' on disk' if 'slow_tier' in stats else ''}, "
        f"{stats['bytes_fetched_per_token'] / 1e3:.0f} kB fetched per token"
    )
    if "slow_tier_bytes_read_per_step" in stats:
        line += f" ({stats['slow_tier_bytes_read_per_step'] / 1e3:.0f} kB read from disk per step)"
    if "sliding_window_layers" in stats:
        line += (
            f"; {stats['full_attention_layers']} full-attention layers "
            f"{stats['fast_tier_ratio_full_attention_layers']:.3f}x their 16-bit cache, "
            f"{stats['sliding_window_layers']} sliding-window layers keep their 16-bit rings "
            f"({stats['fast_tier_bytes_sliding_window_layers'] / 1e6:.1f} MB)"
        )
    line += f"; selection: {stats['select']}"
    if stats.get("arithmetic", "float") != "float":
        line += f", {stats['arithmetic']} low-bit pass"
    if "tau" in stats:
        line += f" (tau {stats['tau']:g})"
    if stats.get("speculative_match_rate") is not None:
        line += f", speculative token right {100 * stats['speculative_match_rate']:.0f}% of steps"
    if stats.get("prefetch_discarded_share") is not None:
        line += (
            f", prefetch discarded on {100 * stats['prefetch_discarded_share']:.0f}% of KV heads"
        )
    if "diagnostics" in stats:
        d = stats["diagnostics"]
        line += (
            f"; the real token's exact attention read in 16 bits: {100 * d['coverage']:.1f}% (the "
            "exact top-"
            f"{stats['topk']}: {100 * d['oracle_coverage']:.1f}%), recall of its own low-bit top-k "
            f"{100 * d['recall_own_lowbit']:.0f}%, of its exact top-k "
            f"{100 * d['recall_exact']:.0f}%"
        )
        if "sparse_kept" in d:
            line += (
                f"; the sparse pass mixed {100 * d['sparse_kept']:.1f}% of positions by their own "
                f"value and gave {100 * d['sparse_skipped_mass']:.3f}% of the real token's "
                "attention to key groups' mean values"
            )
    return line
