"""generate.py's command line: every bad input is one clear line on stderr and exit code 2."""

import json
import pickle
import shutil

import pytest
import torch

from conftest import make_tiny_hf_model
import generate as generate_module
from generate import main
from convert import convert_hf_checkpoint


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(code, err, *fragments):
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, lines[-1])


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model("llama-gqa").save_pretrained(directory)
    convert_hf_checkpoint(directory)
    return directory


def test_missing_checkpoint(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--checkpoint", str(tmp_path / "nope" / "model.pth"))
    assert_one_line_error(code, err, "not found")


def test_debug_raises_with_the_traceback_instead(tmp_path):
    with pytest.raises(generate_module.UserError, match="not found"):
        main(["--checkpoint", str(tmp_path / "nope" / "model.pth"), "--debug"])


def test_directory_without_model_pth(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--checkpoint", str(tmp_path))
    assert_one_line_error(code, err, "has no model.pth", "convert_hf_checkpoint.py")


def test_truncated_checkpoint(capsys, tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    data = (tiny_checkpoint / "model.pth").read_bytes()
    (tmp_path / "model.pth").write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(capsys, "--checkpoint", str(tmp_path / "model.pth"))
    assert_one_line_error(code, err, "truncated or corrupt")


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickle_with_code_is_refused_not_executed(capsys, tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    torch.save({"x": Payload()}, tmp_path / "model.pth", pickle_protocol=pickle.HIGHEST_PROTOCOL)
    code, out, err = run_cli(capsys, "--checkpoint", str(tmp_path / "model.pth"))
    assert_one_line_error(code, err, "weights_only")
    assert "this must never run" not in out + err


def test_config_that_contradicts_the_weights_names_the_tensor(capsys, tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "model.pth", tmp_path)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "--checkpoint", str(tmp_path / "model.pth"))
    assert_one_line_error(code, err, "layers.0.feed_forward.w1.weight", "(96, 64)", "(128, 64)")


def test_missing_tensor_is_named(capsys, tiny_checkpoint, tmp_path):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    state = torch.load(tiny_checkpoint / "model.pth", weights_only=True)
    del state["layers.1.ffn_norm.weight"]
    torch.save(state, tmp_path / "model.pth")
    code, _, err = run_cli(capsys, "--checkpoint", str(tmp_path / "model.pth"))
    assert_one_line_error(code, err, "layers.1.ffn_norm.weight")


def test_tokenizer_from_another_model(capsys, tiny_checkpoint, smollm2_checkpoint, tmp_path):
    for name in ("model.pth", "config.json"):
        shutil.copy(tiny_checkpoint / name, tmp_path)
    shutil.copy(smollm2_checkpoint.parent / "tokenizer.json", tmp_path)
    code, _, err = run_cli(capsys, "--checkpoint", str(tmp_path / "model.pth"))
    assert_one_line_error(code, err, "49152 tokens", "97")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--max_new_tokens", "0"], "--max_new_tokens"),
        (["--max_new_tokens", "-3"], "--max_new_tokens"),
        (["--device", "tpu"], "--device"),
        (
            ["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nonsense"],
            "--device",
        ),
        (["--temperature", "-1"], "--temperature"),
        (["--top_k", "0"], "--top_k"),
        (["--batch_size", "0"], "--batch_size"),
        (["--prompt", ""], "empty"),
    ],
)
def test_bad_arguments(capsys, argv, fragment):
    code, _, err = run_cli(capsys, *argv)
    assert_one_line_error(code, err, fragment)


def test_prompt_files(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    code, _, err = run_cli(capsys, "--prompt_file", str(tmp_path / "empty.txt"))
    assert_one_line_error(code, err, "empty")
    code, _, err = run_cli(capsys, "--prompt_file", str(tmp_path / "missing.txt"))
    assert_one_line_error(code, err, "not found")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    code, _, err = run_cli(capsys, "--prompt_file", str(tmp_path / "latin1.txt"))
    assert_one_line_error(code, err, "not UTF-8")


def test_prompt_longer_than_max_seq_length(capsys, smollm2_checkpoint):
    code, _, err = run_cli(capsys, "--prompt", "word " * 50, "--max_seq_length", "20")
    assert_one_line_error(code, err, "--max_seq_length 20")


def test_generation_stops_at_max_seq_length_with_a_note(capsys, smollm2_checkpoint):
    code, out, err = run_cli(
        capsys,
        "--prompt",
        "One, two, three,",
        "--max_seq_length",
        "10",
        "--max_new_tokens",
        "50",
        "--temperature",
        "0",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    room = 10 - result["prompt_tokens"][0]
    assert f"leaves room for {room} new tokens" in err
    assert result["new_tokens"] == [room]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--specache", "--specache_bits", "3"], "bits must be 1 or 2"),
        (["--specache", "--specache_group", "48"], "multiple of the group size"),
        (["--specache", "--specache_topk", "-1"], "top-k must be >= 0"),
        (["--cache", "turbo"], "unknown --cache"),
        (["--specache", "--cache", "kivi"], "contradicts"),
        (["--cache", "streaming", "--budget_tokens", "4"], "sink tokens"),
        (["--cache", "h2o", "--budget_tokens", "1"], "at least 2"),
        (["--specache", "--budget_tokens", "100"], "--budget_tokens applies to"),
        (
            ["--specache", "--specache_select", "sideways"],
            "unknown --specache_select entry 'sideways'",
        ),
        (["--specache", "--specache_select", "split=1.5"], "share of k must be in [0, 1]"),
    ],
)
def test_bad_specache_settings(capsys, argv, fragment):
    code, _, err = run_cli(capsys, *argv, "--max_new_tokens", "2")
    assert_one_line_error(code, err, fragment)


def test_top_k_beyond_the_context_is_clamped_with_a_note(capsys, smollm2_checkpoint):
    code, out, err = run_cli(
        capsys,
        "--specache",
        "--specache_topk",
        "500",
        "--prompt",
        "Hello there",
        "--max_new_tokens",
        "3",
        "--temperature",
        "0",
        "--json",
    )
    assert code == 0, err
    # two tokens of prompt: everything stays 16-bit in the window, nothing is quantized or fetched
    assert "clamped to 0" in err and "Traceback" not in err
    result = json.loads(out)
    assert result["topk"] == 0 and result["fast_tier_ratio_to_16bit_cache"] == 1.0


def test_specache_refuses_head_dims_that_do_not_fill_bytes(capsys, smollm2_checkpoint, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    # head_dim 20: 20 bits a token at 1 bit, 40 at 2
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=80,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    convert_hf_checkpoint(tmp_path)
    shutil.copy(smollm2_checkpoint.parent / "tokenizer.json", tmp_path)
    code, _, err = run_cli(
        capsys, "--checkpoint", str(tmp_path), "--specache", "--max_new_tokens", "2"
    )
    assert_one_line_error(code, err, "head_dim is 20")
    code, _, err = run_cli(
        capsys,
        "--checkpoint",
        str(tmp_path),
        "--specache",
        "--specache_bits",
        "2",
        "--specache_group",
        "20",
        "--specache_residual",
        "40",
        "--max_new_tokens",
        "2",
    )
    assert code == 0, err


@pytest.mark.parametrize("cache", ["streaming", "h2o"])
def test_eviction_caches_run_and_report_their_budget(capsys, smollm2_checkpoint, cache):
    code, out, err = run_cli(
        capsys,
        "--cache",
        cache,
        "--prompt",
        "The capital of France is",
        "--max_new_tokens",
        "4",
        "--temperature",
        "0",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    # The default budget is SpeCache 1-bit's fast tier at this length: the whole short prompt fits,
    # so the answer is the full cache's.
    assert result["cache"] == cache and result["budget_tokens"] >= result["prompt_tokens"][0] + 4
    assert "Paris" in result["texts"][0]


@pytest.mark.parametrize(
    "extra", [[], ["--batch_size", "2"], ["--json"], ["--specache", "--batch_size", "2"]]
)
def test_ctrl_c_during_decode_prints_what_was_generated(
    capsys, smollm2_checkpoint, monkeypatch, extra
):
    argv = ["--prompt", "One, two, three,", "--temperature", "0", *extra]
    code, whole, err = run_cli(capsys, *argv, "--max_new_tokens", "4")
    assert code == 0, err

    def interrupt_after_four_tokens(real):
        def wrapped(*args, callback, **kwargs):
            seen = []

            def ctrl_c(tokens):
                callback(tokens)
                seen.append(tokens)
                if len(seen) == 4:
                    raise KeyboardInterrupt

            return real(*args, callback=ctrl_c, **kwargs)

        return wrapped

    monkeypatch.setattr(
        generate_module, "generate", interrupt_after_four_tokens(generate_module.generate)
    )
    code, out, err = run_cli(capsys, *argv, "--max_new_tokens", "50")
    assert code == 130 and "[interrupted]" in err and "Traceback" not in err
    if "--json" in extra:
        partial, finished = json.loads(out), json.loads(whole)
        assert partial["interrupted"] and partial["texts"] == finished["texts"]
    else:
        assert out.strip() == whole.strip()


def test_repeated_samples_report_the_same_generation(capsys, smollm2_checkpoint, tmp_path):
    """--num_samples 3 of a batch of two copies, greedy, k below the context and window flushes on
    the way: six identical texts and three identical cache summaries (a leak from one generation
    into the next changed them)."""
    from scripts.eval.haystack import essays_dir

    essay = sorted(essays_dir().glob("*.txt"))[0].read_text(encoding="utf-8")[:2500]
    prompt = essay + "\n\nIn one sentence, what is this essay about?"
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    code, out, err = run_cli(
        capsys,
        "--specache",
        "--prompt_file",
        str(tmp_path / "prompt.txt"),
        "--temperature",
        "0",
        "--num_samples",
        "3",
        "--specache_topk",
        "16",
        "--specache_group",
        "32",
        "--specache_residual",
        "32",
        "--max_new_tokens",
        "40",
        "--batch_size",
        "2",
    )
    assert code == 0, err
    summaries = [line for line in err.splitlines() if line.startswith("specache 1-bit")]
    assert len(summaries) == 3 and len(set(summaries)) == 1, summaries
    # each sequence prints the prompt, then its text
    generated = [text.strip() for text in out.split(prompt)[1:]]
    assert len(generated) == 6 and len(set(generated)) == 1 and generated[0]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (
            ["--slow_tier", "disk"],
            "--slow_tier and --slow_tier_dir apply to SpeCache, not --cache full",
        ),
        (["--cache", "kivi", "--slow_tier", "disk"], "not --cache kivi"),
        (["--specache", "--slow_tier_dir", "/tmp"], "--slow_tier_dir needs --slow_tier disk"),
    ],
)
def test_slow_tier_flags_that_do_not_apply(capsys, tiny_checkpoint, argv, fragment):
    code, _, err = run_cli(capsys, "--checkpoint", str(tiny_checkpoint), "--prompt", "hi", *argv)
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--specache", "--full_16bit"], "--full_16bit applies to --cache full, not specache"),
        (["--compile_per_block"], "--compile_per_block goes with --compile"),
    ],
)
def test_full_cache_and_compile_flags_that_do_not_apply(capsys, tiny_checkpoint, argv, fragment):
    code, _, err = run_cli(capsys, "--checkpoint", str(tiny_checkpoint), *argv)
    assert_one_line_error(code, err, fragment)


