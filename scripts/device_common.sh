# Sourced by the device scripts (device_all.sh, device_ab.sh, device_ncu.sh,
# device_ncu_compare.sh, device_linear.sh, device_fquant.sh, device_harness_smoke.sh,
# results_study.sh, seeds_study.sh): the set-up they share.
# The study_* functions share note / say / LOG (study_logs sets them).
#
# PYTHON: the interpreter every one of those scripts runs, for each Python step
# (pytest, setup.py, python -m fp8attn.train.*, the inline checks); default python3,
# the GPU machine's system Python that has torch. Override it for another one, e.g.
#   PYTHON=/opt/venv/bin/python bash scripts/seeds_study.sh
# (scripts/setup_env.sh reads the same variable for the Python it makes .venv from).
# Exported, so commands the scripts hand to `bash -c` (device_ab.sh's AB_EXTRA) see it.
export PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "device_common.sh: PYTHON=$PYTHON: no such interpreter (unset PYTHON for python3)" >&2
  exit 2
fi

# device_setup NAME: cd to the repository root (ROOT), OUT defaults to $ROOT/NAME
# (the device's `run` sets OUT itself), python/ on PYTHONPATH, unbuffered output.
device_setup() {
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$ROOT" || exit 1
  OUT="${OUT:-$ROOT/$1}"
  mkdir -p "$OUT"
  export PYTHONPATH="$ROOT/python" PYTHONUNBUFFERED=1
}

# summary_init: a fresh $OUT/summary.txt (SUMMARY) and note MSG, which prints MSG and
# appends it there (device_all.sh, device_ncu.sh, device_ncu_compare.sh).
summary_init() {
  SUMMARY="$OUT/summary.txt"
  : >"$SUMMARY"
  note() { echo "$*" | tee -a "$SUMMARY"; }
}

# use_carried_so: the CUDA build carried to the device in .devbuild/lib (see
# device_all.sh) replaces the in-place extension; CARRIED_SO names it. Returns 1
# (and leaves python/fp8attn alone) when nothing was carried.
use_carried_so() {
  CARRIED_SO="$(ls .devbuild/lib/fp8attn/_C*.so 2>/dev/null | head -1)"
  [ -n "$CARRIED_SO" ] || return 1
  rm -f python/fp8attn/_C*.so
  cp "$CARRIED_SO" python/fp8attn/
}

# device_library: the CUDA library the device scripts test (DEVICE_LIB, default native):
# native builds it here in place (FP8ATTN_BUILD_CUDA=1 MAX_JOBS=16 $PYTHON setup.py
# build_ext --inplace, log in $OUT/build.log; needs the carried third_party/cutlass
# headers: the device has no network), carried copies the CPU machine's build from
# .devbuild/lib (use_carried_so). Sets LIB_NOTE (one line); returns 1 after a note
# saying why when there is no loading library with CUDA kernels.
device_library() {
  local mode="${DEVICE_LIB:-native}" t0
  case "$mode" in
    carried)
      use_carried_so || { note "DEVICE_LIB=carried: no .devbuild/lib/fp8attn/_C*.so carried"; return 1; }
      LIB_NOTE="library: carried prebuilt $(basename "$CARRIED_SO")";;
    native)
      if [ -z "${FP8ATTN_CUTLASS_INCLUDE:-}" ] && [ ! -f third_party/cutlass/include/cute/tensor.hpp ]; then
        note "native build: no CUTLASS headers in third_party/cutlass/include: carry third_party (scripts/get_cutlass.sh)"
        return 1
      fi
      rm -f python/fp8attn/_C*.so
      t0=$SECONDS
      if ! FP8ATTN_BUILD_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$PYTHON" setup.py build_ext --inplace >"${OUT:-/tmp}/build.log" 2>&1; then
        tail -40 "${OUT:-/tmp}/build.log"; note "native build FAILED (build.log)"; return 1
      fi
      LIB_NOTE="library: built here in $((SECONDS - t0)) s with CXX=${CXX:-c++} ($("${CXX:-c++}" --version 2>&1 | head -1)); $(grep -m1 'fp8attn build: .* links' "${OUT:-/tmp}/build.log")";;
    *) note "DEVICE_LIB=$mode: expected native or carried"; return 1;;
  esac
  if ! has_cuda_kernels 2>/tmp/fp8attn_load.log; then
    tail -5 /tmp/fp8attn_load.log; note "$LIB_NOTE: does not load with CUDA kernels"; return 1
  fi
}

