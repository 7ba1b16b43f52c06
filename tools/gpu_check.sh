#!/usr/bin/env bash
# The GPU check of issue 23: one script for the device machine (one H200, no network, no megatron-core in its
# image) that proves the GPU path in at most 8 minutes of its own wall time.
#
# Device call (after tools/gpu_check_prepare.sh has put the wheels into .whl/ HERE):
#     run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)
# then, here:  bash tools/gpu_check.sh --record /work/.device/<files_at>   (writes docs/bench/gpu.md)
# A session has 15 minutes of device time, all tries together: a machine's start (1-2 min) + this run (<= 8 min)
# leave no room for a second full run. Rerun only what failed, at once while the machine is warm (the in-place build
# is kept there, ninja rebuilds nothing):
#     run(command='GPU_CHECK_ONLY="parity sanitizer" GPU_CHECK_BUDGET_S=240 bash tools/gpu_check.sh', carry=[".whl"])
# Issue 46's decode numbers first, in a call of their own (env, deps, decode: about 2 minutes, no build), after
# bash tools/gpu_check_prepare.sh here:
#     run(command='GPU_CHECK_ONLY=decode GPU_CHECK_BUDGET_S=200 bash tools/gpu_check.sh', carry=['.whl'], timeout_s=300)
#
# Stages (each under its own time budget, stopped with `timeout` when over it; the script goes on):
#   1 env        nvidia-smi, nvcc, torch / torch.version.cuda, Transformer Engine importable?, megatron-core version
#   2 deps       pip install --no-index --no-deps --target $GPU_CHECK_SITE .whl/*.whl (megatron-core), PYTHONPATH
#   3 build      python setup.py build_ext --inplace against the device's torch; ops.backend("cuda") == "cuda"
#   4 decode     tools/bench_decode.py: the Megatron engine's generation speed, 0.5 B Qwen2-shaped model in bf16 at
#                64x256 and 256x512: eager step (static_step=False) vs the static loop vs it as CUDA graphs; tokens/s,
#                ms per decode step against the bandwidth floor, host reads per step (issue 46); needs no build
#   5 parity     ops parity suite on the CUDA kernels with CUDA_LAUNCH_BLOCKING=1 (MEGATRON_PPO_OPS=kernels via
#                use_backend): test_ops_gae/logprob/backend + test_ops_cuda_edges (issue 23's edge rows), then GAE
#                again with the serial algorithm
#   6 models     tests/integration/test_models_gpu.py: TE vs local spec (where TE imports), varlen THD, generation
#   7 sanitizer  compute-sanitizer memcheck and racecheck on tools/gpu_sanitize_kernels.py (every kernel once)
#   8 nccl       tools/gpu_nccl_world.py: an NCCL world of 2 processes on the one GPU (or NCCL's refusal, recorded)
#   9 ppo_step   megatron_ppo/testing/gpu_step.py: bf16 PPO steps of a 0.5 B Qwen2-shaped model, actor + critic +
#                ref through the real workers in one process (launcher=local, device=cuda), 128 prompts x 256, every
#                role's micro-batches by a 16k-token budget: step time, tokens/s, MFU (the actor update's: issue 47's
#                goal), host reads per micro-batch, each role's peak memory; then, time allowing, the packed attention
#                strategies at 16k tokens (tools/bench_thd_attention.py: varlen, padded, flex, ...; "thd_attention")
#                and the same step at the 1.5 B shape (--arch qwen2-1.5b, 2 steps; "qwen2-1.5b" in ppo_step.json)
#  10 bench      tools/bench_kernels.py --device cuda
#  11 vllm       rollout.name=vllm vs megatron: the same PPO step (gpu_step --engine) at 256 prompts x 512 tokens,
#                generation tokens/s of each (issue 25's goal: vLLM >= 3x ours); skipped when the image has no
#                vLLM (the device has no network for make setup-vllm). Over the 480 s of a full run it is left out
#                of time: run it alone in a second call, GPU_CHECK_ONLY=vllm GPU_CHECK_BUDGET_S=420.
# (the brief's stage 4 is split into parity and models, so that each has its own budget)
#
# Results in $RESULTS_DIR (default: $OUT on the device machine, else ./gpu_check_results), at most 8 files, no
# folders (the device tool returns 8 files): gpu_check.log (this console), summary.md, results.json (stages, env,
# every measurement), logs.tar.gz (one log per stage, junit XML, sanitizer and build logs), ppo_step.json,
# kernels_gpu.md, engines.json (stage vllm: both engines' gpu_step results), decode.json (stage decode).
#
# Usage: tools/gpu_check.sh [--dry-run] [--only "parity sanitizer ..."]
#        tools/gpu_check.sh --record DIR [--out docs/bench/gpu.md] [--kernels-page docs/bench/kernels.md]
#        tools/gpu_check.sh --list
# --dry-run (or GPU_CHECK_DRY_RUN=1), for CPU machines and CI: the script parses (bash -n, shellcheck where
# installed), every stage runs its CPU side (environment report, the wheels installed for cp312 into a temp dir, the
# extension list, tools/bench_decode.py --dry-run (eager and static loops on a tiny fp32 model), the test files
# collect, the kernel script on the CPU kernels, the NCCL script's jobs in a gloo world of one, the PPO step's config
# and parameter count, bench_kernels loads) and then says 'skipped: no GPU'.
# --only: run these stages (env and deps always run, and build unless decode is all that is selected: the others
# need it); the rest 'skipped: not selected'.
# Env: PYTHON (default python3; a CPU dry run falls back to .venv/bin/python), RESULTS_DIR, GPU_CHECK_BUDGET_S
# (480), GPU_CHECK_SITE (/tmp/site), GPU_CHECK_ONLY, GPU_CHECK_PPO_ARGS (extra gpu_step arguments), MAX_JOBS.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SCRIPT="$ROOT/tools/gpu_check.sh"
cd "$ROOT" || exit 2

