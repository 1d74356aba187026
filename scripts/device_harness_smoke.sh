#!/usr/bin/env bash
# GPU smoke run of the training harness's features (issue 22 item 6): every
# switch the paper's setups need, in one short run per stage, all five attention
# modes (bf16, fp8-stale, fp8-matched_do, fp8-delta_matching, fp8-cudnn), on the
# device (H100 / H200):
#   1. gpu-125m (head_dim 128: fp8-cudnn runs), --arch gdn-hybrid (fla-core's
#      Triton Gated DeltaNet layers between fp8attn GQA layers), --optimizer muon,
#      --steps $SMOKE_STEPS at seq 1024;
#   2. long-context continuation: --init-from stage 1's checkpoints at seq 2048,
#      a lower peak LR and RoPE base 4x (weights only, fresh optimizer);
#   3. the retrieval probe (passkey, multi-key recall) on stage 2's checkpoints.
# Reports land in $OUT/runs.tgz (runs/{smoke,smoke-long}: report.md, summary.json,
# logs, plots; checkpoints are deleted before the call returns: too large for the
# return channel). The lead copies the reports to docs/runs/.
# Measured on an H100 (2026-12-07): the Gated DeltaNet layers run fla-core's PyTorch
# reference there (fla-core refuses Triton 3.6's backward on Hopper), ~0.9 s per step
# of gpu-125m at seq 1024 for every mode: 30 steps x 5 modes took 165 s, 15 steps at
# seq 2048 ~22 s per mode; so the defaults below are sized for one 600 s call.
#
#   run(command="bash scripts/device_harness_smoke.sh",
#       carry=["third_party", ".whl", "data/linux-doc-6.1-bpe16384-32mb"], timeout_s=600)
#
# Needs: the carried tokenized corpus (the device has no network), .whl/fla_core-*.whl
# (pure Python; Triton is the image's), .whl/nvidia_cudnn_frontend-*-cp3XY-*.whl.
# Env: SMOKE_STEPS (30), SMOKE_LONG_STEPS (12), SMOKE_T1 / SMOKE_T2 / SMOKE_T3 (the stages'
# time limits in seconds: 240, 180, 120), DEVICE_LIB (native | carried), SMOKE_BUILD=0
# (use a library already built in place by an earlier call). runs.tgz is rewritten after
# every stage, so a call cut short still returns what finished.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup device_harness_smoke
summary_init
note "== device_harness_smoke $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
note "$(torch_versions)"
if [ "${SMOKE_BUILD:-1}" = 1 ] || ! has_cuda_kernels 2>/dev/null; then
  device_library || exit 1
  note "$LIB_NOTE"
else
  note "library: the one built in place by an earlier call"
fi
install_cudnn_frontend
note "$CUDNN_FE_NOTE"
# fla-core (Gated DeltaNet) from its carried wheel, beside the frontend.
fla=$(ls .whl/fla_core-*.whl 2>/dev/null | head -1)
if [ -n "$fla" ] && "$PYTHON" -m pip install --no-deps --no-index --quiet --target /tmp/fla_site "$fla" \
     >/tmp/fla_pip.log 2>&1; then
  export PYTHONPATH="/tmp/fla_site:$PYTHONPATH"
  note "fla-core: $(basename "$fla") -> /tmp/fla_site"
else
  note "fla-core: no carried .whl/fla_core-*.whl or install failed ($(tail -1 /tmp/fla_pip.log 2>/dev/null)): stage 1 fails"
fi
if [ ! -f data/linux-doc-6.1-bpe16384-32mb/meta.json ]; then
  note "data/linux-doc-6.1-bpe16384-32mb is missing: carry it"; exit 1
fi

# pack_runs: the reports and logs as one archive (the return channel limits the number
# of files); checkpoints and training states stay out (size).
pack_runs() {
  tar czf "$OUT/runs.tgz" --exclude='*.pt' -C "$OUT" runs 2>/dev/null
}

modes=bf16,fp8-stale,fp8-matched_do,fp8-delta_matching,fp8-cudnn
runs="$OUT/runs"
mkdir -p "$runs"
common=(--preset gpu-125m --modes "$modes" --arch gdn-hybrid --optimizer muon --diag-every 10 --no-progress
        --val-batches 4)
# run_stage N LIMIT_S TAIL_LINES TITLE CMD...: one stage under a time limit, its log in
# $OUT/stageN.log, the rc and time noted, the log's tail in the summary, runs.tgz refreshed.
run_stage() {
  local n=$1 limit=$2 lines=$3 title=$4 t0=$SECONDS rc
  shift 4
  note "== stage $n: $title"
  timeout "$limit" "$@" >"$OUT/stage$n.log" 2>&1
  rc=$?
  note "stage $n: rc=$rc, $((SECONDS - t0)) s"
  tail -"$lines" "$OUT/stage$n.log" | tee -a "$SUMMARY"
  pack_runs
}

run_stage 1 "${SMOKE_T1:-240}" 15 "gdn-hybrid + muon, ${SMOKE_STEPS:-30} steps, seq 1024" \
  "$PYTHON" -m fp8attn.train.compare "${common[@]}" --steps "${SMOKE_STEPS:-30}" --out "$runs/smoke"
run_stage 2 "${SMOKE_T2:-180}" 15 "--init-from stage 1, seq 2048, lr 3e-4, rope_base 40000, ${SMOKE_LONG_STEPS:-12} steps" \
  "$PYTHON" -m fp8attn.train.compare "${common[@]}" --steps "${SMOKE_LONG_STEPS:-12}" \
  --init-from "$runs/smoke" --seq-len 2048 --batch-size 8 --lr 3e-4 --warmup 6 --model rope_base=40000 \
  --out "$runs/smoke-long"
run_stage 3 "${SMOKE_T3:-120}" 25 "retrieval probe on stage 2's checkpoints" \
  "$PYTHON" -m fp8attn.train.retrieval --run-dir "$runs/smoke-long" --lengths 512,1024,1536 --samples 2

rm -rf "$runs"
du -sh "$OUT/runs.tgz" | tee -a "$SUMMARY"