# library_linkage: one line, the libstdc++ the in-place library links (ldd | grep libstdc),
# or a warning that it has none (its own static C++ runtime: errors crash).
library_linkage() {
  local so l
  so="$(ls python/fp8attn/_C*.so 2>/dev/null | head -1)"
  l="$(ldd "$so" 2>/dev/null | grep libstdc | tr -s ' \t' ' ')"
  echo "linkage: ${l:-NO libstdc++.so.6 in ldd $(basename "$so") (static C++ runtime: C++ errors crash)}"
}

# install_cudnn_frontend: the cuDNN FP8 baseline of bench_gpu.py needs the cuDNN
# frontend (pip nvidia-cudnn-frontend; the device has no network): install the
# carried .whl/nvidia_cudnn_frontend-*-cp3XY-*.whl matching this python into
# /tmp/cudnn_fe (no system site-packages change; libcudnn is torch's) and put it on
# PYTHONPATH. Sets CUDNN_FE_NOTE (one line); no wheel or a failed install is not
# an error (the columns say n/a). NOTE: call it directly, not in a pipeline (the
# export must reach this shell).
install_cudnn_frontend() {
  local xy
  xy=$("$PYTHON" -c 'import sys; print(sys.version_info[1])')
  install_carried_wheel ".whl/nvidia_cudnn_frontend-*-cp3$xy-*.whl" /tmp/cudnn_fe "cudnn frontend" \
    "cuDNN FP8 columns n/a"
  CUDNN_FE_NOTE=$WHEEL_NOTE
}

# install_torchao: the torchao baseline of bench_train.py (torchao/<recipe> configs) and
# bench_linear_gpu.py needs torchao (optional; the device has no network): install the
# carried .whl/torchao-*.whl (pure-Python float8; abi3) into /tmp/torchao with --no-deps
# and put it on PYTHONPATH. Sets TORCHAO_NOTE (one line); no wheel or a failed install is
# not an error (those configs say n/a). NOTE: call it directly, not in a pipeline.
install_torchao() {
  install_carried_wheel ".whl/torchao-*.whl" /tmp/torchao torchao "torchao configs n/a"
  TORCHAO_NOTE=$WHEEL_NOTE
}

# install_carried_wheel GLOB DIR NAME WITHOUT: pip-installs the first carried wheel matching
# GLOB into DIR (--no-deps --no-index: the device has no network) and puts DIR on PYTHONPATH;
# WHEEL_NOTE says what happened (WITHOUT: what a run lacks when no wheel was carried). A
# missing wheel or a failed install is not an error.
install_carried_wheel() {
  local whl
  # shellcheck disable=SC2086
  whl=$(ls $1 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    WHEEL_NOTE="$3: no $1 carried ($4)"
  elif "$PYTHON" -m pip install --no-deps --no-index --upgrade --quiet --target "$2" "$whl" \
       >"$2_pip.log" 2>&1; then
    export PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}"
    WHEEL_NOTE="$3: $(basename "$whl") -> $2"
  else
    WHEEL_NOTE="$3: pip install failed: $(tail -1 "$2_pip.log")"
  fi
}

# has_cuda_kernels: status 0 when the importable fp8attn has its CUDA kernels.
has_cuda_kernels() {
  "$PYTHON" -c "import fp8attn, sys; sys.exit(0 if fp8attn._lib.HAS_CUDA_KERNELS else 1)"
}

# torch_versions: one line of python / torch / CUDA / cuDNN versions.
torch_versions() {
  "$PYTHON" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
}

# study_logs NAME: fresh $OUT/NAME (LOG, everything) and $OUT/summary.txt
# (SUMMARY, the notes); note MSG goes to both and stdout, say MSG to LOG and stdout.
study_logs() {
  LOG="$OUT/$1"
  SUMMARY="$OUT/summary.txt"
  : >"$LOG"
  : >"$SUMMARY"
  note() { echo "$*" | tee -a "$SUMMARY" >>"$LOG"; echo "$*"; }
  say() { echo "$*" | tee -a "$LOG"; }
}

