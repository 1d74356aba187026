"""dS of matmul #6 (dQ = dS K) in Bds = min(B, 64)-key blocks (numerics.md
sections 3 and 7), through the public API (fp8attn.attention and
varlen_attention, CPU reference), against a model written here from the
contract: FP64 arithmetic, the FP8 codec of torch's float8 dtypes, the scale
rule of section 2, masked quantization of the causal visible prefix.

The inputs make the dS blocking visible: the logits drop by ~18 from one
Bds-key block to the next (so dS of block u is ~2^-26 of block u - 1's: E4M3
zero under a shared scale; 36 and 2^-52 for E5M2 dS) and head_dim channel
1 + u of K is non-zero only on the keys of block u, so dQ[:, 1 + u] comes from dS block u alone. The right
blocking gives dQ[:, 1 + u] ~ its model value; a coarser or misaligned one
flushes it to zero. Each case also shows that the wrong blockings (the former
B-key blocks, a split of the visible tile into halves, blocks aligned at the
packed token 0 of a varlen batch) give a different dQ, so the check can fail.
"""
import math

import pytest
import torch

import fp8attn

FMT = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


# ---- the model ---------------------------------------------------------------------


def decode_block(x, fmt):
    """Decoded FP8 values of one block x (FP32 1-D or [n, L] rows along the
    last dim): s = 2^e, e the least integer with fp8_max 2^e >= amax, clamped to
    [-126, 127]; s = 1 for amax = 0; codes = fp8_rn(x / s)."""
    dt, fmax = FMT[fmt]
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True).double()
    e = torch.ceil(torch.log2(amax / fmax))
    # log2 may be off by one ulp near a power of two: fix e exactly.
    e = torch.where(fmax * torch.exp2(e - 1) >= amax, e - 1, e)
    e = torch.where(fmax * torch.exp2(e) < amax, e + 1, e)
    e = torch.where(amax == 0, torch.zeros_like(e), e).clamp(-126, 127)
    s = torch.exp2(e)
    return (x.double() / s).to(torch.float32).to(dt).double() * s


def rows_blocked(x, B, fmt):
    """x [n, w] decoded per row in blocks of B along w."""
    return torch.cat([decode_block(x[:, c0:c0 + B], fmt) for c0 in range(0, x.shape[1], B)], dim=1)


def blocks_aligned(nvis, B, Bds):
    """The contract: dS blocks of Bds keys from key 0, a shorter last one."""
    return [(u0, min(Bds, nvis - u0)) for u0 in range(0, nvis, Bds)]


def blocks_halves(nvis, B, Bds):
    """A wrong reading: the visible part of each B-key tile cut into two halves."""
    out = []
    for j0 in range(0, nvis, B):
        L = min(B, nvis - j0)
        h = (L + 1) // 2
        out += [(j0, h), (j0 + h, L - h)] if L > 1 else [(j0, L)]
    return out


