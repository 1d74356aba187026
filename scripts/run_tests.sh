#!/usr/bin/env bash
# The test command: sets up .venv + the package (torch 2.11), builds and runs the C++
# GoogleTest suite, then the pytest suite (GPU tests skip without a GPU); then the
# same package and CPU pytest suite against the newest torch on PyPI in a second venv,
# .venv-torch-latest (created once with the newest torch of that day, ~3.5 min and
# ~6 GB with its CUDA libraries; the package is built in .venv-torch-latest/fp8attn-build,
# apart from build/). Arguments go to both pytest runs. FP8ATTN_LATEST_TORCH=0 skips
# the second job. Exits non-zero when any stage fails (both pytest runs always run).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
echo "[tests] C++ core (GoogleTest)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2
ctest --test-dir build --output-on-failure -j2
echo "[tests] Python (pytest), torch $(python -c 'import torch; print(torch.__version__)')"
rc=0
python -m pytest -q "$@" || rc=$?
if [ "${FP8ATTN_LATEST_TORCH:-1}" != 0 ]; then
  t0=$SECONDS
  deactivate
  latest_rc=0
  # A subshell: its venv and PYTHONPATH stay in it.
  (
    export FP8ATTN_VENV="$ROOT/.venv-torch-latest" FP8ATTN_TORCH=torch \
      FP8ATTN_BUILD_BASE="$ROOT/.venv-torch-latest/fp8attn-build" FP8ATTN_BUILD_CUDA=0
    source "$ROOT/scripts/setup_env.sh"
    cd "$ROOT"
    echo "[tests] Python (pytest, CPU), newest torch: $(python -c 'import torch; print(torch.__version__)'), fp8attn from $(python -c 'import fp8attn, os; print(os.path.dirname(fp8attn.__file__))')"
    python -m pytest -q -m "not gpu" "$@"
  ) || latest_rc=$?
  echo "[tests] newest-torch job: rc=$latest_rc, $((SECONDS - t0)) s"
  [ "$latest_rc" = 0 ] || rc=$latest_rc
fi
exit "$rc"
