"""specache::step_attention on CPUs: specache/kernels/step_cpu.cpp's one call per layer, which
chains the C kernels KV head by KV head, against specache's definition of the op, run op by op on
the same C kernels and on the plain-PyTorch ops (`reference_ops`).

What must agree: the output (within float32 rounding of the definition on the same kernels, and
within the kernels' own tolerance of the plain ops), which picks were placed and where, the
prefetch, the pairs read, and every slot's position, validity and pair, but those of picks and
prefetch entries that are not real: a ranking with fewer candidates than k leaves their position
unspecified (the kernel writes 0, topk some masked position), and such a slot never counts.
"""

import contextlib
import math
import shutil
import warnings

import pytest
import torch

import specache
from conftest import reference_ops
from specache.config import ARITHMETICS
from specache.lowbit import quantize_keys, quantize_values
from specache.ops import parameter_names
from specache.step import step_attention_reference

# the op's arguments by name: their index in its schema
ARGUMENT = {name: i for i, name in enumerate(parameter_names(step_attention_reference))}

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: the reference serves"),
    pytest.mark.usefixtures("one_thread", "specache_kernels"),
]


def step_problem(
    bits=1,
    arithmetic="float",
    s=2,
    n_picks=8,
    shortlist=0,
    n_sinks=2,
    n_spec=4,
    n_real=4,
    discard=True,
    gqa_max=True,
    dtype=torch.bfloat16,
    d=64,
    t=160,
    n_kv=2,
    seed=0,
):
    """The op's arguments for 2 sequences of n_kv KV heads with 3 query heads each: a low-bit copy
    of t positions of random keys (outlier channels) and values, of which sequence 0 has
    quantized t - 32 and sequence 1 only 8 (fewer candidates than picks); slots holding sinks, a
    prefetch (some of it beyond the quantized length, one entry invalid) and stale real-row picks;
    a ragged window; the tier holding every pair. With `discard`, correct at 0.9 against rows that
    chose the prefetch: the real rows themselves, but turned around (cosine -1) for every third KV
    head, which discards its prefetch. The prefetch held before is the slots' (reuse)."""
    g = torch.Generator().manual_seed(seed)
    b, h, group_size, window = 2, n_kv, 3, 24
    m = group_size * s
    keys = torch.randn(b, h, t + window, d, generator=g) * torch.linspace(0.2, 4, d)
    values = torch.randn(b, h, t + window, d, generator=g)
    k_packed, k_scale, k_zero = quantize_keys(keys[:, :, :t], bits, 32, torch.float16)
    v_packed, v_scale, v_zero = quantize_values(values[:, :, :t], bits, 32, torch.float16)
    v_mean = None
    if arithmetic == "sparse":
        v_mean = specache.sparse.value_means(v_packed, v_scale, v_zero, bits, 32)
    quantized_len = torch.tensor([t - 32, 8])
    slots = n_sinks + n_spec + n_real
    fetched_pos = torch.randint(0, t - 24, (b, h, slots), generator=g)
    fetched_pos[:, :, :n_sinks] = torch.arange(n_sinks)
    fetched_valid = torch.rand(b, h, slots, generator=g) > 0.2
    fetched_valid[:, :, :n_sinks] = True
    store_k, store_v = keys.to(dtype), values.to(dtype)
    fetched_k = store_k.gather(2, fetched_pos[..., None].expand(-1, -1, -1, d))
    fetched_v = store_v.gather(2, fetched_pos[..., None].expand(-1, -1, -1, d))
    window_len = torch.tensor([window, 9])
    window_k = torch.stack([store_k[0, :, t - 32 : t - 32 + window], store_k[1, :, 8 : 8 + window]])
    window_v = torch.stack([store_v[0, :, t - 32 : t - 32 + window], store_v[1, :, 8 : 8 + window]])
    # the model's own dtype (float32 here) beside 16-bit pairs
    new = torch.randn(b, h, 2 * s, d, generator=g)
    # the model's k, v for the new rows: a transposed view, as attention hands them over
    new_k, new_v = new[:, :, :s], new[:, :, s:].transpose(2, 3).contiguous().transpose(2, 3)
    rows = torch.randn(b, h, m, d, generator=g) * d**-0.5 * 3
    last_query = rows.view(b, h, group_size, s, d)[:, :, :, 0].clone()
    last_query[torch.arange(b * h).view(b, h) % 3 == 0] *= -1
    prefetch = slice(n_sinks, n_sinks + n_spec)
    return (
        rows,
        k_packed,
        k_scale,
        k_zero,
        v_packed,
        v_scale,
        v_zero,
        v_mean,
        bits,
        32,
        ARITHMETICS.index(arithmetic),
        math.exp(-2.0),  # the sparse pass's threshold: about half the positions skipped here
        quantized_len,
        fetched_k,
        fetched_v,
        fetched_pos,
        fetched_valid,
        window_k,
        window_v,
        window_len,
        new_k,
        new_v,
        store_k,
        store_v,
        n_picks,
        shortlist,
        last_query.flatten(1, 2) if discard else None,
        0.9,
        gqa_max,
        n_sinks,
        n_spec,
        quantized_len + torch.tensor([32, 0]),
        fetched_pos[:, :, prefetch].clone(),
        fetched_valid[:, :, prefetch].clone(),
        True,
    )


