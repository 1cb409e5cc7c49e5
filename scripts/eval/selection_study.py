"""How well SpeCache's 1-bit copy chooses the exact pairs, measured on a model's own decode queries
without decoding once per variant.

    python scripts/eval/selection_study.py --checkpoint checkpoints/google/gemma-3-270m/model.pth \
        --length 16384 --tasks niah_multikey_2 niah_multiquery cwe
    python scripts/eval/selection_study.py --length 4096 --topk 64 128  # the default model
    python scripts/eval/selection_study.py --length 4096 --taus 4 6 8 12  # and the sparse mix

A task sweep (ruler.py) needs a prefill and a decode per sample and method, and its score moves by
whole answers. This study isolates the copy: each RULER sample is decoded greedily once with the
full cache, and a hook on every full-attention layer's cache records the real row's query at each
step. Then, for every --stride-th step and each such layer, the step's attention is recomputed as
SpeCache's real row would see it: the sinks, the window, the new token and k chosen positions
exact, the rest of the quantized span from the 1-bit copy (keys per channel over groups of g
tokens, values per token, specache's quantizer). It is compared with the exact attention:

- error: the relative error of the attention output, |o - o_exact| / |o_exact|, the mean over
  query heads, steps, layers and samples;
- coverage: the share of the exact attention that falls on positions read exactly.

Choices of the k positions, all made by the step's own row (no speculation, as split=1):
- kivi: none (nothing fetched);
- copy: the k positions of highest weight in the copy, the max over a KV head's query heads (ours);
- error bound: the k positions that could add most to the output's error, by norms the copy
  would keep beside its codes: the key's and the value's residual |x - x_copy|. A position's
  weight could be up to exp(|q| |k - k_copy|) times the copy's, so its bound is that growth times
  |v_copy| plus the grown weight times |v - v_copy| (costs 2 numbers per position and KV head);
- copy + outliers: the copy's k picks, and beside them, kept exact in the fast tier, the 0.5% of
  the quantized positions whose keys the copy represents worst (largest key residual);
- shortlist: the copy's top --shortlist x k positions, ranked again by their exact keys (read
  from the slow tier: --shortlist x k keys more per step), the k best kept (ours);
- shortlist by error bound, shortlist + outliers: the shortlist listed by the error bound, and
  the shortlist beside the outliers;
- exact top-k (oracle): the k positions of most exact attention, the mean over its query heads;
- shortlist, sparse tau=T (with --taus): the shortlist's exact reads, the rest mixed as the sparse
  pass (specache/sparse.py) mixes them: a low-bit position (in [sinks, quantized_len), not read
  exactly) keeps its copy's value if some row of its KV head weighs it, within that segment
  (exp(score - the row's largest copy score there)), at least e^-T; the others, their weight
  unchanged in the softmax, take their key group's mean copy value (groups of g from 0, computed
  once per layer by specache.sparse.value_means, in the pair dtype, as the layer stores them).
  It scores with the float copy, as every choice here does; the pass scores in integers
  (specache/integer.py), which differ by rounding only (about 0.4%). Its own table gives the
  share of those low-bit positions kept and the skipped mass: the share of the row's attention
  (the mixed softmax, as for the error) on positions given their group's mean. Its code is in
  scripts/eval/sparse_study.py.

Each is measured for every 1-bit level rule (--levels: the paper's minmax, Lloyd's, midway; values
are Lloyd's under midway, as specache/ stores them; and, for this study only, hadamard: Lloyd's
levels over keys rotated by a Hadamard transform, queries rotated alike). The oracle's coverage is
the most k positions can read. Its error is no floor (with a poor copy the error sits on the
positions left out), but at Lloyd's levels it is the lowest seen: kivi to copy is what the fetch
gives, copy to oracle what the ranking leaves.

With three or more --topk values, a second table asks what k where it is needed could give: each
layer takes one of them, the middle one on average (the same pairs in all), split by dynamic
programming for the least error on these very steps: an optimistic bound for a calibrated
per-layer k.

Writes {out}/selection_study.md and .json (every layer's figures).
"""

import argparse
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from scripts.eval.harness import RESULTS_DIR, Runner, wants_chat, write_report  # noqa: E402
from scripts.eval.ruler import TASKS, make_sample  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402
from specache.lowbit import (
    LEVELS,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)  # noqa: E402
from scripts.eval.sparse_study import group_means, sparse_figures, sparse_table  # noqa: E402

