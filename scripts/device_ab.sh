#!/usr/bin/env bash
# Same-run A/B of a kernel change on the lent GPU: build A (this tree) natively, then
# B = A + the patches in AB_PATCHES (git-apply format, e.g. docs/kernels/pending/*.patch),
# run AB_TESTS on B (the GPU tests a change must pass before it lands), then the
# benchmark on both libraries interleaved (A, B, A, B: drift shows as A != A), and a
# table of B / A per kernel time last.
#
#   run(command="AB_PATCHES='docs/kernels/pending/x.patch' bash scripts/device_ab.sh",
#       carry=["third_party"], timeout_s=600)
#
# Knobs: AB_PATCHES (required, space-separated), AB_TESTS (default the tile kernels' GPU
# tests), AB_PYTEST_ARGS (default "-n 5 -p no:cacheprovider"), AB_SHAPES (bench_gpu.py
# --shapes, default 2x16x8192x128,16x16x1024x128), AB_BENCH_ARGS (more bench_gpu.py
# arguments; default "--scaling row,tile --no-cudnn-fp8 --no-accuracy --no-extras"),
# AB_ROUNDS (benchmark rounds per library, default 2; 0: no benchmark, and A is not built), AB_T_TESTS (s, default 240),
# AB_SAN=1 also runs compute-sanitizer memcheck + racecheck on B (the device_all.sh
# sanitize case), AB_EXTRA a command run last with B's library on PYTHONPATH (output in
# extra.log, e.g. '"$PYTHON" benchmarks/op_breakdown.py --host --shapes 16x16x1024x128'). Outputs under $OUT: summary.txt, build.log, pytest_b.log,
# bench_{a,b}{1,2}.json, ab.md. Exit status 0 iff both builds, the tests (and
# sanitizers) passed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup ab_out
summary_init
[ -n "${AB_PATCHES:-}" ] || { note "AB_PATCHES is empty: name the patches that make B"; exit 2; }
rc_all=0

note "== $(date -u '+%Y-%m-%d %H:%M UTC'); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); $(torch_versions); $(nvcc --version | tail -1)"

# build_copy NAME: native build in place, then a copy of python/ with it in /tmp/ab_NAME.
build_copy() {
  device_library || return 1
  note "$1: $LIB_NOTE"
  rm -rf "/tmp/ab_$1" && mkdir -p "/tmp/ab_$1" && cp -r python "/tmp/ab_$1/"
}
if [ "${AB_ROUNDS:-2}" != 0 ]; then build_copy a || exit 1; fi
for p in $AB_PATCHES; do
  if git apply --check "$p" 2>/dev/null; then git apply "$p"; else patch -p1 --forward <"$p" >/dev/null; fi \
    || { note "patch $p does not apply"; exit 1; }
  note "applied $p"
done
build_copy b || exit 1

echo "== GPU tests on B"
tests="${AB_TESTS:-tests/python/test_tile_cuda.py tests/python/test_tile_cuda_bwd.py}"
# shellcheck disable=SC2086
PYTHONPATH=/tmp/ab_b/python timeout "${AB_T_TESTS:-240}" "$PYTHON" -m pytest -q -rfE $tests \
  ${AB_PYTEST_ARGS:--n 5 -p no:cacheprovider} >"$OUT/pytest_b.log" 2>&1
rc=$?
tail -8 "$OUT/pytest_b.log"
note "tests on B: rc=$rc, $(tail -1 "$OUT/pytest_b.log")"
[ $rc = 0 ] || rc_all=1