def discard_of(a):
    """(B, Hkv) bool or None: the KV heads the arguments `a` discard the prefetch of."""
    if a.last_query is None:
        return None
    return specache.select.prefetch_missed(a.rows, a.last_query, a.new_k.shape[2], a.correct_below)


def meaningful_slots(args, placed, kappa_valid):
    """(B, Hkv, K): slots whose content is specified: all but those a pick or a prefetch entry
    that is not real went to."""
    a = specache.ops.arguments(specache.step.step_attention_reference, args)
    fetched_pos, n_picks, n_sinks, n_spec = a.fetched_pos, a.n_picks, a.n_sinks, a.n_spec
    slots = fetched_pos.shape[-1]
    first = specache.select.first_pick_slot(fetched_pos, n_sinks, n_spec, discard_of(a))
    meaningful = torch.ones_like(a.fetched_valid)
    if n_picks:
        rank = (torch.arange(slots) - first).clamp(0, n_picks - 1)
        real_pick = placed.gather(2, rank)
        meaningful &= (torch.arange(slots) < first) | real_pick
    meaningful[:, :, n_sinks : n_sinks + n_spec] = kappa_valid
    return meaningful


@contextlib.contextmanager
def without_fallback():
    """The C++ implementation's fallback (the definition, as specache_plain::step_attention)
    raises: a call it does not take itself fails instead of passing as the definition."""

    def refuse(*args):
        raise AssertionError("the C++ step_attention handed the call to its fallback")

    library = torch.library.Library("specache_plain", "IMPL")
    with warnings.catch_warnings():  # torch warns that this overrides the definition: meant to
        warnings.simplefilter("ignore")
        library.impl("step_attention", refuse, "CPU")
    try:
        yield
    finally:
        library._destroy()


def assert_same_step(args):
    with without_fallback():
        fused = torch.ops.specache.step_attention(*args)
    with reference_ops():
        expected = torch.ops.specache.step_attention(*args)
    out, fetched_k, fetched_v, fetched_pos, fetched_valid, placed, kappa_pos, kappa_valid = fused[
        :8
    ]
    read, discarded = fused[8:]
    scale = expected[0].abs().max()
    # the definition run on the same C kernels, op by op: only the drop's order of additions
    # differs (a few ulps of the unnormalized low-bit terms, up to ~10x the output)
    on_kernels = specache.step.step_attention_reference(*args)[0]
    torch.testing.assert_close(out, on_kernels, atol=1e-5 * scale, rtol=1e-6)
    # on the plain ops: the kernels' own tolerance (1e-5 of the low-bit pass's largest terms),
    # which the drop amplifies where the picks take most of the low-bit weight
    torch.testing.assert_close(out, expected[0], atol=1e-4 * scale, rtol=1e-5)
    assert torch.equal(placed, expected[5])
    assert torch.equal(read, expected[8])
    assert torch.equal(discarded, expected[9])
    assert torch.equal(kappa_valid, expected[7])
    assert torch.equal(kappa_pos[kappa_valid], expected[6][kappa_valid])
    meaningful = meaningful_slots(args, expected[5], expected[7])
    assert torch.equal(fetched_pos[meaningful], expected[3][meaningful])
    assert torch.equal(fetched_valid, expected[4])
    assert torch.equal(fetched_k[meaningful], expected[1][meaningful])
    assert torch.equal(fetched_v[meaningful], expected[2][meaningful])
    return fused


