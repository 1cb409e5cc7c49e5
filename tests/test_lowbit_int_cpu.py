"""specache/kernels/lowbit_int_cpu: the integer low-bit pass (the -march=native build, which runs
VNNI where the CPU has it, and a plain x86-64 one) against its plain-PyTorch twin in specache/, and
the twin against the float pass within the bounds its two roundings allow.

Exactness: given the same float inputs, the kernel's int8 operands are the twin's and its integer
sums exact. Scores (hence weights, row_max, row_sum) differ from the twin's only by the order of
the float sum q . z (~1e-7 relative) and exp's last bits; so `out` is checked against the twin's
value mix of the kernel's own weights, where only float summation order remains (1e-5 relative).
One wrong code bit moves a score by alpha * q8 ~ 1e-2 of its scale, one int8 unit of a weight
1/127 of its tile's largest.
"""

import platform
import shutil
from pathlib import Path

import pytest
import torch
from test_lowbit_cpu import problem

import specache
from specache.kernels import cpu_build, lowbit_int_cpu
from specache.integer import int8_scores, int8_value_mix
from specache.lowbit import LowBitKV, dequantize_keys, dequantize_values, unpack_bits
from specache.ops import Segments, lowbit_partial_attention

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc: only the twin exists")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def native():
    assert lowbit_int_cpu.register(), "gcc is here but the kernel did not build"
    return lowbit_int_cpu.load(lowbit_int_cpu.build())


@pytest.fixture(scope="module")
def portable():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-march=x86-64 needs an x86 machine")
    lib = lowbit_int_cpu.load(lowbit_int_cpu.build(cpu_build.PORTABLE_FLAGS))
    assert lowbit_int_cpu.path_of(lib) == "plain C"
    return lib


@pytest.fixture(scope="module")
def avx2(portable):
    """The AVX2 path, as machines with AVX2 but not AVX512-VNNI build it."""
    flags = ("-O3", "-march=haswell", "-fopenmp", "-shared", "-fPIC")
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file() or "avx2" not in cpuinfo.read_text():
        pytest.skip("no /proc/cpuinfo, or this CPU has no AVX2")
    lib = lowbit_int_cpu.load(lowbit_int_cpu.build(flags))
    assert lowbit_int_cpu.path_of(lib) == "AVX2"
    return lib


def twin(rows, kv, visible_len, pos, valid):
    return specache.ops.lowbit_partial_attention_int8_reference(
        rows, *kv[:6], kv.bits, kv.group, visible_len, pos, valid
    )


def assert_matches_twin(got, want, kv):
    """weights, row_max, row_sum within 1e-5 of the twin's scale; out equal to the twin's value mix
    of the kernel's own weights within float summation order."""
    for name, x, y in zip(("weights", "row_max", "row_sum"), got, want):
        finite = y.isfinite()
        assert torch.equal(finite, x.isfinite()), f"{name}: -inf in other places"
        assert not x[y == 0].any(), f"{name}: not exactly 0 where the twin is"
        scale = y[finite].abs().max().item() if finite.any() else 1.0
        torch.testing.assert_close(x[finite], y[finite], rtol=1e-5, atol=1e-5 * scale, msg=name)
    mix = int8_value_mix(got[0], kv.v_packed, kv.v_scale, kv.v_zero, kv.bits)
    # out sums T terms that may cancel: its rounding follows the terms' magnitudes
    values = dequantize_values(kv.v_packed, kv.v_scale, kv.v_zero, kv.bits, kv.group)
    scale = max((got[0] @ values.abs()).max().item(), 1e-30)
    torch.testing.assert_close(got[3], mix, rtol=1e-5, atol=1e-5 * scale, msg="out")


@pytest.mark.parametrize("m", [1, 6, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2])
def test_kernel_matches_its_twin(native, bits, d, scale_dtype, group, m):
    for visible in ([0, 203], [1, group - 1]):  # T = 203 is a multiple of neither 16 nor 64
        rows, kv, visible_len, pos, valid = problem(
            bits, d, group, t=203, m=m, scale_dtype=scale_dtype, visible=visible
        )
        pos[0, 0, 0], valid[0, 0, 0] = 0, True  # sequence 0, head 0 then sees nothing
        got = lowbit_int_cpu.run_kernel(native, rows, kv, visible_len, pos, valid)
        assert_matches_twin(got, twin(rows, kv, visible_len, pos, valid), kv)
        assert (got[1][0, 0] == float("-inf")).all() and not got[3][0, 0].any()
        assert not got[0][1, :, :, visible[1] :].any()


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
    ],
)
def test_avx2_plain_builds_and_odd_shapes_match_the_twin(native, portable, avx2, shape):
    inputs = problem(t=300, **shape)
    want = twin(*inputs)
    for lib in (native, portable, avx2):
        assert_matches_twin(lowbit_int_cpu.run_kernel(lib, *inputs), want, inputs[1])


