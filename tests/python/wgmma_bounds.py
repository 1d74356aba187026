"""The error model of the CUDA forward's FP8 Q K^T (Hopper wgmma, E4M3 codes, FP32
accumulator) for the tests' per-row LSE tolerances (docs/numerics.md section 7, "FP8
wgmma accumulation"; measured and checked on the H200 by tests/python/test_wgmma_accum.py).
Importable without a GPU; computes on the GPU when there is one.

Measured model: in each k32 step of a 128-channel head_dim block the step's products
of codes and the incoming FP32 accumulator are aligned to the largest of them
(exponent E) and each is cut toward zero to a multiple of 2^(E - WGMMA_FRAC_BITS).
So a step loses less than min(|p_c|, cut) per product p_c and one cut per
accumulator term, cut <= 2^-13 max(largest product, |accumulator|). Whether a k32
step is aligned at once or as two k16 halves is not resolved by the probes; the
bound below holds for both (two accumulator terms, the accumulator taken at the
step's start and middle).
"""
from __future__ import annotations

import math

import torch

import fp8attn

WGMMA_FRAC_BITS = 13
WGMMA_K_STEP = 32
HEAD_DIM_BLOCK = 128  # S is promoted to FP32 per 128-channel head_dim block (numerics.md section 3)


def dequantized_codes(x: torch.Tensor, scaling: str = "row", operand: str = "q") -> torch.Tensor:
    """The E4M3 values the kernels multiply for S, float64, exact: `row` 128-channel blocks
    along head_dim (numerics.md section 2); `tile` Q one block per row, K one per 128-key
    tile, all of head_dim (section 9)."""
    x = x.cpu()
    if scaling == "row":
        codes, scales = fp8attn.quantize_blockwise(x, -1, HEAD_DIM_BLOCK, "e4m3")
        return fp8attn.dequantize_blockwise(codes, scales, -1, HEAD_DIM_BLOCK, "e4m3").double()
    dim = -1 if operand == "q" else -2
    codes, scales = fp8attn.quantize_tilescale(x.float(), dim, 128, "e4m3")
    vals = fp8attn.fp8_decode(codes, "e4m3").double()
    if dim == -1:
        return vals * scales.double().unsqueeze(-1)
    per_token = scales.double().repeat_interleave(128, dim=-1)[..., : x.shape[2]]
    return vals * per_token.unsqueeze(-1)


def wgmma_s_bound_entries(qh: torch.Tensor, kh: torch.Tensor, tau: float, block: int = HEAD_DIM_BLOCK):
    """(bound, S): |S_cuda - S| <= bound per (query, key), with S = tau qh kh^T exact;
    qh [..., Sq, d], kh [..., Sk, d] dequantized codes (float64, same leading dims),
    results [..., Sq, Sk]. block: the channels of one wgmma chain (the `row` kernels
    promote S per 128-channel block; the `tile` kernels run one chain over all of d)."""
    d = qh.shape[-1]
    total = torch.zeros(*qh.shape[:-1], kh.shape[-2], dtype=torch.float64, device=qh.device)
    s = torch.zeros_like(total)
    qa, ka = qh.abs(), kh.abs()
    for blk in range(0, d, block):
        run = torch.zeros_like(total)  # the exact running sum of this block
        for lo in range(blk, min(blk + block, d), WGMMA_K_STEP):
            hi = min(lo + WGMMA_K_STEP, blk + block, d)
            mid = min(lo + WGMMA_K_STEP // 2, hi)
            acc = run.abs()
            run = run + qh[..., lo:mid] @ kh[..., lo:mid].transpose(-1, -2)
            acc = torch.maximum(acc, run.abs())
            run = run + qh[..., mid:hi] @ kh[..., mid:hi].transpose(-1, -2)
            # The hardware's accumulator differs from the exact running sum by at most
            # what was lost so far (total), hence the + total.
            big = qa[..., lo:hi].amax(-1).unsqueeze(-1) * ka[..., lo:hi].amax(-1).unsqueeze(-2)
            cut = 2.0**-WGMMA_FRAC_BITS * torch.maximum(big, acc + total)
            l1 = qa[..., lo:hi] @ ka[..., lo:hi].transpose(-1, -2)
            total = total + torch.minimum(l1, (hi - lo) * cut) + 2 * cut
        s = s + run
    return tau * total, tau * s


def wgmma_lse_bound(q: torch.Tensor, k: torch.Tensor, tau: float, causal: bool, scaling: str = "row") -> torch.Tensor:
    """Per query row, how far the CUDA LSE may lie from the LSE of exact S over the same
    codes, [B, Hq, Sq] float64 on the CPU (0 where a row sees no key). With x_j the error
    of S_j and P the exact softmax of the row, LSE moves by log sum_j P_j exp(x_j), and
    |log sum_j P_j exp(x_j)| <= log sum_j P_j exp(b_j) for |x_j| <= b_j (Jensen both ways).
    q [B, Hq, Sq, d], k [B, Hkv, Sk, d] BF16 (query heads of a group consecutive); causal
    is bottom-right aligned (row i sees keys j <= i + Sk - Sq), as the op; scaling: the
    recipe ("row": S per 128-channel block; "tile": one chain over all of head_dim,
    padded head dims included: zero channels add nothing)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    qh = dequantized_codes(q, scaling, "q").to(dev)
    kh = dequantized_codes(k, scaling, "k").to(dev)
    block = HEAD_DIM_BLOCK if scaling == "row" else max(q.shape[-1], 1)
    sq, sk = q.shape[2], k.shape[2]
    out = torch.zeros(q.shape[:3], dtype=torch.float64)
    grp = q.shape[1] // k.shape[1]
    rows = max(1, 2**22 // max(sk, 1))  # <= 4M (query, key) pairs per chunk
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            kb = kh[b, h // grp]
            for lo in range(0, sq, rows):
                bound, s = wgmma_s_bound_entries(qh[b, h, lo:lo + rows], kb, tau, block)
                if causal:
                    i = torch.arange(lo, lo + s.shape[0], device=dev).unsqueeze(-1)
                    s = s.masked_fill(torch.arange(sk, device=dev).unsqueeze(0) > i + sk - sq, -math.inf)
                lp = torch.log_softmax(s, dim=-1)  # NaN on rows that see no key
                r = torch.logsumexp(lp + bound, dim=-1)
                out[b, h, lo:lo + rows] = torch.nan_to_num(r, nan=0.0).cpu()
    return out
