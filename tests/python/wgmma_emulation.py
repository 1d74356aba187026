"""Float64 emulation of the `row` recipe's FP8 backward, with S and dP summed exactly or
as the measured FP8 wgmma accumulation of the CUDA kernels sums them (docs/numerics.md
section 7, "FP8 wgmma accumulation" and "What the H200 fuzz still shows";
tests/python/wgmma_bounds.py holds the bound form of the same model).

What it is for: the CUDA kernels form S = Q_hat K_hat^T (#3) and dP = dO_hat V_hat^T (#4)
with wgmma, whose sums are cut to ~14 bits per k32 step, while the CPU reference sums
them in FP32. Downstream FP8 roundings of P and dS, and the stale residual (a
difference of large numbers), can turn those small differences into percents of a
gradient on outlier inputs. `model_gap` computes the recipe's dQ, dK, dV twice on the
same quantized operands, once with S and dP summed exactly and once by the model, and
returns ||G_model - G_exactsum|| / ||G_exactsum|| per gradient and per 64-column block:
the difference between kernel and reference that the accumulation alone explains
(tests/python/test_cuda_fuzz.py turns it into a derived tolerance, numerics.md s.6-7).

The model (measured on the H200, tests/python/test_wgmma_accum.py): within each
128-channel head_dim block, per k32 step, the step's products of decoded values and the
incoming accumulator are aligned to the largest magnitude (exponent E) and each is cut
toward zero to a multiple of 2^(E - 13); the block partials are then promoted (here:
added exactly). Products inside one (row, key, block) share one power-of-two scale
factor, so cutting decoded products is cutting the codes' products.

The recipe (numerics.md sections 2-4 and 7; csrc/reference/attention_ref.cpp
fp8_backward), B = 128, Bds = 64:
  #3 S = tau Q_hat K_hat^T: Q and K per row along head_dim in 128-channel blocks, E4M3;
     causal mask bottom-right (row i sees keys j <= i + Sk - Sq); P = exp(S - LSE) with
     LSE the log-sum-exp of the same S (each side its own); a row that sees no key has P = 0.
  #4 dP = dO_hat V_hat^T: dO per row along head_dim_v in 128-blocks (grad_format), V per
     row along head_dim_v (E4M3).
  delta: stale <dO, O> (BF16 operands), matched_do <dO_hat, O>, delta_matching sum_j P dP.
  dS = P o (dP - delta).
  #6 dQ = tau dS_hat K_hat: dS per query row along keys in 64-key blocks (grad_format),
     K per channel along keys in 128-key tiles (E4M3).
  #5 dV = P_hat^T dO_hat: P per key column along queries in 128-query tiles (E4M3), dO per
     channel along queries in 128-query tiles (grad_format).
  #7 dK = tau dS_hat^T Q_hat: dS per key column along queries in 128-query tiles
     (grad_format), Q per channel along queries in 128-query tiles (E4M3).
  GQA: query head h reads kv head h // (Hq / Hkv); dK, dV sum over the group's query heads.
One deliberate difference from the CPU reference: the column-blocked K (#6), Q (#7) and
dO (#5) are quantized from whole 128-token tiles, as the CUDA kernels do (numerics.md
s.7, "CUDA kernels quantize whole tiles"), where the reference requantizes the visible
part of a diagonal tile; on finite inputs the two differ only for FP8-subnormal values.
Sums other than S and dP are float64 here (FP32 in the reference and the kernels).

FP8 rounding is exact float64 arithmetic (round to nearest even at the format's
quantum, subnormals kept, saturation at the format's max), so the emulation runs on any
device the tensors are on (the GPU fuzz calls it on CUDA tensors). Memory: the model's
[rows, keys, 33] step tensors are chunked to `max_elems` elements.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64
MODES = ("stale", "matched_do", "delta_matching")
GRADS = ("dQ", "dK", "dV")
BLOCK = 128          # head_dim blocks (#3, #4) and sequence tiles (#5, #6's K, #7)
DS_ROW_BLOCK = 64    # #6's dS blocks along keys (numerics.md section 3)
COLUMN_BLOCK = 64    # the fuzz's per-64-column-block check
WGMMA_FRAC_BITS = 13
WGMMA_K_STEP = 32
# (mantissa bits, minimum normal exponent, max) of the FP8 formats (numerics.md section 2).
FORMATS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}


# ---- FP8 block quantization (numerics.md section 2), exact in float64 ---------------------


def fp8_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (float64, already divided by its block scale) rounded to the nearest FP8 value of
    `fmt` ("e4m3" | "e5m2"), ties to even, subnormals kept, |x| > max saturating to max."""
    mbits, emin, fmax = FORMATS[fmt]
    x = x.clamp(-fmax, fmax)
    _, e = torch.frexp(x)  # |x| = f 2^e, f in [0.5, 1): floor(log2 |x|) = e - 1
    quantum = torch.ldexp(torch.ones_like(x), (e - 1).clamp(min=emin) - mbits)
    return torch.round(x / quantum) * quantum  # torch.round: half to even; x / quantum exact


