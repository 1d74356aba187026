"""The backward-consistent LSE of the Delta-Matching backward (docs/numerics.md
section 4, "Backward-consistent LSE"; issue #18 item 3).

The backward forms P = exp(S - LSE) from its own recomputed S and the forward's LSE.
Where the two S differ (FP8 wgmma sums of the forward and backward kernels, the CPU
forward's LSE handed to a CUDA backward, a forward with another accumulation order)
P's row sum l is 1 + O(S error), and with the plain Delta-Matching delta
sum_j P dP_hat the pre-cast row sums of dS become delta (1 - l) instead of 0, growing
with the logit scale. The delta_matching backward therefore normalizes: delta =
sum_j P dP_hat / l and P' = exp(S - (LSE + ln l)) = P / l.

What the tests check, and the failure each guards against:
- A row-wise shift of the LSE handed to the backward (a mismatched LSE, e.g. +-0.2)
  leaves the delta_matching gradients unchanged to rounding, on the CPU reference and
  on every CUDA backward kernel (`row` wgmma, `tile`), while the stale
  gradients, which keep the given LSE, move by the shift (that is what the
  Delta-Matching gradients did before: P scaled by exp(-shift)).
- At logit standard deviations 8 and 30 (d 64-256), the CUDA Delta-Matching gradients
  with the (mismatched) LSE of the CPU forward equal those with the CUDA forward's own
  LSE (the real mismatch, where the shift above is a synthetic one).
"""
import math
import os

import pytest
import torch

from fp8attn import _lib

OPS = torch.ops.fp8attn
HAS_GPU = torch.cuda.is_available() and getattr(_lib, "HAS_CUDA_KERNELS", False)
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and the CUDA kernels")

# Gradients of a delta_matching backward under a row-wise LSE shift of +-SHIFT: the same
# S and P' = exp(S - LSE') up to the FP32 rounding of LSE' (~1 ulp of |LSE| <= ~100 at
# logit std 30, so P' moves by <= ~1e-5 relative), which flips the FP8 code of the
# few P / dS values that close to a rounding midpoint: <= 5e-3 of a gradient at these
# sizes. The stale backward keeps the given LSE: its P moves by exp(-shift), 4-20% per
# row, and its gradients by more than STALE_MOVES.
SHIFT = 0.2
DM_SAME = 5e-3
STALE_MOVES = 5e-2


def _scale(d: int, sigma: float) -> float:
    """FP32 softmax_scale giving logits tau q.k of standard deviation ~sigma for
    standard-normal q, k (q.k has variance d)."""
    return float(torch.tensor(sigma / math.sqrt(d), dtype=torch.float32))


def _inputs(d, dv, seed, device="cpu", b=1, hq=4, hkv=2, s=256):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=gen).bfloat16()
    k = torch.randn(b, hkv, s, d, generator=gen).bfloat16()
    v = torch.randn(b, hkv, s, dv, generator=gen).bfloat16()
    do = torch.randn(b, hq, s, dv, generator=gen).bfloat16()
    shift = (torch.rand(b, hq, s, generator=gen) * 2 - 1) * SHIFT
    return [t.to(device) for t in (q, k, v, do)], shift.to(device)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _check_shift_invariance(q, k, v, do, shift, tau, causal, scaling, fmt="e4m3"):
    out, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128, scaling)
    moved = {}
    for mode in ("delta_matching", "stale"):
        g0 = OPS.bwd(do, q, k, v, out, lse, tau, causal, "fp8", mode, 128, fmt, False, scaling)
        g1 = OPS.bwd(do, q, k, v, out, lse + shift, tau, causal, "fp8", mode, 128, fmt, False, scaling)
        for a in g0[:3] + g1[:3]:
            assert torch.isfinite(a).all(), mode
        moved[mode] = [_rel(a, b) for a, b in zip(g1[:3], g0[:3])]
    assert max(moved["delta_matching"]) < DM_SAME, moved
    # The guarded failure: a backward that keeps the given LSE (stale) moves with it;
    # dV too (P_hat of #5 is scaled by exp(-shift)).
    assert min(moved["stale"]) > STALE_MOVES, moved
    return moved


# ---- CPU reference -----------------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["row", "tile"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sigma", [1.0, 30.0])
def test_reference_delta_matching_ignores_a_mismatched_lse(scaling, d, sigma):
    (q, k, v, do), shift = _inputs(d, d, seed=7 + d)
    _check_shift_invariance(q, k, v, do, shift, _scale(d, sigma), True, scaling)


def test_reference_delta_matching_row_sums_vanish_with_a_mismatched_lse():
    # The reference's own diagnostics: with the LSE off by up to SHIFT per row (l = exp(-shift)
    # up to 18% from 1), the delta_matching pre-cast row-sum residual is FP32 rounding and
    # delta_dm is the normalized sum (eps of stale = delta_stale - delta_dm unchanged by
    # the shift); without the normalization the residual would be |delta (1 - l)| / sum |dS|.
    (q, k, v, do), shift = _inputs(64, 64, seed=3)
    tau = _scale(64, 4.0)
    out, lse = OPS.fwd(q, k, v, tau, False, "fp8", 128)
    for lse_in in (lse, lse + shift):
        *_, diag = OPS.bwd(do, q, k, v, out, lse_in, tau, False, "fp8", "delta_matching", 128, "e4m3", True)
        assert diag[2].double().mean().item() < 1e-6
    eps = [OPS.bwd(do, q, k, v, out, x, tau, False, "fp8", "stale", 128, "e4m3", True)[3][1]
           for x in (lse, lse + shift)]
    assert _rel(eps[1], eps[0]) < 1e-4


