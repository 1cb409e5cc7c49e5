"""scripts/eval/longbench.py without a model: metrics against hand-computed values, the per-task
rules (metric, post-processing, chat or not, generation length), prompts and their middle
truncation, data loading (local jsonl and the hub's data.zip), and a whole run with a fake runner.

The fixtures in tests/fixtures/longbench/ are hand-made samples in LongBench's jsonl format.
"""

import json
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from scripts.eval import longbench as lb

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "longbench"


class CharTokenizer:
    """One token per character; the chat format is visible markers around the prompt."""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([0] if bos else []) + [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids if i != 0)

    def encode_chat(self, prompt: str, system=None) -> list[int]:
        return self.encode(f"<user>{prompt}</user><assistant>", bos=True)


# --- metrics --------------------------------------------------------------------------------------


def test_normalize_answer():
    # lower case, punctuation gone, then the articles a/an/the as whole words, then single spaces
    assert lb.normalize_answer("The  Cat's hat, an Apple!") == "cats hat apple"
    assert lb.normalize_answer("Theatre") == "theatre"


def test_qa_f1_score():
    # "the cat sat" vs "a cat sat down" -> tokens [cat, sat] vs [cat, sat, down]: 2 shared,
    # P = 2/2, R = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert lb.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # shared tokens counted with multiplicity: [paris, paris, france] vs [paris] share 1,
    # P = 1/3, R = 1, F1 = 2 * 1/3 / (4/3) = 0.5
    assert lb.qa_f1_score("Paris Paris France", "Paris") == pytest.approx(0.5)
    # [paris, paris] vs [paris, paris, and, france] share 2 (not 1): P = 1, R = 1/2, F1 = 2 * 1/2 /
    # (3/2) = 2/3
    assert lb.qa_f1_score("paris paris", "Paris, Paris and France") == pytest.approx(2 / 3)
    assert lb.qa_f1_score("The Seine.", "the seine") == 1.0
    assert lb.qa_f1_score("London", "Paris") == 0.0
    assert lb.qa_f1_score("the", "a") == 0.0  # both normalize to nothing


def test_rouge_score():
    # ROUGE-L F on lower-cased words: LCS of "the cat sat on the mat" and "the cat lay on the mat"
    # is "the cat on the mat" = 5 of 6 words either way, so P = R = F = 5/6
    assert lb.rouge_score("the cat lay on the mat", "the cat sat on the mat") == pytest.approx(
        5 / 6
    )
    # prediction 4 words, reference 6, LCS "the gunman" = 2: P = 1/2, R = 1/3, F = 2 * 1/6 / (5/6) =
    # 0.4
    assert lb.rouge_score(
        "police killed the gunman", "the gunman was killed by police"
    ) == pytest.approx(0.4)
    assert lb.rouge_score("The cat sat on the mat.", "the cat sat on the mat") == pytest.approx(1.0)
    assert lb.rouge_score("", "the cat") == 0.0


def test_classification_score():
    classes = ["city", "other city", "country", "state"]
    # "other city" also contains "city", which is dropped as a proper substring of the true class ->
    # 1/1
    assert lb.classification_score("other city", "other city", all_classes=classes) == 1.0
    # two classes named, the true one among them -> 1/2
    assert lb.classification_score("city or country", "city", all_classes=classes) == 0.5
    assert lb.classification_score("state", "city", all_classes=classes) == 0.0
    # metrics.py removes from the list it iterates: after dropping "x", "y" is skipped and stays,
    # so [y, "x y z"] remain and the score is 1/2 (1.0 had every substring been dropped)
    assert lb.classification_score("x y z", "x y z", all_classes=["x", "y", "x y z"]) == 0.5