STAGES=(env deps build decode parity models sanitizer nccl ppo_step bench vllm)
# Per-stage budgets (s). They add up to more than the whole run's 480 s on purpose: each is a stage's ceiling, and a
# stage gets at most what is left of the 480 s (minus RESERVE_S); expected on an H200 about 400 s in all (build ~60-90,
# decode ~70, parity ~60, models ~30, sanitizer ~50, nccl ~15, ppo_step ~70, bench ~40).
declare -A BUDGET=([env]=30 [deps]=40 [build]=180 [decode]=90 [parity]=100 [models]=75 [sanitizer]=100 [nccl]=45
                   [ppo_step]=300 [bench]=75 [vllm]=360)
declare -A WHAT=(
  [env]="environment report"
  [deps]="megatron-core from the carried wheels"
  [build]="CUDA extension against the device's torch"
  [decode]="generation speed, 0.5 B bf16: eager step vs static loop vs CUDA graphs (tools/bench_decode.py, issue 46)"
  [parity]="ops parity suite on the CUDA kernels (CUDA_LAUNCH_BLOCKING=1), issue 23's edge rows"
  [models]="tests/integration/test_models_gpu.py (TE vs local spec, varlen THD, generation, a bf16 step after an HF load)"
  [sanitizer]="compute-sanitizer memcheck + racecheck on every kernel"
  [nccl]="NCCL world of 2 processes on the one GPU"
  [ppo_step]="bf16 PPO steps, 0.5 B (then 1.5 B) model, actor + critic + ref in one process: MFU, host reads"
  [bench]="tools/bench_kernels.py --device cuda"
  [vllm]="generation tokens/s, rollout.name=vllm vs megatron, 0.5 B model, 256 x 512"
)
ALWAYS=" env deps build "  # prerequisites: run even when --only names other stages
BUILD_FREE=" env deps decode "  # stages that need no CUDA extension: --only naming these alone leaves build out
RESERVE_S=10               # kept for the summary, the report and the log archive
SKIP_RC=77
PIPS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# ------------------------------------------------------------------------------------------------ helpers
skip() {  # inside a stage: report 'skipped: <why>' and leave it
  echo "SKIP: $*"
  [ -n "${GPU_CHECK_SKIP_FILE:-}" ] && echo "$*" > "$GPU_CHECK_SKIP_FILE"
  exit "$SKIP_RC"
}
fail() { echo "FAILED: $*"; exit 1; }
status_of() { awk -F'\t' -v s="$1" '$1 == s { print $2 }' "$WORK/stages.tsv" 2>/dev/null | tail -n 1; }
need() {  # need STAGE WHY: skip this stage unless STAGE was ok
  local st
  st=$(status_of "$1")
  [ "$st" = ok ] || skip "$2 (stage $1: ${st:-not run})"
}
build_needed() {  # does a stage --only selects need the CUDA extension? (build itself, named, does)
  local s
  for s in $ONLY; do
    [[ "$BUILD_FREE" == *" $s "* ]] || return 0
  done
  return 1
}
verl_filter() { "$PY" -c "import verl" 2>/dev/null && echo "" || echo " and not verl"; }

