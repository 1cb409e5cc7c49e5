"""Tensor parallelism (tp.py) on CPUs with gloo, each rank a process of its own: sharded models give
the unsharded model's logits and greedy tokens with every cache and with int8 and int4 weights;
generate.py under torchrun prints once, its statistics summed over the ranks; a world size that does
not divide the KV heads, a rank that dies and a rank that stops answering end every rank in bounded
time.

Ranks are forked from the test's process (`rank_main`: each writes what `outputs` gives), or run
generate.py; the references are the unsharded models, run in the test's own process. Every rank runs
one thread: the box has two cores and up to four ranks share them.
"""

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, tiny_model
from caches.by_name import make_cache
from checkpoint import DEFAULT_CHECKPOINT_DIR, UserError, load_model, load_tokenizer
from generation import generate
from generate import main
from model import Transformer, precompute_freqs_cis
from quantize import Int4Linear, pack_int4, quantized_state_dict
import tp

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PROMPT_LENGTH, NEW_TOKENS = 64, 16
# Small groups and window, so that within PROMPT_LENGTH + NEW_TOKENS positions SpeCache quantizes
# most of the prompt and reads k = 4 exact pairs per KV head out of ~60 (k < context); the eviction
# baselines keep 24 of them.
CACHE_OPTIONS = dict(group=8, residual=8, topk=4, budget_tokens=24)
GEMMA = dict(
    n_layer=3,
    head_dim=16,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_local_base=500.0,
    sandwich_norm=True,
    qk_norm=True,
    ffn_activation="gelu_tanh",
    scale_embeddings=True,
    norm_in_fp32=True,
    query_pre_attn_scalar=24.0,
)
KV2, KV4 = (
    dict(n_head=4, n_local_heads=2),
    dict(n_head=8, n_local_heads=4, head_dim=16, intermediate_size=128),
)
# name: (tiny_model's shape, weights, the caches whose greedy tokens are compared)
CASES = {
    "kv2": (
        KV2,
        "float",
        ("full", "specache-1bit", "specache-2bit", "kivi-1bit", "streaming", "h2o"),
    ),
    "kv2-int8": (KV2, "int8", ("full", "specache-1bit")),
    "kv2-int4": (KV2, "int4", ("full", "specache-1bit")),
    "qwen-bias": (dict(KV2, qkv_bias=True), "float", ("full",)),
    "gemma-hybrid": (
        dict(GEMMA, n_head=4, n_local_heads=2),
        "float",
        ("full", "specache-1bit", "specache-2bit", "streaming", "h2o"),
    ),
    "kv4": (KV4, "float", ("full", "specache-1bit", "specache-2bit", "h2o")),
    "kv4-int8": (KV4, "int8", ("full", "specache-1bit")),
    "kv4-int4": (KV4, "int4", ("full",)),
}
WORLD_CASES = {
    2: [name for name in CASES if not name.startswith("kv4")] + ["kv4"],
    4: ["kv4", "kv4-int8", "kv4-int4"],
}
SMOLLM2 = DEFAULT_CHECKPOINT_DIR / "model.pth"
SMOLLM2_PROMPT = (
    "Tensor parallelism splits every layer's heads over several processes; each process keeps the "
    "keys and values of its own heads, and two sums a layer join their work."
)


def quantized(model: Transformer, weights: str) -> Transformer:
    """`model` with int8 (per channel) or int4 (groups of 16) weights, not yet packed."""
    if weights != "float":
        model.load_state_dict(
            quantized_state_dict(model, weights, 16 if weights == "int4" else None),
            strict=False,
            assign=True,
        )
    return model


def ready(model: Transformer, shard: bool, device: torch.device) -> Transformer:
    """Cut to this rank's shard (with shard), then moved to `device` and packed for it."""
    if shard:
        tp.shard_model(model, tp.rank(), tp.world_size())
        tp.all_reduce_partial_sums(model)
    model = model.to(device)
    pack_int4(model)
    return model


def random_prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@torch.no_grad()
def outputs(model: Transformer, prompt: list[int], methods, new_tokens: int = NEW_TOKENS) -> dict:
    """The prompt's logits at every position (full cache), and for each cache its greedy new tokens
    and statistics."""
    model.setup_caches(1, len(prompt))
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None])
    runs = {
        method: generate(
            model,
            make_cache(method, model, 1, len(prompt) + new_tokens, **CACHE_OPTIONS),
            [prompt],
            new_tokens,
        )
        for method in methods
    }
    return {
        "logits": logits.cpu(),
        "tokens": {m: run.tokens[0] for m, run in runs.items()},
        "stats": {m: run.stats for m, run in runs.items()},
    }