def test_long_context_in_many_tasks_is_independent_of_threads(native):
    inputs = problem(1, 64, 64, t=20000, m=6, b=1, n_kv=3)
    one = lowbit_int_cpu.run_kernel(native, *inputs)
    torch.set_num_threads(2)
    two = lowbit_int_cpu.run_kernel(native, *inputs)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    assert_matches_twin(one, twin(*inputs), inputs[1])


@pytest.mark.parametrize("bits", [1, 2])
def test_twin_is_the_float_pass_within_its_roundings(bits):
    """Per row and key group, |int8 score - float score| <= alpha / 2 * sum of the codes (one half
    step per channel) plus float rounding; per block, |int8 mix - w @ v| <= beta / 2 * sum of the
    codes. A twin that scaled, rounded or grouped wrongly breaks these bounds."""
    rows, kv, *_ = problem(bits, 64, 32, t=256, m=6)
    keys = dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, bits, 32)
    exact = rows @ keys.transpose(-1, -2)
    scores = int8_scores(rows, kv.k_packed, kv.k_scale, kv.k_zero, bits, 32)
    qs = rows.unsqueeze(2) * kv.k_scale.float().unsqueeze(3)  # (B, Hkv, J, M, D)
    alpha = (qs.abs().amax(-1) / 127).repeat_interleave(32, 2).transpose(2, 3)  # (B, Hkv, M, T)
    codes = unpack_bits(kv.k_packed, bits, 64).float().sum(-1)[:, :, None]  # (B, Hkv, 1, T)
    assert ((scores - exact).abs() <= alpha / 2 * codes + 1e-5).all()
    assert (scores != exact).any()

    weights = torch.rand(rows.shape[:3] + (256,))
    values = dequantize_values(kv.v_packed, kv.v_scale, kv.v_zero, bits, 32)
    mix = int8_value_mix(weights, kv.v_packed, kv.v_scale, kv.v_zero, bits)
    scaled = weights.unsqueeze(-1) * kv.v_scale.float().unsqueeze(2)  # (B, Hkv, M, T, NV)
    beta = scaled.unflatten(3, (4, 64)).abs().amax(4) / 127  # (B, Hkv, M, blocks, NV)
    code_sums = unpack_bits(kv.v_packed, bits, 64).float().unflatten(2, (4, 64)).sum(3)
    bound = (beta.repeat_interleave(32, -1) / 2 * code_sums.unsqueeze(2)).sum(3)
    assert ((mix - weights @ values).abs() <= bound + 1e-4).all()
    assert (mix != weights @ values).any()


def test_the_op_runs_the_kernel_once_registered_and_specache_picks_it_by_arithmetic(native):
    rows, kv, visible_len, pos, valid = problem(1, 64, 64)
    op = torch.ops.specache.lowbit_partial_attention_int8(
        rows, *kv[:6], 1, 64, visible_len, pos, valid
    )
    direct = lowbit_int_cpu.run_kernel(native, rows, kv, visible_len, pos, valid)
    assert all(torch.equal(x, y) for x, y in zip(op, direct))  # the C++ or ctypes dispatch
    b, h, _, d = rows.shape
    empty = rows.new_zeros(b, h, 0, d)
    seg = Segments(
        visible_len, empty, empty, pos, valid, empty, empty, visible_len * 0, empty, empty
    )
    as_int8 = lowbit_partial_attention(rows, kv, seg, "int8")
    as_float = lowbit_partial_attention(rows, kv, seg, "float")
    assert torch.equal(as_int8.out, direct[3]) and not torch.equal(as_float.out, direct[3])
    # a shape the kernel does not take: the twin
    odd = problem(t=150, d=40, bits=2, group=40)
    got = torch.ops.specache.lowbit_partial_attention_int8(odd[0], *odd[1][:6], 2, 40, *odd[2:])
    assert all(torch.equal(x, y) for x, y in zip(got, twin(*odd)))


def test_kivi_copy_layout_is_shared_with_the_float_kernel():
    """The integer kernel reads the float kernel's inputs: a LowBitKV made once serves both."""
    rows, kv, *rest = problem(2, 128, 64, m=2)
    assert isinstance(kv, LowBitKV)
    float_pass = specache.ops.lowbit_partial_attention_reference(rows, *kv[:6], 2, 64, *rest)
    int_pass = twin(rows, kv, *rest)
    normalized = [x[3] / x[2].clamp(min=1e-30).unsqueeze(-1) for x in (float_pass, int_pass)]
    torch.testing.assert_close(normalized[1], normalized[0], rtol=0.1, atol=0.1)