# ------------------------------------------------------------------------------------------------ stages
stage_env() {
  echo "repo: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git metadata here')"
  bash -n "$SCRIPT" || fail "tools/gpu_check.sh has a syntax error"
  echo "bash -n tools/gpu_check.sh: ok"
  if command -v shellcheck > /dev/null; then
    shellcheck -S warning "$SCRIPT" "$ROOT/tools/gpu_check_prepare.sh" || fail "shellcheck found problems"
    echo "shellcheck -S warning tools/gpu_check.sh tools/gpu_check_prepare.sh: clean"
  else
    echo "shellcheck: not installed"
  fi
  echo "host: $(uname -srm), $(nproc) CPUs, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,compute_cap --format=csv \
      || echo "nvidia-smi failed"
  else
    echo "nvidia-smi: not found"
  fi
  if command -v nvcc > /dev/null; then nvcc --version | tail -n 2; else echo "nvcc: not found"; fi
  echo "compute-sanitizer: $(sanitizer_path || echo 'not found')"
  "$PY" - "$WORK/env.json" "$DRY" <<'PY' || fail "python/torch environment"
import json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable}
import torch
out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
               gpu_memory_gib=round(p.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
               nccl=".".join(map(str, torch.cuda.nccl.version())))
import importlib.metadata as md, importlib.util as iu
for name, dist in (("megatron_core", "megatron-core"), ("transformers", "transformers"), ("triton", "triton")):
    try:  # the installed version, without importing (megatron-core: seconds); stage deps imports it
        out[name] = md.version(dist)
    except md.PackageNotFoundError:
        out[name] = "not installed"
if iu.find_spec("transformer_engine") is None:
    out["transformer_engine"] = "not installed"
else:
    try:
        import transformer_engine
        out["transformer_engine"] = getattr(transformer_engine, "__version__", "importable")
    except Exception as exc:  # noqa: BLE001 - the report says why
        out["transformer_engine"] = f"not importable: {type(exc).__name__}: {str(exc)[:160]}"
for k, v in out.items():
    print(f"{k}: {v}")
json.dump(out, open(sys.argv[1], "w"), indent=1)
if sys.argv[2] != "1" and not torch.cuda.is_available():
    sys.exit("torch sees no GPU")
PY
}

sanitizer_path() {
  local p
  for p in "$(command -v compute-sanitizer 2> /dev/null)" /usr/local/cuda/bin/compute-sanitizer \
           /usr/local/cuda/compute-sanitizer/compute-sanitizer /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -n "$p" ] && [ -x "$p" ] && { echo "$p"; return 0; }
  done
  return 1
}

