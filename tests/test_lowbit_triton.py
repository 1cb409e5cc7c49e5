"""The Triton kernels of the low-bit segment (the float pass and the sparse one) against
specache's plain-PyTorch definitions of their ops.

On a GPU they run for real (scripts/gpu_check.sh); on a CPU with Triton installed they run in
Triton's interpreter, in a subprocess (TRITON_INTERPRET must be set before the kernels are
defined); without Triton these tests are skipped.
"""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

# (KV heads, rows, head_dim, T, visible, excluded per head): SmolLM2 and Llama-3-8B decode shapes,
# T neither a multiple of the block nor of the group, nothing excluded (KIVI), nothing visible.
CASES = [
    (3, 6, 64, 1000, 930, 64),
    (8, 8, 128, 200, 200, 16),
    (2, 3, 64, 130, 64, 0),
    (2, 6, 64, 64, 0, 8),
]


def random_problem(n_kv, m, d, t, visible, k, bits, group, seed, peak=1.0):
    """rows (scaled by `peak`), the low-bit copy (6 tensors) of random keys (outlier channels) and
    values of 2 sequences, their visible lengths, and k excluded positions per KV head (80%
    valid)."""
    from specache.lowbit import quantize_keys, quantize_values

    g = torch.Generator().manual_seed(seed)
    padded = -(-t // group) * group
    keys = torch.randn(2, n_kv, padded, d, generator=g) * torch.linspace(0.2, 3, d)
    values = torch.randn(2, n_kv, t, d, generator=g)
    k_packed, k_scale, k_zero = quantize_keys(keys, bits, group, torch.float16)
    copy = (
        k_packed[:, :, :t].contiguous(),
        k_scale,
        k_zero,
        *quantize_values(values, bits, group, torch.float16),
    )
    rows = torch.randn(2, n_kv, m, d, generator=g) * d**-0.5 * peak
    visible_len = torch.tensor([visible, max(0, visible - 17)])
    excluded = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(2 * n_kv)])
    excluded_valid = torch.rand(2, n_kv, k, generator=g) < 0.8
    return rows, copy, visible_len, excluded.view(2, n_kv, k), excluded_valid


def assert_softmax_pieces_match(got, expected, case: str) -> None:
    """weights, row_max, row_sum and out: -inf where the reference has it, else within 1e-4 (1e-5
    of the largest magnitude)."""
    for name, a, b in zip(("weights", "row_max", "row_sum", "out"), got, expected):
        finite = b.isfinite()
        assert torch.equal(a.cpu().isfinite(), finite), (name, case)
        scale = b[finite].abs().max().item() if finite.any() else 1.0
        torch.testing.assert_close(
            a.cpu()[finite],
            b[finite],
            rtol=1e-4,
            atol=1e-5 * scale,
            msg=lambda text: f"{name}, {case}: {text}",
        )


def check_all(device: str) -> None:
    from specache.kernels.lowbit_triton import run_kernels
    from specache.ops import lowbit_partial_attention_reference

    for bits in (1, 2):
        for n_kv, m, d, t, visible, k in CASES:
            group = 64
            problem = random_problem(n_kv, m, d, t, visible, k, bits, group, seed=t + bits)
            rows, copy, visible_len, excluded, excluded_valid = problem
            masks = (visible_len, excluded, excluded_valid)
            expected = lowbit_partial_attention_reference(rows, *copy, bits, group, *masks)
            moved = [x.to(device) for x in (rows, *copy)]
            got = run_kernels(*moved, bits, group, *(x.to(device) for x in masks))
            assert_softmax_pieces_match(got, expected, f"bits {bits}, T {t}")


# (KV heads, rows, head_dim, T, visible, excluded per head, group, min_weight, row scale): the
# sparse pass's default e^-6, every value mixed (tau inf: 0), peaked rows that leave most groups
# unread, and groups of 32 and 128 (one group a program).
SPARSE_CASES = [
    (3, 6, 64, 1000, 930, 64, 64, math.exp(-6), 1.0),
    (2, 6, 64, 1000, 1000, 8, 64, 0.0, 1.0),
    (3, 6, 64, 700, 700, 16, 32, math.exp(-6), 12.0),
    (2, 8, 128, 300, 290, 16, 128, math.exp(-4), 6.0),
    (2, 6, 64, 64, 0, 8, 64, math.exp(-6), 1.0),
]


