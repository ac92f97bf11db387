#!/usr/bin/env bash
# The checks that need a GPU, as one time-boxed script: what first ran tinyscale on a GPU (lesson 11).
# Run from the repository root, or from a copy holding src, tests, benchmarks, conftest.py, pyproject.toml,
# notebooks/kernels_traffic.py and scripts (what a GPU machine was sent), as the working directory:
#
#     OUT=/some/dir bash scripts/gpu_checks.sh      # WHEELS=DIR: pip-install DIR/*.whl first (pydantic, ...)
#
# Every step is time-boxed against one overall deadline (BUDGET_S, default 360 s) and tees its
# output into $OUT, so a step that hangs or a run that is cut short still leaves what it printed.
#   0. the device, versions, and the backend `launch` picks for 1 and 2 ranks
#   3. python scripts/gpu_engine.py               (1-rank NCCL engine vs reference at ZeRO 0-3 and compiled
#                                                  with checkpointing; MFU), unless SKIP_ENGINE=1
#   4. pytest tests/engine -k "zero3 and not slow" -x, if at least 60 s are left
#   1. pytest tests/kernels/test_kernels_gpu.py   (compiled kernels, fp32/bf16/fp16, vs float64)
#   5. python scripts/gpu_perf.py cp              (context parallel's block kernel on the GPU)
#   6. python benchmarks/mfu.py --dtype bfloat16  (one process, bf16 autocast)
#   2. python benchmarks/kernels.py               (timings vs eager / SDPA)
#   7. python scripts/gpu_perf.py tiles           (flash-attention tile sweep) with what is left
# (numbered as first written; run in the order above, the most wanted first: the engine changed most
# since the last GPU run, the kernels least)
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
BUDGET_S=${BUDGET_S:-360}
left() { echo $((BUDGET_S - ($(date +%s) - START))); }
box() {  # seconds for the next step: what it asks for, at most what is left, at least 1
  local want=$1 rem; rem=$(left)
  [ "$rem" -lt "$want" ] && want=$rem
  [ "$want" -lt 1 ] && want=1
  echo "$want"
}

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl 2>&1 | tail -3
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi

{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, pydantic; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, 'pydantic', pydantic.__version__)
print('nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
  python3 -c "from tinyscale.dist.runtime import resolve_backend as r
print('launch backend auto: 1 rank', r('auto', 1), '| 2 ranks', r('auto', 2))"
} 2>&1 | tee "$OUT/0_env.log"

if [ -z "${SKIP_ENGINE:-}" ]; then
  echo "== 3. engine on NCCL, 1 rank (budget left $(left) s)"
  timeout -k 5 "$(box 200)" python3 scripts/gpu_engine.py all 2>&1 | tee "$OUT/3_engine.log"
  echo "step 3 exit ${PIPESTATUS[0]}" | tee -a "$OUT/3_engine.log"
fi

if [ "$(left)" -ge 60 ]; then
  echo "== 4. zero3 engine tests with CUDA present (budget left $(left) s)"
  timeout -k 5 "$(box 120)" python3 -m pytest tests/engine -q -p no:cacheprovider -k "zero3 and not slow" -x \
    2>&1 | tee "$OUT/4_zero3.log"
  echo "step 4 exit ${PIPESTATUS[0]}" | tee -a "$OUT/4_zero3.log"
else
  echo "== 4. skipped: $(left) s left" | tee "$OUT/4_zero3.log"
fi
echo "== 1. compiled kernels (budget left $(left) s)"
timeout -k 5 "$(box 100)" python3 -m pytest tests/kernels/test_kernels_gpu.py -q -p no:cacheprovider \
  --durations=5 2>&1 | tee "$OUT/1_kernels_gpu.log"
echo "step 1 exit ${PIPESTATUS[0]}" | tee -a "$OUT/1_kernels_gpu.log"

echo "== 5. context-parallel blocks on the GPU (budget left $(left) s)"
timeout -k 5 "$(box 60)" python3 scripts/gpu_perf.py cp 2>&1 | tee "$OUT/5_cp.log"
echo "step 5 exit ${PIPESTATUS[0]}" | tee -a "$OUT/5_cp.log"

echo "== 6. MFU, bf16 (budget left $(left) s)"
timeout -k 5 "$(box 60)" python3 benchmarks/mfu.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/6_mfu.log"
echo "step 6 exit ${PIPESTATUS[0]}" | tee -a "$OUT/6_mfu.log"

echo "== 2. benchmark (budget left $(left) s)"
timeout -k 5 "$(box 80)" python3 benchmarks/kernels.py 2>&1 | tee "$OUT/2_bench.log"
echo "step 2 exit ${PIPESTATUS[0]}" | tee -a "$OUT/2_bench.log"

echo "== 7. flash-attention tiles (budget left $(left) s)"
if [ "$(left)" -ge 30 ]; then
  timeout -k 5 "$(box 300)" python3 scripts/gpu_perf.py tiles "$(( $(left) - 15 ))" 2>&1 | tee "$OUT/7_tiles.log"
  echo "step 7 exit ${PIPESTATUS[0]}" | tee -a "$OUT/7_tiles.log"
fi
echo "total $(( $(date +%s) - START )) s"
