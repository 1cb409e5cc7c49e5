"""specache/kernels/rank_cpu: SpeCache's choice of positions in one C op, against its plain-PyTorch
reference (the native build and a plain x86-64 one), through the C++ dispatch and under
torch.compile.

The rankings here are random floats, so no two candidates tie and both must choose the same
positions in the same order. tests/test_specache.py checks the op against a per-KV-head softmax
over the dequantized copy (an independent reference), and the whole selection through SpeCache's
layer against the reference decoder.
"""

import ctypes
import platform
import shutil

import pytest
import torch

from specache.kernels import cpu_build, rank_cpu
from specache.ops import parameter_names, top_positions_reference

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="no gcc: only the reference exists"
)


@pytest.fixture(scope="module")
def native():
    assert rank_cpu.register(), "gcc is here but the kernel did not build"
    return rank_cpu.load(rank_cpu.build())


@pytest.fixture(scope="module")
def portable():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-march=x86-64 needs an x86 machine")
    return rank_cpu.load(rank_cpu.build(cpu_build.PORTABLE_FLAGS))


def problem(b=2, h=3, g=3, s=2, t=300, n_fetched=9, n_window=16, n_excluded=12, seed=0):
    """Random inputs in the layout SpeCache's layer passes: fetched slots that repeat positions and
    fall outside [0, T), a window that runs past the copy, exclusions with invalid repeats."""
    torch.manual_seed(seed)
    m = g * s
    fetched_pos = torch.randint(-2, t + 3, (b, h, n_fetched))
    if n_fetched > 1:
        fetched_pos[..., 1] = fetched_pos[..., 0]  # two slots, one position: their weights add
    excluded_pos = torch.randint(-2, t + 3, (b, h, n_excluded))
    excluded_valid = torch.rand(b, h, n_excluded) < 0.6
    if n_excluded > 1:  # an invalid repeat of a valid slot
        excluded_pos[..., 1], excluded_valid[..., 1] = excluded_pos[..., 0], False
    return dict(
        weights=torch.rand(b, h, m, t),
        scale=torch.rand(b, h, m, 1),
        p_fetched=torch.rand(b, h, m, n_fetched),
        fetched_pos=fetched_pos,
        p_window=torch.rand(b, h, m, n_window),
        window_start=torch.randint(max(t - n_window - 4, 0), t + 1, (b,)),
        excluded_pos=excluded_pos,
        excluded_valid=excluded_valid,
    )


def ordered(inputs, **options):
    """specache::top_positions's arguments in its order: `inputs` (a `problem`) and the options,
    with defaults."""
    args = dict(
        inputs,
        s=options.get("s", 2),
        row=options.get("row", 0),
        gqa_max=options.get("gqa_max", True),
        lower=options.get("lower", 0),
        upper=options["upper"],
        k=options.get("k", 16),
    )
    return [args[name] for name in parameter_names(top_positions_reference)]


def both(lib, inputs, **options):
    args = ordered(inputs, **options)
    return rank_cpu.run_kernel(lib, *args), top_positions_reference(*args)


def assert_same_choice(kernel, reference):
    (indices, valid), (ref_indices, ref_valid) = kernel, reference
    assert torch.equal(valid, ref_valid)
    assert torch.equal(torch.where(valid, indices, -1), torch.where(ref_valid, ref_indices, -1))
    assert (
        (indices >= 0) & (indices < 10**6)
    ).all()  # invalid entries still point somewhere harmless


@pytest.mark.parametrize("row", [0, 1])
@pytest.mark.parametrize("gqa_max", [True, False])
@pytest.mark.parametrize("lower", [0, 4])
def test_kernel_matches_reference(native, row, gqa_max, lower):
    inputs = problem()
    upper = torch.tensor([250, 300])
    assert_same_choice(*both(native, inputs, row=row, gqa_max=gqa_max, lower=lower, upper=upper))


