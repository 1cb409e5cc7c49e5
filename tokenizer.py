"""One tokenizer interface over SentencePiece, tiktoken and HF `tokenizers`, plus chat formats.

`get_tokenizer(checkpoint_dir)` picks by what the directory holds:
- `tokenizer.json` -> HF `tokenizers` (SmolLM2, Qwen2.5, and HF-format Llama-3),
- `tokenizer.model` that SentencePiece can read -> SentencePiece (Llama-2, Mistral, Gemma 3, whose
  tokenizer.model `scripts/convert/gguf_sentencepiece.py` rebuilds from a GGUF),
- `tokenizer.model` that it cannot -> tiktoken with Llama-3's pattern and special tokens.

Chat formats are chosen from the vocabulary: ChatML where `<|im_start|>` exists, the Llama-3 header
format where `<|start_header_id|>` exists, Gemma's turns where `<start_of_turn>` exists, else
Llama-2's `[INST]`. They wrap a conversation the way each model's own chat template does
(SmolLM2 and Qwen2.5 add their default system prompt; Gemma, which has no system turn, puts the
system prompt at the head of the user's turn).
"""

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable, Optional

# Names that end a turn or a document in the supported families; any present in the vocabulary stops
# generation.
END_TOKEN_NAMES = (
    "</s>",
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<eos>",
    "<end_of_turn>",
)

# The default system message each family's chat template inserts when the user gives none.
DEFAULT_SYSTEM_PROMPTS = {
    "smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "qwen2.5": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
}


