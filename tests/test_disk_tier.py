"""The disk slow tier (caches/disk_tier.py) against the RAM one: the same tokens and logits, files
that exist only while a generation runs, and one clear error when the disk fails."""

import errno
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from caches import disk_tier
from conftest import tiny_model
from specache import SlowTierError
from generation import generate
from generate import main
from scripts.eval.harness import Runner
from scripts.eval.haystack import needle_prompt
from caches.plugged import PluggedSpeCache
from conftest import specache_config
from specache import SpeCacheLayer
from caches.stats import Diagnostics
from tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 24
# ragged, with window flushes (g = R = 16): sequence b's pairs sit at offset b x capacity in each
# file
LENGTHS = (70, 47, 130)
SMALL = dict(topk=8, group=16, residual=16)
# name: (config, with the diagnostics)
CONFIGS = {
    "default-1bit": (specache_config(bits=1, **SMALL), False),
    "default-2bit-stats": (specache_config(bits=2, **SMALL), True),
    "paper-1bit-waited": (specache_config("paper", bits=1, overlap_fetch=False, **SMALL), False),
    "paper-2bit": (specache_config("paper", bits=2, **SMALL), False),  # no reuse
    "nospec-1bit": (specache_config(bits=1, speculative=False, **SMALL), False),
    "shortlist-1bit": (specache_config("default,shortlist=3", bits=1, **SMALL), False),
    "no-shortlist-1bit": (specache_config("default,shortlist=0", bits=1, **SMALL), False),
}


@pytest.fixture(autouse=True)
def ram_tier_op_by_op(monkeypatch):
    """The RAM tier's layers run op by op, as the disk tier's do, not in one op per layer (whose
    CPU kernel drops the picks' low-bit share in another order of additions): so both tiers
    compute the same floats, and their logits can be held equal bit for bit."""
    monkeypatch.setattr(
        SpeCacheLayer,
        "step_in_ram",
        lambda self, rows, k, v, correct: self.step_in_parts(
            rows, k, v, True, self.prefetch_missed(rows, k.shape[2]) if correct else None
        ),
    )


def disk_cache(model, capacity, tmp_path, batch=1, config=None, stats=False):
    """SpeCache with its slow tier on disk under tmp_path (None: in RAM)."""
    probe = (
        Diagnostics(model.config.n_layer, model.config.n_local_heads, torch.device("cpu"))
        if stats
        else None
    )
    where = dict(slow_tier="disk", slow_tier_dir=str(tmp_path)) if tmp_path is not None else {}
    return PluggedSpeCache(
        model, batch, capacity, config or specache_config(bits=1, **SMALL), probe=probe, **where
    )


def tiny_run(case, tmp_path=None, lengths=LENGTHS, callback=lambda tokens: None):
    """Tokens and every pass's logits of a ragged batch, with the RAM tier or (tmp_path) the disk
    one."""
    model = tiny_model(3)
    config, stats = case
    prompts = [
        torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in lengths
    ]
    cache = disk_cache(model, max(lengths) + NEW_TOKENS, tmp_path, len(prompts), config, stats)
    logits = []
    hook = model.output.register_forward_hook(
        lambda module, args, out: logits.append(out.detach().clone())
    )
    try:
        result = generate(model, cache, prompts, NEW_TOKENS, temperature=0, callback=callback)
    finally:
        hook.remove()
    return result, logits


@pytest.mark.parametrize("name", CONFIGS)
def test_disk_tier_decodes_exactly_as_the_ram_tier(name, tmp_path):
    """Catches a pair written or read at the wrong offset (sequence, position, head, K/V), a
    prefetch
    that lands in the wrong layer or step, and reuse handing back a stale pair: logits equal bit
    for bit."""
    ram, ram_logits = tiny_run(CONFIGS[name])
    disk, disk_logits = tiny_run(CONFIGS[name], tmp_path)
    assert disk.tokens == ram.tokens
    assert len(ram_logits) == len(disk_logits) and all(
        torch.equal(a, b) for a, b in zip(ram_logits, disk_logits)
    )
    assert disk.stats["slow_tier"] == "disk" and disk.stats["slow_tier_bytes_read_per_step"] > 0
    assert list(tmp_path.iterdir()) == []  # the files went with the generation


