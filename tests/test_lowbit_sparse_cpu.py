"""specache/kernels/lowbit_sparse_cpu: the sparse low-bit pass (the -march=native build, an AVX2
one and a plain x86-64 one) against the integer kernel and its plain-PyTorch twin in specache/.

Exactness: its scores and softmax are the integer kernel's own code, so weights, row_max and
row_sum equal that kernel's bit for bit on the same build. `kept` is a comparison of those weights
with min_weight, so it equals `kept_positions` of the kernel's own weights exactly, and the twin's
kept wherever no row's weight lies within 1e-5 of min_weight (the weights differ from the twin's in
their last bits). `out` is checked against the twin's mix (`sparse_value_mix`) of the kernel's own
weights and kept, where only float summation order remains: within 1e-5 of the largest |out|. One
wrong code bit moves a kept value by its scale (~1e-1 of it), a lost mean term by the group's
skipped weight times its mean.
"""

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_lowbit_cpu import problem

import specache
from specache.kernels import cpu_build, lowbit_int_cpu, lowbit_sparse_cpu
from specache.ops import Segments, lowbit_partial_attention
from specache.sparse import kept_positions, sparse_value_mix, value_means

pytestmark = pytest.mark.skipif(
    cpu_build.shutil.which("gcc") is None, reason="no gcc: only the twin exists"
)
HASWELL = ("-O3", "-march=haswell", "-fopenmp", "-shared", "-fPIC")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def libraries(flags: tuple[str, ...]):
    """The sparse and the integer kernel built with `flags`."""
    sparse = lowbit_sparse_cpu.load(lowbit_sparse_cpu.build(flags))
    return sparse, lowbit_int_cpu.load(lowbit_int_cpu.build(flags))


@pytest.fixture(scope="module")
def native():
    assert lowbit_sparse_cpu.register(), "gcc is here but the kernel did not build"
    return libraries(cpu_build.FLAGS)


@pytest.fixture(scope="module")
def portable():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-march=x86-64 needs an x86 machine")
    libs = libraries(cpu_build.PORTABLE_FLAGS)
    assert lowbit_sparse_cpu.path_of(libs[0]) == "plain C"
    return libs


