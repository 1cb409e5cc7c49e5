"""Rebuild a SentencePiece `tokenizer.model` from the vocabulary a GGUF file carries (Gemma 3); see
convert.build_sentencepiece_model for how.

    python scripts/convert/gguf_sentencepiece.py model.gguf \
        checkpoints/google/gemma-3-270m/tokenizer.model
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from convert import build_sentencepiece_model  # noqa: E402


def write_sentencepiece_model(reader, path: Path) -> Path:
    """Write the rebuilt tokenizer.model to `path` (e.g. a checkpoint directory's
    tokenizer.model)."""
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
