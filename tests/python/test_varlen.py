"""Tests of fp8attn.varlen_attention (packed variable-length batches, flash_attn
varlen layout). Math: docs/numerics.md section 1 per sequence, section 7 (block
grid restarts at every sequence). Small shapes: runs in seconds on 2 cores.
"""
import math

import pytest
import torch

import fp8attn

# ---- helpers ---------------------------------------------------------------------


def cu(lens, dtype=torch.int32):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=dtype)


def make_packed(lens_q, lens_k, hq=4, hkv=2, d=32, dv=None, tail_q=0, tail_k=0, dtype=torch.float32):
    """Random packed q [total_q, hq, d], k [total_k, hkv, d], v [total_k, hkv, dv]
    with `tail_*` extra tokens outside every sequence."""
    dv = d if dv is None else dv
    tq, tk = sum(lens_q) + tail_q, sum(lens_k) + tail_k
    q = torch.randn(tq, hq, d, dtype=dtype)
    k = torch.randn(tk, hkv, d, dtype=dtype)
    v = torch.randn(tk, hkv, dv, dtype=dtype)
    return q, k, v


def run_varlen(q, k, v, cq, ck, dout, **kw):
    """Forward + backward through varlen_attention; returns O, LSE, dQ, dK, dV."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fp8attn.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def run_per_sequence(q, k, v, cq, ck, dout, **kw):
    """The same through fp8attn.attention on each sequence's slices alone
    (contiguous [1, heads, len, d] copies). Returns per-sequence lists."""
    res = []
    cq, ck = cq.tolist(), ck.tolist()
    for b in range(len(cq) - 1):
        sl_q, sl_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        qb, kb, vb = (t[s].transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
                      for t, s in ((q, sl_q), (k, sl_k), (v, sl_k)))
        out, lse = fp8attn.attention(qb, kb, vb, return_lse=True, **kw)
        out.backward(dout[sl_q].transpose(0, 1).unsqueeze(0))
        to_packed = lambda t: t.squeeze(0).transpose(0, 1)  # noqa: E731
        res.append((to_packed(out.detach()), lse.squeeze(0), to_packed(qb.grad), to_packed(kb.grad),
                    to_packed(vb.grad)))
    return res


def assert_equals_per_sequence(got, ref, cq, ck):
    """got = (O, LSE, dQ, dK, dV) of a packed call; ref = run_per_sequence's list:
    every sequence's rows bitwise equal to its own per-sequence call."""
    out, lse, dq, dk, dv = got
    a, c = cq.tolist(), ck.tolist()
    for b, (o_b, lse_b, dq_b, dk_b, dv_b) in enumerate(ref):
        assert torch.equal(out[a[b]:a[b + 1]], o_b), b
        assert torch.equal(lse[:, a[b]:a[b + 1]], lse_b), b
        assert torch.equal(dq[a[b]:a[b + 1]], dq_b), b
        assert torch.equal(dk[c[b]:c[b + 1]], dk_b), b
        assert torch.equal(dv[c[b]:c[b + 1]], dv_b), b


