"""scripts/eval/ruler.py: samples fit their length and hold their answers the way each RULER task
asks; seeding; the metric; the CLI's tables and report driven by a fake runner (no model runs)."""

import json
import random
import re
from collections import Counter
from types import SimpleNamespace

import pytest

from scripts.eval import ruler
from scripts.eval.ruler import (
    NOISE,
    TASKS,
    largest_fitting,
    make_sample,
    selection_tables,
    string_match_all,
)

LENGTHS = (1024, 2048)
NIAH_TASKS = [task for task, config in TASKS.items() if config["kind"] == "niah"]
# RULER's tokens_to_generate per task kind (scripts/data/synthetic/constants.py).
TOKENS_TO_GENERATE = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
}
# What the assistant turn must start with: RULER's answer prefix, singular where one value is asked
# for.
ANSWER_PREFIXES = {
    "niah_single_1": r" The special magic number for .+ mentioned in the provided text is",
    "niah_single_2": r" The special magic number for .+ mentioned in the provided text is",
    "niah_single_3": r" The special magic uuid for .+ mentioned in the provided text is",
    "niah_multikey_1": r" The special magic number for .+ mentioned in the provided text is",
    "niah_multikey_2": r" The special magic number for .+ mentioned in the provided text is",
    "niah_multikey_3": r" The special magic uuid for .+ mentioned in the provided text is",
    "niah_multivalue": r" The special magic numbers for .+ mentioned in the provided text are",
    "niah_multiquery": r" The special magic numbers for .+, .+, .+, and .+ mentioned in the "
    r"provided text are",
    "vt": r" Answer: According to the chain\(s\) of variable assignment in the text above, 5 "
    r"variables are "
    r"assigned the value \d{5}, they are: ",
    "cwe": r" Answer: The top 10 words that appear most often in the list are:",
    "fwe": r" Answer: According to the coded text above, the three most frequently appeared words "
    r"are:",
}
ASSISTANT = "<|im_start|>assistant\n"  # the default model (SmolLM2) uses ChatML


@pytest.fixture(scope="module")
def tokenizer():
    from checkpoint import prepare_default_checkpoint
    from tokenizer import get_tokenizer

    return get_tokenizer(prepare_default_checkpoint().parent)


@pytest.fixture(scope="module")
def samples(tokenizer):
    return {
        (task, length): make_sample(task, tokenizer, length, random.Random(f"test/{task}/{length}"))
        for task in TASKS
        for length in LENGTHS
    }


def user_turn(tokenizer, sample) -> str:
    text = tokenizer.decode(sample.prompt_tokens)
    return text[text.rindex("<|im_start|>user\n") : text.rindex(ASSISTANT)]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", list(TASKS))
def test_sample_fills_its_length_and_ends_with_the_answer_prefix(samples, tokenizer, task, length):
    sample = samples[task, length]
    assert sample.max_new_tokens == TOKENS_TO_GENERATE[TASKS[task]["kind"]]
    total = len(sample.prompt_tokens) + sample.max_new_tokens
    assert 0.9 * length <= total <= length
    text = tokenizer.decode(sample.prompt_tokens)
    assert re.fullmatch(ANSWER_PREFIXES[task], text[text.rindex(ASSISTANT) + len(ASSISTANT) :])


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_references_are_the_values_next_to_the_asked_keys(samples, tokenizer, task, length):
    config, sample = TASKS[task], samples[task, length]
    text = user_turn(tokenizer, sample)
    needles = re.findall(r"One of the special magic (\w+) for (.+?) is: (\S+)\.", text)
    question = re.search(
        r"What (?:is|are all) the special magic \w+ for (.+) mentioned in the provided text\?", text
    )
    asked = re.split(r", and |, ", question.group(1))
    assert len(asked) == config["num_needle_q"]
    assert {t for t, _, _ in needles} == {config["type_needle_v"]}
    assert sorted(v for _, k, v in needles if k in asked) == sorted(sample.references)
    assert len(sample.references) == config["num_needle_q"] * config["num_needle_v"]
    value_pattern = (
        r"\d{7}"
        if config["type_needle_v"] == "numbers"
        else r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}"
    )
    assert all(re.fullmatch(value_pattern, v) for v in sample.references)
    keys = {k for _, k, _ in needles}
    if config["type_haystack"] == "needle":  # distractor needles with other keys fill the haystack
        assert len(needles) > 5 and len(keys) == len(needles)
    else:
        assert len(keys) == max(config["num_needle_k"], config["num_needle_q"])
        assert (NOISE in text) == (config["type_haystack"] == "noise")
        # the first essay's start
        assert ("What hard liquor" in text) == (config["type_haystack"] == "essay")