def test_the_kernel_serves_the_op():
    """Where g++ builds specache/kernels/cpu_ops.cpp and step_cpu.cpp, the C++ implementation is
    registered (else the rest of this file would compare the reference with itself)."""
    assert torch.ops.specache.enable_step_attention()


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("arithmetic", ARITHMETICS)
@pytest.mark.parametrize("s", [1, 2])
def test_a_step_equals_the_composition(bits, arithmetic, s):
    step = assert_same_step(step_problem(bits=bits, arithmetic=arithmetic, s=s))
    placed, kappa_valid, discarded = step[5], step[7], step[9]
    # the problem exercises what it claims: picks placed and cut short, a prefetch chosen, every
    # third KV head's discarded
    assert placed[0].any() and not placed[1].all()
    assert kappa_valid.any()
    assert torch.equal(discarded, torch.arange(4).view(2, 2) % 3 == 0)


@pytest.mark.parametrize(
    "change",
    [
        {"discard": False},  # correct, no head discards: the real row's slots take 4 of 8 picks
        {"n_picks": 4, "discard": False},  # split without correct: picks fill the real slots
        {"n_picks": 0, "n_real": 0, "discard": False},  # the paper's rule: the prefetch alone
        {"n_spec": 0, "n_picks": 4, "discard": False},  # not speculative
        {"n_sinks": 0},
        {"gqa_max": False},
        {"dtype": torch.float16},
        {"dtype": torch.float32, "d": 128},
        {"shortlist": 4},  # the real row lists 32 and keeps the 8 its exact keys weigh most
        {"shortlist": 4, "gqa_max": False},
        {"shortlist": 4, "n_picks": 4, "discard": False},
        {"shortlist": 2, "bits": 2, "arithmetic": "int8", "s": 1},
        {"shortlist": 4, "arithmetic": "sparse", "dtype": torch.float32, "d": 128},
        {"shortlist": 3, "dtype": torch.float32, "d": 128},
        {"shortlist": 30},  # more listed than the copy holds: the list stops at T
    ],
)
def test_a_step_equals_the_composition_in_every_configuration(change):
    assert_same_step(step_problem(**change))


def test_the_shortlist_reads_its_list_and_keeps_other_picks():
    """The shortlist reads shortlist x the picks a KV head places (fewer where fewer positions
    are candidates) and keeps picks that the copy's ranking alone would not."""
    plain = assert_same_step(step_problem())
    listed = assert_same_step(step_problem(shortlist=4))
    held = step_problem()[ARGUMENT["held_pos"]], step_problem()[ARGUMENT["held_valid"]]

    def picks_read(step):  # read, less the prefetch's pairs
        return step[8] - specache.tiers.prefetch_reads(step[6], step[7], *held, True)

    placed, read = listed[5], picks_read(listed)
    assert torch.equal(picks_read(plain), plain[5].sum(-1))  # without it, the placed picks are read
    # sequence 0: 128 candidates; a KV head that discards its prefetch places 8, else 4
    discard = torch.tensor([True, False])
    assert torch.equal(read[0], torch.where(discard, 32, 16))
    assert (read[1] <= 8).all()  # sequence 1 has 8 quantized positions, some held in slots
    kept, kept_plain = listed[3][0, :, 6:], plain[3][0, :, 6:]
    assert placed[0].sum() == plain[5][0].sum()
    assert not torch.equal(kept.sort(-1).values, kept_plain.sort(-1).values)


def test_the_prefetch_counts_only_the_pairs_it_did_not_hold():
    """reuse: a prefetch position the previous prefetch held is not read again; the step's
    choices are the same whatever it held."""
    args = list(step_problem())
    held_nothing = torch.zeros_like(args[ARGUMENT["held_valid"]])
    args[ARGUMENT["held_valid"]] = held_nothing
    fresh = assert_same_step(args)
    kappa_pos, kappa_valid = fresh[6], fresh[7]
    held_valid = kappa_valid & (torch.arange(kappa_pos.shape[-1]) % 2 == 0)
    args[ARGUMENT["held_pos"]], args[ARGUMENT["held_valid"]] = kappa_pos, held_valid
    reused = assert_same_step(args)
    assert held_valid.any()
    assert torch.equal(reused[8], fresh[8] - held_valid.sum(-1))
    for a, b in zip(fresh[:8], reused[:8]):
        assert torch.equal(a, b)
    args[ARGUMENT["reuse"]] = False  # without reuse every pair of the prefetch is read
    assert torch.equal(assert_same_step(args)[8], fresh[8])


