"""specache/kernels/lowbit_cpu: the C kernel (the -march=native build and a plain x86-64 one)
against specache's plain-PyTorch definition of the op, the op once the kernel is registered (and the
reference for shapes the kernel does not take), and the op under torch.compile.

Tolerances: the kernel folds scales into the query and the weights and adds in another order than
dequantize-then-matmul. A score is a sum of D float32 products, so both are off from the exact one
by a few roundings of the largest products (~1e-6 here), and a weight exp(score - max) by as much
relatively; out sums T weighted values, so its error follows the largest terms, not out itself.
Each output is compared within 1e-5 of the reference's largest magnitude plus 1e-5 relative: the
differences seen are up to 5e-6 of it, while one wrong code bit moves a score by s * |q| ~ 1e-2.
"""

import platform
import shutil
import time
import warnings

import pytest
import torch

import specache
from specache.kernels import cpu_build, lowbit_cpu
from specache.lowbit import LowBitKV, quantize_keys, quantize_values

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="no gcc: only the reference exists"
)


@pytest.fixture(autouse=True)
def one_thread():
    """These problems are small: on a busy machine torch's threads would only wait on each other.
    The kernel's threads are tested where a test asks for them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def native():
    assert lowbit_cpu.register(), "gcc is here but the kernel did not build"
    return lowbit_cpu.load(lowbit_cpu.build())


def lowbit_partial_attention_reference(rows, kv, visible_len, excluded_pos, excluded_valid):
    return specache.ops.lowbit_partial_attention_reference(
        rows, *kv[:6], kv.bits, kv.group, visible_len, excluded_pos, excluded_valid
    )


def lowbit_partial_attention(rows, kv, visible_len, excluded_pos, excluded_valid):
    """The op, as the package calls it."""
    return torch.ops.specache.lowbit_partial_attention(
        rows, *kv[:6], kv.bits, kv.group, visible_len, excluded_pos, excluded_valid
    )


@pytest.fixture(scope="module")
def portable():
    """The plain C path that machines without AVX-512 build (on x86, the only place to test it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-march=x86-64 needs an x86 machine")
    return lowbit_cpu.load(lowbit_cpu.build(cpu_build.PORTABLE_FLAGS))


def problem(
    bits=1, d=64, group=64, t=200, m=6, b=2, n_kv=2, scale_dtype=torch.float16, visible=None, seed=0
):
    """Rows, a low-bit copy of random K, V made by specache's quantizer (keys quantized over
    whole groups,
    then cut to T positions: the last group partial), a ragged visible_len and excluded positions:
    some valid, one invalid repeating a valid one's position, one valid beyond visible_len."""
    g = torch.Generator().manual_seed(seed)
    # outlier channels
    k = torch.randn(b, n_kv, -(-t // group) * group, d, generator=g) * torch.linspace(0.2, 4, d)
    v = torch.randn(b, n_kv, t, d, generator=g)
    k_packed, k_scale, k_zero = quantize_keys(k, bits, group, scale_dtype)
    kv = LowBitKV(
        k_packed[:, :, :t].contiguous(),
        k_scale,
        k_zero,
        *quantize_values(v, bits, group, scale_dtype),
        bits,
        group,
    )
    rows = torch.randn(b, n_kv, m, d, generator=g) * d**-0.5
    visible_len = torch.tensor(visible if visible is not None else [t, t - 37][:b])
    pos = torch.stack([torch.randperm(t, generator=g)[:6] for _ in range(b * n_kv)]).view(
        b, n_kv, 6
    )
    valid = torch.ones_like(pos, dtype=torch.bool)
    pos[..., 4], valid[..., 4] = pos[..., 0], False  # an invalid slot at a valid slot's position
    pos[..., 5] = visible_len.clamp(max=t - 1)[:, None]  # at visible_len: past it, unless it is T
    valid[..., 1] = False
    return rows, kv, visible_len, pos, valid


def assert_matches(got, want):
    for name, x, y in zip(("weights", "row_max", "row_sum", "out"), got, want):
        assert x.shape == y.shape and x.dtype == y.dtype == torch.float32, name
        finite = y.isfinite()
        assert torch.equal(finite, x.isfinite()), f"{name}: -inf in other places"
        assert not x[y == 0].any(), f"{name}: not exactly 0 where the reference is"
        scale = y[finite].abs().max().item() if finite.any() else 1.0
        torch.testing.assert_close(x[finite], y[finite], rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2])
def test_kernel_matches_reference(native, bits, d, scale_dtype, group, m):
    for visible in ([0, 203], [1, group - 1]):  # T = 203 is a multiple of neither 16 nor the group
        rows, kv, visible_len, pos, valid = problem(
            bits, d, group, t=203, m=m, scale_dtype=scale_dtype, visible=visible
        )
        pos[0, 0, 0], valid[0, 0, 0] = 0, True  # sequence 0, head 0 then sees nothing
        got = lowbit_cpu.run_kernel(native, rows, kv, visible_len, pos, valid)
        assert_matches(got, lowbit_partial_attention_reference(rows, kv, visible_len, pos, valid))
        assert (
            (got[1][0, 0] == float("-inf")).all()
            and not got[0][0, 0].any()
            and not got[3][0, 0].any()
        )
        assert not got[0][1, :, :, visible[1] :].any()  # nothing past visible_len


@pytest.mark.parametrize(
    "shape",
    [
        dict(d=64, group=64),
        dict(d=128, group=32, bits=2, scale_dtype=torch.bfloat16),
        dict(d=48, group=24),
        dict(d=96, group=32, bits=2),
        dict(d=64, group=8),
    ],
)
def test_plain_build_and_odd_shapes_match_reference(native, portable, shape):
    """The x86-64 build runs everything in plain C; odd shapes take plain C in the native build
    too."""
    inputs = problem(t=150, **shape)
    want = lowbit_partial_attention_reference(*inputs)
    assert_matches(lowbit_cpu.run_kernel(portable, *inputs), want)
    assert_matches(lowbit_cpu.run_kernel(native, *inputs), want)


@pytest.mark.parametrize("bits", [1, 2])
def test_long_context_in_many_tasks_is_independent_of_threads(native, bits):
    inputs = problem(
        bits, 128, 64, t=3000, m=8, n_kv=3, scale_dtype=torch.bfloat16, visible=[3000, 1234]
    )
    one = lowbit_cpu.run_kernel(native, *inputs)
    torch.set_num_threads(2)  # the one_thread fixture restores the count
    two = lowbit_cpu.run_kernel(native, *inputs)
    assert_matches(one, lowbit_partial_attention_reference(*inputs))
    for x, y in zip(one, two):
        assert torch.equal(x, y)


def test_exp_is_accurate_to_a_few_ulps(native, portable):
    """Rows picking one key channel make every score exact in float32 (code * s + z, one rounding,
    as in the reference), so the weights test exp itself: scores spread over [-80, 0] after the
    max."""
    rows, kv, visible_len, pos, valid = problem(2, 64, 16, t=4096, m=1, b=1, n_kv=1)
    k_packed, k_scale, k_zero = quantize_keys(
        torch.linspace(-80, 0, 4096).view(1, 1, 4096, 1).expand(1, 1, 4096, 64),
        2,
        16,
        torch.float16,
    )
    kv = kv._replace(k_packed=k_packed, k_scale=k_scale, k_zero=k_zero)
    rows = torch.zeros_like(rows)
    rows[..., 0] = 1.0
    want = lowbit_partial_attention_reference(rows, kv, visible_len, pos, valid)[0]
    assert want[want > 0].min() < 1e-34 and want.max() == 1.0
    for lib in (native, portable):
        got = lowbit_cpu.run_kernel(lib, rows, kv, visible_len, pos, valid)[0]
        # ~3 ulp; the error seen is 1 ulp
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-37)


def test_the_op_runs_the_kernel_once_registered_and_the_reference_where_it_cannot(native):
    inputs = problem(1, 64, 64)
    want = lowbit_partial_attention_reference(*inputs)
    fast = lowbit_partial_attention(*inputs)
    assert_matches(fast, want)
    assert not all(torch.equal(x, y) for x, y in zip(fast, want))  # it is not the reference
    # shapes the kernel does not take
    for odd in (
        dict(d=40, bits=2, group=40),
        dict(d=64, group=4),
    ):
        inputs = problem(t=150, **odd)
        assert all(
            torch.equal(x, y)
            for x, y in zip(
                lowbit_partial_attention(*inputs), lowbit_partial_attention_reference(*inputs)
            )
        )


def test_cpp_dispatch_runs_the_same_kernel_as_the_python_one(native):
    """specache/kernels/cpu_ops.cpp's implementation of the op (where g++ builds it) and the
    ctypes one."""
    inputs = problem(2, 128, 32)
    assert all(
        torch.equal(x, y)
        for x, y in zip(lowbit_partial_attention(*inputs), lowbit_cpu.run_kernel(native, *inputs))
    )


@pytest.mark.parametrize("why", ["no gcc", "SPECACHE_NO_CPU_KERNEL=1"])
def test_without_a_kernel_register_is_false_with_one_warning_at_most(native, monkeypatch, why):
    if why == "no gcc":
        monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    else:
        monkeypatch.setenv("SPECACHE_NO_CPU_KERNEL", "1")
    lowbit_cpu.register.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not lowbit_cpu.register()
            assert not lowbit_cpu.register()
        assert len(caught) == (why == "no gcc") and all(
            "unavailable" in str(w.message) for w in caught
        )
    finally:
        lowbit_cpu.register.cache_clear()
        monkeypatch.undo()
        assert lowbit_cpu.register()


def test_build_is_cached_by_content_in_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = ("-O1", "-march=x86-64", "-fopenmp", "-shared", "-fPIC")
    path = lowbit_cpu.build(flags)
    assert path.parent == tmp_path / "specache" and path.exists()
    stamp = path.stat().st_mtime_ns
    time.sleep(0.01)
    assert lowbit_cpu.build(flags) == path and path.stat().st_mtime_ns == stamp  # not rebuilt
    assert lowbit_cpu.build(flags[1:]) != path  # other flags, another file
    assert sorted(p.suffix for p in path.parent.iterdir()) == [".so", ".so"]  # no temporary left


def test_fullgraph_compile_keeps_one_opaque_op(native):
    inputs = problem(2, 64, 32)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def attend(rows, kv, visible_len, pos, valid):
        weights, row_max, row_sum, out = lowbit_partial_attention(
            rows * 1.0, kv, visible_len, pos, valid
        )
        return weights, row_max, row_sum, out

    got = torch.compile(attend, fullgraph=True, backend=backend)(*inputs)
    op = torch.ops.specache.lowbit_partial_attention
    # the op, the product, 4 getitems
    assert ops.count(op) + ops.count(op.default) == 1 and len(ops) == 6
    assert_matches(got, lowbit_partial_attention_reference(*inputs))
    torch._dynamo.reset()
    assert_matches(
        torch.compile(attend, fullgraph=True)(*inputs), lowbit_partial_attention_reference(*inputs)
    )


def test_visible_len_outside_the_copy_is_clamped(native):
    inputs = problem(2, 128, 64, t=200, visible=[500, -3])
    got = lowbit_cpu.run_kernel(native, *inputs)
    assert_matches(got, lowbit_partial_attention_reference(*inputs))
    assert (got[0][0] > 0).sum(-1).min() >= 200 - 4 and (
        got[1][1] == float("-inf")
    ).all()  # T but 4 excluded; none


def test_non_contiguous_inputs_are_made_contiguous(native):
    rows, kv, visible_len, pos, valid = problem(1, 64, 64)
    strided = rows.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not strided.is_contiguous()
    assert_matches(
        lowbit_cpu.run_kernel(native, strided, kv, visible_len, pos, valid),
        lowbit_partial_attention_reference(rows, kv, visible_len, pos, valid),
    )


BAD_INPUTS = {
    "rows float64": lambda r, kv, *x: (r.double(), kv, *x),
    "rows 3-d": lambda r, kv, *x: (r[0], kv, *x),
    "rows of another head_dim": lambda r, kv, *x: (r[..., :40], kv, *x),
    "bits 3": lambda r, kv, *x: (r, kv._replace(bits=3), *x),
    "group of other key groups": lambda r, kv, *x: (r, kv._replace(group=12), *x),
    "float32 scales": lambda r, kv, *x: (r, kv._replace(k_scale=kv.k_scale.float()), *x),
    "value scales of other dtype": lambda r, kv, *x: (
        r,
        kv._replace(v_scale=kv.v_scale.bfloat16()),
        *x,
    ),
    "too few key groups": lambda r, kv, *x: (r, kv._replace(k_scale=kv.k_scale[:, :, 1:]), *x),
    "packed values of other length": lambda r, kv, *x: (
        r,
        kv._replace(v_packed=kv.v_packed[:, :, 1:]),
        *x,
    ),
    "visible_len int32": lambda r, kv, v, p, ok: (r, kv, v.int(), p, ok),
    "excluded_valid not bool": lambda r, kv, v, p, ok: (r, kv, v, p, ok.long()),
    "excluded shapes differ": lambda r, kv, v, p, ok: (r, kv, v, p, ok[..., 1:]),
}


@pytest.mark.parametrize("corrupt", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(native, corrupt):
    """The checks that guard the kernel's reads and writes: in C++ (the op) and in Python
    (ctypes)."""
    inputs = corrupt(*problem(1, 64, 64))
    with pytest.raises(ValueError, match="lowbit_partial_attention"):
        lowbit_partial_attention(*inputs)
    with pytest.raises(ValueError, match="lowbit_partial_attention"):
        lowbit_cpu.run_kernel(native, *inputs)


@pytest.mark.parametrize("pass_name", ["float", "int8", "sparse"])
@pytest.mark.parametrize("t, group", [(200, 64), (1000, 32), (20000, 64)])
def test_every_pass_gives_the_step_each_rows_largest_weight_per_block(pass_name, t, group):
    """The one-op step's rankings skip blocks by the low-bit pass's block_max (rank_cpu.c's
    rank_bounded): every kernel writes each row's largest weight per block of 64 positions,
    equal to the weights' own (0 past what is visible, and where nothing is), whatever the tasks
    and threads; a bound below a block's weights would make the step choose other positions."""
    from specache.kernels import lowbit_int_cpu, lowbit_sparse_cpu
    from specache.sparse import value_means

    module = {"float": lowbit_cpu, "int8": lowbit_int_cpu, "sparse": lowbit_sparse_cpu}[pass_name]
    function = "lowbit_partial_attention" if pass_name == "float" else module.FUNCTION
    lib = module.load(module.build())
    rows, kv, visible_len, pos, valid = problem(t=t, group=group)
    problem_, inputs, outputs = lowbit_cpu.prepare(rows, kv, visible_len, pos, valid)
    kept = torch.empty(kv.k_packed.shape[:3], dtype=torch.bool)
    v_mean = value_means(*kv[3:6], kv.bits, kv.group)
    if pass_name == "sparse":
        problem_.v_mean, problem_.kept = v_mean.data_ptr(), kept.data_ptr()
        problem_.min_weight = 0.01
    block_max = torch.full(rows.shape[:3] + (-(-t // 64),), float("nan"))
    problem_.block_max = block_max.data_ptr()
    torch.set_num_threads(2)
    lowbit_cpu.call(lib, function, problem_)
    weights = outputs[0]
    expected = torch.nn.functional.pad(weights, (0, -t % 64)).unflatten(-1, (-1, 64)).amax(-1)
    assert torch.equal(block_max, expected)
