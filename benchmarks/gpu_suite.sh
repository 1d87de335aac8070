#!/usr/bin/env bash
# The GPU part of the benchmarks, on a machine with one NVIDIA GPU:
#   - every test marked `cuda` (tensor manager copy streams and host pool, monitor's CUDA timing);
#   - the swap path benchmark (pinned pool and copy engine vs naive copies, overlap with compute);
#   - the tensor manager benchmark on the GPU (step time and peak saved bytes per policy);
#   - the throughput benchmark, on CPU ranks (see docs/benchmarks.md: two pipeline ranks
#     cannot share one GPU under NCCL, so a one-GPU machine cannot run a GPU pipeline).
# Results (JSON, test log, nvidia-smi) go to the directory given (default gpu-results/);
# copy the numbers into docs/benchmarks.md, "GPU" section.
#
#   benchmarks/gpu_suite.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-results}
PY=${PYTHON:-python}
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_suite: no CUDA GPU visible to torch; nothing to measure" >&2
  exit 2
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$OUT/torch.txt"

status=0
"$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda-tests.txt" || status=1
"$PY" benchmarks/swap_bench.py --device cuda --json "$OUT/swap.json" || status=1
"$PY" benchmarks/tensor_manager_bench.py --device cuda --json "$OUT/tensor_manager.json" || status=1
CUDA_VISIBLE_DEVICES= "$PY" benchmarks/throughput_bench.py --cases transformer:2 --rounds 3 \
  --json "$OUT/throughput.json" || status=1
echo "gpu_suite: results in $OUT (exit $status)"
exit $status
