"""The soak test's short version (scripts/bench/soak_serve.py): SpeCache with its slow tier on disk,
the hardest case for what may be left behind."""

import socket

from scripts.bench.soak_serve import soak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_short_soak_loses_nothing_and_leaves_nothing_behind(smollm2_checkpoint):
    """Known answers, second turns, bad requests and hang-ups at concurrency 1-16: no failure (a
    wrong or missing answer, a bad request not refused, memory up by over 10%, threads not back,
    a file left, a traceback)."""
    row = soak(smollm2_checkpoint, "specache-1bit-disk", 40, 0.2, free_port(), seed=1)
    assert row["failures"] == []
    assert row["known"] and row["second_turn"] and row["bad"] and row["hung_up"]
    assert row["reused_tokens"] > 0  # second turns continued kept conversations
