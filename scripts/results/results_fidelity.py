"""docs/RESULTS.md's parts on fidelity: Qwen2.5-Coder, the copy's choice step by step, the
shortlist, the shortlist as the default, and the other rankings weighed beside it
(results_sections.py's format)."""

QWEN = [
    (
        "qwen/needle_8k/needle",
        "Qwen2.5-Coder-0.5B-Instruct: needle at 8k",
        "scripts/eval/needle.py --checkpoint "
        "checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 8000 ...",
        "The project's needle (Paul Graham's essays) at 5 depths, one prefill per cell shared by "
        "every method.",
    ),
    (
        "qwen/needle_16k/needle",
        "Qwen2.5-Coder-0.5B-Instruct: needle at 16k",
        "scripts/eval/needle.py --checkpoint "
        "checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 16000 ...",
        "The same at 16k.",
    ),
    (
        "qwen/ruler_8k/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 8k",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 8192 --quick ...",
        "One sample per task (about 30 min on this 2-core CPU); StreamingLLM at SpeCache 1-bit's "
        "fast-tier bytes.",
    ),
    (
        "qwen/ruler_8k_shortlist/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 8k, the shortlist",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 8192 --quick --methods specache-1bit:default,shortlist ...",
        "The same samples (seed 42) as the table above, in a second run.",
    ),
    (
        "qwen/needle_1.5b_16k/needle",
        "Qwen2.5-Coder-1.5B-Instruct: needle at 16k",
        "scripts/eval/needle.py --checkpoint "
        "checkpoints/Qwen/Qwen2.5-Coder-1.5B-Instruct/model.pth "
        "--lengths 16000 ...",
        "The larger model on the same needle: the full cache, our default at 1 bit and the "
        "shortlist.",
    ),
    (
        "qwen/ruler_16k/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 16k",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 16384 --quick ...",
        "One sample per task: the full cache, the paper's rule, ours at 1 and 2 bits and the "
        "shortlist.",
    ),
]
QWEN_SUMMARY = (
    "## Qwen2.5-Coder\n\nQwen2.5-Coder-0.5B-Instruct, converted from its GGUF "
    "(docs/models.md#qwen25-coder-a-32k-model-that-retrieves): the first sweeps of the fidelity "
    "issue. On this needle the 0.5B coder model itself is weak: the full cache finds 2 of 5 at "
    "8k and 1 of 5 at 16k, answering \"start a startup\" where the needle is a city walk, so "
    "this needle cannot separate the caches: at 8k the 2-bit copy keeps exactly the full "
    "cache's answers and every 1-bit method loses one, at 16k every method finds the same one. "
    "RULER's numeric needles it does retrieve: at 8k the full cache scores 69.8, our 1-bit "
    "selection 66.4 (0.95x) and with midway key levels 68.6 (0.98x), the paper's rule 49.4, "
    "KIVI 1-bit and StreamingLLM at the same bytes 3.0 (one sample per task); with the "
    "shortlist 67.6, the full cache's answer on every task but niah_multivalue. "
    "At 16k our 1-bit selection (then without the shortlist) falls to 61.4 against the full "
    "cache's 72.7 (0.84x; the paper's rule 48.5, ours at 2 bits 66.7), and the shortlist "
    "gives the full cache's answer on every task (72.7). "
    "Qwen2.5-Coder-1.5B-Instruct finds the needle at all 5 depths at 16k with the full cache, "
    "and so does our 1-bit selection, with and without the shortlist.\n"
)
STUDY_SUMMARY = (
    "## The copy's choice, step by step\n\nscripts/eval/selection_study.py "
    "(docs/evaluation.md#accuracy): each model's own decode queries on RULER samples, recorded "
    "with the full cache; every 4th step recomputed with the k exact positions chosen by the "
    "1-bit copy, by its top 8k ranked again by their exact keys (shortlist), by the exact "
    "top-k (an oracle) or none (KIVI), for each 1-bit level rule. "
    "'error' is the attention output's relative error, 'coverage' the share of the exact "
    "attention read exactly. The copy's coverage against the oracle's is what the ranking "
    "leaves.\n"
)
STUDY = [
    (
        f"selection/study/{folder}/selection_study",
        title,
        "scripts/eval/selection_study.py ...",
        "One sample per task; means over steps, full-attention layers and samples.",
    )
    for folder, title in (
        ("smollm2", "SmolLM2-135M-Instruct at 4k"),
        ("qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct at 8k"),
        ("gemma3", "Gemma-3-270M at 16k"),
    )
]
SHORTLIST_SUMMARY = (
    "## The shortlist\n\n`--specache_select default,shortlist` "
    "(docs/method.md#the-shortlist-ours): the real row reads the pairs of its copy's "
    "top 8 x picks and keeps those its exact keys weigh most. First Gemma-3-270M, where our "
    "default loses the full cache's answers, then SmolLM2's selection sweeps again, then what "
    "it costs a CPU's decode step: the fast tier is the same, the slow tier gives more pairs "
    "per token ('fetched kB/token').\n"
)
SHORTLIST = [
    (
        "gemma3/shortlist/needle",
        "Gemma-3-270M: needle at 8k-32k",
        "scripts/eval/needle.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "8000 "
        "16000 32000 ...",
        "The full cache, our default and the shortlist; completion prompts.",
    ),
    (
        "gemma3/shortlist/ruler_8k/ruler",
        "Gemma-3-270M: RULER at 8k",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "8192 "
        "--samples 2 ...",
        "Two samples per task.",
    ),
    (
        "gemma3/shortlist/ruler_16k/ruler",
        "Gemma-3-270M: RULER at 16k, our default and split=1",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "16384 "
        "--quick ...",
        "One sample per task. The real row choosing all k by the copy (`split=1`, no speculative "
        "half) loses the same answers as our default: the copy's ranking, not the speculation, "
        "misses them.",
    ),
    (
        "gemma3/shortlist/ruler_16k_shortlist/ruler",
        "Gemma-3-270M: RULER at 16k, the shortlist",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "16384 "
        "--quick ...",
        "The same samples (seed 42) as the table above, in a second run: the shortlist with "
        "Lloyd's and with midway key levels.",
    ),
    (
        "selection/shortlist/needle",
        "SmolLM2-135M: needle, 1k-4k x 5 depths, the shortlist",
        "scripts/eval/needle.py --stats --methods specache-1bit:default,shortlist ...",
        "The cells of the selection's needle sweep (at the top of this page), in a second run: "
        "the shortlist at 1 and 2 bits.",
    ),
    (
        "selection/shortlist/ruler",
        "SmolLM2-135M: RULER at 2k and 4k, the shortlist",
        "scripts/eval/ruler.py --lengths 2048 4096 --samples 2 --compile --methods "
        "specache-1bit:default,shortlist ...",
        "The samples (seed 42) of the selection's RULER tables, in a second run.",
    ),
    (
        "step/shortlist/bench",
        "SmolLM2-135M: decode speed with the shortlist, eager",
        "scripts/bench/bench.py --lengths 4096 16384 --batch_sizes 1 --eager --methods full "
        "specache-1bit specache-1bit:default,shortlist ...",
        "One run, int4 weights, generate.py's eager mode, each layer's attention one op "
        "(`specache::step_attention` with the shortlist in it).",
    ),
    (
        "disk/shortlist/bench_disk",
        "Llama-3-8B shape: the shortlist on the disk tier at 64k",
        "scripts/bench/bench_disk.py --lengths 65536 --steps 5 --no_full --methods specache-1bit "
        "specache-1bit:default,shortlist ...",
        "Where the slow tier is far: every listed pair is read from the disk within the step. "
        "Synthetic keys spread attention evenly, so the listed positions differ most between "
        "KV heads (a pessimistic case).",
    ),
]

