"""The real default model (SmolLM2-135M-Instruct from its GGUF) against HF transformers."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from caches.full import FullCache
from generation import generate
from tokenizer import get_tokenizer


@pytest.fixture
def hf_gguf_model(hf_smollm2):
    return hf_smollm2


def test_logits_match_hf_loading_the_same_gguf(smollm2_model, smollm2_checkpoint, hf_gguf_model):
    tokenizer = get_tokenizer(smollm2_checkpoint.parent)
    text = (
        "The SpeCache method keeps the whole KV cache in host memory and a 1-bit copy on the GPU. "
        "Each decoding step, the copy decides which keys to fetch. "
    ) * 3
    ids = torch.tensor([tokenizer.encode(text)[:64]])
    assert ids.shape[1] == 64
    with torch.no_grad():
        reference = hf_gguf_model(ids).logits
        smollm2_model.setup_caches(1, 64)
        ours = smollm2_model(ids, torch.arange(64)[None])
    assert (ours - reference).abs().max() < 1e-4 * reference.abs().max()


def test_greedy_generation_matches_hf_generate(smollm2_model, smollm2_checkpoint, hf_gguf_model):
    tokenizer = get_tokenizer(smollm2_checkpoint.parent)
    prompt = tokenizer.encode_chat("What is the capital of France?")
    with torch.no_grad():
        reference = hf_gguf_model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False
        )
    ours = generate(
        smollm2_model,
        FullCache(smollm2_model, 1, len(prompt) + 16),
        [prompt],
        16,
        temperature=0,
        stop_ids=frozenset(tokenizer.stop_ids),
    )
    assert ours.tokens[0] == reference[0, len(prompt) :].tolist()


def test_readme_command_continues_with_paris(smollm2_checkpoint):
    """The README's first command, as a user runs it."""
    out = subprocess.run(
        [
            sys.executable,
            "generate.py",
            "--prompt",
            "The capital of France is",
            "--max_new_tokens",
            "8",
            "--temperature",
            "0",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["texts"][0].lstrip().startswith("Paris")
    assert result["new_tokens"] == [8] and result["prompt_tokens"] == [5]
