#!/usr/bin/env bash
# Issue 6 item 2, seed spread: ONE command on the lent H200 (one GPU, <= 9 min wall).
#
#   run(command="FP8ATTN_GIT_COMMIT=<sha> bash scripts/seeds_study.sh",
#       carry=[".devbuild/lib", "data/linux-doc-6.1-bpe16384-32mb"], timeout_s=600)
#
# (.devbuild/lib: the CUDA build, see scripts/device_all.sh; the device has no
# network, so the tokenized corpus of the gpu-50m preset travels too. The copied
# tree has no .git: FP8ATTN_GIT_COMMIT lands in every run's provenance.json.)
#
# What it runs (GPU defaults; every knob is an env var, see below): the four modes
# bf16, fp8-stale, fp8-matched_do, fp8-delta_matching x seeds 1234 and 1235 = 8
# `python -m fp8attn.train.compare --modes <mode> --seed <seed>` processes, ALL AT
# ONCE on the one GPU (gpu-50m is launch/overhead bound at ~64 ms/step alone, so
# concurrent processes raise the total throughput), each into <dir>/<mode>-s<seed>/.
# Model: preset gpu-50m (12 layers, d_model 512, vocab 16384) with head_dim 128
# (4 q / 2 kv heads), QK-norm ON, lr 3e-3 (2x the preset's 1.5e-3: the paper's
# damage channel is channel-gain growth, which a higher lr helps), the preset's
# 16 x 1024 tokens per step. Seed s sets the init (torch.manual_seed(s)) and the
# batch order (data seed s + 3087, so 1234 -> the usual 4321; SEEDS_VARY_DATA=0
# keeps 4321 for every seed); within a seed every mode has the same init and the
# same batches (tests/python/test_seeds_study.py: a one-mode process trains
# exactly what the multi-mode run trains for that mode).
#   0. CUDA MPS: starts a user-level MPS control daemon (pipe/log dirs under /tmp)
#      and checks a CUDA client runs through it; if the binary is missing, the
#      daemon does not start or the check fails: plain concurrent processes
#      (time-sliced). Stopped in the EXIT trap (echo quit | nvidia-cuda-mps-control).
#   1. calibration: every run at once for SEEDS_CALIB_STEPS (20) steps (--no-save,
#      1 val batch) -> the slowest run's mean step time over steps >= 3 under that
#      concurrency (x SEEDS_MARGIN, 1.25) -> the step count (multiple of 10) that fits the
#      training window (python -m fp8attn.train.seeds plan). If a calibration run
#      runs out of GPU memory, SEEDS_PARALLEL is halved (runs then go in waves);
#      if one fails otherwise under MPS, MPS is stopped and the calibration repeated
#      without it (at most 3 attempts, each capped at 120 s).
#   2. training: all runs with that same step count (same lr schedule),
#      --deadline-s as the clean stop at the end of the window, `timeout` as the
#      backstop; diagnostics every 10 steps, 8 val batches, no checkpoints.
#   3. python -m fp8attn.train.seeds aggregate -> seeds.md (per mode: final val
#      loss per seed, mean, spread, gap to the bf16 mean, max QK-norm gain and
#      post-cast row-sum residual at the end per seed; paired per-seed differences),
#      seeds.json, seeds_loss.png, seeds_gain.png. When the deadline cut some run,
#      every run is read at the last val step all of them logged (--at-step common:
#      same lr schedule and batches there); when that fails too (a run missing or
#      diverged), the rest is aggregated and the bad runs listed (--partial).
#      NOTE (first H200 run, 2026-11-29): the 20-step calibration measured 311 ms per
#      step under 8-way MPS concurrency, training ran at ~368 ms (x1.18), so every
#      run was cut at 1055-1137 of 1150 steps; hence the 1.25 margin and --at-step.
# GPU memory (nvidia-smi every 2 s) and utilization are logged to gpu_mem.txt, the
# peaks per phase to summary.txt.
#
# Time estimate: setup + MPS check ~20 s; calibration ~40 s (8 process starts
# ~15 s, 20 steps); training window = SEEDS_TOTAL_S (500) minus 45 s reserve minus
# what the first stages took, ~390 s: at an (unmeasured) ~0.25-0.4 s per step per
# run under 8-way concurrency that is ~900-1500 steps (15-25 M tokens per run);
# aggregation + tar ~15 s. ~8.5 min in all; the deadline cuts every stage and the
# EXIT trap still packs whatever finished. Memory (estimate, not measured): ~8-14
# GB per gpu-50m process at 16 x 1024 tokens (FP32 weights + AdamW 0.8 GB, the
# 16384-vocab logits in BF16 + FP32 ~3-4 GB, activations ~6 GB, context), so 8
# processes ~70-110 GB of the 139 GB; an OOM in the calibration halves the
# concurrency.
#
# Outputs under $OUT (7 files): seeds.tgz (the study dir without *.pt: every run's
# jsonl log, summary.json, report.md + plots, compare stdout, the calibration,
# gpu_mem.txt, MPS logs, seeds/), seeds.log, summary.txt, seeds.md, seeds.json,
# seeds_loss.png, seeds_gain.png.
#
# Env knobs: SEEDS_TOTAL_S (500), SEEDS_MODES (the four), SEEDS_SEEDS (1234,1235),
# SEEDS_LR (3e-3), SEEDS_MODEL (ModelConfig overrides, head_dim=128,n_heads=4,
# n_kv_heads=2), SEEDS_QK_NORM (1), SEEDS_PRESET (gpu-50m), SEEDS_SEQ_LEN /
# SEEDS_BATCH (the preset's), SEEDS_STEPS (fixed count, skips the calibration),
# SEEDS_PARALLEL (max concurrent processes, 8), SEEDS_MPS (1; 0 = never),
# SEEDS_VARY_DATA (1), SEEDS_MARGIN (1.25), SEEDS_CALIB_STEPS (20), SEEDS_MAX_STEPS (3000),
# SEEDS_RESERVE_S (45), SEEDS_VAL_BATCHES (8), SEEDS_DIR (/tmp/fp8attn_seeds/study),
# SEEDS_DEVICE (auto), PYTHON (the interpreter of every Python step, python3; the same
# variable as the other device scripts, scripts/device_common.sh).
# Without a GPU the defaults switch to a CPU trial (cpu-tiny, 2 layers, 2 modes x 2
# seeds, a few tens of steps, one thread per process; ~1.5 min on 2 cores) that
# runs the same pipeline end to end.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup seeds_out
T0=$(date +%s)
if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
   && [ "${SEEDS_DEVICE:-auto}" != cpu ]; then GPU=1; else GPU=0; fi