DEFAULT_SUMMARY = (
    "## The shortlist as the default\n\nOur selection includes the shortlist "
    "(docs/method.md#the-shortlist-ours) since these runs: `specache-1bit` is it, "
    "`specache-1bit:default,shortlist=0` ours without it (what `specache-1bit` meant in every "
    "section after this one). The runs name both explicitly.\n"
)
DEFAULT = [
    (
        "qwen/needle_1.5b_32k/needle",
        "Qwen2.5-Coder-1.5B-Instruct: needle at 32k",
        "scripts/eval/needle.py --checkpoint "
        "checkpoints/Qwen/Qwen2.5-Coder-1.5B-Instruct/model.pth "
        "--lengths 32000 --methods full specache-1bit ...",
        "The larger Qwen at its full context, the full cache and ours: both find the needle at "
        "every depth, and ours at a tenth of the 16-bit cache's fast-tier bytes. At 50% ours "
        "ends its reply a clause earlier. 142.8 min of cells in fp32, with other work beside "
        "them (resumable with --resume).",
    ),
    (
        "qwen/needle_32k/needle",
        "Qwen2.5-Coder-0.5B-Instruct: needle at 32k",
        "scripts/eval/needle.py --checkpoint "
        "checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 32000 ...",
        "The 8k and 16k sweeps' methods at the model's full context, ours with and without the "
        "shortlist, and ours at 2 bits with it. Ours finds what the full cache finds (2 of 5), "
        "and its reply is the full cache's at 4 depths (at 25% it drops 'you should'); without "
        "the shortlist it finds 1, as do the paper's rule, KIVI, StreamingLLM and ours at 2 bits.",
    ),
    (
        "qwen/needle_8k_16k_default/needle",
        "Qwen2.5-Coder-0.5B-Instruct: needle at 8k and 16k",
        "scripts/eval/needle.py --checkpoint "
        "checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 8000 16000 --methods full specache-1bit ...",
        "The full cache and ours with the shortlist, the default's sweep at the shorter lengths "
        "(the sections further down measured ours without it): as without it, one needle fewer "
        "than the full cache at 8k (1 of 5 against 2) and the same one at 16k.",
    ),
    (
        "selection/shortlist_4k_seed7/ruler",
        "SmolLM2-135M: RULER at 4k, 4 more samples",
        "scripts/eval/ruler.py --lengths 4096 --samples 4 --seed 7 --compile --methods full "
        "specache-1bit specache-1bit:default,shortlist=0 ...",
        "Other samples (seed 7) than the selection's tables (seed 42, 2 per task), where ours "
        "scored 35.0 against 38.7 without the shortlist. Over all 6 samples per task: the full "
        "cache 35.5, ours 32.7, ours without the shortlist 30.4. 14.3 min.",
    ),
    (
        "qwen/ruler_8k_seed7/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 8k, a second sample",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 8192 --samples 1 --seed 7 --methods full specache-1bit "
        "specache-1bit:default,shortlist=0 ...",
        "A second sample per task (seed 7) beside the first (seed 42, further down). Over both: "
        "the full cache 67.1, ours 66.4 (0.99x), ours without the shortlist 60.5 (0.90x). "
        "21.0 min.",
    ),
    (
        "qwen/ruler_16k_seed7/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 16k, a second sample",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 16384 --samples 1 --seed 7 --methods full specache-1bit ...",
        "A second sample per task (seed 7) beside the first (seed 42, further down), the full "
        "cache and ours. Over both: the full cache 70.1, ours 64.4 (0.92x). "
        "39.0 min.",
    ),
    (
        "qwen/ruler_16k_seed11/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 16k, a third sample",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 16384 --samples 1 --seed 11 --methods full specache-1bit ...",
        "A third sample per task (seed 11), the full cache and ours. Over the three: the full "
        "cache 65.2, ours 60.6 (0.93x). 47.9 min, with other work beside it.",
    ),
    (
        "gemma3/shortlist_2bit/needle",
        "Gemma-3-270M: needle at 8k-32k, ours at 2 bits",
        "scripts/eval/needle.py --checkpoint checkpoints/google/gemma-3-270m/model.pth "
        "--lengths 8000 16000 32000 --methods full specache-2bit ...",
        "Ours at 2 bits with the shortlist finds what the full cache finds, 14 of 15. 36.6 min, "
        "with other work beside it.",
    ),
    (
        "gemma3/shortlist_2bit/ruler_16k/ruler",
        "Gemma-3-270M: RULER at 16k, ours at 2 bits",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "16384 "
        "--quick --methods full specache-2bit ...",
        "Ours at 2 bits with the shortlist gives the full cache's score on every task (32.7; "
        "without the shortlist it scored 30.5). 15.9 min.",
    ),
    (
        "gemma3/shortlist_2bit/ruler_8k/ruler",
        "Gemma-3-270M: RULER at 8k, ours at 2 bits",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "8192 "
        "--samples 2 --methods full specache-2bit ...",
        "The samples (seed 42, 2 per task) of the shortlist's 8k table further down: ours at 2 "
        "bits gives the full cache's score on every task (32.4). One thread, beside another "
        "sweep.",
    ),
    (
        "qwen/ruler_16k_seed7_misses/ruler",
        "Qwen2.5-Coder-0.5B-Instruct: RULER at 16k, the two tasks ours missed at seed 7",
        "scripts/eval/ruler.py --checkpoint checkpoints/Qwen/Qwen2.5-Coder-0.5B-Instruct/model.pth "
        "--lengths 16384 --quick --seed 7 --tasks niah_multikey_2 niah_multiquery --methods full "
        "specache-1bit specache-1bit:oracle specache-2bit ...",
        "The same samples again: ours repeats its slips (6299864 for 6299935, 811684 for "
        "8116895), the oracle that chooses all k pairs by the exact error within the step "
        "answers both as the full cache does, and ours at 2 bits slips on the first too "
        "(6299594). So the 1-bit copy allows the full cache's answers; our choice of positions "
        "misses one digit of a number here and there. 11 min.",
    ),
]

