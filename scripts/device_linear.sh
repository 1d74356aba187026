#!/usr/bin/env bash
# One short H200 validation of the FP8 linear path and the end-to-end benchmark
# (issue #7): GPU tests of fp8attn.linear (cuBLASLt block-scaled scaled_mm vs
# the FP32 emulation), measured scaled_mm-vs-emulation differences and GEMM
# timings, benchmarks/bench_linear_gpu.py (every linear shape of a preset, BF16 vs
# FP8Linear vs torchao float8; issue 21), then benchmarks/bench_train.py. Logs under $OUT.
#   run(command="bash scripts/device_linear.sh", carry=[".devbuild/lib", ".whl"], timeout_s=300)
# (.whl: torchao's wheel for the torchao columns / configs; without it they say n/a).
# (or from a worktree copy: cd .wt/<WT> && bash scripts/device_linear.sh, carry=[".wt/<WT>"]).
# Needs python/fp8attn/_C*.so built with CUDA (FP8ATTN_BUILD_CUDA=1) for the
# fp8 attention core in the benchmark; FP8Linear itself needs no extension.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup device_out
# A prebuilt CUDA library carried in .devbuild/lib (as for device_all.sh) wins over an in-place one.
use_carried_so
T_BENCH="${T_BENCH:-80}"   # BENCH_ARGS: extra bench_train.py arguments
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/summary.txt"
"$PYTHON" -c "import torch, fp8attn; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'fp8attn CUDA kernels', fp8attn._lib.HAS_CUDA_KERNELS)" 2>&1 | tee -a "$OUT/summary.txt"
echo "== pytest tests/python/test_linear.py tests/python/test_linear_fused.py" | tee -a "$OUT/summary.txt"
timeout 150 "$PYTHON" -m pytest -q -rs tests/python/test_linear.py tests/python/test_linear_fused.py 2>&1 | tee "$OUT/pytest_linear.log" | tail -4 | tee -a "$OUT/summary.txt"
echo "== scaled_mm vs emulation, GEMM timing" | tee -a "$OUT/summary.txt"
timeout 30 "$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import math, time, torch
from fp8attn import linear as L
torch.manual_seed(0)
m, k, n = 16384, 768, 2304
x = torch.randn(m, k, device="cuda"); w = torch.randn(n, k, device="cuda") / math.sqrt(k); dy = torch.randn(m, n, device="cuda")
res = {}
for be in ("scaled_mm", "emulated"):
    xx = x.clone().requires_grad_(); ww = w.clone().requires_grad_()
    y = L.fp8_linear(xx, ww, backend=be); y.backward(dy)
    res[be] = (y.detach(), xx.grad, ww.grad)
ex = (x.double() @ w.double().t(), dy.double() @ w.double(), dy.double().t() @ x.double())
for i, name in enumerate(("y", "dx", "dW")):
    a, e = res["scaled_mm"][i].double(), res["emulated"][i].double()
    print(f"{name}: scaled_mm vs emulation rel {float((a - e).norm() / e.norm()):.2e}; "
          f"vs FP64 exact rel {float((a - ex[i]).norm() / ex[i].norm()):.4f}")
def bench(f, it=20):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(it): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / it * 1e3
xb, wb = x.bfloat16(), w.bfloat16()
xq, xs = L.quantize_1x128(x); wq, ws = L.quantize_128x128(w)
print(f"[{m}x{k}] x [{k}x{n}]: bf16 mm {bench(lambda: xb @ wb.t()):.3f} ms, "
      f"fp8 block-scaled GEMM only {bench(lambda: L._gemm_1x128_128x128(xq, xs, wq, ws, torch.bfloat16)):.3f} ms, "
      f"quantize x 1x128 {bench(lambda: L.quantize_1x128(x)):.3f} ms")
lin = L.FP8Linear(k, n, bias=False).cuda(); ref = torch.nn.Linear(k, n, bias=False).cuda()
xr = x.bfloat16().requires_grad_()
def step(mod):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mod(xr)
    y.backward(dy.bfloat16())
print(f"fwd+bwd: nn.Linear bf16 autocast {bench(lambda: step(ref)):.3f} ms, FP8Linear {bench(lambda: step(lin)):.3f} ms")
PY
install_torchao
echo "$TORCHAO_NOTE" | tee -a "$OUT/summary.txt"
echo "== bench_linear_gpu (per-GEMM fwd+bwd: BF16, FP8Linear, torchao float8; LINEAR_ARGS)" | tee -a "$OUT/summary.txt"
timeout "${T_LINEAR:-120}" "$PYTHON" benchmarks/bench_linear_gpu.py ${LINEAR_ARGS:-} --json "$OUT/bench_linear_gpu.json" 2>&1 | tee "$OUT/bench_linear_gpu.log" | tail -12 | tee -a "$OUT/summary.txt"
echo "bench_linear rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
echo "== bench_train" | tee -a "$OUT/summary.txt"
timeout "$T_BENCH" "$PYTHON" benchmarks/bench_train.py ${BENCH_ARGS:-} --json "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" | tail -14 | tee -a "$OUT/summary.txt"
echo "bench rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
