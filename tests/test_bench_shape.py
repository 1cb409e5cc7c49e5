"""scripts/bench/bench_shape.py's parts: the random model and GGUF of a shape, llama.cpp's KV cache
filled by tiling a saved sequence state, and the table's ratios."""

import ctypes

import pytest
import torch

from config import ModelArgs
from quantize import Int4Linear
from scripts.bench.bench import random_model
from scripts.bench.bench_peers import (
    bench_llama_cpp_at_length,
    llama_cpp_available,
    read_sequence_state,
    write_random_gguf,
    write_tiled_state,
)
from scripts.bench.bench_shape import FULL, PEER, table

needs_llama_cpp = pytest.mark.skipif(
    not llama_cpp_available(), reason="llama-cpp-python is not installed"
)
TINY = ModelArgs(
    block_size=4096,
    vocab_size=1000,
    n_layer=2,
    n_head=4,
    n_local_heads=2,
    dim=256,
    intermediate_size=512,
)


def test_random_int4_model_keeps_activations_at_unit_scale():
    model = random_model("SmolLM2-135M", torch.device("cpu"), torch.float32, "int4", 64)
    linear = model.layers[0].feed_forward.w1
    assert isinstance(linear, Int4Linear)
    y = linear(torch.randn(4, linear.in_features))
    assert 0.7 < y.std().item() < 1.4 and y.mean().abs().item() < 0.2


@pytest.fixture(scope="module")
def llama_cpp():
    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed")
    import llama_cpp

    return llama_cpp


@pytest.mark.parametrize("weights", ["q4_0", "q8_0"])
def test_a_random_gguf_loads_in_llama_cpp_with_unit_scale_logits(llama_cpp, tmp_path, weights):
    write_random_gguf(TINY, tmp_path / "random.gguf", weights)
    llm = llama_cpp.Llama(model_path=str(tmp_path / "random.gguf"), n_ctx=64, verbose=False)
    assert llm.n_vocab() == TINY.vocab_size
    llm.eval([5, 6, 7])
    logits = torch.tensor(llama_cpp.llama_get_logits_ith(llm.ctx, -1)[: TINY.vocab_size])
    llm.close()
    assert logits.isfinite().all() and 0.3 < logits.std().item() < 3


def save_state(llama_cpp, llm, path):
    no_tokens = (llama_cpp.llama_token * 1)()
    assert llama_cpp.llama_state_seq_save_file(llm.ctx, str(path).encode(), 0, no_tokens, 0)


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])  # V transposed, and not
def test_tiled_state_is_what_llama_cpp_holds_after_loading_it(llama_cpp, tmp_path, kv_type):
    write_random_gguf(TINY, tmp_path / "random.gguf")
    kind = llama_cpp.GGML_TYPE_F16 if kv_type == "f16" else llama_cpp.GGML_TYPE_Q4_0
    llm = llama_cpp.Llama(
        model_path=str(tmp_path / "random.gguf"),
        n_ctx=256,
        flash_attn=kv_type != "f16",
        type_k=kind,
        type_v=kind,
        verbose=False,
    )
    llm.eval(list(range(10, 30)))
    save_state(llama_cpp, llm, tmp_path / "seed")
    state = read_sequence_state(tmp_path / "seed")
    assert state["v_trans"] == (kv_type == "f16") and len(state["keys"]) == TINY.n_layer
    # the same cells written back: the file llama.cpp wrote, byte for byte
    write_tiled_state(state, 20, tmp_path / "same")
    assert (tmp_path / "same").read_bytes() == (tmp_path / "seed").read_bytes()
    # 20 cells tiled to 150: loaded, then saved again by llama.cpp, the same bytes
    write_tiled_state(state, 150, tmp_path / "tiled")
    loaded, no_tokens = ctypes.c_size_t(0), (llama_cpp.llama_token * 1)()
    assert llama_cpp.llama_state_seq_load_file(
        llm.ctx, str(tmp_path / "tiled").encode(), 0, no_tokens, 1, ctypes.byref(loaded)
    )
    save_state(llama_cpp, llm, tmp_path / "again")
    assert (tmp_path / "again").read_bytes() == (tmp_path / "tiled").read_bytes()
    again = read_sequence_state(tmp_path / "again")
    k_seed, k_tiled = state["keys"][1][2], again["keys"][1][2]
    assert k_tiled.shape[0] == 150 and (k_tiled[40:60] == k_seed).all()
    llm.close()


@needs_llama_cpp
def test_llama_cpp_decodes_from_the_tiled_length(tmp_path):
    write_random_gguf(TINY, tmp_path / "random.gguf")
    row = bench_llama_cpp_at_length(tmp_path / "random.gguf", 300, 2, "q4_0", tmp_path)
    assert row["ms_per_step"] > 0 and row["fast"] == 2 * 2 * 2 * 64 * (300 + 2 + 1) * 18 / 32
    assert not (tmp_path / "tiled.state").exists()


def test_table_gives_ratios_to_our_full_cache_and_llama_cpp_f16_of_the_same_context():
    def row(length, method, tok_s):
        return dict(
            length=length,
            method=method,
            ms_per_step=1e3 / tok_s,
            tok_s=tok_s,
            gbps=10.0,
            bandwidth=20.0,
            fast=1e6,
        )

    rows = [
        row(2048, FULL, 10.0),
        row(2048, "specache-1bit", 15.0),
        row(2048, PEER, 12.0),
        row(4096, FULL, 5.0),
        row(4096, "specache-1bit", 10.0),
    ]
    lines = table(rows, "title").splitlines()
    assert "| 2048 | specache-1bit | 67 | 15.00 | 10.0 | 50% | 1 | 1.50x | 1.25x |" in lines
    assert "| 4096 | specache-1bit | 100 | 10.00 | 10.0 | 50% | 1 | 2.00x | - |" in lines
    assert "| 2048 | llama.cpp, f16 KV | 83 | 12.00 | 10.0 | 50% | 1 | 1.20x | 1.00x |" in lines


@needs_llama_cpp
def test_a_failing_llama_cpp_child_becomes_an_error_naming_its_row(tmp_path):
    from scripts.bench.bench_shape import run_llama_cpp

    with pytest.raises(RuntimeError, match=r"llama.cpp at 300 \(f16 KV\): ValueError"):
        run_llama_cpp(tmp_path / "missing.gguf", 300, 2, "f16", str(tmp_path))
