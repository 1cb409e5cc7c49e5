"""LongBench v1 on the 16 English and code tasks that the SpeCache paper family reports, every KV
cache.

    python scripts/eval/longbench.py --tasks all --samples 5 --max_length 3500
    python scripts/eval/longbench.py --tasks hotpotqa trec lcc --methods full specache-1bit
    python scripts/eval/longbench.py --data_dir ~/LongBench/data  # jsonl files from data.zip,
                                                                  # offline
    python scripts/eval/longbench.py ... --resume                 # the same command, stopped: go on

Reproduces the official pipeline (github.com/THUDM/LongBench, files under LongBench/ at commit
2e00731): the per-task prompt template (config/dataset2prompt.json) and generation length
(config/dataset2maxlen.json); pred.py's middle truncation of the tokenized prompt to --max_length
(the first half and the last half of its tokens), then the model's chat format for every task but
trec, triviaqa, samsum, lcc and repobench-p; eval.py's post-processing (the first non-empty line of
the reply for trec, triviaqa and samsum) and score: per sample the best of the task metric over the
ground-truth answers, averaged over samples, x100. The metrics follow metrics.py; see each for where
the result can differ.

--max_length defaults to 3500 tokens, sized for a 4k-token context: 3500 prompt tokens, the chat
wrapping (about 30 tokens for SmolLM2) and the longest generation (512, the summaries) fit in 4096.
Official runs use the model's own window (3500 for llama2-7b-chat-4k, 31500 for 32k models).

Data: data.zip of the Hugging Face dataset --repo_id (downloaded once into the HF cache; it holds
data/{task}.jsonl), or --data_dir with those jsonl files. Each prompt is prefilled once and decoded
greedily by every method (scripts/eval/harness.py). Writes {out}/longbench.md (score table: methods
x tasks and their average) and {out}/longbench.json (every reply and score). While it runs,
{out}/longbench.partial.jsonl holds the samples done, for --resume.

Differences from the official scripts: samsum is not stopped at the first newline during generation
(the post-processing keeps only the first line, so the score is the same unless the reply starts
with a newline, which official runs forbid); the truncation length counts the prompt's text tokens
only (HF Llama tokenizers also count the BOS token).
"""

import argparse
import json
import re
import string
import sys
import zipfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Optional

from rapidfuzz import fuzz
from rouge_score import rouge_scorer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.eval.harness import (  # noqa: E402
    SweepLog,
    add_arguments,
    runner_from_args,
    write_report,
)

TASKS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
DEFAULT_REPO_ID = "zai-org/LongBench"  # THUDM/LongBench before the organisation was renamed
DEFAULT_MAX_LENGTH = 3500

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output "
    "any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on "
    "the "
    "given passages. Only give me the answer and do not output any other words.\n\nQuestion: "
    "{input}\n"
    "Answer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question "
    "cannot be "
    "answered based on the information in the article, write \"unanswerable\". If the question is "
    "a "
    "yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)
# LongBench/config/dataset2prompt.json, verbatim (including its "asconcisely" typo in narrativeqa).
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a "
    "question. Answer the "
    "question asconcisely as you can, using a single phrase if possible. Do not provide any "
    "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely "
    "as "
    "you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: "
    "{input}\n\nAnswer:",
    "qasper": f"You are given a scientific article and a question. Answer the question "
    f"{_QASPER_RULES}\n\n"
    f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\n"
    "Question: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer "
    "the following "
    "question based on the above text, only give me the answer and do not output any other "
    "words.\n\nQuestion: {input}\nAnswer:",
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the "
    "report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. "
    "Answer the query "
    "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
    "above "
    "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. "
    "\n\nNews:\n{context}\n\n"
    "Now, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of "
    "questions.\n\n{context}\n"
    "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do "
    "not output any other "
    "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some "
    "examples.\n\n{context}\n\n"
    "{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be "
    "duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after "
    "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n"
    "{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The "
    "output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer "
    "is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please "
    "determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n"
    "{input}\n\nPlease enter the number of the paragraph that the abstract is from. The "
    "answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# LongBench/config/dataset2maxlen.json: new tokens per task.