CHOICES = (
    "kivi",
    "copy",
    "error bound",
    "copy + outliers",
    "shortlist",
    "shortlist by error bound",
    "shortlist + outliers",
    "exact top-k (oracle)",
)
# The level rules: specache's, and Lloyd's levels over keys rotated by a Hadamard transform
# (study only: RaBitQ/QJL-style rotation spreads a key's outlier channels over all of them).
STUDY_LEVELS = (*LEVELS, "hadamard")


class Recorded(NamedTuple):
    """One full-attention layer's decode: queries (steps, H, D), and K, V (Hkv, N, D) of the prompt
    and every new token (N = prompt length + steps)."""

    layer: int
    queries: Tensor
    keys: Tensor
    values: Tensor


def record_decode(runner: Runner, prompt: list[int], max_new_tokens: int) -> list[Recorded]:
    """Greedy decode of `prompt` with the full cache, recording each full-attention layer's real
    queries and new K, V (batch 1)."""
    model = runner.model
    prefilled = runner.prefill(prompt, max_new_tokens)
    full_layers = [i for i, layer in enumerate(model.layers) if layer.attention.window is None]
    steps = {i: ([], [], []) for i in full_layers}
    hooks = []

    def hook_caches(token: Tensor) -> None:
        # the first token comes before the first decode step, with the caches in place
        if hooks:
            return
        for i in full_layers:

            def record(module, args, into=steps[i]):
                q, k, v = args[:3]
                for seen, x in zip(into, (q, k, v)):
                    seen.append(x[0, :, 0].float())

            hooks.append(model.layers[i].attention.kv_cache.register_forward_pre_hook(record))

    try:
        runner.decode("full", prompt, prefilled, max_new_tokens, callback=hook_caches)
    finally:
        for hook in hooks:
            hook.remove()
    recorded = []
    for i in full_layers:
        queries, keys, values = (torch.stack(x) for x in steps[i])
        recorder = prefilled.recorders[i]
        recorded.append(
            Recorded(
                i,
                queries,
                torch.cat([recorder.k[0].float(), keys.transpose(0, 1)], 1),
                torch.cat([recorder.v[0].float(), values.transpose(0, 1)], 1),
            )
        )
    return recorded


def hadamard(n: int) -> Tensor:
    """The orthonormal Hadamard matrix of size n (a power of two), Sylvester's construction: it is
    symmetric, so it is its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    if h.shape[0] != n:
        raise SystemExit(f"--levels hadamard needs a head_dim that is a power of two, not {n}")
    return h / n**0.5


def copy_values_packed(
    values: Tensor, levels: str, group: int, pair_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The 1-bit copy of values (Hkv, T, D) as the layer stores it: packed codes, scale, zero.
    The rotation of `hadamard` is the keys' alone; its values take Lloyd's levels."""
    levels = "lloyd" if levels == "hadamard" else levels
    return quantize_values(values.to(pair_dtype), 1, group, pair_dtype, levels)


