#!/usr/bin/env bash
# The checks for a machine with a CUDA device (issue 33), one command:
#   bash benchmarks/gpu_check.sh            # on the GPU machine; results under $OUT (default ./gpu-check)
#   bash benchmarks/gpu_check.sh --dry-run  # here, on the CPU: the same checks with LINATTN_CHECK_DEVICE=cpu
# 1. tests/test_cuda.py: every operator family on the device in fp32 and bf16 against float64 on the CPU
#    (outputs, states, gradients), and linattn.compat.fla's handover to FLA's Triton kernels (same numbers);
# 2. benchmarks/gpu_check.py: linattn's torch path vs FLA's kernels vs SDPA (ms, % of the measured matmul
#    peak, agreement), and the one-token step against one copy of its state.
# Packages the GPU machine lacks travel as wheels in .whl/ (flash-linear-attention, fla-core: see
# ../.library/device/README.md); linattn itself runs from src/ (no install, so no build step there).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-check}
mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu-check-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-check-site:${PYTHONPATH:-}
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 LINATTN_NATIVE=0
if [ "${1:-}" = "--dry-run" ]; then
  export LINATTN_CHECK_DEVICE=cpu
  $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"; rc=${PIPESTATUS[0]}
  $PY benchmarks/gpu_check.py --dry-run --out "$OUT" 2>&1 | tee "$OUT/bench.log"; rb=${PIPESTATUS[0]}
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
  # FLA's Triton kernels compile and autotune on their first call (minutes for every family and dtype):
  # TESTS / BENCH_ARGS narrow a run to what a short lease allows
  timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py -k "${TESTS:-}" 2>&1 | tee "$OUT/tests.log"; rc=${PIPESTATUS[0]}
  timeout ${BENCH_TIMEOUT:-200} $PY benchmarks/gpu_check.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"; rb=${PIPESTATUS[0]}
fi
echo "tests exit $rc, benchmark exit $rb"
[ "$rc" = 0 ] && [ "$rb" = 0 ]
