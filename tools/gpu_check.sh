#!/usr/bin/env bash
# GPU check of the kernels (issue 6), one prepared script for a machine with an NVIDIA GPU (written for an H200):
#   1. build the CUDA + CPU extensions in place (csrc_build.py: sm_90 SASS + compute_90 PTX);
#   2. run the ops parity suite with the CUDA kernels (use_backend("cuda") runs under MEGATRON_PPO_OPS=kernels,
#      so a missing extension fails instead of testing the fallback), for both GAE algorithms (scan, serial);
#   3. run tools/bench_kernels.py --device cuda (GAE vs the loop and the bandwidth floor; log-prob memory/time);
#   4. append the GPU section to docs/bench/kernels.md.
# Logs, junit XML and the markdown go to $RESULTS_DIR (default: $OUT when run through the device tool, else
# ./gpu_check_results); on the device machine only $OUT comes back, so copy $OUT/kernels.md over
# docs/bench/kernels.md afterwards. Usage: tools/gpu_check.sh   (env: PYTHON, RESULTS_DIR, MAX_JOBS, SKIP_BENCH=1)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS_DIR:-${OUT:-gpu_check_results}}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 VERL_USE_EXTERNAL_PLUGINS=none
exec > >(tee "$RESULTS/gpu_check.log") 2>&1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
nvcc --version | tail -n 2 || true
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "torch sees no GPU"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(0),
      "| SMs", torch.cuda.get_device_properties(0).multi_processor_count)
PY

step "build (python setup.py build_ext --inplace)"
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py build_ext --inplace > "$RESULTS/build.log" 2>&1 \
  || { tail -n 60 "$RESULTS/build.log"; echo "BUILD FAILED"; exit 1; }
grep -E "csrc_build|warning" "$RESULTS/build.log" | grep -v "Wc++20-extensions" | tail -n 20 || true
"$PY" - <<'PY'
from megatron_ppo import ops
assert ops.backend("cuda") == "cuda", ops.unavailable_reason("cuda")
assert ops.backend("cpu") == "cpu", ops.unavailable_reason("cpu")
print("backends: cuda =", ops.backend("cuda"), "| cpu =", ops.backend("cpu"))
PY

step "parity suite with the CUDA kernels"
select=()
if ! "$PY" -c "import verl" 2>/dev/null; then
  echo "verl not installed here: verl-oracle tests deselected (they run on CPU in CI; CUDA is checked against"
  echo "the float64 oracle, algo and autograd, which the CPU suite ties to verl)"
  select=(-k "not verl")
fi
TESTS=(tests/unit/test_ops_gae.py tests/unit/test_ops_logprob.py tests/unit/test_ops_backend.py tests/unit/test_ops_build.py)
"$PY" -m pytest "${TESTS[@]}" -q -rfE -p no:cacheprovider "${select[@]}" --junitxml="$RESULTS/parity.xml" \
  || status=1
step "GAE parity with the serial CUDA algorithm"
MEGATRON_PPO_GAE_CUDA_ALGO=serial "$PY" -m pytest tests/unit/test_ops_gae.py -q -rfE -p no:cacheprovider \
  -k "cuda${select:+ and not verl}" --junitxml="$RESULTS/parity_gae_serial.xml" || status=1

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step "benchmarks"
  "$PY" tools/bench_kernels.py --device cuda --out "$RESULTS/kernels_gpu.md" || status=1
  if [ -s "$RESULTS/kernels_gpu.md" ]; then
    step "record: GPU section of docs/bench/kernels.md"
    "$PY" tools/bench_kernels.py --record-gpu "$RESULTS/kernels_gpu.md" --out docs/bench/kernels.md || status=1
    cp docs/bench/kernels.md "$RESULTS/kernels.md"
  fi
fi

step "done: status $status (results in $RESULTS)"
exit "$status"
