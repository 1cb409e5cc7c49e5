"""specache's low-bit copy (quantization rules, bit packing) and its mixed-precision attention,
composed of its ops, against attention spelled out over every key a row sees."""

import pytest
import torch

from specache.lowbit import (
    LowBitKV,
    dequantize_keys,
    dequantize_values,
    pack_bits,
    quantize_groups,
    quantize_keys,
    quantize_values,
    unpack_bits,
)
from specache.ops import (
    Segments,
    lowbit_partial_attention,
    merge_segments,
    position_weights,
    positions_mask,
    query_rows,
)
from specache.select import drop_from_lowbit

# the ops run on the C kernels where they build (tests/test_specache.py runs the references too)
pytestmark = pytest.mark.usefixtures("specache_kernels")


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 64, 65, 127])
def test_pack_unpack_is_bit_exact_at_every_length(bits, n):
    codes = torch.randint(
        0, 1 << bits, (3, 2, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)
    )
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == (n * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_bits_layout_is_low_bits_first():
    assert (
        pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).item() == 0b10000001
    )
    assert pack_bits(torch.tensor([3, 0, 1, 2], dtype=torch.uint8), 2).item() == 0b10010011


def test_one_bit_levels_are_a_quarter_and_three_quarters_of_the_range():
    # min -2, max 6, range 8, midpoint 2
    x = torch.tensor([[-2.0, -1.0, 0.0, 0.999, 1.0, 3.0, 6.0]])
    codes, scale, zero = quantize_groups(x, 1, -1, torch.float32)
    levels = sorted(set((codes.float() * scale + zero).flatten().tolist()))
    assert levels == [0.0, 4.0]  # min + range/4, min + 3*range/4
    # x >= midpoint 2 -> 1, and the max is clamped to 1
    assert codes.tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    codes, _, _ = quantize_groups(torch.tensor([[-2.0, 2.0, 6.0]]), 1, -1, torch.float32)
    assert codes.tolist() == [[0, 1, 1]]  # exactly the midpoint rounds up


def test_constant_groups_quantize_without_nan():
    for bits in (1, 2):
        codes, scale, zero = quantize_groups(torch.full((2, 8), 0.5), bits, -1, torch.float16)
        assert torch.equal(codes.float() * scale.float() + zero.float(), torch.full((2, 8), 0.5))


def test_two_bit_error_is_at_most_a_sixth_of_the_range():
    x = torch.randn(64, 128) * torch.linspace(0.1, 10, 128)
    codes, scale, zero = quantize_groups(x, 2, 0, torch.float16)
    error = (codes.float() * scale.float() + zero.float() - x).abs()
    value_range = x.amax(0) - x.amin(0)
    # the bound holds for the stored fp16 scale; the fp16 rounding of scale and zero adds a hair
    assert (error <= value_range / 6 * (1 + 2e-3) + 1e-3).all()
    assert (codes <= 3).all()


@pytest.mark.parametrize("bits", [1, 2])
def test_keys_are_grouped_over_tokens_per_channel_and_values_over_channels_per_token(bits):
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 128, 64), torch.randn(2, 3, 128, 64)
    packed, scale, zero = quantize_keys(k, bits, 32, torch.float16)
    assert packed.shape == (2, 3, 128, 64 * bits // 8) and scale.shape == zero.shape == (
        2,
        3,
        4,
        64,
    )
    # tokens 32..63, each channel
    codes, s, z = quantize_groups(k[:, :, 32:64], bits, 2, torch.float16)
    torch.testing.assert_close(
        dequantize_keys(packed, scale, zero, bits, 32)[:, :, 32:64],
        codes.float() * s.float() + z.float(),
    )
    packed, scale, zero = quantize_values(v, bits, 32, torch.float16)
    assert scale.shape == zero.shape == (2, 3, 128, 2)
    # channels 32..63, each token
    codes, s, z = quantize_groups(v[..., 32:], bits, 3, torch.float16)
    torch.testing.assert_close(
        dequantize_values(packed, scale, zero, bits, 32)[..., 32:],
        codes.float() * s.float() + z.float(),
    )


