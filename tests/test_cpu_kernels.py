"""kernels/linear_cpu and kernels/dense_cpu: the C kernels (the -march=native build and a plain
x86-64
one) against their PyTorch references, the ops under torch.compile, and the modules that use them.

Tolerances: both kernels add float32 products in another order than the references (blocks of 16
lanes, then a tree), so each output is off by a few roundings of the largest terms: 1e-5 of the
output's largest magnitude, where one wrong code, nibble or position moves an output by 1e-2 or
more.
"""

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import dense_cpu, host_ops, linear_cpu
from specache.kernels import cpu_build
from kernels.dense_cpu import dense_decode_attention, dense_decode_attention_reference
from kernels.linear_cpu import quantized_linear, quantized_linear_reference
from model import CausalPrompt
from quantize import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from conftest import tiny_model
from test_quantize import int4_layer, int8_layer

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="no gcc: only the references exist"
)


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance * want.abs().max().item())


@pytest.fixture(scope="module")
def builds():
    """The native build and, on x86, the plain C one that machines without AVX-512 build."""
    libs = {"native": (linear_cpu._library(), dense_cpu._library())}
    assert None not in libs["native"], "gcc is here but a kernel did not build"
    if platform.machine() in ("x86_64", "AMD64"):
        libs["portable"] = (
            linear_cpu.load(linear_cpu.build(cpu_build.PORTABLE_FLAGS)),
            dense_cpu.load(dense_cpu.build(cpu_build.PORTABLE_FLAGS)),
        )
    return libs


