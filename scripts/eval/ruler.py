"""RULER's synthetic tasks (NVIDIA/RULER), generated in code, scored for several KV caches.

    python scripts/eval/ruler.py                   # 2048 and 4096 tokens, 2 samples per task,
                                                   # all 11 tasks
    python scripts/eval/ruler.py --quick           # 1 sample per task
    python scripts/eval/ruler.py --lengths 4096 8192 --samples 5 --tasks niah_single_1 vt \
        --methods full specache-1bit
    python scripts/eval/ruler.py ... --resume      # the same command, stopped: go on with it

The tasks are RULER's official configurations (scripts/synthetic.yaml): eight needle-in-a-haystack
variants, variable tracking (vt), common words extraction (cwe) and frequent words extraction (fwe),
with RULER's templates, answer prefixes and generation lengths
(scripts/data/synthetic/constants.py). The prompt is the task text as one chat user turn, then the
answer prefix after the assistant header, as RULER does for chat models. Each sample is sized to
its length: its number of haystack units (noise sentences, essay words, distractor needles, listed
words, coded words) is the largest for which the prompt plus the tokens to generate fits, found by
bisection for that sample. The score is RULER's string_match_all: the percent of references found
in the reply (substring, case ignored), averaged per task; the average column is over tasks. Each
sample is prefilled once and decoded greedily by every method (scripts/eval/harness.py).

Differences from RULER: essays are split into sentences by a regex instead of NLTK punkt (whose data
is not on PyPI); random draws come from one seeded generator per sample, where RULER reuses a fixed
seed for some shuffles; cwe's solved example is plain text inside the user turn (RULER formats it
with the whole chat template too); cwe draws at most the ~8k wonderwords words (RULER switches to a
larger list past that, beyond ~90k tokens).

Writes {out}/ruler.md (one table per length: methods x tasks) and {out}/ruler.json (every sample's
references, replies and scores). While it runs, {out}/ruler.partial.jsonl holds the samples done,
for --resume.
"""

import argparse
import random
import re
import string
import sys
import uuid
from functools import cache, partial
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

# the loader RULER uses for the bundled lists
from wonderwords.random_word import (
    _get_words_from_text_file,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.eval.harness import (  # noqa: E402
    Runner,
    SweepLog,
    add_arguments,
    runner_from_args,
    selection_cells,
    selection_columns,
    write_report,
)
from scripts.eval.haystack import essays_dir  # noqa: E402
from tokenizer import Tokenizer  # noqa: E402

# RULER scripts/synthetic.yaml: the official task configurations (qa_1 and qa_2 need external
# datasets). The needle tasks, one row each:
NIAH_FIELDS = (
    "type_haystack",
    "type_needle_k",
    "type_needle_v",
    "num_needle_k",
    "num_needle_v",
    "num_needle_q",
)
NIAH_TASKS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
TASKS = {
    **{name: dict(kind="niah", **dict(zip(NIAH_FIELDS, row))) for name, row in NIAH_TASKS.items()},
    # noise: the one built
    "vt": dict(kind="variable_tracking", type_haystack="noise", num_chains=1, num_hops=4),
    "cwe": dict(kind="common_words_extraction", freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": dict(kind="freq_words_extraction", alpha=2.0),
}

# RULER scripts/data/synthetic/constants.py: (template, answer prefix, tokens to generate) per kind.
PROMPTS = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided "
        "text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128,
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following "
        "text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ",
        30,
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120,
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three "
        "most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
        "words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        50,
    ),
}

# RULER scripts/data/synthetic/niah.py and variable_tracking.py: haystack sentences and needle
# positions.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, num=40))
VT_EXAMPLE_TOKENS = 500  # RULER sizes vt's solved example to 500 tokens


class Sample(NamedTuple):
    prompt_tokens: list[int]
    references: list[str]
    max_new_tokens: int


class Instance(NamedTuple):
    """One task instance as text: the user turn, the answer prefix and the expected answers."""

    text: str
    answer_prefix: str
    references: list[str]


@cache
def wonderwords_list(part_of_speech: str) -> list[str]:
    """One of wonderwords' bundled lists (noun, adjective, verb), deduplicated and sorted as RULER
    does."""
    return sorted(set(_get_words_from_text_file(f"{part_of_speech}list.txt")))


@cache
def cwe_words() -> list[str]:
    return sorted(
        set(wonderwords_list("noun") + wonderwords_list("adjective") + wonderwords_list("verb"))
    )


@cache
def essay_words() -> list[str]:
    # RULER concatenates the essays (Kamradt's set, in name order, comes first) and splits on
    # whitespace.
    text = "".join(path.read_text(encoding="utf-8") for path in sorted(essays_dir().glob("*.txt")))
    return re.sub(r"\s+", " ", text).split(" ")


