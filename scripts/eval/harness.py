"""What the evaluation scripts (needle.py, ruler.py, longbench.py) share: the methods, one prefill
per prompt branched into every method's cache, the common flags, and the report files.

Prefill is full precision and the same for every method: each layer attends over the whole prompt,
and only then does a cache decide what to keep (SpeCache and KIVI quantize, StreamingLLM and H2O
evict). So `Runner.run` prefills a prompt once, recording each layer's K and V (and, when H2O is
among the methods, the attention each key received), then hands them to each method's cache
through its `ingest` and decodes from the shared first token. A cell of a sweep costs one
prefill plus a short decode per method. Generation is greedy; batch size 1.

Methods (caches/by_name.py names them): full (the 16-bit cache); specache-{1,2}bit;
specache-nospec-{1,2}bit (the paper's non-speculative baseline); kivi-{1,2}bit (the low-bit copy and
window, nothing fetched); each of these with a selection after a colon (specache-1bit:paper);
streaming and h2o (eviction at the fast-tier budget of SpeCache with --budget_bits bits, see
caches/eviction.py).

With --compile, decode steps run compiled (the full cache with FlexAttention, as generate.py does);
each method and cache capacity is a graph of its own, so capacities are rounded up to a multiple of
1024 tokens and prompts of similar length share them.
"""

import argparse
import json
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from caches.by_name import (  # noqa: E402
    LOW_BIT_KINDS,
    equal_budget_tokens,
    make_cache,
    parse_method,
)
from caches.full import flex_attention_available  # noqa: E402
from checkpoint import load_model, resolve_checkpoint  # noqa: E402
from caches.eviction import prompt_attention_mass  # noqa: E402
from generation import (  # noqa: E402
    GenerateOptions,
    GenerationResult,
    compile_decode,
    generate,
    prefill,
    products_in,
)
from generate import COMPILED_CAPACITY_STEP  # noqa: E402
from model import Transformer, prompt_attention  # noqa: E402
from options import prefill_products  # noqa: E402
from specache import Method, SpeCacheConfig  # noqa: E402
from tokenizer import Tokenizer, get_tokenizer  # noqa: E402

DEFAULT_METHODS = (
    "full",
    "specache-1bit",
    "specache-2bit",
    "kivi-1bit",
    "kivi-2bit",
    "streaming",
    "h2o",
)
RESULTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "results"


@dataclass
class MethodOutput:
    text: str  # the reply, decoded, stop token removed
    tokens: list[int]  # the new tokens, stop token included
    fast_tier_bytes: Optional[int]  # None for the full cache (all of it is fast tier)
    decode_seconds: float
    stats: dict = field(default_factory=dict)


class PromptRecorder(nn.Module):
    """A layer's cache during the shared prefill: the layer's own attention over the prompt (full,
    or its sliding window), and the prompt's K, V kept."""

    def __init__(self, want_mass: bool, window: Optional[int]):
        super().__init__()
        self.want_mass, self.window = want_mass, window
        self.k = self.v = self.mass = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, mask) -> Tensor:
        self.k, self.v = k, v
        if self.want_mass and self.window is None:
            self.mass = [prompt_attention_mass(q[0], k[0])]
        return prompt_attention(q, k, v, self.window)


class Prefilled(NamedTuple):
    first: Tensor  # (1, 1) the first new token
    recorders: list[PromptRecorder]  # each layer's K, V (and H2O's scores)
    seconds: float