if [ "${AB_SAN:-0}" = 1 ]; then
  # The sanitize case of device_all.sh (written there to /tmp): extract it.
  sed -n "/^cat >\/tmp\/fp8attn_sanitize_case.py <<'EOF'$/,/^EOF$/p" scripts/device_all.sh | sed '1d;$d' \
    >/tmp/fp8attn_sanitize_case.py
  for tool in memcheck racecheck; do
    PYTHONPATH=/tmp/ab_b/python PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${AB_T_SAN:-150}" \
      compute-sanitizer --tool "$tool" --error-exitcode 3 "$PYTHON" /tmp/fp8attn_sanitize_case.py \
      >"/tmp/sanitizer_$tool.log" 2>&1
    rc=$?
    note "B compute-sanitizer $tool: rc=$rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/sanitizer_$tool.log" | tail -1)"
    [ $rc = 0 ] || { rc_all=1; tail -30 "/tmp/sanitizer_$tool.log"; }
  done
fi

echo "== benchmark, interleaved"
for r in $(seq 1 "${AB_ROUNDS:-2}"); do  # (none with AB_ROUNDS=0)
  for lib in a b; do
    # shellcheck disable=SC2086
    PYTHONPATH="/tmp/ab_$lib/python" timeout 200 "$PYTHON" benchmarks/bench_gpu.py \
      --shapes "${AB_SHAPES:-2x16x8192x128,16x16x1024x128}" \
      ${AB_BENCH_ARGS:---scaling row,tile --no-cudnn-fp8 --no-accuracy --no-extras} --out "/tmp/bench_$lib$r" \
      >"/tmp/bench_$lib$r.log" 2>&1
    rc=$?
    note "bench $lib round $r: rc=$rc"
    [ $rc = 0 ] || { tail -20 "/tmp/bench_$lib$r.log"; rc_all=1; }
    cp "/tmp/bench_$lib$r/bench_gpu.json" "$OUT/bench_$lib$r.json" 2>/dev/null
  done
done
[ "${AB_ROUNDS:-2}" = 0 ] || "$PYTHON" - "$OUT" "${AB_ROUNDS:-2}" <<'EOF' | tee "$OUT/ab.md"
import json, os, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def load(lib, r):
    try:
        with open(os.path.join(out, f"bench_{lib}{r}.json")) as f:
            return json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return None
keys = ["cudnn_fwd_ms", "cudnn_bwd_ms", "fp8_fwd_ms", "fp8_bwd_delta_matching_ms", "tile_fwd_ms", "tile_fwd_kernel_ms",
        "tile_quant_ms", "tile_bwd_delta_matching_ms", "tile_bwd_main_ms", "tile_bwd_prepass_ms"]
runs = {(lib, r): load(lib, r) for lib in "ab" for r in range(1, rounds + 1)}
print("| shape | causal | time (ms) | " + " | ".join(f"A{r}" for r in range(1, rounds + 1)) + " | "
      + " | ".join(f"B{r}" for r in range(1, rounds + 1)) + " | B / A (medians) |")
print("|---|---|---|" + "---|" * (2 * rounds + 1))
base = next((v for v in runs.values() if v), None) or []
for i, row in enumerate(base):
    for k in keys:
        vals = {lr: (rows[i].get(k) if rows and i < len(rows) else None) for lr, rows in runs.items()}
        if all(v is None for v in vals.values()):
            continue
        a = sorted(v for (lib, _), v in vals.items() if lib == "a" and v is not None)
        b = sorted(v for (lib, _), v in vals.items() if lib == "b" and v is not None)
        ratio = f"{b[len(b) // 2] / a[len(a) // 2]:.3f}" if a and b else "n/a"
        cells = [("n/a" if vals[(lib, r)] is None else f"{vals[(lib, r)]:.4f}") for lib in "ab"
                 for r in range(1, rounds + 1)]
        print(f"| {row['B']}x{row['H']}x{row['S']}x{row['d']} | {row['causal']} | {k} | " + " | ".join(cells)
              + f" | {ratio} |")
EOF
if [ -n "${AB_EXTRA:-}" ]; then
  echo "== extra: $AB_EXTRA"
  PYTHONPATH=/tmp/ab_b/python timeout "${AB_T_EXTRA:-150}" bash -c "$AB_EXTRA" >"$OUT/extra.log" 2>&1
  note "extra: rc=$?"
  tail -60 "$OUT/extra.log"
fi
note "exit status $rc_all"
exit $rc_all
