#!/usr/bin/env bash
# The GPU machine's check, in one go: where a bundle in .gpu/ brings fbgemm-gpu and torchrec
# (install.sh into /tmp/site), install it; then, most important first,
#   0. FIRST_TESTS (default: the device decode's tests, pytest -m gpu): about 10 s with a
#      warm Triton cache, over 80 s on a fresh machine (every kernel variant compiles);
#   1. benchmarks/stall.py: what a checkpoint costs the training loop, DCP beside it
#      (STALL_PHASES: only these phases; STALL_OUT: the result's name, default gpu_stall);
#   2. benchmarks/gpu.py: every optimizer x location x codec (benchmarks/results/gpu.json,
#      with stall.py's summary; WITHOUT_FIX=0 skips the cases run without the cache fix;
#      GPU_BENCH_S=0 skips it);
#   3. the other GPU tests (pytest -m gpu) of the files that have them;
#   4. with CUDA hidden, CPU tests under this release set (torch 2.11, fbgemm-gpu 1.6,
#      torchrec 1.6.1), as a second set beside CI's pins.
# Each step has its own time limit; logs and results go to $OUT (or out/gpu_check here).
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
python3 -c "import triton; print('triton', triton.__version__)"

FIRST_TESTS=${FIRST_TESTS:-tests/test_device_decode.py}
timeout "${FIRST_TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs $FIRST_TESTS \
  >"$OUT/first_tests.log" 2>&1
echo "first tests exit $?"
tail -8 "$OUT/first_tests.log"

STALL_OUT=${STALL_OUT:-gpu_stall}
PHASE_ARG=()
[ -n "${STALL_PHASES:-}" ] && PHASE_ARG=(--phases $STALL_PHASES)
PYTHONWARNINGS=ignore timeout "${STALL_S:-360}" python3 benchmarks/stall.py --rounds "${ROUNDS:-2}" \
  "${PHASE_ARG[@]}" --out "$STALL_OUT" --copy-to "$OUT/$STALL_OUT.json" >"$OUT/stall.log" 2>&1
echo "stall.py exit $?"
grep -E "^[a-z_0-9]+ +" "$OUT/stall.log" | tail -16
STALL_ARG=()
[ -f "benchmarks/results/$STALL_OUT.json" ] && STALL_ARG=(--stall "benchmarks/results/$STALL_OUT.json")

if [ "${GPU_BENCH_S:-300}" != 0 ]; then
  FIX_ARG=()
  [ "${WITHOUT_FIX:-1}" = 0 ] && FIX_ARG=(--no-without-fix)
  PYTHONWARNINGS=ignore timeout "${GPU_BENCH_S:-300}" python3 benchmarks/gpu.py \
    --workers "${WORKERS:-6}" "${FIX_ARG[@]}" "${STALL_ARG[@]}" >"$OUT/gpu_bench.log" 2>&1
  echo "gpu.py exit $?"
  grep -E "^[a-z_]+/|cases run|    " "$OUT/gpu_bench.log" | cut -c1-220 | tail -80
  cp benchmarks/results/gpu.json "$OUT/" 2>/dev/null
fi

timeout "${GPU_TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
  ${GPU_TESTS:-tests/test_kernel_locations.py tests/test_fused_counters.py \
  tests/test_state_codec.py tests/test_cow_snapshot.py tests/test_device_encode.py \
  tests/test_writer_process.py} >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $?"
tail -15 "$OUT/gpu_tests.log"

if [ -n "${CPU_TESTS:-}" ]; then
  CUDA_VISIBLE_DEVICES= timeout "${CPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider \
    -m "not gpu" -n 8 --dist loadfile $CPU_TESTS >"$OUT/cpu_tests.log" 2>&1
  echo "cpu tests (CUDA hidden) exit $?"
  tail -12 "$OUT/cpu_tests.log"
fi
