#!/usr/bin/env bash
# Run HERE (a machine with network), before the device call of tools/gpu_check.sh: downloads into .whl/ the wheels
# the device machine lacks (it has no network and no megatron-core), checks each wheel's Requires-Dist against the
# device image's package list, and measures what the call will carry (the working tree + .whl: 64 MiB at most).
#
#   tools/gpu_check_prepare.sh            # then: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# Env: PYTHON (a python with pip; default .venv/bin/python, else python3), MCORE_VERSION (default 0.16.1, inside
# setup.py's range; its cp312 wheel exists), WHEEL_DIR (default .whl, ignored by .gitignore).
# The device image (KINDS.md, nvidia-h200): Python 3.12.3, torch 2.11.0+cu130, numpy, packaging, triton, pytest,
# hypothesis, pyarrow, transformers, tokenizers, safetensors, pyyaml, psutil, rich, matplotlib, tensorboard; no
# megatron-core, no ray, no verl, no Transformer Engine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
MCORE_VERSION=${MCORE_VERSION:-0.16.1}
WHEEL_DIR=${WHEEL_DIR:-.whl}
LIMIT_MIB=60  # the device tool's limit is 64 MiB for everything that travels; keep a margin
# Names the image already holds (KINDS.md's package list, the ones megatron-core or this project may ask for).
IMAGE_HAS="torch numpy packaging triton pytest hypothesis pyarrow transformers tokenizers safetensors pyyaml psutil
rich matplotlib tensorboard einops tqdm nvidia-ml-py setuptools wheel pybind11 ninja requests"
# Wheels to carry: NAME==VERSION, one version of each (two of one name stop the whole install there).
WHEELS=("megatron-core==${MCORE_VERSION}")

mkdir -p "$WHEEL_DIR"
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  file_prefix=$(echo "$name" | tr '-' '_')
  if compgen -G "$WHEEL_DIR/${file_prefix}-${spec##*==}-*.whl" > /dev/null; then
    echo "have $spec"
    continue
  fi
  for stale in "$WHEEL_DIR/${file_prefix}"-*.whl; do
    if [ -e "$stale" ]; then echo "removing another version: $stale"; rm -f "$stale"; fi
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEEL_DIR" "$spec"
done

echo "--- Requires-Dist of the carried wheels (extras left out) against the device image"
missing=0
for whl in "$WHEEL_DIR"/*.whl; do
  reqs=$("$PY" - "$whl" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            print(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0].lower().replace("_", "-"))
PY
)
  for req in $reqs; do
    if echo " $IMAGE_HAS " | tr '\n' ' ' | grep -q " $req "; then
      echo "$(basename "$whl"): needs $req (in the image)"
    elif compgen -G "$WHEEL_DIR/$(echo "$req" | tr '-' '_')-*.whl" > /dev/null; then
      echo "$(basename "$whl"): needs $req (carried)"
    else
      echo "$(basename "$whl"): needs $req: NOT in the image and not carried"; missing=1
    fi
  done
done

echo "--- what travels with the device call"
tree_bytes=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
wheel_bytes=$(du -cb "$WHEEL_DIR"/*.whl | tail -n 1 | cut -f1)
total=$((tree_bytes + wheel_bytes))
for whl in "$WHEEL_DIR"/*.whl; do
  awk -v f="$whl" -v b="$(stat -c %s "$whl")" 'BEGIN { printf "  %s  %.1f MiB\n", f, b / 1048576 }'
done
awk -v t="$tree_bytes" -v w="$wheel_bytes" 'BEGIN { m = 1048576;
  printf "working tree %.1f MiB + wheels %.1f MiB = %.1f MiB (limit 64 MiB)\n", t / m, w / m, (t + w) / m }'
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_check_prepare: over ${LIMIT_MIB} MiB: carry less"; exit 1
fi
[ "$missing" = 0 ] || { echo "gpu_check_prepare: a requirement is neither in the image nor carried"; exit 1; }
echo 'gpu_check_prepare: ready. Device call: run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=600)'
