"""Float64 emulation of the `row` and `tile` FP8 scaling recipes (docs/numerics.md
section 9): O / LSE / dQ / dK / dV error against exact float64 attention, on Gaussian
and training-shaped inputs, with variants of the backward's P-for-dV scale; and
(--outliers) the same errors of the CPU reference (fp8attn.attention on CPU
tensors) for row / tile x {no transform, qk_rotation="hadamard", smooth_k, both}
(docs/numerics.md section 10; the table of docs/results.md), (--captured) that table on
activations captured from a fp8attn.train checkpoint, and (--pds-blocks) the `tile` P / dS
blocks of #5 / #7 of T / 2 = 64 queries x T / 2 = 64 keys with the dS of #6 per (row, 64 keys)
(the contract) against 64 x 128 blocks with #6 per (row, 128 keys), and against whole 128 x 128
tiles.

The emulation is not part of the test suite (the CPU reference is the oracle; it
only explores choices before they are fixed in the contract). Every FP8 operand is
rounded with torch's float8 casts (RNE, subnormals kept) after a power-of-two
block scale 2^ceil(log2(amax / fp8_max)); all other arithmetic is float64.
`inputs` is also the generator of the accuracy tests of tests/python/test_qk_transform.py.

    python scripts/recipe_study.py [--long | --outliers [--seqlen N] | --long-keys | --pds-blocks |
                                    --captured CHECKPOINT [--heads N] [--data-root DIR]]
"""
from __future__ import annotations

import argparse
import math

import torch

F64 = torch.float64
E4M3 = (torch.float8_e4m3fn, 448.0)


