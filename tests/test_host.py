"""The specache/ folder copied alone into another project: a minimal gpt-fast-style host
(tests/minimal_host.py) and the copy, in an empty folder, in a fresh interpreter where this
repository is not on the path. Its greedy tokens and logits against the independent reference
decoder (tests/reference_decoder.py) on the same weights, k below the context, on a tiny model and
on SmolLM2's weights."""

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from reference_decoder import ReferenceDecoder
from specache import Method, Placement, Selection, SpeCacheConfig
from test_reference_decoder import (
    SMOL_ATOL,
    SMOL_MEDIAN_ATOL,
    TINY_ATOL,
    TINY_LENGTHS,
    TINY_MIN_GAP,
    TINY_SEED,
    spread_prompt,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 32

pytestmark = pytest.mark.usefixtures("one_thread")


def copy_project(folder: Path) -> Path:
    """An empty folder with the specache/ folder and the host, nothing else of this repository."""
    folder.mkdir()
    shutil.copytree(
        REPO_ROOT / "specache", folder / "specache", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO_ROOT / "tests" / "minimal_host.py", folder)
    return folder


def python(
    folder: Path, *args: str, interpreter: str = sys.executable
) -> subprocess.CompletedProcess:
    """A fresh interpreter in `folder`: no PYTHONPATH (-E), no user site (-s), this repository's
    one environment (torch) or the given one."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [interpreter, "-E", "-s", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def run_host(
    folder: Path,
    model,
    config: SpeCacheConfig,
    prompts: list[list[int]],
    max_seq_length: int,
    device: str = "cpu",
    interpreter: str = sys.executable,
) -> dict:
    c = model.config
    shape = dict(
        vocab_size=c.vocab_size,
        dim=c.dim,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_local_heads=c.n_local_heads,
        head_dim=c.head_dim,
        intermediate_size=c.intermediate_size,
        norm_eps=c.norm_eps,
        rope_base=c.rope_base,
    )
    job = dict(
        model=shape,
        weights=model.state_dict(),
        method=vars(config.method),
        select=config.selection.name(),
        pair_dtype=config.placement.pair_dtype,
        prompts=prompts,
        new_tokens=NEW_TOKENS,
        max_seq_length=max_seq_length,
        device=device,
    )
    torch.save(job, folder / "job.pt")
    result = python(folder, "minimal_host.py", "job.pt", interpreter=interpreter)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(folder / "job.out.pt", weights_only=True)


def test_the_copy_imports_on_torch_alone_and_the_repository_is_out_of_reach(tmp_path):
    folder = copy_project(tmp_path / "project")
    found = python(folder, "-c", "import specache; print(specache.__file__)")
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == folder / "specache" / "__init__.py"
    for module in ("model", "kernels", "caches", "serving"):
        assert python(folder, "-c", f"import {module}").returncode != 0, module
    imports = python(folder, "-c", "import sys, specache; print(sorted(sys.modules))").stdout
    # the method on torch alone: not the host, nor the kernels or transformers until asked for
    assert "'torch'" in imports and not any(
        name in imports
        for name in ("'kernels", "'model'", "'caches'", "'specache.kernels", "'transformers")
    )


# the copy as it is on each device here: its pinned slow tier beside a GPU, no kernels anywhere
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("select", ["default", "paper"])
def test_a_minimal_host_matches_the_reference_decoder_on_a_tiny_model(tmp_path, select, device):
    config = SpeCacheConfig(
        Method(bits=1, group=16, residual=16, topk=8), Selection.parse(select), Placement()
    )
    model = tiny_model(TINY_SEED)
    generator = torch.Generator().manual_seed(TINY_SEED)
    prompts = [spread_prompt(n, generator) for n in TINY_LENGTHS]
    max_seq_length = max(TINY_LENGTHS) + NEW_TOKENS + 8
    folder = copy_project(tmp_path / "project")
    host = run_host(folder, model, config, prompts, max_seq_length, device)
    reference = ReferenceDecoder(model, config, max_seq_length)
    ref_tokens, ref_logits = reference.generate(prompts, NEW_TOKENS)
    assert reference.min_gap > TINY_MIN_GAP, f"a near-tie in a top-k ({reference.min_gap:.1e})"
    assert host["tokens"] == ref_tokens
    assert [x.shape for x in host["logits"]] == [x.shape for x in ref_logits]
    worst = max((a - b.float()).abs().max().item() for a, b in zip(host["logits"], ref_logits))
    assert worst < TINY_ATOL


def test_a_minimal_host_matches_the_reference_decoder_on_smollm2(
    tmp_path, smollm2_model, smollm2_checkpoint
):
    import tokenizer
    from scripts.eval.haystack import needle_prompt

    prompt = needle_prompt(tokenizer.get_tokenizer(smollm2_checkpoint.parent), 1500, 50)
    # the defaults: k = 64 of ~1500
    config = SpeCacheConfig(Method(bits=1), Selection(), Placement())
    max_seq_length = len(prompt) + NEW_TOKENS + 8
    host = run_host(
        copy_project(tmp_path / "project"), smollm2_model, config, [prompt], max_seq_length
    )
    ref_tokens, ref_logits = ReferenceDecoder(smollm2_model, config, max_seq_length).generate(
        [prompt], NEW_TOKENS
    )
    assert host["tokens"] == ref_tokens
    diffs = [(a - b.float()).abs().max().item() for a, b in zip(host["logits"], ref_logits)]
    assert max(diffs) < SMOL_ATOL and statistics.median(diffs) < SMOL_MEDIAN_ATOL, [
        round(d, 4) for d in diffs
    ]