OTHER_RANKINGS_SUMMARY = (
    "## Other rankings, step by step\n\nscripts/eval/selection_study.py, as in 'The copy's choice, "
    "step by step' below, with the rankings the fidelity issue proposed beside the copy and the "
    "shortlist (docs/method.md#other-rankings-weighed-and-why-they-are-not-in-the-default): an "
    "error bound from the copy's key and value residual norms, the 0.5% of positions whose keys "
    "the copy represents worst kept exact (outliers), and keys rotated by a Hadamard transform "
    "before the 1-bit copy is taken (levels 'hadamard'); then k where it is needed, each "
    "full-attention layer's k fitted from 32, 64 and 128 for the same pairs in all.\n"
)
OTHER_RANKINGS = [
    (
        f"selection/study/{folder}/selection_study",
        title,
        "scripts/eval/selection_study.py ...",
        blurb,
    )
    for folder, title, blurb in (
        (
            "alternatives/smollm2",
            "SmolLM2-135M-Instruct at 4k: the other rankings",
            "One sample per task, k = 64; 10.8 min with other work beside it.",
        ),
        (
            "alternatives/qwen2.5-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct at 8k: the other rankings",
            "One sample per task, k = 64; 13.3 min with other work beside it.",
        ),
        (
            "alternatives/gemma3",
            "Gemma-3-270M at 16k: the other rankings",
            "One sample per task, k = 64; 10.6 min with other work beside it.",
        ),
        (
            "per_layer_k/qwen2.5-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct at 8k: k where it is needed",
            "The same samples at k = 32, 64 and 128, then the per-layer split.",
        ),
        (
            "per_layer_k/gemma3",
            "Gemma-3-270M at 16k: k where it is needed",
            "The same samples at k = 32, 64 and 128, then the per-layer split over Gemma's three "
            "full-attention layers.",
        ),
    )
]
