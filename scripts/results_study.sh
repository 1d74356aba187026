#!/usr/bin/env bash
# Issue 6 results study: ONE command on the lent H200 (<= 8 min device time).
#
#   run(command="bash scripts/results_study.sh",
#       carry=[".devbuild/lib", "data/linux-doc-6.1-bpe16384-32mb"], timeout_s=540)
#
# (.devbuild/lib: the CUDA build, see scripts/device_all.sh; the device has no
# network, so the tokenized corpus of the gpu-50m preset travels too.)
#
# What it runs (GPU defaults; every knob is an env var, see below):
#   stress configuration chosen to give the stale delta its best chance to do
#   damage within budget (issue 6 item 3): preset gpu-50m (12 layers, d_model
#   512, vocab 16384) with head_dim 256 (2 q heads / 1 kv head, same attention
#   width as gpu-50m), NO QK-norm (the paper saw stale diverge without it),
#   lr 5e-3 (3.3x gpu-50m's 1.5e-3), sequences of 2048 tokens (batch 8: the same
#   16384 tokens per step as gpu-50m). Why: the stale delta's error relative to
#   Delta-Matching grows with the attention logit scale (logit_scan on the CPU
#   reference, head_dim 128, seqlen 1024: stale/DM post-cast residual, median,
#   1.6x at logit std 1, 3.0x at 5, 4.9x at 8, 11x at 12), and no QK-norm plus a
#   high learning rate is what lets logits grow. In the same synthetic scan
#   head_dim did not matter and longer rows lowered the residuals slightly, so
#   seqlen is doubled (not quadrupled) to keep more optimizer steps in budget
#   (STUDY_SEQ_LEN=4096 STUDY_BATCH=4 for the longer variant).
#   1. calibration: 20 steps of bf16 and fp8-delta_matching -> step times;
#   2. training: bf16, fp8-stale, fp8-delta_matching (and fp8-matched_do when the
#      step cap leaves time for it) from the same init and batch order, the step
#      count chosen to fill the training window; checkpoints <mode>.pt;
#   3. probes on every checkpoint (python -m fp8attn.train.probe): kernel probe
#      (dS row-sum residuals pre/post cast, eps) per layer and delta mode, and the
#      masking probe for every layer;
#   4. python -m fp8attn.train.logit_scan: stale vs DM residual against the logit
#      scale on synthetic inputs at the study's head_dim and seqlen (CUDA kernels);
#   5. python -m fp8attn.train.results -> results.md for a first look.
#
# Time estimate (from docs/runs/gpu-50m-h200-2026-11-29: 79 ms/step bf16 and
# 88 ms/step fp8 at 16 x 1024 tokens, head_dim 64; docs/benchmarks.md: the
# head_dim-256 FP8 backward runs at ~0.55x the head_dim-64 one): 2x the attention
# FLOPs at seq 2048 -> ~82 ms/step bf16, ~110-115 ms/step fp8 -> ~0.31 s per step
# for the three main modes -> ~900 steps (14.7 M tokens, ~2 epochs of the corpus)
# in the ~325 s training window (after process start, model builds, val evals).
# Setup ~10 s, calibration ~35 s, probes ~45 s, scan ~10 s, results + tar ~15 s:
# ~7.5 min in all. A hard deadline (STUDY_TOTAL_S, default 450 s) cuts every
# stage, and whatever finished is still packed. The step count is not guessed:
# it is computed from the calibrated step times.
#
# Outputs under $OUT (<= 8 files): study.tgz (run dir without checkpoints:
# logs, summary.json, report.md, probe/, results.md + figures), study.log,
# summary.txt, report.md, probe.md, results.md. Checkpoints (~200 MB each) stay on
# the device.
#
# Env knobs: STUDY_TOTAL_S (450), STUDY_PRESET, STUDY_MODEL (ModelConfig
# overrides), STUDY_QK_NORM (0/1), STUDY_LR, STUDY_SEQ_LEN, STUDY_BATCH,
# STUDY_MODES (main modes), STUDY_EXTRA_MODE (fp8-matched_do; "" = never),
# (head_dim 128 instead: STUDY_MODEL=head_dim=128,n_heads=4,n_kv_heads=2),
# STUDY_MAX_STEPS (cap, 3000), STUDY_STEPS (fixed count, skips calibration),
# STUDY_SEED, STUDY_DEVICE (auto), STUDY_DIR (run dir), STUDY_PROBE_RESERVE_S,
# STUDY_RESUME (0/1), STUDY_STATE_EVERY (0), STUDY_RESTORE_DIR (see below),
# PYTHON (the interpreter of every Python step, python3; scripts/device_common.sh).
# The copied tree on the device has no .git: put the commit into the command,
# e.g. run(command="FP8ATTN_GIT_COMMIT=<sha> bash scripts/results_study.sh", ...),
# and it lands in summary.json / probe.json.
# Without a GPU the defaults switch to a CPU-scale trial (cpu-tiny, a few tens of
# steps) that exercises the same pipeline end to end.
#
# Continuing a study over several calls (STUDY_RESUME=1): training runs with
# `compare --deadline-s` (the training window), so every mode stops cleanly after
# a step and saves <mode>.state.pt (weights + AdamW state + RNGs + accumulators,
# 12 bytes per parameter) instead of being killed; with STUDY_RESUME=1 the run dir
# is kept, calibration is skipped (steps and modes come from its run_config.json:
# a split run must keep them) and training continues with `compare --resume`,
# which gives the same weights and loss curve as one uninterrupted run. Probes and
# the results page then use whatever modes are complete (incomplete ones are
# marked). STUDY_STATE_EVERY=K also saves the states every K steps (a call killed
# by `timeout` loses at most K steps).
# LIMIT, plainly: the states live in the run dir ON THE DEVICE. The device is a
# fresh, bare machine after it is given back (idle release, or 30 min held), and
# only 8 files of <= 16 MiB each come back in $OUT. A gpu-50m state is ~600 MB
# per mode (head_dim 256 stress model ~0.6 GB too), so it CANNOT travel back:
# for gpu-50m, resume works only between calls on the same warm machine (one
# lease: keep calls close together, STUDY_DIR on the device, default
# /tmp/fp8attn_study/stress); once the machine is released the study restarts.
# Small states (total <= 15 MiB, e.g. cpu-tiny or smoke) are packed into
# $OUT/states.tgz; to continue on a fresh machine copy study.tgz and states.tgz
# into an ignored folder of the checkout (e.g. runs/study_in), carry it, and set
# STUDY_RESTORE_DIR=runs/study_in STUDY_RESUME=1. The final <mode>.pt checkpoints
# are not packed (study.tgz leaves out *.pt), so after such a restore the probes
# cover only the modes that finish in that call. Measured on CPU (cpu-tiny trial,
# 60 steps): call 1 stopped fp8-delta_matching at 10/60 steps, states.tgz 10 MiB;
# call 2 on a wiped run dir restored it and ended with weights and per-step losses
# bit-identical to an uninterrupted run. On resume STUDY_STEPS/STUDY_MODES are
# ignored (the saved run_config.json decides); other changed knobs are refused.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup study_out
T0=$(date +%s)
TOTAL_S="${STUDY_TOTAL_S:-450}"
DEADLINE=$((T0 + TOTAL_S))
left() { echo $((DEADLINE - $(date +%s))); }
tmo() { local t=$(( $(left) - $1 )); echo $(( t > 5 ? t : 5 )); }   # seconds left minus a reserve, >= 5
rm -f "$OUT"/study.tgz "$OUT"/states.tgz "$OUT"/report.md "$OUT"/probe.md "$OUT"/results.md
study_logs study.log

