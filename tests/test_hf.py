"""specache.hf: SpeCache inside HF transformers' LlamaForCausalLM (its attention-function
interface, the adapter's two-row loop) gives the greedy tokens our model gives with SpeCache on the
same weights, k below the context, for our selection and the paper's: a tiny random Llama, and
SmolLM2 loaded into HF from the same GGUF as ours."""

import pytest
import torch

pytest.importorskip("transformers")

from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from checkpoint import load_model
from conftest import make_tiny_hf_model, specache_config
from convert import convert_hf_checkpoint
from generation import generate
from specache import hf

NEW_TOKENS = 32

pytestmark = pytest.mark.usefixtures("one_thread", "specache_kernels")


def ours(model, config, prompts, capacity, stop_ids=frozenset()):
    cache = PluggedSpeCache(model, len(prompts), capacity, config)
    return generate(model, cache, prompts, NEW_TOKENS, temperature=0, stop_ids=stop_ids).tokens


def theirs(model, config, prompts, capacity, stop_ids=()):
    try:
        cache = hf.plug(model, len(prompts), capacity, config)
        return hf.generate(model, cache, prompts, NEW_TOKENS, stop_ids=stop_ids)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("select", ["default", "paper"])
def test_a_tiny_hf_llama_with_specache_gives_our_tokens(tmp_path, select):
    hf_model = make_tiny_hf_model("llama-gqa")
    hf_model.save_pretrained(tmp_path)
    model = load_model(convert_hf_checkpoint(tmp_path), torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (70, 47, 130)]
    config = specache_config(select, bits=1, group=16, residual=16, topk=8)
    expected = ours(model, config, prompts, 170)
    assert theirs(hf_model, config, prompts, 170) == expected
    # the comparison can tell: the full cache answers otherwise
    assert (
        generate(model, FullCache(model, 3, 170), prompts, NEW_TOKENS, temperature=0).tokens
        != expected
    )


@pytest.mark.parametrize("select", ["default", "paper"])
def test_smollm2_in_hf_with_specache_gives_our_tokens(
    smollm2_model, smollm2_checkpoint, hf_smollm2, select
):
    import tokenizer
    from scripts.eval.haystack import needle_prompt

    tokens = tokenizer.get_tokenizer(smollm2_checkpoint.parent)
    prompt = needle_prompt(tokens, 1500, 50)
    config = specache_config(select, bits=1)  # k = 64 of ~1500
    capacity = len(prompt) + NEW_TOKENS
    stop = frozenset(tokens.stop_ids)
    expected = ours(smollm2_model, config, [prompt], capacity, stop)
    assert theirs(hf_smollm2, config, [prompt], capacity, stop) == expected
    assert len(expected[0]) > 16  # an answer (our selection's and the paper's differ here)


def test_models_with_sliding_window_layers_are_refused():
    model = make_tiny_hf_model("mistral-window")
    with pytest.raises(ValueError, match="attend over the whole context"):
        hf.plug(model, 1, 64, specache_config())
