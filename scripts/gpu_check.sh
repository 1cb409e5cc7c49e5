#!/usr/bin/env bash
# The prepared GPU run: the CUDA tests (kernels, the SpeCache step and the full cache against their CPU
# references, on tiny random models). Installs nothing (the GPU machine has torch and no internet).
# Usage on a lent GPU machine, from the repository root:  bash scripts/gpu_check.sh
# Results go to $OUT (or ./out when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$out/environment.txt" 2>&1
timeout 420 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py 2>&1 | tee "$out/cuda_tests.txt"
status=${PIPESTATUS[0]}
echo "exit status $status" >> "$out/cuda_tests.txt"
exit "$status"
