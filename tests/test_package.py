"""The package as a user installs it: a wheel built from pyproject.toml, README.md and specache/
alone, installed into a fresh virtual environment and run there in a fresh interpreter, from an
empty folder where this repository is not on the path. The minimal host (tests/minimal_host.py)
then matches the reference decoder, and a tiny HF Llama through `specache.hf` gives the tokens it
gives through this repository's copy, on the kernels built from the installed sources.

The environment gets the package from the wheel and nothing else: torch and transformers come from
this one, behind it on the path (installing them would download gigabytes), so what is tested is
the package's own files and metadata."""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import specache.kernels
from conftest import make_tiny_hf_model, specache_config, tiny_model
from reference_decoder import ReferenceDecoder
from specache import Method, Placement, Selection, SpeCacheConfig
from test_host import NEW_TOKENS, TINY_ATOL, TINY_LENGTHS, TINY_SEED, python, run_host
from test_reference_decoder import spread_prompt

REPO_ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


def run(*args) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[str, Path]:
    """(the fresh environment's interpreter, its site-packages), the package's wheel installed."""
    tmp = tmp_path_factory.mktemp("package")
    source = tmp / "source"  # what the wheel may be built from, nothing more
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source)
    shutil.copytree(
        REPO_ROOT / "specache", source / "specache", ignore=shutil.ignore_patterns("__pycache__")
    )
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp / "dist", source)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("specache-*.whl")
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", venv)
    interpreter = str(venv / "bin" / "python")
    run(interpreter, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel)
    site = Path(run(interpreter, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())  # fmt: skip
    (site / "outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return interpreter, site


def test_the_installed_package_imports_from_the_environment_with_its_metadata(installed, tmp_path):
    interpreter, site = installed
    found = python(
        tmp_path,
        "-c",
        "import json, importlib.metadata as m, specache, specache.hf; "
        "print(json.dumps([specache.__file__, specache.hf.__file__, m.requires('specache')]))",
        interpreter=interpreter,
    )
    assert found.returncode == 0, found.stderr[-3000:]
    package, adapter, requires = json.loads(found.stdout)
    assert Path(package) == site / "specache" / "__init__.py"
    assert Path(adapter) == site / "specache" / "hf.py"
    assert requires == ["torch>=2.6", 'transformers; extra == "hf"']
    for module in ("model", "caches", "kernels"):  # the host is not part of it
        assert python(tmp_path, "-c", f"import {module}", interpreter=interpreter).returncode


def test_the_minimal_host_on_the_installed_package_matches_the_reference_decoder(
    installed, tmp_path
):
    interpreter, _ = installed
    config = SpeCacheConfig(Method(bits=1, group=16, residual=16, topk=8), Selection(), Placement())
    model = tiny_model(TINY_SEED)
    generator = torch.Generator().manual_seed(TINY_SEED)
    prompts = [spread_prompt(n, generator) for n in TINY_LENGTHS]
    max_seq_length = max(TINY_LENGTHS) + NEW_TOKENS + 8
    folder = tmp_path / "host"
    folder.mkdir()
    shutil.copy(REPO_ROOT / "tests" / "minimal_host.py", folder)
    host = run_host(folder, model, config, prompts, max_seq_length, interpreter=interpreter)
    ref_tokens, ref_logits = ReferenceDecoder(model, config, max_seq_length).generate(
        prompts, NEW_TOKENS
    )
    assert host["tokens"] == ref_tokens
    worst = max((a - b.float()).abs().max().item() for a, b in zip(host["logits"], ref_logits))
    assert worst < TINY_ATOL


HF_JOB = """
import json, sys, torch, transformers, specache, specache.hf, specache.kernels
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
job = json.load(open(sys.argv[2]))
config = specache.SpeCacheConfig(
    specache.Method(**job["method"]), specache.Selection.parse(job["select"])
)
cache = specache.hf.plug(model, len(job["prompts"]), job["capacity"], config)  # kernels registered
tokens = specache.hf.generate(model, cache, job["prompts"], job["new_tokens"])
print(json.dumps([specache.kernels.register(), tokens]))
"""


def test_a_tiny_hf_llama_through_the_installed_adapter_gives_the_repository_copys_tokens(
    installed, tmp_path
):
    pytest.importorskip("transformers")
    from specache import hf

    interpreter, _ = installed
    hf_model = make_tiny_hf_model("llama-gqa")
    hf_model.save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (70, 47)]
    config = specache_config("default", bits=1, group=16, residual=16, topk=8)
    job = dict(method=vars(config.method), select="default", prompts=prompts, capacity=150)
    job["new_tokens"] = NEW_TOKENS
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "job.py").write_text(HF_JOB)
    result = python(tmp_path, "job.py", "model", "job.json", interpreter=interpreter)
    assert result.returncode == 0, result.stderr[-3000:]
    paths, tokens = json.loads(result.stdout)
    # the kernels the installed sources build (the same builds: cached by a hash of the sources)
    assert paths == specache.kernels.register()
    try:
        cache = hf.plug(hf_model, len(prompts), 150, config)
        expected = hf.generate(hf_model, cache, prompts, NEW_TOKENS)
    finally:
        hf_model.set_attn_implementation("sdpa")
    assert tokens == expected


def test_without_compilers_the_ops_run_their_definitions_after_one_warning(tmp_path):
    """No gcc or g++ on the path: every CPU op keeps its plain-PyTorch definition, register() says
    so, and one warning (not one per kernel) says what did not build."""
    job = (
        "import json, warnings, specache.kernels\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    paths = specache.kernels.register()\n"
        "print(json.dumps([paths, [str(w.message) for w in caught]]))\n"
    )
    (tmp_path / "bin").mkdir()  # a PATH with no compiler on it
    env = {"PATH": str(tmp_path / "bin"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", job], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    paths, caught = json.loads(result.stdout)
    assert set(paths.values()) == {"plain PyTorch", "plain PyTorch, op by op"}
    assert len(caught) == 1 and "gcc not found" in caught[0] and "g++ not found" in caught[0]