def block_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """The smallest power of two s with amax / s <= the format's max (1.75 2^P), exponent
    clamped to [-126, 127], 1 where amax == 0 (csrc/common/fp8_codec.h block_scale)."""
    p = 8 if fmt == "e4m3" else 15
    f, e = torch.frexp(amax)  # amax = f 2^e: mantissa m = 2f in [1, 2), exponent e - 1
    ex = (e - 1 - p + (f > 0.875).to(e.dtype)).clamp(-126, 127)
    s = torch.ldexp(torch.ones_like(amax), ex)
    return torch.where(amax > 0, s, torch.ones_like(amax))


def quantize(x: torch.Tensor, dim: int, block: int, fmt: str = "e4m3") -> torch.Tensor:
    """Decoded FP8 of x (float64, any shape) in blocks of `block` consecutive elements
    along `dim` from index 0 (a last partial block is a shorter block), one scale per
    block: x_hat * s with s = block_scale(amax of the block)."""
    x = x.to(F64)
    dim = dim % x.dim()
    n = x.shape[dim]
    nb = -(-n // block)
    pad = nb * block - n
    xt = x.movedim(dim, -1)
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    blk = xt.reshape(*xt.shape[:-1], nb, block)
    s = block_scale(blk.abs().amax(-1, keepdim=True), fmt)
    y = (fp8_round(blk / s, fmt) * s).reshape(*xt.shape[:-1], nb * block)[..., :n]
    return y.movedim(-1, dim)


# ---- the measured wgmma accumulation ---------------------------------------------------------


def wgmma_model_dot(a: torch.Tensor, b: torch.Tensor, block: int = BLOCK, k_step: int = WGMMA_K_STEP,
                    frac_bits: int = WGMMA_FRAC_BITS, max_elems: int = 2**24) -> torch.Tensor:
    """a [M, d], b [N, d] float64 decoded FP8 values (one power-of-two scale per row and
    `block`-channel block) -> [M, N] float64: the sum over d as the measured model says
    FP8 wgmma forms it (per block, per k_step channels: the products and the incoming
    accumulator aligned to the largest magnitude, exponent E, each cut toward zero to a
    multiple of 2^(E - frac_bits); block partials added exactly). Chunked over M so the
    [rows, N, k_step + 1] step tensor has at most ~max_elems elements. The cut sums are
    exact in float64 (33 multiples of 2^(E - 13) below 2^(E + 1))."""
    M, d = a.shape
    N = b.shape[0]
    out = torch.zeros(M, N, dtype=F64, device=a.device)
    rows = max(1, max_elems // max(N * (k_step + 1), 1))
    for r0 in range(0, M, rows):
        ar = a[r0:r0 + rows]
        total = torch.zeros(ar.shape[0], N, dtype=F64, device=a.device)
        for blk in range(0, d, block):
            acc = torch.zeros_like(total)
            for lo in range(blk, min(blk + block, d), k_step):
                hi = min(lo + k_step, blk + block, d)
                terms = torch.cat([acc.unsqueeze(-1), ar[:, None, lo:hi] * b[None, :, lo:hi]], -1)
                _, e = torch.frexp(terms.abs().amax(-1, keepdim=True))  # largest = f 2^e, E = e - 1
                quantum = torch.ldexp(torch.ones_like(terms[..., :1]), e - 1 - frac_bits)
                acc = (torch.trunc(terms / quantum) * quantum).sum(-1)
                del terms
            total += acc
        out[r0:r0 + rows] = total
    return out


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, d] @ b [N, d]^T in float64 (exact to float64 rounding for FP8 operands)."""
    return a @ b.transpose(-1, -2)


# ---- the `row` recipe's backward -------------------------------------------------------------


SUMS = ("exact", "model", "mirror")


def row_backward(q, k, v, do, o, softmax_scale: float, causal: bool, grad_format: str = "e4m3",
                 modes=MODES, sums: str = "exact", rows_per_chunk: int = 512, max_elems: int = 2**24,
                 with_aux: bool = False):
    """The `row` recipe's dQ, dK, dV in float64 for every delta mode (module docstring).

    q [B, Hq, Sq, d], k [B, Hkv, Sk, d], v [B, Hkv, Sk, dv], do, o [B, Hq, Sq, dv]: any
    float dtype (BF16 as the op sees them), all on one device (the computation runs
    there); o is the forward output the stale / matched_do delta reads. softmax_scale:
    the FP32-rounded tau. causal: bottom-right mask. sums: how S and dP are summed,
    "exact" (float64), "model" (wgmma_model_dot) or "mirror" (the model's difference
    from the exact sum with the opposite sign: 2 exact - model, see model_gap), or a
    tuple of these. rows_per_chunk: query rows per step (rounded to a multiple of 128,
    the query tiles of #5 / #7).
    Returns {mode: (dq [B, Hq, Sq, d], dk [B, Hkv, Sk, d], dv [B, Hkv, Sk, dv])} float64
    (a tuple `sums`: {sums: that dict}); with_aux also {"lse": [B, Hq, Sq], "delta":
    {mode: [B, Hq, Sq]}} of the first of `sums` (-inf LSE where a row sees no key)."""
    variants = (sums,) if isinstance(sums, str) else tuple(sums)
    assert variants and all(x in SUMS for x in variants), sums
    q, k, v, do, o = (t.to(F64) for t in (q, k, v, do, o))
    dev = q.device
    Bsz, Hq, Sq, d = q.shape
    Hkv, Sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    tau = float(softmax_scale)
    gf = grad_format
    need_model = any(x != "exact" for x in variants)
    need_exact = any(x != "model" for x in variants)
    chunk = max(BLOCK, rows_per_chunk // BLOCK * BLOCK)

    def zeros():
        return {m: (torch.zeros(Bsz, Hq, Sq, d, dtype=F64, device=dev),
                    torch.zeros(Bsz, Hkv, Sk, d, dtype=F64, device=dev),
                    torch.zeros(Bsz, Hkv, Sk, dv, dtype=F64, device=dev)) for m in modes}

    out = {x: zeros() for x in variants}
    lse_all = torch.full((Bsz, Hq, Sq), -math.inf, dtype=F64, device=dev)
    delta_all = {m: torch.zeros(Bsz, Hq, Sq, dtype=F64, device=dev) for m in modes}
    keys = torch.arange(Sk, device=dev)

    def sums_of(a, b):
        """{variant: a b^T summed that way}, each dot computed once."""
        ex = exact_dot(a, b) if need_exact else None
        md = wgmma_model_dot(a, b, max_elems=max_elems) if need_model else None
        return {"exact": ex, "model": md, "mirror": None if md is None or ex is None else 2 * ex - md}

    for b in range(Bsz):
        for hk in range(Hkv):
            k_rows = quantize(k[b, hk], -1, BLOCK, "e4m3")   # #3, along d
            v_rows = quantize(v[b, hk], -1, BLOCK, "e4m3")   # #4, along dv
            k_cols = quantize(k[b, hk], 0, BLOCK, "e4m3")    # #6, per channel along keys
            for h in range(hk * group, (hk + 1) * group):
                q_rows = quantize(q[b, h], -1, BLOCK, "e4m3")   # #3
                do_rows = quantize(do[b, h], -1, BLOCK, gf)     # #4 (and matched_do's delta)
                q_cols = quantize(q[b, h], 0, BLOCK, "e4m3")    # #7, per channel along queries
                do_cols = quantize(do[b, h], 0, BLOCK, gf)      # #5
                for i0 in range(0, Sq, chunk):
                    i1 = min(Sq, i0 + chunk)
                    if causal:
                        i = torch.arange(i0, i1, device=dev).unsqueeze(-1)
                        seen = keys.unsqueeze(0) <= i + (Sk - Sq)
                    else:
                        seen = torch.ones(i1 - i0, Sk, dtype=torch.bool, device=dev)
                    s_by = sums_of(q_rows[i0:i1], k_rows)
                    dp_by = sums_of(do_rows[i0:i1], v_rows)
                    stale = (do[b, h, i0:i1] * o[b, h, i0:i1]).sum(-1, keepdim=True)
                    matched = (do_rows[i0:i1] * o[b, h, i0:i1]).sum(-1, keepdim=True)
                    for vi, x in enumerate(variants):
                        S = (tau * s_by[x]).masked_fill(~seen, -math.inf)
                        lse = torch.logsumexp(S, -1, keepdim=True)   # -inf on rows that see no key
                        P = torch.where(seen, torch.exp(S - lse.nan_to_num(neginf=0.0)), 0.0)
                        dP = dp_by[x]
                        # #5 dV = P_hat^T dO_hat, P per key column along each 128-query tile.
                        dv_part = quantize(P, 0, BLOCK, "e4m3").transpose(0, 1) @ do_cols[i0:i1]
                        if vi == 0:
                            lse_all[b, h, i0:i1] = lse.squeeze(-1)
                        for m in modes:
                            if m == "stale":
                                delta = stale
                            elif m == "matched_do":
                                delta = matched
                            elif m == "delta_matching":
                                delta = (P * dP).sum(-1, keepdim=True)
                            else:
                                raise ValueError(f"delta mode {m!r}")
                            if vi == 0:
                                delta_all[m][b, h, i0:i1] = delta.squeeze(-1)
                            dS = torch.where(seen, P * (dP - delta), 0.0)
                            dq, dk, dvv = out[x][m]
                            dq[b, h, i0:i1] = tau * quantize(dS, -1, DS_ROW_BLOCK, gf) @ k_cols
                            dk[b, hk] += tau * quantize(dS, 0, BLOCK, gf).transpose(0, 1) @ q_cols[i0:i1]
                            dvv[b, hk] += dv_part
    res = out[sums] if isinstance(sums, str) else out
    if with_aux:
        return res, {"lse": lse_all, "delta": delta_all}
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    nb = b.norm().item()
    return (a - b).norm().item() / nb if nb > 0 else (0.0 if a.norm().item() == 0 else math.inf)


def model_gap(q, k, v, do, o, softmax_scale: float, causal: bool, grad_format: str = "e4m3", modes=MODES,
              with_grads: bool = False, mirror: bool = True, **kw):
    """The model gap of every gradient: {mode: {"dQ": {"rel": g, "blocks": [g_0, g_1, ...],
    "model": ..., "mirror": ..., "model_blocks": [...], "mirror_blocks": [...]}, "dK": ...,
    "dV": ...}} (arguments as row_backward; the computation runs on q's device).

    model: ||G_model - G_exactsum|| / ||G_exactsum|| (per 64-column block: the same over
    columns [64c, 64c + 64); 0 where both vanish, inf where only the exact-sum one does),
    G_model from S and dP summed by the measured model, G_exactsum summed exactly, on the
    same quantized operands. mirror: the same with S and dP moved from the exact sum by
    the model's difference with the opposite sign (2 exact - model). rel / blocks: the
    larger of the two. Why the mirror: where a pre-rounding value of P or dS lies closer
    to an FP8 rounding midpoint than the model's perturbation of it, the rounding the
    kernel takes depends on the sign of that perturbation, which the model does not pin
    down (it matches the H200 only to within ~1.7x, and the kernel's FP32 exp2 / LSE /
    dS arithmetic is not modelled); fuzz case 66 has its largest |dS| 1.8e-5 (relative)
    above an E5M2 midpoint, the model moves it away from the midpoint and the mirror
    across it (docs/numerics.md section 7). mirror=False: the model alone.
    with_grads: returns (gaps, {"exact": grads, "model": grads[, "mirror": grads]})."""
    variants = ("exact", "model", "mirror") if mirror else ("exact", "model")
    g = row_backward(q, k, v, do, o, softmax_scale, causal, grad_format, modes, variants, **kw)
    ex = g["exact"]
    gaps = {}
    for m in modes:
        gaps[m] = {}
        for gi, name in enumerate(GRADS):
            b = ex[m][gi]
            entry = {}
            for x in variants[1:]:
                a = g[x][m][gi]
                entry[x] = _rel(a, b)
                entry[x + "_blocks"] = [_rel(a[..., lo:lo + COLUMN_BLOCK], b[..., lo:lo + COLUMN_BLOCK])
                                        for lo in range(0, b.shape[-1], COLUMN_BLOCK)]
            entry["rel"] = max(entry[x] for x in variants[1:])
            entry["blocks"] = [max(vals) for vals in zip(*(entry[x + "_blocks"] for x in variants[1:]))]
            gaps[m][name] = entry
    if with_grads:
        return gaps, g
    return gaps
