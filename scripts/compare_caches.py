"""One table comparing KV caches on needle-in-a-haystack prompts with the default model.

    python scripts/compare_caches.py                           # 2k and 4k context, depth 50%
    python scripts/compare_caches.py --lengths 2000 --depths 10 50 90 --compile

For each prompt: the full 16-bit cache, SpeCache 1- and 2-bit, the non-speculative baseline and
KIVI alone (the low-bit copy, nothing fetched), greedy. Columns: decode ms per token, fast-tier KV
bytes (and their ratio to a 16-bit cache of the same capacity), bytes fetched from the slow tier per
token, whether the needle was answered, how many generated tokens agree with the full cache's
(position by position), how often the speculative token was right, and recall@k of the prefetched
pairs against the real token's own low-bit top-k.
"""
import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from generate import compile_decode, generate, load_model  # noqa: E402
from scripts.convert_gguf import prepare_default_checkpoint  # noqa: E402
from scripts.harness import specache_config_for  # noqa: E402
from scripts.haystack import answered, needle_prompt  # noqa: E402
from specache import SpeCacheConfig, setup_specache, specache_generate  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402

METHODS = ["full", "specache-1bit", "specache-2bit", "specache-nospec-1bit", "specache-nospec-2bit", "kivi-1bit",
           "kivi-2bit"]


def config_for(method: str, topk: int) -> SpeCacheConfig:
    config = specache_config_for(method, topk)
    return replace(config, stats=config.speculative and config.topk > 0)


def run(model, method: str, prompt: list[int], new_tokens: int, stop_ids: frozenset, topk: int):
    if method == "full":
        model.setup_caches(1, len(prompt) + new_tokens)
        return generate(model, [prompt], new_tokens, temperature=0, stop_ids=stop_ids,
                        use_flex=getattr(model, "compiled", False))
    state = setup_specache(model, 1, len(prompt) + new_tokens, config_for(method, topk))
    return specache_generate(model, state, [prompt], new_tokens, temperature=0, stop_ids=stop_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000], help="haystack lengths in tokens")
    parser.add_argument("--depths", type=float, nargs="+", default=[50], help="needle depths in percent")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--topk", type=int, default=64, help="SpeCache k")
    parser.add_argument("--compile", action="store_true", help="compile the decode steps")
    args = parser.parse_args()

    torch.set_grad_enabled(False)
    checkpoint = prepare_default_checkpoint()
    model = load_model(checkpoint, torch.device("cpu"), torch.float32)
    tokenizer = get_tokenizer(checkpoint.parent)
    stop_ids = frozenset(tokenizer.stop_ids)
    if args.compile:
        compile_decode(model)
        model.compiled = True
    methods = ["full"] + [m for m in args.methods if m != "full"]
    rows = []
    cases = [(length, depth) for length in args.lengths for depth in args.depths]
    with tqdm(total=len(cases) * len(methods), desc="generations", file=sys.stderr) as bar:
        for length, depth in cases:
            prompt = needle_prompt(tokenizer, length, depth)
            reference = None
            for method in methods:
                if args.compile:  # a first short run compiles this capacity's graphs
                    run(model, method, prompt, 3, stop_ids, args.topk)
                result = run(model, method, prompt, args.new_tokens, stop_ids, args.topk)
                tokens = result.tokens[0]
                reference = reference or tokens
                stats = result.stats
                rows.append(dict(
                    context=len(prompt), depth=depth, method=method,
                    ms=1e3 * result.decode_seconds / max(1, result.decode_steps),
                    fast=stats.get("fast_tier_bytes"), ratio=stats.get("fast_tier_ratio_to_16bit_cache"),
                    fetched=stats.get("bytes_fetched_per_token", 0), answered=answered(tokenizer.decode(tokens)),
                    agree=sum(a == b for a, b in zip(tokens, reference)), of=len(reference),
                    match=stats.get("speculative_match_rate"), recall=stats.get("recall_at_k")))
                bar.update()
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
    print(f"\nSmolLM2-135M-Instruct, fp32, greedy, {args.new_tokens} new tokens, k = {args.topk}, "
          f"{'compiled' if args.compile else 'eager'}; fast tier of a full cache = its 16-bit K and V\n")
    print("| context | depth | method | decode ms/token | fast-tier KV MB (x 16-bit) | fetched kB/token "
          "| needle | agrees with full | spec. token right | recall@k |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fast = "full 16-bit" if r["fast"] is None else f"{r['fast'] / 1e6:.1f} ({r['ratio']:.3f}x)"
        print(f"| {r['context']} | {r['depth']:g}% | {r['method']} | {r['ms']:.1f} | {fast} | {r['fetched'] / 1e3:.0f} "
              f"| {'yes' if r['answered'] else 'no'} | {r['agree']}/{r['of']} | {pct(r['match'])} | {pct(r['recall'])} |")


if __name__ == "__main__":
    main()
