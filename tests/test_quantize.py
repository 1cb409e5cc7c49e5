"""quantize.py: int8 and int4 weight-only quantization, its modules against their references,
the files scripts/convert/quantize_checkpoint.py writes and generate.py loads by name, and SpeCache
on a quantized model."""

import pytest
import torch
import torch.nn.functional as F

from checkpoint import load_model
from conftest import make_tiny_hf_model, tiny_model
from convert import convert_hf_checkpoint
from generation import generate
from model import CAUSAL_PROMPT
from quantize import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantized_state_dict,
)
from scripts.convert import quantize_checkpoint
from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from conftest import specache_config


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model("llama-tied").save_pretrained(directory)
    convert_hf_checkpoint(directory)
    return directory / "model.pth"


def test_codes_stay_within_half_a_step():
    w = torch.randn(48, 96) * torch.linspace(0.1, 3, 96)
    codes, scales = quantize_int8(w)
    assert (
        codes.dtype == torch.int8
        and (dequantize_int8(codes, scales) - w).abs().le(scales[:, None] / 2 + 1e-6).all()
    )
    packed, scales, zeros = quantize_int4(w, 32)
    assert packed.shape == (48, 48) and scales.shape == zeros.shape == (48, 3)
    error = (dequantize_int4(packed, scales, zeros) - w).abs().view(48, 3, 32)
    assert error.le(scales[..., None] / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(w, 64)


def int8_layer(w):
    layer = Int8Linear(w.shape[1], w.shape[0])
    layer.weight, layer.scales = quantize_int8(w)
    return layer


def int4_layer(w, groupsize=32):
    layer = Int4Linear(w.shape[1], w.shape[0], groupsize)
    layer.weight, layer.scales, layer.zeros = quantize_int4(w, groupsize)
    return layer


def test_int8_linear_matches_its_reference_eager_and_compiled(monkeypatch):
    """torch's and inductor's paths, where kernels/linear_cpu.c is off (tests/test_cpu_kernels.py
    tests it)."""
    monkeypatch.setenv("SPECACHE_NO_CPU_KERNEL", "1")
    w, x = torch.randn(80, 64), torch.randn(2, 3, 64)
    layer = int8_layer(w)
    expected = F.linear(x, dequantize_int8(layer.weight, layer.scales))
    # torch's _weight_int8pack_mm
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    many = torch.randn(2, 20, 64)  # prefill: dequantize, then multiply
    torch.testing.assert_close(
        layer(many), F.linear(many, dequantize_int8(layer.weight, layer.scales))
    )
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    # fused multiply-reduce
    torch.testing.assert_close(compiled(x[:, :2]), expected[:, :2], rtol=1e-5, atol=1e-5)


def test_packed_int4_linear_matches_its_reference(monkeypatch):
    """torch's packed int4 matmul (where kernels/linear_cpu.c is off) takes bf16 activations:
    agreement to bf16's precision (8 bits of mantissa, ~0.4%) of the output's scale."""
    monkeypatch.setenv("SPECACHE_NO_CPU_KERNEL", "1")
    w, x = torch.randn(80, 128), torch.randn(2, 3, 128)
    layer = int4_layer(w)
    expected = layer(x)  # unpacked: dequantize, then multiply
    torch.testing.assert_close(
        expected, F.linear(x, dequantize_int4(layer.weight, layer.scales, layer.zeros))
    )
    layer.pack()
    assert layer.weight is None and layer.packed is not None
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-2 * expected.abs().max().item())
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, dynamic=False)(x), layer(x))


@torch.no_grad()
def test_quantized_logits_stay_close_to_the_float_model():
    """int8 per channel keeps each weight within 1/254 of its channel's range, int4 in groups of 32
    within 1/30 of its group's, which for Gaussian weights is a tenth of their spread: on this
    random
    2-layer model the logits' cosine similarity to the float model's is 0.9995 for int8 and 0.95
    for int4; the floors leave room for the seed, not for a wrong scale or code order (which
    fall far below)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 97, (2, 40))
    positions = torch.arange(40).expand(2, -1)
    reference = tiny_model()
    reference.setup_caches(2, 40)
    expected = reference(tokens, positions, CAUSAL_PROMPT)
    for mode, groupsize, floor in [("int8", None, 0.999), ("int4", 32, 0.93)]:
        model = tiny_model()
        state_dict = quantized_state_dict(model, mode, groupsize)
        model.load_state_dict(state_dict, strict=False, assign=True)
        pack_int4(model)
        model.setup_caches(2, 40)
        got = model(tokens, positions, CAUSAL_PROMPT)
        assert F.cosine_similarity(got.flatten(), expected.flatten(), 0) > floor, mode


@pytest.mark.parametrize("mode, name", [("int8", "model_int8.pth"), ("int4", "model_int4.g32.pth")])
def test_files_round_trip_and_decode_with_specache_as_with_the_full_cache(
    tiny_checkpoint, mode, name, capsys
):
    assert (
        quantize_checkpoint.main(
            ["--checkpoint", str(tiny_checkpoint), "--mode", mode, "--groupsize", "32"]
        )
        == 0
    )
    path = tiny_checkpoint.with_name(name)
    assert path.is_file() and f"wrote {path}" in capsys.readouterr().out
    model = load_model(path, torch.device("cpu"), torch.float32)
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    in_memory = load_model(tiny_checkpoint, torch.device("cpu"), torch.float32)
    state_dict = quantized_state_dict(in_memory, mode, 32 if mode == "int4" else None)
    in_memory.load_state_dict(state_dict, strict=False, assign=True)
    pack_int4(in_memory)
    tokens, positions = torch.randint(0, 97, (1, 30)), torch.arange(30)[None]
    for m in (model, in_memory):
        m.setup_caches(1, 30)
    torch.testing.assert_close(
        model(tokens, positions, CAUSAL_PROMPT),
        in_memory(tokens, positions, CAUSAL_PROMPT),
        rtol=0,
        atol=0,
    )

    prompts = [
        torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (40, 75)
    ]
    full = generate(model, FullCache(model, 2, 75 + 20), prompts, 20, temperature=0)
    config = specache_config(topk=256, pair_dtype=torch.float32, group=16, residual=16)
    # a roomy capacity: a slot for every position it quantizes (specache/config.py: fast_tier_plan)
    assert (
        generate(model, PluggedSpeCache(model, 2, 256, config), prompts, 20, temperature=0).tokens
        == full.tokens
    )


def test_quantize_refuses_a_quantized_file_and_a_group_that_does_not_divide(
    tiny_checkpoint, capsys
):
    quantize_checkpoint.main(["--checkpoint", str(tiny_checkpoint), "--mode", "int8"])
    assert (
        quantize_checkpoint.main(["--checkpoint", str(tiny_checkpoint.with_name("model_int8.pth"))])
        == 2
    )
    assert "quantized already" in capsys.readouterr().err
    assert (
        quantize_checkpoint.main(
            ["--checkpoint", str(tiny_checkpoint), "--mode", "int4", "--groupsize", "128"]
        )
        == 2
    )
    assert "group size" in capsys.readouterr().err
    assert not tiny_checkpoint.with_name("model_int4.g128.pth").exists()
