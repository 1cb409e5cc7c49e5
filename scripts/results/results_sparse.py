"""What docs/RESULTS.md says of issue 51's work, the sparse pass, the step's rankings and prefill in
bfloat16: their summaries and sections, as results_sections.py writes the others."""

RANKINGS_SUMMARY = (
    "## The step's rankings\n\nThe one op per layer ranks positions twice: the real row's list "
    "for the shortlist (n x the picks it places) and the last row's prefetch. With the shortlist "
    "the default, the first ranked 512 positions in a heap, which on a flat ranking took "
    "thousands of replacements and as many sifts again to give its entries in order; it now "
    "ranks the 256 the shortlist reads, with no heap (a floor from every 16th position, checked, "
    "then a radix sort of about k positions), and the prefetch's ranking bounds each block of 64 "
    "positions by its largest low-bit weight alone, the few positions with fetched or window "
    "probabilities ranked exactly first (docs/method.md#the-shortlist-ours). Same choices, "
    "torch.equal. In short, SmolLM2 int4 compiled, same command before and after (the box's "
    "load moves single rows): the op's share of a step fell from 14.2 to 9.7 ms at 4k and from "
    "46.7 to 22.3 ms at 16k, where it now takes about the full cache's attention (19.0 ms). "
    "Decode over our fastest full cache: 0.56x at 4k and 0.81x at 16k with the float pass "
    "(0.51x and 0.63x earlier the same day), 0.58x and 0.95x with the sparse pass; eager, "
    "0.53x and 0.75x. Still below the issue's targets: at 4k what is left is the rankings, the "
    "shortlist's 256 scattered keys a KV head and the Python around the op; at 16k the float "
    "pass itself (about 6 vector operations per position and row, 6 rows a KV head).\n"
)
RANKINGS = [
    (
        "rankings/profile_before/profile",
        "SmolLM2-135M: where a compiled step's time went, before",
        "scripts/bench/profile_step.py --lengths 4096 16384 --methods full-16bit specache-1bit "
        "--steps 20 ...",
        "Before the rankings changed (commit e93fa30), int4 weights.",
    ),
    (
        "rankings/profile/profile",
        "SmolLM2-135M: where a compiled step's time goes, after",
        "scripts/bench/profile_step.py --lengths 4096 16384 --methods full-16bit specache-1bit "
        "--steps 20 ...",
        "The same command after: the SpeCache op is 9.7 ms of a 4k step (14.2 before) and 22.3 "
        "ms of a 16k one (46.7).",
    ),
    (
        "rankings/bench/bench",
        "SmolLM2-135M: decode speed after the rankings changed, compiled",
        "scripts/bench/bench.py --lengths 4096 16384 --methods full-16bit specache-1bit "
        "specache-1bit:int8 specache-1bit:sparse ...",
        "Int4 weights, compiled, batch 1, one run (the int8 row at 16k is slower than the float "
        "one here, faster in every other run: the box's load).",
    ),
    (
        "rankings/bench_eager/bench",
        "SmolLM2-135M: decode speed after the rankings changed, eager",
        "scripts/bench/bench.py --eager --lengths 4096 16384 --methods full-16bit specache-1bit "
        "specache-1bit:int8 specache-1bit:sparse ...",
        "As generate.py decodes by default: the Python around the op (the correction's cosines, "
        "the prefetch's reuse, the window's and the tier's writes: about 13 ms of a 4k step under "
        "cProfile) costs more than the op saves.",
    ),
    (
        "step_fold/ab",
        "SmolLM2-135M: eager decode with the prefetch's check and count in the op",
        "scripts/bench/bench.py --eager --lengths 4096 --methods full-16bit specache-1bit ... "
        "(in a checkout before and one after)",
        "The op now also computes correct's cosines and the pairs read (the prefetch's net of "
        "what the previous one held), and the window's and tier's appends skip their row "
        "indexing when every row moves: a layer's eager step dispatches 36 aten ops around the "
        "op instead of 72. Eight pairs of runs alternated at 4k: the median ratio to the full "
        "cache rose from 0.58x to 0.63x, within a box whose load moves single runs by 10-20%.",
    ),
]
SPARSE_SUMMARY = (
    "## The sparse pass\n\nThe low-bit pass with the integer pass's scores and a sparse value "
    "mix (`--specache_arithmetic sparse`, docs/method.md#the-sparse-pass-ours-an-option): "
    "positions below e^-tau of every row's largest weight take their key group's mean value. "
    "In short: on the default model's own decode queries the attention error with the default "
    "selection is unchanged at tau 6 while the pass mixes by value 11.6% of the low-bit "
    "positions at 16k (47.5% at 4k); the needles' replies are the float pass's, all 20, and "
    "RULER 4k scores the same on every task, though 3 of 22 replies differ in words. The "
    "kernel alone takes 0.48-0.81x the integer pass's time where 5-9% are kept (4-10x its DRAM "
    "floor: the integer scores and the exponentials still touch every position and row), and "
    "up to 1.35x where attention is flat (random keys keep 72-85%). In decode it moves little: "
    "with the default selection the step reads its shortlist's 8 x k pairs exactly and the "
    "pass is no longer most of it, so SmolLM2 decodes at 0.52-0.64x our fastest full cache "
    "with it, 0.61-0.67x with the integer pass and 0.45-0.58x with the float one (one run, a "
    "loaded box). It stays an option.\n"
)
SPARSE = [
    (
        "sparse/study16k/selection_study",
        "SmolLM2-135M: the sparse mix's error and what it keeps, 16k",
        "scripts/eval/selection_study.py --length 16384 --taus 3 4 5 6 8 ...",
        "The default selection's exact pairs (the shortlist), the rest of the low-bit segment "
        "mixed as the sparse pass mixes it, against exact attention on the model's own decode "
        "queries (float copy scores; the pass's integer scores differ by rounding).",
    ),
    (
        "sparse/study4k/selection_study",
        "SmolLM2-135M: the sparse mix's error and what it keeps, 4k",
        "scripts/eval/selection_study.py --length 4096 --taus 2 3 4 6 8 12 ...",
        "The same at 4k over three RULER tasks: attention over fewer positions is flatter, so "
        "each tau keeps more.",
    ),
    (
        "sparse/kernel",
        "The sparse pass alone against its DRAM floor",
        "scripts/bench/bench_lowbit_cpu.py --lengths 16384 32768 --repeats 3 --tau 8 [--peaked]",
        "Per layer of a step's worth of layers (from DRAM): the float, integer and sparse "
        "kernels and the floor, on random keys and values (flat attention) and with the rows "
        "scaled up (peaked, as a trained model's at long context).",
    ),
    (
        "sparse/needle/needle",
        "SmolLM2-135M: needle with the sparse pass",
        "scripts/eval/needle.py --methods specache-1bit specache-1bit:sparse ...",
        "Our selection at 1 bit, the float pass against the sparse one (tau 6), same prompts: "
        "every reply the same.",
    ),
    (
        "sparse/needle_gemma3/needle",
        "Gemma-3-270M: needle at 8k-32k with the sparse pass",
        "scripts/eval/needle.py --checkpoint checkpoints/google/gemma-3-270m/model.pth "
        "--lengths 8192 16384 32768 --depths 0 50 100 --methods specache-1bit "
        "specache-1bit:sparse ...",
        "Our selection at 1 bit, the float pass against the sparse one (tau 6), same prompts: "
        "all 9 replies identical, the one miss (32k) missed by both.",
    ),
    (
        "sparse/ruler_gemma3/ruler",
        "Gemma-3-270M: RULER at 16k with the sparse pass",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "16384 --samples 2 --methods specache-1bit specache-1bit:sparse ...",
        "Two samples per task, eager: every score is the float pass's, and 21 of the 22 "
        "replies are identical (95%; the one that differs, cwe, is wrong in both).",
    ),
    (
        "sparse/ruler/ruler",
        "SmolLM2-135M: RULER at 4k with the sparse pass",
        "scripts/eval/ruler.py --lengths 4096 --samples 2 --compile --methods specache-1bit "
        "specache-1bit:sparse ...",
        "Two samples per task, compiled (a run begun at six samples per task, stopped after "
        "three tasks for time and resumed at two: those three tasks' other four samples, not "
        "shown, were identical too). Every score is the float pass's; 19 of the 22 replies are "
        "identical, and the three that differ (multikey_3, multiquery, cwe) are wrong in "
        "both. Over all 34 samples run, 31 identical "
        "(91%): below the 95% the default must keep, so the sparse pass stays an option.",
    ),
    (
        "sparse/bench/bench",
        "SmolLM2-135M: decode speed with the sparse pass",
        "scripts/bench/bench.py --checkpoint ... --methods full full-16bit specache-1bit "
        "specache-1bit:int8 specache-1bit:sparse ...",
        "Int4 weights, compiled, batch 1, one run; the default selection reads its shortlist "
        "(fetched kB/token). SpeCache's rows are slower than in the earlier sections, which "
        "were measured before the shortlist became the default.",
    ),
]