MAX_NEW_TOKENS = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}
# pred.py: "chat models are better off without build prompts on these tasks" (the few-shot and code
# tasks; its list also has lsht, a Chinese task not run here).
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lcc", "repobench-p"})
# eval.py keeps the first line of the reply on these few-shot tasks (and lsht), whose examples
# continue past the answer.
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum"})


# --- metrics (LongBench/metrics.py) ---------------------------------------------------------------

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD's normalization: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 between the normalized answers, tokens counted with multiplicity."""
    pred_tokens, truth_tokens = (
        normalize_answer(prediction).split(),
        normalize_answer(ground_truth).split(),
    )
    same = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


_ROUGE_L = rouge_scorer.RougeScorer(["rougeL"])


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F-measure.

    Official LongBench uses the `rouge` package, which splits the texts into sentences at '.' and
    takes a summary-level LCS over case-sensitive whitespace tokens; `rouge-score` (kept up by
    Google)
    lower-cases, drops punctuation and takes one LCS over the whole text, so values may differ
    slightly.
    """
    return _ROUGE_L.score(ground_truth, prediction)["rougeL"].fmeasure


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/(number of classes named in the prediction) if the true class is among them, else 0.

    A named class that is a proper substring of the true class does not count. Removing from the
    list
    while iterating over it skips the element after each removal, as metrics.py does: kept so that
    scores match the official ones.
    """
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    for name in matches:
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    """The fraction of the numbers in a reply that are the right one (0 if it has none)."""
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Ground truth "Paragraph 12": the share of the numbers in the prediction equal to 12."""
    target = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    return _share_equal(re.findall(r"\d+", prediction), target)


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """The share of the numbers in the prediction equal to the count."""
    return _share_equal(re.findall(r"\d+", prediction), str(ground_truth))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Similarity of the first code line of the reply (no `, # or //) to the true next line.

    metrics.py uses fuzzywuzzy's fuzz.ratio, an integer percentage; rapidfuzz's fuzz.ratio is the
    same
    normalized Indel similarity (fuzzywuzzy's value with python-Levenshtein installed), rounded
    here the
    way fuzzywuzzy rounds. Without python-Levenshtein fuzzywuzzy falls back to difflib, which can
    differ.
    """
    line = next(
        (
            line
            for line in prediction.lstrip("\n").split("\n")
            if "`" not in line and "#" not in line and "//" not in line
        ),
        "",
    )
    return round(fuzz.ratio(line, ground_truth)) / 100


