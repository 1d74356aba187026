"""How the CUDA forward's FP8 Q K^T rounds (Hopper wgmma, E4M3 codes, FP32 accumulator),
measured through the op and checked against the model the tests' LSE tolerances use
(tests/python/wgmma_bounds.py; docs/numerics.md section 7, "FP8 wgmma accumulation").

With one key (seqlen_k = 1) a row's LSE is its one logit: LSE_i = tau s_Q s_K t_i with
t_i = sum_c q_hat_ic k_hat_c as the tensor cores computed it. Rows and the key are
E4M3 values with a block amax of exactly 448 (scale 1, codes = values), so the exact
t_i is known in float64 and LSE_i / tau - t_i is the accumulation error alone (the FP32
epilogue adds ~2^-22 relative). d = 128: one head_dim block, four k32 steps.

The model (measured 2026-12-02 on the H200): in each step the 32 products and the
incoming accumulator are aligned to the largest (exponent E) and each is cut toward
zero to a multiple of 2^(E - 13). Crafted rows (a "big" product 448 * 448 ~ 2^17.6 and
small ones beside, after or before it) pin that down exactly; random rows with outlier
channels check the bound and show the old bound (2^-12 tau ||q_i|| max_j ||k_j||, which
charged each step 2^-14 of sum |q_c k_c|) fail. Run with -s to see the numbers:
  PYTHONPATH=python python -m pytest -q -s tests/python/test_wgmma_accum.py
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import fp8attn
from wgmma_bounds import WGMMA_FRAC_BITS, wgmma_s_bound_entries

OPS = torch.ops.fp8attn
HAS_GPU = torch.cuda.is_available() and getattr(fp8attn._lib, "HAS_CUDA_KERNELS", False)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the CUDA kernels")]

D = 128
TAU = 2.0**-16  # keeps tau * t (|t| < 2^20) a moderate logit


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(torch.float64)


def key_row() -> torch.Tensor:
    k = torch.ones(D, dtype=torch.float64)
    k[::16] = 448.0  # channels 0, 16, 32, ...: a big product where the row has 448
    return k


def kernel_error(rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Kernel t_i - exact t_i (float64) for query rows [R, D] against one key [D]."""
    assert torch.equal(e4m3(rows), rows) and torch.equal(e4m3(k), k)
    assert (rows.abs().amax(-1) == 448).all() and k.abs().max() == 448  # scale 1: codes = values
    q = rows.to(torch.bfloat16).view(1, 1, -1, D).cuda()
    kk = k.to(torch.bfloat16).view(1, 1, 1, D).cuda()
    v = torch.ones(1, 1, 1, D, dtype=torch.bfloat16, device="cuda")
    _, lse = OPS.fwd(q, kk, v, TAU, False, "fp8", 128)
    return lse.double().cpu().view(-1) / TAU - rows @ k


def emulate(rows: torch.Tensor, k: torch.Tensor, step: int = 32) -> torch.Tensor:
    """The model's t - exact t per row: per step of `step` channels, the products and the
    accumulator cut toward zero to multiples of 2^(E - 13), E the exponent of the largest."""
    prod = rows * k
    acc = torch.zeros(rows.shape[0], dtype=torch.float64)
    for lo in range(0, D, step):
        add = torch.cat([acc[:, None], prod[:, lo:lo + step]], dim=1)
        m = add.abs().amax(-1, keepdim=True)
        quantum = torch.where(m > 0, torch.exp2(torch.floor(torch.log2(m.clamp(min=1e-300))) - WGMMA_FRAC_BITS),
                              torch.ones_like(m))
        acc = (torch.sign(add) * torch.floor(add.abs() / quantum) * quantum).sum(-1)
    return acc - prod.sum(-1)


def crafted(big_ch, small_chs, filler_ch=None):
    """Rows for small exponents e = 0 .. -9: 448 at big_ch (a big product with the key's
    448) or, without a big product, at filler_ch (where the key is 1); 2^e at small_chs."""
    rows = []
    for e in range(0, -10, -1):
        r = torch.zeros(D, dtype=torch.float64)
        r[big_ch if big_ch is not None else filler_ch] = 448.0
        r[small_chs] = 2.0**e
        rows.append(r)
    return torch.stack(rows)


CRAFTED = {
    # name: (big channel, small channels, filler) -- what the row shows
    "small beside big, same step": (0, list(range(1, 32)), None),   # cut relative to the big product
    "small in the other k16 half": (16, list(range(1, 16)), None),
    "small in the next step": (0, list(range(33, 48)), None),       # the accumulator takes part
    "small before big": (32, list(range(1, 16)), None),             # the accumulator is cut too
    "no big product": (None, list(range(33, 48)), 1),               # cut relative to 448: 2^-5
}


def test_crafted_rows_follow_the_truncation_model():
    k = key_row()
    report = {}
    for name, (big, small, filler) in CRAFTED.items():
        rows = crafted(big, small, filler)
        err = kernel_error(rows, k)
        pred = emulate(rows, k)
        report[name] = [(float(a), float(b)) for a, b in zip(err, pred)]
        # Exact up to the FP32 LSE's resolution (2^-22 relative of t ~ 2^18: 0.06).
        assert (err - pred).abs().max() < 0.07, f"{name}: measured {err.tolist()} vs model {pred.tolist()}"
    print("\n" + json.dumps(report))
    # The model is not vacuous: a small product beside a big one is lost (1 < 16 = 2^(17 - 13)).
    err = kernel_error(crafted(0, [1]), k)
    assert err[0].item() == pytest.approx(-1.0, abs=0.07)


def test_random_rows_within_the_bound_the_tests_use():
    g = torch.Generator().manual_seed(20261202)
    gain = torch.ones(D, dtype=torch.float64)
    gain[torch.randperm(D, generator=g)[:4]] = 8.0  # channel outliers shared by Q and K
    k = torch.randn(D, generator=g, dtype=torch.float64) * gain
    k = e4m3(k / k.abs().max() * 448.0)
    n = 4096
    rows = torch.randn(n, D, generator=g, dtype=torch.float64) * gain
    rows = e4m3(rows / rows.abs().amax(-1, keepdim=True) * 448.0)
    err = kernel_error(rows, k)
    bound, s = wgmma_s_bound_entries(rows, k[None, :], 1.0)
    bound = bound[:, 0]
    assert torch.allclose(s[:, 0], rows @ k)
    ratio = (err.abs() / bound).max().item()
    old = 2.0**-12 * rows.norm(dim=-1) * k.norm()
    old_ratio = (err.abs() / old).max().item()
    agree = {step: (emulate(rows, k, step) - err).abs().le(0.07).double().mean().item() for step in (32, 16)}
    print(f"\nrandom outlier rows: max |err| / bound = {ratio:.3f}, max |err| / old bound = {old_ratio:.3f}, "
          f"rows the k32 / k16 emulation reproduces: {agree[32]:.4f} / {agree[16]:.4f}, "
          f"err mean {err.mean().item():.3g}, mean |err| {err.abs().mean().item():.3g}")
    assert ratio <= 1.0, f"an error exceeds the bound the LSE checks use ({ratio:.3f}x)"
    assert ratio > 0.02, "the bound is not that loose: the error model would be wrong"
    assert old_ratio > 1.0, "the old bound held on outlier rows: the reason for the new one is gone"
    # Truncation toward zero on magnitudes: no bias on signed random products.
    assert abs(err.mean().item()) < 0.1 * err.abs().mean().item()