def test_retrieval_and_count_scores():
    assert lb.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    # numbers [12, 3]
    assert lb.retrieval_score("Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    # whole numbers, not substrings
    assert lb.retrieval_score("Paragraph 112", "Paragraph 12") == 0.0
    assert lb.retrieval_score("I don't know", "Paragraph 12") == 0.0
    assert lb.count_score("There are 7 unique paragraphs out of 10", "7") == 0.5  # numbers [7, 10]
    assert lb.count_score("7", 7) == 1.0  # an integer count compares as its string
    assert lb.count_score("seven", "7") == 0.0


def test_code_sim_score():
    # the first line without a comment or backtick is compared: identical -> 100
    assert lb.code_sim_score("\n# add them\n    return a + b\nprint(1)", "    return a + b") == 1.0
    # Indel ratio = 2 * LCS / (len1 + len2): "abcd"/"abce" share "abc": 6/8 = 75
    assert lb.code_sim_score("abcd", "abce") == 0.75
    # "kitten"/"sitting": LCS "ittn" = 4, 8/13 = 61.54, rounded to an integer percentage like
    # fuzzywuzzy
    assert lb.code_sim_score("kitten", "sitting") == 0.62
    # no code line: "" vs the answer
    assert lb.code_sim_score("```python\n// no code", "x = 1") == 0.0


# --- per-task rules -------------------------------------------------------------------------------


def test_task_dispatch():
    qa, rouge = lb.qa_f1_score, lb.rouge_score
    expected = {  # LongBench/eval.py dataset2metric, config/dataset2maxlen.json
        "narrativeqa": (qa, 128),
        "qasper": (qa, 128),
        "multifieldqa_en": (qa, 64),
        "hotpotqa": (qa, 32),
        "2wikimqa": (qa, 32),
        "musique": (qa, 32),
        "gov_report": (rouge, 512),
        "qmsum": (rouge, 512),
        "multi_news": (rouge, 512),
        "trec": (lb.classification_score, 64),
        "triviaqa": (qa, 32),
        "samsum": (rouge, 128),
        "passage_count": (lb.count_score, 32),
        "passage_retrieval_en": (lb.retrieval_score, 32),
        "lcc": (lb.code_sim_score, 64),
        "repobench-p": (lb.code_sim_score, 64),
    }
    assert set(lb.TASKS) == set(expected) and len(lb.TASKS) == 16
    for task, (metric, new_tokens) in expected.items():
        assert lb.METRICS[task] is metric, task
        assert lb.MAX_NEW_TOKENS[task] == new_tokens, task
    assert lb.NO_CHAT_TASKS == {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}
    assert lb.FIRST_LINE_TASKS == {"trec", "triviaqa", "samsum"}


def test_postprocess_and_sample_score():
    reply = "\n\nWarsaw\nQuestion: Where was Chopin born?\nAnswer: Zelazowa Wola"
    assert lb.postprocess("triviaqa", reply) == "Warsaw"
    assert lb.postprocess("hotpotqa", reply) == reply
    # triviaqa keeps only "Warsaw": F1 1 against the first answer
    assert lb.sample_score("triviaqa", reply, ["Warsaw", "Poland"], None) == 1.0
    # hotpotqa scores the whole reply: 9 normalized tokens, one of them "warsaw": P = 1/9, R = 1, F1
    # = 0.2
    assert lb.sample_score("hotpotqa", reply, ["Warsaw"], None) == pytest.approx(0.2)
    # the best over the answers: "Seine River" gives F1 2/3 with "the Seine" ([seine] vs [seine,
    # river])
    assert lb.sample_score(
        "hotpotqa", "the Seine", ["Thames", "Seine River"], None
    ) == pytest.approx(2 / 3)
    # trec passes all_classes: the first line names "City" only
    assert (
        lb.sample_score("trec", "City\nType: Individual", ["City"], ["City", "Individual"]) == 1.0
    )
    assert lb.task_score([1.0, 0.5, 0.0]) == 50.0
    assert lb.task_score([2 / 3, 0.5]) == 58.33  # (2/3 + 1/2) / 2 = 7/12, x100, 2 decimals


# --- prompts --------------------------------------------------------------------------------------

QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output "
    "any "
    "other words.\n\nThe following are given passages.\nC\n\nAnswer the question based on the "
    "given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: Q\nAnswer:"
)
QASPER = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question "
    "cannot be "
    "answered based on the information in the article, write \"unanswerable\". If the question is "
    "a yes/no "
    "question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)
