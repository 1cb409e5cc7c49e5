"""chat.py, the interactive multi-turn chat, driven through stdin in a subprocess on SmolLM2."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from caches.full import FullCache
from caches.plugged import PluggedSpeCache
from conftest import specache_config
from generation import GenerateOptions, generate
from tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parent.parent
TURNS = ["What is the capital of France?", "And of Germany?", "Which of the two is larger?"]
NEW_TOKENS = 16
# small groups, so that three short turns quantize groups and flush the window across turns
SPECACHE = [
    "--specache",
    "--specache_group",
    "16",
    "--specache_residual",
    "16",
    "--specache_topk",
    "16",
]


def chat(checkpoint, lines, *flags, timeout=300):
    return subprocess.run(
        [
            sys.executable,
            "chat.py",
            "--checkpoint",
            str(checkpoint),
            "--temperature",
            "0",
            "--max_new_tokens",
            str(NEW_TOKENS),
            *flags,
        ],
        input="".join(f"{line}\n" for line in lines),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def shown(tokenizer, answer):
    """What chat.py prints of an answer: its text without the stop token."""
    return tokenizer.decode([t for t in answer if t not in tokenizer.stop_ids])


@pytest.mark.parametrize("cache", ["full", "specache"])
def test_three_turns_through_stdin(smollm2_checkpoint, smollm2_model, cache):
    """Each answer equals the greedy answer to the whole conversation so far: prefilled at once from
    position 0 for the full cache; for SpeCache (k = 16 < context), continued through generate's
    own multi-turn arguments (tests/test_chunked_prefill.py holds those to the reference
    decoder)."""
    result = chat(
        smollm2_checkpoint, TURNS + ["/stats", "/exit"], *(SPECACHE if cache == "specache" else [])
    )
    assert result.returncode == 0, result.stderr
    tokenizer = get_tokenizer(smollm2_checkpoint.parent)
    model, expected, stop = smollm2_model, [], frozenset(tokenizer.stop_ids)
    prompt = tokenizer.encode_chat(TURNS[0])
    if cache == "specache":
        config = specache_config(topk=16, group=16, residual=16)
        conversation_cache, held = PluggedSpeCache(model, 1, 4096, config), 0
    for turn in TURNS:
        if cache == "full":
            answer = generate(
                model, FullCache(model, 1, 4096), [prompt], NEW_TOKENS, temperature=0, stop_ids=stop
            ).tokens[0]
            context = prompt + answer
        else:
            answer = generate(
                model,
                conversation_cache,
                [prompt[held:]],
                NEW_TOKENS,
                temperature=0,
                options=GenerateOptions(held=held, keep=True),
                stop_ids=stop,
            ).tokens[0]
            context = prompt + answer
            held = len(context) - 1
        expected.append(shown(tokenizer, answer))
        if turn is not TURNS[-1]:
            closing = [] if answer[-1] == tokenizer.end_of_turn_id else [tokenizer.end_of_turn_id]
            # the template
            prompt = context + closing + tokenizer.encode_next_turn(TURNS[TURNS.index(turn) + 1])
    lines = result.stdout.splitlines()
    assert "\n".join(lines[:-2]) == "\n".join(expected)
    held_line, cache_line = lines[-2:]
    assert held_line == f"conversation: {len(context) - 1} of 4096 tokens in the cache"
    assert cache_line.startswith(
        "cache: full, K and V in torch.float32"
        if cache == "full"
        else "cache: specache 1-bit: fast tier"
    )
    assert result.stderr.count("tokens prefilled") == 3 and "Traceback" not in result.stderr


def test_reset_unknown_commands_and_the_context_limit(smollm2_checkpoint):
    """A 120-token context: the first turn fits, the second does not (said, not crashed); /reset
    starts over and the same turn is answered again, the same way."""
    long_turn = "Tell me about " + "the history of Paris, " * 16  # ~100 tokens
    result = chat(
        smollm2_checkpoint,
        [TURNS[0], "/frobnicate", long_turn, "/reset", TURNS[0], "/stats"],
        "--max_seq_length",
        "120",
    )
    assert result.returncode == 0, result.stderr
    assert "unknown command /frobnicate" in result.stderr
    assert "The conversation has reached the context" in result.stderr and "/reset" in result.stderr
    assert "[a new conversation]" in result.stderr and "Traceback" not in result.stderr
    answers = result.stdout.splitlines()
    assert answers[:3] == [answers[0], answers[0], "conversation: 44 of 120 tokens in the cache"]


def test_ctrl_c_stops_the_answer_not_the_session(smollm2_checkpoint, tmp_path):
    """SIGINT while an answer streams: it stops there ('[answer stopped]'), and the next turn is
    answered on top of what the cache holds (the disk tier's files stay until the session ends)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "chat.py",
            "--checkpoint",
            str(smollm2_checkpoint),
            "--temperature",
            "0",
            "--max_new_tokens",
            "60",
            *SPECACHE,
            "--slow_tier",
            "disk",
            "--slow_tier_dir",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        process.stdin.write("Write a long story about a dragon.\n")
        process.stdin.flush()
        process.stdout.read(20)  # the answer is streaming
        os.kill(process.pid, signal.SIGINT)
        out, err = process.communicate("/stats\nSay hello.\n/exit\n", timeout=300)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert (
        "[answer stopped]" in err and err.count("tokens prefilled") == 2 and "Traceback" not in err
    )
    first_answer = int(err.split(" generated at ")[0].split()[-1])
    assert first_answer < 30  # cut well before its 60 tokens
    assert int(out.split("conversation: ")[1].split()[0]) > 40
    assert list(tmp_path.iterdir()) == []  # the session's files went with it


def test_eviction_caches_cannot_chat(smollm2_checkpoint):
    result = chat(smollm2_checkpoint, ["Hi"], "--cache", "h2o")
    assert result.returncode == 2 and "cannot hold a conversation" in result.stderr
