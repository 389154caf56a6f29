#!/usr/bin/env bash
# The GPU machine's check, in one go: where a bundle in .gpu/ brings fbgemm-gpu and torchrec
# (install.sh into /tmp/site), install it; then, most important first,
#   0. benchmarks/stall.py: what a checkpoint costs the training loop, DCP beside it;
#   1. benchmarks/gpu.py: every optimizer x location x codec (benchmarks/results/gpu.json,
#      with stall.py's summary);
#   2. the GPU tests (pytest -m gpu) of the files that have them;
#   3. with CUDA hidden, CPU tests under this release set (torch 2.11, fbgemm-gpu 1.6,
#      torchrec 1.6.1), as a second set beside CI's pins.
# Each step has its own time limit; logs and gpu.json go to $OUT (or out/gpu_check here).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
if [ -f .gpu/install.sh ]; then  # else fbgemm-gpu and torchrec are installed already
  SMOKE=${SMOKE:-0} bash .gpu/install.sh >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 3; }
  tail -4 "$OUT/install.log"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

PYTHONWARNINGS=ignore timeout "${STALL_S:-360}" python3 benchmarks/stall.py --rounds "${ROUNDS:-2}" \
  --out gpu_stall >"$OUT/stall.log" 2>&1
echo "stall.py exit $?"
grep -E "^[a-z_0-9]+ +" "$OUT/stall.log" | tail -14
cp benchmarks/results/gpu_stall.json "$OUT/" 2>/dev/null
STALL_ARG=()
[ -f benchmarks/results/gpu_stall.json ] && STALL_ARG=(--stall benchmarks/results/gpu_stall.json)

PYTHONWARNINGS=ignore timeout "${GPU_BENCH_S:-300}" python3 benchmarks/gpu.py --workers "${WORKERS:-6}" \
  "${STALL_ARG[@]}" >"$OUT/gpu_bench.log" 2>&1
echo "gpu.py exit $?"
grep -E "^[a-z_]+/|cases run|    " "$OUT/gpu_bench.log" | cut -c1-220 | tail -80
cp benchmarks/results/gpu.json "$OUT/" 2>/dev/null

timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  tests/test_kernel_locations.py tests/test_fused_counters.py tests/test_state_codec.py \
  tests/test_cow_snapshot.py tests/test_device_encode.py tests/test_writer_process.py \
  tests/test_device_decode.py \
  >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"
tail -15 "$OUT/gpu_tests.log"

if [ -n "${CPU_TESTS:-}" ]; then
  CUDA_VISIBLE_DEVICES= timeout "${CPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider \
    -m "not gpu" -n 8 --dist loadfile $CPU_TESTS >"$OUT/cpu_tests.log" 2>&1
  echo "cpu tests (CUDA hidden) exit $?"
  tail -12 "$OUT/cpu_tests.log"
fi
