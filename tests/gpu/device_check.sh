#!/usr/bin/env bash
# The GPU checks, in one run on a lent GPU machine (see tests/gpu/README.md). Run from the
# repository root with the wheels meshplan needs beyond the machine's image in .whl/ (duckdb,
# highspy, pyzmq); writes its logs and results under $OUT (or ./gpu-out).
#
# Every step runs whatever the others returned (no `set -e`: a failed step must not hide the
# rest), and each step's exit status is kept. The run ends with a summary naming the steps
# that failed and exits 1 if any did, 0 only when every check passed. This script runs only on
# a GPU machine: without a usable CUDA device the `env` step fails (and the GPU tests, which
# would skip, fail too: tests/gpu/require_gpu_tests.py), it is never a pass.
# The NCCL run is a check with two GPUs or more (and fails without any); with exactly one,
# NCCL refuses two ranks on the same device, so it runs as a record-only probe, apart from the
# checks and not counted (the summary says so).
#
#   TESTS_ONLY=1  runs env, wheels and tests only (the summary lists the steps left out)
#   TEST_S, LOWERED_S, BENCH_S, NCCL_S  per-step time limits in seconds
set -u -o pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PASSED=(); FAILED=(); LEFT_OUT=(); RECORDED=()

# step NAME CMD...: run CMD, print its status and time, remember whether it failed
step() {
  local name=$1 rc; shift
  echo "== $name"; SECONDS=0
  "$@"; rc=$?
  echo "$name rc=$rc in ${SECONDS}s"
  if [ "$rc" -eq 0 ]; then PASSED+=("$name"); else FAILED+=("$name (rc=$rc)"); fi
}

wheels() {
  if [ -n "${NO_WHEELS:-}" ]; then echo "NO_WHEELS set: using the image's packages"; return 0; fi
  if ! ls .whl/*.whl >/dev/null 2>&1; then echo "no .whl/*.whl: using the image's packages"; return 0; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return $?
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# the repository root is the package: import it as `meshplan` through a link
link_package() {
  mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/meshplan || return $?
  export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
}

env_check() {
  { date -u; nvidia-smi; python3 -c "import sys, torch, triton; print(sys.version); \
print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); \
import meshplan; print('meshplan', meshplan.__file__); \
ok = torch.cuda.is_available(); print('cuda available', ok, 'devices', torch.cuda.device_count()); \
print(torch.cuda.get_device_name(0)) if ok else None; sys.exit(0 if ok else 'no usable CUDA device')"; \
  } > "$OUT/env.txt" 2>&1
  local rc=$?; cat "$OUT/env.txt"; return $rc
}

gpu_tests() {
  # a skipped test marked gpu (or a whole skipped file) fails the run here: see the plugin
  PYTHONPATH=tests/gpu${PYTHONPATH:+:$PYTHONPATH} timeout "${TEST_S:-300}" python3 -m pytest \
    -p no:cacheprovider -p no:logging -p require_gpu_tests -q -rs \
    tests/unit/test_kernels_triton.py tests/unit/test_kernels_registry.py \
    tests/dist/test_lower_kernels.py tests/dist/test_device.py --junitxml "$OUT/tests.xml" > "$OUT/tests.log" 2>&1
  local rc=$?; tail -30 "$OUT/tests.log"; return $rc
}

lowered_step() {
  timeout "${LOWERED_S:-120}" python3 benchmarks/lowered_step_gpu.py --steps 20 \
    --json "$OUT/lowered_step.json" > "$OUT/lowered_step.log" 2>&1
  local rc=$?; grep -v DEBUG "$OUT/lowered_step.log" | tail -8; return $rc
}

kernels_bench() {
  timeout "${BENCH_S:-150}" python3 benchmarks/kernels_gpu.py --json "$OUT/kernels_gpu.json" \
    --markdown "$OUT/kernels_gpu.md" > "$OUT/bench.log" 2>&1
  local rc=$?; tail -45 "$OUT/bench.log"; return $rc
}

nccl() {   # nccl [--record-only]
  timeout "${NCCL_S:-75}" python3 tests/gpu/nccl_check.py --timeout 30 "$@" > "$OUT/nccl.log" 2>&1
  local rc=$?; cut -c1-600 "$OUT/nccl.log" | head -30; return $rc
}

step wheels wheels
step link link_package
step env env_check
step tests gpu_tests
if [ -n "${TESTS_ONLY:-}" ]; then
  LEFT_OUT+=("lowered-step" "kernels-bench" "nccl")
else
  step lowered-step lowered_step
  step kernels-bench kernels_bench
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "${gpus:-0}" -ne 1 ]; then    # two GPUs or more; none: the check fails, saying so
    step nccl nccl
  else
    echo "== nccl: RECORD ONLY, not a check (1 GPU: NCCL refuses two ranks on one device)"
    SECONDS=0; nccl --record-only; rc=$?
    echo "nccl record rc=$rc in ${SECONDS}s"
    RECORDED+=("nccl (record only, 1 GPU; rc=$rc; $OUT/nccl.log)")
  fi
fi

echo "== summary"
echo "passed: ${PASSED[*]:-none}"
[ ${#LEFT_OUT[@]} -gt 0 ] && echo "left out (TESTS_ONLY): ${LEFT_OUT[*]}"
[ ${#RECORDED[@]} -gt 0 ] && echo "recorded, not checked: ${RECORDED[*]}"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "FAILED: ${FAILED[*]}"
  exit 1
fi
echo "all checks passed"
exit 0