def lowbit_copy(bits, group, t=256, b=2, n_kv=3, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    # outlier channels, as real keys
    k = torch.randn(b, n_kv, t, d, generator=g) * torch.linspace(0.2, 4, d)
    v = torch.randn(b, n_kv, t, d, generator=g)
    return (
        LowBitKV(
            *quantize_keys(k, bits, group, torch.float16),
            *quantize_values(v, bits, group, torch.float16),
            bits,
            group,
        ),
        k,
        v,
    )


def mixed_attention(q, kv: LowBitKV, seg: Segments):
    """Attention of q (B, H, S, D) over the four segments, from specache's ops: the output
    (B, H, S, D) and the last row's weights of the history's positions [0, T), averaged over each KV
    head's query heads (B, Hkv, T)."""
    b, n_heads, s, d = q.shape
    rows = query_rows(q, kv.k_packed.shape[1])
    part = lowbit_partial_attention(rows, kv, seg)
    merged = merge_segments(rows, part, seg)
    weights = position_weights(
        part.weights,
        merged.lowbit_scale,
        merged.p_fetched,
        seg.fetched_pos,
        merged.p_window,
        seg.quantized_len,
        s,
        s - 1,
    )
    return merged.out.reshape(b, n_heads, s, d).to(q.dtype), weights.mean(2)


def mixed_attention_reference(q, kv: LowBitKV, seg: Segments):
    """The same, spelled out: dequantize the copy, put the fetched 16-bit pairs in their places,
    append the window and the new rows, and run one masked softmax."""
    b, n_heads, s, d = q.shape
    n_kv, t = kv.k_packed.shape[1], kv.k_packed.shape[2]
    g = n_heads // n_kv
    keys = dequantize_keys(kv.k_packed, kv.k_scale, kv.k_zero, kv.bits, kv.group)
    values = dequantize_values(kv.v_packed, kv.v_scale, kv.v_zero, kv.bits, kv.group)
    for bi in range(b):
        for hi in range(n_kv):
            for slot in range(seg.fetched_pos.shape[-1]):
                if seg.fetched_valid[bi, hi, slot]:
                    pos = seg.fetched_pos[bi, hi, slot]
                    keys[bi, hi, pos] = seg.fetched_k[bi, hi, slot].float()
                    values[bi, hi, pos] = seg.fetched_v[bi, hi, slot].float()
    keys = torch.cat([keys, seg.window_k.float(), seg.new_k.float()], dim=2)
    values = torch.cat([values, seg.window_v.float(), seg.new_v.float()], dim=2)
    r = seg.window_k.shape[2]
    visible = torch.zeros(b, 1, s, t + r + s, dtype=torch.bool)
    for bi in range(b):
        visible[bi, :, :, : seg.quantized_len[bi]] = True
        visible[bi, :, :, t : t + seg.window_len[bi]] = True
        for row in range(s):
            visible[bi, :, row, t + r : t + r + row + 1] = True
    scores = (q.float() @ keys.repeat_interleave(g, 1).transpose(-1, -2)) * d**-0.5
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = probs @ values.repeat_interleave(g, 1)
    position_weights = probs[:, :, -1, :t].clone()
    for bi in range(b):
        lq, wl = int(seg.quantized_len[bi]), int(seg.window_len[bi])
        position_weights[bi, :, lq : lq + wl] += probs[bi, :, -1, t : t + wl]
    position_weights = position_weights.view(b, n_kv, g, t).mean(2)
    return out.to(q.dtype), position_weights


def segments(kv, k, v, s, k_fetch=8, window=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    b, n_kv, t, d = k.shape
    # the window's positions follow Lq
    quantized_len = torch.tensor([t - window, t - 2 * window])[:b]
    fetched_pos = torch.stack(
        [torch.randperm(t, generator=g)[:k_fetch] for _ in range(b * n_kv)]
    ).view(b, n_kv, -1)
    fetched_valid = fetched_pos < quantized_len[:, None, None]

    def gather(x):
        return x.gather(2, fetched_pos.unsqueeze(-1).expand(-1, -1, -1, d))

    return Segments(
        quantized_len,
        gather(k),
        gather(v),
        fetched_pos,
        fetched_valid,
        torch.randn(b, n_kv, window, d, generator=g),
        torch.randn(b, n_kv, window, d, generator=g),
        torch.tensor([5, 0])[:b],
        torch.randn(b, n_kv, s, d, generator=g),
        torch.randn(b, n_kv, s, d, generator=g),
    )


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("s", [1, 2])
def test_mixed_attention_matches_reference(bits, s):
    kv, k, v = lowbit_copy(bits, 64)
    seg = segments(kv, k, v, s)
    q = torch.randn(2, 9, s, 64)
    out, weights = mixed_attention(q, kv, seg)
    ref_out, ref_weights = mixed_attention_reference(q, kv, seg)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-4, atol=1e-6)
    assert not weights[1, :, 256 - 64 :].any(), "positions past Lq got weight"


def test_compiled_mixed_attention_matches_reference():
    kv, k, v = lowbit_copy(1, 64)
    seg = segments(kv, k, v, 2)
    q = torch.randn(2, 9, 2, 64)
    out, weights = torch.compile(mixed_attention, fullgraph=True, dynamic=False)(q, kv, seg)
    ref_out, ref_weights = mixed_attention_reference(q, kv, seg)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-4, atol=1e-6)


def test_fetching_every_position_is_exact_attention():
    """With every quantized position fetched in 16 bits, the low-bit copy no longer matters."""
    kv, k, v = lowbit_copy(1, 64, b=1)
    t = k.shape[2]
    everything = torch.arange(t).view(1, 1, t).expand(1, 3, t)
    seg = Segments(
        torch.tensor([t]),
        k,
        v,
        everything,
        torch.ones(1, 3, t, dtype=torch.bool),
        torch.zeros(1, 3, 64, 64),
        torch.zeros(1, 3, 64, 64),
        torch.tensor([0]),
        torch.randn(1, 3, 2, 64),
        torch.randn(1, 3, 2, 64),
    )
    q = torch.randn(1, 9, 2, 64)
    out, _ = mixed_attention(q, kv, seg)
    keys = torch.cat([k, seg.new_k], 2).repeat_interleave(3, 1)
    values = torch.cat([v, seg.new_v], 2).repeat_interleave(3, 1)
    mask = torch.ones(2, t + 2, dtype=torch.bool)
    mask[0, -1] = False  # the real row does not see the speculative row
    exact = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    torch.testing.assert_close(out, exact, rtol=1e-4, atol=1e-5)


