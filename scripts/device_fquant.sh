#!/usr/bin/env bash
# One short H200 check of the fused FP8 quantizers (issue #7 item 1): the linear
# tests (incl. the fused-vs-torch bit-identity tests), a micro-benchmark
# (quantizers fused vs torch ops; FP8Linear fwd+bwd vs nn.Linear BF16), then
# benchmarks/bench_train.py on gpu-50m. At most 90 s of commands (timeouts 50 + 15 + 25 s,
# T_TEST / T_MICRO / T_BENCH); the first triton compiles dominate the tests. Logs under $OUT.
#   run(command="cd .wt/wt-fquant/src && bash scripts/device_fquant.sh", carry=[".wt/wt-fquant"], timeout_s=120)
# bench_train needs python/fp8attn/_C*.so built with CUDA (or .devbuild/lib/fp8attn/_C*.so);
# (the linear tests and the micro-benchmark use no CUDA kernels of the extension).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_common.sh"
device_setup device_out
use_carried_so
S="$OUT/summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$S"
"$PYTHON" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1 | tee -a "$S"
echo "== pytest tests/python/test_linear.py" | tee -a "$S"
t0=$(date +%s)
timeout "${T_TEST:-50}" "$PYTHON" -m pytest -q -rs tests/python/test_linear.py 2>&1 | tee "$OUT/pytest_linear.log" | tail -6 | tee -a "$S"
echo "pytest rc ${PIPESTATUS[0]} ($(( $(date +%s) - t0 )) s)" | tee -a "$S"
echo "== micro-benchmark" | tee -a "$S"
timeout "${T_MICRO:-15}" "$PYTHON" - <<'PY' 2>&1 | tee -a "$S"
import math, time, torch
from fp8attn import linear as L
from fp8attn import quant_fp8_block128_triton as TQ
torch.manual_seed(0)
m, k, n = 16384, 768, 2304
x = torch.randn(m, k, device="cuda"); xb = x.bfloat16()
w = torch.randn(n, k, device="cuda") / math.sqrt(k); dy = torch.randn(m, n, device="cuda").bfloat16()
def bench(f, it=20):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(it): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / it * 1e3
def same(a, b):
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
rows = []
for name, t, elt in (("x fp32 [16384x768] 1x128", x, 4), ("x bf16 [16384x768] 1x128", xb, 2),
                     ("x^T bf16 (transpose fused) 1x128", xb.t(), 2), ("dy bf16 [16384x2304] 1x128", dy, 2)):
    tt = bench(lambda: L._quantize_1x128_torch(t, "e4m3")); tf = bench(lambda: TQ.quantize_1x128(t, "e4m3"))
    ok = same(TQ.quantize_1x128(t, "e4m3"), L._quantize_1x128_torch(t, "e4m3"))
    print(f"quantize {name}: torch ops {tt:.3f} ms, fused {tf:.3f} ms ({t.numel() * (elt + 1) / tf / 1e6:.0f} GB/s), bit-identical {ok}")
td = bench(lambda: TQ.quantize_1x128_dual(dy, "e4m3"))
tt = bench(lambda: (L._quantize_1x128_torch(dy, "e4m3"), L._quantize_1x128_torch(dy.t(), "e4m3")))
d = TQ.quantize_1x128_dual(dy, "e4m3", outer_major=False)
ok = same(d[:2], L._quantize_1x128_torch(dy, "e4m3")) and same(d[2:], L._quantize_1x128_torch(dy.t(), "e4m3"))
print(f"quantize dy rows + dy^T rows (dual, one read): torch ops {tt:.3f} ms, fused {td:.3f} ms "
      f"({dy.numel() * 4 / td / 1e6:.0f} GB/s), bit-identical {ok}")
tt = bench(lambda: L._quantize_128x128_torch(w, "e4m3")); tf = bench(lambda: TQ.quantize_128x128(w, "e4m3"))
print(f"quantize W fp32 [2304x768] 128x128: torch ops {tt:.3f} ms, fused {tf:.3f} ms, "
      f"bit-identical {same(TQ.quantize_128x128(w, 'e4m3'), L._quantize_128x128_torch(w, 'e4m3'))}")
xq, xs = L.quantize_1x128(x); wq, ws = L.quantize_128x128(w)
print(f"[{m}x{k}] x [{k}x{n}]: bf16 mm {bench(lambda: xb @ w.bfloat16().t()):.3f} ms, "
      f"fp8 block-scaled GEMM only {bench(lambda: L._gemm_1x128_128x128(xq, xs, wq, ws, torch.bfloat16)):.3f} ms")
lin = L.FP8Linear(k, n, bias=False).cuda(); ref = torch.nn.Linear(k, n, bias=False).cuda()
xr = xb.clone().requires_grad_()
def step(mod, bwd=True):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mod(xr)
    if bwd:
        y.backward(dy)
res = {}
for fused in (True, False):
    L.FUSED_QUANT = fused
    res[fused] = (bench(lambda: step(lin, False)), bench(lambda: step(lin)))
L.FUSED_QUANT = True
print(f"fwd: nn.Linear bf16 autocast {bench(lambda: step(ref, False)):.3f} ms, FP8Linear fused {res[True][0]:.3f} ms, "
      f"FP8Linear torch-op quantizers {res[False][0]:.3f} ms")
print(f"fwd+bwd: nn.Linear bf16 autocast {bench(lambda: step(ref)):.3f} ms, FP8Linear fused {res[True][1]:.3f} ms, "
      f"FP8Linear torch-op quantizers {res[False][1]:.3f} ms")
PY
echo "micro rc ${PIPESTATUS[0]}" | tee -a "$S"
echo "== bench_train gpu-50m" | tee -a "$S"
timeout "${T_BENCH:-25}" "$PYTHON" benchmarks/bench_train.py --presets gpu-50m ${BENCH_ARGS:-} --json "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" | tail -10 | tee -a "$S"
echo "bench rc ${PIPESTATUS[0]}" | tee -a "$S"