# One entry per template of LongBench/config/dataset2prompt.json, with context "C" and input "Q".
FORMATTED = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a "
    "question. Answer the "
    "question asconcisely as you can, using a single phrase if possible. Do not provide any "
    "explanation.\n\nStory: C\n\nNow, answer the question based on the story asconcisely as you "
    "can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: Q\n\n"
    "Answer:",
    "qasper": f"You are given a scientific article and a question. Answer the question "
    f"{QASPER}\n\nArticle: C\n\n "
    f"Answer the question based on the above article {QASPER}\n\nQuestion: Q\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\nC\n\nNow, answer the "
    "following question "
    "based on the above text, only give me the answer and do not output any other words.\n\n"
    "Question: Q\nAnswer:",
    "hotpotqa": QA_PASSAGES,
    "2wikimqa": QA_PASSAGES,
    "musique": QA_PASSAGES,
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the "
    "report.\n\n"
    "Report:\nC\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. "
    "Answer the query "
    "in one or more sentences.\n\nTranscript:\nC\n\nNow, answer the query based on the above "
    "meeting "
    "transcript in one or more sentences.\n\nQuery: Q\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. "
    "\n\nNews:\nC\n\nNow, "
    "write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of "
    "questions.\n\nC\nQ",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do "
    "not output any other "
    "words. The following are some examples.\n\nC\n\nQ",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some "
    "examples.\n\nC\n\nQ",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be "
    "duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after "
    "removing duplicates. In other words, how many non-repeating paragraphs are there in "
    "total?\n\nC"
    "\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output "
    "format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please "
    "determine which "
    "paragraph the abstract is from.\n\nC\n\nThe following is an abstract.\n\nQ\n\nPlease "
    "enter the number of the paragraph that the abstract is from. The answer format must be "
    "like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \nCNext line of code:\n",
    "repobench-p": "Please complete the code given below. \nCQNext line of code:\n",
}


@pytest.mark.parametrize("task", sorted(FORMATTED))
def test_format_prompt(task):
    # a real sample has more fields than the template uses
    assert (
        lb.format_prompt(task, dict(context="C", input="Q", answers=["A"], _id="0"))
        == FORMATTED[task]
    )


def test_format_prompt_keeps_braces_in_the_data():
    assert (
        lb.format_prompt("lcc", dict(context="d = {x}\n", input=""))
        == "Please complete the code given below. \nd = {x}\nNext line of code:\n"
    )


def test_truncate_middle():
    assert lb.truncate_middle(list(range(10)), 6) == ([0, 1, 2], [7, 8, 9])
    # int(7/2) = 3 each side, as pred.py
    assert lb.truncate_middle(list(range(10)), 7) == (
        [0, 1, 2],
        [7, 8, 9],
    )
    # at most max_length: untouched
    assert lb.truncate_middle(list(range(6)), 6) == (
        list(range(6)),
        [],
    )


def test_prompt_tokens_truncates_then_wraps():
    tok = CharTokenizer()
    sample = dict(context="0123456789" * 20, input="Where?")
    prompt = lb.format_prompt("hotpotqa", sample)
    # short enough: the whole prompt, in the chat format for hotpotqa, plain (with BOS) for trec
    assert lb.prompt_tokens(tok, "hotpotqa", sample, 10_000) == tok.encode_chat(prompt)
    assert lb.prompt_tokens(tok, "trec", sample, 10_000) == tok.encode(
        lb.format_prompt("trec", sample), bos=True
    )
    # cut to 100 characters: the first 50 and the last 50 of the formatted prompt, then wrapped
    cut = lb.prompt_tokens(tok, "hotpotqa", sample, 100)
    assert tok.decode(cut) == f"<user>{prompt[:50]}{prompt[-50:]}</user><assistant>"
    # lcc: 39 characters of instruction + 11 x, then 31 x + the 19 characters of "Next line of
    # code:\n"
    assert lb.prompt_tokens(tok, "lcc", dict(context="x" * 300, input=""), 100) == tok.encode(
        "Please complete the code given below. \n" + "x" * 42 + "Next line of code:\n", bos=True
    )


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_checkpoint):
    from tokenizer import get_tokenizer

    return get_tokenizer(smollm2_checkpoint.parent)


def test_prompt_tokens_real_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    sample = dict(
        context=" ".join(f"word{i}" for i in range(2000)), input="Which word comes first?"
    )
    tokens = lb.prompt_tokens(tok, "hotpotqa", sample, 200)
    text = tok.decode(tokens)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert (
        "Answer the question based on the given passages" in text
        and "Which word comes first?" in text
    )
    assert "word0 " in text and "word1999" in text and "word1000" not in text  # the middle is gone
    # 200 prompt tokens inside the chat turn, give or take a token re-tokenized differently at the
    # cut
    assert abs(len(tokens) - len(tok.encode_chat("")) - 200) <= 2


# --- data -----------------------------------------------------------------------------------------
# ----------


def fixture_rows(task: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()]


