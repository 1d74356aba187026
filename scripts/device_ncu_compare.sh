#!/usr/bin/env bash
# Nsight Compute side by side: every kernel of one fp8attn forward + backward and of
# the baselines (cuDNN BF16 SDPA, cuDNN FP8 SDPA) on the same shape, on the lent H200.
#
#   run(command="bash scripts/device_ncu_compare.sh", carry=[".devbuild/lib", ".whl"], timeout_s=600)
#
# NCU_SHAPE (default 2x16x8192x128), NCU_CAUSAL=1 for causal, NCU_IMPLS (default
# "fp8attn cudnn_bf16 cudnn_fp8"). Each implementation runs benchmarks/ncu_target.py
# with --bwd (2 warm-up steps); ncu profiles the kernels inside its NVTX range "profile"
# (one forward + backward after the warm-up; cuDNN BF16: see NOTE) with the sections below. Outputs under $OUT:
# <impl>.csv (raw page), compare.md (benchmarks/ncu_compare.py), summary.txt.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup ncu_compare_out
summary_init

use_carried_so || note "no carried .devbuild/lib/fp8attn/_C*.so (fp8attn rows need it)"
install_cudnn_frontend
note "$CUDNN_FE_NOTE"
note "$(ncu --version | tail -1); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(torch_versions)"
SHAPE="${NCU_SHAPE:-2x16x8192x128}"
causal=(); [ "${NCU_CAUSAL:-0}" = 1 ] && causal=(--causal)
note "shape $SHAPE ${causal[*]} ($(date -u '+%Y-%m-%d %H:%M UTC'))"
SECTIONS=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats
          --section LaunchStats --section Occupancy --section InstructionStats)
csvs=()
for impl in ${NCU_IMPLS:-fp8attn cudnn_bf16 cudnn_fp8}; do
  # NOTE: torch runs the autograd backward on its own thread, outside the (per-thread)
  # NVTX range: cuDNN BF16's two main kernels are picked by name after the warm-up
  # steps instead (its small helper kernels are not profiled).
  select=(--nvtx --nvtx-include "profile/")
  [ "$impl" = cudnn_bf16 ] && select=(-k "regex:flash_(f|b)prop" --launch-skip 4 --launch-count 2)
  timeout "${NCU_T:-170}" ncu "${SECTIONS[@]}" "${select[@]}" -f -o "/tmp/$impl" \
    "$PYTHON" benchmarks/ncu_target.py --impl "$impl" --shape "$SHAPE" --bwd "${causal[@]}" >"/tmp/${impl}_ncu.log" 2>&1
  note "$impl: ncu rc=$? $(grep -E '^ok|did not run|Error|error' "/tmp/${impl}_ncu.log" | tail -1 | cut -c1-200)"
  if [ -f "/tmp/$impl.ncu-rep" ]; then
    ncu --import "/tmp/$impl.ncu-rep" --csv --page raw >"$OUT/$impl.csv" 2>/dev/null && csvs+=("$OUT/$impl.csv")
  else
    tail -5 "/tmp/${impl}_ncu.log"
  fi
done
[ ${#csvs[@]} -gt 0 ] && "$PYTHON" benchmarks/ncu_compare.py "${csvs[@]}" | tee "$OUT/compare.md"
ls -la "$OUT"
