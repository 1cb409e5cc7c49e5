#!/usr/bin/env bash
# The prepared GPU run, under 8 minutes, installing nothing (the GPU machine has torch and Triton,
# no internet; no checkpoint travels there):
#  1. the CUDA tests: the Triton low-bit kernels against their reference, mixed attention, and
#     SpeCache (speculative, non-speculative, fetch waited, KIVI) and the full cache on tiny random
#     models against their CPU runs; specache/ copied alone into a minimal host, on the GPU as it is
#     (no kernels), against the reference decoder;
#  2. the low-bit pass's Triton kernels alone, float against sparse, on SmolLM2's and the Llama-3-8B
#     shape at 32k and 128k, flat and peaked rows (scripts/bench/bench_lowbit_triton.py);
#  3. the bench on a Llama-3-8B-shaped model with random weights, bf16: ms/step at 32k for the full
#     cache and SpeCache 1-bit with the paper's selection and ours (whose real-row picks wait for a
#     synchronous fetch inside each layer), not speculative, and with each fetch waited for (each
#     method and length is a compile of its own, so one length keeps this inside the time); then the
#     largest batch at 32k (up to 16) of the full cache and SpeCache 1-bit, and its tok/s;
#  4. serving: the server's engine (serving/batching.py) in one process (no HTTP stack there),
#     static against continuous batching on the mixed load, SmolLM2's shape with random weights, the
#     full cache and SpeCache 1-bit (their sequences a row each of one cache;
#     scripts/bench/bench_batching.py);
#  5. on a machine with two GPUs or more, tensor parallelism over NCCL: two ranks (cuda:0, cuda:1)
#     against one GPU, the logits and greedy tokens of every cache on a tiny random model
#     (tests/test_tp.py); skipped with one GPU.
# Usage on a lent GPU machine, from the repository root:  bash scripts/gpu_check.sh
# Results go to $OUT (or ./out when OUT is unset): environment.txt, cuda_tests.txt,
# lowbit_triton.md, bench.log and bench/bench.{md,json,png}, max_batch.log, batching.log and
# batching/batching.{md,json}, tp_two_gpus.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  free -g
} > "$out/environment.txt" 2>&1

timeout 150 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_lowbit_triton.py \
  tests/test_lowbit_copy.py tests/test_host.py -k "not smollm2" 2>&1 | tee "$out/cuda_tests.txt"
tests=${PIPESTATUS[0]}
echo "exit status $tests" >> "$out/cuda_tests.txt"

timeout 90 python scripts/bench/bench_lowbit_triton.py 2>&1 | tee "$out/lowbit_triton.md"
kernels=${PIPESTATUS[0]}

timeout 240 python scripts/bench/bench.py --device cuda --random_weights Meta-Llama-3-8B --dtype bfloat16 \
  --lengths 32768 --batch_sizes 1 --new_tokens 16 --no_hf \
  --methods full specache-1bit:paper specache-1bit specache-nospec-1bit "specache-1bit, fetch waited" \
  --out "$out/bench" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}

timeout 120 python scripts/bench/bench.py --device cuda --random_weights Meta-Llama-3-8B --dtype bfloat16 \
  --lengths 32768 --batch_sizes 1 --new_tokens 8 --no_hf --methods full specache-1bit \
  --max_batch --max_batch_cap 16 --out "$out/max_batch" 2>&1 | tee "$out/max_batch.log"
largest=${PIPESTATUS[0]}

timeout 100 python scripts/bench/bench_batching.py --device cuda --random_weights SmolLM2-135M \
  --dtype bfloat16 --requests 16 --answer_tokens 16 64 --out "$out/batching" 2>&1 \
  | tee "$out/batching.log"
batching=${PIPESTATUS[0]}

two_gpus=0
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_tp.py -k two_gpus 2>&1 | tee "$out/tp_two_gpus.txt"
  two_gpus=${PIPESTATUS[0]}
else
  echo "skipped: fewer than two GPUs" | tee "$out/tp_two_gpus.txt"
fi

echo "tests $tests, kernels $kernels, bench $bench, max batch $largest, batching $batching," \
  "two GPUs $two_gpus" | tee "$out/status.txt"
[ "$tests" -eq 0 ] && [ "$kernels" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$largest" -eq 0 ] \
  && [ "$batching" -eq 0 ] && [ "$two_gpus" -eq 0 ]
