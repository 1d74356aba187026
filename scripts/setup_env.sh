#!/usr/bin/env bash
# Creates .venv (if missing), installs the Python dependencies and builds and
# installs the fp8attn package into it. Idempotent; sourced by the other scripts.
# Env: FP8ATTN_VENV (default .venv), FP8ATTN_BUILD_CUDA (see setup.py),
# FP8ATTN_TORCH (pip requirement, default torch==2.11.*; read when the venv's
# dependencies are installed), FP8ATTN_BUILD_BASE (build the package there with
# `setup.py build` instead of installing it, and put it first on PYTHONPATH with
# FP8ATTN_SOURCE_TREE=0: a second venv sharing this tree, whose objects must not
# mix with build/, the first venv's; scripts/run_tests.sh's latest-torch job).
# PYTHON: the interpreter the venv is made from (default python3; the device scripts
# read the same variable, scripts/device_common.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FP8ATTN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.fp8attn-deps-v4"
if [ ! -f "$stamp" ]; then
  # NOTE (measured for torch 2.11.0+cu130, Python 3.11, x86_64): the wheels are ~2.8 GB (torch
  # 0.53 GB, its CUDA libraries and triton 2.2 GB, the rest ~0.1 GB), ~5 GB once installed;
  # 100 s for this whole script on a 2-core machine with a fast link. README.md quotes it.
  echo "[setup] installing Python dependencies (${FP8ATTN_TORCH:-torch==2.11.*}: a ~3 GB download, ~5 GB on disk)"
  # --no-cache-dir: the wheels are installed once per venv; caching them as well would
  # add their ~3 GB per torch to the disk this takes, and CI machines' free disk varies.
  python -m pip install -q --no-cache-dir --upgrade pip
  python -m pip install -q --no-cache-dir "${FP8ATTN_TORCH:-torch==2.11.*}" numpy ml-dtypes tokenizers matplotlib tqdm pytest setuptools wheel ninja transformers fla-core einops ruff
  touch "$stamp"
fi
# CMake/GoogleTest for the C++ suite (Debian packages; present on the dev image).
if ! command -v cmake >/dev/null 2>&1 || [ ! -d /usr/src/googletest ]; then
  echo "[setup] installing cmake and googletest from Debian"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq cmake g++ googletest libgtest-dev >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq cmake g++ googletest libgtest-dev >/dev/null; fi
fi
if [ -n "${FP8ATTN_BUILD_BASE:-}" ]; then
  echo "[setup] building fp8attn in $FP8ATTN_BUILD_BASE (torch $(python -c 'import torch; print(torch.__version__)'))"
  ( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-2}" python setup.py -q build --build-base "$FP8ATTN_BUILD_BASE" )
  lib="$(ls -d "$FP8ATTN_BUILD_BASE"/lib.*/ | head -1)"
  export PYTHONPATH="${lib%/}${PYTHONPATH:+:$PYTHONPATH}" FP8ATTN_SOURCE_TREE=0
else
  echo "[setup] building and installing fp8attn"
  ( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-2}" python -m pip install -q --no-build-isolation . )
fi