def test_with_threads_the_result_is_the_same():
    """KV heads run on threads (here 4 on 2): the same result."""
    args = step_problem(t=1024)
    single = assert_same_step(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with without_fallback():
            many = torch.ops.specache.step_attention(*args)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(single, many):
        assert torch.equal(a, b)


def test_too_few_picks_for_the_slots_is_an_error():
    """A KV head that discards its prefetch fills all 8 slots after the sinks: 6 picks cannot
    (the slots would repeat the last pick)."""
    with pytest.raises(ValueError, match="6 picks cannot fill the 4 real-row slots and the 4"):
        torch.ops.specache.step_attention(*step_problem(n_picks=6))


@pytest.mark.parametrize("broken", ["window_v", "window_len"])
def test_mismatched_inputs_are_refused_not_read_past(broken):
    """A window whose values are one position short, or one window length for two sequences:
    the kernel would read past them; the call goes to the definition, which refuses."""
    args = list(step_problem())
    if broken == "window_v":
        args[ARGUMENT["window_v"]] = args[ARGUMENT["window_v"]][:, :, :-1]
    else:
        args[ARGUMENT["window_len"]] = args[ARGUMENT["window_len"]][:1]
    with pytest.raises((ValueError, RuntimeError)):
        torch.ops.specache.step_attention(*args)


def test_shapes_the_kernels_do_not_take_go_to_the_reference():
    """Head dim 8 (the low-bit kernel wants multiples of 16): the definition answers, op by op."""
    args = step_problem(d=8)
    with pytest.raises(AssertionError, match="fallback"), without_fallback():
        torch.ops.specache.step_attention(*args)
    expected = specache.step.step_attention_reference(*args)
    for a, b in zip(torch.ops.specache.step_attention(*args), expected):
        assert torch.equal(a, b)


def strided(x):
    """x's values in a tensor whose last two dimensions are transposed in memory."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_the_op_passes_torch_library_opcheck():
    """The schema, the fake (shapes, dtypes and strides of the outputs) and the dispatch under
    AOT, on contiguous inputs and on strided rows and slots."""
    args = list(step_problem())
    torch.library.opcheck(torch.ops.specache.step_attention.default, tuple(args))
    for name in ("rows", "fetched_k", "fetched_v"):
        args[ARGUMENT[name]] = strided(args[ARGUMENT[name]])
    torch.library.opcheck(torch.ops.specache.step_attention.default, tuple(args))


def test_a_compiled_graph_around_the_op_takes_strided_inputs():
    """The fake's outputs are contiguous, as the kernel's are, whatever the inputs' strides: a
    fake that copied the rows' strides failed inductor's stride assertion."""
    args = list(step_problem())
    for name in ("rows", "fetched_k"):
        args[ARGUMENT[name]] = strided(args[ARGUMENT[name]])

    def around(*args):
        out, fetched_k = torch.ops.specache.step_attention(*args)[:2]
        return out * 2 + 1, fetched_k.float() + 1

    expected = around(*args)
    with without_fallback():
        compiled = torch.compile(around, fullgraph=True)(*args)
    for a, b in zip(expected, compiled):
        torch.testing.assert_close(a, b)


def test_the_op_under_torch_compile_matches_eager():
    args = step_problem()
    eager = torch.ops.specache.step_attention(*args)
    with without_fallback():
        compiled = torch.compile(torch.ops.specache.step_attention, fullgraph=True)(*args)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


class RecordSpeCacheOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The specache:: ops called under it, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "specache":
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arithmetic", ARITHMETICS)
def test_each_op_the_step_calls_passes_opcheck(arithmetic):
    """Every op's schema is derived from its reference's annotations and its fake reads the
    arguments by name (specache/ops.py's `declare`): opcheck holds each fake's outputs (shapes,
    dtypes, strides) and the schema (mutation, aliasing) against the real op, on the arguments a
    step really passes. A fake that read a wrong argument, or a schema whose outputs do not match
    the reference's, fails here."""
    with RecordSpeCacheOps() as recorded:
        specache.step.step_attention_reference(*step_problem(arithmetic=arithmetic))
    names = {func.__name__.split(".")[0] for func, _ in recorded.calls}
    lowbit = "lowbit_partial_attention" + ("" if arithmetic == "float" else f"_{arithmetic}")
    assert names == {lowbit, "merge_segments", "top_positions"}
    for func, args in recorded.calls:
        torch.library.opcheck(func, args)
