#!/usr/bin/env bash
# Nsight Compute profile of the FP8 forward and backward kernels on the lent H200,
# with per-SASS-instruction warp-stall sampling (docs/kernels/*.md cite it).
#
#   run(command="bash scripts/device_ncu.sh", carry=["third_party"], timeout_s=420)
# (the library is built on the device; DEVICE_LIB=carried with carry=[".devbuild/lib"]
# profiles a build made on the CPU machine instead; NCU_EXTRA: more ncu_target.py
# arguments for every kernel, e.g. "--scaling tile").
#
# Profiles the last of (NCU_WARMUP + 1) launches of each kernel named in NCU_KERNELS
# (default: the wgmma forward and the wgmma backward main kernel) at NCU_SHAPE
# (default 4x16x4096x128, non-causal; NCU_CAUSAL=1 for causal), `--set full
# --import-source yes`. Outputs under $OUT (<= 8 files): <tag>.ncu-rep (NCU_KEEP_REP=1;
# <= 16 MiB to come back), <tag>_sass.csv.gz (the source page), <tag>_details.txt (all sections), <tag>_stalls.md (top SASS
# lines by stall samples, stall reasons by opcode; benchmarks/ncu_stalls.py),
# summary.txt.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup ncu_out
summary_init

device_library || exit 1  # DEVICE_LIB=native (default: built here, ~40 s) | carried
note "$LIB_NOTE"
note "$(ncu --version | tail -1); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

SHAPE="${NCU_SHAPE:-4x16x4096x128}"
causal=(); [ "${NCU_CAUSAL:-0}" = 1 ] && causal=(--causal)
# tag:kernel-regex:extra target args
KERNELS="${NCU_KERNELS:-fwd:fwd_wgmma_kernel: bwd:bwd_wgmma_main_kernel:--bwd}"
for spec in $KERNELS; do
  IFS=: read -r tag kre extra <<<"$spec"
  # shellcheck disable=SC2086
  ncu_profile "$tag" "$kre" "$SHAPE" "${causal[@]}" $extra ${NCU_EXTRA:-}
done
rm -f "$OUT"/*_ncu.log
ls -la "$OUT"