def tiny_case(name: str, shard: bool, device: torch.device = torch.device("cpu")) -> dict:
    shape, weights, methods = CASES[name]
    model = ready(quantized(tiny_model(**shape), weights), shard, device)
    return outputs(model, random_prompt(PROMPT_LENGTH, model.config.vocab_size), methods)


def smollm2_case(model: Transformer) -> dict:
    prompt = load_tokenizer(SMOLLM2, model).encode(SMOLLM2_PROMPT)
    return outputs(model, prompt, ("full", "specache-1bit"), new_tokens=8)


def rank_main(r: int, world: int, port: int, scenario: str, out: Path) -> None:
    """Rank r of a scenario (on CPUs forked from the test's process, where torch is imported
    already;
    on GPUs spawned): its outputs into out/rank<r>.pt."""
    os.environ.update(
        ONE_THREAD,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(r),
        LOCAL_RANK=str(r),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    device = tp.join("cuda" if scenario == "tiny-cuda" else "cpu", timeout_s=60)
    if scenario == "tiny":
        results = {name: tiny_case(name, shard=True) for name in WORLD_CASES[world]}
    elif scenario == "tiny-cuda":
        results = {"kv2": tiny_case("kv2", shard=True, device=device)}
    elif scenario == "rank 1 fails to set up":
        results = setting_up_with_a_failure_on_rank_1()
    else:
        results = smollm2_case(tp.load_model_shard(SMOLLM2, torch.device("cpu"), torch.float32))
    torch.save(results, out / f"rank{r}.pt")
    tp.leave()


def setting_up_with_a_failure_on_rank_1() -> str:
    """What `tp.agree` gives a rank when rank 1 alone fails to set up."""

    def setup() -> str:
        if tp.rank() == 1:
            raise UserError("no room on this rank")
        return "set up"

    try:
        return tp.agree(setup)
    except UserError as e:
        return f"UserError: {e}"


# --- launching ranks -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world: int, argv: list[str], logs: Path) -> list[subprocess.Popen]:
    """`world` processes of `python argv...` with the environment torchrun would give them; each
    one's
    stdout and stderr go to logs/rank<r>.out and .err."""
    env = dict(
        os.environ,
        **ONE_THREAD,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    logs.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [sys.executable, *argv],
            cwd=REPO_ROOT,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=open(logs / f"rank{r}.out", "w"),
            stderr=open(logs / f"rank{r}.err", "w"),
        )
        for r in range(world)
    ]


def wait_all(processes: list[subprocess.Popen], timeout: float) -> list[int]:
    """Every process's exit code; all are killed, and the test fails, if any runs past `timeout`."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in processes]
    except subprocess.TimeoutExpired:
        for p in processes:
            p.kill()
        pytest.fail(f"the ranks did not all exit within {timeout} s")


def run_ranks(world: int, scenario: str, out: Path, timeout: float = 120) -> list[dict]:
    """Each rank's outputs of a scenario; a rank's exception fails the test with its traceback. CUDA
    ranks are spawned (a CUDA driver does not survive a fork), CPU ones forked (no import of
    torch)."""
    method = "spawn" if scenario == "tiny-cuda" else "fork"
    ranks = torch.multiprocessing.start_processes(
        rank_main,
        (world, free_port(), scenario, out),
        nprocs=world,
        join=False,
        start_method=method,
    )
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the ranks did not all exit within {timeout} s")
    return [torch.load(out / f"rank{r}.pt", map_location="cpu") for r in range(world)]


@pytest.fixture(scope="module")
def ranks_ran(tmp_path_factory):
    """The ranks' outputs of a (world size, scenario), each run once."""
    done = {}

    def ran(world: int, scenario: str) -> list[dict]:
        if (world, scenario) not in done:
            done[world, scenario] = run_ranks(
                world, scenario, tmp_path_factory.mktemp(f"{scenario}{world}")
            )
        return done[world, scenario]

    return ran


def assert_same_as_unsharded(ranks: list[dict], reference: dict) -> None:
    for r, got in enumerate(ranks):
        torch.testing.assert_close(
            got["logits"], reference["logits"], rtol=1e-4, atol=1e-4, msg=f"rank {r}"
        )
        assert got["tokens"] == reference["tokens"], f"rank {r}"