stage_deps() {
  local wheels=()
  [ -d .whl ] && mapfile -t wheels < <(find .whl -maxdepth 1 -type f -name '*.whl' | sort)
  if [ ${#wheels[@]} -eq 0 ]; then
    if "$PY" -c "import megatron.core" 2> /dev/null; then
      "$PY" -c "import megatron.core as m; print('megatron-core', m.__version__, 'from', m.__file__)"
      return 0
    fi
    [ "$DRY" = 1 ] && skip "no .whl/ (run tools/gpu_check_prepare.sh first)"
    fail "megatron-core is not importable and no wheels were carried: run tools/gpu_check_prepare.sh here and call with carry=[\".whl\"]"
  fi
  printf 'carried: %s\n' "${wheels[@]}"
  local names
  names=$(printf '%s\n' "${wheels[@]##*/}" | cut -d- -f1 | sort | uniq -d)
  [ -z "$names" ] || fail "two versions of: $names (keep one of each)"
  if [ "$DRY" = 1 ]; then  # the device's install, for its Python 3.12, into a temp dir nothing imports
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
      --python-version 3.12 --implementation cp --only-binary=:all: "${PIPS[@]}" "${wheels[@]}" \
      || fail "pip install of the wheels"
    echo "dry run: installed for cp312 into $WORK/site: $(find "$WORK/site" -maxdepth 1 -name '*.dist-info' -printf '%f ')"
    return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
    || fail "pip install of the wheels into $SITE"
  "$PY" -c "import megatron.core as m; print('megatron-core', m.__version__, 'from', m.__file__)" \
    || fail "megatron.core does not import after the install (PYTHONPATH=$PYTHONPATH)"
}

stage_build() {
  if [ "$DRY" = 1 ]; then
    "$PY" -c "import csrc_build; m, _ = csrc_build.extensions(); print('extensions:', [e.name for e in m])" \
      || fail "csrc_build.extensions() (what setup.py builds)"
    skip "no GPU (csrc_build.extensions() loads; the CUDA extension is built where torch has CUDA and nvcc)"
  fi
  echo "MAX_JOBS=$MAX_JOBS $PY setup.py build_ext --inplace (full output: logs/build_ext.log)"
  if ! "$PY" setup.py build_ext --inplace > "$WORK/logs/build_ext.log" 2>&1; then
    tail -n 80 "$WORK/logs/build_ext.log"
    fail "python setup.py build_ext --inplace"
  fi
  grep -E "csrc_build|warning" "$WORK/logs/build_ext.log" | grep -v "Wc++20-extensions" | tail -n 20
  "$PY" - <<'PY' || fail "the CUDA extension is not the cuda backend"
from megatron_ppo import ops
assert ops.backend("cuda") == "cuda", ops.unavailable_reason("cuda")
assert ops.backend("cpu") == "cpu", ops.unavailable_reason("cpu")
import megatron_ppo._kernels_cuda as k
print("backends: cuda =", ops.backend("cuda"), "| cpu =", ops.backend("cpu"), "|", k.__file__)
PY
  if command -v cuobjdump > /dev/null; then
    cuobjdump --list-elf ./megatron_ppo/_kernels_cuda*.so 2> /dev/null | sed 's/^/  /' | head -n 6
  fi
}

stage_decode() {
  if [ "$DRY" = 1 ]; then
    "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('megatron') is None)" \
      || skip "megatron-core is not importable here"
    "$PY" tools/bench_decode.py --dry-run --out "$WORK/decode_dry.json" > "$WORK/logs/decode_dry.log" 2>&1 \
      || { tail -n 40 "$WORK/logs/decode_dry.log"; fail "tools/bench_decode.py --dry-run"; }
    grep -E '^(\||- |bench_decode:)' "$WORK/logs/decode_dry.log"
    skip "no GPU (tools/bench_decode.py --dry-run timed the eager and static loops on a tiny fp32 model on the CPU)"
  fi
  need deps "megatron-core not importable"
  "$PY" tools/bench_decode.py --out "$RESULTS/decode.json" --deadline-s $(( ${GPU_CHECK_STAGE_BUDGET:-90} - 20 )) \
    || fail "tools/bench_decode.py (what it measured is in decode.json)"
}

PARITY_FILES=(tests/unit/test_ops_gae.py tests/unit/test_ops_logprob.py tests/unit/test_ops_backend.py
              tests/unit/test_ops_cuda_edges.py)
stage_parity() {
  if [ "$DRY" = 1 ]; then
    "$PY" -m pytest --collect-only -q -p no:cacheprovider "${PARITY_FILES[@]}" > "$WORK/logs/parity_collect.log" 2>&1 \
      || { tail -n 30 "$WORK/logs/parity_collect.log"; fail "the parity suite does not collect"; }
    skip "no GPU (the suite collects: $(grep -cE '::' "$WORK/logs/parity_collect.log") tests on this machine's backends)"
  fi
  need build "no CUDA extension"
  local filter rc=0
  filter=$(verl_filter)
  [ -n "$filter" ] && echo "verl not installed here: its oracle tests are deselected (they run on the CPU in CI)"
  CUDA_LAUNCH_BLOCKING=1 "$PY" -m pytest "${PARITY_FILES[@]}" -q -rfE -p no:cacheprovider \
    -k "(cuda or ops_backend)$filter" --junitxml="$WORK/logs/parity.xml" || rc=1
  echo "--- GAE again with the serial CUDA algorithm"
  CUDA_LAUNCH_BLOCKING=1 MEGATRON_PPO_GAE_CUDA_ALGO=serial "$PY" -m pytest tests/unit/test_ops_gae.py \
    -q -rfE -p no:cacheprovider -k "cuda$filter" --junitxml="$WORK/logs/parity_gae_serial.xml" || rc=1
  [ $rc = 0 ] || fail "parity tests failed"
}

stage_models() {
  if [ "$DRY" = 1 ]; then
    "$PY" -m pytest --collect-only -q -p no:cacheprovider tests/integration/test_models_gpu.py \
      > "$WORK/logs/models_collect.log" 2>&1 || { tail -n 30 "$WORK/logs/models_collect.log"; fail "collect"; }
    skip "no GPU (tests/integration/test_models_gpu.py collects: $(grep -cE '::' "$WORK/logs/models_collect.log") tests)"
  fi
  need deps "megatron-core not importable"
  "$PY" -m pytest tests/integration/test_models_gpu.py -q -rfEs -p no:cacheprovider -m gpu \
    --junitxml="$WORK/logs/models.xml" || fail "model tests failed"
}

stage_sanitizer() {
  if [ "$DRY" = 1 ]; then
    "$PY" tools/gpu_sanitize_kernels.py --device cpu || fail "the kernel script on the CPU kernels"
    skip "no GPU (tools/gpu_sanitize_kernels.py ran and checked every call on the CPU kernels)"
  fi
  need build "no CUDA extension"
  local cs tool rc=0 t refused=""
  cs=$(sanitizer_path) || skip "compute-sanitizer not found on this machine"
  "$cs" --version | tail -n 1
  for tool in memcheck racecheck; do
    t=$(( (${GPU_CHECK_STAGE_BUDGET:-100} - 10) / 2 ))
    echo "--- $tool (limit ${t}s; PYTORCH_NO_CUDA_MEMORY_CACHING=1: one cudaMalloc per tensor)"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 5 "$t" "$cs" --tool "$tool" --error-exitcode 86 --print-limit 20 \
      "$PY" tools/gpu_sanitize_kernels.py > "$WORK/logs/sanitizer_$tool.log" 2>&1
    local this=$?
    grep -E "^=========|gpu_sanitize_kernels:|Error|error" "$WORK/logs/sanitizer_$tool.log" | tail -n 25
    if grep -q "Device not supported" "$WORK/logs/sanitizer_$tool.log"; then refused=$tool; fi
    case $this in
      0) echo "$tool: clean" ;;
      124 | 137) echo "$tool: timed out after ${t}s"; rc=1 ;;
      86) echo "$tool: reported errors"; rc=1 ;;
      *) echo "$tool: exit $this"; rc=1 ;;
    esac
  done
  [ -z "$refused" ] || skip "compute-sanitizer refused the device ('Device not supported': a gVisor runtime)"
  [ $rc = 0 ] || fail "compute-sanitizer"
}