class Tokenizer(ABC):
    """encode/decode, the ids that stop generation, and the chat format of one model."""

    vocab_size: int
    bos_id: Optional[int] = None

    def __init__(self, checkpoint_dir: Path):
        self.checkpoint_dir = checkpoint_dir
        self.stop_ids = {i for name in END_TOKEN_NAMES if (i := self.token_to_id(name)) is not None}
        self.stop_ids |= _configured_eos_ids(checkpoint_dir)
        self.default_system = next(
            (
                text
                for family, text in DEFAULT_SYSTEM_PROMPTS.items()
                if family in checkpoint_dir.name.lower()
            ),
            None,
        )

    @abstractmethod
    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised.

        `bos` adds the model's begin-of-sequence token where the model uses one.
        """

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens included."""

    @abstractmethod
    def token_to_id(self, token: str) -> Optional[int]:
        """The id of a (special) token, or None if the vocabulary lacks it."""

    @property
    def chat_format(self) -> str:
        if self.token_to_id("<|im_start|>") is not None:
            return "chatml"
        if self.token_to_id("<|start_header_id|>") is not None:
            return "llama3"
        if self.token_to_id("<start_of_turn>") is not None:
            return "gemma"
        return "llama2"

    def encode_chat(self, prompt: str, system: Optional[str] = None) -> list[int]:
        """Ids of one user turn wrapped in the model's chat format, ending where the reply
        starts."""
        return self.encode_messages(
            ([{"role": "system", "content": system}] if system is not None else [])
            + [{"role": "user", "content": prompt}]
        )

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Ids of a conversation (OpenAI-style {"role": system|user|assistant, "content": text}
        messages; a system message only first) in the model's chat format, ending where the
        assistant's next reply starts. Without a system message the family's default goes in, as its
        own template does."""
        roles = [m["role"] for m in messages]
        if any(r not in ("system", "user", "assistant") for r in roles) or "system" in roles[1:]:
            raise ValueError("messages have the roles system (first only), user and assistant")
        system = messages[0]["content"] if roles[:1] == ["system"] else self.default_system
        turns = [(m["role"], m["content"]) for m in messages if m["role"] != "system"]
        if self.chat_format == "chatml":
            text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
            text += "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
            return self.encode(text + "<|im_start|>assistant\n", bos=False)
        if self.chat_format == "llama3":
            text = "<|begin_of_text|>"
            if system:
                text += f"<|start_header_id|>system<|end_header_id|>\n\n{system.strip()}<|eot_id|>"
            text += "".join(
                f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
                for role, content in turns
            )
            return self.encode(
                text + "<|start_header_id|>assistant<|end_header_id|>\n\n", bos=False
            )
        if self.chat_format == "gemma":
            # Gemma 3's template: the system text (untrimmed) + "\n\n" opens the first user turn;
            # each message is trimmed; the assistant is "model".
            text = ""
            for i, (role, content) in enumerate(turns):
                prefix = f"{system}\n\n" if system and i == 0 else ""
                speaker = "model" if role == "assistant" else role
                text += f"<start_of_turn>{speaker}\n{prefix}{content.strip()}<end_of_turn>\n"
            return self.encode(text + "<start_of_turn>model\n", bos=True)
        # Llama-2: each user turn and its answer are one [INST] block, with BOS; the system prompt
        # opens the first
        if [role for role, _ in turns] != ["user", "assistant"] * (len(turns) // 2) + ["user"] * (
            len(turns) % 2
        ):
            raise ValueError(
                "Llama-2's chat format needs user and assistant turns in turn, starting with the "
                "user"
            )
        eos = self.token_to_id("</s>")
        ids: list[int] = []
        for i in range(0, len(turns), 2):
            prompt = turns[i][1]
            if system and i == 0:
                prompt = f"<<SYS>>\n{system}\n<</SYS>>\n\n{prompt}"
            text = f"[INST] {prompt.strip()} [/INST]"
            if i + 1 < len(turns):
                text += f" {turns[i + 1][1].strip()} "
                ids += self.encode(text, bos=True) + ([eos] if eos is not None else [])
            else:
                ids += self.encode(text, bos=True)
        return ids

    @property
    def end_of_turn_id(self) -> Optional[int]:
        """The token that closes a turn in this chat format (where the model's reply stops)."""
        return self.token_to_id(
            {
                "chatml": "<|im_end|>",
                "llama3": "<|eot_id|>",
                "gemma": "<end_of_turn>",
                "llama2": "</s>",
            }[self.chat_format]
        )

    def encode_next_turn(self, content: str) -> list[int]:
        """Ids of the user's next turn in a conversation whose last reply ended with
        `end_of_turn_id`,
        ending where the assistant's next reply starts: what follows that token in `encode_messages`
        of the whole conversation, so that a chat can prefill only the new turn (chat.py)."""
        if self.chat_format == "chatml":
            return self.encode(
                f"\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n", bos=False
            )
        if self.chat_format == "llama3":
            return self.encode(
                f"<|start_header_id|>user<|end_header_id|>\n\n{content.strip()}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n",
                bos=False,
            )
        if self.chat_format == "gemma":
            return self.encode(
                f"\n<start_of_turn>user\n{content.strip()}<end_of_turn>\n<start_of_turn>model\n",
                bos=False,
            )
        return self.encode(f"[INST] {content.strip()} [/INST]", bos=True)


class IncrementalText:
    """A growing answer's text that decodes only its newest tokens and the few before them (a
    token's text can depend on the one before, as SentencePiece's leading spaces do; HF's streamers
    work the same way), so that streaming a long answer costs linear time, not quadratic."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""
        self._prefix = self._read = 0  # ids[prefix:read] were decoded last; ids[read:] are new

    def add(self, token: int) -> str:
        """Append `token`; return the text it completes, also added to `text` ('' while a character
        is split between tokens)."""
        self.ids.append(token)
        return self._take(final=False)

    def rest(self) -> str:
        """The text of new tokens that `add` held back (a split character, as U+FFFD)."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self.text += after[len(before) :]
        return after[len(before) :]


def _configured_eos_ids(checkpoint_dir: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = checkpoint_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids |= set(eos) if isinstance(eos, list) else {eos}
    return ids


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: Path):
        import sentencepiece as spm

        self.processor = spm.SentencePieceProcessor(model_file=str(model_file))
        self.vocab_size = self.processor.vocab_size()
        self.bos_id = self.processor.bos_id()
        super().__init__(model_file.parent)
        # "</s>" ends Llama-2's documents but is Gemma's strikethrough HTML tag: it stops only as
        # the model's EOS.
        if (end := self.token_to_id("</s>")) is not None and end != self.processor.eos_id():
            self.stop_ids.discard(end)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + self.processor.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode(list(ids))

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.processor.piece_to_id(token)
        return i if i != self.processor.unk_id() or token == self.processor.id_to_piece(i) else None


class TiktokenTokenizer(Tokenizer):
    """Llama-3's tokenizer.model: base64 BPE ranks plus 256 special tokens after them."""

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| "
        r"?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    num_reserved_special_tokens = 256

    def __init__(self, model_file: Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(str(model_file))
        names = ["<|begin_of_text|>", "<|end_of_text|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(4)
        ]
        names += [
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|reserved_special_token_4|>",
            "<|eot_id|>",
        ]
        names += [
            f"<|reserved_special_token_{i}|>"
            for i in range(5, self.num_reserved_special_tokens - 5)
        ]
        self.special_tokens = {name: len(ranks) + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding(
            name=model_file.name,
            pat_str=self.pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = self.model.n_vocab
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        super().__init__(model_file.parent)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + self.model.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        return self.model.decode(list(ids))

    def token_to_id(self, token: str) -> Optional[int]:
        return self.special_tokens.get(token)


class HFTokenizer(Tokenizer):
    """A tokenizer.json read by HF `tokenizers` (its post-processor decides whether BOS is
    added)."""

    def __init__(self, tokenizer_file: Path):
        from tokenizers import Tokenizer as RustTokenizer

        self.model = RustTokenizer.from_file(str(tokenizer_file))
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
        config_file = tokenizer_file.parent / "tokenizer_config.json"
        bos = (
            json.loads(config_file.read_text()).get("bos_token") if config_file.is_file() else None
        )
        self.bos_id = (
            self.model.token_to_id(bos["content"] if isinstance(bos, dict) else bos)
            if bos
            else None
        )
        super().__init__(tokenizer_file.parent)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self.model.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.model.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.model.token_to_id(token)


def get_tokenizer(checkpoint_dir: Path) -> Tokenizer:
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint_dir / "tokenizer.json")
    model_file = checkpoint_dir / "tokenizer.model"
    if not model_file.is_file():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {checkpoint_dir}")
    with open(model_file, "rb") as f:
        # a serialized ModelProto starts with field 1 (pieces)
        is_sentencepiece = f.read(1) == b"\n"
    if is_sentencepiece:
        return SentencePieceTokenizer(model_file)
    return TiktokenTokenizer(model_file)