def one_bit_copy(
    keys: Tensor, values: Tensor, levels: str, group: int, pair_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The dequantized 1-bit copy (float32) of keys and values (Hkv, T, D), T a multiple of g.
    Under `hadamard`, the keys are rotated, quantized at Lloyd's levels and rotated back: a query
    scores the copy as it would score the rotated copy with a rotated query."""
    rotation = hadamard(keys.shape[-1]) if levels == "hadamard" else None
    if rotation is not None:
        keys, levels = keys.float() @ rotation, "lloyd"
    k = quantize_keys(keys.to(pair_dtype), 1, group, pair_dtype, levels)
    v = copy_values_packed(values, levels, group, pair_dtype)
    k_copy = dequantize_keys(*k, 1, group).float()
    if rotation is not None:
        k_copy = k_copy @ rotation
    return k_copy, dequantize_values(*v, 1, group).float()


def step_figures(
    rows: Tensor,
    keys: Tensor,
    values: Tensor,
    copy: tuple[Tensor, Tensor],
    quantized_len: int,
    sinks: int,
    topk: int,
    shortlist: int = 8,
    outlier_share: float = 0.005,
    taus: Sequence[float] = (),
    means: Tensor | None = None,
) -> dict[str, tuple[float, ...]]:
    """(error, coverage) of each choice for one step: rows (Hkv, G, D) scaled by D**-0.5 over keys
    and values (Hkv, N, D), the copy standing in for positions [sinks, quantized_len); the
    shortlist is `shortlist` * k positions long; the outliers, kept exact beside the k picks, are
    the `outlier_share` of the quantized positions whose keys the copy is furthest from. For each
    of `taus`, the shortlist with the sparse mix (sparse_study.py): (error, coverage, kept,
    skipped mass), `means` (Hkv, >= quantized_len, D) each position's group mean."""
    n_kv, n = keys.shape[0], keys.shape[1]
    low = torch.zeros(n, dtype=torch.bool)
    low[sinks:quantized_len] = True
    exact_scores = rows @ keys.transpose(-1, -2)  # (Hkv, G, N)
    copy_scores = exact_scores.clone()
    copy_scores[..., :quantized_len] = rows @ copy[0][:, :quantized_len].transpose(-1, -2)
    copy_values = values.clone()
    copy_values[:, :quantized_len] = copy[1][:, :quantized_len]
    exact_p = exact_scores.softmax(-1)
    exact_out = exact_p @ values
    copy_p = torch.where(low, copy_scores, exact_scores).softmax(-1)
    candidates = int(low.sum())
    copy_ranking = copy_p.amax(1)

    # What a position could add to the output's error, by the copy's residuals (norms the copy
    # would keep per position): its weight could be up to exp(|q| |k - k_copy|) times the copy's,
    # and its value is off by |v - v_copy|.
    key_residual = torch.zeros(n_kv, n)
    copied = slice(0, quantized_len)
    key_residual[:, copied] = (keys[:, copied] - copy[0][:, copied]).norm(dim=-1)
    value_residual = (values - copy_values).norm(dim=-1)[:, None]  # (Hkv, 1, N)
    growth = (rows.norm(dim=-1, keepdim=True) * key_residual[:, None]).clamp_max(80).exp()
    upper_p = copy_p * growth
    value_norm = copy_values.norm(dim=-1)[:, None]
    error_ranking = ((upper_p - copy_p) * value_norm + upper_p * value_residual).amax(1)

    outliers = torch.zeros(n_kv, n, dtype=torch.bool)
    count = min(candidates, math.ceil(outlier_share * candidates))
    if count:
        worst = key_residual.masked_fill(~low, -1.0).topk(count, -1).indices
        outliers.scatter_(-1, worst, True)

    def reranked(ranking: Tensor) -> Tensor:
        """The ranking's shortlist weighed again by the exact keys, the max over query heads."""
        listed = ranking.masked_fill(~low, float("-inf"))
        listed = listed.topk(min(shortlist * topk, candidates), -1).indices
        return torch.full_like(exact_p[:, 0], -1.0).scatter(
            -1, listed, exact_p.amax(1).gather(-1, listed)
        )

    shortlisted = reranked(copy_ranking)
    rankings = {
        "copy": copy_ranking,
        "error bound": error_ranking,
        "copy + outliers": copy_ranking,
        "shortlist": shortlisted,
        "shortlist by error bound": reranked(error_ranking),
        "shortlist + outliers": shortlisted,
        "exact top-k (oracle)": exact_p.mean(1),
    }
    figures: dict[str, tuple[float, ...]] = {}
    for choice in CHOICES:
        read_exactly = (~low).expand(n_kv, n).clone()
        if choice.endswith("+ outliers"):
            read_exactly |= outliers
        if choice in rankings and topk > 0 and low.any():
            k = min(topk, candidates)
            unread = low & ~read_exactly
            picks = rankings[choice].masked_fill(~unread, float("-inf")).topk(k, -1).indices
            read_exactly.scatter_(-1, picks, True)
        scores = torch.where(read_exactly[:, None], exact_scores, copy_scores)
        mixed_values = torch.where(read_exactly[..., None], values, copy_values)
        out = scores.softmax(-1) @ mixed_values
        error = ((out - exact_out).norm(dim=-1) / exact_out.norm(dim=-1)).mean()
        coverage = (exact_p * read_exactly[:, None]).sum(-1).mean()
        figures[choice] = (float(error), float(coverage))
        if choice == "shortlist" and taus:
            # past quantized_len (read exactly, never given a mean) the copy's values stand in
            position_means = copy_values.clone()
            position_means[:, :quantized_len] = means[:, :quantized_len]
            sparse = sparse_figures(
                scores, copy_scores, mixed_values, position_means, read_exactly, exact_out, taus
            )
            for name, (sparse_error, kept, skipped) in sparse.items():
                figures[name] = (sparse_error, float(coverage), kept, skipped)
    return figures


def study_layer(
    rec: Recorded,
    prompt_len: int,
    levels: str,
    topk: int,
    group: int,
    residual: int,
    sinks: int,
    stride: int,
    pair_dtype: torch.dtype,
    shortlist: int,
    taus: Sequence[float] = (),
) -> dict[str, tuple[float, ...]]:
    """A layer's figures per choice, the mean over every stride-th step."""
    n_kv, head_dim = rec.keys.shape[0], rec.keys.shape[-1]
    steps = rec.queries.shape[0]
    last_quantized = max(0, prompt_len + steps - 1 - residual) // group * group
    copy = one_bit_copy(
        rec.keys[:, :last_quantized], rec.values[:, :last_quantized], levels, group, pair_dtype
    )
    # the group means, like the copy, once per layer (the layer stores them as it quantizes)
    means = None
    if taus:
        packed = copy_values_packed(rec.values[:, :last_quantized], levels, group, pair_dtype)
        means = group_means(packed, group)
    # the exact pairs as SpeCache holds them, in the 16-bit pair dtype
    keys, values = rec.keys.to(pair_dtype).float(), rec.values.to(pair_dtype).float()
    sums: dict[str, list[float]] = {}
    taken = range(0, steps, stride)
    for step in taken:
        history = prompt_len + step  # positions before this step's token, which is at `history`
        quantized_len = max(0, history - residual) // group * group
        rows = rec.queries[step].view(n_kv, -1, head_dim) * head_dim**-0.5
        figures = step_figures(
            rows,
            keys[:, : history + 1],
            values[:, : history + 1],
            copy,
            quantized_len,
            min(sinks, quantized_len),
            topk,
            shortlist,
            taus=taus,
            means=means,
        )
        for choice, measured in figures.items():
            total = sums.setdefault(choice, [0.0] * len(measured))
            for i, x in enumerate(measured):
                total[i] += x
    return {choice: tuple(x / len(taken) for x in total) for choice, total in sums.items()}


def table(results: dict, topks: list[int], levels: list[str]) -> str:
    lines = [
        "| levels | k | " + " | ".join(f"{c}: error | coverage" for c in CHOICES) + " |",
        "|---|---|" + "---|---|" * len(CHOICES),
    ]
    for level in levels:
        for k in topks:
            per_layer = results[level][str(k)]
            cells = []
            for choice in CHOICES:
                pairs = [layer[choice] for layer in per_layer]
                error = sum(e for e, _ in pairs) / len(pairs)
                coverage = sum(c for _, c in pairs) / len(pairs)
                cells.append(f"{error:.4f} | {100 * coverage:.1f}%")
            lines.append(f"| {level} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_layer_k(
    results: dict, layers: list[int], topks: list[int], level: str, choice: str
) -> tuple[float, float, dict[int, int]]:
    """k where it is needed: each layer takes one of `topks`, their mean the middle one's, so
    that the total pairs are those of the middle k everywhere; the split with the least mean
    error (exhaustive over the sums, by dynamic programming). Returns the error of the middle k
    everywhere, the split's error and the split (layer -> k). The split is fitted on the steps it
    is measured on: what a calibrated per-layer k could at best give."""
    budget = sorted(topks)[len(topks) // 2]
    errors = {}  # layer -> {k: mean error over samples}
    for k in topks:
        for layer, figures in zip(layers, results[level][str(k)]):
            errors.setdefault(layer, {}).setdefault(k, []).append(figures[choice][0])
    errors = {
        layer: {k: sum(e) / len(e) for k, e in by_k.items()} for layer, by_k in errors.items()
    }
    unit = math.gcd(*topks)
    target = budget * len(errors) // unit
    best = {0: (0.0, {})}  # units spent -> (error sum, split)
    for layer, by_k in errors.items():
        step = {}
        for spent, (total, split) in best.items():
            for k, error in by_k.items():
                units = spent + k // unit
                if units <= target and (units not in step or total + error < step[units][0]):
                    step[units] = (total + error, {**split, layer: k})
        best = step
    total, split = best[target]
    uniform = sum(by_k[budget] for by_k in errors.values()) / len(errors)
    return uniform, total / len(errors), split


def per_layer_k_table(results: dict, layers: list[int], topks: list[int], levels: list[str]) -> str:
    budget = sorted(topks)[len(topks) // 2]
    lines = [
        f"k where it is needed: each full-attention layer takes k from {topks}, {budget} on "
        "average (fitted on these steps):",
        "",
        f"| levels | choice | error, k = {budget} everywhere | error, k per layer | k per layer |",
        "|---|---|---|---|---|",
    ]
    for level in levels:
        for choice in ("copy", "shortlist"):
            uniform, split_error, split = per_layer_k(results, layers, topks, level, choice)
            ks = " ".join(str(split[layer]) for layer in sorted(split))
            lines.append(f"| {level} | {choice} | {uniform:.4f} | {split_error:.4f} | {ks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--length", type=int, default=4096, help="RULER sample length (4096)")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["niah_multikey_1", "niah_multivalue", "vt"],
        choices=list(TASKS),
        metavar="TASK",
        help="RULER tasks, one sample each (default niah_multikey_1 niah_multivalue vt)",
    )
    parser.add_argument("--seed", type=int, default=42, help="as ruler.py's: the same samples")
    parser.add_argument(
        "--levels",
        nargs="+",
        default=list(LEVELS),
        choices=STUDY_LEVELS,
        help="1-bit level rules (default: specache's; also hadamard: Lloyd's levels over "
        "keys rotated by a Hadamard transform)",
    )
    parser.add_argument("--group", type=int, default=64, help="g (default 64)")
    parser.add_argument("--residual", type=int, default=64, help="R, the window (default 64)")
    parser.add_argument("--sinks", type=int, default=4, help="first positions kept exact (4)")
    parser.add_argument("--stride", type=int, default=4, help="study every n-th step (4)")
    parser.add_argument(
        "--shortlist", type=int, default=8, help="the shortlist's length over k (default 8)"
    )
    parser.add_argument(
        "--topk", type=int, nargs="+", default=[64], help="k values to study (default 64)"
    )
    parser.add_argument(
        "--taus",
        type=float,
        nargs="+",
        default=[],
        help="add the shortlist with the sparse pass's value mix at each tau (e.g. 4 6 8 12; "
        "default none)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="model.pth (default: the embedded SmolLM2-135M-Instruct, prepared offline)",
    )
    parser.add_argument(
        "--prompt_format",
        choices=("auto", "chat", "completion"),
        default="auto",
        help="as ruler.py's (auto: chat for instruct models)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / "selection" / "study",
        help="where the report files go (default docs/results/selection/study)",
    )
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    checkpoint = resolve_checkpoint(args.checkpoint)
    dtype = getattr(torch, args.dtype)
    model = load_model(checkpoint, torch.device(args.device), dtype)
    chat = wants_chat(args.prompt_format, checkpoint.parent.name)
    runner = Runner(model, get_tokenizer(checkpoint.parent), ["full"], chat=chat)
    pair_dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16
    results: dict = {level: {str(k): [] for k in args.topk} for level in args.levels}
    layers = []  # the layer of each entry of results[level][k]
    samples = []
    for task in tqdm(args.tasks, desc="samples", file=sys.stderr):
        rng = random.Random(f"{args.seed}/{task}/{args.length}")
        prompt, references, max_new_tokens = make_sample(
            task, runner.tokenizer, args.length, rng, chat=runner.chat
        )
        recorded = record_decode(runner, prompt, max_new_tokens)
        samples.append(dict(task=task, prompt_tokens=len(prompt), references=references))
        for rec in recorded:
            layers.append(rec.layer)
            for level in args.levels:
                for k in args.topk:
                    figures = study_layer(
                        rec,
                        len(prompt),
                        level,
                        k,
                        args.group,
                        args.residual,
                        args.sinks,
                        args.stride,
                        pair_dtype,
                        args.shortlist,
                        args.taus,
                    )
                    results[level][str(k)].append(figures)
    markdown = (
        f"{args.checkpoint or 'the default model'}, RULER {' '.join(args.tasks)} at "
        f"{args.length} tokens (1 sample each), every {args.stride}th decode step of the full "
        f"cache, g = {args.group}, R = {args.residual}, {args.sinks} sinks, shortlist "
        f"{args.shortlist} x k. Mean over steps, "
        f"full-attention layers and samples. Wall-clock {(time.perf_counter() - t0) / 60:.1f} "
        "min.\n\n"
        + table(results, args.topk, args.levels)
        + ("\n\n" + sparse_table(results, args.topk, args.levels, args.taus) if args.taus else "")
        + (
            "\n\n" + per_layer_k_table(results, layers, args.topk, args.levels)
            if len(args.topk) >= 3
            else ""
        )
    )
    print(markdown)
    write_report(
        args.out,
        "selection_study",
        markdown,
        dict(samples=samples, layers=layers, results=results),
    )


if __name__ == "__main__":
    main()