stage_nccl() {
  if [ "$DRY" = 1 ]; then
    "$PY" tools/gpu_nccl_world.py --dry-run > /dev/null || fail "tools/gpu_nccl_world.py's jobs in a gloo world of one"
    skip "no GPU (both jobs ran in a gloo world of one on the CPU)"
  fi
  "$PY" tools/gpu_nccl_world.py --timeout 15 --out "$WORK/nccl.json"  # start + job within the 45 s budget
}

stage_ppo_step() {
  if [ "$DRY" = 1 ]; then
    "$PY" -m megatron_ppo.testing.gpu_step --dry-run --out "$WORK/ppo_step_dry.json" || fail "gpu_step config"
    "$PY" -m megatron_ppo.testing.gpu_step --dry-run --arch qwen2-1.5b > /dev/null || fail "gpu_step 1.5 B config"
    skip "no GPU (config built and validated, parameter count checked)"
  fi
  need deps "megatron-core not importable"
  local s0=$SECONDS
  # shellcheck disable=SC2086 # GPU_CHECK_PPO_ARGS is a list of arguments
  "$PY" -m megatron_ppo.testing.gpu_step --out "$RESULTS/ppo_step.json" --workdir "$WORK/ppo" \
    ${GPU_CHECK_PPO_ARGS:-} || fail "PPO step"
  local left=$(( ${GPU_CHECK_STAGE_BUDGET:-300} - (SECONDS - s0) ))
  [ "$left" -ge 60 ] || { echo "THD strategies and the 1.5 B case left out: ${left}s of the stage left"; return 0; }
  timeout -k 5 $((left < 120 ? left - 5 : 115)) "$PY" tools/bench_thd_attention.py --shape qwen2.5-0.5b \
    --tokens 16384 --iters 3 --json "$WORK/thd.json" && merge_ppo thd_attention "$WORK/thd.json"
  left=$(( ${GPU_CHECK_STAGE_BUDGET:-300} - (SECONDS - s0) ))
  [ "$left" -ge 100 ] || { echo "1.5 B case left out: ${left}s of the stage left"; return 0; }
  timeout -k 5 $((left - 5)) "$PY" -m megatron_ppo.testing.gpu_step --arch qwen2-1.5b --steps 2 \
    --out "$WORK/ppo_1p5b.json" --workdir "$WORK/ppo_1p5b" && merge_ppo qwen2-1.5b "$WORK/ppo_1p5b.json"
  return 0
}