if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
   && [ "${STUDY_DEVICE:-auto}" != cpu ]; then GPU=1; else GPU=0; fi

if [ "$GPU" = 1 ]; then
  PRESET="${STUDY_PRESET:-gpu-50m}"; MODEL="${STUDY_MODEL:-head_dim=256,n_heads=2,n_kv_heads=1}"
  QK_NORM="${STUDY_QK_NORM:-0}"; LR="${STUDY_LR:-5e-3}"; SEQ="${STUDY_SEQ_LEN:-2048}"
  BATCH="${STUDY_BATCH:-8}"; MAX_STEPS="${STUDY_MAX_STEPS:-3000}"; CALIB_STEPS=20
  VAL_BATCHES=8; PROBE_BATCH=4; PROBE_RESERVE="${STUDY_PROBE_RESERVE_S:-90}"
  hd="$(echo "$MODEL" | sed -n 's/.*head_dim=\([0-9]*\).*/\1/p')"
  SCAN=(--device cuda --head-dim "${hd:-128}" --seq-len "$SEQ")
else
  PRESET="${STUDY_PRESET:-cpu-tiny}"; MODEL="${STUDY_MODEL:-head_dim=64,n_heads=2,n_kv_heads=1,n_layers=2}"
  QK_NORM="${STUDY_QK_NORM:-0}"; LR="${STUDY_LR:-2e-2}"; SEQ="${STUDY_SEQ_LEN:-128}"
  BATCH="${STUDY_BATCH:-4}"; MAX_STEPS="${STUDY_MAX_STEPS:-30}"; CALIB_STEPS=6
  VAL_BATCHES=2; PROBE_BATCH=2; PROBE_RESERVE="${STUDY_PROBE_RESERVE_S:-90}"
  SCAN=(--device cpu --head-dim 64 --seq-len 256)
