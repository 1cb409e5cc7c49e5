"""Download a HF model into checkpoints/<org>/<name> and convert it to model.pth.

    python scripts/convert/download.py --repo_id HuggingFaceTB/SmolLM2-360M-Instruct
    python scripts/convert/download.py --repo_id meta-llama/Meta-Llama-3-8B-Instruct \
        --hf_token $HF_TOKEN

Needs network access to the Hugging Face hub (gated models need a token). The project's default
model needs none of this: generate.py prepares it offline.
"""

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from convert import convert_hf_checkpoint  # noqa: E402

# Weights, configs and tokenizers; not the duplicate .bin/.pth copies some repositories also carry.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "original/tokenizer.model", "*.txt"]


def download(
    repo_id: str,
    checkpoint_root: Path = Path("checkpoints"),
    hf_token: Optional[str] = None,
    convert: bool = True,
) -> Path:
    from huggingface_hub import list_repo_files, snapshot_download

    checkpoint_dir = checkpoint_root / repo_id
    files = list_repo_files(repo_id, token=hf_token)
    patterns = list(ALLOW_PATTERNS)
    if not any(f.endswith(".safetensors") for f in files):
        patterns.append("*.bin")  # older repositories ship only PyTorch pickles
    snapshot_download(repo_id, local_dir=checkpoint_dir, token=hf_token, allow_patterns=patterns)
    if convert:
        return convert_hf_checkpoint(checkpoint_dir)
    return checkpoint_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--repo_id", required=True, help="HF repository, e.g. HuggingFaceTB/SmolLM2-360M-Instruct"
    )
    parser.add_argument("--hf_token", default=None, help="HF access token for gated models")
    parser.add_argument("--checkpoint_root", type=Path, default=Path("checkpoints"))
    parser.add_argument("--no_convert", action="store_true", help="download only")
    args = parser.parse_args()
    print(download(args.repo_id, args.checkpoint_root, args.hf_token, convert=not args.no_convert))


if __name__ == "__main__":
    main()
