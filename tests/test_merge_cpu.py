"""specache/kernels/merge_cpu.py's kernel of the op specache::merge_segments: SpeCache's 16-bit
segments in one softmax with the low-bit pass. The C kernel (the -march=native build and the plain
x86-64 one) and specache's plain-PyTorch definition, both against a softmax spelled out over all the
keys a row sees, the low-bit ones included; the op once the kernel is registered.

Tolerances as in test_cpu_kernels.py: 1e-5 of the largest magnitude, where one wrong mask entry or
row moves a probability by 1e-2 or more.
"""

import platform
import shutil

import pytest
import torch

from specache.kernels import cpu_build, merge_cpu
from specache.ops import merge_segments_reference

pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None, reason="no gcc: only the reference exists"
)


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float = 1e-5) -> None:
    torch.testing.assert_close(
        got, want, rtol=0, atol=tolerance * (want.abs().max().item() if want.numel() else 0)
    )


def merge_segments(*inputs):
    """The op, as the package calls it."""
    return torch.ops.specache.merge_segments(*inputs)


@pytest.fixture(scope="module")
def libs():
    assert merge_cpu.register(), "gcc is here but the kernel did not build"
    built = {"native": merge_cpu.load(merge_cpu.build())}
    if platform.machine() in ("x86_64", "AMD64"):
        built["portable"] = merge_cpu.load(merge_cpu.build(cpu_build.PORTABLE_FLAGS))
    return built


def merge_problem(
    b=1, h=3, g=3, s=2, d=64, t=50, f=20, r=24, dtype=torch.float16, seed=0, lowbit=True
):
    """Random segments, the low-bit pass computed from t explicit keys (so that a plain softmax can
    check the merge), and the new pairs strided as the model's K, V are (B, S, Hkv, D)
    transposed."""
    gen = torch.Generator().manual_seed(seed)
    m = g * s
    # already scaled: scores of a few units
    rows = torch.randn(b, h, m, d, generator=gen) * 2 * d**-0.5
    low_k, low_v = (
        torch.randn(b, h, t if lowbit else 0, d, generator=gen),
        torch.randn(b, h, t if lowbit else 0, d, generator=gen),
    )
    scores = rows @ low_k.transpose(-1, -2)
    row_max = scores.amax(-1) if lowbit else torch.full((b, h, m), float("-inf"))
    weights = torch.exp(scores - row_max.unsqueeze(-1)) if lowbit else scores

    def pair(n):
        return [torch.randn(b, h, n, d, generator=gen).to(dtype) for _ in range(2)]

    (fetched_k, fetched_v), (window_k, window_v) = pair(f), pair(r)
    segments = dict(
        fetched_k=fetched_k,
        fetched_v=fetched_v,
        fetched_valid=torch.rand(b, h, f, generator=gen) > 0.3,
        window_k=window_k,
        window_v=window_v,
        window_len=torch.randint(0, r + 1, (b,), generator=gen),
        new_k=torch.randn(b, s, h, d, generator=gen).transpose(1, 2),
        new_v=torch.randn(b, s, h, d, generator=gen).transpose(1, 2),
    )
    inputs = (rows, row_max, weights.sum(-1), weights @ low_v, *segments.values())
    return inputs, (low_k, low_v)


def spelled_out(inputs, low):
    """Per row, one softmax over the low-bit keys and every 16-bit key it sees, in a Python loop."""
    rows, _, _, _, fk, fv, valid, wk, wv, window_len, nk, nv = inputs
    low_k, low_v = low
    b, h, m, d = rows.shape
    s = nk.shape[2]
    out, scale = torch.zeros(b, h, m, d), torch.zeros(b, h, m, 1)
    probs = [torch.zeros(b, h, m, x.shape[2]) for x in (fk, wk, nk)]
    for bi in range(b):
        for hi in range(h):
            for row in range(m):
                seen = [(low_k[bi, hi], low_v[bi, hi], None)]
                seen.append(
                    (
                        fk[bi, hi][valid[bi, hi]].float(),
                        fv[bi, hi][valid[bi, hi]].float(),
                        (0, valid[bi, hi].nonzero()[:, 0]),
                    )
                )
                seen.append(
                    (
                        wk[bi, hi, : window_len[bi]].float(),
                        wv[bi, hi, : window_len[bi]].float(),
                        (1, torch.arange(int(window_len[bi]))),
                    )
                )
                seen.append(
                    (
                        nk[bi, hi, : row % s + 1],
                        nv[bi, hi, : row % s + 1],
                        (2, torch.arange(row % s + 1)),
                    )
                )
                keys, values = torch.cat([x[0] for x in seen]), torch.cat([x[1] for x in seen])
                p = torch.softmax(keys @ rows[bi, hi, row], 0)
                out[bi, hi, row] = p @ values
                start = len(low_k[bi, hi])
                if start:  # p of a low-bit key = lowbit_scale * exp(score - row_max)
                    first = low_k[bi, hi] @ rows[bi, hi, row]
                    scale[bi, hi, row] = p[0] / torch.exp(first[0] - first.max())
                for _, _, (seg, where) in seen[1:]:
                    probs[seg][bi, hi, row, where] = p[start : start + len(where)]
                    start += len(where)
    return out, scale, *probs


