"""SpeCache: speculative key-value caching (Jie et al., ICML 2025, arXiv 2503.16163).

This package is the whole method, on PyTorch and the standard library alone: install it (`pip
install .` from the repository) or copy the folder into your own project, and plug it into your
model (`SpeCache`'s docstring, in cache.py, shows how; `specache.hf` plugs it into a transformers
model). docs/method.md explains every choice, and marks as "ours" what the paper leaves open or
what we do differently.

The complete 16-bit KV cache lives in the big slow tier (host RAM); the small fast tier (VRAM, or
on a CPU the working set a step reads) keeps a 1- or 2-bit copy of every key and value, a 16-bit
window of the newest tokens, and a few 16-bit pairs per layer and KV head read exactly. Every
decode step runs two tokens at once, the real one and a speculative guess of the next one; the
speculative row's attention decides which pairs to fetch for the next step, and the fetch runs
while the rest of this step computes.

The timeline (the paper's Appendix A; names as there):

  Prefill. Each layer attends over the prompt in full precision, then quantizes the prompt's
  keys and values into the low-bit copy (whole groups of g tokens, all but the newest R, which
  stay in the 16-bit window) and sends its 16-bit K, V to the slow tier, before the next layer
  runs.

  Bootstrap. The first token T1 attends over the low-bit copy and the window. Its attention gives
  kappa_1, the positions to fetch for the first step, and its logits the first guess T'2. Its K, V
  are dropped (the next step computes them again).

  Decode step t. Rows [T_t, T'_{t+1}] attend in mixed precision: 16-bit pairs at the fetched
  positions and in the window, the low-bit copy everywhere else (nothing is dropped). The real
  row does not see the speculative row's key. Per layer, the speculative row's weights give
  kappa_{t+1}, whose fetch starts as soon as the layer is done. The real row's K, V go to the slow
  tier and join the window, whose oldest group moves to the low-bit copy once it holds R + g
  tokens; the speculative row's are dropped. Row 0's logits give T_{t+1} (any sampler); the next
  guess comes from row 1's logits. A wrong guess is never rolled back: it only makes the next
  fetch less apt.

Choosing the exact pairs: the paper's rule and ours. With a 1-bit copy, the paper's rule (the
speculative row's top-k, averaged over each KV head's query heads) loses most needle retrievals on
the models measured here: the speculative row attends with pairs chosen for another query, its
choice for the next step is worse for it, and the real row pays. Ours lets the real row choose half
of the k pairs within the step from its own low-bit scores (step.py): the copy lists 8
candidates per pick, whose 16-bit keys decide (the shortlist). Smaller changes follow; `Selection`
names every rule.

Variants: `speculative=False` is the paper's non-speculative baseline (each step's k pairs are the
real row's own low-bit top-k, fetched and waited for); `topk=0` is KIVI alone (the low-bit copy and
the window, nothing fetched).

Reading order. The paper's method: this page, then cache.py (the driver: prefill, bootstrap, the
two-row step), layer.py (one layer's cache and its passes) and step.py (a decode step's attention,
written once: the rows over the four segments, the real row's picks within the step, the next
prefetch), with the pieces they call: config.py (the settings and the fast tier's size), lowbit.py
(the copy), ops.py (the ops a step runs, in plain PyTorch), select.py (the choice of pairs),
tiers.py (the slow tier), state.py and prefill.py. Ours, each apart: guess.py (the prompt-lookup
guess beside the paper's greedy one), integer.py (the integer pass), pinned.py (the slow tier
beside a GPU) and rows.py (sequences that come and go in one cache). Faster kernels for the ops
live in specache/kernels (`specache.kernels.register()`); the results are the same.
"""

from specache.cache import SpeCache
from specache.config import PAPER, VARIANTS, Method, Placement, Selection, SpeCacheConfig
from specache.layer import Probe, SpeCacheLayer
from specache.pinned import PinnedTier
from specache.rows import SpeCacheRow
from specache.tiers import (
    Kappa,
    PrefetchSlots,
    RamTier,
    SlowTier,
    SlowTierError,
    TierSpec,
    TierState,
)

__all__ = [
    "SpeCache",
    "SpeCacheConfig",
    "Method",
    "Selection",
    "Placement",
    "PAPER",
    "VARIANTS",
    "SpeCacheLayer",
    "Probe",
    "SlowTier",
    "SlowTierError",
    "TierSpec",
    "TierState",
    "Kappa",
    "PrefetchSlots",
    "RamTier",
    "PinnedTier",
    "SpeCacheRow",
]