@pytest.mark.parametrize(
    "shape",
    [
        dict(b=1, h=1, g=1, s=1, t=70),
        dict(b=3, h=2, g=4, s=2, t=1000),
        dict(b=1, h=3, g=3, s=2, t=20000, n_fetched=68, n_window=128, n_excluded=68),
    ],
)
def test_plain_build_and_other_shapes_match_reference(native, portable, shape):
    inputs = problem(**shape)
    b, t, s = shape["b"], shape["t"], shape["s"]
    upper = torch.randint(t // 2, t + 5, (b,))
    for lib in (native, portable):
        assert_same_choice(*both(lib, inputs, s=s, row=s - 1, upper=upper, k=32))


@pytest.mark.parametrize("gqa_max", [True, False])
@pytest.mark.parametrize("t, k", [(1000, 128), (1000, 700), (20000, 512)])
def test_long_lists_match_reference(native, gqa_max, t, k):
    """From k = 128 on (a shortlist's list) a radix floor bounds what enters the heap: the same
    choice, in the same order; sequence 0 has fewer candidates than k."""
    inputs = problem(t=t, n_fetched=68, n_window=32)
    upper = torch.tensor([k // 2, t])
    (indices, valid), reference = both(native, inputs, gqa_max=gqa_max, upper=upper, k=k)
    assert not valid[0].all() and valid[1].all()
    assert_same_choice((indices, valid), reference)


def test_long_lists_with_few_distinct_weights_keep_ties_in_order(native):
    """Weights in four values: the k-th best shares its value (and the floor's bin) with hundreds
    of positions, of which the earliest win, best first."""
    inputs = problem(b=1, h=2, t=2000, n_fetched=0, n_window=0, n_excluded=0)
    weights = torch.randint(1, 5, (1, 2, 1, 2000)).float() / 4
    inputs["weights"] = weights.expand_as(inputs["weights"]).contiguous()
    inputs["scale"] = torch.ones_like(inputs["scale"])
    (indices, valid), _ = both(native, inputs, upper=torch.tensor([2000]), k=300)
    expected = torch.sort(-weights[:, :, 0], stable=True).indices[..., :300]
    assert valid.all() and torch.equal(indices, expected)


def test_fewer_candidates_than_k_are_marked_invalid(native):
    inputs = problem(t=64)
    inputs["excluded_valid"][:] = False
    upper = torch.tensor([10, 3])  # sequence 1: positions 1, 2 only (lower 1)
    (indices, valid), reference = both(native, inputs, lower=1, upper=upper, k=12)
    assert valid.sum(-1).tolist() == [[9] * 3, [2] * 3]
    assert_same_choice((indices, valid), reference)
    none, _ = both(native, inputs, lower=5, upper=torch.tensor([5, 0]), k=4)  # an empty range
    assert not none[1].any()


def test_ties_go_to_the_earlier_position(native):
    inputs = problem(b=1, h=1, t=100, n_fetched=0, n_window=0, n_excluded=0)
    inputs["weights"][:] = 0.5
    (indices, valid), _ = both(native, inputs, lower=7, upper=torch.tensor([100]), k=5)
    assert indices.tolist() == [[[7, 8, 9, 10, 11]]] and valid.all()


def test_k_zero_and_an_empty_history(native):
    inputs = problem(b=1, t=50)
    (indices, valid), _ = both(native, inputs, upper=torch.tensor([50]), k=0)
    assert indices.shape == (1, 3, 0)
    empty = problem(b=1, t=0, n_window=0, n_fetched=0, n_excluded=0)
    (indices, valid), _ = both(native, empty, upper=torch.tensor([0]), k=0)
    assert indices.shape == (1, 3, 0)


def test_does_not_depend_on_threads(native):
    inputs = problem(b=2, h=3, g=3, t=40000, n_fetched=68, n_window=128)
    upper = torch.tensor([39000, 40000])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = both(native, inputs, upper=upper, k=64)
        torch.set_num_threads(2)
        two, reference = both(native, inputs, upper=upper, k=64)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert_same_choice(two, reference)


def test_cpp_dispatch_and_compile_run_the_kernel(native):
    """The op once the kernel is registered (C++ dispatch where it builds), a fullgraph compile of
    it, and the ctypes call give the same choice."""
    inputs = problem(t=500)
    upper = torch.tensor([480, 500])
    args = (
        inputs["weights"],
        inputs["scale"],
        inputs["p_fetched"],
        inputs["fetched_pos"],
        inputs["p_window"],
        inputs["window_start"],
        2,
        1,
        True,
        4,
        upper,
        inputs["excluded_pos"],
        inputs["excluded_valid"],
        20,
    )
    direct = rank_cpu.run_kernel(native, *args)
    op = torch.ops.specache.top_positions
    public = op(*args)
    compiled = torch.compile(lambda *args: op(*args), fullgraph=True, backend="aot_eager")(*args)
    for other in (public, compiled):
        assert torch.equal(direct[0], other[0]) and torch.equal(direct[1], other[1])


@pytest.mark.parametrize(
    "corrupt",
    ["weights dtype", "no query rows", "scale shape", "fetched_pos shape", "upper dtype", "row"],
)
def test_bad_inputs_raise_value_error(native, corrupt):
    inputs = problem(t=40)
    upper, row = torch.tensor([40, 40]), 0
    if corrupt == "weights dtype":
        inputs["weights"] = inputs["weights"].double()
    # nothing to rank by: an error, not a choice from uninitialized memory
    elif corrupt == "no query rows":
        inputs["weights"] = inputs["weights"][:, :, :0]
    elif corrupt == "scale shape":
        inputs["scale"] = inputs["scale"][:, :, :3]
    elif corrupt == "fetched_pos shape":
        inputs["fetched_pos"] = inputs["fetched_pos"][..., :2]
    elif corrupt == "upper dtype":
        upper = upper.int()
    else:
        row = 2
    with pytest.raises(ValueError, match="top_positions"):
        both(native, inputs, upper=upper, row=row)


def test_a_copy_of_the_problem_struct_that_disagrees_is_refused(native):
    """The C struct is copied in ctypes (rank_cpu._Problem) and in C++ (cpu_ops.h's RankProblem),
    and a copy that lost or gained a field would have the kernel read past it: each is held to the
    C library's problem_bytes() when it loads, the ctypes copy by cpu_build.load and the C++ copy
    by specache::set_cpu_kernel."""
    from specache.kernels import cpu_ops

    class Longer(ctypes.Structure):
        _fields_ = rank_cpu._Problem._fields_ + [("extra", ctypes.c_int64)]

    with pytest.raises(RuntimeError, match="must agree field for field"):
        cpu_build.load(rank_cpu.build(), "top_positions", Longer)
    if not cpu_ops.loaded():
        pytest.skip("the C++ dispatch is not built here")
    address = cpu_ops.address(native, "top_positions")
    with pytest.raises(RuntimeError, match="must agree field for field"):
        torch.ops.specache.set_cpu_kernel("top_positions", address, native.problem_bytes() + 8)
    torch.ops.specache.set_cpu_kernel("top_positions", address, native.problem_bytes())


def block_maxima(weights, inflate=1.0):
    """(B, Hkv, M, ceil(T/64)): each row's largest weight per block of 64 positions, as the one-op
    step's low-bit pass writes it (`inflate` > 1: a looser bound, still a bound)."""
    t = weights.shape[-1]
    padded = torch.nn.functional.pad(weights, (0, -t % 64))
    return padded.unflatten(-1, (-1, 64)).amax(-1) * inflate


def peaked(inputs, seed=1):
    """Most weight on a few positions, as at long context: small low-bit weights elsewhere,
    probabilities of the fetched slots and the window large enough to matter."""
    g = torch.Generator().manual_seed(seed)
    weights = inputs["weights"] ** 8 * 1e-3
    heavy = torch.randint(0, weights.shape[-1], (40,), generator=g)
    weights[..., heavy] = torch.rand(weights.shape[:-1] + (40,), generator=g)
    return dict(inputs, weights=weights)


@pytest.mark.parametrize("gqa_max", [True, False])
@pytest.mark.parametrize("k", [1, 32, 256])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
@pytest.mark.parametrize("inflate", [1.0, 4.0])
def test_block_bounds_choose_what_the_whole_ranking_chooses(native, gqa_max, k, kind, inflate):
    """With each row's largest weight per block (the one-op step's), the kernel skips the blocks
    whose bound is below its heap's root: the same positions in the same order, torch.equal, on
    peaked and flat rankings and on ties (a bound equal to the root must not end the scan: a tie
    at an earlier position wins), with the fetched slots' and the window's probabilities."""
    inputs = problem(b=2, h=3, g=3, s=2, t=5000, n_fetched=68, n_window=128, n_excluded=68)
    if kind == "peaked":
        inputs = peaked(inputs)
    if kind == "ties":
        inputs["weights"] = (inputs["weights"] * 4).floor() / 4
        inputs["p_fetched"].zero_()
        inputs["p_window"].zero_()
    upper = torch.tensor([4000, 5000])
    for row in (0, 1):
        args = ordered(inputs, row=row, gqa_max=gqa_max, lower=4, upper=upper, k=k)
        whole = rank_cpu.run_kernel(native, *args)
        bounded = rank_cpu.run_kernel(
            native, *args, block_max=block_maxima(inputs["weights"], inflate)
        )
        assert torch.equal(whole[0], bounded[0]) and torch.equal(whole[1], bounded[1])
        if kind != "ties":  # torch's topk orders ties as it likes; the kernel by position
            assert_same_choice(bounded, top_positions_reference(*args))


def test_a_bound_below_a_blocks_weights_changes_the_choice(native):
    """The test above can fail: a block_max that understates a block (half its largest weight)
    makes the kernel skip positions it should choose."""
    inputs = peaked(problem(b=1, h=1, g=3, s=2, t=5000, n_fetched=8, n_window=16))
    args = ordered(inputs, upper=torch.tensor([5000]), k=32)
    whole = rank_cpu.run_kernel(native, *args)
    understated = rank_cpu.run_kernel(native, *args, block_max=block_maxima(inputs["weights"], 0.5))
    assert not torch.equal(whole[0], understated[0])


def test_a_block_whose_bound_ties_the_root_is_still_read(native):
    """Ties go to the earlier position: a block whose bound equals the heap's root can hold a
    tie that wins (here the loose bound of block 5 puts it first, and block 2's tie at position
    130 must replace its 330). A scan that stopped at a bound equal to the root fails."""
    inputs = problem(b=1, h=1, g=1, s=1, t=640, n_fetched=4, n_window=4, n_excluded=2)
    inputs["weights"] = torch.full((1, 1, 1, 640), 0.1)
    inputs["weights"][..., [130, 330]] = 0.75
    inputs["scale"] = torch.ones(1, 1, 1, 1)
    inputs["p_fetched"].zero_()
    inputs["p_window"].zero_()
    inputs["excluded_valid"].zero_()
    bounds = block_maxima(inputs["weights"])
    bounds[..., 5] = 1.0  # still a bound on block 5
    args = ordered(inputs, s=1, upper=torch.tensor([640]), k=1)
    indices, valid = rank_cpu.run_kernel(native, *args, block_max=bounds)
    assert valid.all() and indices.flatten().tolist() == [130]


@pytest.mark.parametrize("sampled", ["too high", "verified"])
def test_a_sampled_floor_counts_only_where_k_positions_reach_it(native, sampled):
    """From k = 128 on, the kernel takes a floor for the k-th best from every 16th position where
    at least k positions reach it. Here every 16th position weighs 1 and the rest less: with k above
    their number, the sample's floor (1) would leave too few, and the kernel must find another."""
    t = 20000
    inputs = problem(b=1, h=2, t=t, n_fetched=0, n_window=0, n_excluded=0)
    weights = torch.rand(1, 2, 1, t) * 0.5
    weights[..., ::16] = 1.0
    inputs["weights"] = weights.expand_as(inputs["weights"]).contiguous()
    inputs["scale"] = torch.ones_like(inputs["scale"])
    k = t // 16 + 300 if sampled == "too high" else 512
    (indices, valid), _ = both(native, inputs, upper=torch.tensor([t]), k=k)
    expected = torch.sort(-weights[:, :, 0], stable=True).indices[..., :k]
    assert valid.all() and torch.equal(indices, expected)
