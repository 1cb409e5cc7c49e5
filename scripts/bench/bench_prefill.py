"""Time and peak memory of a long prompt's prefill: in one piece and in --prefill_chunk chunks, in
the model's dtype and with --prefill_dtype bfloat16 (prefill's matrix products in bfloat16), beside
llama.cpp's prefill of the same tokens.

    python scripts/bench/bench_prefill.py                              # 16k tokens, chunks of 1024
    python scripts/bench/bench_prefill.py --prompt_tokens 4096 --chunks 512 2048 --out /tmp/prefill
    python scripts/bench/bench_prefill.py --chunks --prefill_dtypes model bfloat16 --llama_cpp

Per method, prefill dtype and chunk size, one `python generate.py --json` process (so that each peak
resident memory is its own) prefills the same prompt (prose, --prompt_tokens tokens) and generates
4 tokens, greedy, eager. Reported: prefill seconds (the time to the first token), the process's
peak resident memory, both as ratios over the same method's first row (its first prefill dtype, in
one piece), and whether the first tokens agree with it. --llama_cpp adds llama.cpp's prefill of
the same token ids (llama-cpp-python on the GGUF the default model comes from, its f16 KV cache,
batches of 512, torch's thread count) and its time over our full cache's first row.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checkpoint import find_default_gguf, resolve_checkpoint  # noqa: E402
from scripts.bench.bench_peers import bench_llama_cpp, llama_cpp_available  # noqa: E402
from scripts.bench.bench_serve import prompt_text, server_flags  # noqa: E402
from scripts.eval.harness import write_report  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 4


def piece(chunk: int) -> str:
    return f"chunks of {chunk}" if chunk else "one piece"


def run(checkpoint: Path, method: str, prompt_file: Path, chunk: int, products: str) -> dict:
    flags = server_flags(method) + (["--prefill_chunk", str(chunk)] if chunk else [])
    flags += ["--prefill_dtype", products, "--device", "cpu"]
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
        "--chunks",
        type=int,
        nargs="*",
        default=[1024],
        help="chunk sizes beside one piece (none: one piece alone)",
    )
    parser.add_argument(
        "--prefill_dtypes",
        nargs="+",
        default=["model"],
        choices=["model", "bfloat16"],
        help="generate.py's --prefill_dtype per row (default: the model's dtype alone)",
    )
    parser.add_argument(
        "--llama_cpp", action="store_true", help="add llama.cpp's prefill of the same tokens"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write prefill.md and prefill.json here"
    )
    args = parser.parse_args()
    if args.llama_cpp and not llama_cpp_available():
        raise SystemExit("--llama_cpp: llama-cpp-python is not installed (requirements-bench.txt)")
    checkpoint = resolve_checkpoint(args.checkpoint)
    tokenizer = get_tokenizer(checkpoint.parent)
    text = prompt_text(tokenizer, args.prompt_tokens, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        prompt_file = Path(folder) / "prompt.txt"
        prompt_file.write_text(text, encoding="utf-8")
        for method in args.methods:
            first = None  # the method's first row: the first prefill dtype, one piece
            for dtype in args.prefill_dtypes:
                for chunk in [0, *args.chunks]:
                    print(f"{method}, {dtype}, {piece(chunk)}...", file=sys.stderr, flush=True)
                    report = run(checkpoint, method, prompt_file, chunk, dtype)
                    first = first or report
                    rows.append(
                        dict(
                            method=method,
                            dtype=dtype,
                            chunk=chunk,
                            prompt_tokens=report["prompt_tokens"][0],
                            prefill_seconds=report["prefill_seconds"],
                            peak_bytes=report["peak_memory_bytes"],
                            time_ratio=report["prefill_seconds"] / first["prefill_seconds"],
                            memory_ratio=report["peak_memory_bytes"] / first["peak_memory_bytes"],
                            same_tokens=report["texts"] == first["texts"],
                        )
                    )
    full = next((r for r in rows if r["method"].startswith("full")), None)
    if args.llama_cpp:
        print("llama.cpp...", file=sys.stderr, flush=True)
        measured = bench_llama_cpp(find_default_gguf(), tokenizer.encode(text), NEW_TOKENS, False)
        rows.append(
            dict(
                method="llama.cpp",
                dtype="its GGUF's",
                chunk=512,
                prompt_tokens=rows[0]["prompt_tokens"],
                prefill_seconds=measured["prefill"],
                peak_bytes=None,
                time_ratio=measured["prefill"] / full["prefill_seconds"] if full else None,
                memory_ratio=None,
                same_tokens=None,
            )
        )
    peer = f"; llama.cpp's over our {full['method']}'s" if args.llama_cpp and full else ""
    lines = [
        f"{checkpoint.parent.name}, a {rows[0]['prompt_tokens']}-token prompt, {NEW_TOKENS} new "
        f"tokens, greedy, eager, {torch.get_num_threads()} CPU threads; ratios over the same "
        f"method's first row (prefill in {args.prefill_dtypes[0]}, one piece){peer}",
        "",
        "| method | prefill dtype | prefill | prefill s | peak RSS GB | time ratio | "
        "memory ratio | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['dtype']} | {piece(r['chunk'])} | {r['prefill_seconds']:.1f} | "
        f"{cell(r['peak_bytes'], lambda b: f'{b / 1e9:.2f}')} | "
        f"{cell(r['time_ratio'], lambda x: f'{x:.2f}x')} | "
        f"{cell(r['memory_ratio'], lambda x: f'{x:.2f}x')} | "
        f"{cell(r['same_tokens'], lambda same: 'yes' if same else 'no')} |"
        for r in rows
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if args.out:
        write_report(args.out, "prefill", markdown, dict(rows=rows))


def cell(value, form) -> str:
    return "-" if value is None else form(value)


if __name__ == "__main__":
    main()