@pytest.fixture(scope="module")
def avx2(portable):
    """The AVX2 path, as machines with AVX2 but not AVX512-VNNI build it."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or "avx2" not in cpuinfo.read_text():
        pytest.skip("no /proc/cpuinfo, or this CPU has no AVX2")
    libs = libraries(HASWELL)
    assert lowbit_sparse_cpu.path_of(libs[0]) == "AVX2"
    return libs


def sparse_problem(*args, **kwargs):
    """test_lowbit_cpu's problem, its copy with each key group's mean value."""
    rows, kv, visible_len, pos, valid = problem(*args, **kwargs)
    v_mean = value_means(kv.v_packed, kv.v_scale, kv.v_zero, kv.bits, kv.group)
    return rows, kv._replace(v_mean=v_mean), visible_len, pos, valid


def twin(rows, kv, min_weight, visible_len, pos, valid):
    return specache.ops.lowbit_partial_attention_sparse_reference(
        rows, *kv[:6], kv.v_mean, kv.bits, kv.group, min_weight, visible_len, pos, valid
    )


def op(rows, kv, min_weight, visible_len, pos, valid):
    """The op, as the package calls it."""
    return torch.ops.specache.lowbit_partial_attention_sparse(
        rows, *kv[:6], kv.v_mean, kv.bits, kv.group, min_weight, visible_len, pos, valid
    )


def assert_exact(libs, rows, kv, min_weight, visible_len, pos, valid):
    """The sparse kernel of `libs` on the problem, held to the integer kernel of the same build, to
    the twin's kept away from the threshold and to the twin's mix of its own weights and kept."""
    sparse, integer = libs
    got = lowbit_sparse_cpu.run_kernel(sparse, rows, kv, min_weight, visible_len, pos, valid)
    same = lowbit_int_cpu.run_kernel(integer, rows, kv, visible_len, pos, valid)
    for name, x, y in zip(("weights", "row_max", "row_sum"), got, same):
        assert torch.equal(x, y), f"{name}: not the integer kernel's"
    assert got.kept.dtype == torch.bool
    assert torch.equal(got.kept, kept_positions(got.weights, min_weight))
    want = twin(rows, kv, min_weight, visible_len, pos, valid)
    clear = ((want.weights - min_weight).abs() > 1e-5).all(2)
    assert torch.equal(got.kept[clear], want.kept[clear])
    mix = sparse_value_mix(got.weights, got.kept, *kv[3:6], kv.v_mean, kv.bits, kv.group)
    scale = max(mix.abs().max().item(), 1e-30)
    torch.testing.assert_close(got.out, mix, rtol=1e-5, atol=1e-5 * scale, msg="out")
    return got


@pytest.mark.parametrize("tau", [1.0, 4.0])
@pytest.mark.parametrize("m", [1, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2])
def test_kernel_matches_the_integer_kernel_and_its_twin(
    native, bits, d, scale_dtype, group, m, tau
):
    for visible in ([0, 203], [1, group - 1]):  # T = 203 is a multiple of neither 16 nor 64
        rows, kv, visible_len, pos, valid = sparse_problem(
            bits, d, group, t=203, m=m, scale_dtype=scale_dtype, visible=visible
        )
        pos[0, 0, 0], valid[0, 0, 0] = 0, True  # sequence 0, head 0 then sees nothing
        got = assert_exact(native, rows, kv, math.exp(-tau), visible_len, pos, valid)
        assert not got.kept[0, 0].any() and not got.out[0, 0].any()
        assert not got.kept[1, :, visible[1] :].any()
        kept = got.kept[1, :, : visible[1]].float().mean().item()
        assert 0 < kept < 1, f"tau {tau}: {kept:.0%} kept, the mix's two parts are not both tested"
        assert not got.kept[1, 0, pos[1, 0][valid[1, 0]]].any()  # excluded: weight 0


@pytest.mark.parametrize("bits", [1, 2])
def test_all_kept_mixes_every_value_and_none_kept_only_the_means(native, bits):
    rows, kv, visible_len, pos, valid = sparse_problem(bits, 128, 64, t=300)
    values = specache.lowbit.dequantize_values(*kv[3:6], bits, 64)
    everything = assert_exact(native, rows, kv, 0.0, visible_len, pos, valid)
    assert torch.equal(everything.kept, (everything.weights > 0).any(2))
    scale = (everything.weights @ values).abs().max().item()
    torch.testing.assert_close(
        everything.out, everything.weights @ values, rtol=1e-5, atol=1e-5 * scale
    )
    nothing = assert_exact(native, rows, kv, 1.5, visible_len, pos, valid)
    assert not nothing.kept.any()
    per_group = torch.nn.functional.pad(nothing.weights, (0, -300 % 64)).unflatten(-1, (-1, 64))
    means = per_group.sum(-1) @ kv.v_mean.float()
    torch.testing.assert_close(nothing.out, means, rtol=1e-5, atol=1e-5 * means.abs().max().item())


@pytest.mark.parametrize(
    "shape",
    [
        dict(d=64, group=64),
        dict(d=128, group=32, bits=2, scale_dtype=torch.bfloat16),
        dict(d=256, group=64, m=3),
        dict(d=48, group=24),
        dict(d=64, group=8, bits=2),
        dict(d=128, group=16, bits=1, m=12),
        dict(d=64, group=64, bits=2, m=1, scale_dtype=torch.bfloat16),
        dict(d=64, group=512, m=6, t=1100),
    ],
)
def test_avx2_plain_builds_and_odd_shapes_match(native, portable, avx2, shape):
    inputs = sparse_problem(**{"t": 300, **shape})
    for libs in (native, portable, avx2):
        for min_weight in (math.exp(-2), 0.0):
            assert_exact(libs, inputs[0], inputs[1], min_weight, *inputs[2:])


def test_long_context_in_many_tasks_is_independent_of_threads(native):
    rows, kv, *rest = sparse_problem(2, 64, 64, t=20000, m=6, b=1, n_kv=3)
    one = lowbit_sparse_cpu.run_kernel(native[0], rows * 2, kv, math.exp(-4), *rest)
    torch.set_num_threads(2)
    two = lowbit_sparse_cpu.run_kernel(native[0], rows * 2, kv, math.exp(-4), *rest)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    assert 0 < one.kept.float().mean().item() < 0.5
    assert_exact(native, rows * 2, kv, math.exp(-4), *rest)


def test_the_op_runs_the_kernel_once_registered_and_specache_picks_it_by_arithmetic(native):
    rows, kv, visible_len, pos, valid = sparse_problem(1, 64, 64)
    min_weight = math.exp(-2)
    direct = lowbit_sparse_cpu.run_kernel(native[0], rows, kv, min_weight, visible_len, pos, valid)
    got = op(rows, kv, min_weight, visible_len, pos, valid)
    assert all(torch.equal(x, y) for x, y in zip(got, direct))  # the C++ or ctypes dispatch
    # the ctypes implementation, as it serves where the C++ dispatch does not build
    reference = specache.ops.lowbit_partial_attention_sparse_reference
    arguments = (rows, *kv[:6], kv.v_mean, 1, 64, min_weight, visible_len, pos, valid)
    served = lowbit_sparse_cpu._serve(native[0], lowbit_sparse_cpu.FUNCTION, reference, *arguments)
    assert all(torch.equal(x, y) for x, y in zip(served, direct))
    b, h, _, d = rows.shape
    empty = rows.new_zeros(b, h, 0, d)
    seg = Segments(
        visible_len, empty, empty, pos, valid, empty, empty, visible_len * 0, empty, empty
    )
    as_sparse = lowbit_partial_attention(rows, kv, seg, "sparse", min_weight)
    assert all(torch.equal(x, y) for x, y in zip(as_sparse, direct[:4]))
    # a shape the kernel does not take: the twin
    odd = sparse_problem(t=150, d=40, bits=2, group=40)
    got = op(odd[0], odd[1], min_weight, *odd[2:])
    assert all(torch.equal(x, y) for x, y in zip(got, twin(odd[0], odd[1], min_weight, *odd[2:])))


def test_ctypes_dispatch_serves_the_op_with_specache_no_cpu_ops(native, tmp_path):
    """SPECACHE_NO_CPU_OPS=1: the op goes through lowbit_sparse_cpu's ctypes implementation."""
    rows, kv, *rest = sparse_problem(2, 128, 32, m=8)
    torch.save((rows, kv, rest), tmp_path / "inputs.pt")
    script = (
        "import json, sys, torch, specache.kernels\n"
        "from specache.kernels import lowbit_sparse_cpu\n"
        "torch.set_num_threads(1)\n"
        "rows, kv, rest = torch.load(sys.argv[1], weights_only=False)\n"
        "paths = specache.kernels.register()\n"
        "got = torch.ops.specache.lowbit_partial_attention_sparse(\n"
        "    rows, *kv[:6], kv.v_mean, kv.bits, kv.group, 0.05, *rest)\n"
        "torch.save(tuple(got), sys.argv[2])\n"
        "print(json.dumps(paths))\n"
    )
    env = {**os.environ, "SPECACHE_NO_CPU_OPS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script, tmp_path / "inputs.pt", tmp_path / "out.pt"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["lowbit_partial_attention_sparse (CPU)"] == "C, ctypes"
    direct = lowbit_sparse_cpu.run_kernel(native[0], rows, kv, 0.05, *rest)
    assert all(torch.equal(x, y) for x, y in zip(torch.load(tmp_path / "out.pt"), direct))


@pytest.mark.parametrize("how", ["missing", "one group short", "float32"])
def test_a_wrong_v_mean_raises_value_error(native, how):
    rows, kv, *rest = sparse_problem(1, 64, 64)
    bad = {"missing": None, "one group short": kv.v_mean[:, :, 1:], "float32": kv.v_mean.float()}
    kv = kv._replace(v_mean=bad[how])
    with pytest.raises(ValueError, match="v_mean"):
        lowbit_sparse_cpu.run_kernel(native[0], rows, kv, 0.1, *rest)
    if how != "missing":
        with pytest.raises(ValueError, match="v_mean"):
            op(rows, kv, 0.1, *rest)
