"""Forward and backward outputs of two CUDA builds of fp8attn on the same inputs
(e.g. a kernel branch against main): run `save` once per build (choose the build
with PYTHONPATH), then `compare`.

    PYTHONPATH=<build A>/python python3 benchmarks/bwd_compare_builds_gpu.py save a.pt
    PYTHONPATH=<build B>/python python3 benchmarks/bwd_compare_builds_gpu.py save b.pt
    python3 benchmarks/bwd_compare_builds_gpu.py compare a.pt b.pt

Inputs: seeded on the GPU, O and LSE from the CUDA forward (same kernel in both
builds when only the backward changed); every head_dim, causal or not, GQA,
partial tiles, n_iters = 0 CTAs (causal, seqlen_q < seqlen_k), delta_matching
and stale, E4M3 and E5M2 gradients, diagnostics on.
Prints per case: whether the forward's O and LSE are bitwise equal (a forward
change that keeps the math and its order, e.g. wgmma forward v8, must keep them),
dQ ||a - b|| / ||b||, whether dK and dV are bitwise equal,
the four diagnostics rows' relative differences; then the worst values.
Use: wgmma bwd v6 (docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md) changes
only dQ's dS blocking (64-key blocks for matmul #6), so dK and dV must be
bitwise equal to main's and dQ within FP8 quantization level (~1e-3).
"""
import math
import sys
import time

import torch

import fp8attn  # noqa: F401  (registers torch.ops.fp8attn; PYTHONPATH picks the build)

OPS = torch.ops.fp8attn
SHAPES = [  # b, hq, hkv, sq, sk, d, dv, causal
    (2, 4, 2, 333, 200, 128, 128, False), (2, 4, 2, 333, 200, 128, 128, True),
    (2, 4, 2, 200, 333, 64, 64, True), (2, 6, 2, 290, 260, 64, 64, False),
    (1, 4, 2, 1024, 1024, 128, 128, False), (1, 4, 2, 1024, 1024, 128, 128, True),
    (1, 8, 1, 640, 1000, 64, 64, True), (1, 2, 1, 300, 100, 64, 64, True), (1, 2, 1, 100, 300, 128, 128, True),
    (1, 2, 2, 128, 128, 128, 128, False), (1, 2, 2, 256, 128, 128, 128, False), (1, 2, 2, 384, 128, 64, 64, False),
    (1, 4, 2, 333, 200, 256, 256, True), (1, 4, 2, 333, 200, 192, 128, False), (1, 1, 1, 256, 128, 192, 128, False),
]


def run():
    res = {}
    for si, (b, hq, hkv, sq, sk, d, dv, causal) in enumerate(SHAPES):
        g = torch.Generator(device="cuda").manual_seed(1234 + si)
        q = torch.randn(b, hq, sq, d, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, hkv, sk, d, device="cuda", generator=g).bfloat16()
        v = torch.randn(b, hkv, sk, dv, device="cuda", generator=g).bfloat16()
        do = torch.randn(b, hq, sq, dv, device="cuda", generator=g).bfloat16()
        tau = float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))
        if si == 0:
            q[0, 1, 7] *= 40.0  # one query row with large logits (rescaling / block-scale paths)
        out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128)
        res[(si, "fwd")] = (out.cpu(), lse.cpu())
        for mode in ("delta_matching", "stale"):
            for fmt in ("e4m3", "e5m2"):
                r = OPS.bwd(do, q, k, v, out, lse, tau, causal, "fp8", mode, 128, fmt, True)
                torch.cuda.synchronize()
                res[(si, mode, fmt)] = tuple(t.cpu() for t in r)
    return res


def rel(x, y):
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def compare(fa, fb):
    a, m = torch.load(fa), torch.load(fb)
    worst = {"dQ": 0.0, "dK not bitwise": 0, "dV not bitwise": 0, "non-finite": 0}
    worst["fwd not bitwise"] = 0
    for key in a:
        ra, rm = a[key], m[key]
        if key[1] == "fwd":
            same = all(torch.equal(x, y) for x, y in zip(ra, rm))
            finite = bool(torch.isfinite(ra[0]).all())
            worst["fwd not bitwise"] += 0 if same else 1
            worst["non-finite"] += 0 if finite else 1
            print(str(SHAPES[key[0]]), "fwd", "O, LSE bitwise" if same else "O %.2e LSE %.2e" % (
                rel(ra[0].double(), rm[0].double()), rel(ra[1].double().nan_to_num(), rm[1].double().nan_to_num())))
            continue
        line = [str(SHAPES[key[0]]), key[1], key[2]]
        for name, x, y in zip(("dQ", "dK", "dV"), ra[:3], rm[:3]):
            x, y = x.double(), y.double()
            if not bool(torch.isfinite(x).all()):
                worst["non-finite"] += 1
                line.append(name + " NON-FINITE")
            if name == "dQ":
                r = rel(x, y)
                line.append("dQ %.2e" % r)
                worst["dQ"] = max(worst["dQ"], r)
            elif torch.equal(x, y):
                line.append(name + " bitwise")
            else:
                line.append("%s DIFF %.2e" % (name, rel(x, y)))
                worst[name + " not bitwise"] += 1
        da, dm = ra[3].double(), rm[3].double()
        for i in range(da.shape[0]):
            r = rel(da[i], dm[i])
            line.append("diag%d %.1e" % (i, r))
            worst["diag%d" % i] = max(worst.get("diag%d" % i, 0.0), r)
        print(" ".join(line))
    print("WORST", worst)


if __name__ == "__main__":
    if sys.argv[1] == "save":
        t0 = time.time()
        torch.save(run(), sys.argv[2])
        print("saved", sys.argv[2], "%.1f s" % (time.time() - t0))
    else:
        compare(sys.argv[2], sys.argv[3])
