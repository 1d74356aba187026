#!/usr/bin/env bash
# The test command: sets up .venv + the package (torch 2.11), builds and runs the C++
# GoogleTest suite, then the pytest suite (GPU tests skip without a GPU); then the
# same package and CPU pytest suite against the newest torch on PyPI in a second venv,
# .venv-torch-latest (created once with the newest torch of that day, ~3.5 min and
# ~6 GB with its CUDA libraries; the package is built in .venv-torch-latest/fp8attn-build,
# apart from build/). Arguments go to both pytest runs. FP8ATTN_LATEST_TORCH=0 skips
# the second job. Exits non-zero when any stage fails (both pytest runs always run).
# Disk: the second venv needs ~10 GB free. When less is free and this run created .venv
# itself (a fresh clone, as in CI), .venv is removed after the first job to make room;
# otherwise the second job is skipped with a message saying so (and how much was free).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
first_venv="${FP8ATTN_VENV:-$ROOT/.venv}"
fresh_venv=0
[ -x "$first_venv/bin/python" ] || fresh_venv=1
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
  need_kb=$((10 * 1024 * 1024))
  free_kb() { df -Pk "$ROOT" | awk 'NR == 2 { print $4 }'; }
  if [ ! -x "$ROOT/.venv-torch-latest/bin/python" ] && [ "$(free_kb)" -lt "$need_kb" ] && [ "$fresh_venv" = 1 ]; then
    echo "[tests] $(( $(free_kb) / 1024 )) MB free, the newest-torch venv needs ~10 GB: removing $first_venv (made by this run)"
    rm -rf "$first_venv"
  fi
fi
if [ "${FP8ATTN_LATEST_TORCH:-1}" != 0 ] && [ ! -x "$ROOT/.venv-torch-latest/bin/python" ] \
    && [ "$(free_kb)" -lt "$need_kb" ]; then
  echo "[tests] newest-torch job SKIPPED: $(( $(free_kb) / 1024 )) MB free on $(df -P "$ROOT" | awk 'NR == 2 { print $6 }'), it needs ~10 GB (FP8ATTN_LATEST_TORCH=0 skips it on purpose)"
elif [ "${FP8ATTN_LATEST_TORCH:-1}" != 0 ]; then
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
