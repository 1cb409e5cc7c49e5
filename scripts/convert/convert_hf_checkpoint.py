"""Convert a HF transformers Llama-family or Gemma-3 checkpoint directory into this project's
`model.pth` (see convert.py for the renames and permutations).

    python scripts/convert/convert_hf_checkpoint.py --checkpoint_dir \
        checkpoints/HuggingFaceTB/SmolLM2-360M-Instruct
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from convert import convert_hf_checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint_dir",
        type=Path,
        required=True,
        help="directory holding the HF checkpoint (config.json, *.safetensors or *.bin)",
    )
    parser.add_argument(
        "--model_name",
        type=str,
        default=None,
        help="preset name, used only when the directory has no config.json",
    )
    args = parser.parse_args()
    convert_hf_checkpoint(args.checkpoint_dir, args.model_name)


if __name__ == "__main__":
    main()
