#!/usr/bin/env bash
# The README's main job: set up .venv + fp8attn, fetch and tokenize the real-text
# corpus (Linux kernel docs from Debian's linux-doc-6.1), train the same GQA
# transformer with bf16 / fp8-stale / fp8-matched_do / fp8-delta_matching
# attention, print the comparison table and, last, the report path.
#
# CPU (no GPU): preset cpu-tiny, 300 steps per mode; ~4-5 min of training on 2 idle cores.
# GPU present:  preset gpu-50m (FP8ATTN_PRESET=gpu-125m for the larger one).
# Env knobs: FP8ATTN_PRESET, FP8ATTN_STEPS, FP8ATTN_MODES, FP8ATTN_RUN_DIR,
# FP8ATTN_TEXT_DIR (train on a directory of text files instead; no download).
# Extra arguments go to `python -m fp8attn.train.compare` (e.g. --steps 100).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"

if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  preset="${FP8ATTN_PRESET:-gpu-50m}"
else
  preset="${FP8ATTN_PRESET:-cpu-tiny}"
fi
# NOTE: the default is compare's (compare.DEFAULT_MODES: every mode of model.ATTN_MODES but the
# opt-in fp8-cudnn), read from it so the two cannot drift apart.
modes="${FP8ATTN_MODES:-$(python -c 'from fp8attn.train.compare import DEFAULT_MODES; print(",".join(DEFAULT_MODES))')}"
out="${FP8ATTN_RUN_DIR:-runs/main-$preset}"
steps=()
[ -n "${FP8ATTN_STEPS:-}" ] && steps=(--steps "$FP8ATTN_STEPS")

echo "[main] preset $preset, modes $modes -> $out"
# NOTE: the package is installed into .venv; run from ROOT so data/ and runs/ land here.
# compare prints the data/training times, the table and, last, the report path.
python -m fp8attn.train.compare --preset "$preset" --modes "$modes" --out "$out" ${steps[@]+"${steps[@]}"} "$@"
