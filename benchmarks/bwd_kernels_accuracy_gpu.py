"""Accuracy of the CUDA `row` backward (the wgmma kernels) against the CPU
reference of the same FP8 recipe and the exact FP64 backward (docs/numerics.md
section 6), plus the Delta-Matching pre-cast row-sum residual and the one-key
degenerate case (exact dS = 0). Until 2026-12-07 it also ran the mma.sync
backward (FP8ATTN_BWD_KERNEL=mma) side by side; that kernel was removed (code
at f7729f9).

    PYTHONPATH=python python3 benchmarks/bwd_kernels_accuracy_gpu.py

Prints one line per (shape, causal, mode): ||cuda - cpu|| / ||cpu||
and ||cuda - exact|| / ||exact|| for dQ, dK, dV, the mean pre-cast residual,
and max |dQ|, |dK| (the degenerate case's residue). Needs a GPU and the CUDA extension.
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import fp8attn  # noqa: E402,F401

OPS = torch.ops.fp8attn


def scale(d):
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def inputs(b, hq, hkv, sq, sk, d, causal, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=gen).bfloat16()
    k = torch.randn(b, hkv, sk, d, generator=gen).bfloat16()
    v = torch.randn(b, hkv, sk, d, generator=gen).bfloat16()
    do = torch.randn(b, hq, sq, d, generator=gen).bfloat16()
    out, lse = OPS.fwd(q, k, v, scale(d), causal, "fp8", 128)
    return q, k, v, out, lse, do


def main():
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    cases = [((1, 2, 1, 77, 1, 128), False), ((2, 4, 2, 333, 200, 128), False), ((2, 4, 2, 333, 200, 128), True),
             ((2, 4, 2, 200, 333, 64), True), ((1, 4, 2, 384, 384, 128), False)]
    for shape, causal in cases:
        q, k, v, out, lse, do = inputs(*shape, causal, seed=sum(shape) + causal)
        tau = scale(shape[-1])
        for mode in ("stale", "delta_matching"):
            cpu = OPS.bwd(do, q, k, v, out, lse, tau, causal, "fp8", mode, 128, "e4m3", True)
            ex = OPS.bwd(do.double(), q.double(), k.double(), v.double(), out.double(), lse, tau, causal, "exact",
                         mode, 128, "e4m3", False)
            dev = [t.cuda() for t in (do, q, k, v, out, lse)]
            cu = [t.cpu().double() for t in OPS.bwd(*dev, tau, causal, "fp8", mode, 128, "e4m3", True)]
            msg = []
            for name, c, r, e in zip(("dQ", "dK", "dV"), cu[:3], cpu[:3], ex[:3]):
                r, e = r.double(), e.double()
                msg.append(f"{name} cpu {((c - r).norm() / max(r.norm(), 1e-30)).item():.2e} "
                           f"exact {((c - e).norm() / max(e.norm(), 1e-30)).item():.2e} "
                           f"(cpu-exact {((r - e).norm() / max(e.norm(), 1e-30)).item():.2e})")
            print(f"{shape} causal={causal} {mode:14s} | " + " | ".join(msg)
                  + f" | rowsum_pre {cu[3][2].mean().item():.2e} (cpu {cpu[3][2].double().mean().item():.2e})"
                  + f" | max|dQ| {cu[0].abs().max().item():.3e} max|dK| {cu[1].abs().max().item():.3e}", flush=True)
    # Delta-Matching residual with LSE (and O) from the CUDA forward, as in
    # training: sum_j P_ij = 1 to FP32 rounding only if the backward's
    # recomputed S matches the S the forward's LSE came from.
    for shape, causal in [((1, 4, 2, 384, 384, 128), False), ((2, 4, 2, 333, 200, 128), True),
                          ((2, 4, 2, 200, 333, 64), True)]:
        q, k, v, _, _, do = inputs(*shape, causal, seed=sum(shape) + causal)
        tau = scale(shape[-1])
        dev = [t.cuda() for t in (q, k, v, do)]
        out, lse = OPS.fwd(dev[0], dev[1], dev[2], tau, causal, "fp8", 128)
        res = {}
        for mode in ("stale", "delta_matching"):
            diag = OPS.bwd(dev[3], dev[0], dev[1], dev[2], out, lse, tau, causal, "fp8", mode, 128, "e4m3",
                           True)[3]
            res[mode] = diag[2].double().mean().item()
        print(f"CUDA-forward LSE {shape} causal={causal} | rowsum_pre stale {res['stale']:.2e} "
              f"delta_matching {res['delta_matching']:.2e}", flush=True)


if __name__ == "__main__":
    main()