merge_ppo() {  # merge_ppo KEY FILE: FILE's JSON under KEY in ppo_step.json (the results are at most 8 files)
  "$PY" - "$RESULTS/ppo_step.json" "$1" "$2" <<'PYEOF' || echo "($1 not merged into ppo_step.json)"
import json, sys
path, key, extra = sys.argv[1:4]
main = json.load(open(path))
main[key] = json.load(open(extra))
json.dump(main, open(path, "w"), indent=1, default=str)
PYEOF
}

stage_bench() {
  if [ "$DRY" = 1 ]; then
    "$PY" tools/bench_kernels.py --help > /dev/null || fail "tools/bench_kernels.py does not load"
    skip "no GPU (tools/bench_kernels.py loads)"
  fi
  need build "no CUDA extension"
  "$PY" tools/bench_kernels.py --device cuda --out "$RESULTS/kernels_gpu.md" || fail "bench_kernels"
}

stage_vllm() {
  local eng args=(--batch 256 --response-length 512 --steps 2)
  if [ "$DRY" = 1 ]; then
    for eng in megatron vllm; do
      "$PY" -m megatron_ppo.testing.gpu_step --dry-run --engine "$eng" "${args[@]}" > /dev/null \
        || fail "gpu_step --engine $eng config"
    done
    skip "no GPU (both engines' configs built and validated)"
  fi
  need deps "megatron-core not importable"
  "$PY" -c "import vllm" 2> /dev/null || skip "vLLM is not installed in the image's Python (no network here)"
  for eng in megatron vllm; do
    "$PY" -m megatron_ppo.testing.gpu_step --engine "$eng" "${args[@]}" --out "$WORK/engine_$eng.json" \
      --workdir "$WORK/ppo_$eng" || fail "PPO steps with rollout.name=$eng"
  done
  "$PY" tools/gpu_check_report.py engines "$WORK/engine_megatron.json" "$WORK/engine_vllm.json" \
    --out "$RESULTS/engines.json" || fail "engines.json"
}