if [ "$GPU" = 1 ]; then
  TOTAL_S="${SEEDS_TOTAL_S:-500}"; PRESET="${SEEDS_PRESET:-gpu-50m}"
  MODEL="${SEEDS_MODEL:-head_dim=128,n_heads=4,n_kv_heads=2}"; LR="${SEEDS_LR:-3e-3}"
  MODES="${SEEDS_MODES:-bf16,fp8-stale,fp8-matched_do,fp8-delta_matching}"
  PARALLEL="${SEEDS_PARALLEL:-8}"; CALIB_STEPS="${SEEDS_CALIB_STEPS:-20}"; MAX_STEPS="${SEEDS_MAX_STEPS:-3000}"
  RESERVE="${SEEDS_RESERVE_S:-45}"; VAL_BATCHES="${SEEDS_VAL_BATCHES:-8}"; CAL_LIMIT=120; BACKSTOP=25; MIN_TRAIN=120; DIAG_EVERY=10; START_S=10
  THREADS=()
else
  TOTAL_S="${SEEDS_TOTAL_S:-118}"; PRESET="${SEEDS_PRESET:-cpu-tiny}"
  SEEDS_SEQ_LEN="${SEEDS_SEQ_LEN:-64}"; SEEDS_BATCH="${SEEDS_BATCH:-4}"
  MODEL="${SEEDS_MODEL:-head_dim=64,n_heads=2,n_kv_heads=1,n_layers=2}"; LR="${SEEDS_LR:-2e-2}"
  MODES="${SEEDS_MODES:-bf16,fp8-delta_matching}"
  PARALLEL="${SEEDS_PARALLEL:-4}"; CALIB_STEPS="${SEEDS_CALIB_STEPS:-5}"; MAX_STEPS="${SEEDS_MAX_STEPS:-40}"
  RESERVE="${SEEDS_RESERVE_S:-20}"; VAL_BATCHES="${SEEDS_VAL_BATCHES:-2}"; CAL_LIMIT=60; BACKSTOP=15; MIN_TRAIN=20; DIAG_EVERY=3; START_S=12
  THREADS=(--threads 1)   # NOTE: 2 cores shared by 4 processes