def quant(x: torch.Tensor, b0: int, b1: int, fmt=E4M3, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decoded FP8 of a 2-D x in blocks of b0 x b1 (b = 0: the whole extent)."""
    R, C = x.shape
    b0 = b0 or R
    b1 = b1 or C
    R2, C2 = -(-R // b0) * b0, -(-C // b1) * b1
    xp = torch.zeros(R2, C2, dtype=F64)
    xp[:R, :C] = x
    blk = xp.view(R2 // b0, b0, C2 // b1, b1)
    if scale is None:
        amax = blk.abs().amax(dim=(1, 3), keepdim=True)
        s = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / fmt[1])).clamp(-126, 127)), torch.ones_like(amax))
    else:
        s = scale.view(R2 // b0, 1, C2 // b1, 1)
    y = (blk / s).clamp(-fmt[1], fmt[1]).to(fmt[0]).to(F64) * s
    return y.view(R2, C2)[:R, :C]


def exact(q, k, v, do, tau, causal):
    S = tau * q @ k.T
    if causal:
        S = S + mask_bias(q.shape[0], k.shape[0])
    lse = torch.logsumexp(S, 1)
    P = torch.exp(S - lse[:, None])
    o = P @ v
    dP = do @ v.T
    delta = (P * dP).sum(1, keepdim=True)
    dS = P * (dP - delta)
    return dict(o=o, lse=lse, dq=tau * dS @ k, dk=tau * dS.T @ q, dv=P.T @ do)


def mask_bias(Sq, Sk):
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Sk)[None, :]
    return torch.where(j <= i + (Sk - Sq), 0.0, -math.inf).to(F64)


def emulate(q, k, v, do, tau, causal, recipe, pdv="tile_amax", T=128, qblk=None, kblk=None):
    """qblk: query rows of the P (#5) and dS (#7) blocks of `tile` (default T // 2, the query
    sub-tile of docs/numerics.md section 9; T gives whole query tiles). kblk: keys of those
    blocks and of the per-row dS blocks of #6 (default T // 2, the key half of section 9;
    T gives whole key tiles)."""
    qblk = qblk or T // 2
    kblk = kblk or T // 2
    Sq, d = q.shape
    Sk, dv = v.shape
    row = recipe == "row"
    # #1/#3: S = Q K^T.
    qh = quant(q, 1, 128) if row else quant(q, 1, 0)
    kh = quant(k, 1, 128) if row else quant(k, T, 0)
    S = tau * qh @ kh.T
    if causal:
        S = S + mask_bias(Sq, Sk)
    # Forward: online softmax over key tiles of T; P per (row, tile), dynamic.
    nt = -(-Sk // T)
    tmax = torch.stack([S[:, t * T:(t + 1) * T].amax(1) for t in range(nt)], 1)
    run = torch.cummax(tmax, 1).values  # running max after tile t
    m = run[:, -1]
    vh2 = quant(v, T, 1) if row else quant(v, T, 0)
    o = torch.zeros(Sq, dv, dtype=F64)
    l = torch.zeros(Sq, dtype=F64)
    for t in range(nt):
        sl = slice(t * T, (t + 1) * T)
        mt = run[:, t:t + 1]
        pe = torch.exp(S[:, sl] - torch.where(torch.isfinite(mt), mt, 0.0))
        w = torch.exp(torch.where(torch.isfinite(mt), mt - m[:, None], 0.0))
        o += w * (quant(pe, 1, 0) @ vh2[sl])
        l += (w[:, 0] * pe.sum(1))
    o = o / l[:, None]
    lse = m + torch.log(l)
    # Backward.
    P = torch.exp(S - lse[:, None])
    doh = quant(do, 1, 128) if row else quant(do, 1, 0)
    vh4 = quant(v, 1, 128) if row else vh2
    dP = doh @ vh4.T
    delta = (P * dP).sum(1, keepdim=True)
    dS = P * (dP - delta)
    if row:
        dq = tau * quant(dS, 1, 64) @ quant(k, T, 1)
        dvv = quant(P, T, 1).T @ quant(do, T, 1)
        dk = tau * quant(dS, T, 1).T @ quant(q, T, 1)
    else:
        dq = tau * quant(dS, 1, kblk) @ kh
        do5 = quant(do, T, 0)
        if pdv == "fixed":
            Ph = (P * 256).to(torch.float8_e4m3fn).to(F64) / 256
        elif pdv == "fold_do":
            # P * 2^(8 + e_dO(qt) - E): the dO tile factor as an exponent offset,
            # E = the largest dO tile exponent (constant over the loop).
            nq = -(-Sq // T)
            e = torch.stack([torch.ceil(torch.log2(do[i * T:(i + 1) * T].abs().amax() / 448)).clamp(-126, 127) for i in range(nq)])
            off = 8 + e - e.max()
            scale = torch.exp2(-off).repeat_interleave(T)[:Sq, None].expand(Sq, Sk)
            Ph = quant(P, 1, 1, scale=scale.contiguous())
        else:  # tile_amax: per (query sub-tile of qblk queries, key half of kblk keys), dynamic
            Ph = quant(P, qblk, kblk)
        dvv = Ph.T @ do5
        dk = tau * quant(dS, qblk, kblk).T @ quant(q, T, 0)
    return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dvv)


INPUT_KINDS = ("gaussian", "training", "common_key")
COMMON_KEY = 4.0  # common_key: |common component| = COMMON_KEY * sqrt(d) (~4x a Gaussian key's norm)


def inputs(kind, Sq, Sk, d, g):
    """BF16-rounded float64 q [Sq, d], k [Sk, d], v [Sk, d], dO [Sq, d] of one head.
    kind: "gaussian" (standard normal); "training" (channel outliers shared by Q
    and K: 4 channels x4; a sink key with logit ~ +8 for every query; per-token
    magnitudes 2^(N(0,1)/2) on q, k, v, dO; dO at 1e-4); "common_key" (Gaussian
    plus one vector shared by all keys, of norm COMMON_KEY * sqrt(d): logits of
    |S| ~ 3 carried by the common part)."""
    q = torch.randn(Sq, d, dtype=F64, generator=g)
    k = torch.randn(Sk, d, dtype=F64, generator=g)
    v = torch.randn(Sk, d, dtype=F64, generator=g)
    do = torch.randn(Sq, d, dtype=F64, generator=g)
    if kind == "training":
        # Channel outliers shared by Q and K (grown QK-norm gains), a sink key
        # with large logits, token-magnitude spread along the sequence.
        gain = torch.ones(d, dtype=F64)
        gain[:4] = 4.0
        q, k = q * gain, k * gain
        u = torch.randn(d, dtype=F64, generator=g)
        u /= u.norm()
        q += 2.0 * u * math.sqrt(d) / 4
        k[0] = u * 8 * math.sqrt(d) / (2.0 * math.sqrt(d) / 4)
        for x in (q, k, v, do):
            x *= torch.exp2(0.5 * torch.randn(x.shape[0], 1, dtype=F64, generator=g))
        do *= 1e-4
    elif kind == "common_key":
        u = torch.randn(d, dtype=F64, generator=g)
        k = k + COMMON_KEY * math.sqrt(d) * u / u.norm()
    elif kind != "gaussian":
        raise ValueError(f"kind must be one of {INPUT_KINDS}, got {kind!r}")
    bf = lambda x: x.to(torch.bfloat16).to(F64)
    return bf(q), bf(k), bf(v), bf(do)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def run(kind, Sq, Sk, d, causal, seed, variants):
    """variants: (name, recipe, pdv), (name, recipe, pdv, qblk) or (name, recipe, pdv, qblk, kblk)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = inputs(kind, Sq, Sk, d, g)
    tau = 1 / math.sqrt(d)
    ex = exact(q, k, v, do, tau, causal)
    out = {}
    for name, rec, pdv, *blk in variants:
        blk = blk + [None] * (2 - len(blk))
        em = emulate(q, k, v, do, tau, causal, rec, pdv, qblk=blk[0], kblk=blk[1])
        fin = torch.isfinite(ex["lse"])
        out[name] = {key: rel(em[key], ex[key]) if key != "lse" else
                     (em[key][fin] - ex[key][fin]).pow(2).mean().sqrt().item() for key in ex}
    return out