def varlen_math(q, k, v, cq, ck, scale, causal):
    """Exact attention in float64 on the packed batch with a block-diagonal mask
    (query i of sequence b sees key j of the same sequence, bottom-right causal
    per sequence). Returns O [total_q, hq, dv], LSE [hq, total_q]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = scale * torch.einsum("ihd,jhd->hij", q, k)
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    cq, ck = cq.tolist(), ck.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        i = torch.arange(lq)[:, None]
        j = torch.arange(lk)[None, :]
        m = (j <= i + (lk - lq)) if causal else torch.ones(lq, lk, dtype=torch.bool)
        allowed[cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = m
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])  # 0 on masked entries and on rows seeing no key
    return torch.einsum("hij,jhd->ihd", p, v), lse


# Sequences with lengths around the block size (32): several blocks, partial last
# blocks, a zero-length query sequence with keys, a query sequence with no keys,
# seqlen_q != seqlen_k.
LENS_Q = [40, 0, 70, 9, 5, 33]
LENS_K = [40, 12, 45, 0, 21, 33]


# ---- equality with per-sequence attention ------------------------------------------


@pytest.mark.parametrize("precision", ["fp8", "exact"])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_per_sequence_attention_bitwise(precision, causal):
    q, k, v = make_packed(LENS_Q, LENS_K, hq=4, hkv=2, d=32, dv=16, tail_q=3, tail_k=4)
    cq, ck = cu(LENS_Q), cu(LENS_K, torch.int64)
    dout = torch.randn(q.shape[0], 4, 16)
    kw = dict(causal=causal, precision=precision, block_size=32)
    out, lse, dq, dk, dv = run_varlen(q, k, v, cq, ck, dout, **kw)
    ref = run_per_sequence(q, k, v, cq, ck, dout, **kw)
    assert out.shape == (q.shape[0], 4, 16) and lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    assert_equals_per_sequence((out, lse, dq, dk, dv), ref, cq, ck)
    a, c = cq.tolist(), ck.tolist()
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    # Sequence 3 has 9 queries and no key: O = 0, LSE = -inf, dQ = 0.
    assert (out[a[3]:a[4]] == 0).all() and (dq[a[3]:a[4]] == 0).all()
    assert torch.isneginf(lse[:, a[3]:a[4]]).all()
    # Sequence 1 has no query and 12 keys: dK = dV = 0 there.
    assert (dk[c[1]:c[2]] == 0).all() and (dv[c[1]:c[2]] == 0).all()
    # The other gradients are real (not trivially zero).
    assert dq[: a[1]].abs().sum() > 0 and dk[: c[1]].abs().sum() > 0 and dv[: c[1]].abs().sum() > 0


def test_bf16_gqa_matches_per_sequence():
    lens_q, lens_k = [17, 64, 3], [30, 64, 3]
    q, k, v = make_packed(lens_q, lens_k, hq=6, hkv=2, d=64, dtype=torch.bfloat16)
    cq, ck = cu(lens_q), cu(lens_k)
    dout = torch.randn(q.shape[0], 6, 64, dtype=torch.bfloat16)
    kw = dict(causal=True, block_size=64, delta_mode="stale", grad_format="e5m2")
    out, lse, dq, dk, dv = run_varlen(q, k, v, cq, ck, dout, **kw)
    ref = run_per_sequence(q, k, v, cq, ck, dout, **kw)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.cat([r[0] for r in ref]))
    assert torch.equal(dq, torch.cat([r[2] for r in ref]))
    assert torch.equal(dk, torch.cat([r[3] for r in ref]))
    assert torch.equal(dv, torch.cat([r[4] for r in ref]))


def test_sequences_do_not_see_each_other():
    """Guard: packing without the block-diagonal mask (one attention over all
    tokens) gives a clearly different O; varlen must equal the masked math."""
    lens = [20, 28]
    q, k, v = make_packed(lens, lens, hq=2, hkv=2, d=16, dtype=torch.float64)
    cq = cu(lens)
    out = fp8attn.varlen_attention(q, k, v, cq, cq, precision="exact")
    o_ref, _ = varlen_math(q, k, v, cq, cq, 1 / math.sqrt(16), False)
    o_unmasked = fp8attn.attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                   precision="exact").squeeze(0).transpose(0, 1)
    assert (o_unmasked - o_ref).abs().max() > 0.05  # the failure this guards against
    torch.testing.assert_close(out, o_ref, rtol=1e-12, atol=1e-12)


# ---- tokens outside every sequence -----------------------------------------------


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_outside_tokens_zero_and_nan_does_not_leak(precision):
    lens_q, lens_k = [10, 0, 35], [14, 6, 40]  # every in-sequence row sees a key
    tail_q, tail_k = 5, 7
    q, k, v = make_packed(lens_q, lens_k, hq=4, hkv=1, d=16, tail_q=tail_q, tail_k=tail_k)
    cq, ck = cu(lens_q), cu(lens_k)
    dout = torch.randn(q.shape[0], 4, 16)
    kw = dict(causal=True, precision=precision, block_size=32)
    clean = run_varlen(q, k, v, cq, ck, dout, **kw)
    # Garbage outside every sequence: NaN in q/k/v and in dO rows there.
    qn, kn, vn, dn = q.clone(), k.clone(), v.clone(), dout.clone()
    qn[-tail_q:] = float("nan")
    kn[-tail_k:] = float("nan")
    vn[-tail_k:] = float("nan")
    dn[-tail_q:] = float("nan")
    dirty = run_varlen(qn, kn, vn, cq, ck, dn, **kw)
    for t_clean, t_dirty in zip(clean, dirty):
        assert not torch.isnan(t_dirty).any()
        assert torch.equal(t_clean, t_dirty)
    out, lse, dq, dk, dv = dirty
    assert (out[-tail_q:] == 0).all() and torch.isneginf(lse[:, -tail_q:]).all()
    assert (dq[-tail_q:] == 0).all() and (dk[-tail_k:] == 0).all() and (dv[-tail_k:] == 0).all()
    # Inside the sequences the outputs are real.
    assert out[: sum(lens_q)].abs().sum() > 0 and torch.isfinite(lse[:, : sum(lens_q)]).all()


def test_nan_outside_is_seen_by_a_naive_pack():
    """Guard for the test above: the same NaN tail poisons attention over the
    whole packed tensor, so 'no leak' is a real property of varlen."""
    q, k, v = make_packed([8], [8], hq=2, hkv=2, d=16, tail_k=3)
    k[-3:] = float("nan")
    naive = fp8attn.attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), precision="exact")
    assert torch.isnan(naive).all()
    out = fp8attn.varlen_attention(q, k, v, cu([8]), cu([8]), precision="exact")
    assert torch.isfinite(out).all()


def test_empty_batch_and_all_empty_sequences():
    q, k, v = make_packed([], [], hq=2, hkv=2, d=8, tail_q=4, tail_k=2)
    q.requires_grad_()
    out, lse = fp8attn.varlen_attention(q, k, v, torch.tensor([0], dtype=torch.int32),
                                        torch.tensor([0], dtype=torch.int32), return_lse=True)
    assert out.shape == (4, 2, 8) and (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()  # still in the graph
    assert (q.grad == 0).all()
    out = fp8attn.varlen_attention(q, k, v, cu([0, 0]), cu([0, 2]))
    assert (out == 0).all()


# ---- exact path against float64 math ---------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_exact_matches_block_diagonal_math(causal):
    q, k, v = make_packed(LENS_Q, LENS_K, hq=4, hkv=2, d=24, dv=12, tail_q=2, tail_k=3, dtype=torch.float64)
    cq, ck = cu(LENS_Q), cu(LENS_K)
    scale = 0.3
    qv, kv, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = fp8attn.varlen_attention(qv, kv, vv, cq, ck, causal=causal, softmax_scale=scale,
                                        precision="exact", return_lse=True)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = varlen_math(qr, kr, vr, cq, ck, scale, causal)
    torch.testing.assert_close(out, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), lse_ref.float().double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    dout = torch.randn_like(out)
    out.backward(dout)
    o_ref.backward(dout)
    for got, want in ((qv.grad, qr.grad), (kv.grad, kr.grad), (vv.grad, vr.grad)):
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_exact(causal):
    lens_q, lens_k = [2, 0, 3, 2], [3, 1, 2, 0]
    q, k, v = make_packed(lens_q, lens_k, hq=2, hkv=1, d=3, dv=2, tail_q=1, tail_k=1, dtype=torch.float64)
    cq, ck = cu(lens_q), cu(lens_k)
    fn = lambda q, k, v: fp8attn.varlen_attention(q, k, v, cq, ck, causal=causal, precision="exact")  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in (q, k, v)))


# ---- argument validation ---------------------------------------------------------


def _bad_calls():
    q, k, v = make_packed([3, 4], [5, 2], hq=4, hkv=2, d=8)
    c_q, c_k = cu([3, 4]), cu([5, 2])
    ok = dict(q=q, k=k, v=v, cu_seqlens_q=c_q, cu_seqlens_k=c_k)

    def with_(**kw):
        d = dict(ok)
        d.update(kw)
        return d

    return [
        (with_(cu_seqlens_q=c_q.float()), TypeError, "cu_seqlens_q"),
        (with_(cu_seqlens_k=[0, 5, 7]), TypeError, "cu_seqlens_k"),
        (with_(cu_seqlens_q=c_q.view(1, 3)), ValueError, "cu_seqlens_q"),
        (with_(cu_seqlens_q=torch.tensor([], dtype=torch.int32)), ValueError, "cu_seqlens_q"),
        (with_(cu_seqlens_k=cu([5, 1, 1])), ValueError, "cu_seqlens_k.*batch"),
        (with_(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError, "cu_seqlens_q.*non-decreasing"),
        (with_(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError, "cu_seqlens_q.*start at 0"),
        (with_(cu_seqlens_k=torch.tensor([0, 5, 8], dtype=torch.int32)), ValueError, "cu_seqlens_k.*exceeds total_k"),
        (with_(q=q.unsqueeze(0)), ValueError, "'q'.*3-D"),
        (with_(v=v[:, :, 0]), ValueError, "'v'.*3-D"),
        (with_(v=v[:6]), ValueError, "'v'.*total_k"),
        (with_(k=k[:, :, :4]), ValueError, "'k'.*head_dim"),
        (with_(q=q[:, :3]), ValueError, "'q'.*multiple of num_heads_kv"),
        (with_(v=v[:, :1]), ValueError, "'v'.*num_heads"),
        (with_(k=k.double()), TypeError, "'k'.*dtype"),
        (with_(q=q.half()), TypeError, "'k'.*q's dtype"),  # float16 runs, but mixed with float32 k, v
        (with_(q=q.numpy()), TypeError, "'q'"),
        (with_(max_seqlen_q=3), ValueError, "max_seqlen_q.*4"),
        (with_(max_seqlen_k=4), ValueError, "max_seqlen_k.*5"),
        (with_(max_seqlen_k=5.0), TypeError, "max_seqlen_k"),
        (with_(causal=1), TypeError, "causal"),
        (with_(block_size=48), ValueError, "block_size"),
        (with_(precision="fp16"), ValueError, "precision"),
        (with_(delta_mode="x"), ValueError, "delta_mode"),
        (with_(softmax_scale=-1.0), ValueError, "softmax_scale"),
    ]


@pytest.mark.parametrize("idx", range(len(_bad_calls())))
def test_validation_errors(idx):
    kwargs, exc, pattern = _bad_calls()[idx]
    with pytest.raises(exc, match=pattern) as info:
        fp8attn.varlen_attention(**kwargs)
    assert "varlen_attention" in str(info.value)


def test_max_seqlen_accepted_when_large_enough():
    q, k, v = make_packed([3, 4], [5, 2], hq=2, hkv=2, d=8)
    a = fp8attn.varlen_attention(q, k, v, cu([3, 4]), cu([5, 2]), 4, 5)
    b = fp8attn.varlen_attention(q, k, v, cu([3, 4]), cu([5, 2]), max_seqlen_q=100, max_seqlen_k=100)
    assert torch.equal(a, b) and torch.isfinite(a).all() and a.abs().sum() > 0


# ---- diagnostics / compile -------------------------------------------------------


def test_diagnostics_one_record_per_nonempty_sequence():
    lens_q, lens_k = [6, 0, 9, 4], [6, 5, 9, 0]
    q, k, v = make_packed(lens_q, lens_k, hq=2, hkv=2, d=16)
    q.requires_grad_()
    with fp8attn.diagnostics.record() as rec:
        fp8attn.varlen_attention(q, k, v, cu(lens_q), cu(lens_k), layer_name="packed").sum().backward()
    assert [r["layer"] for r in rec.records] == ["packed", "packed"]
    # in sequence order (varlen_bwd loops over the sequences)
    assert [r["shape"]["seqlen_q"] for r in rec.records] == [6, 9]


def test_torch_compile_aot_eager():
    lens = [5, 11]
    q, k, v = make_packed(lens, lens, hq=2, hkv=2, d=16)
    cq = cu(lens)
    fn = torch.compile(lambda q, k, v: fp8attn.varlen_attention(q, k, v, cq, cq, causal=True),
                       backend="aot_eager")
    qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    oe = fp8attn.varlen_attention(qe, ke, ve, cq, cq, causal=True)
    oc = fn(qc, kc, vc)
    assert torch.equal(oe, oc)
    dout = torch.randn_like(oe)
    oe.backward(dout)
    oc.backward(dout)
    assert torch.equal(qe.grad, qc.grad) and torch.equal(kc.grad, ke.grad) and torch.equal(vc.grad, ve.grad)


# ---- CUDA (skips without a GPU and the CUDA kernels) ---------------------------------

HAS_CUDA_KERNELS = torch.cuda.is_available() and getattr(fp8attn._lib, "HAS_CUDA_KERNELS", False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_KERNELS, reason="needs a CUDA GPU and the CUDA kernels")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_per_sequence_and_cpu(causal):
    # Packed documents on the GPU (the trainer's --packed path): bit-identical to
    # per-sequence CUDA calls (empty sequences and outside tokens included), and
    # within the FP8 tolerance of the CPU reference on the same packed inputs.
    lens_q, lens_k = [130, 0, 257, 9, 64], [200, 12, 257, 0, 64]
    torch.manual_seed(7)
    q, k, v = make_packed(lens_q, lens_k, hq=4, hkv=2, d=128, tail_q=5, tail_k=3, dtype=torch.bfloat16)
    q[-5:] = float("nan")            # outside every sequence: must not leak
    cq, ck = cu(lens_q), cu(lens_k)
    dout = torch.randn(q.shape[0], 4, 128, dtype=torch.bfloat16)
    kw = dict(causal=causal, block_size=128)
    dev = [t.cuda() for t in (q, k, v, cq, ck, dout)]
    out, lse, dq, dk, dv = run_varlen(*dev, **kw)
    ref = run_per_sequence(*dev, **kw)
    assert_equals_per_sequence((out, lse, dq, dk, dv), ref, cq, ck)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    assert (out[-5:] == 0).all() and (dq[-5:] == 0).all()
    o_cpu, _, dq_cpu, dk_cpu, dv_cpu = run_varlen(q, k, v, cq, ck, dout, **kw)
    for name, g, r in (("O", out, o_cpu), ("dQ", dq, dq_cpu), ("dK", dk, dk_cpu), ("dV", dv, dv_cpu)):
        g, r = g.cpu().double()[: sum(lens_q) if name in ("O", "dQ") else sum(lens_k)], \
            r.double()[: sum(lens_q) if name in ("O", "dQ") else sum(lens_k)]
        rel = (g - r).norm() / r.norm().clamp(min=1e-30)
        assert rel.item() < 2e-2, f"{name}: ||cuda - cpu|| / ||cpu|| = {rel.item():.3g}"


def test_single_launch_ops_refuse_cpu_tensors():
    # fp8attn::fwd_varlen / bwd_varlen (the single-launch path, CUDA kernels only) on
    # CPU tensors: a ValueError naming the argument, not torch's "Could not run".
    q, k, v = make_packed([5, 7], [5, 7], d=64)
    cq = cu([5, 7])
    with pytest.raises(ValueError, match="argument 'q': expected a CUDA tensor"):
        torch.ops.fp8attn.fwd_varlen(q, k, v, cq, cq, None, None, 0.125, True, 128, "tile")
    with pytest.raises(ValueError, match="argument 'dout': expected a CUDA tensor"):
        torch.ops.fp8attn.bwd_varlen(q, q, k, v, q, torch.zeros(4, 12), cq, cq, None, None, 0.125, True,
                                     "delta_matching", 128, "e4m3", False, "tile")


def test_single_launch_ops_fake_shapes():
    # The fake kernels (torch.compile / meta tensors) of the single-launch ops.
    m = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    c = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = torch.ops.fp8attn.fwd_varlen(m(12, 4, 64), m(10, 2, 64), m(10, 2, 32), c, c, None, None, 0.125, True,
                                            128, "tile")
    assert out.shape == (12, 4, 32) and lse.shape == (4, 12) and lse.dtype == torch.float32
    grads = torch.ops.fp8attn.bwd_varlen(m(12, 4, 32), m(12, 4, 64), m(10, 2, 64), m(10, 2, 32), m(12, 4, 32),
                                         m(4, 12), c, c, None, None, 0.125, True, "delta_matching", 128, "e4m3", True,
                                         "tile")
    assert [tuple(g.shape) for g in grads] == [(12, 4, 64), (10, 2, 64), (10, 2, 32), (4, 4, 12)]

