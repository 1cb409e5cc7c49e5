"""Assemble docs/RESULTS.md from the evaluation reports in docs/results/.

    python scripts/results/results_page.py        # rebuild the page from the reports already there
    python scripts/results/results_page.py --run  # rerun every evaluation first (defaults; ~1 h \
        on a 2-core CPU)

Each report (`{name}.md`) starts with the command that produced it; needle.py, ruler.py,
longbench.py, bench.py and long_run.py write them (scripts/eval/harness.py: write_report).
"""

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
from results_fidelity import DEFAULT, DEFAULT_SUMMARY, OTHER_RANKINGS, OTHER_RANKINGS_SUMMARY
from results_brief import BRIEF
from results_sections import PARTS, SELECTION, SELECTION_SUMMARY

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def page() -> str:
    parts = [
        "# Results\n",
        "Measured on this project's CPU box (2 cores, no GPU) with the default model, "
        "SmolLM2-135M-Instruct "
        "(fp32), which retrieves reliably only up to about 4k tokens, and, in the Gemma-3 sections "
        "at the "
        "end, Gemma-3-270M (8k-32k). Every table below was written by the "
        "command above it; `python scripts/results/results_page.py` rebuilds this page from those "
        "reports "
        f"(last built with torch {torch.__version__}, Python {platform.python_version()}).\n",
        "Methods: `full` is the full cache in the model's dtype (16-bit on a GPU, float32 on a CPU "
        "unless a "
        "table says otherwise), `full-16bit` the full cache in 16 bits (float16 beside a float32 "
        "model); `specache-Nbit` is SpeCache (k = 64 exact pairs, g = 64, "
        "R = 64) with our selection, `specache-Nbit:paper` with the paper's. Our selection "
        "includes the shortlist since 'The shortlist as the default', the first section after "
        "'In brief'; every later section was measured before (the serving part says which of "
        "its runs were not), so there `specache-Nbit` is ours without it, what "
        "`specache-Nbit:default,shortlist=0` names now, and `specache-Nbit:default,shortlist` is "
        "today's default (under 'Before the selection changed', at the end, it is the paper's "
        "rule). `kivi-Nbit` is the "
        "same low-bit copy and window with nothing fetched; `streaming` "
        "(StreamingLLM) and `h2o` keep as many 16-bit tokens as fit in SpeCache 1-bit's fast-tier "
        "bytes. "
        "'fast tier (x 16-bit)' is the fast-tier KV bytes over a 16-bit cache of the same "
        "length.\n",
    ]
    parts += BRIEF
    parts.append(DEFAULT_SUMMARY)
    parts += [section(*entry, level=3) for entry in DEFAULT]
    parts.append(OTHER_RANKINGS_SUMMARY)
    parts += [section(*entry, level=3) for entry in OTHER_RANKINGS]
    parts += [SELECTION_SUMMARY, ablation()]
    parts += [section(*entry, level=3) for entry in SELECTION]
    for summary, entries in PARTS:
        parts.append(summary)
        parts += [section(*entry, level=3) for entry in entries]
    return "\n".join(parts)


def ablation() -> str:
    """One row per selection: needles found, RULER averages and bytes, from the JSON beside the
    reports."""
    needle_file, ruler_file = (
        RESULTS / "selection" / "needle.json",
        RESULTS / "selection" / "ruler.json",
    )
    if not (needle_file.is_file() and ruler_file.is_file()):
        return ""
    needle, ruler = json.loads(needle_file.read_text()), json.loads(ruler_file.read_text())
    methods = list(dict.fromkeys(row["method"] for row in needle["rows"]))
    methods += [m for m in next(iter(ruler["scores"].values())) if m not in methods]
    lengths = list(ruler["scores"])
    header = (
        "| method | needle found | "
        + " | ".join(f"RULER {int(n) // 1024}k" for n in lengths)
        + " | fast tier (x 16-bit) | 16-bit kB read per token |"
    )
    lines = [
        "### At a glance\n",
        "From the needle sweep and RULER below (same runs): needles found of "
        f"{len({(r['length'], r['depth']) for r in needle['rows']})}, RULER averages, and, over "
        "the needle "
        "prompts, the fast tier's bytes over a 16-bit cache's and the 16-bit pairs read from the "
        "slow tier "
        "per token (means).\n",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for method in methods:
        rows = [r for r in needle["rows"] if r["method"] == method]
        found = f"{sum(r['found'] for r in rows)}/{len(rows)}" if rows else "-"
        rulers = [
            f"{ruler['scores'][n][method]['average']:.1f}" if method in ruler["scores"][n] else "-"
            for n in lengths
        ]
        stats = [r["stats"] for r in rows if "fast_tier_ratio_to_16bit_cache" in r["stats"]]
        ratio = f"{mean(s['fast_tier_ratio_to_16bit_cache'] for s in stats):.3f}" if stats else "1"
        fetched = f"{mean(s['bytes_fetched_per_token'] for s in stats) / 1e3:.0f}" if stats else "-"
        lines.append(f"| {method} | {found} | " + " | ".join(rulers) + f" | {ratio} | {fetched} |")
    return "\n".join(lines) + "\n"


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def section(name: str, title: str, script: str, blurb: str, level: int) -> str:
    """A report under its heading, its images' links made relative to the page."""
    report = RESULTS / f"{name}.md"
    text = f"{'#' * level} {title}\n\n{blurb}\n\n"
    if not report.is_file():
        return text + f"Not measured on this machine yet: run `python {script}`.\n"
    folder = "results/" + (name.rsplit("/", 1)[0] + "/" if "/" in name else "")
    return text + report.read_text(encoding="utf-8").replace("](", f"]({folder}") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run", action="store_true", help="rerun needle.py and ruler.py (default settings) first"
    )
    args = parser.parse_args()
    if args.run:
        for script in ("scripts/eval/needle.py", "scripts/eval/ruler.py"):
            subprocess.run([sys.executable, str(ROOT / script)], check=True, cwd=ROOT)
    (ROOT / "docs" / "RESULTS.md").write_text(page(), encoding="utf-8")
    print(f"wrote {ROOT / 'docs' / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
