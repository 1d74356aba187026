#!/usr/bin/env bash
# The one script run on the lent H200 (the `run` tool of this workplace):
# versions, the CUDA library, GPU tests, compute-sanitizer memcheck and
# racecheck on a small fwd+bwd case, then the GPU benchmark; logs under $OUT,
# a short table last. At most 8 files land in $OUT (the tool's limit): summary.txt,
# pytest_gpu.log, sanitizer_{memcheck,racecheck}.log, bench_gpu.{log,json,md}
# and build.log (native builds).
#
# The library is built here on the device by default (DEVICE_LIB=native, ~40 s with
# MAX_JOBS=16: FP8ATTN_BUILD_CUDA=1 python3 setup.py build_ext --inplace, with whatever
# compiler CXX names; setup.py checks it links libstdc++.so.6 dynamically), so carry the
# CUTLASS headers (scripts/get_cutlass.sh puts them in third_party/, ignored by git):
#   run(command="bash scripts/device_all.sh", carry=["third_party", ".whl"], timeout_s=600)
# DEVICE_LIB=carried instead uses a build made on the CPU machine and carried in
# .devbuild/lib (torch 2.11 cu130 is the same on both machines, so the .so built with
# that machine's Python 3.11 loads on the device's Python 3.12):
#   FP8ATTN_BUILD_CUDA=1 MAX_JOBS=2 python3 setup.py build_ext \
#       --build-lib .devbuild/lib --build-temp .devbuild/tmp
#   run(command="DEVICE_LIB=carried bash scripts/device_all.sh", carry=[".devbuild/lib", ".whl"], timeout_s=600)
# (.devbuild/ is in .git/info/exclude; .whl: the cuDNN frontend wheels for the
# benchmark's cuDNN FP8 columns; optional, without them those columns say n/a).
# The summary names the library, the compiler and its libstdc++ linkage (ldd).
# Env knobs: DEVICE_LIB=native|carried (default native), DEVICE_BENCH=full|quick|0 (default quick), DEVICE_BENCH_SHAPES=BxHxSxd,...
# (bench_gpu.py --shapes instead of the quick / full list), DEVICE_BENCH_ARGS more bench_gpu.py
# arguments (e.g. --scaling row,tile), DEVICE_CPU_TESTS=1 also
# runs the CPU pytest suites, DEVICE_SLOW=1 also the slow limit tests (test_cuda_limits.py),
# DEVICE_TESTS replaces the GPU test list, DEVICE_TESTS_PART=1|2 runs half of the default list,
# DEVICE_PYTEST_ARGS extra pytest arguments,
# DEVICE_SAN=0 skips the sanitizers, DEVICE_BENCH_TRAIN_ARGS more bench_train.py arguments, DEVICE_ACCURACY=1 the accuracy table (DEVICE_ACCURACY_ARGS), DEVICE_NCU Nsight Compute profiles (below), DEVICE_T_TESTS / DEVICE_T_SAN / DEVICE_T_BENCH stage time limits in seconds.
# PYTHON: the interpreter of every Python step (default python3; scripts/device_common.sh).
# Exit status: 0 iff every stage that ran passed (a per-stage table ends the output and
# summary.txt); 1 when one failed or the library did not build / load; 2 for a bad knob.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup device_out
summary_init

# stage NAME RC: records a stage's exit status for the table at the end (and the exit status).
STAGE_NAMES=()
STAGE_RCS=()
stage() { STAGE_NAMES+=("$1"); STAGE_RCS+=("$2"); }

echo "== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee -a "$SUMMARY"
torch_versions | tee -a "$SUMMARY"
nvcc --version | tail -1 | tee -a "$SUMMARY"

echo "== library"
device_library || exit 1
note "$LIB_NOTE"
note "$(library_linkage)"

install_cudnn_frontend
note "$CUDNN_FE_NOTE"