# ------------------------------------------------------------------------------------------------ driver
run_all() {
  local start=$SECONDS n=0 name t left log rc dt st ok=0 failed=0 skipped=0
  echo "gpu_check: $([ "$DRY" = 1 ] && echo 'DRY RUN, ')python $PY, results in $RESULTS, budget ${TOTAL_BUDGET}s" \
       "($(date -u +%FT%TZ))"
  : > "$WORK/stages.tsv"
  for name in "${STAGES[@]}"; do
    n=$((n + 1))
    log="$WORK/logs/$(printf '%02d' "$n")_$name.log"
    left=$((TOTAL_BUDGET - (SECONDS - start) - RESERVE_S))
    t=${BUDGET[$name]}
    [ "$left" -lt "$t" ] && t=$left
    [ "$t" -lt 0 ] && t=0
    echo
    echo "=== [$n/${#STAGES[@]}] $name: ${WHAT[$name]} (budget ${t}s, $(date +%T))"
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && [[ "$ALWAYS" != *" $name "* ]]; then
      st="skipped: not selected (--only)"; dt=0
    elif [ "$name" = build ] && [ -n "$ONLY" ] && ! build_needed; then
      st="skipped: not needed by the selected stages (--only $ONLY)"; dt=0
    elif [ "$t" -lt 5 ]; then
      st="skipped: out of time (${TOTAL_BUDGET}s budget spent)"; dt=0
    else
      rm -f "$WORK/$name.skip"
      local s0=$SECONDS
      GPU_CHECK_SKIP_FILE="$WORK/$name.skip" GPU_CHECK_STAGE_BUDGET=$t \
        timeout -k 10 "$t" bash "$SCRIPT" --stage "$name" 2>&1 | tee "$log"
      rc=${PIPESTATUS[0]}
      dt=$((SECONDS - s0))
      case $rc in
        0) st=ok ;;
        "$SKIP_RC") st="skipped: $(head -n 1 "$WORK/$name.skip" 2> /dev/null || echo 'no reason given')" ;;
        124 | 137) st="timed out after ${t}s" ;;
        *) st="FAILED (exit $rc)" ;;
      esac
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$st" "$dt" "$t" >> "$WORK/stages.tsv"
    echo "--- $name: $st (${dt}s)"
  done
  local elapsed=$((SECONDS - start))
  "$PY" tools/gpu_check_report.py summarize --work "$WORK" --results "$RESULTS" --elapsed "$elapsed" \
    --budget "$TOTAL_BUDGET" --dry-run "$DRY" > /dev/null || echo "(summary.md / results.json not written)"
  tar -czf "$RESULTS/logs.tar.gz" -C "$WORK" --exclude ./site --exclude ./ppo --exclude './ppo_*' . 2> /dev/null \
    || echo "(logs.tar.gz not written)"
  echo
  echo "gpu_check summary:"
  n=0
  while IFS=$'\t' read -r name st dt t; do
    n=$((n + 1))
    printf '  %d %-10s %-s (%ss of %ss)\n' "$n" "$name" "$st" "$dt" "$t"
    case $st in ok) ok=$((ok + 1)) ;; skipped*) skipped=$((skipped + 1)) ;; *) failed=$((failed + 1)) ;; esac
  done < "$WORK/stages.tsv"
  elapsed=$((SECONDS - start))
  echo "gpu_check: $ok ok, $failed failed, $skipped skipped in $elapsed s"
  [ "$failed" = 0 ]
}

usage() { sed -n '2,/^set -uo/p' "$SCRIPT" | sed '$d; s/^# \{0,1\}//'; }

main() {
  DRY=${GPU_CHECK_DRY_RUN:-0}  # the stages (child processes) read it from there too
  ONLY=${GPU_CHECK_ONLY:-}
  local stage="" record=""
  local rest=()
  while [ $# -gt 0 ]; do
    case $1 in
      --dry-run) DRY=1 ;;
      --only) ONLY=$2; shift ;;
      --stage) stage=$2; shift ;;
      --record) record=$2; shift ;;
      --list) for s in "${STAGES[@]}"; do printf '%s\t%s\t%s\n' "$s" "${BUDGET[$s]}" "${WHAT[$s]}"; done; return 0 ;;
      -h | --help) usage; return 0 ;;
      *) rest+=("$1") ;;
    esac
    shift
  done
  if [ -z "${PYTHON:-}" ]; then
    PY=python3
    if ! python3 -c "import torch" 2> /dev/null && [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; fi
  else
    PY=$PYTHON
  fi
  PYTHON=$PY GPU_CHECK_DRY_RUN=$DRY
  export PY PYTHON DRY GPU_CHECK_DRY_RUN
  if [ -n "$record" ]; then
    "$PY" tools/gpu_check_report.py record "$record" "${rest[@]}"
    return
  fi
  [ ${#rest[@]} -eq 0 ] || { echo "gpu_check.sh: unknown arguments: ${rest[*]} (see --help)"; return 2; }
  if [ -n "$stage" ]; then
    declare -F "stage_$stage" > /dev/null || { echo "no stage $stage"; return 2; }
    "stage_$stage"
    return
  fi
  RESULTS=${RESULTS_DIR:-${OUT:-gpu_check_results}}
  mkdir -p "$RESULTS"
  RESULTS=$(cd "$RESULTS" && pwd)
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
  mkdir -p "$WORK/logs"
  TOTAL_BUDGET=${GPU_CHECK_BUDGET_S:-480}
  SITE=${GPU_CHECK_SITE:-/tmp/site}
  MAX_JOBS=${MAX_JOBS:-$(nproc)}
  export RESULTS WORK SITE MAX_JOBS PYTHONUNBUFFERED=1 VERL_USE_EXTERNAL_PLUGINS=none HYPOTHESIS_PROFILE=ci
  if [ "$DRY" != 1 ]; then
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  run_all 2>&1 | tee "$RESULTS/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  rm -rf "$WORK"
  return "$rc"
}

main "$@"
