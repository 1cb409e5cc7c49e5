"""Rebuild a SentencePiece `tokenizer.model` from the vocabulary a GGUF file carries (Gemma 3).

A GGUF of a SentencePiece model ("tokenizer.ggml.model" = "llama") stores every piece with its score
and type, but not the ModelProto's trainer and normalizer specs, and llama.cpp's converter rewrote
some pieces on the way in. `build_sentencepiece_model` undoes that and fills in the specs so that
`sentencepiece` encodes exactly as Gemma 3's own tokenizer.model does:

- Specs: a BPE model with byte fallback; normalizer "identity" (no charsmap), no dummy prefix, no
  removal of extra whitespace, spaces escaped to U+2581 -- Gemma's "split digits, preserved
  whitespace, byte-level encodings" (the GGUF's add_space_prefix is False). split_digits and
  allow_whitespace_only_pieces are training options, set only to describe the model truthfully.
- Types: llama.cpp marks as CONTROL every token that HF's tokenizer_config calls special. In the real
  model only <pad>, <eos> and <bos> are control and <unk> is unknown; the rest (<start_of_turn>,
  <end_of_turn>, <mask>, <unusedN>, ...) are user-defined, so text that spells them encodes to the
  one token and decodes back to the text. The real model counts 255474 normal, 6410 user-defined,
  256 byte, 3 control and 1 unknown pieces; this mapping gives the same counts for Gemma 3's GGUF.
- Spaces: llama.cpp respells a user-defined piece's U+2581 as a real space ("  " for "\u2581\u2581").
  The normalizer turns every space into U+2581 before pieces are matched, so a piece holding a real
  space could never match; it is spelled back. In Gemma 3 these are exactly the 30 runs of 2 to 31
  spaces: no piece mixes spaces with newlines or tabs, and the newline and tab runs, which the
  normalizer leaves alone, stay as they are.
- Scores: as the file stores them. Normal pieces keep SentencePiece's own scores, which order BPE's
  merges. The -1000 llama.cpp wrote for the added tokens is never read: SentencePiece merges only
  into normal and user-defined pieces, and a merge never yields a user-defined piece, since the
  matcher would have taken that piece whole where it starts.

The ModelProto is built with the classes sentencepiece ships, which need `protobuf`.

    python scripts/gguf_sentencepiece.py model.gguf checkpoints/google/gemma-3-270m/tokenizer.model
"""
import argparse
from pathlib import Path

# GGUF's token types use SentencePiece's numbering (1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte).
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def build_sentencepiece_model(reader) -> bytes:
    """A serialized SentencePiece ModelProto for the GGUF vocabulary `reader` (a `gguf.GGUFReader`) holds."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if _field(reader, "tokenizer.ggml.model") != "llama":
        raise ValueError("the GGUF does not describe a SentencePiece ('llama') vocabulary")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    types = _field(reader, "tokenizer.ggml.token_type")
    special = {name: _field(reader, f"tokenizer.ggml.{key}") for name, key in
               (("unk", "unknown_token_id"), ("bos", "bos_token_id"), ("eos", "eos_token_id"),
                ("pad", "padding_token_id"))}
    control_ids = {special["bos"], special["eos"], special["pad"]} - {None}

    model = pb.ModelProto()
    for i, (token, score, token_type) in enumerate(zip(tokens, scores, types)):
        if i == special["unk"]:
            token_type = UNKNOWN  # SentencePiece needs exactly one; llama.cpp marks it control
        elif token_type == CONTROL and i not in control_ids:
            token_type = USER_DEFINED
        if " " in token:
            token = token.replace(" ", "\u2581")
        model.pieces.add(piece=token, score=score, type=token_type)

    trainer = model.trainer_spec
    trainer.model_type = pb.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = True
    trainer.split_digits = True
    trainer.allow_whitespace_only_pieces = True
    trainer.treat_whitespace_as_suffix = False
    for name in ("unk", "bos", "eos", "pad"):  # an absent one is -1, as SentencePiece writes it
        i = special[name]
        setattr(trainer, f"{name}_id", -1 if i is None else i)
        if i is not None:
            setattr(trainer, f"{name}_piece", model.pieces[i].piece)

    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    # llama.cpp's default for a SentencePiece vocabulary that does not say (Llama-2); Gemma says False.
    normalizer.add_dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    return model.SerializeToString()


def write_sentencepiece_model(reader, path: Path) -> Path:
    """Write the rebuilt tokenizer.model to `path` (e.g. a checkpoint directory's tokenizer.model)."""
    path = Path(path)
    path.write_bytes(build_sentencepiece_model(reader))
    return path


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("output", type=Path, help="where to write tokenizer.model")
    args = parser.parse_args()
    print(write_sentencepiece_model(gguf.GGUFReader(args.gguf), args.output))


if __name__ == "__main__":
    main()
