#!/usr/bin/env bash
# The GPU part of the benchmarks, on a machine with one NVIDIA GPU (about 7 minutes on an H200):
#   - every test marked `cuda` (copy streams and host pool, the monitor's CUDA timing, a GPU budget,
#     a batch twice what the capped memory holds trained under the budget);
#   - the swap path (pinned pool and copy engine vs naive copies, overlap with compute);
#   - the tensor manager on a launch-bound transformer (d_model 256) and a compute-bound one
#     (d_model 2048): step time per policy against torch's save_on_cpu and checkpoint, and on the
#     launch-bound one the host's cost counted (bytecodes and tensor operations per step) and
#     all-swapped against save_on_cpu once more with VPIPE_PREFETCH_ALLOC=compute;
#   - the memory-bound benchmark at d_model 2048 and 4096: activations twice what the capped memory
#     holds, vpipe's own swap/recompute mix against all-recompute and save_on_cpu, and the largest
#     batch each runs within 10% of plain's per-sample throughput; at d_model 2048 once more with
#     VPIPE_PREFETCH_ALLOC=compute (prefetched copies from the compute stream's memory);
#   - the timeline of one memory-bound step at both sizes: where the compute stream sat idle and
#     how much of the copies ran under kernels.
# JSON, the test log and the machine's description go to the directory given (default
# docs/results/gpu); `python -m vpipe_lab.report docs/results --docs docs/benchmarks.md` then
# regenerates the docs' GPU section from them.
#
# With VPIPE_AGAINST set to a vpipe package exported by `benchmarks/revision.py REV --export DIR` (carried
# to the GPU machine, which has no git history), the launch-bound table also times that revision's
# tensor manager (vpipe D/S/R @REV) in the same process: a change against the code before it, on one card.
# VPIPE_GPU_PARTS (space-separated: cuda_tests swap launch_bound launch_bound_compute_alloc host_cost
# compute_bound memory_bound memory_bound_compute_alloc memory_bound_4096 timelines) runs only those parts; each part's seconds
# go to OUT_DIR/suite_times.txt.
#
#   benchmarks/gpu_suite.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/results/gpu}
PY=${PYTHON:-python}
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_suite: no CUDA GPU visible to torch; nothing to measure" >&2
  exit 2
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$OUT/torch.txt"

status=0
TIMES="$OUT/suite_times.txt"  # each part's seconds: what a device session has to plan for
: > "$TIMES"
last=$SECONDS
mark() {
  echo "gpu_suite: $1 took $((SECONDS - last)) s" | tee -a "$TIMES"
  last=$SECONDS
}
# VPIPE_GPU_PARTS="memory_bound memory_bound_4096" runs only those parts (a rerun of what failed); default all
want() {
  [ -z "${VPIPE_GPU_PARTS:-}" ] || [[ " $VPIPE_GPU_PARTS " == *" $1 "* ]]
}

if want cuda_tests; then
  "$PY" -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda-tests.txt" || status=1
  # pytest's closing line, for the report
  "$PY" -c 'import json, sys; lines = [l.strip("= \n") for l in open(sys.argv[1]) if " in " in l and ("passed" in l or "failed" in l)]; print(json.dumps({"summary": lines[-1] if lines else "no summary line"}))' \
    "$OUT/cuda-tests.txt" > "$OUT/cuda_tests.json"
  mark cuda_tests
fi
if want swap; then
  "$PY" benchmarks/swap_bench.py --device cuda --json "$OUT/swap.json" || status=1
  mark swap
fi
AGAINST=()
if [ -n "${VPIPE_AGAINST:-}" ]; then AGAINST=(--against "$VPIPE_AGAINST"); fi
if want launch_bound; then
  "$PY" benchmarks/tensor_manager_bench.py --device cuda --rounds 31 ${AGAINST[@]+"${AGAINST[@]}"} \
    --json "$OUT/tensor_manager.json" || status=1
  mark launch_bound
fi
if want launch_bound_compute_alloc; then
  # all-swapped with prefetched copies from the compute stream's memory: no record_stream per copy
  VPIPE_PREFETCH_ALLOC=compute "$PY" benchmarks/tensor_manager_bench.py --device cuda --rounds 15 \
    --only "vpipe S,save_on_cpu" --json "$OUT/launch_bound_compute_alloc.json" || status=1
  mark launch_bound_compute_alloc
fi
if want host_cost; then
  # the same model's host cost counted (bytecodes, tensor operations): no clock, so no rounds
  "$PY" benchmarks/host_cost.py --device cuda --d-model 256 --heads 4 --seq-len 128 --micro-batch-size 8 \
    --min-swap-bytes 65536 --only "vpipe D,vpipe S,vpipe R,save_on_cpu,checkpoint" ${AGAINST[@]+"${AGAINST[@]}"} \
    --json "$OUT/host_cost.json" || status=1
  mark host_cost
fi
if want compute_bound; then
  "$PY" benchmarks/tensor_manager_bench.py --device cuda --d-model 2048 --heads 16 --seq-len 256 --rounds 9 \
    --only "vpipe D,vpipe S,vpipe R,save_on_cpu,checkpoint" --json "$OUT/tensor_manager_compute.json" || status=1
  mark compute_bound
fi
if want memory_bound; then
  "$PY" benchmarks/memory_bound_bench.py --device cuda --json "$OUT/memory_bound.json" || status=1
  mark memory_bound
fi
if want memory_bound_compute_alloc; then
  # the same with prefetched copies taken from the compute stream's memory (one allocator pool under the cap)
  VPIPE_PREFETCH_ALLOC=compute "$PY" benchmarks/memory_bound_bench.py --device cuda --rounds 3 --max-factor 2 \
    --json "$OUT/memory_bound_compute_alloc.json" || status=1
  mark memory_bound_compute_alloc
fi
if want memory_bound_4096; then
  "$PY" benchmarks/memory_bound_bench.py --device cuda --d-model 4096 --heads 32 --micro-batch-size 4 --rounds 3 \
    --steps 2 --max-factor 3 --json "$OUT/memory_bound_4096.json" || status=1
  mark memory_bound_4096
fi
if want timelines; then
  "$PY" benchmarks/gpu_timeline.py --json "$OUT/timeline_2048.json" || status=1
  "$PY" benchmarks/gpu_timeline.py --d-model 4096 --heads 32 --micro-batch-size 4 --json "$OUT/timeline_4096.json" \
    || status=1
  mark timelines
fi
echo "gpu_suite: results in $OUT (exit $status)"
exit $status
