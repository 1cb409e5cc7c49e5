"""Quantize a float checkpoint's weights (quantize.py): int8 per channel, or int4 per group, into a
file beside it that generate.py loads by name.

    python scripts/convert/quantize_checkpoint.py --mode int8        # the default model -> \
        model_int8.pth beside it
    python scripts/convert/quantize_checkpoint.py --checkpoint \
        checkpoints/<org>/<model>/model.pth --mode int4 --groupsize 32
"""

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import UserError, load_model, resolve_checkpoint  # noqa: E402
from quantize import output_name, parse_quantized_name, quantized_state_dict  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the float model.pth (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--mode", choices=["int8", "int4"], default="int8")
    parser.add_argument(
        "--groupsize",
        type=int,
        default=32,
        choices=[32, 64, 128, 256],
        help="int4: input channels per scale and zero (default 32)",
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        if parse_quantized_name(checkpoint):
            raise UserError(f"{checkpoint} is quantized already; give the float model.pth")
        model = load_model(checkpoint, torch.device("cpu"), torch.float32)
        state_dict = quantized_state_dict(
            model, args.mode, args.groupsize if args.mode == "int4" else None
        )
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = checkpoint.with_name(output_name(args.mode, args.groupsize))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:  # never a half-written file under the final name
        torch.save(state_dict, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)

    def size(p):
        return p.stat().st_size / 1e6

    print(f"wrote {target} ({size(target):.1f} MB; {checkpoint.name}: {size(checkpoint):.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
