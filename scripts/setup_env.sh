#!/usr/bin/env bash
# Creates .venv (if missing), installs the Python dependencies and builds and
# installs the fp8attn package into it. Idempotent; sourced by the other scripts.
# Env: FP8ATTN_VENV (default .venv), FP8ATTN_BUILD_CUDA (see setup.py).
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
stamp="$VENV/.fp8attn-deps-v2"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing Python dependencies (torch 2.11 is ~0.5 GB plus its CUDA libraries)"
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.11.*" numpy ml-dtypes tokenizers matplotlib tqdm pytest setuptools wheel ninja transformers
  touch "$stamp"
fi
# CMake/GoogleTest for the C++ suite (Debian packages; present on the dev image).
if ! command -v cmake >/dev/null 2>&1 || [ ! -d /usr/src/googletest ]; then
  echo "[setup] installing cmake and googletest from Debian"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq cmake g++ googletest libgtest-dev >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq cmake g++ googletest libgtest-dev >/dev/null; fi
fi
echo "[setup] building and installing fp8attn"
( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-2}" python -m pip install -q --no-build-isolation . )
