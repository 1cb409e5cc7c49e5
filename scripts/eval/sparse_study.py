"""The sparse pass's value mix (specache/sparse.py) in selection_study.py: the shortlist's exact
reads, the rest of the low-bit segment mixed as the pass mixes it, on the study's float copy
scores (the pass scores in integers, specache/integer.py, which differ by rounding only)."""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from specache.sparse import kept_positions, value_means


def sparse_choice(tau: float) -> str:
    return f"shortlist, sparse tau={tau:g}"


def group_means(packed_values: tuple[Tensor, Tensor, Tensor], group: int) -> Tensor:
    """Each position's key group's mean copy value (Hkv, T, D) float32, from the copy's packed
    values (codes, scale, zero; T a multiple of g): the means as the layer stores them
    (value_means, in the pair dtype), repeated over their group so that they line up with the
    copy's positions."""
    return value_means(*packed_values, 1, group).float().repeat_interleave(group, -2)


def sparse_figures(
    scores: Tensor,
    copy_scores: Tensor,
    mixed_values: Tensor,
    means: Tensor,
    read_exactly: Tensor,
    exact_out: Tensor,
    taus: Sequence[float],
) -> dict[str, tuple[float, float, float]]:
    """(error, kept, skipped mass) of the sparse mix for each tau: `scores` (Hkv, G, N) and
    `mixed_values` (Hkv, N, D) are the shortlist's (exact where `read_exactly` (Hkv, N), the
    copy's elsewhere), `copy_scores` the copy's everywhere; `means` (Hkv, N, D) each position's
    group mean. kept: the share of the low-bit positions (those not read exactly) mixed by their
    own value; skipped mass: the share of the row's attention on the others."""
    unread = ~read_exactly  # the sinks and all past quantized_len are read exactly
    # weights within the low-bit segment, as the pass forms them; a finite row maximum where a
    # row has no low-bit position left, so that its weights are 0 rather than NaN
    segment = copy_scores.masked_fill(read_exactly[:, None], float("-inf"))
    row_max = segment.amax(-1, keepdim=True).clamp_min(torch.finfo(segment.dtype).min)
    weights = torch.exp(segment - row_max)  # 1 at each row's largest
    p = scores.softmax(-1)  # the weights are the shortlist's: the sparse mix keeps the softmax
    figures = {}
    for tau in taus:
        # the pass's own rule, on a batch of one
        skipped = unread & ~kept_positions(weights[None], math.exp(-tau))[0]
        out = p @ torch.where(skipped[..., None], means, mixed_values)
        error = ((out - exact_out).norm(dim=-1) / exact_out.norm(dim=-1)).mean()
        unread_count = int(unread.sum())
        kept = 1 - int(skipped.sum()) / unread_count if unread_count else 1.0
        skipped_mass = (p * skipped[:, None]).sum(-1).mean()
        figures[sparse_choice(tau)] = (float(error), kept, float(skipped_mass))
    return figures


def sparse_table(results: dict, topks: list[int], levels: list[str], taus: list[float]) -> str:
    lines = [
        "The shortlist's exact reads with the sparse pass's value mix (float copy scores): kept, "
        "the share of the low-bit positions mixed by their own value; skipped mass, the share of "
        "the attention on those given their group's mean value; change, the error's against the "
        "shortlist's.",
        "",
        "| levels | k | shortlist: error | tau | error | change | kept | skipped mass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        for k in topks:
            per_layer = results[level][str(k)]
            base = sum(layer["shortlist"][0] for layer in per_layer) / len(per_layer)
            for tau in taus:
                figures = [layer[sparse_choice(tau)] for layer in per_layer]
                error, _, kept, skipped = (sum(x) / len(figures) for x in zip(*figures))
                change = 100 * (error / base - 1) if base else 0.0
                lines.append(
                    f"| {level} | {k} | {base:.4f} | {tau:g} | {error:.4f} | {change:+.2f}% "
                    f"| {100 * kept:.1f}% | {100 * skipped:.3f}% |"
                )
    return "\n".join(lines)