def test_full_16bit_reports_a_float16_cache(capsys, smollm2_checkpoint):
    code, out, err = run_cli(
        capsys,
        "--checkpoint",
        str(smollm2_checkpoint),
        "--full_16bit",
        "--json",
        "--temperature",
        "0",
        "--max_new_tokens",
        "4",
    )
    assert code == 0, err
    assert '"kv_dtype": "torch.float16"' in out  # SpeCache's 16-bit pair type beside float32


def test_cache_capacity_rounds_only_compiled_steps():
    """A compiled step is a graph per capacity: rounded up to a multiple of 1024 so that similar
    prompts share one, never below what is needed nor past the model's context to get there."""
    assert generate_module.cache_capacity(1500, False, 8192) == 1500
    assert generate_module.cache_capacity(1500, True, 8192) == 2048
    assert generate_module.cache_capacity(1024, True, 8192) == 1024
    assert generate_module.cache_capacity(8000, True, 8192) == 8192
    assert generate_module.cache_capacity(9000, True, 8192) == 9000


@pytest.mark.parametrize(
    "extra, expected",
    [([], "needed"), (["--compile"], 1024), (["--compile", "--max_seq_length", "300"], 300)],
)
def test_generate_sizes_the_cache_by_cache_capacity(
    monkeypatch, smollm2_checkpoint, extra, expected
):
    """generate.py's cache: what the prompt and new tokens need; with --compile rounded up; with
    --max_seq_length as given."""
    seen = []
    monkeypatch.setattr(
        generate_module,
        "cache_from_args",
        lambda args, model, batch, capacity, *rest: seen.append(capacity),
    )
    args = generate_module.build_parser().parse_args(
        [
            "--checkpoint",
            str(smollm2_checkpoint),
            "--prompt",
            "hello there",
            "--max_new_tokens",
            "5",
            *extra,
        ]
    )
    _, _, _, prompts, _, _ = generate_module.prepare(
        args, torch.device("cpu"), torch.float32, lambda *a: None
    )
    assert seen == [len(prompts[0]) + 5 if expected == "needed" else expected]


def test_specache_flags_are_the_settings_dataclasses():
    """--specache_* and --specache_select are made from specache.Method's and Selection's fields
    (specache/config.py): each setting's default and name is written once. A flag written by hand
    with its own default, or a selection name the help leaves out, fails here."""
    from dataclasses import fields

    from specache import VARIANTS, Method, Selection

    parser = generate_module.build_parser()
    args = parser.parse_args([])
    for setting in fields(Method):
        if setting.name != "speculative":  # the cache's kind says that: specache-nospec
            assert getattr(args, f"specache_{setting.name}") == setting.default, setting.name
    assert Selection.parse(args.specache_select) == Selection()
    help_text = " ".join(parser.format_help().split())
    for name in VARIANTS:
        assert name in help_text, name
    for name, (field_name, _, number) in VARIANTS.items():
        if number is not None:
            assert f"{name}[={number.__name__}]" in help_text
            assert Selection.parse(f"{name}=0").__dict__[field_name] == 0