def model_dq(q, k, v, dout, lse, tau, causal, B, Bds, gf="e4m3", blocks=blocks_aligned):
    """dQ of the FP8 backward (delta_matching) of one (batch, kv head group):
    q [Hq, Sq, d], k [Hkv, Sk, d], v [Hkv, Sk, dv], dout [Hq, Sq, dv], lse
    [Hq, Sq] (the op's forward LSE, which the backward reads). #6: one FP64
    partial per (dS block, K block) pair, each with its two scales."""
    Hq, Sq, d = q.shape
    Hkv, Sk, _ = k.shape
    dq = torch.zeros(Hq, Sq, d, dtype=torch.float64)
    for h in range(Hq):
        kh, vh = k[h // (Hq // Hkv)], v[h // (Hq // Hkv)]
        k_rows, v_rows = rows_blocked(kh, B, "e4m3"), rows_blocked(vh, B, "e4m3")  # #3, #4
        q_rows, do_rows = rows_blocked(q[h], B, "e4m3"), rows_blocked(dout[h], B, gf)
        for i in range(Sq):
            nvis = min(Sk, max(0, i + 1 + Sk - Sq)) if causal else Sk
            if nvis == 0:
                continue
            s = torch.zeros(nvis, dtype=torch.float64)
            for c0 in range(0, d, B):  # #3: one partial per head_dim block
                s += k_rows[:nvis, c0:c0 + B] @ q_rows[i, c0:c0 + B]
            p = torch.exp(s.to(torch.float32).double() * tau - float(lse[h, i]))
            dp = v_rows[:nvis] @ do_rows[i]
            ds = (p * (dp - (p * dp).sum())).to(torch.float32)
            # #6: K per channel over the visible prefix of each B-key block.
            kd = torch.cat([decode_block(kh[j0:min(j0 + B, nvis)].T.contiguous(), "e4m3").T
                            for j0 in range(0, nvis, B)])
            dsd = torch.zeros(nvis, dtype=torch.float64)
            for u0, Lu in blocks(nvis, B, Bds):
                dsd[u0:u0 + Lu] = decode_block(ds[u0:u0 + Lu], gf)
            dq[h, i] = tau * (dsd @ kd)
    return dq


# ---- inputs --------------------------------------------------------------------------


def wide_range(Hq, Hkv, Sq, Sk, d, dv, Bds, gen, kstep=9.0):
    """Logits drop by tau * 16 * kstep (18 for d = 64, kstep 9) per Bds-key
    block; K channel 1 + u lives on block u only."""
    q = torch.randn(Hq, Sq, d, generator=gen)
    k = torch.randn(Hkv, Sk, d, generator=gen)
    v = torch.randn(Hkv, Sk, dv, generator=gen)
    dout = torch.randn(Hq, Sq, dv, generator=gen)
    q[..., 0] = 16.0
    u = torch.arange(Sk) // Bds
    k[..., 0] = -kstep * u.float()
    nb = int(u.max()) + 1 if Sk else 0
    k[..., 1:1 + nb] = 0.0
    for b in range(nb):
        k[:, u == b, 1 + b] = torch.randn(Hkv, int((u == b).sum()), generator=gen)
    return q, k, v, dout


def op_dq(q, k, v, dout, causal, B, gf="e4m3"):
    """dQ and LSE of fp8attn.attention (batch 1) for [H, S, d] inputs."""
    qq, kk, vv = (t[None].clone().requires_grad_() for t in (q, k, v))
    out, lse = fp8attn.attention(qq, kk, vv, causal=causal, block_size=B, grad_format=gf, return_lse=True)
    out.backward(dout[None])
    return qq.grad[0].double(), lse[0]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def channel_err(dq, ref, nb):
    """Worst relative error over the channels 1 .. nb (one per dS block)."""
    return max(rel(dq[..., c], ref[..., c]) for c in range(1, 1 + nb))


# ---- tests ---------------------------------------------------------------------------

CASES = [
    # (B, Sq, Sk, causal, Hq, Hkv, gf)
    (128, 8, 128, False, 1, 1, "e4m3"),    # two 64-key blocks of one tile
    (128, 8, 150, False, 2, 1, "e4m3"),    # seqlen_k not a multiple of 64; GQA
    (128, 8, 100, False, 1, 1, "e4m3"),    # last block shorter (64 + 36)
    (128, 20, 100, True, 1, 1, "e4m3"),    # causal Sq != Sk: prefixes end inside [64, 128)
    (128, 40, 200, True, 2, 2, "e4m3"),    # causal across two tiles, prefix ends in [128, 192) / [192, 200)
    (128, 150, 100, True, 1, 1, "e4m3"),   # causal Sq > Sk: rows 0..49 see no key, then 1..100 keys
    (128, 6, 40, False, 1, 1, "e4m3"),     # seqlen_k < 64: one block
    (128, 6, 1, False, 1, 1, "e4m3"),      # a single key
    (64, 8, 150, False, 1, 1, "e4m3"),     # B = 64: Bds = 64
    (64, 20, 100, True, 2, 1, "e4m3"),
    (32, 8, 100, False, 1, 1, "e4m3"),     # B = 32: Bds = 32 (not 64)
    (32, 20, 90, True, 1, 1, "e4m3"),
    # E5M2 dS: its range is 2^15 wider, so the logits drop by 36 per block
    # (dS ~2^-52 of the previous block: E5M2 zero under a shared scale).
    (128, 8, 128, False, 1, 1, "e5m2"),
    (128, 20, 100, True, 2, 1, "e5m2"),
]


@pytest.mark.parametrize("B,Sq,Sk,causal,Hq,Hkv,gf", CASES)
def test_dq_matches_model_of_bds_blocks(B, Sq, Sk, causal, Hq, Hkv, gf):
    Bds = min(B, 64)
    d, dv = 64, 32
    tau = float(torch.tensor(1 / math.sqrt(d), dtype=torch.float32))
    gen = torch.Generator().manual_seed(1000 * B + Sk + Sq)
    q, k, v, dout = wide_range(Hq, Hkv, Sq, Sk, d, dv, Bds, gen, kstep=9.0 if gf == "e4m3" else 18.0)
    dq, lse = op_dq(q, k, v, dout, causal, B, gf)
    if Sk == 1:  # one key: dS = P (dP - delta) = 0 exactly (numerics.md section 7)
        assert torch.all(dq == 0)
        return
    ref = model_dq(q, k, v, dout, lse, tau, causal, B, Bds, gf)
    nb = (Sk + Bds - 1) // Bds
    # Every block's channel carries signal (else the case shows nothing); its
    # scale is that of its dS block (~2^-26 per block), so it is compared alone.
    for c in range(1, 1 + nb):
        assert ref[..., c].norm() > 0, c
    # The op is the model to FP32 rounding (and the odd FP8 rounding flip of a
    # dS element from FP32 vs FP64 sums), per dS block channel and overall.
    assert channel_err(dq, ref, nb) < 2e-2
    assert rel(dq, ref) < 2e-2
    # The wrong blockings, where they differ, flush a block's channel.
    nvis = [min(Sk, max(0, i + 1 + Sk - Sq)) if causal else Sk for i in range(Sq)]
    wrong = []
    if Sk > Bds:
        wrong.append(dict(Bds=2 * Bds))  # B = 128: the former 128-key blocks; B = 32: 64 keys
    if B == 2 * Bds and any(n % B > Bds for n in nvis):  # a tile of 65..127 visible keys
        wrong.append(dict(blocks=blocks_halves))
    for w in wrong:
        bad = model_dq(q, k, v, dout, lse, tau, causal, B, w.get("Bds", Bds), gf,
                       w.get("blocks", blocks_aligned))
        assert channel_err(bad, ref, nb) > 0.5, w


def test_varlen_blocks_restart_at_every_sequence():
    """Packed sequences of 70, 100 and 90 keys (starts 0, 70, 170: not multiples
    of 64): the dS blocks of #6 start at each sequence's key 0."""
    B, Bds, d, dv, H = 128, 64, 64, 32, 2
    tau = float(torch.tensor(1 / math.sqrt(d), dtype=torch.float32))
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_k = [10, 12, 9], [70, 100, 90]
    parts = [wide_range(H, H, sq, sk, d, dv, Bds, gen) for sq, sk in zip(lens_q, lens_k)]
    cat = [torch.cat([p[t] for p in parts], dim=1).transpose(0, 1).contiguous() for t in range(4)]
    q, k, v = (t.requires_grad_() for t in cat[:3])
    dout = cat[3]
    cu_q = torch.tensor([0, 10, 22, 31], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 170, 260], dtype=torch.int32)
    for causal in (False, True):
        for t in (q, k, v):
            t.grad = None
        out, lse = fp8attn.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
        out.backward(dout)
        dq = q.grad.transpose(0, 1).double()  # [H, total_q, d]
        for b, (p, sq) in enumerate(zip(parts, lens_q)):
            q0, k0 = int(cu_q[b]), int(cu_k[b])
            ref = model_dq(p[0], p[1], p[2], p[3], lse[:, q0:q0 + sq], tau, causal, B, Bds)
            got = dq[:, q0:q0 + sq]
            nb = (lens_k[b] + Bds - 1) // Bds
            assert channel_err(got, ref, nb) < 2e-2, (b, causal)
            assert rel(got, ref) < 2e-2, (b, causal)
            if k0 % Bds == 0:
                continue

            # The wrong reading: blocks aligned at key 0 of the packed batch.
            def blocks_global(nvis, B_, Bds_, k0=k0):
                cuts = sorted({0, nvis} | set(range(-k0 % Bds_, nvis, Bds_)))
                return [(a, e - a) for a, e in zip(cuts, cuts[1:])]

            bad = model_dq(p[0], p[1], p[2], p[3], lse[:, q0:q0 + sq], tau, causal, B, Bds, blocks=blocks_global)
            assert channel_err(bad, ref, nb) > 0.5, (b, causal)