def check_sparse(device: str) -> None:
    from specache.kernels.lowbit_sparse_triton import run_kernels
    from specache.ops import lowbit_partial_attention_sparse_reference
    from specache.sparse import value_means

    for bits in (1, 2):
        for n_kv, m, d, t, visible, k, group, min_weight, peak in SPARSE_CASES:
            problem = random_problem(
                n_kv, m, d, t, visible, k, bits, group, seed=t + bits + group, peak=peak
            )
            rows, copy, visible_len, excluded, excluded_valid = problem
            v_mean = value_means(*copy[3:], bits, group)
            arguments = (*copy, v_mean, bits, group, min_weight, visible_len, excluded)
            expected = lowbit_partial_attention_sparse_reference(rows, *arguments, excluded_valid)
            moved = [x.to(device) if isinstance(x, torch.Tensor) else x for x in arguments]
            got = run_kernels(rows.to(device), *moved, excluded_valid.to(device))
            case = f"bits {bits}, T {t}, group {group}, min_weight {min_weight:.4f}"
            assert_softmax_pieces_match(got, expected, case)
            # kept may differ only where some row's weight rounds across min_weight
            differs = got.kept.cpu() != expected.kept
            near = ((expected.weights - min_weight).abs() <= 1e-5 * min_weight).any(2)
            assert not (differs & ~near).any(), ("kept", case)
            assert 0 < expected.kept.float().mean() < 1 or min_weight == 0 or visible == 0, case


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_match_the_reference_on_cuda():
    check_all("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_sparse_kernels_match_the_reference_on_cuda():
    check_sparse("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_op_on_cuda_dispatches_to_triton_once_registered(monkeypatch):
    from specache.kernels import lowbit_triton
    from specache.lowbit import LowBitKV, quantize_keys, quantize_values

    assert lowbit_triton.register()
    calls = []
    real = lowbit_triton.run_kernels
    monkeypatch.setattr(lowbit_triton, "run_kernels", lambda *args: calls.append(1) or real(*args))
    keys, values = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    kv = LowBitKV(
        *quantize_keys(keys, 1, 64, torch.float16),
        *quantize_values(values, 1, 64, torch.float16),
        1,
        64,
    )
    torch.ops.specache.lowbit_partial_attention(
        torch.randn(1, 2, 4, 64, device="cuda"),
        *(x.cuda() for x in kv[:6]),
        1,
        64,
        torch.tensor([100], device="cuda"),
        torch.zeros(1, 2, 8, dtype=torch.long, device="cuda"),
        torch.ones(1, 2, 8, dtype=torch.bool, device="cuda"),
    )
    assert calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_sparse_op_on_cuda_dispatches_to_triton_once_registered(monkeypatch):
    from specache.kernels import lowbit_sparse_triton
    from specache.lowbit import quantize_keys, quantize_values
    from specache.sparse import value_means

    assert lowbit_sparse_triton.register()
    calls = []
    real = lowbit_sparse_triton.run_kernels
    monkeypatch.setattr(
        lowbit_sparse_triton, "run_kernels", lambda *args: calls.append(1) or real(*args)
    )
    keys, values = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    v_copy = quantize_values(values, 1, 64, torch.float16)
    copy = (*quantize_keys(keys, 1, 64, torch.float16), *v_copy, value_means(*v_copy, 1, 64))
    part = torch.ops.specache.lowbit_partial_attention_sparse(
        torch.randn(1, 2, 4, 64, device="cuda"),
        *(x.cuda() for x in copy),
        1,
        64,
        math.exp(-6),
        torch.tensor([100], device="cuda"),
        torch.zeros(1, 2, 8, dtype=torch.long, device="cuda"),
        torch.ones(1, 2, 8, dtype=torch.bool, device="cuda"),
    )
    assert calls and part[4].dtype == torch.bool


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels run for real")
def test_triton_kernels_match_the_reference_in_the_interpreter():
    script = (
        "import sys; sys.path.insert(0, 'tests'); import test_lowbit_triton as t; "
        "t.check_all('cpu'); t.check_sparse('cpu')"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
