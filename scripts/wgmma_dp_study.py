"""Does the FP8 wgmma accumulation explain the GPU fuzz's remaining cuda-cpu gradient
differences? (docs/numerics.md section 7, "What the H200 fuzz still shows".)

For cases of tests/python/test_cuda_fuzz.py, prints the model gap of
tests/python/wgmma_emulation.py (the `row` recipe's dQ, dK, dV in float64 with S and
dP summed exactly vs by the measured wgmma model, and vs the mirror: the model's
perturbation with the opposite sign) for the given delta modes, to set beside the
fuzz's ||cuda - cpu|| / ||cpu||. O is the CPU forward's (the fuzz passes the CUDA
forward's; O enters only the stale / matched_do delta). CPU, seconds per case:
  PYTHONPATH=python python scripts/wgmma_dp_study.py 211:stale 218:delta_matching 66
(CASE alone: every mode.) Measured on the H200 (2026-12-02) / model / mirror, dQ:
211 stale 0.0793 / 0.0799 / 0.0103; 218 delta_matching 0.0381 / 0.0372 / 0.0171;
148 stale 0.0244 / 0.0225 / 0.0014; 113 stale 0.041 / 0.046 / 0.040; 85 stale 0.066 /
0.039 / 0.027; 29 stale 0.021 / 0.0135 / 0.0076; 66 stale 0.1075 / 0.0004 / 0.1000.
"""
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "tests", "python"))
import test_cuda_fuzz as F  # noqa: E402
import wgmma_emulation as W  # noqa: E402

OPS = torch.ops.fp8attn


def study(index, modes):
    case = {c.index: c for c in F.generate_cases(F.FUZZ_SEEDS[0])}[index]
    q, k, v, do, tau = F.make_tensors(case)
    o, _ = OPS.fwd(q, k, v, tau, case.causal, "fp8", 128)
    gaps = W.model_gap(q, k, v, do, o, tau, case.causal, case.grad_format, modes=modes)
    print(case.label())
    for m in modes:
        print(f"  {m:15s} " + "  ".join(f"{n} model {gaps[m][n]['model']:.4f} mirror {gaps[m][n]['mirror']:.4f}"
                                        for n in W.GRADS))


def main(args):
    assert args, __doc__
    for a in args:
        idx, _, mode = a.partition(":")
        modes = (mode,) if mode else W.MODES
        assert all(m in W.MODES for m in modes), f"CASE or CASE:MODE with MODE in {W.MODES}, got {a!r}"
        study(int(idx), modes)


if __name__ == "__main__":
    main(sys.argv[1:])
