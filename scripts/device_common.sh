# Sourced by the device scripts (device_all.sh, device_ncu.sh, device_linear.sh,
# device_fquant.sh, results_study.sh, seeds_study.sh): the set-up they share.

# device_setup NAME: cd to the repository root (ROOT), OUT defaults to $ROOT/NAME
# (the device's `run` sets OUT itself), python/ on PYTHONPATH, unbuffered output.
device_setup() {
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$ROOT" || exit 1
  OUT="${OUT:-$ROOT/$1}"
  mkdir -p "$OUT"
  export PYTHONPATH="$ROOT/python" PYTHONUNBUFFERED=1
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

# has_cuda_kernels: status 0 when the importable fp8attn has its CUDA kernels.
has_cuda_kernels() {
  python3 -c "import fp8attn, sys; sys.exit(0 if fp8attn._lib.HAS_CUDA_KERNELS else 1)"
}

# torch_versions: one line of python / torch / CUDA / cuDNN versions.
torch_versions() {
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
}