fi
SEEDS="${SEEDS_SEEDS:-1234,1235}"
QK_NORM="${SEEDS_QK_NORM:-1}"
DEVICE="${SEEDS_DEVICE:-auto}"
RUN="${SEEDS_DIR:-/tmp/fp8attn_seeds/study}"
CAL="$RUN/calib"
DEADLINE=$((T0 + TOTAL_S))
left() { echo $((DEADLINE - $(date +%s))); }
common=(--preset "$PRESET" --model "$MODEL" --lr "$LR" --device "$DEVICE" --no-progress "${THREADS[@]}")
[ -n "${SEEDS_SEQ_LEN:-}" ] && common+=(--seq-len "$SEEDS_SEQ_LEN")
[ -n "${SEEDS_BATCH:-}" ] && common+=(--batch-size "$SEEDS_BATCH")
[ "$QK_NORM" = 0 ] && common+=(--no-qk-norm)
data_seed() { if [ "${SEEDS_VARY_DATA:-1}" = 1 ]; then echo $(( $1 + 3087 )); else echo 4321; fi; }
JOBS=()   # mode:seed, seed-major (a first wave holds whole seeds)
for s in ${SEEDS//,/ }; do for m in ${MODES//,/ }; do JOBS+=("$m:$s"); done; done

rm -f "$OUT"/seeds.tgz "$OUT"/seeds.md "$OUT"/seeds.json "$OUT"/seeds_*.png
study_logs seeds.log
rm -rf "$RUN"
mkdir -p "$RUN"

# ---- MPS ----------------------------------------------------------------------------
MPS=0
MPS_PIPE=/tmp/fp8attn_mps_pipe
MPS_LOGDIR=/tmp/fp8attn_mps_log
stop_mps() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | timeout 20 nvidia-cuda-mps-control >>"$LOG" 2>&1
    say "MPS: quit sent (rc=$?)"
    cp -r "$MPS_LOGDIR" "$RUN/mps_log" 2>/dev/null
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  MPS=0
}
start_mps() {
  if [ "$GPU" != 1 ]; then note "MPS: no GPU"; return; fi
  if [ "${SEEDS_MPS:-1}" != 1 ]; then note "MPS: off (SEEDS_MPS=0); plain concurrent processes"; return; fi
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    note "MPS: nvidia-cuda-mps-control not found; plain concurrent processes"; return
  fi
  mkdir -p "$MPS_PIPE" "$MPS_LOGDIR"
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_PIPE" CUDA_MPS_LOG_DIRECTORY="$MPS_LOGDIR"
  echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1   # NOTE: a daemon of ours left by an earlier call
  if ! timeout 20 nvidia-cuda-mps-control -d >>"$LOG" 2>&1; then
    note "MPS: the control daemon did not start; plain concurrent processes"
    tail -5 "$MPS_LOGDIR/control.log" 2>/dev/null | tee -a "$LOG"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; return
  fi
  if timeout 45 "$PYTHON" -c "import torch; x = torch.ones(256, 256, device='cuda'); print('mps client ok', float((x @ x).sum()))" >>"$LOG" 2>&1; then
    srv="$(echo get_server_list | timeout 10 nvidia-cuda-mps-control 2>>"$LOG" | tr '\n' ' ')"
    if [ -n "${srv// /}" ]; then
      MPS=1; note "MPS: on (control daemon started, a CUDA client ran through server pid $srv)"
    else
      note "MPS: the daemon started but lists no server after a CUDA client ran; stopping it, plain processes"
      stop_mps
    fi
  else
    note "MPS: a CUDA client failed under the MPS daemon; stopping it, plain concurrent processes"
    tail -5 "$MPS_LOGDIR/control.log" "$MPS_LOGDIR/server.log" 2>/dev/null | tee -a "$LOG"
    stop_mps
  fi
}

# ---- GPU memory monitor ------------------------------------------------------------
MON=""
if [ "$GPU" = 1 ] && command -v nvidia-smi >/dev/null; then
  ( i=0; while :; do
      echo "$(date +%s) $(nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' ')"
      i=$((i + 1)); if [ $((i % 15)) = 5 ]; then
        { date +%s; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null; } >>"$RUN/gpu_apps.txt"
      fi
      sleep 2
    done ) >"$RUN/gpu_mem.txt" 2>/dev/null &
  MON=$!
