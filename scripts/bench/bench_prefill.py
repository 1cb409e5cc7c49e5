"""Peak memory and time of a long prompt's prefill, in one piece against --prefill_chunk.

    python scripts/bench/bench_prefill.py                              # 16k tokens, chunks of 1024
    python scripts/bench/bench_prefill.py --prompt_tokens 4096 --chunks 512 2048 --out /tmp/prefill

Per method and chunk size, one `python generate.py --json` process (so that each peak resident
memory is its own) prefills the same prompt (prose, --prompt_tokens tokens) and generates 4 tokens,
greedy, eager. Reported: prefill seconds, the process's peak resident memory, both as ratios over
the same method's prefill in one piece, and whether the first tokens agree with it.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import resolve_checkpoint  # noqa: E402
from scripts.bench.bench_serve import prompt_text, server_flags  # noqa: E402
from scripts.eval.harness import write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4


def piece(chunk: int) -> str:
    return f"chunks of {chunk}" if chunk else "one piece"


def run(checkpoint: Path, method: str, prompt_file: Path, chunk: int) -> dict:
    flags = server_flags(method) + (["--prefill_chunk", str(chunk)] if chunk else [])
    result = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "generate.py"),
            "--checkpoint",
            str(checkpoint),
            "--prompt_file",
            str(prompt_file),
            "--max_new_tokens",
            str(NEW_TOKENS),
            "--temperature",
            "0",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    if result.returncode != 0:
        raise SystemExit(f"generate.py {' '.join(flags)} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", type=Path, default=None, help="default: the embedded SmolLM2"
    )
    parser.add_argument("--methods", nargs="+", default=["full", "specache-1bit"])
    parser.add_argument("--prompt_tokens", type=int, default=16384)
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[1024], help="chunk sizes beside one piece"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write prefill.md and prefill.json here"
    )
    args = parser.parse_args()
    checkpoint = resolve_checkpoint(args.checkpoint)
    tokenizer = get_tokenizer(checkpoint.parent)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        prompt_file = Path(folder) / "prompt.txt"
        prompt_file.write_text(prompt_text(tokenizer, args.prompt_tokens, seed=0), encoding="utf-8")
        for method in args.methods:
            whole = None
            for chunk in [0, *args.chunks]:
                print(f"{method}, {piece(chunk)}...", file=sys.stderr, flush=True)
                report = run(checkpoint, method, prompt_file, chunk)
                whole = whole or report
                rows.append(
                    dict(
                        method=method,
                        chunk=chunk,
                        prompt_tokens=report["prompt_tokens"][0],
                        prefill_seconds=report["prefill_seconds"],
                        peak_bytes=report["peak_memory_bytes"],
                        time_ratio=report["prefill_seconds"] / whole["prefill_seconds"],
                        memory_ratio=report["peak_memory_bytes"] / whole["peak_memory_bytes"],
                        same_tokens=report["texts"] == whole["texts"],
                    )
                )
    lines = [
        f"{checkpoint.parent.name}, a {rows[0]['prompt_tokens']}-token prompt, {NEW_TOKENS} new "
        "tokens, greedy, "
        "eager; ratios over the same method in one piece",
        "",
        "| method | prefill | prefill s | peak RSS GB | time ratio | memory ratio | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {piece(r['chunk'])} | "
        f"{r['prefill_seconds']:.1f} | {r['peak_bytes'] / 1e9:.2f} | {r['time_ratio']:.2f}x | "
        f"{r['memory_ratio']:.2f}x | {'yes' if r['same_tokens'] else 'no'} |"
        for r in rows
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write_report(args.out, "prefill", markdown, dict(rows=rows))


if __name__ == "__main__":
    main()
