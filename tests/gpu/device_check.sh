#!/usr/bin/env bash
# The GPU checks, in one run on a lent GPU machine (see tests/gpu/README.md). Run from the
# repository root with the wheels meshplan needs beyond the machine's image in .whl/ (duckdb,
# highspy, pyzmq); writes its logs and results under $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -z "${NO_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the repository root is the package: import it as `meshplan` through a link
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/meshplan && export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
{ date -u; nvidia-smi; python3 -c "import sys, torch, triton; print(sys.version); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); \
print('triton', triton.__version__); import meshplan; print('meshplan', meshplan.__file__)"; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
echo "== tests"; SECONDS=0
timeout "${TEST_S:-240}" python3 -m pytest -p no:cacheprovider -q -rs -p no:logging \
  tests/unit/test_kernels_triton.py tests/unit/test_kernels_registry.py \
  tests/dist/test_lower_kernels.py --junitxml "$OUT/tests.xml" > "$OUT/tests.log" 2>&1
echo "tests rc=$? in ${SECONDS}s"; tail -25 "$OUT/tests.log"
echo "== lowered step"; SECONDS=0
timeout 120 python3 benchmarks/lowered_step_gpu.py --steps 20 --json "$OUT/lowered_step.json" \
  > "$OUT/lowered_step.log" 2>&1
echo "lowered step rc=$? in ${SECONDS}s"; grep -v DEBUG "$OUT/lowered_step.log" | tail -8
[ -n "${TESTS_ONLY:-}" ] && exit 0
echo "== benchmark"; SECONDS=0
timeout "${BENCH_S:-150}" python3 benchmarks/kernels_gpu.py --json "$OUT/kernels_gpu.json" \
  --markdown "$OUT/kernels_gpu.md" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in ${SECONDS}s"; tail -45 "$OUT/bench.log"
echo "== nccl"; SECONDS=0
timeout 75 python3 tests/gpu/nccl_probe.py --timeout 30 > "$OUT/nccl.log" 2>&1
echo "nccl rc=$? in ${SECONDS}s"; cut -c1-600 "$OUT/nccl.log" | head -30