METRICS: dict[str, Callable[..., float]] = {
    **dict.fromkeys(
        ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"),
        qa_f1_score,
    ),
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum"), rouge_score),
    "trec": classification_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def postprocess(task: str, prediction: str) -> str:
    """eval.py: on the few-shot tasks the model tends to go on with more examples; only its first
    line counts."""
    return prediction.lstrip("\n").split("\n")[0] if task in FIRST_LINE_TASKS else prediction


def sample_score(
    task: str, prediction: str, answers: list[str], all_classes: Optional[list[str]]
) -> float:
    """eval.py's score of one reply: the best over the ground-truth answers, in [0, 1]."""
    prediction = postprocess(task, prediction)
    return max(
        [0.0] + [METRICS[task](prediction, answer, all_classes=all_classes) for answer in answers]
    )


def task_score(sample_scores: list[float]) -> float:
    """eval.py's task score: the mean x100, rounded to 2 decimals."""
    return round(100 * sum(sample_scores) / len(sample_scores), 2)


# --- prompts --------------------------------------------------------------------------------------


def format_prompt(task: str, sample: dict) -> str:
    """The task's template filled with the sample's fields (context, input), as pred.py does."""
    return PROMPTS[task].format(**sample)


def truncate_middle(tokens: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """pred.py's cut: the first and the last int(max_length/2) tokens, when there are more than
    max_length.

    Returns the two halves (the second empty when nothing is cut): they are decoded separately, as
    pred.py does, so no token is merged across the cut.
    """
    if len(tokens) <= max_length:
        return tokens, []
    half = max_length // 2
    return tokens[:half], tokens[-half:]


def prompt_tokens(tokenizer, task: str, sample: dict, max_length: int) -> list[int]:
    """The tokens the model is prefilled with: format, truncate in the middle, then wrap (or not)
    in chat."""
    prompt = format_prompt(task, sample)
    head, tail = truncate_middle(tokenizer.encode(prompt, bos=False), max_length)
    if tail:
        prompt = tokenizer.decode(head) + tokenizer.decode(tail)
    return (
        tokenizer.encode(prompt, bos=True)
        if task in NO_CHAT_TASKS
        else tokenizer.encode_chat(prompt)
    )


# --- data -----------------------------------------------------------------------------------------


def _read_jsonl(lines: Iterable[str], samples: Optional[int]) -> list[dict]:
    rows = []
    for line in lines:
        if samples is not None and len(rows) == samples:
            break
        if line.strip():
            rows.append(json.loads(line))
    return rows


def hub_zip(repo_id: str) -> Path:
    """data.zip of the dataset repo, from the HF cache or downloaded; one clear line when
    unreachable."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo_id, "data.zip", repo_type="dataset"))
    except (
        OSError
    ) as e:  # offline, unknown repo, HTTP errors: all OSError subclasses in huggingface_hub
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(
            f"could not get data.zip of the dataset {repo_id} from the Hugging Face hub "
            f"({reason}); "
            f"download https://huggingface.co/datasets/{repo_id}/resolve/main/data.zip, unzip it "
            "and "
            "pass --data_dir <its data/ folder>"
        )


def load_data(
    tasks: list[str],
    data_dir: Optional[Path] = None,
    repo_id: str = DEFAULT_REPO_ID,
    samples: Optional[int] = None,
) -> dict[str, list[dict]]:
    """The first `samples` samples (all if None) of each task: {data_dir}/{task}.jsonl, or
    data/{task}.jsonl
    inside the hub's data.zip (fetched once for all tasks)."""
    data = {}
    if data_dir is not None:
        for task in tasks:
            path = Path(data_dir) / f"{task}.jsonl"
            if not path.is_file():
                raise SystemExit(
                    f"no {path}: --data_dir must hold LongBench's {{task}}.jsonl files "
                    "(the data/ folder of its data.zip)"
                )
            with open(path, encoding="utf-8") as f:
                data[task] = _read_jsonl(f, samples)
        return data
    archive_path = hub_zip(repo_id)
    with zipfile.ZipFile(archive_path) as archive:
        for task in tasks:
            if f"data/{task}.jsonl" not in archive.namelist():
                raise SystemExit(
                    f"{archive_path} has no data/{task}.jsonl: is {repo_id} LongBench v1?"
                )
            with archive.open(f"data/{task}.jsonl") as f:
                data[task] = _read_jsonl((line.decode("utf-8") for line in f), samples)
    return data


# --- run and report -------------------------------------------------------------------------------


def run_sample(runner, task: str, sample: dict, max_length: int) -> dict:
    """One sample through every method: its answers, and per method the reply and its score."""
    tokens = prompt_tokens(runner.tokenizer, task, sample, max_length)
    outputs = runner.run(tokens, MAX_NEW_TOKENS[task])
    row = dict(
        id=sample.get("_id"),
        length=sample.get("length"),
        prompt_tokens=len(tokens),
        answers=sample["answers"],
        replies={},
        scores={},
        fast_tier_bytes={},
    )
    for method, out in outputs.items():
        score = sample_score(task, out.text, sample["answers"], sample.get("all_classes"))
        row["replies"][method], row["scores"][method] = out.text, score
        row["fast_tier_bytes"][method] = out.fast_tier_bytes
    return row


def evaluate(
    runner, data: dict[str, list[dict]], max_length: int, log: Optional[SweepLog] = None
) -> dict:
    """Every sample of every task through every method of `runner`; with a log, the samples it
    holds are taken from it, and each sample run is added to it.

    Returns {"scores": {method: {task: score}}, "samples": {task: [one dict per sample: id, length,
    prompt_tokens, answers, and per method the reply and its score]}}.
    """
    methods = list(runner.methods)
    per_sample = {m: {task: [] for task in data} for m in methods}
    samples_out = {task: [] for task in data}
    progress = tqdm(
        total=sum(len(rows) for rows in data.values()), desc="longbench samples", file=sys.stderr
    )
    for task, rows in data.items():
        for index, sample in enumerate(rows):
            progress.set_postfix_str(task)
            run = partial(run_sample, runner, task, sample, max_length)
            row = run() if log is None else log.result([task, index], run)
            for method in methods:
                per_sample[method][task].append(row["scores"][method])
            samples_out[task].append(row)
            progress.update()
    progress.close()
    scores = {
        m: {task: task_score(s) for task, s in by_task.items()} for m, by_task in per_sample.items()
    }
    return dict(scores=scores, samples=samples_out)


def average(scores: list[float]) -> float:
    """The unweighted mean of task scores, as papers report LongBench averages."""
    return round(sum(scores) / len(scores), 2)


def table(scores: dict[str, dict[str, float]], tasks: list[str]) -> str:
    """Markdown: one row per method, one column per task, then the average over tasks."""
    lines = ["| method | " + " | ".join(tasks) + " | average |", "|---" * (len(tasks) + 2) + "|"]
    for method, by_task in scores.items():
        lines.append(
            f"| {method} | "
            + " | ".join(f"{by_task[t]:.2f}" for t in tasks)
            + f" | {average([by_task[t] for t in tasks]):.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = parser.add_argument_group("LongBench")
    g.add_argument(
        "--tasks",
        nargs="+",
        default=["all"],
        choices=("all",) + TASKS,
        metavar="TASK",
        help=f"'all' (default) or some of: {' '.join(TASKS)}",
    )
    g.add_argument(
        "--samples", type=int, default=None, help="the first N samples of each task (default: all)"
    )
    g.add_argument(
        "--max_length",
        type=int,
        default=DEFAULT_MAX_LENGTH,
        help="prompt tokens kept (first and last halves) before the chat wrapping (default 3500, "
        "for a 4k context)",
    )
    g.add_argument(
        "--data_dir",
        type=Path,
        default=None,
        help="read {task}.jsonl from here instead of the hub (the data/ folder of LongBench's "
        "data.zip)",
    )
    g.add_argument(
        "--repo_id",
        default=DEFAULT_REPO_ID,
        help=f"Hugging Face dataset holding data.zip (default {DEFAULT_REPO_ID}, formerly "
        "THUDM/LongBench)",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.samples is not None and args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.max_length < 2:
        parser.error("--max_length must be at least 2")
    args.tasks = list(TASKS) if "all" in args.tasks else list(dict.fromkeys(args.tasks))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # The data first: a missing file or an unreachable hub fails before the model is loaded.
    data = load_data(args.tasks, args.data_dir, args.repo_id, args.samples)
    empty = [task for task, rows in data.items() if not rows]
    if empty:
        raise SystemExit(f"no samples for {', '.join(empty)}")
    log = SweepLog(args, "longbench", grid=("tasks", "samples"))
    runner = runner_from_args(args)
    result = evaluate(runner, data, args.max_length, log)
    samples = "all samples" if args.samples is None else f"the first {args.samples} sample(s)"
    markdown = (
        f"LongBench v1, {samples} of each task, prompts cut to {args.max_length} tokens; "
        "scores x100 (F1, ROUGE-L, accuracy or edit similarity per task).\n\n"
        + table(result["scores"], args.tasks)
    )
    print(markdown)
    write_report(
        args.out,
        "longbench",
        markdown,
        dict(
            tasks=args.tasks,
            samples_per_task=args.samples,
            max_length=args.max_length,
            repo_id=None if args.data_dir else args.repo_id,
            minutes=log.minutes(),
            **result,
        ),
    )
    log.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
