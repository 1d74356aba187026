#!/usr/bin/env bash
# The test command: sets up .venv + the package, builds and runs the C++
# GoogleTest suite, then the pytest suite (GPU tests skip without a GPU).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
echo "[tests] C++ core (GoogleTest)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2
ctest --test-dir build --output-on-failure -j2
echo "[tests] Python (pytest)"
python -m pytest -q "$@"