PREFILL_SUMMARY = (
    "## Prefill in bfloat16\n\n`--prefill_dtype bfloat16` (docs/cli.md, 'Prefill in bfloat16') "
    "runs prefill's matrix products in bfloat16 under torch.autocast on this CPU's native "
    "AVX512-BF16, the weights, caches, attention and logits in float32. In short: the first token "
    "of a 16k-token prompt comes 14% sooner with the full cache and 9% sooner with SpeCache 1-bit "
    "(attention, still float32, is most of a 16k prefill), and 2.0-2.4x sooner than llama.cpp's; "
    "the needles' replies and every RULER 4k score are the float32 prefill's, but 20% of RULER's "
    "replies differ in words, so it stays an option. The accuracy runs were made with the flag's "
    "first form, `--dtype auto`, which then meant what `--prefill_dtype bfloat16` means now.\n"
)
PREFILL = [
    (
        "bf16_prefill/prefill/prefill",
        "SmolLM2-135M: time to the first token of a 16k-token prompt",
        "scripts/bench/bench_prefill.py --chunks --prefill_dtypes model bfloat16 --llama_cpp",
        "One generate.py process per row, eager, one run (ratios within the table).",
    ),
    (
        "bf16_prefill/needle/compare",
        "SmolLM2-135M: needle 1k-4k, float32 prefill against bfloat16 products",
        "scripts/eval/compare_runs.py docs/results/bf16_prefill/needle_float32/needle.json "
        "docs/results/bf16_prefill/needle_bfloat16/needle.json ...",
        "Two needle.py runs (methods full and specache-1bit, 4 lengths x 5 depths), compared reply "
        "by reply: all 40 identical.",
    ),
    (
        "bf16_prefill/ruler/compare",
        "SmolLM2-135M: RULER 4k, float32 prefill against bfloat16 products",
        "scripts/eval/compare_runs.py docs/results/bf16_prefill/ruler_float32/ruler.json "
        "docs/results/bf16_prefill/ruler_bfloat16/ruler.json ...",
        "Two ruler.py runs (6 samples per task, compiled decode), compared reply by reply: the "
        "scores move by at most a fifth of an answer, but 26 of 132 replies differ (6 of 66 with "
        "the full cache, 20 of 66 with SpeCache 1-bit, whose choice of pairs amplifies a small "
        "change in the prompt's K and V).",
    ),
]