echo "== GPU tests"
# The GPU test files in two parts of similar length (~4 min each at -n 5 on the H200;
# all of both plus the sanitizers and a benchmark do not fit one 10-minute call):
# DEVICE_TESTS_PART=1 (row kernels, fuzz) or 2 (tile kernels, varlen, CP, the FA surface)
# runs one part, unset runs both. NOTE: -n 5 is the measured sweet spot: 1239 tests
# of both parts took 435 s at -n 5 (2026-12-03 09:39) and did not finish in 430 s at -n 8.
part1="tests/python/test_build.py tests/python/test_cuda.py tests/python/test_cuda_bwd.py tests/python/test_cuda_head_dims.py tests/python/test_cuda_fuzz.py tests/python/test_wgmma_accum.py tests/python/test_wgmma_emulation.py tests/python/test_consistent_lse.py"
part2="tests/python/test_tile.py tests/python/test_tile_cuda.py tests/python/test_tile_cuda_bwd.py tests/python/test_cuda_qk_transform.py tests/python/test_linear.py tests/python/test_varlen.py tests/python/test_varlen_op.py tests/python/test_varlen_single_cuda.py tests/python/test_cuda_context_parallel.py tests/python/test_softcap.py tests/python/test_softcap_tile_cuda.py tests/python/test_window_tile_cuda.py tests/python/test_flash_surface.py tests/python/test_cudnn_fp8.py tests/python/test_cudnn_fp8_op.py tests/python/test_cudnn_fp8_train.py tests/python/test_op_edges.py tests/python/test_ddp.py::test_two_gpus_ddp_and_fsdp_train_the_same tests/python/test_fa3_grid.py::test_fa3_grid_gpu_point_matches_cpu_reference tests/python/test_hadamard_triton.py"
case "${DEVICE_TESTS_PART:-all}" in
  1) default_tests="$part1";;
  2) default_tests="$part2";;
  all) default_tests="$part1 $part2";;
  *) note "DEVICE_TESTS_PART=${DEVICE_TESTS_PART}: expected 1, 2 or unset"; exit 2;;
esac
tests="${DEVICE_TESTS:-$default_tests}"
# DEVICE_SLOW=1: also the launch / size limit tests (batch x heads >= 65536, 1M tokens,
# 2^31+ elements; ~3-5 min, <= 60 GB of GPU memory each).
[ "${DEVICE_SLOW:-0}" = 1 ] && tests="$tests tests/python/test_cuda_limits.py"
# shellcheck disable=SC2086
# -v names every result as it lands and SIGINT at the limit makes pytest print its
# summary (failures with their messages) before it exits: a run cut at its limit
# still says which tests failed (2026-12-07: a -q run killed at its limit showed
# four F's and no names). The failed / errored node ids go to the summary too.
timeout -s INT -k 30 "${DEVICE_T_TESTS:-300}" "$PYTHON" -m pytest -v --tb=short -rfE $tests ${DEVICE_PYTEST_ARGS:-} \
  >"$OUT/pytest_gpu.log" 2>&1
rc=$?
grep -E "(FAILED|ERROR) tests/" "$OUT/pytest_gpu.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u | head -40 \
  | tee "$OUT/.failed"
tail -25 "$OUT/pytest_gpu.log"
note "gpu tests: rc=$rc, $(tail -1 "$OUT/pytest_gpu.log")"
[ -s "$OUT/.failed" ] && note "$(cat "$OUT/.failed")"
rm -f "$OUT/.failed"
stage "gpu tests" "$rc"
if [ "${DEVICE_CPU_TESTS:-0}" = 1 ]; then
  timeout 200 "$PYTHON" -m pytest -q -m "not gpu" tests/python >"$OUT/pytest_cpu.log" 2>&1
  rc=$?
  note "cpu tests: rc=$rc, $(tail -1 "$OUT/pytest_cpu.log")"
  stage "cpu tests" "$rc"
fi

