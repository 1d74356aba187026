#!/usr/bin/env bash
# Fetch the CUTLASS/CuTe headers (nvidia-cutlass wheel from PyPI, pinned) into
# third_party/cutlass/include (ignored by git). The sm_90a wgmma/TMA kernels
# include them; setup.py picks the folder up automatically, or from
# FP8ATTN_CUTLASS_INCLUDE. CPU-only builds do not need them. PYTHON: the interpreter
# that runs pip (default python3; the same variable as setup_env.sh and the device scripts).
set -euo pipefail
PYTHON="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VERSION="${CUTLASS_VERSION:-4.2.0.0}"
DEST="$ROOT/third_party/cutlass"
if [[ -f "$DEST/include/cute/tensor.hpp" && -f "$DEST/VERSION" && "$(cat "$DEST/VERSION")" == "$VERSION" ]]; then
  echo "CUTLASS $VERSION headers already in $DEST/include"; exit 0
fi
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m pip download --no-deps --only-binary=:all: -d "$TMP" "nvidia-cutlass==$VERSION" >/dev/null
"$PYTHON" - "$TMP" "$DEST" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "nvidia_cutlass-*.whl"))[0]
prefix = "cutlass_library/source/include/"
shutil.rmtree(dest, ignore_errors=True)
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(dest, "include", name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
echo "$VERSION" > "$DEST/VERSION"
echo "CUTLASS $VERSION headers in $DEST/include"