OPTIONS = (("none", "none", False), ("hadamard", "hadamard", False), ("smooth_k", "none", True),
           ("both", "hadamard", True))


def errors(got: dict, ex: dict) -> dict:
    """Relative Frobenius error vs exact (LSE: rms absolute over finite rows)."""
    fin = torch.isfinite(ex["lse"])
    return {key: rel(got[key].double(), ex[key]) if key != "lse" else
            (got[key].double()[fin] - ex[key][fin]).pow(2).mean().sqrt().item() for key in ex}


def reference_outputs(q, k, v, do, causal, scaling, qk_rotation, smooth_k, block_size=128):
    """O, LSE, dQ, dK, dV of the CPU reference (fp8attn.attention, BF16 CPU tensors, one head)."""
    import fp8attn
    qb, kb, vb = (x.to(torch.bfloat16)[None, None].requires_grad_() for x in (q, k, v))
    o, lse = fp8attn.attention(qb, kb, vb, causal=causal, scaling=scaling, qk_rotation=qk_rotation,
                               smooth_k=smooth_k, block_size=block_size, return_lse=True)
    o.backward(do.to(torch.bfloat16)[None, None])
    return dict(o=o[0, 0].detach(), lse=lse[0, 0], dq=qb.grad[0, 0], dk=kb.grad[0, 0], dv=vb.grad[0, 0])


def reference_errors(q, k, v, do, causal, scaling, qk_rotation, smooth_k, ex, block_size=128):
    """Errors of the CPU reference (reference_outputs) vs the float64 exact results `ex`."""
    return errors(reference_outputs(q, k, v, do, causal, scaling, qk_rotation, smooth_k, block_size), ex)


def outlier_table(seqlen=2048, d=128, causal=True, seed=1, kinds=INPUT_KINDS):
    """{kind: {(scaling, option name): errors}} of the CPU reference (OPTIONS)."""
    out = {}
    for kind in kinds:
        g = torch.Generator().manual_seed(seed)
        q, k, v, do = inputs(kind, seqlen, seqlen, d, g)
        ex = exact(q, k, v, do, 1 / math.sqrt(d), causal)
        out[kind] = {(sc, name): reference_errors(q, k, v, do, causal, sc, rot, sm, ex)
                     for sc in ("row", "tile") for name, rot, sm in OPTIONS}
    return out