# --- quantized Linear ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("n, k", [(96, 64), (70, 200), (33, 1536)])
def test_int8_kernel_matches_reference(builds, rows, n, k):
    """Row counts that take every chunk size (16, 8, 4, 2, 1), channel counts off the blocks of 4, 2
    and 32, and K off a multiple of 16 (the masked tail)."""
    g = torch.Generator().manual_seed(rows * n + k)
    codes, scales = quantize_int8(torch.randn(n, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    want = quantized_linear_reference(x, codes, scales)
    for lib, _ in builds.values():
        close(linear_cpu.run_kernel(lib, x, codes, scales), want)


@pytest.mark.parametrize("rows", [1, 2, 7, 16])
@pytest.mark.parametrize("n, k, group", [(48, 128, 32), (70, 192, 64), (40, 96, 16), (24, 60, 6)])
def test_int4_kernel_matches_reference(builds, rows, n, k, group):
    """Groups of 32 and 64 take the vector path; 16 and 6 (K = 60) the plain loops."""
    g = torch.Generator().manual_seed(rows * n + k)
    codes, scales, zeros = quantize_int4(torch.randn(n, k, generator=g), group)
    x = torch.randn(rows, k, generator=g)
    want = quantized_linear_reference(x, codes, scales, zeros, group)
    # the reference is quantize.py's layout
    close(want, x @ dequantize_int4(codes, scales, zeros).T)
    for lib, _ in builds.values():
        close(linear_cpu.run_kernel(lib, x, codes, scales, zeros, group), want)


def test_linear_kernel_does_not_depend_on_threads(builds):
    codes, scales = quantize_int8(torch.randn(4096, 256))
    x = torch.randn(3, 256)
    lib = builds["native"][0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_cpu.run_kernel(lib, x, codes, scales)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(linear_cpu.run_kernel(lib, x, codes, scales), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda x, c, s: (x[:, :-2], c, s), "int8 codes"),
        (lambda x, c, s: (x.double(), c, s), "float32"),
        (lambda x, c, s: (torch.randn(17, x.shape[1]), c, s), "M <= 16"),
        (lambda x, c, s: (x, c, s[:-1]), "scales"),
    ],
)
def test_linear_bad_inputs_raise_value_error(corrupt, message):
    codes, scales = quantize_int8(torch.randn(8, 32))
    with pytest.raises(ValueError, match=message):
        quantized_linear(*corrupt(torch.randn(2, 32), codes, scales))


class OpsSeen(TorchDispatchMode):
    """The names of the ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def test_cpp_and_python_dispatch_run_the_same_kernel():
    """kernels/host_ops.cpp (the ops' CPU implementation where g++ builds it) and the Python
    one."""
    codes, scales, zeros = quantize_int4(torch.randn(64, 128), 32)
    x = torch.randn(3, 128)
    assert torch.equal(
        quantized_linear(x, codes, scales, zeros, 32), linear_cpu._op(x, codes, scales, zeros, 32)
    )
    q, k, v, pos = attention_problem(s=2, dtype=torch.bfloat16)
    assert torch.equal(dense_decode_attention(q, k, v, pos), dense_cpu._op(q, k, v, pos, None))


def test_without_gpp_the_python_dispatch_serves_with_one_warning(monkeypatch):
    import warnings

    monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
    host_ops.loaded.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Python serves"):
            assert not host_ops.hand_over("quantized_linear", linear_cpu._library())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only one warning
            assert not host_ops.hand_over("quantized_linear", linear_cpu._library())
    finally:
        host_ops.loaded.cache_clear()


def test_quantized_linears_take_the_kernel_for_decode_rows_and_compile_to_one_op():
    w, x = torch.randn(80, 128), torch.randn(1, 2, 128)
    int8, int4 = int8_layer(w), int4_layer(w)
    int4.pack()  # on a CPU with the kernel: the stored layout stays, scales in float32
    assert int4.packed is None and int4.scales.dtype == torch.float32
    for layer, weight in (
        (int8, dequantize_int8(int8.weight, int8.scales)),
        (int4, dequantize_int4(int4.weight, int4.scales, int4.zeros)),
    ):
        want = F.linear(x, weight)
        with OpsSeen() as seen:
            close(layer(x), want)
        assert "gptfast.quantized_linear.default" in seen.names, (
            "decode rows did not go through the kernel"
        )
        many = torch.randn(2, 20, 128)  # prefill: dequantize, then multiply
        close(layer(many), F.linear(many, weight))
        graph = []
        compiled = torch.compile(
            layer,
            fullgraph=True,
            dynamic=False,
            backend=lambda gm, inputs: graph.append(gm) or gm.forward,
        )
        close(compiled(x), want)
        assert "gptfast.quantized_linear" in graph[0].code


def test_int4_without_the_kernel_packs_for_torch(monkeypatch):
    monkeypatch.setenv("SPECACHE_NO_CPU_KERNEL", "1")
    layer = int4_layer(torch.randn(80, 128))
    layer.pack()
    assert layer.weight is None and layer.packed is not None


# --- dense decode attention ---------------------------------------------------------------------


def attention_problem(b=2, h=6, hkv=2, s=1, d=64, t=300, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g)
    # scores of a few units: a peaked softmax
    k = (torch.randn(b, hkv, t, d, generator=g) * 2).to(dtype)
    v = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    ends = torch.randint(s, t, (b, 1), generator=g)  # ragged: each sequence at its own position
    return q, k, v, ends - s + 1 + torch.arange(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(s=2),
        dict(b=3, h=8, hkv=1, s=2, d=128, t=1000),
        dict(h=4, hkv=4, d=256, t=70),
        dict(h=3, hkv=3, d=40, t=200),
        dict(b=1, h=9, hkv=3, t=5000),
    ],
)
def test_dense_kernel_matches_reference(builds, dtype, shape):
    """GQA groups of 3, 4, 8 and 1; one and two rows per sequence; head_dim 64, 128 and 256 (the
    vector path) and 40 (the plain loops); 5000 positions (many chunks to merge)."""
    q, k, v, pos = attention_problem(dtype=dtype, **shape)
    want = dense_decode_attention_reference(q, k, v, pos)
    for _, lib in builds.values():
        close(dense_cpu.run_kernel(lib, q, k, v, pos), want)


def test_dense_kernel_reads_nothing_past_each_rows_position(builds):
    """Positions past a sequence's rows hold NaN: the kernel never reads them (SDPA would mix the
    NaN
    in, so the reference runs before they are set)."""
    q, k, v, pos = attention_problem(s=2, t=400)
    want = dense_decode_attention_reference(q, k, v, pos)
    for b in range(2):
        k[b, :, pos[b, -1] + 1 :] = float("nan")
        v[b, :, pos[b, -1] + 1 :] = float("nan")
    close(dense_cpu.run_kernel(builds["native"][1], q, k, v, pos), want)


def test_dense_kernel_does_not_depend_on_threads(builds):
    q, k, v, pos = attention_problem(b=1, h=9, hkv=3, s=2, t=20000)
    lib = builds["native"][1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dense_cpu.run_kernel(lib, q, k, v, pos)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(dense_cpu.run_kernel(lib, q, k, v, pos), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda q, k, v, p: (q.double(), k, v, p), "float32"),
        (lambda q, k, v, p: (q, k, v[:, :, :-1], p), "shaped and typed like k"),
        (lambda q, k, v, p: (q[:, :5], k, v, p), "multiple of Hkv"),
        (lambda q, k, v, p: (q, k, v, p.int()), "input_pos"),
    ],
)
def test_dense_bad_inputs_raise_value_error(corrupt, message):
    with pytest.raises(ValueError, match=message):
        dense_decode_attention(*corrupt(*attention_problem()))


def test_full_cache_decode_goes_through_the_kernel_and_matches_sdpa(monkeypatch):
    """The model's full cache: decode steps (eager and compiled) give the logits SDPA gives with the
    kernel switched off, in float32 and in a 16-bit cache."""
    torch.manual_seed(0)
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 30))
    steps = torch.randint(0, 97, (2, 3))

    def logits(kv_dtype=None, compiled=False):
        model.setup_caches(2, 40, kv_dtype)
        model(tokens, torch.arange(30).expand(2, -1), CausalPrompt())
        forward = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
        return torch.stack(
            [forward(steps[:, i : i + 1], torch.full((2, 1), 30 + i)) for i in range(3)]
        )

    with torch.no_grad():
        got = [logits(), logits(compiled=True), logits(torch.bfloat16)]
        monkeypatch.setenv("SPECACHE_NO_CPU_KERNEL", "1")
        want = [logits(), logits(torch.bfloat16)]
    close(got[0], want[0])
    close(got[1], want[0])
    close(got[2], want[1])