def resolve(text: str, value: str) -> set[str]:
    """Every variable that ends up holding `value` through the 'VAR X = ...' lines of text."""
    assignments = re.findall(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+)|(\d+))", text)
    holders = {x for x, _, number in assignments if number == value}
    while grown := {x for x, y, _ in assignments if y in holders} - holders:
        holders |= grown
    return holders


@pytest.mark.parametrize("length", LENGTHS)
def test_vt_chain_resolves_to_the_references(samples, tokenizer, length):
    sample = samples["vt", length]
    text = user_turn(tokenizer, sample)
    example, task = text.split("\n\nMemorize and track")[-2:]  # the solved example, then the task
    value = re.search(r"assigned the value (\d{5}) in the text above", task).group(1)
    assert resolve(task, value) == set(sample.references)
    assert len(sample.references) == 5 and all(len(name) == 5 for name in sample.references)
    example_value = re.search(r"assigned the value (\d{5}), they are: ", example).group(1)
    example_answer = example.rsplit("they are: ", 1)[1].split()
    assert resolve(example, example_value) == set(example_answer) and len(example_answer) == 5
    assert value != example_value and not set(example_answer) & set(sample.references)


def cwe_counts(list_text: str) -> Counter:
    entries = re.split(r"(?:^| )(\d+)\. ", list_text)[1:]  # number, word, number, word, ...
    assert [int(n) for n in entries[::2]] == list(range(1, len(entries) // 2 + 1))
    return Counter(entries[1::2])


@pytest.mark.parametrize("length", LENGTHS)
def test_cwe_references_are_the_most_common_words(samples, tokenizer, length):
    sample = samples["cwe", length]
    text = user_turn(tokenizer, sample)
    counts = cwe_counts(
        text.split("Memorize the ones that appear most often.\n")[-1].split("\nQuestion:")[0]
    )
    assert len(sample.references) == 10 and len(counts) > 20
    # below 4096 tokens RULER repeats the common words 6 times and the others once
    assert {w: c for w, c in counts.items() if c > 1} == dict.fromkeys(sample.references, 6)
    example = text.split("Memorize the ones that appear most often.\n")[1].split("\nQuestion:")[0]
    assert sorted(cwe_counts(example).values()) == [1] * 10 + [3] * 10


def test_cwe_at_4096_uses_the_official_repeats(tokenizer):
    sample = make_sample("cwe", tokenizer, 4096, random.Random(0))
    text = user_turn(tokenizer, sample)
    counts = cwe_counts(
        text.split("Memorize the ones that appear most often.\n")[-1].split("\nQuestion:")[0]
    )
    assert {w: c for w, c in counts.items() if c == 30} == dict.fromkeys(sample.references, 30)
    assert set(counts.values()) == {30, 3}


@pytest.mark.parametrize("length", LENGTHS)
def test_fwe_references_are_the_three_most_frequent_coded_words(samples, tokenizer, length):
    sample = samples["fwe", length]
    text = user_turn(tokenizer, sample)
    words = (
        text.split("Find the three most frequently appeared coded words. ")[1]
        .split("\nQuestion:")[0]
        .split(" ")
    )
    counts = Counter(words)
    assert counts.most_common(1)[0][0] == "..."  # rank 1 is the noise the question says to ignore
    del counts["..."]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)
    ranked = [c for _, c in counts.most_common()]
    assert {w for w, _ in counts.most_common(3)} == set(sample.references)
    assert min(counts[w] for w in sample.references) > ranked[3]


def test_same_seed_same_samples(tokenizer):
    for task in TASKS:
        first, again = (make_sample(task, tokenizer, 1024, random.Random(7)) for _ in range(2))
        assert first == again
        other = make_sample(task, tokenizer, 1024, random.Random(8))
        assert other.prompt_tokens != first.prompt_tokens
    rng = random.Random(7)  # consecutive samples from one generator differ
    assert (
        make_sample("vt", tokenizer, 1024, rng).references
        != make_sample("vt", tokenizer, 1024, rng).references
    )


def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 100
    assert string_match_all("The numbers are 123 and 45.", ["123", "456"]) == 50
    assert string_match_all(
        "APPLE-PIE, Banana", ["apple-pie", "banana", "cherry"]
    ) == pytest.approx(200 / 3)
    assert string_match_all("", ["x"]) == 0


def test_largest_fitting():
    assert largest_fitting(lambda n: 3 * n + 5, 100, lo=1) == 31
    assert largest_fitting(lambda n: 3 * n + 5, 100, lo=1, most=10) == 10
    assert largest_fitting(lambda n: 3 * n + 5, 8, lo=1) == 1
    with pytest.raises(ValueError):
        largest_fitting(lambda n: 3 * n + 5, 7, lo=1)


class FakeRunner:
    """Replies from what make_sample returned for the prompt: full answers all references (upper
    case),
    kivi-1bit only the first and only in a task's first sample (of two), streaming nothing."""

    chat = True

    def __init__(self, tokenizer, methods, references_of):
        self.tokenizer, self.methods, self.references_of = tokenizer, methods, references_of
        self.calls = []

    def run(self, prompt_tokens, max_new_tokens):
        self.calls.append(max_new_tokens)
        refs = self.references_of[tuple(prompt_tokens)]
        first_sample = len(self.calls) % 2 == 1
        replies = {
            "full": " and ".join(refs).upper(),
            "kivi-1bit": f"It is {refs[0]}." if first_sample else "?",
            "streaming": "",
        }
        return {
            m: SimpleNamespace(text=replies[m], tokens=[1, 2], fast_tier_bytes=10, stats={})
            for m in self.methods
        }


@pytest.fixture
def fake_cli(monkeypatch, tokenizer, tmp_path):
    """ruler.main with the fake runner; returns (run(argv) -> runner, out dir)."""
    references_of = {}

    def recording_make_sample(*args, **kwargs):
        sample = make_sample(*args, **kwargs)
        references_of[tuple(sample.prompt_tokens)] = sample.references
        return sample

    runners = []
    monkeypatch.setattr(ruler, "make_sample", recording_make_sample)
    monkeypatch.setattr(
        ruler,
        "runner_from_args",
        lambda args: (
            runners.append(FakeRunner(tokenizer, args.methods, references_of)) or runners[-1]
        ),
    )

    def run(*argv):
        ruler.main([*argv, "--methods", "full", "kivi-1bit", "streaming", "--out", str(tmp_path)])
        return runners[-1]

    return run, tmp_path


def test_cli_tables_and_report(fake_cli, capsys):
    run, out = fake_cli
    runner = run("--lengths", "1024", "--samples", "2", "--tasks", "niah_single_1", "cwe", "fwe")
    assert runner.calls == [128, 128, 120, 120, 50, 50]
    printed = capsys.readouterr().out
    markdown = (out / "ruler.md").read_text()
    for text in (printed, markdown):
        assert "| method | niah_single_1 | cwe | fwe | average |" in text
        assert "| full | 100.0 | 100.0 | 100.0 | 100.0 |" in text
        # one of 1, 10 and 3 references found in one sample of two: 50, 5, 16.7; their mean 23.9
        assert "| kivi-1bit | 50.0 | 5.0 | 16.7 | 23.9 |" in text
        assert "| streaming | 0.0 | 0.0 | 0.0 | 0.0 |" in text
    raw = json.loads((out / "ruler.json").read_text())
    assert raw["scores"]["1024"]["kivi-1bit"]["average"] == pytest.approx((50 + 5 + 50 / 3) / 3)
    assert len(raw["samples"]) == 6
    cwe_row = next(r for r in raw["samples"] if r["task"] == "cwe")
    assert len(cwe_row["references"]) == 10 and cwe_row["outputs"]["kivi-1bit"]["score"] == 10
    assert cwe_row["outputs"]["kivi-1bit"]["text"] == f"It is {cwe_row['references'][0]}."

    run("--lengths", "1024", "2048", "--quick", "--tasks", "vt")
    markdown = (out / "ruler.md").read_text()
    assert (
        "RULER at 1024 tokens (1 sample per task" in markdown and "RULER at 2048 tokens" in markdown
    )
    assert len(json.loads((out / "ruler.json").read_text())["samples"]) == 2


def test_cli_samples_depend_only_on_seed_task_and_length(fake_cli):
    run, out = fake_cli

    def references():
        return [
            r["references"]
            for r in json.loads((out / "ruler.json").read_text())["samples"]
            if r["task"] == "fwe"
        ]

    run("--lengths", "1024", "--samples", "2", "--tasks", "fwe", "--seed", "3")
    alone = references()
    run("--lengths", "1024", "--samples", "2", "--tasks", "vt", "fwe", "--seed", "3")
    assert references() == alone and alone[0] != alone[1]
    run("--lengths", "1024", "--samples", "2", "--tasks", "fwe", "--seed", "4")
    assert references() != alone
    run("--lengths", "1024", "--samples", "1", "--tasks", "niah_single_1", "niah_single_2")
    single_1, single_2 = (
        r["references"] for r in json.loads((out / "ruler.json").read_text())["samples"]
    )
    assert single_1 != single_2  # tasks draw their own needles, not one shared sequence


def test_resume_runs_the_samples_not_done_and_draws_the_same_ones(fake_cli, monkeypatch):
    run, out = fake_cli
    argv = ("--lengths", "1024", "--samples", "2", "--tasks", "niah_single_1", "fwe")
    run(*argv)
    whole = json.loads((out / "ruler.json").read_text())["samples"]
    assert not (out / "ruler.partial.jsonl").exists()  # removed with the report written

    answer = FakeRunner.run

    def stopped_after_three(self, prompt_tokens, max_new_tokens):
        if len(self.calls) == 3:
            raise KeyboardInterrupt
        return answer(self, prompt_tokens, max_new_tokens)

    with monkeypatch.context() as patch:
        patch.setattr(FakeRunner, "run", stopped_after_three)
        with pytest.raises(KeyboardInterrupt):
            run(*argv)
    with pytest.raises(SystemExit, match=r"other settings \(seed\)"):
        run(*argv, "--resume", "--seed", "5")
    runner = run(*argv, "--resume")
    assert runner.calls == [50]  # the second fwe sample alone
    resumed = json.loads((out / "ruler.json").read_text())["samples"]
    assert resumed[:3] == whole[:3]
    # The fourth sample was drawn after the three taken from the log: the same one as before.
    assert [r["references"] for r in resumed] == [r["references"] for r in whole]
    assert resumed[3]["prompt_tokens"] == whole[3]["prompt_tokens"]


def test_selection_tables_average_each_method_s_statistics_over_the_samples():
    def sample(length, rate, fetched, coverage):
        diagnostics = dict(
            coverage=coverage, oracle_coverage=1.0, recall_own_lowbit=0.5, recall_exact=0.25
        )
        stats = dict(
            speculative_match_rate=rate,
            bytes_fetched_per_token=fetched,
            diagnostics=diagnostics,
        )
        return dict(length=length, outputs=dict(full=dict(stats={}), ours=dict(stats=stats)))

    rows = [sample(1024, 0.5, 1000.0, 0.8), sample(1024, 1.0, 3000.0, 0.6)]
    rows.append(sample(2048, 0.2, 5000.0, 0.4))
    text = selection_tables(rows, ["full", "ours"])
    _, at_1024, at_2048 = text.split("SpeCache's selection")
    assert at_1024.startswith(" at 1024 tokens") and at_2048.startswith(" at 2048 tokens")
    assert "| method | spec. token right | fetched kB/token | coverage |" in at_1024
    assert "| full | - | - | - | - | - | - |" in at_1024
    assert "| ours | 75% | 2 | 70% | 100% | 50% | 25% |" in at_1024
    assert "| ours | 20% | 5 | 40% | 100% | 50% | 25% |" in at_2048
    no_specache = [dict(length=1024, outputs=dict(full=dict(stats={})))]
    assert selection_tables(no_specache, ["full"]) == ""