class GarbageEmpty:
    """torch, but `empty` gives NaN, as recycled memory can (the high half of a -inf float32 is an
    fp16 NaN)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.full_like(torch.empty(*args, **kwargs), float("nan"))


def test_slots_of_invalid_positions_hold_zeros_not_garbage(tmp_path, monkeypatch):
    """A prompt with nothing quantized yet (20 < R + g): every position the prefetch and the picks
    name is invalid, and the attention weighs their slots by 0, which NaN would survive."""
    monkeypatch.setattr(disk_tier, "torch", GarbageEmpty())
    for name in ("default-1bit", "nospec-1bit"):
        ram, ram_logits = tiny_run(CONFIGS[name], lengths=(20, 70))
        disk, disk_logits = tiny_run(CONFIGS[name], tmp_path, lengths=(20, 70))
        assert all(torch.isfinite(x).all() for x in disk_logits)
        assert disk.tokens == ram.tokens and all(
            torch.equal(a, b) for a, b in zip(ram_logits, disk_logits)
        )


def test_ctrl_c_in_the_loop_removes_the_files_at_once(tmp_path):
    """Not at exit: while the cache object still lives."""

    def interrupt(tokens, seen=[]):
        seen.append(tokens)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tiny_run(CONFIGS["default-1bit"], tmp_path, callback=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_a_second_begin_replaces_the_folder(tmp_path):
    model = tiny_model(3)
    cache = disk_cache(model, 200, tmp_path)
    cache.begin(torch.zeros(1, 60, dtype=torch.long), torch.tensor([60]))
    first = list(tmp_path.iterdir())
    cache.begin(torch.zeros(1, 60, dtype=torch.long), torch.tensor([60]))
    second = list(tmp_path.iterdir())
    cache.finish()
    assert len(first) == len(second) == 1 and first != second and list(tmp_path.iterdir()) == []


def test_the_files_exist_while_a_generation_runs_and_one_process_never_shares_them(tmp_path):
    model = tiny_model(3)
    caches = [disk_cache(model, 200, tmp_path) for _ in range(2)]
    seen = []

    def look(tokens):
        folders = sorted(tmp_path.iterdir())
        seen.append(
            [(f.name, sorted((p.name, p.stat().st_size) for p in f.iterdir())) for f in folders]
        )

    prompt = list(range(60))
    # a second generation open beside the first
    caches[0].begin(torch.tensor([prompt]), torch.tensor([60]))
    generate(model, caches[1], [prompt], 4, temperature=0, callback=look)
    caches[0].finish()
    folders = seen[0]
    assert len(folders) == 2 and folders[0][0] != folders[1][0]
    assert all(name.startswith(f"specache-{os.getpid()}-") for name, _ in folders)
    # B x capacity (a whole group) x Hkv x (K, V) x D x 2 bytes
    layer_bytes = 1 * 208 * 2 * 2 * 16 * 2
    assert folders[0][1] == [(f"layer{i:03d}.kv", layer_bytes) for i in range(2)]
    assert list(tmp_path.iterdir()) == []


def failing(call, after: int, error: int):
    """`call` that raises OSError(error) from its (after + 1)-th use on."""
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] > after:
            raise OSError(error, os.strerror(error))
        return call(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize(
    "module, what, error, message",
    [
        (os, "pwrite", errno.ENOSPC, "no space left for SpeCache's slow tier"),
        (
            os,
            "pwrite",
            errno.EROFS,
            "writing SpeCache's slow tier in .* failed: Read-only file system",
        ),
        (mmap, "mmap", errno.ENODEV, "cannot memory-map files, which the disk tier reads through"),
    ],
)
def test_a_disk_error_is_one_clear_error_and_removes_the_files(
    module, what, error, message, tmp_path, monkeypatch
):
    monkeypatch.setattr(
        module, what, failing(getattr(module, what), 40 if what == "pwrite" else 0, error)
    )
    with pytest.raises(SlowTierError, match=message):
        tiny_run(CONFIGS["default-1bit"], tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_too_little_free_space_fails_before_prefill(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(SlowTierError, match=r"no space left .* it needs 0\.00\d* GB"):
        tiny_run(CONFIGS["default-1bit"], tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_generate_prints_one_error_line_for_a_missing_directory(tmp_path, capsys):
    code = main(
        [
            "--specache",
            "--slow_tier",
            "disk",
            "--slow_tier_dir",
            str(tmp_path / "missing"),
            "--prompt",
            "Hi",
            "--max_new_tokens",
            "2",
            "--temperature",
            "0",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and err[-1]
        == f"error: the slow tier's directory {tmp_path / 'missing'} does not exist "
        "(--slow_tier_dir)"
    )


@pytest.mark.parametrize(
    "sent, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)]
)
def test_a_real_process_stopped_while_it_runs_leaves_nothing_behind(
    sent, code, tmp_path, smollm2_checkpoint
):
    """Ctrl-C (SIGINT) or a plain kill (SIGTERM) once its files exist: the exit code says so, the
    folder is gone."""
    process = subprocess.Popen(
        [
            sys.executable,
            "generate.py",
            "--specache",
            "--slow_tier",
            "disk",
            "--slow_tier_dir",
            str(tmp_path),
            "--prompt",
            "Once upon a time " * 80,
            "--max_new_tokens",
            "2000",
            "--max_seq_length",
            "2400",
            "--temperature",
            "0",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # a test run started in the background (`cmd &`) ignores SIGINT, and its children would
        # inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not any(folder.is_dir() and any(folder.iterdir()) for folder in tmp_path.iterdir()):
            assert process.poll() is None and time.monotonic() < deadline, (
                "no slow-tier files appeared"
            )
            time.sleep(0.2)
        time.sleep(2)  # most likely decoding by now; in prefill the same cleanup must hold
        process.send_signal(sent)
        _, err = process.communicate(timeout=60)
        assert process.returncode == code, err
    finally:
        process.kill()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def smollm2_4k(smollm2_model, smollm2_checkpoint):
    tokenizer = get_tokenizer(smollm2_checkpoint.parent)
    prompt = needle_prompt(tokenizer, 4000, 50)
    runner = Runner(
        smollm2_model,
        tokenizer,
        ["specache-1bit", "specache-2bit", "specache-nospec-1bit", "specache-nospec-2bit"],
    )
    return runner, prompt, runner.prefill(prompt, NEW_TOKENS)


@pytest.mark.parametrize(
    "method", ["specache-1bit", "specache-2bit", "specache-nospec-1bit", "specache-nospec-2bit"]
)
def test_default_model_at_4k_gives_the_ram_tiers_tokens(method, smollm2_4k, tmp_path):
    runner, prompt, prefilled = smollm2_4k
    ram = runner.decode(method, prompt, prefilled, NEW_TOKENS)
    disk = runner.decode(
        method, prompt, prefilled, NEW_TOKENS, slow_tier="disk", slow_tier_dir=str(tmp_path)
    )
    assert disk.tokens == ram.tokens
    assert disk.stats["slow_tier_bytes_read_per_step"] > 0
    assert list(tmp_path.iterdir()) == []