# --- the shards, in one process ------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("weights", ["float", "int8", "int4"])
def test_the_ranks_partial_sums_add_up_to_each_block(weights, world):
    """Without the all-reduce, rank r's attention and FFN give partial sums; over the ranks they
    add up
    to the unsharded block's output (here in one process, for every layout of the weights)."""
    torch.manual_seed(0)
    whole = quantized(tiny_model(**{**GEMMA, **KV4}), weights)
    shards = [copy.deepcopy(whole) for _ in range(world)]
    for r, shard in enumerate(shards):
        tp.shard_model(shard, r, world)
        assert (
            shard.config.n_local_heads == 4 // world
            and shard.layers[0].attention.n_head == 8 // world
        )
    x = torch.randn(1, 12, whole.config.dim)
    positions = torch.arange(12)[None]
    freqs = precompute_freqs_cis(12, 16)[positions]
    for model in [whole, *shards]:
        model.setup_caches(1, 12)
        pack_int4(model)

    def block_outputs(model):
        block = model.layers[1]  # the full-attention layer
        return block.attention(x, freqs, None, positions), block.feed_forward(x)

    expected = block_outputs(whole)
    summed = [sum(parts) for parts in zip(*map(block_outputs, shards))]
    for got, want in zip(summed, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_world_size_that_does_not_divide_the_kv_heads_is_refused():
    with pytest.raises(ValueError, match="3 ranks cannot share this model's 2 KV heads.*1, 2"):
        tp.shard_model(tiny_model(**KV2), 0, 3)


def test_an_int4_share_that_is_not_whole_groups_is_refused():
    """In groups of 32: wo's 64 inputs give 32 per rank at 2 ranks, w2's 96 give 48, not whole
    groups."""
    model = tiny_model(**KV2)
    model.load_state_dict(quantized_state_dict(model, "int4", 32), strict=False, assign=True)
    assert isinstance(model.layers[0].feed_forward.w2, Int4Linear)
    with pytest.raises(
        ValueError, match="feed_forward.w2: 2 ranks would cut its 96 int4 input channels into 48"
    ):
        tp.shard_model(model, 0, 2)


# --- ranks in processes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world, case", [(2, name) for name in WORLD_CASES[2]] + [(4, name) for name in WORLD_CASES[4]]
)
def test_sharded_logits_and_greedy_tokens_match_the_unsharded_model(ranks_ran, world, case):
    reference = tiny_case(case, shard=False)
    for method in CASES[case][2]:
        # k < context: SpeCache quantized the prompt and read exact pairs
        if method.startswith("specache"):
            assert 0 < reference["stats"][method]["topk"] < PROMPT_LENGTH
            assert reference["stats"][method]["bytes_fetched_per_token"] > 0
    assert_same_as_unsharded([ranks[case] for ranks in ranks_ran(world, "tiny")], reference)


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="the SmolLM2 checkpoint is not prepared")
def test_smollm2_at_three_ranks_gives_the_single_process_tokens(ranks_ran):
    """SmolLM2-135M has 3 KV heads: one per rank, full cache and SpeCache 1-bit."""
    ranks = ranks_ran(3, "smollm2")
    reference = smollm2_case(load_model(SMOLLM2, torch.device("cpu"), torch.float32))
    assert reference["stats"]["specache-1bit"]["bytes_fetched_per_token"] > 0
    assert_same_as_unsharded(ranks, reference)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs (scripts/gpu_check.sh runs them)"
)
def test_two_gpus_with_nccl_give_the_unsharded_logits_and_tokens(tmp_path):
    """Ranks on cuda:0 and cuda:1 (SpeCache's fetches each on its own GPU's tier) against one
    GPU."""
    ranks = run_ranks(2, "tiny-cuda", tmp_path)
    assert_same_as_unsharded(
        [outputs["kv2"] for outputs in ranks], tiny_case("kv2", False, torch.device("cuda", 0))
    )


def test_a_rank_that_alone_fails_to_set_up_stops_every_rank_with_its_message(tmp_path):
    assert (
        run_ranks(2, "rank 1 fails to set up", tmp_path)
        == ["UserError: rank 1: no room on this rank"] * 2
    )