# study_library GPU: the fp8attn library of a training study (results_study.sh,
# seeds_study.sh). GPU=1: the carried CUDA build, else the in-place CUDA build an
# earlier call of the same hold left in python/fp8attn (device_all.sh's native
# build; a build inside the study would eat its window); else the CPU extension,
# built in place when missing. Returns 1 after a note saying why.
study_library() {
  if [ "$1" = 1 ]; then
    if use_carried_so; then
      if ! has_cuda_kernels >>"$LOG" 2>&1; then
        note "carried $(basename "$CARRIED_SO") does not load with CUDA kernels"; tail -5 "$LOG"; return 1
      fi
      note "library: carried $(basename "$CARRIED_SO") (CUDA kernels)"
    elif ls python/fp8attn/_C*.so >/dev/null 2>&1 && has_cuda_kernels >>"$LOG" 2>&1; then
      note "library: the in-place CUDA build of an earlier call ($(ls python/fp8attn/_C*.so | head -1))"
    else
      note "no carried .devbuild/lib/fp8attn/_C*.so and no in-place CUDA build (run DEVICE_LIB=native" \
           "scripts/device_all.sh first in the same hold; a build here would eat the window)"
      return 1
    fi
  else
    if ! "$PYTHON" -c "import fp8attn" >>"$LOG" 2>&1; then
      say "building the CPU extension in place"
      FP8ATTN_BUILD_CUDA=0 "$PYTHON" setup.py build_ext --inplace >>"$LOG" 2>&1 || { note "CPU build failed"; return 1; }
    fi
    note "library: CPU reference op (no GPU)"
  fi
}

# study_corpus GPU PRESET: a gpu-* preset on the device needs the carried
# tokenized corpus (the device has no network). Returns 1 after a note.
study_corpus() {
  if [ "$1" = 1 ] && case "$2" in gpu-*) true;; *) false;; esac \
     && [ ! -f data/linux-doc-6.1-bpe16384-32mb/meta.json ]; then
    note "data/linux-doc-6.1-bpe16384-32mb is missing: carry it (the device has no network)"; return 1
  fi
}

# ncu_profile TAG KERNEL_REGEX SHAPE [TARGET ARGS...]: Nsight Compute (`--set full
# --import-source yes`) of the last of NCU_WARMUP + 1 (default 3) launches of the
# kernel matching KERNEL_REGEX in benchmarks/ncu_target.py at SHAPE (BxHxSxd);
# writes $OUT/TAG_details.txt (all sections), $OUT/TAG_stalls.md (top SASS lines by
# stall samples, benchmarks/ncu_stalls.py), $OUT/TAG_sass.csv.gz unless
# NCU_NO_SASS=1, the report itself only with NCU_KEEP_REP=1 (the device returns
# at most 8 files); notes the headline metrics. Time limit NCU_T (default 150 s).
ncu_profile() {
  local tag="$1" kre="$2" shape="$3" warm="${NCU_WARMUP:-2}" rep
  shift 3
  rep="/tmp/$tag"
  note "== ncu $tag ($kre, $shape $*)"
  timeout "${NCU_T:-150}" ncu --set full --import-source yes -k "regex:$kre" --launch-skip "$warm" --launch-count 1 \
    -f -o "$rep" "$PYTHON" benchmarks/ncu_target.py --shape "$shape" --warmup "$warm" "$@" >"/tmp/${tag}_ncu.log" 2>&1
  note "ncu rc=$?"
  tail -3 "/tmp/${tag}_ncu.log"
  [ -f "$rep.ncu-rep" ] || return 1
  ncu --import "$rep.ncu-rep" --page details >"$OUT/${tag}_details.txt" 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass >"/tmp/${tag}_sass.csv" 2>/tmp/${tag}_sass.err
  note "source page rc=$? ($(wc -l <"/tmp/${tag}_sass.csv") lines)"
  "$PYTHON" benchmarks/ncu_stalls.py "/tmp/${tag}_sass.csv" --top "${NCU_TOP:-45}" >"$OUT/${tag}_stalls.md" 2>&1
  [ "${NCU_NO_SASS:-0}" = 1 ] || gzip -c "/tmp/${tag}_sass.csv" >"$OUT/${tag}_sass.csv.gz"
  head -60 "$OUT/${tag}_stalls.md"
  grep -E "Duration|Issue Slots Busy|Executed Ipc A|Compute \(SM\) Throughput|Registers Per|Warp Cycles Per Issued" \
    "$OUT/${tag}_details.txt" | head -12 | tee -a "$SUMMARY"
  [ "${NCU_KEEP_REP:-0}" = 1 ] && cp "$rep.ncu-rep" "$OUT/"
  return 0
}