echo "== compute-sanitizer"
cat >/tmp/fp8attn_sanitize_case.py <<'EOF'
# One small fwd+bwd per head-dim kernel (causal, GQA, partial tiles).
import torch, fp8attn  # noqa: F401
ops = torch.ops.fp8attn
for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128)):
    q = torch.randn(1, 4, 150, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 200, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 200, dv, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(1, 4, 150, dv, device="cuda", dtype=torch.bfloat16)
    o, lse = ops.fwd(q, k, v, d ** -0.5, True, "fp8", 128)
    try:
        ops.bwd(do, q, k, v, o, lse, d ** -0.5, True, "fp8", "delta_matching", 128, "e4m3", True)
    except NotImplementedError:
        pass
# More query tiles than SMs, more key tiles than K/V stages (stages reused), ragged, both masks,
# the default forward schedules (v11 at d = 64, pingpong at 128), then the other d <= 128
# schedule of each head_dim on a smaller case.
import os
for sched, b, sq in (("", 2, 1100), ("wgmma_pingpong", 1, 500), ("wgmma_serial3", 1, 500)):
    os.environ["FP8ATTN_FWD_KERNEL"] = sched
    for d in (64, 128):
        for causal in (False, True):
            q = torch.randn(b, 8, sq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, 2, 1000, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, 2, 1000, d, device="cuda", dtype=torch.bfloat16)
            ops.fwd(q, k, v, d ** -0.5, causal, "fp8", 128)
os.environ["FP8ATTN_FWD_KERNEL"] = ""
# The `tile` forward (quantization + fwd_tilescale kernels): every head_dim, both masks,
# GQA, ragged, more key tiles than stages; both consumer orders at dv <= 128.
os.environ["FP8ATTN_TILE_FWD"] = "1"
# Both schedulers (FP8ATTN_TILE_PERSISTENT); the persistent one also on 144 work tiles
# (> 132 SMs: CTAs that run several).
for ps in ("0", "1"):
    os.environ["FP8ATTN_TILE_PERSISTENT"] = ps
    for pp in ("0", "1"):
        os.environ["FP8ATTN_TILE_PINGPONG"] = pp
        for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128)):
            for causal in (False, True):
                q = torch.randn(1, 4, 300, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(1, 2, 650, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(1, 2, 650, dv, device="cuda", dtype=torch.bfloat16)
                ops.fwd(q, k, v, d ** -0.5, causal, "fp8", 128, "tile")
        if ps == "1":
            q = torch.randn(1, 48, 260, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
            ops.fwd(q, k, k, 128 ** -0.5, True, "fp8", 128, "tile")
os.environ.pop("FP8ATTN_TILE_PINGPONG")
os.environ.pop("FP8ATTN_TILE_PERSISTENT")
# The `tile` backward (pre-pass + main kernel, FP8ATTN_TILE_BWD=1): every head_dim, both
# masks, GQA, ragged, more query tiles than ring stages, diagnostics; every delta mode at 128.
os.environ["FP8ATTN_TILE_BWD"] = "1"
for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128)):
    for causal in (False, True):
        q = torch.randn(1, 4, 300, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 2, 270, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 2, 270, dv, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(1, 4, 300, dv, device="cuda", dtype=torch.bfloat16)
        o, lse = ops.fwd(q, k, v, d ** -0.5, causal, "fp8", 128, "tile")
        for mode in ("stale", "matched_do", "delta_matching") if d == 128 else ("delta_matching",):
            ops.bwd(do, q, k, v, o, lse, d ** -0.5, causal, "fp8", mode, 128, "e4m3", True, "tile")
        # deterministic=True (numerics.md section 9): the dQ turn counters.
        ops.bwd(do, q, k, v, o, lse, d ** -0.5, causal, "fp8", "delta_matching", 128, "e4m3", False, "tile",
                deterministic=True)
# Sliding windows (numerics.md section 14) in the tile kernels: key-tile ranges per CTA and
# per consumer warpgroup (dummy hand-over turns), query-tile ranges in the backward.
for ps in ("0", "1"):
    os.environ["FP8ATTN_TILE_PERSISTENT"] = ps
    for d in (64, 128):
        for causal, (wl, wr) in ((False, (100, 30)), (True, (200, 0)), (False, (-1, 70)), (False, (5, 5))):
            q = torch.randn(1, 4, 400, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 2, 700, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, 2, 700, d, device="cuda", dtype=torch.bfloat16)
            do = torch.randn(1, 4, 400, d, device="cuda", dtype=torch.bfloat16)
            o, lse = ops.fwd(q, k, v, d ** -0.5, causal, "fp8", 128, "tile", window_left=wl, window_right=wr)
            if ps == "0":
                ops.bwd(do, q, k, v, o, lse, d ** -0.5, causal, "fp8", "delta_matching", 128, "e4m3", True, "tile",
                        window_left=wl, window_right=wr)
os.environ.pop("FP8ATTN_TILE_PERSISTENT")
# Packed batches in one launch (fwd_varlen; hopper/varlen_sm90.h): empty and
# one-token sequences, tokens outside every sequence, seqused, and cu_seqlens that
# break the rules (unchecked: clamped inside the tensors).
cu = torch.tensor([0, 300, 300, 301, 430, 1130], device="cuda", dtype=torch.int32)
for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
    q = torch.randn(1140, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1140, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1140, 2, dv, device="cuda", dtype=torch.bfloat16)
    for causal, (wl, wr) in ((False, (-1, -1)), (True, (-1, 0)), (False, (100, 30))):
        ops.fwd_varlen(q, k, v, cu, cu, None, None, d ** -0.5, causal, 128, "tile", wl, wr)
    used = torch.tensor([10, 0, 1, 128, 700], device="cuda")
    o, lse = ops.fwd_varlen(q, k, v, cu, cu, used, used, d ** -0.5, True, 128, "tile")
    do = torch.randn_like(o)
    for mode in ("stale", "delta_matching") if d == 128 else ("delta_matching",):
        ops.bwd_varlen(do, q, k, v, o, lse, cu, cu, used, used, d ** -0.5, True, mode, 128, "e4m3", d == 128, "tile")
    o, lse = ops.fwd_varlen(q, k, v, cu, cu, None, None, d ** -0.5, False, 128, "tile", 100, 30)
    ops.bwd_varlen(do, q, k, v, o, lse, cu, cu, None, None, d ** -0.5, False, "delta_matching", 128, "e4m3", False,
                   "tile", 100, 30)
for bad in ([0, 300, 200, 5000, -7, 1130], [0, 2**31 - 1, 0, -(2**31), 3, 3]):
    bad = torch.tensor(bad, device="cuda", dtype=torch.int64)
    o, lse = ops.fwd_varlen(q, k, v, bad, bad, None, None, 0.1, True, 128, "tile")
    ops.bwd_varlen(torch.randn_like(o), q, k, v, o, lse, bad, bad, None, None, 0.1, True, "delta_matching", 128,
                   "e4m3", False, "tile")
# The rotation fused into the tile quantization (numerics.md 10.3; BF16 and float32 inputs,
# the FP32-input path of the quantizer) and its gradient map-back, with and without smooth_k.
import fp8attn
for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
    for dt in (torch.bfloat16, torch.float32):
        for sm in (False, True):
            q = torch.randn(1, 4, 300, d, device="cuda", dtype=dt, requires_grad=True)
            k = torch.randn(1, 2, 270, d, device="cuda", dtype=dt, requires_grad=True)
            v = torch.randn(1, 2, 270, dv, device="cuda", dtype=dt, requires_grad=True)
            o = fp8attn.attention(q, k, v, causal=True, scaling="tile", qk_rotation="hadamard", smooth_k=sm)
            o.backward(torch.randn_like(o))
# Logit softcap (numerics.md section 12) in the tile kernels: every head_dim, both masks.
for d, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
    for causal in (False, True):
        q = torch.randn(1, 4, 300, d, device="cuda", dtype=torch.bfloat16) * 3
        k = torch.randn(1, 2, 270, d, device="cuda", dtype=torch.bfloat16) * 3
        v = torch.randn(1, 2, 270, dv, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(1, 4, 300, dv, device="cuda", dtype=torch.bfloat16)
        o, lse = ops.fwd(q, k, v, d ** -0.5, causal, "fp8", 128, "tile", softcap=20.0)
        ops.bwd(do, q, k, v, o, lse, d ** -0.5, causal, "fp8", "delta_matching", 128, "e4m3", True, "tile",
                softcap=20.0)
torch.cuda.synchronize()
print("sanitize case done")
EOF
[ "${DEVICE_SAN:-1}" = 0 ] && DEVICE_SAN_TOOLS=" "
for tool in ${DEVICE_SAN_TOOLS:-memcheck racecheck}; do
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${DEVICE_T_SAN:-240}" compute-sanitizer --tool "$tool" --error-exitcode 3 \
    "$PYTHON" /tmp/fp8attn_sanitize_case.py >"$OUT/sanitizer_$tool.log" 2>&1
  rc=$?
  tail -4 "$OUT/sanitizer_$tool.log"
  note "compute-sanitizer $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
  stage "sanitizer $tool" "$rc"
done

# Optional: the main job's GPU comparison (all four modes), carried data needed:
# DEVICE_TRAIN_STEPS=N with the tokenized corpus in data/ (carry it; the device
# has no network). The run directory lands in $OUT/train.tgz.
if [ "${DEVICE_TRAIN_STEPS:-0}" != 0 ]; then
  echo "== GPU training comparison (${DEVICE_TRAIN_PRESET:-gpu-50m}, ${DEVICE_TRAIN_STEPS} steps/mode)"
  tdir=/tmp/fp8attn_train
  timeout "${DEVICE_T_TRAIN:-240}" "$PYTHON" -m fp8attn.train.compare --preset "${DEVICE_TRAIN_PRESET:-gpu-50m}" \
    --steps "$DEVICE_TRAIN_STEPS" --out "$tdir" --no-progress >/tmp/fp8attn_train.log 2>&1
  rc=$?
  note "training: rc=$rc"
  stage "training" "$rc"
  cp /tmp/fp8attn_train.log "$tdir/" 2>/dev/null
  tail -25 /tmp/fp8attn_train.log
  tar czf "$OUT/train.tgz" --exclude="*.pt" -C "$(dirname "$tdir")" "$(basename "$tdir")"  # NOTE: checkpoints (~200 MB each) stay
fi

# A small text folder (this repo's docs) for the two smoke runs below.
mkdir -p /tmp/nccl_text && cp README.md docs/*.md /tmp/nccl_text/

# Distributed path on this one GPU (FP8ATTN_DIST=1: a 1-rank NCCL group, DDP and
# FSDP2 wrappers), a few steps of the smoke preset (head_dim 64: the CUDA kernels
# have no head_dim 32) on a bundled text dir.
if [ "${DEVICE_NCCL:-1}" = 1 ]; then
  echo "== NCCL (1-rank group) DDP + FSDP2"
  for extra in "" "--fsdp"; do
    # torchrun as a module of $PYTHON (the torchrun on PATH may be another interpreter's)
    FP8ATTN_DIST=1 timeout "${DEVICE_T_NCCL:-60}" "$PYTHON" -m torch.distributed.run --nproc_per_node 1 \
      -m fp8attn.train.compare \
      --preset smoke --model head_dim=64 --modes bf16,fp8-delta_matching --steps 4 --val-every 4 --val-batches 1 --device cuda \
      --data-dir /tmp/nccl_data --text-dir /tmp/nccl_text --no-progress --no-save --out "/tmp/nccl_run$extra" \
      $extra >>"$OUT/pytest_gpu.log" 2>&1
    rc=$?
    ws=$("$PYTHON" -c "import json,sys; from fp8attn.train.report import read_log; s=read_log('/tmp/nccl_run$extra/fp8-delta_matching.jsonl')['summary']; print(s.get('world_size'), s.get('fsdp'), s['final_train_loss'])" 2>&1 | tail -1)
    note "nccl ${extra:-ddp}: rc=$rc (world_size, fsdp, final loss) = $ws"
    name="${extra#--}"
    stage "nccl ${name:-ddp}" "$rc"
  done
fi

# Packed documents on the GPU (--packed: per-document causal attention through
# varlen_attention), a few steps of the smoke preset at head_dim 64.
if [ "${DEVICE_PACKED:-1}" = 1 ]; then
  echo "== packed documents (smoke, GPU)"
  timeout "${DEVICE_T_PACKED:-60}" "$PYTHON" -m fp8attn.train.compare --preset smoke --model head_dim=64 --packed \
    --modes bf16,fp8-delta_matching --steps 4 --val-every 4 --val-batches 1 --device cuda \
    --data-dir /tmp/nccl_data --text-dir /tmp/nccl_text --no-progress --no-save --out /tmp/packed_run \
    >>"$OUT/pytest_gpu.log" 2>&1
  rc=$?
  pk=$("$PYTHON" -c "from fp8attn.train.report import read_log; s=read_log('/tmp/packed_run/fp8-delta_matching.jsonl')['summary']; print(s.get('packed'), s['final_train_loss'], s['final_val_loss'])" 2>&1 | tail -1)
  note "packed: rc=$rc (packed, final train loss, val loss) = $pk"
  stage "packed" "$rc"
fi

# End-to-end training throughput (BF16 cuDNN vs the FP8 scopes), interleaved timed rounds.
if [ "${DEVICE_BENCH_TRAIN:-1}" = 1 ]; then
  echo "== bench_train"
  # NOTE: interleaved rounds (median): single back-to-back timings moved 10-20% between calls.
  # DEVICE_BENCH_TRAIN_ARGS: more bench_train.py arguments (e.g. --presets gpu-125m --packed
  # --configs bf16,fp8/attn-core@tile,fp8/attn-core@tile-loop).
  # shellcheck disable=SC2086
  timeout "${DEVICE_T_BENCH_TRAIN:-180}" "$PYTHON" benchmarks/bench_train.py --rounds "${DEVICE_TRAIN_ROUNDS:-5}" \
    --steps 10 --json "$OUT/bench_train.json" ${DEVICE_BENCH_TRAIN_ARGS:-} \
    >/tmp/bench_train.log 2>&1
  rc=$?
  note "bench_train: rc=$rc"
  stage "bench_train" "$rc"
  tail -12 /tmp/bench_train.log | tee -a "$SUMMARY"
fi

# The accuracy table of docs/results.md section 9 (DEVICE_ACCURACY=1; off by default, ~100 s
# at the default 1K-64K; DEVICE_ACCURACY_ARGS more accuracy_gpu.py arguments, e.g.
# "--seqlens 16384 --variants tile/none,tile/hadamard,tile/both,sdpa-bf16"). The cuDNN FP8
# rows need the frontend that install_cudnn_frontend put on PYTHONPATH above.
if [ "${DEVICE_ACCURACY:-0}" = 1 ]; then
  echo "== accuracy table"
  # shellcheck disable=SC2086
  timeout "${DEVICE_T_ACCURACY:-240}" "$PYTHON" benchmarks/accuracy_gpu.py --out /tmp/accuracy ${DEVICE_ACCURACY_ARGS:-} \
    >/tmp/accuracy.log 2>&1
  rc=$?
  # one file back (the return channel takes 8): accuracy.md, accuracy.json and the log
  cp /tmp/accuracy.log /tmp/accuracy/ 2>/dev/null; tar -czf "$OUT/accuracy.tgz" -C /tmp accuracy
  note "accuracy: rc=$rc"
  stage "accuracy" "$rc"
  tail -16 /tmp/accuracy.log | tee -a "$SUMMARY"
fi

bench="${DEVICE_BENCH:-quick}"
if [ "$bench" != 0 ]; then
  echo "== benchmark ($bench)"
  flag=""
  [ "$bench" = quick ] && flag="--quick"
  [ -n "${DEVICE_BENCH_SHAPES:-}" ] && flag="--shapes $DEVICE_BENCH_SHAPES"
  timeout "${DEVICE_T_BENCH:-240}" "$PYTHON" benchmarks/bench_gpu.py $flag ${DEVICE_BENCH_ARGS:-} --out "$OUT" >"$OUT/bench_gpu.log" 2>&1
  rc=$?
  note "benchmark: rc=$rc"
  stage "benchmark ($bench)" "$rc"
fi

# Optional: Nsight Compute of kernels of the library just built (device_common.sh
# ncu_profile): DEVICE_NCU="tag:kernel-regex:extra ncu_target.py args(comma-separated) ..."
# at NCU_SHAPE (default 2x16x8192x128), e.g.
# DEVICE_NCU="tfwd:fwd_tilescale:--scaling,tile tbwd:bwd_tilescale_main:--bwd,--scaling,tile"
# (NCU_NO_SASS=1 keeps the returned files to details + stalls per kernel: 8 files at most).
for spec in ${DEVICE_NCU:-}; do
  IFS=: read -r tag kre extra <<<"$spec"
  # shellcheck disable=SC2086
  ncu_profile "$tag" "$kre" "${NCU_SHAPE:-2x16x8192x128}" ${extra//,/ }
  stage "ncu $tag" "$?"
done

echo
echo "== summary"
cat "$SUMMARY"
# NOTE: an if, not `[ -f md ] && cat md || tail log`: that list's status (1 when no
# benchmark ran and so no log exists) was the script's exit status, whatever the stages did.
if [ -f "$OUT/bench_gpu.md" ]; then
  cat "$OUT/bench_gpu.md"
elif [ -f "$OUT/bench_gpu.log" ]; then
  tail -15 "$OUT/bench_gpu.log"
fi

echo
echo "== stages"
failed=()
for i in "${!STAGE_NAMES[@]}"; do
  if [ "${STAGE_RCS[$i]}" = 0 ]; then verdict=ok; else verdict=FAILED; failed+=("${STAGE_NAMES[$i]}"); fi
  note "$(printf '%-22s rc=%-4s %s' "${STAGE_NAMES[$i]}" "${STAGE_RCS[$i]}" "$verdict")"
done
if [ "${#failed[@]}" = 0 ]; then
  note "device_all: all ${#STAGE_NAMES[@]} stages passed"
  exit 0
fi
note "device_all: ${#failed[@]} of ${#STAGE_NAMES[@]} stages FAILED: $(IFS=,; echo "${failed[*]}")"
exit 1