# --- generate.py under torchrun ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> dict[int, Path]:
    """model.pth of tiny random models with 2 and 3 KV heads, with a small byte-level BPE tokenizer
    (no stop token, so that a generation runs as long as it is asked to)."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        [SMOLLM2_PROMPT * 4, __doc__], vocab_size=300, show_progress=False
    )
    paths = {}
    for kv_heads in (2, 3):
        directory = tmp_path_factory.mktemp(f"tiny-kv{kv_heads}")
        tokenizer.save(str(directory / "tokenizer.json"))
        model = tiny_model(
            vocab_size=tokenizer.get_vocab_size(),
            n_head=2 * kv_heads,
            n_local_heads=kv_heads,
            head_dim=16,
        )
        torch.save(model.state_dict(), directory / "model.pth")
        c = model.config
        (directory / "config.json").write_text(
            json.dumps(
                dict(
                    model_type="llama",
                    vocab_size=c.vocab_size,
                    hidden_size=c.dim,
                    intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.n_layer,
                    num_attention_heads=c.n_head,
                    num_key_value_heads=c.n_local_heads,
                    head_dim=c.head_dim,
                    max_position_embeddings=c.block_size,
                    rope_theta=c.rope_base,
                    rms_norm_eps=c.norm_eps,
                )
            )
        )
        paths[kv_heads] = directory / "model.pth"
    return paths


def torchrun(world: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(world),
            "generate.py",
            *argv,
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ, **ONE_THREAD),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_torchrun_prints_once_with_the_statistics_summed_over_ranks(tiny_checkpoints, capsys):
    argv = [
        "--checkpoint",
        str(tiny_checkpoints[2]),
        "--prompt",
        SMOLLM2_PROMPT,
        "--max_new_tokens",
        "12",
        "--temperature",
        "0",
        "--cache",
        "specache",
        "--specache_group",
        "8",
        "--specache_residual",
        "8",
        "--specache_topk",
        "4",
        "--json",
    ]
    ran = torchrun(2, argv, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert main(argv) == 0
    single = json.loads(capsys.readouterr().out)
    lines = ran.stdout.splitlines()
    assert len(lines) == 1 and ran.stderr.count("Loaded ") == 1, (ran.stdout, ran.stderr)
    sharded = json.loads(lines[0])
    assert sharded["world_size"] == 2 and single["world_size"] == 1
    assert sharded["texts"] == single["texts"] and sharded["topk"] == single["topk"] == 4
    for summed in ("fast_tier_bytes", "slow_tier_bytes", "bytes_fetched_per_token"):
        assert sharded[summed] == pytest.approx(single[summed]), summed
    for ratio in (
        "fast_tier_ratio_to_16bit_cache",
        "speculative_match_rate",
        "prefetch_discarded_share",
    ):
        assert sharded[ratio] == pytest.approx(single[ratio]), ratio


def test_a_world_size_that_does_not_divide_the_kv_heads_is_one_error_line(
    tiny_checkpoints, tmp_path
):
    """Every rank meets it; rank 0 alone says so, and every rank exits with code 2."""
    ranks = start_ranks(
        2,
        ["generate.py", "--checkpoint", str(tiny_checkpoints[3]), "--max_new_tokens", "4"],
        tmp_path,
    )
    assert wait_all(ranks, timeout=60) == [2, 2]
    stderr = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert stderr[1] == "" and "Traceback" not in stderr[0], stderr
    errors = [line for line in stderr[0].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "2 ranks cannot share this model's 3 KV heads" in errors[0], stderr[
        0
    ]


def generation_that_runs_until_stopped(
    checkpoint: Path, logs: Path, timeout_s: int
) -> list[subprocess.Popen]:
    """Two ranks (without torchrun, whose agent would end the survivors itself) streaming a long
    generation; returns once rank 0 has streamed new text, i.e. mid-run."""
    prompt = "Several processes"
    ranks = start_ranks(
        2,
        [
            "generate.py",
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max_new_tokens",
            "50000",
            "--tp_timeout",
            str(timeout_s),
        ],
        logs,
    )
    deadline = time.monotonic() + 60
    while len((logs / "rank0.out").read_text()) <= len(prompt) + 8:
        assert time.monotonic() < deadline and ranks[0].poll() is None, (
            logs / "rank0.err"
        ).read_text()
        time.sleep(0.1)
    return ranks


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_rank_that_dies_or_stops_answering_ends_the_others_within_the_timeout(
    tiny_checkpoints, tmp_path, how
):
    """Killed: gloo sees its connection close, and rank 0 stops at once. Stopped (SIGSTOP: alive,
    silent):
    rank 0's next all-reduce gives up after --tp_timeout seconds."""
    ranks = generation_that_runs_until_stopped(tiny_checkpoints[2], tmp_path, timeout_s=3)
    ranks[1].send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        code = ranks[0].wait(timeout=30)
    finally:
        ranks[1].kill()
        ranks[0].kill()
    assert code == 1 and time.monotonic() - t0 < (10 if how == "killed" else 3 + 15)
    errors = [
        line
        for line in (tmp_path / "rank0.err").read_text().splitlines()
        if line.startswith("error:")
    ]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 of 2: "), errors