def test_lloyd_levels_are_the_means_of_the_two_halves_and_fit_better():
    # midpoint 2: halves {-2..1} and {3, 6}
    x = torch.tensor([[-2.0, -1.0, 0.0, 0.999, 1.0, 3.0, 6.0]])
    codes, scale, zero = quantize_groups(x, 1, -1, torch.float32, "lloyd")
    assert zero.item() == pytest.approx(-1.001 / 5) and (scale + zero).item() == pytest.approx(4.5)
    assert codes.tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    # bell-shaped data (keys and values are): the squared error drops against the min/max levels
    data = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    errors = {}
    for levels in ("minmax", "lloyd"):
        codes, scale, zero = quantize_groups(data, 1, 0, torch.float16, levels)
        errors[levels] = ((codes.float() * scale.float() + zero.float() - data) ** 2).mean()
    assert errors["lloyd"] < 0.6 * errors["minmax"]
    # 2-bit copies keep the uniform levels
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            quantize_groups(data, 2, 0, torch.float16, "lloyd"),
            quantize_groups(data, 2, 0, torch.float16),
        )
    )


def test_midway_levels_are_halfway_between_lloyd_and_the_paper_for_keys_only():
    # m = -2, M = 6: the paper's levels 0 and 4; Lloyd's -0.2002 and 4.5 (as above)
    x = torch.tensor([[-2.0, -1.0, 0.0, 0.999, 1.0, 3.0, 6.0]])
    codes, scale, zero = quantize_groups(x, 1, -1, torch.float32, "midway")
    assert zero.item() == pytest.approx((-1.001 / 5 + 0.0) / 2)
    assert (scale + zero).item() == pytest.approx((4.5 + 4.0) / 2)
    assert codes.tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    # values take Lloyd's levels under midway (a layer's copy: tests/test_reference_decoder.py)
    v = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(1))
    for a, b in zip(
        quantize_values(v, 1, 32, torch.float16, "midway"),
        quantize_values(v, 1, 32, torch.float16, "lloyd"),
    ):
        assert torch.equal(a, b)


def test_positions_mask_counts_a_position_once_whatever_invalid_slots_repeat():
    """An invalid slot may repeat a valid slot's position (a stale pick): the valid one decides."""
    positions = torch.tensor([[[3, 3, 5, 9]]])
    valid = torch.tensor([[[True, False, False, True]]])
    for order in ([0, 1, 2, 3], [1, 0, 3, 2]):
        mask = positions_mask(positions[..., order], valid[..., order], 8)  # 9 is beyond T: ignored
        assert mask[0, 0].nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("bits", [1, 2])
def test_dropping_positions_equals_excluding_them_from_the_pass(bits):
    """drop_from_lowbit (subtract after the pass) == the pass that excludes those positions."""
    kv, k, v = lowbit_copy(bits, 64)
    seg = segments(kv, k, v, 2)
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 3, 6, 64, generator=g) * 0.3
    picked = torch.stack([torch.randperm(100, generator=g)[:12] for _ in range(6)]).view(2, 3, 12)
    picked_valid = torch.rand(2, 3, 12, generator=g) < 0.8
    picked_valid[..., 0], picked_valid[..., 11] = True, False
    # an invalid entry repeating a valid one (specache/kernels/rank_cpu.c leaves them so)
    picked[..., 11] = picked[..., 0]
    before = lowbit_partial_attention(rows, kv, seg)
    part = drop_from_lowbit(before, kv, picked, picked_valid)
    both = seg._replace(
        fetched_pos=torch.cat([seg.fetched_pos, picked], -1),
        fetched_valid=torch.cat([seg.fetched_valid, picked_valid], -1),
    )
    expected = lowbit_partial_attention(rows, kv, both)
    torch.testing.assert_close(
        part.weights * torch.exp(part.row_max).unsqueeze(-1),
        expected.weights * torch.exp(expected.row_max).unsqueeze(-1),
        rtol=1e-5,
        atol=1e-6,
    )
    # the same pieces, against another row maximum
    scale = torch.exp(part.row_max - expected.row_max)
    # the subtraction's error is a few ulps of the sum before it, not of what remains
    assert ((part.row_sum - expected.row_sum / scale).abs() <= 1e-5 * before.row_sum + 1e-6).all()
    # the output per unit of the low-bit weight: the subtraction's error is a few ulps of the sum
    # taken away (here up to half of it), not of what remains
    torch.testing.assert_close(
        part.out / part.row_sum.unsqueeze(-1),
        expected.out / expected.row_sum.unsqueeze(-1),
        rtol=0,
        atol=5e-5,
    )