fi
MODES="${STUDY_MODES:-bf16,fp8-stale,fp8-delta_matching}"
EXTRA_MODE="${STUDY_EXTRA_MODE-fp8-matched_do}"
SEED="${STUDY_SEED:-1234}"
RUN="${STUDY_DIR:-/tmp/fp8attn_study/stress}"
DEVICE="${STUDY_DEVICE:-auto}"
common=(--preset "$PRESET" --model "$MODEL" --lr "$LR" --seq-len "$SEQ" --batch-size "$BATCH"
        --seed "$SEED" --device "$DEVICE" --no-progress)
[ "$QK_NORM" = 0 ] && common+=(--no-qk-norm)

pack() {
  # Always runs (EXIT trap): whatever finished goes back.
  trap - EXIT
  if [ -d "$RUN" ]; then
    cp "$LOG" "$RUN/study.log" 2>/dev/null
    tar czf "$OUT/study.tgz" --exclude='*.pt' --exclude='*.pt.tmp' -C "$(dirname "$RUN")" "$(basename "$RUN")"
    states=$(cd "$(dirname "$RUN")" && ls "$(basename "$RUN")"/*.state.pt 2>/dev/null)
    if [ -n "$states" ]; then
      mb=$(( $(cd "$(dirname "$RUN")" && du -cb $states | tail -1 | cut -f1) / 1048576 ))
      if [ "$mb" -le 15 ]; then
        tar czf "$OUT/states.tgz" -C "$(dirname "$RUN")" $states
        note "training states ($mb MiB) packed into states.tgz (continue: STUDY_RESTORE_DIR + STUDY_RESUME=1)"
      else
        note "training states ($mb MiB) stay on the device ($RUN): too big for \$OUT (<= 16 MiB per file);" \
             "STUDY_RESUME=1 continues them only on this same warm machine"
      fi
    fi
    for f in report.md probe/probe.md results.md; do
      [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/$(basename "$f")"
    done
  fi
  note "total wall time $(( $(date +%s) - T0 )) s; outputs: $(ls "$OUT" | tr '\n' ' ')"
}
trap pack EXIT

echo "== versions" | tee -a "$LOG"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
  torch_versions
} | tee -a "$SUMMARY" | tee -a "$LOG"

echo "== library" | tee -a "$LOG"
study_library "$GPU" || exit 1
study_corpus "$GPU" "$PRESET" || exit 1
note "config: preset $PRESET, model $MODEL, qk_norm $QK_NORM, lr $LR, ${BATCH}x${SEQ} tokens/step, seed $SEED, device $DEVICE"

# ---- 1. calibration -> step count ------------------------------------------------
RESUME=()
if [ "${STUDY_RESUME:-0}" = 1 ] && [ -n "${STUDY_RESTORE_DIR:-}" ] && [ ! -f "$RUN/run_config.json" ]; then
  # A fresh machine: the run dir (logs) and small states carried in from an earlier call.
  mkdir -p "$(dirname "$RUN")"
  for t in study.tgz states.tgz; do
    [ -f "$STUDY_RESTORE_DIR/$t" ] && tar xzf "$STUDY_RESTORE_DIR/$t" -C "$(dirname "$RUN")"
  done
  note "restored $(ls "$RUN" 2>/dev/null | wc -l) files of the run from $STUDY_RESTORE_DIR"
fi
if [ "${STUDY_RESUME:-0}" = 1 ] && [ -f "$RUN/run_config.json" ]; then
  # NOTE: a split run must keep its step count and modes (compare --resume refuses others).
  read -r STEPS RUN_MODES <<<"$("$PYTHON" -c "import json,sys; c=json.load(open(sys.argv[1])); print(c['train']['steps'], ','.join(c['modes']))" "$RUN/run_config.json")"
  RESUME=(--resume)
  note "resuming $RUN: $STEPS steps x $RUN_MODES ($(ls "$RUN"/*.state.pt 2>/dev/null | wc -l) saved states)"
elif [ "${STUDY_RESUME:-0}" = 1 ]; then
  note "STUDY_RESUME=1 but $RUN holds no run (run_config.json missing; the device machine was probably released): starting fresh"
fi
if [ ${#RESUME[@]} -gt 0 ]; then
  :
elif rm -rf "$RUN" && mkdir -p "$RUN" && [ -n "${STUDY_STEPS:-}" ]; then
  STEPS="$STUDY_STEPS"; RUN_MODES="$MODES"
  note "steps: fixed STUDY_STEPS=$STEPS"
else
  echo "== calibration ($CALIB_STEPS steps of bf16 and fp8-delta_matching)" | tee -a "$LOG"
  CAL=/tmp/fp8attn_study_calib
  rm -rf "$CAL"
  timeout 150 "$PYTHON" -m fp8attn.train.compare "${common[@]}" --modes bf16,fp8-delta_matching \
    --steps "$CALIB_STEPS" --diag-every 5 --val-every 100000 --val-batches 1 --no-save --out "$CAL" >>"$LOG" 2>&1
  note "calibration: rc=$?"
  # Training window: up to the deadline minus the probe/pack reserve. Per-mode cost =
  # steps x step time x 1.03 + val evals (5 x VAL_BATCHES forwards at ~1/3 step) + 8 s fixed.
  plan="$("$PYTHON" - "$CAL" "$(( $(left) - PROBE_RESERVE ))" "$MODES" "$EXTRA_MODE" "$MAX_STEPS" "$VAL_BATCHES" <<'EOF'
import json, sys
from pathlib import Path
cal, window, modes, extra, cap, vb = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3].split(","), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
t = {}
for m in ("bf16", "fp8-delta_matching"):
    p = cal / f"{m}.jsonl"
    st = [json.loads(l) for l in p.open()] if p.exists() else []
    dts = [r["step_time_s"] for r in st if r.get("type") == "step" and "step_time_s" in r and r["step"] >= 2]
    t[m] = sum(dts) / len(dts) if dts else None
if t["bf16"] is None or t["fp8-delta_matching"] is None:
    print(f"0 {','.join(modes)} calibration-failed"); sys.exit()
step_t = lambda m: t["bf16"] if m == "bf16" else t["fp8-delta_matching"]
def cost(ms, n):
    return 12 + sum(n * step_t(m) * 1.03 + 5 * vb * step_t(m) / 3 + 8 for m in ms)
per = sum(step_t(m) * 1.03 for m in modes)
n = int((window - 12 - sum(5 * vb * step_t(m) / 3 + 8 for m in modes)) / per)   # 12 s: process start
n = max(10, min(cap, n // 10 * 10))
run = list(modes)
if extra and extra not in run and cost(run + [extra], n) <= window:
    run.append(extra)
print(n, ",".join(run), f"bf16 {t['bf16']*1e3:.0f} ms/step, fp8-DM {t['fp8-delta_matching']*1e3:.0f} ms/step, "
      f"window {window:.0f} s, planned {cost(run, n):.0f} s")
EOF
)"
  read -r STEPS RUN_MODES CAL_NOTE <<<"$plan"
  note "calibration: $CAL_NOTE -> $STEPS steps x modes $RUN_MODES"
  if [ "${STEPS:-0}" = 0 ]; then note "calibration failed; see study.log"; tail -30 "$LOG"; exit 1; fi
fi

# ---- 2. training -----------------------------------------------------------------
echo "== training ($STEPS steps x $RUN_MODES)" | tee -a "$LOG"
# NOTE: --deadline-s stops cleanly (state saved, report written); timeout is only the backstop.
timeout "$(tmo $((PROBE_RESERVE - 20)))" "$PYTHON" -m fp8attn.train.compare "${common[@]}" --modes "$RUN_MODES" --steps "$STEPS" \
  --diag-every 10 --val-batches "$VAL_BATCHES" --deadline-s "$(tmo "$PROBE_RESERVE")" \
  --state-every "${STUDY_STATE_EVERY:-0}" "${RESUME[@]}" --out "$RUN" >>"$LOG" 2>&1
note "training: rc=$? (124 = killed by the backstop timeout), $(( $(date +%s) - T0 )) s since start"
grep -q 'run INCOMPLETE' "$LOG" && note "training INCOMPLETE: $(grep 'run INCOMPLETE' "$LOG" | tail -1) (STUDY_RESUME=1 continues)"
grep -E '^\[compare\]' "$LOG" | tail -6 | tee -a "$SUMMARY"
[ -f "$RUN/report.md" ] && sed -n '/^| mode/,/^$/p' "$RUN/report.md" | tee -a "$SUMMARY"

# ---- 3. probes -------------------------------------------------------------------
echo "== probes" | tee -a "$LOG"
if ls "$RUN"/*.pt 2>/dev/null | grep -qvE '\.(state|step[0-9]+)\.pt$'; then   # final <mode>.pt only
  timeout "$(tmo 20)" "$PYTHON" -m fp8attn.train.probe --run-dir "$RUN" --batch-size "$PROBE_BATCH" \
    --mask-layers all --device "$DEVICE" >>"$LOG" 2>&1
  note "probe: rc=$?"
  grep -E '^\[probe\] (bf16|fp8)' "$LOG" | tee -a "$SUMMARY"
else
  note "probe: no checkpoints"
fi

# ---- 4. logit-scale scan (synthetic, the study's head_dim and seqlen) -------------
timeout "$(( $(tmo 15) < 40 ? $(tmo 15) : 40 ))" "$PYTHON" -m fp8attn.train.logit_scan "${SCAN[@]}" \
  --scales 0.5,1,2,3,5,8,12 --out "$RUN/logit_scan" >>"$LOG" 2>&1
note "logit scan: rc=$?"
[ -f "$RUN/logit_scan/scan.md" ] && { tail -8 "$RUN/logit_scan/scan.md"; echo; } | tee -a "$SUMMARY"

# ---- 5. results page -------------------------------------------------------------
scan_arg=()
[ -f "$RUN/logit_scan/scan.json" ] && scan_arg=(--scan "$RUN/logit_scan")
timeout "$(tmo 5)" "$PYTHON" -m fp8attn.train.results --run "stress=$RUN" "${scan_arg[@]}" \
  --prior docs/runs/gpu-50m-h200-2026-11-29 --prior docs/runs/cpu-tiny-2026-11-29 \
  --out "$RUN/results.md" --fig-dir "$RUN/results" >>"$LOG" 2>&1
note "results page: rc=$?"
