"""How SpeCache chooses the 16-bit pairs it reads exactly: the rules beside the paper's, and their
names (specache.py applies them; docs/method.md explains each, docs/RESULTS.md measures them).

`--specache_select` takes "paper" (the paper's rule: the speculative row's top-k, averaged over each
KV head's query heads), "default" (ours, DEFAULT_SELECT), or a comma-separated list of changes to
the paper's rule, each setting a SpeCacheConfig field:
- split=share: that share of the k pairs is chosen within the step by the real row's own low-bit
  scores; the rest is the speculative prefetch (default share 0.5).
- gqa-max: a KV head ranks positions by the largest weight any of its query heads gives them.
- correct=tau: a KV head whose real query is less alike than tau (mean cosine over its query heads)
  to the query that chose its prefetch discards it; the real row chooses all k (FreeKV's correction).
- sinks=n: the first n positions are always exact (default 4).
- lloyd: a 1-bit group's two levels are the means of its values below and above its midpoint.
- lookup: the speculative token is copied from the context where the last tokens occurred before
  (prompt lookup), else the speculative row's greedy choice (`prompt_lookup_guess`).
- reuse: positions the previous prefetch held are not read from the slow tier again.
- oracle=error|mass (diagnostics, not a method): all k chosen with the real row's exact scores from
  the whole slow tier: where the low-bit weights are furthest off, or the largest exact weights.
"""
import torch
from torch import Tensor

PAPER = dict(real_share=0.0, gqa="mean", correct_below=None, sinks=0, levels="minmax", guess="greedy", reuse=False,
             oracle=None)
# name: (field, its value when the name comes without "=value", the value's type; None: takes no value)
VARIANTS = {
    "split": ("real_share", 0.5, float),
    "gqa-max": ("gqa", "max", None),
    "correct": ("correct_below", 0.9, float),
    "sinks": ("sinks", 4, int),
    "lloyd": ("levels", "lloyd", None),
    "lookup": ("guess", "lookup", None),
    "reuse": ("reuse", True, None),
    "oracle": ("oracle", "error", str),
}
DEFAULT_SELECT = "split,gqa-max,correct,sinks,lloyd,lookup,reuse"


def parse_select(select: str) -> dict:
    """The selection fields of `select`: "paper", "default" (ours), or a comma-separated list of
    changes to the paper's rule (names of VARIANTS; "split=0.25" or "sinks=8" set a value)."""
    fields = dict(PAPER)
    for item in filter(None, (part.strip() for part in select.split(","))):
        name, _, value = item.partition("=")
        if name in ("paper", "default"):
            if value:
                raise ValueError(f"--specache_select: {name} takes no value")
            fields.update(parse_select(DEFAULT_SELECT) if name == "default" else {})
            continue
        if name not in VARIANTS:
            raise ValueError(f"unknown --specache_select entry {name!r}: use paper, default or some of "
                             f"{', '.join(VARIANTS)}")
        field, default, parser = VARIANTS[name]
        if value and parser is None:
            raise ValueError(f"--specache_select: {name} takes no value")
        try:
            fields[field] = parser(value) if value else default
        except ValueError:
            raise ValueError(f"--specache_select: {name}={value} is not a valid {parser.__name__}") from None
    return fields


def select_name(config) -> str:
    """A SpeCacheConfig's selection as --specache_select would name it."""
    names = []
    for name, (field, default, parser) in VARIANTS.items():
        value = getattr(config, field)
        if value != PAPER[field]:
            names.append(name if parser is None else f"{name}={value}")
    return ",".join(names) or "paper"


def queries_disagree(q: Tensor, previous: Tensor, n_kv_heads: int, threshold: float) -> Tensor:
    """(B, Hkv) bool: KV heads whose real query rows q (B, H, D) and the queries that chose their
    prefetch (B, H, D) have a mean cosine (over the KV head's query heads) below `threshold`."""
    cosine = torch.nn.functional.cosine_similarity(q.float(), previous.float(), dim=-1)  # (B, H)
    return cosine.unflatten(1, (n_kv_heads, -1)).mean(-1) < threshold


def greedy_guess(logits: Tensor, history: Tensor, lengths: Tensor) -> Tensor:
    """The paper's speculative token: the greedy choice of the speculative row's logits (B, V)."""
    return logits.argmax(-1, keepdim=True)


def prompt_lookup_guess(logits: Tensor, history: Tensor, lengths: Tensor, max_ngram: int = 3) -> Tensor:
    """The token that followed the most recent earlier occurrence of the last n tokens of each
    sequence's history (B, L; its first lengths[b] real), for n = max_ngram down to 1; where none
    occurs, the greedy choice. (transformers' prompt_lookup_num_tokens does the same for drafts.)

    An occurrence is found by where it ends: ends_n[j] says that history[j-n+1 .. j] are the last n
    tokens, and ends_n is ends_{n-1} and one more comparison, so each n costs one pass over the
    history (it runs every step, outside the compiled graph: 0.3 ms at 16k tokens on a CPU)."""
    b, length = history.shape
    position = torch.arange(length, device=history.device)
    followed = position + 1 < lengths[:, None]  # a token follows j, and j is not the last token itself
    ends = torch.ones(b, length, dtype=torch.bool, device=history.device)
    latest = []  # per n: the end of the latest occurrence (B,), -1 where none
    for n in range(1, max_ngram + 1):
        token = history.gather(1, (lengths[:, None] - n).clamp(min=0))  # the n-th last token (B, 1)
        ends = ends & torch.nn.functional.pad(history[:, : length - n + 1] == token, (n - 1, 0))
        latest.append(torch.where(ends & followed, position, -1).amax(-1))
    guess, found = logits.argmax(-1), torch.zeros(b, dtype=torch.bool, device=logits.device)
    for n in range(max_ngram, 0, -1):
        hit = (latest[n - 1] >= 0) & ~found & (lengths > n)
        guess = torch.where(hit, history.gather(1, (latest[n - 1] + 1).clamp(min=0)[:, None])[:, 0], guess)
        found |= hit
    return guess[:, None]


GUESSES = {"greedy": greedy_guess, "lookup": prompt_lookup_guess}