def random_needle(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        # RULER picks from the list of all adjective-noun pairs; one pick per part is the same draw
        # without building that 6-million-entry list.
        return f"{rng.choice(wonderwords_list('adjective'))}-{rng.choice(wonderwords_list('noun'))}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def niah(rng: random.Random, n: int, config: dict, length: int) -> Instance:
    """Needles 'One of the special magic ... for KEY is: VALUE.' in n haystack units; ask for some
    keys' values."""
    type_k, type_v = config["type_needle_k"], config["type_needle_v"]
    num_k, num_q = max(config["num_needle_k"], config["num_needle_q"]), config["num_needle_q"]
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_needle(rng, type_k))
        values.append([random_needle(rng, type_v) for _ in range(config["num_needle_v"])])
        needles += [
            NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value) for value in values[-1]
        ]
    rng.shuffle(needles)
    if config["type_haystack"] == "essay":  # n words; needles between sentences at distinct depths
        words = essay_words()
        sentences = re.split(
            r"(?<=[.!?])\s+", " ".join((words * (n // len(words) + 1))[:n]).strip()
        )
        cuts = [0] + sorted(
            int(len(sentences) * depth / 100) for depth in rng.sample(DEPTHS, len(needles))
        )
        parts = [" ".join(sentences[a:b]) for a, b in zip(cuts, cuts[1:] + [len(sentences)])]
        context = " ".join([x for pair in zip(parts, needles) for x in pair] + parts[-1:])
    else:  # n noise sentences, or n distractor needles with other keys, one per line
        if config["type_haystack"] == "noise":
            lines = [NOISE] * n
        else:
            lines = [
                NEEDLE.format(
                    type_needle_v=type_v,
                    key=random_needle(rng, type_k),
                    value=random_needle(rng, type_v),
                )
                for _ in range(n)
            ]
        for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in chosen]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if num_q > 1 else queries[0]
    template, prefix, _ = PROMPTS["niah"]
    if num_q * config["num_needle_v"] == 1:  # RULER's singular wording when one value is asked for

        def singular(t: str) -> str:
            return (
                t.replace("Some", "A")
                .replace("are all", "is")
                .replace("are", "is")
                .replace("answers", "answer")
            )

        template, prefix, type_v = singular(template), singular(prefix), type_v[:-1]
    return Instance(
        template.format(type_needle_v=type_v, context=context, query=query),
        prefix.format(type_needle_v=type_v, query=query),
        [v for i in chosen for v in values[i]],
    )


def vt_instance(
    rng: random.Random, n: int, num_chains: int, num_hops: int, name_length: int
) -> Instance:
    """Chains 'VAR B = VAR A' starting from a 5-digit value, kept in order among n noise lines."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    chains = []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        chains.append(
            [f"VAR {chain[0]} = {rng.randint(10000, 99998)}"]
            + [f"VAR {b} = VAR {a} " for a, b in zip(chain, chain[1:])]
        )
    lines = [NOISE] * n
    for chain in chains:
        for j, position in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
            lines.insert(position + j, chain[j])
    value = chains[0][0].split("=")[-1].strip()
    template, prefix, _ = PROMPTS["variable_tracking"]
    context = "\n".join(lines).replace(". \n", ".\n")
    return Instance(
        template.format(context=context, query=value),
        prefix.format(num_v=num_hops + 1, query=value),
        names[: num_hops + 1],
    )


def vt_example(seed: int, tokenizer: Tokenizer, config: dict) -> str:
    """RULER's solved vt example: 3-letter names, at most 10 hops, sized to VT_EXAMPLE_TOKENS,
    answer appended."""

    def build(n: int) -> Instance:
        return vt_instance(
            random.Random(seed), n, config["num_chains"], min(10, config["num_hops"]), 3
        )

    def size(n: int) -> int:
        instance = build(n)
        return len(tokenizer.encode(instance.text + instance.answer_prefix, bos=False))

    text, prefix, names = build(largest_fitting(size, VT_EXAMPLE_TOKENS, config["num_hops"] + 1))
    return f"{text}{prefix} {' '.join(names)}\n"


def variable_tracking(rng: random.Random, n: int, config: dict, length: int) -> Instance:
    text, prefix, names = vt_instance(rng, n, config["num_chains"], config["num_hops"], 5)
    return Instance(config["example"] + "\n" + text, prefix, names)


def common_words(rng: random.Random, n: int, config: dict, length: int) -> Instance:
    """A numbered list of n distinct words, num_cw of them repeated more often; one solved example
    first."""
    num_cw = config["num_cw"]

    def word_list(num_words: int, common: int, uncommon: int) -> tuple[str, list[str]]:
        chosen = rng.sample(cwe_words(), num_words)
        listed = chosen[:num_cw] * common + chosen[num_cw:] * uncommon
        rng.shuffle(listed)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(listed)), chosen[:num_cw]

    # RULER uses a smaller example and fewer repeats below 4096 tokens.
    shot, repeats = (
        ((20, 3, 1), (6, 1))
        if length < 4096
        else ((40, 10, 3), (config["freq_cw"], config["freq_ucw"]))
    )
    shot_context, shot_answer = word_list(*shot)
    context, answer = word_list(n, *repeats)
    template, prefix, _ = PROMPTS["common_words_extraction"]
    example = (
        template.format(context=shot_context)
        + prefix
        + " "
        + " ".join(f"{i + 1}. {word}" for i, word in enumerate(shot_answer))
    )
    return Instance(example + "\n" + template.format(context=context), prefix, answer)


def freq_words(rng: random.Random, n: int, config: dict, length: int) -> Instance:
    """About n coded words drawn by a Zipf law over a random vocabulary; rank 1 is the noise
    '...'."""
    vocab_size = (
        length - PROMPTS["freq_words_extraction"][2]
    ) // 50  # RULER's default vocabulary size
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)
    vocab[0] = "..."
    alpha = config["alpha"]
    zeta = torch.special.zeta(torch.tensor(alpha, dtype=torch.float64), 1.0).item()
    words = [word for k, word in enumerate(vocab, 1) for _ in range(int(n * k**-alpha / zeta))]
    rng.shuffle(words)
    template, prefix, _ = PROMPTS["freq_words_extraction"]
    return Instance(template.format(context=" ".join(words)), prefix, vocab[1:4])


BUILDERS: dict[str, Callable[[random.Random, int, dict, int], Instance]] = {
    "niah": niah,
    "variable_tracking": variable_tracking,
    "common_words_extraction": common_words,
    "freq_words_extraction": freq_words,
}


def fewest_units(config: dict) -> int:
    """The smallest haystack a builder accepts: room for every needle, chain link or common word."""
    if config["kind"] == "niah":
        return max(config["num_needle_k"], config["num_needle_q"]) * config["num_needle_v"]
    if config["kind"] == "variable_tracking":
        return config["num_hops"] + 1
    if config["kind"] == "common_words_extraction":
        return config["num_cw"]
    return 1


def largest_fitting(size: Callable[[int], int], budget: int, lo: int, most: int = 1 << 40) -> int:
    """The largest n in [lo, most] with size(n) <= budget, by doubling then bisection (size grows
    with n).

    Where size is not quite monotone the answer still fits, as only fitting n are ever kept.
    """
    if size(lo) > budget:
        raise ValueError(
            f"the smallest instance takes {size(lo)} tokens, more than the {budget} available"
        )
    hi = lo + 1  # invariant: lo fits; hi does not, or is past most
    while hi <= most and size(hi) <= budget:
        lo, hi = hi, min(2 * hi, most + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    return lo


def make_sample(
    task: str, tokenizer: Tokenizer, length: int, rng: random.Random, chat: bool = True
) -> Sample:
    """One sample of `task` whose prompt plus its tokens to generate is at most `length` tokens, as
    close as fits.

    The prompt is the chat-formatted task text (with chat=False, for base models, the plain text
    after BOS, as RULER's base-model template has it) followed by the answer prefix.
    """
    config = TASKS[task]
    kind = config["kind"]
    max_new_tokens = PROMPTS[kind][2]
    seed = rng.getrandbits(64)
    if kind == "variable_tracking":  # the solved example stays the same while the haystack is sized
        config = dict(config, example=vt_example(rng.getrandbits(64), tokenizer, config))

    def encode(n: int) -> tuple[list[int], list[str]]:
        # The same seed for every n: only the haystack size changes between tries.
        text, prefix, references = BUILDERS[kind](random.Random(seed), n, config, length)
        head = tokenizer.encode_chat(text) if chat else tokenizer.encode(text, bos=True)
        return head + tokenizer.encode(prefix, bos=False), references

    most = len(cwe_words()) if kind == "common_words_extraction" else 1 << 40
    n = largest_fitting(
        lambda n: len(encode(n)[0]), length - max_new_tokens, fewest_units(config), most
    )
    return Sample(*encode(n), max_new_tokens)


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's metric: the percent of references that occur in the prediction, case ignored."""
    return 100 * sum(r.lower() in prediction.lower() for r in references) / len(references)


def run_sample(runner: Runner, sample: Sample, length: int, task: str, index: int) -> dict:
    """One sample through every method: its references and each method's reply and score."""
    outputs = runner.run(sample.prompt_tokens, sample.max_new_tokens)
    return dict(
        length=length,
        task=task,
        index=index,
        prompt_tokens=len(sample.prompt_tokens),
        references=sample.references,
        outputs={
            method: dict(
                text=out.text,
                score=string_match_all(out.text, sample.references),
                fast_tier_bytes=out.fast_tier_bytes,
                stats=out.stats,
            )
            for method, out in outputs.items()
        },
    )


def evaluate(
    runner: Runner,
    tasks: list[str],
    lengths: list[int],
    samples: int,
    seed: int,
    log: SweepLog | None = None,
) -> list[dict]:
    """One row per sample: its references and every method's reply and score. With a log, the
    samples it holds are taken from it, and each sample run is added to it."""
    rows = []
    with tqdm(
        total=len(lengths) * len(tasks) * samples, desc="ruler samples", file=sys.stderr
    ) as bar:
        for length in lengths:
            for task in tasks:
                # A generator per (task, length): a task's samples do not depend on which others
                # run.
                rng = random.Random(f"{seed}/{task}/{length}")
                for index in range(samples):
                    # Drawn even when the log holds the sample: the next ones depend on it.
                    sample = make_sample(task, runner.tokenizer, length, rng, chat=runner.chat)
                    cell = [length, task, index]
                    run = partial(run_sample, runner, sample, *cell)
                    rows.append(run() if log is None else log.result(cell, run))
                    bar.update()
    return rows


def summarize(
    rows: list[dict], methods: list[str], tasks: list[str]
) -> dict[int, dict[str, dict[str, float]]]:
    """length -> method -> task -> mean score over samples, and 'average' over tasks."""
    scores: dict[int, dict[str, dict[str, float]]] = {}
    for length in dict.fromkeys(r["length"] for r in rows):
        scores[length] = {}
        for method in methods:
            per_task = {}
            for task in tasks:
                mine = [
                    r["outputs"][method]["score"]
                    for r in rows
                    if r["length"] == length and r["task"] == task
                ]
                per_task[task] = sum(mine) / len(mine)
            scores[length][method] = dict(per_task, average=sum(per_task.values()) / len(per_task))
    return scores


def tables(scores: dict[int, dict[str, dict[str, float]]], tasks: list[str], samples: int) -> str:
    """One markdown table per length: a row per method, a column per task, then the average."""
    blocks = []
    for length, by_method in scores.items():
        lines = [
            f"RULER at {length} tokens ({samples} sample{'s' * (samples != 1)} per task, "
            "string_match_all %):",
            "",
            "| method | " + " | ".join(tasks) + " | average |",
            "|---" * (len(tasks) + 2) + "|",
        ]
        for method, row in by_method.items():
            lines.append(
                f"| {method} | " + " | ".join(f"{row[t]:.1f}" for t in tasks + ["average"]) + " |"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def selection_tables(rows: list[dict], methods: list[str]) -> str:
    """Per length, SpeCache's selection statistics per method, means over the samples (with
    --stats, the diagnostics too); empty when no method reports them."""
    blocks = []
    for length in dict.fromkeys(r["length"] for r in rows):
        stats = {
            method: [r["outputs"][method]["stats"] for r in rows if r["length"] == length]
            for method in methods
        }
        if not any(s for per_sample in stats.values() for s in per_sample):
            continue
        diagnostics = any("diagnostics" in s for per_sample in stats.values() for s in per_sample)
        columns = selection_columns(diagnostics)
        lines = [
            f"SpeCache's selection at {length} tokens, means over the samples:",
            "",
            "| method | " + " | ".join(columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for method, per_sample in stats.items():
            cells = selection_cells(per_sample, diagnostics)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[2048, 4096],
        help="sequence lengths in tokens, prompt plus tokens to generate (default 2048 4096)",
    )
    parser.add_argument(
        "--samples", type=int, default=2, help="samples per task and length (default 2)"
    )
    parser.add_argument("--quick", action="store_true", help="1 sample per task and length")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=["all"],
        choices=["all", *TASKS],
        metavar="TASK",
        help=f"some of: {' '.join(TASKS)} (default all)",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="the same seed gives the same samples (default 42)"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    tasks = list(TASKS) if "all" in args.tasks else args.tasks
    samples = 1 if args.quick else args.samples

    log = SweepLog(args, "ruler", grid=("lengths", "samples", "quick", "tasks"))
    runner = runner_from_args(args)
    rows = evaluate(runner, tasks, args.lengths, samples, args.seed, log)
    scores = summarize(rows, runner.methods, tasks)
    minutes = log.minutes()
    selection = selection_tables(rows, runner.methods)
    markdown = "\n\n".join(
        [tables(scores, tasks, samples), *([selection] if selection else [])]
        + [f"The samples took {minutes:.1f} min."]
    )
    print(markdown)
    write_report(
        args.out,
        "ruler",
        markdown,
        dict(
            seed=args.seed,
            samples_per_task=samples,
            tasks=tasks,
            lengths=args.lengths,
            scores={str(length): s for length, s in scores.items()},
            minutes=minutes,
            samples=rows,
        ),
    )
    log.remove()


if __name__ == "__main__":
    main()
