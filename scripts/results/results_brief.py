"""docs/RESULTS.md's first part, "In brief": the main figures of the page's sections in prose,
written by hand (results_page.py places it after the introduction)."""

# The page's first part, after its introduction: the main figures of the sections below in prose,
# each paragraph linking the tables it draws on (blocks joined by blank lines).
BRIEF = [
    "## In brief\n",
    (
        "What the sections below measure, in prose: our selection against the paper's rule "
        "and the full cache, the speed of a decode step on this CPU beside our full cache and "
        "llama.cpp, the slow tier on disk, and the server. Its tables are gathered by hand "
        "from the sections below, and each paragraph links the tables it draws on. The "
        "decode-speed and disk-tier figures were measured before the shortlist joined our "
        "default: there 'ours' is our selection without it, what `default,shortlist=0` names "
        "now. The shortlist makes a step 1.03-1.11x as long with the slow tier in RAM ([its "
        "cost](#smollm2-135m-decode-speed-with-the-shortlist-eager)) and 1.25-1.84x on the "
        "disk tier ([on disk](#llama-3-8b-shape-the-shortlist-on-the-disk-tier-at-64k)).\n"
    ),
    "### Accuracy at 1 bit: ours, the paper's rule and the full cache\n",
    (
        "At 1 bit, the paper's rule for choosing which 16-bit pairs to read (the speculative "
        "token's top-k) loses most needle retrievals on the small models measured here, while "
        "the full cache finds them. Ours lets the real token choose half of the pairs within "
        "the step: its 1-bit copy lists 8 candidates per pair, and their exact keys decide "
        "(the shortlist). It adds smaller changes (attention sinks, Lloyd 1-bit levels, a "
        "prompt-lookup speculative token, max over a KV head's query heads, a per-head "
        "correction when the speculation missed, no re-reading of pairs held already), at the "
        "same fast-tier bytes. One run per row, greedy, fp32 on a 2-core CPU "
        "([Selection](#selection) has the ablation of each change, [The shortlist as the "
        "default](#the-shortlist-as-the-default) and [The shortlist](#the-shortlist) the runs "
        "with the shortlist):\n"
    ),
    (
        "| | full cache | 1-bit, paper's rule | 1-bit, ours | "
        "1-bit, ours without the shortlist | 2-bit, ours without the shortlist |\n"
        "|---|---|---|---|---|---|\n"
        "| SmolLM2-135M needle, 1k-4k x 5 depths | 19/20 | 5/20 | **19/20** | 18/20 | "
        "18/20 |\n"
        "| SmolLM2-135M RULER 2k (2 samples per task) | 48.3 | 9.1 | **51.7** | 41.8 | "
        "48.3 |\n"
        "| SmolLM2-135M RULER 4k | 37.3 | 1.1 | **35.0** | 38.7 | 36.0 |\n"
        "| SmolLM2-135M RULER 4k, 4 more samples per task (6 in all) | 35.5 | - | **32.7** | "
        "30.4 | - |\n"
        "| Gemma-3-270M needle, 8k-32k x 5 depths | 14/15 | 8/15 | **14/15** | 12/15 | "
        "14/15 |\n"
        "| Gemma-3-270M RULER 8k (2 samples per task) | 32.4 | - | **33.9** | 29.5 | - |\n"
        "| Gemma-3-270M RULER 16k (1 sample per task) | 32.7 | 21.4 | **31.8** | 20.5 | "
        "30.5 |\n"
        "| Qwen2.5-Coder-0.5B RULER 8k (1 sample per task) | 69.8 | 49.4 | **67.6** | 66.4 | "
        "- |\n"
        "| Qwen2.5-Coder-0.5B RULER 8k, a second sample per task (2 in all) | 67.1 | - | "
        "**66.4** | 60.5 | - |\n"
        "| Qwen2.5-Coder-0.5B RULER 16k (1 sample per task) | 72.7 | 48.5 | **72.7** | "
        "61.4 | 66.7 |\n"
        "| Qwen2.5-Coder-0.5B RULER 16k, a second sample per task (2 in all) | 70.1 | - | "
        "**64.4** | - | - |\n"
        "| Qwen2.5-Coder-0.5B RULER 16k, a third sample per task (3 in all) | 65.2 | - | "
        "**60.6** | - | - |\n"
        "| Qwen2.5-Coder-0.5B needle, 32k x 5 depths | 2/5 | 1/5 | **2/5** | 1/5 | - |\n"
        "| Qwen2.5-Coder-1.5B needle, 16k x 5 depths | 5/5 | - | **5/5** | 5/5 | - |\n"
        "| Qwen2.5-Coder-1.5B needle, 32k x 5 depths | 5/5 | - | **5/5** | - | - |\n"
        "| fast tier over a 16-bit cache (needle, 4k) | 1 | 0.140 | 0.142 | 0.142 | 0.203 |\n"
    ),
    (
        "The shortlist became the default after the last three columns were measured: without "
        "it, ours missed the full cache's answers on Gemma-3 and on Qwen2.5's RULER at 16k. "
        "With it, the step's own read from the slow tier is 8x larger (5.5-5.9x the pairs per "
        "token in all): on a CPU with the slow tier in RAM a step takes 1.03-1.11x the step "
        "without it, on the disk tier 1.25-1.84x, where `--specache_select "
        "default,shortlist=0` is the faster choice "
        "([method.md](method.md#the-shortlist-ours)). At 2 bits with the shortlist, SmolLM2 "
        "scores 18/20, 47.1 and 36.0 on the three rows above, Gemma-3 the full cache's 14/15 "
        "on the needle, 32.4 on RULER at 8k and 32.7 at 16k (the same answers on every task), "
        "and Qwen2.5's needle at 32k 1/5.\n"
    ),
    "![coverage by layer](results/selection/coverage/coverage_by_layer.png)\n",
    (
        "Per layer, the share of the real token's exact attention read in 16 bits on a 2k "
        "needle prompt (the paper's rule misses it, ours finds it); dashed, what the exact "
        "top-k would read.\n"
    ),
    (
        "Why: at 1 bit, the copy over-weights some positions, and left in low bits they pull "
        "the attention off the answer. The real token's own low-bit top-k reads exactly "
        "those; the speculative token's, chosen a step earlier for another query, misses "
        "them. An oracle that fetches the positions of largest exact attention covers the "
        "most attention mass yet finds only half the needles; one that fetches where the copy "
        "is furthest off finds as many as ours "
        "([method.md](method.md#choosing-the-exact-pairs-the-papers-rule-and-ours)).\n"
    ),
    (
        "Where it falls short: SmolLM2's RULER at 4k, 32.7 against the full cache's 35.5 over "
        "6 samples per task (ahead of ours without the shortlist, 30.4, which the first 2 "
        "samples had put ahead); Qwen2.5-0.5B's RULER at 16k, 0.93x the full cache over 3 "
        "samples (60.6 against 65.2): in 3 of its 33 answers ours strays in the middle of a "
        "7-digit number (Qwen writes each digit as a token, so a number takes seven "
        "retrievals) or leaves one of four numbers out; and the GPU's cost of the larger "
        "waited read, which has not been measured "
        "([method.md](method.md#the-shortlist-ours)). At 2 bits ours matches or beats the "
        "paper's rule everywhere measured.\n"
    ),
    "### Decode speed on a CPU\n",
    (
        "One run of `scripts/bench/bench.py`, compiled, SmolLM2 fp32 on this 2-core CPU "
        "([table](#smollm2-135m-decode-speed-of-the-selections)): SpeCache reads a 1-bit copy "
        "instead of the full cache's K and V, so at 16k it decodes 1.61x as fast as the full "
        "cache (K and V in fp32) with our selection and 1.94x with the paper's. At 4k the "
        "step is mostly weights, which both read: the paper's rule runs at the full cache's "
        "speed (1.01x), ours at 0.80x. Our selection costs 20-26% more per step than the "
        "paper's on this CPU (the real token's picks are extra work in every layer) while it "
        "needs 25-31% fewer 16-bit bytes from the slow tier (on a GPU; a CPU gathers them "
        "all); where speed matters more than retrieval, `--specache_select paper` keeps the "
        "paper's speed. Without `--compile`, SpeCache decodes at about half the compiled "
        "speed (168 against 86 ms per step on a 2.8k-token prompt, in one run; compiling took "
        "15 s), so eager stays the default and `--compile` is one flag away "
        "([evaluation.md](evaluation.md#speed)).\n"
    ),
    "### Beside llama.cpp on a CPU\n",
    (
        "Decode on a CPU runs through C kernels with plain-PyTorch twins: int8/int4 weights "
        "times a few rows (`kernels/linear_cpu.c`), the full cache's attention "
        "(`kernels/dense_cpu.c`), SpeCache's merge of its 16-bit pairs with the 1-bit pass "
        "(`specache/kernels/merge_cpu.c`), the "
        "1-bit pass (`specache/kernels/lowbit_cpu.c`) and the choice of pairs "
        "(`specache/kernels/rank_cpu.c`); "
        "`--compile` makes each step one graph, called from inductor's C++ wrapper. One run "
        "on this 2-core box, SmolLM2-135M with int4 weights (groups of 32, our fastest) "
        "beside llama.cpp on the Q4_1 GGUF it comes from (tok/s, batch 1; the ratio is over "
        "llama.cpp's f16-KV decode; [all rows](#smollm2-135m-against-llamacpp)):\n"
    ),
    (
        "```bash\n"
        "pip install -r requirements-bench.txt && python scripts/convert/quantize_checkpoint.py "
        "--mode int4 --groupsize 32\n"
        "python scripts/bench/bench.py --checkpoint "
        "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth --lengths 1024 "
        "4096 16384 32768 --batch_sizes 1 --methods full full-16bit specache-1bit "
        "specache-1bit:paper --no_hf --new_tokens 16 --out docs/results/llama_cpp\n"
        "```\n"
    ),
    (
        "| context | llama.cpp | our full cache, fastest | "
        "SpeCache 1-bit, paper's selection | SpeCache 1-bit, ours without the shortlist |\n"
        "|---|---|---|---|---|\n"
        "| 1k | 85.8 | 108.7 (1.27x) | 65.5 (0.76x) | 42.5 (0.49x) |\n"
        "| 4k | 46.7 | 73.8 (1.58x) | 42.4 (0.91x) | 43.4 (0.93x) |\n"
        "| 16k | 22.0 | 36.0 (1.63x) | 33.6 (1.52x) | 28.4 (1.29x) |\n"
        "| 32k | not run (its prefill) | 21.8 | 17.3 | 15.2 |\n"
    ),
    (
        "Our full cache decodes faster than llama.cpp at every context, and our prefill of "
        "16k tokens took 109 s against its 185 s. SpeCache draws about level with llama.cpp "
        "at 4k and passes it at 16k (the paper's selection by 1.52x, ours by 1.29x), but on "
        "this small model it is not faster than our own full cache (at 16k the paper's "
        "selection 0.93x, ours 0.79x; the shared box's load moves single rows by 10-30%): the "
        "16-bit cache (768 bytes per position and layer) stays cheap to read next to what "
        "SpeCache adds. Its 1-bit pass is bound by arithmetic on a CPU, not by memory (13 ms "
        "of a 16k step, reading 35 MB), and each layer pays a fixed cost for its choices of "
        "positions and the merge of four segments (at 1k, 0.2 ms a layer with the paper's "
        "selection, 0.5 ms with ours, which chooses twice). `python scripts/bench/profile_step.py` "
        "shows where a step's time goes ([evaluation.md](evaluation.md#speed)). A layer's "
        "whole SpeCache attention is now one op on a CPU (`specache::step_attention`, "
        "`specache/kernels/step_cpu.cpp`): without `--compile` (generate.py's and chat.py's "
        "default) "
        "SpeCache decodes 1.5-1.7x as fast as op by op, at 0.57x, 0.59x and 0.70x our full "
        "cache at 1k, 4k and 16k; compiled, it changes nothing measurable ([One op per "
        "layer](#one-op-per-layer)).\n"
    ),
    (
        "`--specache_arithmetic int8` runs the 1-bit pass on 8-bit integers (VPDPBUSD on CPUs "
        "with AVX512-VNNI, an AVX2 path elsewhere): in the same kind of run it decoded 5-16% "
        "faster at 4k-32k and passed our full cache at 32k (1.07x). It found the same needles "
        "but lost 5 RULER points at 4k, so it is an option, not the default ([The integer "
        "pass](#the-integer-pass)).\n"
    ),
    (
        "On the Llama-3-8B shape (random weights, speed only), `python "
        "scripts/bench/bench_shape.py` runs the same comparison: our int4 weights against "
        "llama.cpp "
        "on a random Q4_0 GGUF of that shape, compiled, each KV cache filled with synthetic "
        "pairs (llama.cpp's by tiling a saved sequence state), tok/s, one run ([all "
        "rows](#the-llama-3-8b-shape-beside-llamacpp)):\n"
    ),
    (
        "| context | llama.cpp, f16 KV | llama.cpp, q4_0 KV | our full cache | "
        "SpeCache 1-bit, ours without the shortlist |\n"
        "|---|---|---|---|---|\n"
        "| 16k | 2.47 | 0.84 | 2.63 (1.07x) | 2.29 (0.93x) |\n"
        "| 32k | 1.45 | 0.31 | 2.05 (1.42x) | 1.92 (1.32x) |\n"
        "| 64k | 0.75 | 0.11 | 1.43 (1.90x) | 1.37 (1.82x) |\n"
    ),
    (
        "SpeCache is level with our full cache here (0.87-0.96x; with int8 weights at 64k "
        "1.10x, and 1.28x with the integer pass), not the 2x its bytes allow: on two cores "
        "its 1-bit pass costs, per position, about as much time as the full cache's 16-bit "
        "attention. At 128k, whose 16-bit cache does not fit in RAM, SpeCache with its slow "
        "tier on disk decoded 0.42 tok/s (ours) and 0.78 (the paper's selection) against "
        "llama.cpp's 0.07 with a q4_0 KV cache in RAM.\n"
    ),
    "### Contexts whose 16-bit cache outgrows RAM\n",
    (
        "On a CPU, `--slow_tier disk` keeps SpeCache's complete 16-bit cache in a file per "
        "layer instead of RAM; RAM holds the weights, the 1-bit copy, the window and the "
        "fetched pairs, and the speculative prefetch reads the disk between layers as the "
        "paper's hides PCIe ([method.md](method.md#the-slow-tier-on-disk-ours)). One run of "
        "`scripts/bench/bench_disk.py` on this 2-core box (Llama-3-8B shape, random int8 weights, "
        "synthetic K and V, batch 1, eager; cold: the store's pages dropped before each step; "
        "[all rows](#the-slow-tier-on-disk)):\n"
    ),
    (
        "| context | cache | ms/step, cold | resident GB | fast tier GB | on disk GB | "
        "read from disk MB/step |\n"
        "|---|---|---|---|---|---|---|\n"
        "| 64k | full cache, in RAM (warm) | 2465 | 17.9 | 8.6 | - | - |\n"
        "| 64k | SpeCache 1-bit, paper's selection | 1573 | 10.0 | 0.83 | 8.6 | 67 |\n"
        "| 64k | the same, each fetch waited | 1956 | 10.0 | 0.83 | 8.6 | 67 |\n"
        "| 64k | SpeCache 1-bit, ours without the shortlist | 2375 | 10.0 | 0.83 | 8.6 | "
        "100 |\n"
        "| 128k | full cache | "
        "cannot be allocated: 17.2 GB of K and V beside 7.5 GB of weights in 23.5 GiB | | | "
        "| |\n"
        "| 128k | SpeCache 1-bit, paper's selection | 2330 | 10.9 | 1.64 | 17.2 | 67 |\n"
        "| 128k | the same, each fetch waited | 2661 | 10.8 | 1.64 | 17.2 | 67 |\n"
        "| 128k | SpeCache 1-bit, non-speculative | 2204 | 10.8 | 1.64 | 17.2 | 67 |\n"
        "| 128k | SpeCache 1-bit, ours without the shortlist | 4176 | 10.9 | 1.64 | 17.2 | "
        "100 |\n"
    ),
    (
        "At 128k the process stays under 11 GB where the full cache does not fit, and "
        "overlapping the prefetch with the other layers is 1.14x (paper's selection) and "
        "1.08x (ours) faster than waiting for it, cold. On this CPU the speculative token "
        "does not pay for itself, though: the second row costs about as much compute as the "
        "disk reads it hides (the non-speculative baseline is as fast as the paper's rule), "
        "and our selection, which reads half of k within the step and decodes two rows, is "
        "the slowest here; its retrieval gains are measured on real models, these keys are "
        "random. Our default's shortlist reads 5.5x the bytes a step (552 MB at 64k) and "
        "takes 1.25x the step without it warm and 1.84x cold ([the "
        "table](#llama-3-8b-shape-the-shortlist-on-the-disk-tier-at-64k)): on a disk, "
        "`--specache_select default,shortlist=0` trades those answers for speed.\n"
    ),
    "### Serving and chat\n",
    (
        "serving/serve.py and chat.py on SmolLM2, eager, on this 2-core CPU, one run each unless "
        "said "
        "otherwise ([Serving](#serving) has the tables). A kept conversation costs what it "
        "holds: with SmolLM2 in fp32, 46 kB a token with the full cache (94 MB at 2k tokens) "
        "and 26 kB with SpeCache 1-bit (its 16-bit slow tier and the low-bit copy beside it). "
        "A SpeCache on the disk tier is kept whole, as allocated for the whole context "
        "(`--max_seq_length`; 108 MB at 4096 positions), in files that stay until the "
        "conversation leaves.\n"
    ),
    (
        "- **A second chat turn** after a 2k-token message: first token in 0.07x the time of "
        "prefilling the whole conversation again with the full cache (0.38 against 5.84 s; "
        "its kept conversation is copied back into a row first) and 0.07x with SpeCache 1-bit "
        "(0.58 against 8.30 s); 2099 prompt tokens reused (`python scripts/bench/bench_serve.py "
        "--workload turns`).\n"
        "- **Mixed load** (`--workload mixed`: 32 streamed completions from 8 clients, every "
        "4th with a 2k-token prompt, the rest 64 tokens, answers of 16-128 tokens): "
        "continuous batching gives the short requests their first token in 0.05-0.11x static "
        "batching's median time, and 1.1-1.4x its tokens/s "
        "([bf16](#smollm2-135m-mixed-load-bf16), three runs, `--dtype bfloat16 --repeats 3`; "
        "[fp32](#smollm2-135m-mixed-load-fp32), one run):\n"
    ),
    (
        "  | tok/s, continuous over static | full cache | SpeCache 1-bit |\n"
        "  |---|---|---|\n"
        "  | bf16, median of 3 (range) | 1.35x (1.16-1.39x) | 1.26x (1.11-1.35x) |\n"
        "  | bf16, at a full batch (median) | 1.48x | 1.39x |\n"
        "  | fp32, one run | 1.42x | 1.38x |\n"
        "  | fp32, at a full batch | 1.55x | 1.54x |\n"
        "  | bf16, in one process, median of 3 (range) | 1.31x (1.31-1.35x) | "
        "1.38x (1.31-1.64x) |\n"
        "  | bf16, in one process, at a full batch (median) | 1.43x | 1.53x |\n"
    ),
    (
        '  "In one process" is `python scripts/bench/bench_batching.py --dtype bfloat16 --repeats '
        "3`: the same load on the engine without HTTP, random token ids for prompts "
        "([table](#smollm2-135m-mixed-load-in-one-process-bf16)); it also runs on a GPU, "
        "where serving/serve.py's HTTP stack need not be installed.\n"
    ),
    (
        "  The 1.5x aimed at is not reached, and on this CPU it is about as far as continuous "
        "batching can go with this workload:\n"
        "  - Both batchings pay the prompts in full, and prefill is bound by arithmetic here: "
        "passes that held a prompt chunk took 40-46% of static batching's time and 55-64% of "
        "continuous batching's.\n"
        "  - What continuous batching wins is fuller decode steps: 6.2 sequences per step "
        "against static batching's 3.3-3.8 (`/health` reports both). How full a static batch "
        "runs depends on when requests happen to arrive, hence the spread from run to run.\n"
        '  - "At a full batch" is the bench\'s estimate of what continuous batching would '
        "reach if every decode-only pass had carried all 8 sequences at the same cost: "
        "1.39-1.55x (medians and single runs). A sequence whose prompt is going in does not "
        "decode, so no scheduler gets there with 8 clients that each wait for their answer.\n"
        "  - The engine's sequences share one cache, a row each (the full cache, and SpeCache "
        "in RAM), so a decode step attends in one call per layer for all of them; static "
        "batching runs on the same engine and gains as much. At 8 sequences the engine's step "
        "costs 1.12x one cache's set up for 8 with the full cache and 1.28x with SpeCache, "
        "where a SpeCache per sequence cost 1.6-1.8x (fp32, `python "
        "scripts/bench/bench_batch_step.py`, "
        "[table](#smollm2-135m-the-engines-decode-step-of-1-8-sequences)). SpeCache's "
        "continuous tokens/s in bf16 is 21-26, 0.7x the full cache's.\n"
        "  - On this CPU, bf16 (its matrix units) serves faster than fp32 with the full cache "
        "(continuous: 61-75 s against 81 s in these runs, 55-60 against 77-88 s in earlier "
        "ones on a quieter box); `--dtype auto` still picks fp32 on CPUs.\n"
        "- **Soak** (`python scripts/bench/soak_serve.py --requests 250`): 250 requests per cache "
        "after a warm-up that fills the kept conversations' budget and then sends a wave at "
        "each concurrency (888 requests in all on the full cache, 840 on SpeCache in RAM, 408 "
        "on the disk tier): known chats and completions, second turns, bad requests, clients "
        "that hang up, at concurrency 1-16, on the full cache, SpeCache 1-bit and SpeCache on "
        "the disk tier. No failure, every known greedy answer equal to generate.py's, every "
        "bad request a 4xx; resident memory after the run +0.3%, +0.4% and -0.6% from where "
        "it was after the warm-up, the same 5 threads, no file left. (Without the warm-up's "
        "waves at each concurrency, the disk tier's memory rose 9% through the run's first "
        "250 requests and 1% over the next 250: a high-water mark, not a leak.)\n"
    ),
    (
        "Before continuous batching (`python scripts/bench/bench_serve.py --requests 1 "
        "--max_tokens "
        "16 --out docs/results/serve`, 2k-token prompts; "
        "[table](#smollm2-135m-requests-before-continuous-batching)) requests were "
        "prefill-bound: 0.18-0.20 requests/s with the full cache and 0.13-0.17 with SpeCache "
        "1-bit at concurrency 1-8 (peak resident memory 2.27 and 2.10 GB).\n"
    ),
    (
        "Chat and long prompts (`python chat.py --specache`; `--prefill_chunk N`): each turn "
        "is prefilled on top of the cache the conversation has built, and a long prompt can "
        "go in in chunks, so that only one chunk's activations and 16-bit K, V are in memory "
        "at once "
        "([method.md](method.md#prefill-in-chunks-and-a-conversations-next-turn-ours)). On a "
        "16k-token prompt (`python scripts/bench/bench_prefill.py --out docs/results/prefill`, one "
        "run; [table](#smollm2-135m-a-16k-token-prompt-prefilled-in-chunks)), chunks of 1024 "
        "lowered the peak resident memory from 2.12 to 1.83 GB with the full cache and from "
        "1.87 to 1.46 GB with SpeCache 1-bit (the activations of one chunk instead of the "
        "whole prompt; the caches are allocated for the whole context either way), in 0.89x "
        "and 0.92x of the time, with the same tokens.\n"
    ),
]