def test_load_data_from_dir():
    data = lb.load_data(["trec", "passage_retrieval_en", "passage_count"], data_dir=FIXTURES)
    assert data["trec"] == fixture_rows("trec") and len(data["trec"]) == 2
    assert data["trec"][0]["all_classes"][:2] == ["Abbreviation", "City"]
    assert data["passage_retrieval_en"][0]["answers"] == ["Paragraph 2"]
    assert data["passage_count"][0]["answers"] == ["3"]
    assert (
        lb.load_data(["hotpotqa"], data_dir=FIXTURES, samples=1)["hotpotqa"]
        == fixture_rows("hotpotqa")[:1]
    )
    with pytest.raises(SystemExit, match="narrativeqa.jsonl"):
        lb.load_data(["narrativeqa"], data_dir=FIXTURES)


def test_load_data_from_hub_zip(tmp_path, monkeypatch):
    import huggingface_hub

    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for task in ("trec", "hotpotqa"):
            z.write(FIXTURES / f"{task}.jsonl", f"data/{task}.jsonl")
    calls = []

    def fake_download(repo_id, filename, repo_type=None):
        calls.append((repo_id, filename, repo_type))
        return str(archive)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    data = lb.load_data(["trec", "hotpotqa"], repo_id="someone/LongBench", samples=1)
    assert data == {"trec": fixture_rows("trec")[:1], "hotpotqa": fixture_rows("hotpotqa")[:1]}
    assert calls == [("someone/LongBench", "data.zip", "dataset")]  # one download for all tasks
    with pytest.raises(SystemExit, match="no data/lcc.jsonl"):
        lb.load_data(["lcc"])


