"""Tokenizers against their reference libraries, and chat formats against the models' own
templates."""

import base64
import io
import random

import jinja2
import pytest

from tokenizer import (
    IncrementalText,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    get_tokenizer,
)

PIECES = [
    "hello",
    "world",
    " The",
    "quick brown fox",
    "naïve café",
    "Straße",
    "日本語のテキスト",
    "中文",
    "😀🚀",
    "Ελληνικά",
    "русский",
    "\t",
    "\n",
    "\n\n",
    "   ",
    "  leading",
    "trailing  ",
    "def f(x):\n    return x**2",
    "if (a && b) { c++; }",
    "<div class=\"x\">",
    "x = [1, 2, 3]",
    "12345",
    "3.14159",
    "2024-12-02",
    "$100.00",
    "1e-5",
    "don't",
    "we'll",
    "I'M",
    "https://example.com/a?b=c",
    "snake_case_name",
    "CamelCase",
    "!!!",
    "...",
    "—",
    "\u00a0",
    "¿Qué?",
    "a\r\nb",
    "<|im_start|>",
    "0x1F",
    "٣٤٥",
    "Ⅻ",
    "½",
]


def varied_strings(n: int = 300) -> list[str]:
    rng = random.Random(0)
    strings = list(PIECES)
    while len(strings) < n:
        strings.append(
            "".join(
                rng.choice(PIECES) + rng.choice(["", " ", "", "\n"])
                for _ in range(rng.randint(2, 6))
            )
        )
    return strings


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_checkpoint):
    return get_tokenizer(smollm2_checkpoint.parent)


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_gguf):
    """HF's own tokenizer built from the same GGUF, with llama.cpp's 'smollm' rule (digits split
    one by one)."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    backend = hf.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    return backend


def test_smollm2_tokenizer_matches_hf_gguf_tokenizer(smollm2_tokenizer, hf_gguf_tokenizer):
    assert isinstance(smollm2_tokenizer, HFTokenizer)
    for text in varied_strings():
        ours = smollm2_tokenizer.encode(text)
        assert ours == hf_gguf_tokenizer.encode(text, add_special_tokens=False).ids, text
        assert smollm2_tokenizer.decode(ours) == text


def test_smollm2_tokenizer_splits_digits_and_knows_its_special_tokens(smollm2_tokenizer):
    assert len(smollm2_tokenizer.encode("2024")) == 4
    assert smollm2_tokenizer.encode("<|im_start|>user")[0] == 1
    assert smollm2_tokenizer.stop_ids == {0, 2}  # <|endoftext|> and <|im_end|>
    assert smollm2_tokenizer.vocab_size == 49152


def assert_next_turn_continues(tokenizer, conversation):
    """A conversation [..., user, assistant, user] in ids is the ids of all but its last two
    messages,
    the reply and its end-of-turn token, then encode_next_turn of the last message: what chat.py
    prefills for a turn on top of the cache is what the whole conversation's template gives."""
    *before, reply, turn = conversation
    whole, first = tokenizer.encode_messages(conversation), tokenizer.encode_messages(before)
    following = tokenizer.encode_next_turn(turn["content"])
    assert whole[: len(first)] == first and whole[-len(following) :] == following
    middle = whole[len(first) : -len(following)]
    assert middle[-1] == tokenizer.end_of_turn_id
    assert tokenizer.decode(middle[:-1]).strip() == reply["content"].strip()