# ---- CUDA kernels ------------------------------------------------------------------------

KERNELS = [("row", {}), ("tile", {"FP8ATTN_TILE_BWD": "1"})]
KERNEL_IDS = ["row-wgmma", "tile"]
DIMS = [(64, 64), (128, 128), (256, 256), (192, 128)]


class _env:
    def __init__(self, values):
        self.values = values

    def __enter__(self):
        self.old = {n: os.environ.get(n) for n in ("FP8ATTN_TILE_BWD", "FP8ATTN_FWD_KERNEL")}
        for n in self.old:
            os.environ.pop(n, None)
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for n, val in self.old.items():
            if val is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = val


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", range(len(KERNELS)), ids=KERNEL_IDS)
@pytest.mark.parametrize("dims", DIMS, ids=lambda x: "%dx%d" % x)
@pytest.mark.parametrize("sigma", [1.0, 30.0])
def test_cuda_delta_matching_ignores_a_mismatched_lse(kernel, dims, sigma):
    scaling, env = KERNELS[kernel]
    (q, k, v, do), shift = _inputs(*dims, seed=11 + dims[0], device="cuda", s=320)
    with _env(env):
        _check_shift_invariance(q, k, v, do, shift, _scale(dims[0], sigma), True, scaling)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kernel", range(len(KERNELS)), ids=KERNEL_IDS)
@pytest.mark.parametrize("dims", DIMS, ids=lambda x: "%dx%d" % x)
@pytest.mark.parametrize("sigma", [8.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_delta_matching_at_large_logits_with_a_real_lse_mismatch(kernel, dims, sigma, causal):
    # The real mismatch: the CPU reference forward's LSE (FP32 S) against the kernel's S
    # (FP8 wgmma sums, ~2^-13 |S| relative, |S| up to ~100 at sigma 30). The CUDA
    # Delta-Matching gradients with that LSE equal those with the CUDA forward's own LSE
    # (before the normalization they moved with exp(LSE_cuda - LSE_cpu)).
    # NOTE: at these logit scales the pre-cast residual r_i = |sum dS| / sum |dS| is
    # itself FP32 noise (near one-hot rows: sum |dS| ~ (1 - P_max) |dP|, the rounding of
    # delta ~ 2^-24 |dP|): the CPU reference measured 1.4e-4-4e-3 at sigma 8 and
    # 0.2-0.25 at sigma 30, the kernels 7e-5-9e-4 (H200, 2026-12-02), with no order
    # between them, so it is no test of the invariant here; only the stale residual
    # (the eps term) must stay above both: 10x at sigma 8; at sigma 30 the H200 measured
    # (2026-12-02, all 3 kernels x 4 head_dims x both masks) stale 0.67-0.68 against DM
    # 0.145-0.152 (CUDA) and 0.146-0.152 (CPU): the DM value is that noise floor, so the
    # margin there is 4.4-4.7x and the check asks 3x.
    scaling, env = KERNELS[kernel]
    (q, k, v, do), _ = _inputs(*dims, seed=21 + dims[0] + causal, s=384)
    tau = _scale(dims[0], sigma)
    o_cpu, lse_cpu = OPS.fwd(q, k, v, tau, causal, "fp8", 128, scaling)
    ref_dm = OPS.bwd(do, q, k, v, o_cpu, lse_cpu, tau, causal, "fp8", "delta_matching", 128, "e4m3", True,
                     scaling)[3][2].double().mean().item()
    qc, kc, vc, doc = (t.cuda() for t in (q, k, v, do))
    with _env(env):
        out, lse = OPS.fwd(qc, kc, vc, tau, causal, "fp8", 128, scaling)
        res, grads = {}, {}
        for name, lse_in in (("cuda", lse), ("cpu", lse_cpu.cuda())):
            for mode in ("delta_matching", "stale"):
                *g, diag = OPS.bwd(doc, qc, kc, vc, out, lse_in, tau, causal, "fp8", mode, 128, "e4m3", True,
                                   scaling)
                assert all(torch.isfinite(x).all() for x in g), (name, mode)
                assert torch.isfinite(diag).all(), (name, mode)
                res[f"{name} {mode}"] = diag[2].double().mean().item()
                grads[(name, mode)] = g
    mismatch = (lse.cpu() - lse_cpu).abs().max().item()
    moved = [_rel(a, b) for a, b in zip(grads[("cpu", "delta_matching")], grads[("cuda", "delta_matching")])]
    assert max(moved) < DM_SAME, (moved, mismatch)
    margin = 10.0 if sigma <= 8.0 else 3.0
    for name in ("cuda", "cpu"):
        assert res[f"{name} stale"] > margin * max(res[f"{name} delta_matching"], ref_dm), (res, ref_dm)