class Runner:
    """Greedy generation of one prompt with every method, sharing the prefill."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        methods: list[str],
        topk: int = 64,
        budget_bits: int = 1,
        sink_tokens: int = 4,
        compile: bool = False,
        round_capacity: bool = True,
        chat: bool = True,
        stats: bool = False,
        whole_step: bool = False,
        prefill_products: Optional[torch.dtype] = None,
    ):
        """`prefill_products`: the shared prefill's matrix products in that dtype (generate's
        GenerateOptions.prefill_products), None: the model's."""
        self.model, self.tokenizer, self.methods = model, tokenizer, list(methods)
        self.prefill_products = prefill_products
        self.kinds = {method: parse_method(method) for method in methods}  # (kind, bits, selection)
        self.chat = (
            chat  # the scripts' prompts: the chat format, or completion prompts for a base model
        )
        self.topk, self.budget_bits, self.sink_tokens = topk, budget_bits, sink_tokens
        self.stats = stats  # SpeCache's diagnostics (recall, coverage), at the cost of extra passes
        self.stop_ids = frozenset(tokenizer.stop_ids)
        self.compiled = compile
        self.capacity_step = COMPILED_CAPACITY_STEP if compile and round_capacity else 1
        # one compiled layer serves every method (split its graph if any method's step must),
        if compile:
            # or with `whole_step` on a CPU each method's whole step (minutes of compiling per
            # method and capacity)
            device = model.tok_embeddings.weight.device
            # beside a GPU, SpeCache hands its fetches over at graph breaks around each layer
            low_bit = any(kind in LOW_BIT_KINDS for kind, _, _ in self.kinds.values())
            compile_decode(
                model,
                fullgraph=not (low_bit and device.type == "cuda"),
                whole_step=whole_step and device.type == "cpu",
            )

    def budget(self, capacity: int) -> int:
        config = SpeCacheConfig(Method(bits=self.budget_bits, topk=self.topk))
        return equal_budget_tokens(self.model, capacity, config)

    def capacity(self, prompt: list[int], max_new_tokens: int) -> int:
        return -(-(len(prompt) + max_new_tokens) // self.capacity_step) * self.capacity_step

    @torch.no_grad()
    def run(self, prompt: list[int], max_new_tokens: int) -> dict[str, MethodOutput]:
        prefilled = self.prefill(prompt, max_new_tokens)
        outputs = {}
        for method in self.methods:
            result = self.decode(method, prompt, prefilled, max_new_tokens)
            new = result.tokens[0]
            text = self.tokenizer.decode([t for t in new if t not in self.stop_ids])
            outputs[method] = MethodOutput(
                text, new, result.stats.get("fast_tier_bytes"), result.decode_seconds, result.stats
            )
        return outputs

    @torch.no_grad()
    def prefill(self, prompt: list[int], max_new_tokens: int) -> Prefilled:
        """The prompt through the model once, full precision, each layer's K and V recorded."""
        model = self.model
        recorders = [
            PromptRecorder("h2o" in self.methods, layer.attention.window) for layer in model.layers
        ]
        for layer, recorder in zip(model.layers, recorders):
            layer.attention.kv_cache = recorder
        model.setup_rope(self.capacity(prompt, max_new_tokens) + 1)
        device = model.tok_embeddings.weight.device
        t0 = time.perf_counter()
        with torch.compiler.set_stance("force_eager"), products_in(device, self.prefill_products):
            first = prefill(
                model,
                torch.tensor([prompt], device=device),
                torch.tensor([len(prompt)], device=device),
                temperature=0,
            )
        return Prefilled(first, recorders, time.perf_counter() - t0)

    @torch.no_grad()
    def decode(
        self,
        method: str,
        prompt: list[int],
        prefilled: Prefilled,
        max_new_tokens: int,
        batch_size: int = 1,
        overlap_fetch: bool = True,
        callback: Optional[Callable[[Tensor], None]] = None,
        **cache_options,
    ) -> GenerationResult:
        """Load the recorded prompt into `method`'s cache (`batch_size` copies of it) and decode
        from the first token. `overlap_fetch=False`: SpeCache waits for each fetch as it starts (a
        GPU
        or the disk tier). `callback` gets each new token (B, 1), the first one included, as
        generate's does. `cache_options`: make_cache's (slow_tier, slow_tier_dir)."""
        model, capacity = self.model, self.capacity(prompt, max_new_tokens)
        device = model.tok_embeddings.weight.device
        kind = self.kinds[method][0]
        # the eviction budget from SpeCache's fast tier at the true length (a capacity rounded up
        # for --compile would inflate it)
        budget = self.budget(len(prompt) + max_new_tokens) if kind in ("streaming", "h2o") else None
        cache = make_cache(
            method,
            model,
            batch_size,
            capacity,
            topk=self.topk,
            stats=self.stats,
            overlap_fetch=overlap_fetch,
            budget_tokens=budget,
            sink_tokens=self.sink_tokens,
            use_flex=self.compiled and flex_attention_available(device),
            **cache_options,
        )
        tokens = torch.tensor([prompt] * batch_size, device=device)
        cache.begin(tokens, torch.full((batch_size,), len(prompt), device=device))
        cache.ingest(
            [
                (
                    rec.k.expand(batch_size, -1, -1, -1),
                    rec.v.expand(batch_size, -1, -1, -1),
                    None if rec.mass is None else rec.mass * batch_size,
                )
                for rec in prefilled.recorders
            ]
        )
        options = GenerateOptions(first_token=prefilled.first.expand(batch_size, 1))
        return generate(
            model,
            cache,
            [prompt] * batch_size,
            max_new_tokens,
            stop_ids=self.stop_ids,
            options=options,
            **({} if callback is None else dict(callback=callback)),
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every evaluation script takes."""
    g = parser.add_argument_group("model and methods")
    g.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="model.pth (default: the embedded SmolLM2-135M-Instruct, prepared offline)",
    )
    g.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        type=method_argument,
        metavar="METHOD",
        help=f"caches to compare (default: {' '.join(DEFAULT_METHODS)}; also: "
        "specache-nospec-1bit specache-nospec-2bit). SpeCache and KIVI methods take a selection "
        "after a colon, as --specache_select names it: specache-1bit:paper is the paper's rule, "
        "specache-1bit:split,gqa-max the paper's rule with two changes; without one, SpeCache "
        "uses ours (default) and KIVI the paper's",
    )
    g.add_argument(
        "--topk",
        type=int,
        default=64,
        help="SpeCache k: 16-bit pairs fetched per layer and KV head",
    )
    g.add_argument(
        "--budget_bits",
        type=int,
        default=1,
        choices=(1, 2),
        help="streaming and h2o get the fast-tier bytes of SpeCache with this many bits "
        "(default 1)",
    )
    g.add_argument(
        "--prompt_format",
        choices=("auto", "chat", "completion"),
        default="auto",
        help="chat: the model's chat format; completion: plain text ending where the answer "
        "starts, "
        "for base models; auto (default): chat when the checkpoint's directory name says "
        "Instruct, -it or chat, else completion",
    )
    g.add_argument(
        "--stats",
        action="store_true",
        help="SpeCache's selection diagnostics in the tables and reports: recall of the fetched "
        "pairs "
        "against the real token's own low-bit and exact top-k, and the share of its exact "
        "attention "
        "read in 16 bits (extra scoring passes per layer)",
    )
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument(
        "--prefill_dtype",
        choices=("model", "bfloat16"),
        default="model",
        help="the shared prefill's matrix products: in the model's dtype (default), or bfloat16 "
        "(generate.py's flag)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode steps (minutes of compiling first; pays off over many prompts)",
    )
    g.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help="where the report files go (default docs/results)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="go on with the sweep that last wrote to --out and stopped before its report (killed, "
        "out of time): the cells it finished are kept, the rest are run. Needs the same model, "
        "methods and settings; the lengths, depths, tasks and samples may change",
    )


def method_argument(method: str) -> str:
    """argparse's type for a method name (caches/by_name.py)."""
    try:
        parse_method(method)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return method


def runner_from_args(args: argparse.Namespace) -> Runner:
    torch.set_grad_enabled(False)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model = load_model(checkpoint, torch.device(args.device), getattr(torch, args.dtype))
    return Runner(
        model,
        get_tokenizer(checkpoint.parent),
        args.methods,
        args.topk,
        args.budget_bits,
        stats=args.stats,
        compile=args.compile,
        chat=wants_chat(args.prompt_format, checkpoint.parent.name),
        prefill_products=prefill_products(args.prefill_dtype),
    )


def wants_chat(prompt_format: str, model_name: str) -> bool:
    """--prompt_format's rule: auto means chat for a model whose name marks it as tuned for chat."""
    if prompt_format == "auto":
        return re.search(r"instruct|-it\b|chat", model_name, re.IGNORECASE) is not None
    return prompt_format == "chat"


def file_name(method: str) -> str:
    """A method's name as a file name that Markdown links keep: specache-1bit:split,lloyd ->
    specache-1bit_split+lloyd."""
    return method.replace(":", "_").replace(",", "+").replace("=", "")


def command_line() -> str:
    return "python " + " ".join(
        shlex.quote(a) for a in [Path(sys.argv[0]).as_posix()] + sys.argv[1:]
    )


DIAGNOSTICS = ("coverage", "oracle_coverage", "recall_own_lowbit", "recall_exact")


def mean_stat(stats: list[dict], key: str, diagnostic: bool = False) -> Optional[float]:
    """The mean of a SpeCache statistic over replies' stats (None where a method reports none)."""
    values = [(s.get("diagnostics") or {}).get(key) if diagnostic else s.get(key) for s in stats]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def selection_columns(diagnostics: bool) -> list[str]:
    """The headers of `selection_cells`: with --stats, the diagnostics' too."""
    return ["spec. token right", "fetched kB/token"] + (
        ["coverage", "oracle coverage", "recall (own low-bit)", "recall (exact)"]
        if diagnostics
        else []
    )


def selection_cells(stats: list[dict], diagnostics: bool) -> list[str]:
    """A method's SpeCache selection statistics over its replies, as table cells ("-" for a method
    without them): how often the speculative token was the real one, the kB read from the slow
    tier per token, and with --stats the share of the exact attention read in 16 bits (coverage,
    and what the exact top-k would read) and the recall of the fetched pairs."""

    def percent(x):
        return "-" if x is None else f"{100 * x:.0f}%"

    fetched = mean_stat(stats, "bytes_fetched_per_token")
    cells = [
        percent(mean_stat(stats, "speculative_match_rate")),
        "-" if fetched is None else f"{fetched / 1e3:.0f}",
    ]
    if diagnostics:
        cells += [percent(mean_stat(stats, key, diagnostic=True)) for key in DIAGNOSTICS]
    return cells


class SweepLog:
    """A sweep's finished cells, written as it goes, so that a sweep stopped after an hour is not
    an hour lost: {out}/{name}.partial.jsonl holds the settings that decide a cell's result (the
    model, the methods, k, the dtype...) on its first line, then one finished cell per line. Run
    again with --resume, the sweep takes the cells it finds there and runs only the others;
    resuming under other settings is refused, since the report would mix two runs. The grid
    arguments (lengths, depths, tasks, samples) are left out of the settings: a cell is named by
    its place in the grid, so a resumed sweep may ask for more of it, or less. The report's
    writing removes the file."""

    def __init__(self, args: argparse.Namespace, name: str, grid: tuple[str, ...]):
        self.path = args.out / f"{name}.partial.jsonl"
        left_out = {"out", "resume", *grid}
        self.settings = json.loads(
            json.dumps({k: v for k, v in vars(args).items() if k not in left_out}, default=str)
        )
        self.entries: dict[str, dict] = {}  # cell (as JSON) -> {cell, result, seconds}
        if args.resume and self.path.exists():
            self._read()
            print(f"--resume: {len(self.entries)} finished cells in {self.path}", file=sys.stderr)
        elif args.resume:
            print(f"--resume: no {self.path}; the sweep starts at its first cell", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        # Written whole: this drops a last line that the stop cut short.
        lines = [self.settings, *self.entries.values()]
        self.path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")

    def _read(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        written_with = json.loads(lines[0])
        if written_with != self.settings:
            changed = sorted(
                k
                for k in written_with.keys() | self.settings.keys()
                if written_with.get(k) != self.settings.get(k)
            )
            raise SystemExit(
                f"--resume: {self.path} was written with other settings ({', '.join(changed)}); "
                "give the same ones, or run without --resume to start over"
            )
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # the line being written when the sweep stopped
            self.entries[json.dumps(entry["cell"])] = entry

    def result(self, cell: list, run: Callable[[], Any]) -> Any:
        """The cell's saved result, or else `run()`'s, timed and saved before it is returned."""
        key = json.dumps(cell)
        if key not in self.entries:
            started = time.perf_counter()
            result = run()
            entry = dict(cell=cell, result=result, seconds=time.perf_counter() - started)
            self.entries[key] = entry
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        return self.entries[key]["result"]

    def minutes(self) -> float:
        """The time the cells held took, over every run that added to the log."""
        return sum(entry["seconds"] for entry in self.entries.values()) / 60

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def write_report(out: Path, name: str, markdown: str, raw: dict) -> None:
    """{out}/{name}.md (the command that produced it, then the tables) and {out}/{name}.json."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(f"`{command_line()}`\n\n{markdown.strip()}\n", encoding="utf-8")
    (out / f"{name}.json").write_text(
        json.dumps(dict(command=command_line(), **raw), indent=1), encoding="utf-8"
    )