fi
mem_peak() {   # mem_peak T_FROM T_TO -> "peak MiB of total, mean util %" between two times
  [ -f "$RUN/gpu_mem.txt" ] || { echo "n/a"; return; }
  awk -F'[ ,]' -v a="$1" -v b="$2" '$1 >= a && $1 <= b && $2 != "" {
      if ($2 > m) m = $2; t = $3; u += $4; n++ }
      END { if (n) printf "peak %d MiB of %d MiB, mean util %.0f %% (%d samples)", m, t, u / n, n; else print "n/a" }' "$RUN/gpu_mem.txt"
}

# ---- run a batch of compare processes ------------------------------------------------
# run_batch DIR STEPS END_EPOCH JOB... -- EXTRA_ARGS...: one compare per job (mode:seed),
# at most $PARALLEL at a time; --deadline-s = END_EPOCH - launch time - START_S (compare
# counts it from after its imports, which take several seconds with 8 processes starting
# at once), timeout = END_EPOCH - launch time + BACKSTOP (never past the total deadline
# minus 10 s); rc per run into DIR/rc.txt.
run_batch() {
  local dir=$1 steps=$2 end=$3; shift 3
  local jobs=() job mode seed dl name
  while [ $# -gt 0 ] && [ "$1" != -- ]; do jobs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  mkdir -p "$dir"
  : >"$dir/rc.txt"
  local pids=()
  for job in "${jobs[@]}"; do
    mode=${job%%:*}; seed=${job##*:}; name="$mode-s$seed"
    while :; do
      local live=0 p
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && live=$((live + 1)); done
      [ "$live" -lt "$PARALLEL" ] && break
      sleep 1
    done
    dl=$(( end - $(date +%s) - START_S )); [ "$dl" -lt 5 ] && dl=5
    local tmo=$(( dl + START_S + BACKSTOP )); local cap=$(( $(left) - 10 )); [ "$tmo" -gt "$cap" ] && tmo=$cap; [ "$tmo" -lt 5 ] && tmo=5
    ( timeout "$tmo" "$PYTHON" -m fp8attn.train.compare "${common[@]}" --modes "$mode" --seed "$seed" \
        --data-seed "$(data_seed "$seed")" --steps "$steps" --deadline-s "$dl" "$@" --out "$dir/$name" \
        >"$dir/$name.log" 2>&1 &
      tp=$!; echo "$tp" >"$dir/$name.pid"; wait "$tp"; rc=$?
      rm -f "$dir/$name.pid"; echo "$name rc=$rc" >>"$dir/rc.txt" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
}
kill_runs() {   # TERM to the timeout processes of unfinished runs (timeout forwards it)
  local f
  for f in "$RUN"/*.pid "$CAL"/*.pid; do
    [ -f "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null
  done
}

AGG_DONE=0
aggregate() {   # strict first; a cut-short run -> --at-step common; a missing / diverged run -> --partial
  local t=$(( $(left) - 5 )); [ "$t" -gt 90 ] && t=90; [ "$t" -lt 10 ] && t=10
  if timeout "$t" "$PYTHON" -m fp8attn.train.seeds aggregate --study "$RUN" --modes "$MODES" --seeds "$SEEDS" \
       --out "$RUN/seeds" >"$RUN/seeds_aggregate.txt" 2>&1; then
    note "aggregation: all $(( ${#JOBS[@]} )) runs complete"
  else
    note "aggregation (strict) failed: $(tail -1 "$RUN/seeds_aggregate.txt"); again at the last shared val step"
    if timeout "$t" "$PYTHON" -m fp8attn.train.seeds aggregate --study "$RUN" --modes "$MODES" --seeds "$SEEDS" \
       --out "$RUN/seeds" --at-step common >"$RUN/seeds_aggregate.txt" 2>&1; then
      note "aggregation --at-step common: rc=0 ($(grep -o 'Read at step [0-9]* of [0-9]*' "$RUN/seeds/seeds.md"))"
    else
      note "aggregation --at-step common failed: $(tail -1 "$RUN/seeds_aggregate.txt"); again with --partial"
      timeout "$t" "$PYTHON" -m fp8attn.train.seeds aggregate --study "$RUN" --modes "$MODES" --seeds "$SEEDS" \
         --out "$RUN/seeds" --partial >"$RUN/seeds_aggregate.txt" 2>&1
      note "aggregation --partial: rc=$?"
    fi
  fi
  AGG_DONE=1
  [ -f "$RUN/seeds/seeds.md" ] && awk '/^\| (mode|comparison) /{t=1} t&&/^$/{t=0; print} t; /^## Problems/{p=1} /^!\[/{p=0} p' "$RUN/seeds/seeds.md" | tee -a "$SUMMARY"
}

finish() {
  # Always runs (EXIT trap): whatever finished goes back.
  trap - EXIT TERM INT
  kill_runs
  [ -n "$MON" ] && kill "$MON" 2>/dev/null
  [ "$MPS" = 1 ] && stop_mps
  if [ "$AGG_DONE" = 0 ] && ls -d "$RUN"/*-s*/ >/dev/null 2>&1; then aggregate; fi
  for f in seeds.md seeds.json seeds_loss.png seeds_gain.png; do
    [ -f "$RUN/seeds/$f" ] && cp "$RUN/seeds/$f" "$OUT/$f"
  done
  if [ -d "$RUN" ]; then
    cp "$LOG" "$RUN/seeds.log" 2>/dev/null
    tar czf "$OUT/seeds.tgz" --exclude='*.pt' --exclude='*.pt.tmp' -C "$(dirname "$RUN")" "$(basename "$RUN")"
    if [ "$(stat -c %s "$OUT/seeds.tgz")" -gt 15728640 ]; then   # NOTE: <= 16 MiB per file comes back
      tar czf "$OUT/seeds.tgz" --exclude='*.pt' --exclude='*.pt.tmp' --exclude='*.png' \
        -C "$(dirname "$RUN")" "$(basename "$RUN")"
      note "seeds.tgz was over 15 MiB: packed again without the per-run PNGs"
    fi
  fi
  note "total wall time $(( $(date +%s) - T0 )) s; outputs: $(ls "$OUT" | tr '\n' ' ')"
}
trap finish EXIT
trap 'note "signal received: stopping"; exit 143' TERM INT

echo "== versions" | tee -a "$LOG"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader 2>/dev/null || echo "no GPU"
  torch_versions
  echo "git commit: ${FP8ATTN_GIT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}; $(nproc) CPU cores"
} | tee -a "$SUMMARY" | tee -a "$LOG"

echo "== library" | tee -a "$LOG"
study_library "$GPU" || exit 1
# SEEDS_MODES checked once, before any run: compare's --modes rules (the grammar, a
# repeated entry or configuration; a repeated mode would have two processes write one
# run dir).
if ! why="$("$PYTHON" -c 'import sys
from fp8attn.train.compare import parse_modes
try:
    parse_modes(sys.argv[1])
except SystemExit as e:
    print(str(e).replace("--modes:", "SEEDS_MODES:", 1)); sys.exit(1)' "$MODES" 2>&1)"; then
  note "${why:-SEEDS_MODES: could not be checked (fp8attn.train.compare did not import)}"; exit 2
fi
if [ "$GPU" = 1 ]; then  # NOTE: CPU side of 8 processes
  export OMP_NUM_THREADS=$(( $(nproc) / PARALLEL > 0 ? $(nproc) / PARALLEL : 1 ))
fi
# NOTE: the corpus is prepared once here, not by 8 processes at once.
study_corpus "$GPU" "$PRESET" || exit 1
if ! "$PYTHON" - "$PRESET" >>"$LOG" 2>&1 <<'EOF'
import sys
from fp8attn.train.compare import DATA_MAX_MB
from fp8attn.train.data import prepare
from fp8attn.train.model import PRESETS
p = sys.argv[1]
d = prepare("data", vocab_size=PRESETS[p]["model"]["vocab_size"], max_mb=DATA_MAX_MB.get(p, 32.0))
print("corpus", d.root)
EOF
then note "corpus preparation failed; see seeds.log"; tail -5 "$LOG"; exit 1; fi
note "config: preset $PRESET, model $MODEL, qk_norm $QK_NORM, lr $LR, seq/batch ${SEEDS_SEQ_LEN:-preset}/${SEEDS_BATCH:-preset}," \
     "modes $MODES, seeds $SEEDS (data seeds $(for s in ${SEEDS//,/ }; do printf '%s ' "$(data_seed "$s")"; done| sed 's/ $//')), ${#JOBS[@]} runs," \
     "at most $PARALLEL at once, device $DEVICE, total budget ${TOTAL_S} s"

start_mps

# ---- 1. calibration -> step count ------------------------------------------------------
if [ -n "${SEEDS_STEPS:-}" ]; then
  STEPS="$SEEDS_STEPS"
  note "steps: fixed SEEDS_STEPS=$STEPS (no calibration)"
else
  STEPS=0
  for attempt in 1 2 3; do
    n=$(( ${#JOBS[@]} < PARALLEL ? ${#JOBS[@]} : PARALLEL ))
    echo "== [$(( $(date +%s) - T0 )) s] calibration $attempt: $CALIB_STEPS steps of $n runs at once (MPS $MPS)" | tee -a "$LOG"
    rm -rf "$CAL"
    limit=$(( $(left) - RESERVE - MIN_TRAIN ))   # NOTE: leave at least MIN_TRAIN s to train; [ "$limit" -gt "$CAL_LIMIT" ] && limit=$CAL_LIMIT
    if [ "$limit" -lt 15 ]; then note "calibration: no time left"; break; fi
    tc0=$(date +%s)
    run_batch "$CAL" "$CALIB_STEPS" $(( tc0 + limit )) "${JOBS[@]:0:n}" -- \
      --no-save --diag-every "$DIAG_EVERY" --val-every 100000 --val-batches 1
    tc1=$(date +%s)
    note "calibration $attempt: $(tr '\n' ' ' <"$CAL/rc.txt") in $(( tc1 - tc0 )) s; GPU $(mem_peak "$tc0" "$tc1")"
    TRAIN_END=$(( DEADLINE - RESERVE ))
    read -r STEPS CAL_NOTE <<<"$("$PYTHON" -m fp8attn.train.seeds plan --calib "$CAL" --window-s $(( TRAIN_END - $(date +%s) )) \
        --parallel "$PARALLEL" --n-runs "${#JOBS[@]}" --cal-wall-s $(( tc1 - tc0 )) --val-batches "$VAL_BATCHES" \
        --max-steps "$MAX_STEPS" --margin "${SEEDS_MARGIN:-1.25}" 2>>"$LOG")"
    STEPS=${STEPS:-0}
    note "calibration $attempt: $CAL_NOTE -> $STEPS steps"
    if [ "$(grep -c 'rc=0$' "$CAL/rc.txt")" != "$n" ]; then   # NOTE: a run that failed before its dir existed
      [ "$STEPS" != 0 ] && note "calibration $attempt: not every run ended with rc=0; counted as failed"
      STEPS=0
    fi
    [ "$STEPS" -gt 0 ] 2>/dev/null && break
    STEPS=0
    for f in "$CAL"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -4 "$f"; }; done | tee -a "$LOG"
    if grep -qil "out of memory" "$CAL"/*.log 2>/dev/null && [ "$PARALLEL" -gt 1 ]; then
      PARALLEL=$(( PARALLEL / 2 )); note "calibration ran out of GPU memory: at most $PARALLEL runs at once"
    elif [ "$MPS" = 1 ]; then
      note "calibration failed under MPS: stopping MPS, again with plain processes"; stop_mps
    else
      break
    fi
  done
  if [ "$STEPS" = 0 ]; then note "calibration failed; see seeds.log"; exit 1; fi
fi

# ---- 2. training ------------------------------------------------------------------------
TRAIN_END=$(( DEADLINE - RESERVE ))
echo "== [$(( $(date +%s) - T0 )) s] training: ${#JOBS[@]} runs x $STEPS steps, at most $PARALLEL at once (MPS $MPS), window $(( TRAIN_END - $(date +%s) )) s" | tee -a "$LOG"
tt0=$(date +%s)
run_batch "$RUN" "$STEPS" "$TRAIN_END" "${JOBS[@]}" -- --diag-every "$DIAG_EVERY" --val-batches "$VAL_BATCHES" --no-save
tt1=$(date +%s)
note "training: $(tr '\n' ' ' <"$RUN/rc.txt")(124 = killed by the backstop timeout) in $(( tt1 - tt0 )) s; GPU $(mem_peak "$tt0" "$tt1")"
for j in "${JOBS[@]}"; do
  name="${j%%:*}-s${j##*:}"
  line="$(grep -E '^\[compare\] (bf16|fp8)' "$RUN/$name.log" 2>/dev/null | tail -1)"
  note "  $name: ${line:-no result (see $name.log)}"
done
[ -f "$RUN/gpu_apps.txt" ] && { echo "per-process GPU memory (last snapshot):"; awk 'NF==1{blk=""} {blk=blk $0 "\n"} END{printf "%s", blk}' "$RUN/gpu_apps.txt"; } | tee -a "$SUMMARY" >>"$LOG"

# ---- 3. aggregation ----------------------------------------------------------------------
echo "== [$(( $(date +%s) - T0 )) s] aggregation" | tee -a "$LOG"
aggregate