def test_hub_unreachable_is_one_clear_line(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("Cannot reach the Hub.\nSecond line of detail")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(SystemExit) as exit_info:
        lb.main(["--tasks", "trec"])
    message = str(exit_info.value.code)
    assert "\n" not in message and "--data_dir" in message and "Cannot reach the Hub." in message
    assert "zai-org/LongBench/resolve/main/data.zip" in message


def test_parse_args():
    assert lb.parse_args([]).tasks == list(lb.TASKS)
    args = lb.parse_args(["--tasks", "trec", "lcc", "trec", "--samples", "3"])
    assert args.tasks == ["trec", "lcc"] and args.samples == 3 and args.max_length == 3500
    assert args.repo_id == "zai-org/LongBench" and args.data_dir is None
    for bad in (["--samples", "0"], ["--tasks", "lsht"], ["--max_length", "1"]):
        with pytest.raises(SystemExit):
            lb.parse_args(bad)


# --- end to end -----------------------------------------------------------------------------------

# A phrase only that sample's prompt contains -> (task, reply of "full", reply of "kivi-1bit",
# kivi's score).
CANNED = {
    "Where was Marie Curie born?": ("hotpotqa", "Warsaw", "Warsaw, Poland", 2 / 3),  # P 1/2, R 1
    "Which river flows through Paris?": (
        "hotpotqa",
        "The Seine.",
        "The river Thames",
        0.5,
    ),  # vs "Seine River"
    "1936 Summer Olympics": (
        "trec",
        "City\nQuestion: Who wrote Hamlet?\nType: Individual",
        "Country or City",
        0.5,
    ),
    "Eiffel Tower": (
        "trec",
        "Date",
        "\n\nDate\nQuestion: Where?\nType: City",
        1.0,
    ),  # first line after the \n\n
    "bring the cake tomorrow": (
        "samsum",
        "Anna will bring the cake.\nDialogue: Tom: Bye.",
        "Anna brings cake",
        0.5,
    ),  # LCS [anna, cake]: P 2/3, R 2/5, F 0.5
    "animal shelter program": (
        "gov_report",
        "The cat sat on the mat.",
        "the cat lay on the mat",
        5 / 6,
    ),
    "alpine swift": ("passage_count", "3", "There are 4 unique paragraphs", 0.0),
    "fast-cooling lava": ("passage_retrieval_en", "Paragraph 2", "Paragraph 1 or Paragraph 2", 0.5),
    "def add(a, b)": (
        "lcc",
        "    return a + b\n",
        "# add them\n    return a - b",
        0.94,
    ),  # 1 - 2/32 = 93.75 -> 94
}
E2E_TASKS = [
    "hotpotqa",
    "trec",
    "samsum",
    "gov_report",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
]
# kivi-1bit per task: the mean of its samples' scores above, x100, 2 decimals
KIVI_SCORES = {
    "hotpotqa": 58.33,
    "trec": 75.0,
    "samsum": 50.0,
    "gov_report": 83.33,
    "passage_count": 0.0,
    "passage_retrieval_en": 50.0,
    "lcc": 94.0,
}


def fake_runner(tokenizer) -> SimpleNamespace:
    calls = []

    def run(prompt: list[int], max_new_tokens: int) -> dict:
        text = tokenizer.decode(prompt)
        (marker,) = [m for m in CANNED if m in text]
        task, full, kivi, _ = CANNED[marker]
        calls.append(dict(task=task, text=text, max_new_tokens=max_new_tokens))
        return {
            name: SimpleNamespace(text=reply, tokens=[], fast_tier_bytes=size)
            for name, reply, size in (("full", full, None), ("kivi-1bit", kivi, 123))
        }

    return SimpleNamespace(tokenizer=tokenizer, methods=["full", "kivi-1bit"], run=run, calls=calls)


def test_end_to_end(smollm2_tokenizer, tmp_path, monkeypatch, capsys):
    runner = fake_runner(smollm2_tokenizer)
    monkeypatch.setattr(lb, "runner_from_args", lambda args: runner)
    assert (
        lb.main(
            [
                "--tasks",
                *E2E_TASKS,
                "--data_dir",
                str(FIXTURES),
                "--out",
                str(tmp_path),
                "--methods",
                "full",
                "kivi-1bit",
            ]
        )
        == 0
    )

    assert [c["task"] for c in runner.calls] == [
        "hotpotqa",
        "hotpotqa",
        "trec",
        "trec",
        "samsum",
        "gov_report",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
    ]
    for call in runner.calls:
        assert call["max_new_tokens"] == lb.MAX_NEW_TOKENS[call["task"]]
        # chat-formatted (SmolLM2's ChatML) except on the few-shot and code tasks
        assert call["text"].startswith("<|im_start|>system") == (
            call["task"] not in {"trec", "samsum", "lcc"}
        )
    lcc_sample = fixture_rows("lcc")[0]
    assert runner.calls[-1]["text"] == lb.format_prompt("lcc", lcc_sample)  # plain, nothing added

    report = json.loads((tmp_path / "longbench.json").read_text())
    assert report["scores"]["full"] == {task: 100.0 for task in E2E_TASKS}
    assert report["scores"]["kivi-1bit"] == KIVI_SCORES
    trec_row = report["samples"]["trec"][0]
    assert trec_row["id"] == "trec-0" and trec_row["scores"] == {"full": 1.0, "kivi-1bit": 0.5}
    assert trec_row["fast_tier_bytes"] == {"full": None, "kivi-1bit": 123}

    # (58.33 + 75 + 50 + 83.33 + 0 + 50 + 94) / 7 = 58.666 -> 58.67
    kivi_row = "| kivi-1bit | 58.33 | 75.00 | 50.00 | 83.33 | 0.00 | 50.00 | 94.00 | 58.67 |"
    header = "| method | " + " | ".join(E2E_TASKS) + " | average |"
    markdown = (tmp_path / "longbench.md").read_text()
    for text in (markdown, capsys.readouterr().out):
        assert header in text and kivi_row in text
        assert "| full |" + " 100.00 |" * 8 in text


def test_resume_runs_only_the_samples_not_done(smollm2_tokenizer, tmp_path, monkeypatch):
    argv = ["--tasks", *E2E_TASKS, "--data_dir", str(FIXTURES), "--out", str(tmp_path)]
    argv += ["--methods", "full", "kivi-1bit"]
    stopped = fake_runner(smollm2_tokenizer)
    answer = stopped.run

    def stop_at_the_fifth(prompt, max_new_tokens):
        if len(stopped.calls) == 4:
            raise KeyboardInterrupt
        return answer(prompt, max_new_tokens)

    stopped.run = stop_at_the_fifth
    monkeypatch.setattr(lb, "runner_from_args", lambda args: stopped)
    with pytest.raises(KeyboardInterrupt):
        lb.main(argv)
    resumed = fake_runner(smollm2_tokenizer)
    monkeypatch.setattr(lb, "runner_from_args", lambda args: resumed)
    assert lb.main([*argv, "--resume"]) == 0
    assert [c["task"] for c in stopped.calls] == ["hotpotqa", "hotpotqa", "trec", "trec"]
    assert [c["task"] for c in resumed.calls] == [
        "samsum",
        "gov_report",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
    ]
    report = json.loads((tmp_path / "longbench.json").read_text())
    assert report["scores"]["kivi-1bit"] == KIVI_SCORES  # the logged samples' scores counted
    assert not (tmp_path / "longbench.partial.jsonl").exists()