def test_chatml_matches_the_models_own_template(smollm2_tokenizer, smollm2_checkpoint):
    import json

    template = json.loads((smollm2_checkpoint.parent / "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    for system in (None, "Answer in French."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is SpeCache?"}
        ]
        expected = env.from_string(template).render(messages=messages, add_generation_prompt=True)
        assert (
            smollm2_tokenizer.decode(smollm2_tokenizer.encode_chat("What is SpeCache?", system))
            == expected
        )
        conversation = messages + [
            {"role": "assistant", "content": "A KV cache."},
            {"role": "user", "content": "More?"},
        ]
        expected = env.from_string(template).render(
            messages=conversation, add_generation_prompt=True
        )
        assert smollm2_tokenizer.decode(smollm2_tokenizer.encode_messages(conversation)) == expected
        assert_next_turn_continues(smollm2_tokenizer, conversation)
    with pytest.raises(ValueError, match="roles"):
        smollm2_tokenizer.encode_messages(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% "
    "if loop.index0 "
    "== 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
    "add_generation_prompt "
    "%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
    "system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = "
    "false %}{% endif "
    "%}{% for message in loop_messages %}{% if loop.index0 == 0 and system_message != false %}{% "
    "set content = "
    "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set "
    "content = "
    "message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
    "content.strip() "
    "+ ' [/INST]' }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tiny_tiktoken_file(tmp_path_factory):
    """A small tiktoken rank file: all bytes plus a few merges."""
    ranks = [bytes([b]) for b in range(256)] + [
        b"th",
        b"he",
        b"in",
        b" t",
        b" the",
        b"er",
        b"an",
        b"on",
    ]
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text(
        "".join(f"{base64.b64encode(tok).decode()} {i}\n" for i, tok in enumerate(ranks))
    )
    return path


def test_tiktoken_wrapper_matches_tiktoken(tiny_tiktoken_file):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    tokenizer = get_tokenizer(tiny_tiktoken_file.parent)
    assert isinstance(tokenizer, TiktokenTokenizer)
    ranks = load_tiktoken_bpe(str(tiny_tiktoken_file))
    reference = tiktoken.Encoding(
        "ref",
        pat_str=TiktokenTokenizer.pattern,
        mergeable_ranks=ranks,
        special_tokens=tokenizer.special_tokens,
    )
    base = len(ranks)
    assert tokenizer.vocab_size == base + 256
    assert tokenizer.bos_id == base and tokenizer.token_to_id("<|eot_id|>") == base + 9
    assert tokenizer.stop_ids == {base + 1, base + 9}
    for text in varied_strings(100):
        assert tokenizer.encode(text) == [base] + reference.encode(text, disallowed_special=())
        assert tokenizer.decode(tokenizer.encode(text, bos=False)) == text
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": " Hi there\n"},
    ]
    expected = jinja2.Template(LLAMA3_TEMPLATE).render(
        messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=True
    )
    assert tokenizer.encode_chat(" Hi there\n", "Be brief. ") == reference.encode(
        expected, allowed_special="all"
    )
    messages += [{"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "Again"}]
    expected = jinja2.Template(LLAMA3_TEMPLATE).render(
        messages=messages, bos_token="<|begin_of_text|>", add_generation_prompt=True
    )
    assert tokenizer.encode_messages(messages) == reference.encode(expected, allowed_special="all")
    assert_next_turn_continues(tokenizer, messages)


@pytest.fixture(scope="module")
def tiny_sentencepiece_file(tmp_path_factory):
    import sentencepiece as spm

    corpus = varied_strings(400) * 3
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=500,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def test_sentencepiece_wrapper_matches_sentencepiece(tiny_sentencepiece_file):
    import sentencepiece as spm

    tokenizer = get_tokenizer(tiny_sentencepiece_file.parent)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    reference = spm.SentencePieceProcessor(model_file=str(tiny_sentencepiece_file))
    assert tokenizer.vocab_size == 500 and tokenizer.stop_ids == {reference.eos_id()}
    for text in varied_strings(100):
        assert tokenizer.encode(text) == [reference.bos_id()] + reference.encode(text)
        assert tokenizer.decode(tokenizer.encode(text, bos=False)) == reference.decode(
            reference.encode(text)
        )
    assert tokenizer.chat_format == "llama2"
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": " Hi "}
        ]
        expected = jinja2.Template(LLAMA2_TEMPLATE).render(messages=messages, bos_token="")
        assert tokenizer.encode_chat(" Hi ", system) == [reference.bos_id()] + reference.encode(
            expected
        )
        assert_next_turn_continues(
            tokenizer,
            messages
            + [{"role": "assistant", "content": "Hello. "}, {"role": "user", "content": "Again"}],
        )


def assert_streams_whole_text(tokenizer, text):
    """IncrementalText: token by token, the pieces add up to the whole decode (leading spaces and
    characters split between byte tokens included), and no decode sees more than a few tokens."""
    ids, seen = tokenizer.encode(text, bos=False), []
    counting = type(
        "Counting",
        (),
        {"decode": lambda self, some: seen.append(len(some)) or tokenizer.decode(some)},
    )()
    stream = IncrementalText(counting)
    pieces = "".join(stream.add(token) for token in ids) + stream.rest()
    assert pieces == stream.text == tokenizer.decode(ids) and max(seen) <= 8 < len(ids)


def test_incremental_text_with_byte_level_and_sentencepiece_tokenizers(
    smollm2_tokenizer, tiny_sentencepiece_file
):
    text = "naïve café, 日本語のテキスト 😀🚀 and  two  spaces.\n" * 6
    assert_streams_whole_text(smollm2_tokenizer, text)
    assert_streams_whole_text(get_tokenizer(tiny_sentencepiece_file.parent), text)