SHAPES = [
    dict(),
    dict(b=2, h=2, g=4, s=1, d=128, f=70, r=33),
    dict(d=256, f=5, r=40),
    dict(d=40, f=17, r=9),  # the plain loops (head_dim not a multiple of 16)
    dict(f=0, r=16, s=1),  # nothing fetched yet
    dict(b=1, h=3, g=3, s=2, d=64, t=300, f=128, r=128),  # SmolLM2's step
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_matches_a_softmax_over_every_key_a_row_sees(libs, dtype, shape):
    inputs, low = merge_problem(dtype=dtype, **shape)
    want = spelled_out(inputs, low)
    kernels = [merge_cpu.run_merge_kernel(lib, *inputs) for lib in libs.values()]
    for got in [merge_segments_reference(*inputs), *kernels]:
        assert [x.shape for x in got] == [x.shape for x in want]
        for g, w in zip(got, want):
            close(g, w)


def test_merge_with_nothing_low_bit_yet(libs):
    """row_max = -inf (a copy that holds nothing): the low-bit share is 0 and the segments alone
    count."""
    inputs, low = merge_problem(lowbit=False)
    want = spelled_out(inputs, low)
    for lib in libs.values():
        got = merge_cpu.run_merge_kernel(lib, *inputs)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        for g, w in zip(got, want):
            close(g, w)


def test_unseen_pairs_get_exactly_zero(libs):
    """Invalid fetched slots, window slots past window_len and the new pairs after a row's own."""
    inputs, _ = merge_problem(b=2, f=40, r=30)
    _, _, _, _, _, _, valid, _, _, window_len, _, _ = inputs
    for lib in libs.values():
        _, _, p_fetched, p_window, p_new = merge_cpu.run_merge_kernel(lib, *inputs)
        assert (p_fetched.masked_select(~valid.unsqueeze(2)) == 0).all()
        for bi in range(2):
            assert (p_window[bi, :, :, window_len[bi] :] == 0).all() and (
                p_window[bi, :, :, : window_len[bi]] > 0
            ).all()
        assert (p_new[:, :, 0::2, 1] == 0).all() and (
            p_new[:, :, 1::2, 1] > 0
        ).all()  # row = g*S + s


def test_merge_does_not_depend_on_threads_or_strides(libs):
    inputs, _ = merge_problem(b=8, f=128, r=128)  # above the work that takes a second thread
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = merge_cpu.run_merge_kernel(libs["native"], *inputs)
        torch.set_num_threads(max(2, threads))
        more = merge_cpu.run_merge_kernel(libs["native"], *inputs)
    finally:
        torch.set_num_threads(threads)
    contiguous = merge_cpu.run_merge_kernel(libs["native"], *(x.contiguous() for x in inputs))
    for a, b, c in zip(one, more, contiguous):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_cpp_and_python_dispatch_run_the_same_merge(libs):
    inputs, _ = merge_problem(dtype=torch.bfloat16)
    for a, b in zip(merge_segments(*inputs), merge_cpu._serve_merge(libs["native"], *inputs)):
        assert torch.equal(a, b)


def test_more_rows_than_the_kernel_holds_go_to_the_reference(libs):
    """Grouped-query heads of 40 query heads x 2 rows: M = 80 > 64, the reference serves."""
    inputs, _ = merge_problem(g=40, d=32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(merge_segments(*inputs), merge_segments_reference(*inputs))
    )


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda x: (x[0].double(), *x[1:]), "rows must be"),
        (lambda x: (*x[:4], x[4][:, :, :-1], *x[5:]), r"k and \w*v must be"),
        (lambda x: (*x[:6], x[6][:, :, :-1], *x[7:]), "fetched_valid"),
        (lambda x: (*x[:9], x[9].int(), *x[10:]), "window_len"),
        (lambda x: (*x[:10], x[10][:, :, :0], x[11][:, :, :0]), "S >= 1"),
    ],
)
def test_merge_bad_inputs_raise_value_error(libs, corrupt, message):
    """The checks that guard the kernel's reads and writes: in C++ (the op) and in Python
    (ctypes)."""
    inputs, _ = merge_problem()
    with pytest.raises(ValueError, match=message):
        merge_segments(*corrupt(inputs))
    with pytest.raises(ValueError, match=message):
        merge_cpu.run_merge_kernel(libs["native"], *corrupt(inputs))