def captured_heads(checkpoint, n_heads=2, layers="all", data_root=None):
    """Q, K, V, dO of real activations: one forward + backward of `checkpoint` (a
    fp8attn.train checkpoint, CPU, FP32) on its first fixed validation sequence, captured at
    the attention core (after QK-norm and RoPE; fp8attn.train.probe.capture_activations).
    Yields (layer, query head, q, k, v, do, o) as float64 [S, D] for the first n_heads query
    heads of each layer (GQA: the head's kv head; o: the model's own attention output);
    layers: "all" or "last"."""
    from pathlib import Path
    from fp8attn.train.checkpoint import load_checkpoint
    from fp8attn.train.data import TokenStream
    from fp8attn.train.probe import capture_activations
    model, info = load_checkpoint(checkpoint, "cpu")
    root = Path(data_root or info.get("data_root") or "")
    seq_len = info["train_config"].get("seq_len") or model.cfg.max_seq_len
    x, y = TokenStream(root / "val.bin", seq_len).fixed_batches(1, 1)[0]
    records, _ = capture_activations(model, x, y)
    names = list(records)
    for name in (names if layers == "all" else names[-1:]):
        r = records[name]
        group = r["q"].shape[1] // r["k"].shape[1]
        for h in range(min(n_heads, r["q"].shape[1])):
            yield (name, h, r["q"][0, h].double(), r["k"][0, h // group].double(), r["v"][0, h // group].double(),
                   r["do"][0, h].double(), r["o"][0, h].double())


def captured_table(checkpoint, n_heads=2, layers="all", data_root=None):
    """{layer: {(scaling, option name): errors}} of the CPU reference on captured
    activations (causal, tau = 1 / sqrt(head_dim), as the model's attention), errors vs
    float64 pooled over the layer's first n_heads query heads (relative Frobenius of the
    concatenation; LSE: rms absolute)."""
    acc = {}
    for name, _h, q, k, v, do, _o in captured_heads(checkpoint, n_heads, layers, data_root):
        # dO of the mean cross-entropy is ~1/(tokens) small: scale it to unit rms (every
        # error here is relative, and the FP8 dO block scales are powers of two).
        do = do / do.pow(2).mean().sqrt().clamp_min(1e-30)
        ex = exact(q, k, v, do, 1 / math.sqrt(q.shape[1]), True)
        for sc in ("row", "tile"):
            for opt, rot, sm in OPTIONS:
                got = reference_outputs(q, k, v, do, True, sc, rot, sm)
                a = acc.setdefault(name, {}).setdefault((sc, opt), {key: [0.0, 0.0] for key in ex})
                fin = torch.isfinite(ex["lse"])
                for key in ex:
                    if key == "lse":
                        a[key][0] += (got[key].double()[fin] - ex[key][fin]).pow(2).sum().item()
                        a[key][1] += int(fin.sum())
                    else:
                        a[key][0] += (got[key].double() - ex[key]).pow(2).sum().item()
                        a[key][1] += ex[key].pow(2).sum().item()
    return {name: {cfg: {key: math.sqrt(n / d) if d > 0 else float("nan") for key, (n, d) in errs.items()}
                   for cfg, errs in res.items()} for name, res in acc.items()}


def long_keys_table(keys=(1024, 8192, 65536), seqlen_q=256, d=128, seed=1, kinds=INPUT_KINDS):
    """{(kind, seqlen_k): {(scaling, option name): errors}} of the CPU reference on the
    synthetic inputs at long key ranges: seqlen_q queries (the last ones of the sequence,
    causal bottom-right, so every row sees nearly all keys) against each seqlen_k."""
    out = {}
    for kind in kinds:
        for sk in keys:
            g = torch.Generator().manual_seed(seed)
            q, k, v, do = inputs(kind, seqlen_q, sk, d, g)
            ex = exact(q, k, v, do, 1 / math.sqrt(d), True)
            out[(kind, sk)] = {(sc, name): reference_errors(q, k, v, do, True, sc, rot, sm, ex)
                               for sc in ("row", "tile") for name, rot, sm in OPTIONS}
    return out


def rotation(d, blocks):
    """R [d, d] = blockdiag(D_b H_b / sqrt(n_b)) for the given block sizes, with the
    fixed signs of numerics.md section 10 (fp8attn.qk_transform)."""
    from fp8attn import qk_transform as qkt
    R = torch.zeros(d, d, dtype=F64)
    o = 0
    for n in blocks:
        R[o:o + n, o:o + n] = qkt._fwht(torch.eye(n, dtype=F64)) / math.sqrt(n)
        o += n
    return qkt.hadamard_signs(d, F64)[:, None] * R


def block_study(d, blocks, kind="training", seqlen=2048, causal=True, seed=1, spread=False):
    """Errors of the CPU reference (row) when Q and K are rotated by `rotation(d, blocks)`
    (applied here in float64, rounded to BF16; the reference then runs without options,
    which is bit for bit its qk_rotation path for the blocks it implements). spread: the
    outlier channels of the training-shaped inputs at random positions instead of 0..3."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = inputs(kind, seqlen, seqlen, d, g)
    if spread:
        perm = torch.randperm(d, generator=g)
        q, k = q[:, perm], k[:, perm]
    ex = exact(q, k, v, do, 1 / math.sqrt(d), causal)
    R = rotation(d, blocks) if blocks else torch.eye(d, dtype=F64)
    import fp8attn
    qb, kb = ((x @ R).to(torch.bfloat16)[None, None].requires_grad_() for x in (q, k))
    vb = v.to(torch.bfloat16)[None, None].requires_grad_()
    o, lse = fp8attn.attention(qb, kb, vb, causal=causal, softmax_scale=1 / math.sqrt(d), return_lse=True)
    o.backward(do.to(torch.bfloat16)[None, None])
    got = dict(o=o[0, 0].detach(), lse=lse[0, 0], dq=qb.grad[0, 0].double() @ R.T, dk=kb.grad[0, 0].double() @ R.T,
               dv=vb.grad[0, 0])
    return errors(got, ex)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", action="store_true", help="long rows: Sq=256, Sk up to 64K, d=64")
    ap.add_argument("--outliers", action="store_true",
                    help="CPU reference errors, row/tile x qk_rotation / smooth_k (markdown table)")
    ap.add_argument("--seqlen", type=int, default=2048, help="--outliers: seqlen_q = seqlen_k")
    ap.add_argument("--long-keys", action="store_true",
                    help="CPU reference errors at 1K / 8K / 64K keys (256 queries), row / tile x the --outliers options")
    ap.add_argument("--captured", metavar="CHECKPOINT",
                    help="CPU reference errors on activations captured from a fp8attn.train checkpoint "
                         "(row / tile x the --outliers options, per layer)")
    ap.add_argument("--heads", type=int, default=2, help="--captured: query heads per layer")
    ap.add_argument("--data-root", help="--captured: the prepared corpus (default: the checkpoint's)")
    ap.add_argument("--pds-blocks", action="store_true",
                    help="tile: P (#5) / dS (#7) blocks of 64 queries x 64 keys and dS (#6) per (row, 64 keys) "
                         "(the contract) vs 64 x 128 blocks with #6 per (row, 128 keys) and whole 128 x 128 tiles")
    ap.add_argument("--blocks", action="store_true",
                    help="Hadamard block choices for head_dim 192 / 80 / 96 (CPU reference, training-shaped)")
    args = ap.parse_args()
    if args.long_keys:
        import time
        t0 = time.time()
        print("CPU reference vs float64, 1 head, 256 queries (the last of the sequence, causal) x seqlen_k keys, "
              "head_dim 128, BF16 inputs, seed 1; relative Frobenius error (LSE: rms absolute)\n")
        print("| inputs | seqlen_k | scaling | option | O | LSE | dQ | dK | dV |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (kind, sk), res in long_keys_table().items():
            for (sc, name), r in res.items():
                print(f"| {kind} | {sk} | {sc} | {name} | " + " | ".join(f"{r[key]:.4f}" for key in
                                                                     ("o", "lse", "dq", "dk", "dv")) + " |")
        print(f"\n({time.time() - t0:.0f} s)")
        return
    if args.captured:
        import time
        t0 = time.time()
        res = captured_table(args.captured, args.heads, data_root=args.data_root)
        print(f"CPU reference vs float64 on activations captured from {args.captured} (first validation "
              f"sequence, first {args.heads} query heads per layer, causal, BF16 inputs, dO scaled to unit rms); "
              "relative Frobenius error pooled over the heads (LSE: rms absolute)\n")
        print("| layer | scaling | option | O | LSE | dQ | dK | dV |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in res.items():
            for (sc, opt), e in r.items():
                print(f"| {name} | {sc} | {opt} | " + " | ".join(f"{e[key]:.4f}" for key in ("o", "lse", "dq", "dk", "dv")) + " |")
        print(f"\n({time.time() - t0:.0f} s)")
        return
    if args.pds_blocks:
        variants = [("row", "row", None), ("tile 128x128, #6 per 128 keys", "tile", "tile_amax", 128, 128),
                    ("tile 64x128, #6 per 128 keys", "tile", "tile_amax", 64, 128),
                    ("tile 64x64, #6 per 64 keys (contract)", "tile", "tile_amax", 64, 64)]
        print("| inputs | Sq x Sk, d | causal | recipe (P / dS block) | O | LSE | dQ | dK | dV |")
        print("|---|---|---|---|---|---|---|---|---|")
        for kind, Sq, Sk, d, causal in ([(kind, 2048, 2048, 128, c) for kind in ("gaussian", "training") for c in (False, True)]
                                        + [(kind, 256, 32768, 128, False) for kind in ("gaussian", "training")]):
            for name, r in run(kind, Sq, Sk, d, causal, 1, variants).items():
                print(f"| {kind} | {Sq} x {Sk}, {d} | {'yes' if causal else 'no'} | {name} | " +
                      " | ".join(f"{r[key]:.4f}" for key in ("o", "lse", "dq", "dk", "dv")) + " |")
        return
    if args.blocks:
        print("| head_dim | outlier channels | blocks | O | LSE | dQ | dK | dV |")
        print("|---|---|---|---|---|---|---|---|")
        for d, choices in ((192, ((), (128, 64), (64, 64, 64))), (80, ((), (64, 16), (16,) * 5)),
                           (96, ((), (64, 32), (32, 32, 32)))):
            for spread in (False, True):
                for blocks in choices:
                    r = block_study(d, blocks, spread=spread)
                    name = " + ".join(map(str, blocks)) or "no rotation"
                    print(f"| {d} | {'random' if spread else '0-3'} | {name} | " +
                          " | ".join(f"{r[key]:.4f}" for key in ("o", "lse", "dq", "dk", "dv")) + " |")
        return
    if args.outliers:
        import time
        t0 = time.time()
        print(f"CPU reference vs float64, 1 head, seqlen {args.seqlen}, head_dim 128, causal, BF16 inputs, "
              "seed 1; relative Frobenius error (LSE: rms absolute)\n")
        print("| inputs | scaling | option | O | LSE | dQ | dK | dV |")
        print("|---|---|---|---|---|---|---|---|")
        for kind, res in outlier_table(args.seqlen).items():
            for (sc, name), r in res.items():
                print(f"| {kind} | {sc} | {name} | " + " | ".join(f"{r[key]:.4f}" for key in
                                                               ("o", "lse", "dq", "dk", "dv")) + " |")
        print(f"\n({time.time() - t0:.0f} s)")
        return
    variants = [("row", "row", None), ("tile/fixed", "tile", "fixed"), ("tile/fold_do", "tile", "fold_do"),
                ("tile/tile_amax", "tile", "tile_amax")]
    cases = ([("gaussian", 256, sk, 64, False) for sk in (8192, 32768, 65536)] +
             [("training", 256, sk, 64, False) for sk in (8192, 32768, 65536)]) if args.long else \
            [(kind, 2048, 2048, 128, c) for kind in ("gaussian", "training") for c in (False, True)]
    for kind, Sq, Sk, d, causal in cases:
        res = run(kind, Sq, Sk, d, causal, 1, variants)
        print(f"{kind} Sq={Sq} Sk={Sk} d={d} causal={causal}")
        for name, r in res.items():
            print(f"  {name:15s} " + " ".join(f"{k} {r[k]:.4f}" for k in ("o", "lse", "dq", "dk", "dv")))


if __name__ == "__main__":
    main()
