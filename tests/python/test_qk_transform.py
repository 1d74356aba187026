"""qk_rotation="hadamard" and smooth_k (docs/numerics.md section 10) on the CPU:
the rotation is orthogonal, fixed and blocked as the contract says; the op's
unfused torch path (what runs around the CUDA kernels) gives the CPU reference's
numbers bit for bit; in exact mode the options change O / LSE / gradients only by
rounding and the gradients equal float64 autograd of the transformed math; GQA
groups share one rotation and one mean; varlen smooths per sequence; the NaN
rules; argument errors name the argument; and the accuracy effect on
training-shaped inputs (the generators of scripts/recipe_study.py) for both
scaling recipes. GPU tests: tests/python/test_cuda_qk_transform.py."""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import fp8attn
from fp8attn import ops
from fp8attn import qk_transform as qkt
from fp8attn.varlen import varlen_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import recipe_study  # noqa: E402  (the input generators and the exact float64 attention)

OPTIONS = [("hadamard", False), ("none", True), ("hadamard", True)]
F64 = torch.float64


def _inputs(B=1, Hq=4, Hkv=2, Sq=70, Sk=133, d=64, dv=24, dtype=torch.bfloat16, key_offset=2.0):
    q = torch.randn(B, Hq, Sq, d)
    k = torch.randn(B, Hkv, Sk, d) + key_offset * torch.randn(B, Hkv, 1, d)  # a common key component
    v = torch.randn(B, Hkv, Sk, dv)
    do = torch.randn(B, Hq, Sq, dv)
    return tuple(t.to(dtype) for t in (q, k, v, do))


def _grads(fn, q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o, lse = fn(q, k, v, return_lse=True, **kw)
    o.backward(do)
    return o.detach(), lse, q.grad, k.grad, v.grad


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---- the rotation itself ---------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 16, 37, 64, 80, 96, 100, 128, 160, 192, 255, 256])
def test_rotation_is_orthogonal_blocked_and_fixed(d):
    blocks = qkt.hadamard_blocks(d)
    assert sum(blocks) == d and blocks == sorted(blocks, reverse=True) and len(set(blocks)) == len(blocks)
    assert all(n & (n - 1) == 0 for n in blocks)
    R = qkt.hadamard_matrix(d)
    assert torch.allclose(R @ R.T, torch.eye(d, dtype=F64), atol=1e-14, rtol=0)
    # Block-diagonal: nothing mixes channels of different blocks; inside a block
    # every entry is +-1/sqrt(n) (outliers are spread over the whole block).
    o = 0
    for n in blocks:
        blk = R[o:o + n, o:o + n]
        assert torch.allclose(blk.abs(), torch.full_like(blk, 1 / math.sqrt(n)), atol=1e-15, rtol=0)
        assert R[o:o + n, :o].abs().max().item() == 0 if o else True
        assert R[o:o + n, o + n:].abs().max().item() == 0 if o + n < d else True
        o += n
    # 128 < d < 256: no block straddles the row recipe's 128-channel quantization blocks.
    if 128 < d < 256:
        edges = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
        assert all(not (a < 128 < b) for a, b in zip(edges, edges[1:]))
    # Deterministic, no state: the same matrix every call, and the sign table is the formula's.
    assert torch.equal(qkt.hadamard_matrix(d), R)
    assert qkt.hadamard_signs(d).tolist() == [qkt._sign(c) for c in range(d)]
    # x R R^T = x (the gradient map is the transpose).
    x = torch.randn(5, d, dtype=F64)
    assert torch.allclose(qkt.rotate_transposed(qkt.rotate(x)), x, atol=1e-13, rtol=0)
    assert torch.allclose(qkt.rotate_transposed(x), x @ R.T, atol=1e-13, rtol=0)


def test_sign_pattern_is_not_a_walsh_function():
    """A sign pattern equal to a Hadamard row would make D H a permuted H: the
    all-ones (common) vector would be mapped onto one channel. The fixed pattern
    spreads it over every channel of each block."""
    for d in (64, 128, 256):
        ones = torch.ones(1, d, dtype=F64)
        y = qkt.rotate(ones)
        assert y.abs().max().item() < 0.5 * math.sqrt(d), d
    s = qkt.hadamard_signs(256)
    assert 96 < int((s > 0).sum()) < 160


# ---- fused (C++ reference) == unfused (torch ops around the raw op) -----------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 80, 192, 37])
@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_unfused_path_equals_the_reference_bitwise(dtype, d, scaling):
    q, k, v, do = _inputs(B=2, Sq=70, Sk=90, d=d, dtype=dtype)
    s = 1 / math.sqrt(d)
    for rot, sm in OPTIONS:
        for causal in (False, True):
            fused = ops.fwd_op(q, k, v, s, causal, "fp8", 64, scaling, rot, sm, unfused=False)
            unfused = ops.fwd_op(q, k, v, s, causal, "fp8", 64, scaling, rot, sm, unfused=True)
            assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
            args = (do, q, k, v, fused[0], fused[1], s, causal, "fp8", "delta_matching", 64, "e4m3", True, scaling,
                    rot, sm)
            gf = ops.bwd_op(*args, unfused=False)
            gu = ops.bwd_op(*args, unfused=True)
            for a, b in zip(gf, gu):
                assert a.dtype == b.dtype and torch.equal(a, b), (rot, sm, causal)
            # ... and the options are really applied (not dropped on the way).
            plain = ops.fwd_op(q, k, v, s, causal, "fp8", 64, scaling)
            assert not torch.equal(plain[0], fused[0])


# ---- exact mode: the options change nothing but rounding ---------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96])
def test_exact_mode_unchanged_by_the_options(causal, d):
    q, k, v, do = _inputs(Sq=50, Sk=77, d=d, dtype=F64, key_offset=5.0)
    base = _grads(fp8attn.attention, q, k, v, do, causal=causal, precision="exact")
    for rot, sm in OPTIONS:
        got = _grads(fp8attn.attention, q, k, v, do, causal=causal, precision="exact", qk_rotation=rot, smooth_k=sm)
        for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, base):
            if name == "LSE":  # FP32 output; -inf rows identical
                assert torch.equal(torch.isinf(a), torch.isinf(b))
                fin = torch.isfinite(b)
                assert (a[fin] - b[fin]).abs().max().item() <= 4e-6 * max(1.0, b[fin].abs().max().item())
            else:
                assert _rel(a, b) < 1e-12, (name, rot, sm)


def _transformed_exact_attention(q, k, v, tau, causal, rot, sm):
    """float64 torch autograd of the transformed math (numerics.md section 10):
    S = tau (Q R) ((K - m) R)^T with m the mean key, then exact attention."""
    d = q.shape[-1]
    R = qkt.hadamard_matrix(d) if rot == "hadamard" else torch.eye(d, dtype=F64)
    kk = k - k.mean(dim=2, keepdim=True) if sm else k
    group = q.shape[1] // k.shape[1]
    qr, kr = q @ R, (kk @ R).repeat_interleave(group, dim=1)
    vr = v.repeat_interleave(group, dim=1)
    S = tau * qr @ kr.transpose(-1, -2)
    if causal:
        S = S + recipe_study.mask_bias(q.shape[2], k.shape[2])
    return torch.softmax(S, dim=-1) @ vr


@pytest.mark.parametrize("causal", [False, True])
def test_exact_gradients_equal_float64_autograd_of_the_transformed_math(causal):
    q, k, v, do = _inputs(Sq=40, Sk=50, d=80, dv=16, dtype=F64, key_offset=3.0)
    tau = 1 / math.sqrt(80)
    for rot, sm in OPTIONS:
        got = _grads(fp8attn.attention, q, k, v, do, causal=causal, precision="exact", qk_rotation=rot, smooth_k=sm)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        o = _transformed_exact_attention(qq, kk, vv, tau, causal, rot, sm)
        o.backward(do)
        for a, b in zip((got[0], got[2], got[3], got[4]), (o.detach(), qq.grad, kk.grad, vv.grad)):
            assert _rel(a, b) < 1e-12


def test_exact_gradcheck_through_rotation_and_mean():
    q, k, v, _ = _inputs(B=1, Hq=2, Hkv=1, Sq=5, Sk=7, d=12, dv=3, dtype=F64)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    f = lambda a, b, c: fp8attn.attention(a, b, c, causal=True, precision="exact", qk_rotation="hadamard",
                                          smooth_k=True)
    assert torch.autograd.gradcheck(f, (qq, kk, vv), eps=1e-6, atol=1e-8)


# ---- GQA, varlen ------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_gqa_group_shares_one_rotation_and_one_mean(scaling):
    """GQA with kv head h equals MHA on K / V repeated per query head: every query
    head of a group sees the same rotation and the group's mean key (the mean of
    the repeated heads is the same mean)."""
    q, k, v, do = _inputs(Hq=6, Hkv=2, Sq=60, Sk=80, d=64)
    rep = lambda t: t.repeat_interleave(3, dim=1)
    for rot, sm in OPTIONS:
        kw = dict(causal=True, scaling=scaling, qk_rotation=rot, smooth_k=sm, block_size=32)
        g = _grads(fp8attn.attention, q, k, v, do, **kw)
        m = _grads(fp8attn.attention, q, rep(k), rep(v), do, **kw)
        assert torch.equal(g[0], m[0]) and torch.equal(g[1], m[1]) and torch.equal(g[2], m[2])
        # dK / dV: the group sum, in another FP32 summation order.
        for a, b in ((g[3], m[3]), (g[4], m[4])):
            b = b.float().view(b.shape[0], 2, 3, *b.shape[2:]).sum(2)
            assert _rel(a, b) < 1e-2


def test_varlen_smooths_each_sequence_with_its_own_mean():
    lens_q, lens_k = [30, 0, 45, 20], [40, 12, 50, 20]
    hq, hkv, d, dv = 4, 2, 64, 32
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d).bfloat16()
    k = torch.randn(tk, hkv, d)
    # Each sequence's keys get their own large common component.
    o = 0
    for n in lens_k:
        k[o:o + n] += 4.0 * torch.randn(1, hkv, d)
        o += n
    k, v, do = k.bfloat16(), torch.randn(tk, hkv, dv).bfloat16(), torch.randn(tq, hq, dv).bfloat16()
    for rot, sm in OPTIONS:
        kw = dict(causal=True, qk_rotation=rot, smooth_k=sm)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = varlen_attention(qq, kk, vv, cu(lens_q), cu(lens_k), return_lse=True, **kw)
        out.backward(do)
        oq = ok = 0
        for nq, nk in zip(lens_q, lens_k):
            sl = lambda t, a, n: t[a:a + n].transpose(0, 1)[None]
            if nq and nk:
                o_b, l_b, dq_b, dk_b, dv_b = _grads(fp8attn.attention, sl(q, oq, nq), sl(k, ok, nk), sl(v, ok, nk),
                                                    sl(do, oq, nq), **kw)
                assert torch.equal(out[oq:oq + nq], o_b[0].transpose(0, 1))
                assert torch.equal(lse[:, oq:oq + nq], l_b[0])
                assert torch.equal(qq.grad[oq:oq + nq], dq_b[0].transpose(0, 1))
                assert torch.equal(kk.grad[ok:ok + nk], dk_b[0].transpose(0, 1))
                assert torch.equal(vv.grad[ok:ok + nk], dv_b[0].transpose(0, 1))
            oq, ok = oq + nq, ok + nk
    # Per sequence, smooth_k is the reference's rule on that sequence's own keys:
    # the mean of its keys (FP64 sum, FP32), subtracted in FP32, rounded to BF16.
    oq = ok = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq and nk:
            kb = k[ok:ok + nk].float()
            ks = (kb - (kb.double().sum(0, keepdim=True) / nk).float()).bfloat16()
            a = varlen_attention(q[oq:oq + nq], k[ok:ok + nk], v[ok:ok + nk], cu([nq]), cu([nk]), smooth_k=True)
            b = varlen_attention(q[oq:oq + nq], ks, v[ok:ok + nk], cu([nq]), cu([nk]))
            assert torch.equal(a, b)
        oq, ok = oq + nq, ok + nk


def test_smooth_k_dk_through_the_mean_sums_to_zero():
    """dK_in = dK' - mean_j dK'_j: the key gradients of each (batch, kv head) sum
    to zero over the keys (to rounding), in every mode and recipe."""
    q, k, v, do = _inputs(Sq=64, Sk=96, dtype=torch.float32)
    for scaling in ("row", "tile"):
        for mode in ("delta_matching", "stale"):
            g = _grads(fp8attn.attention, q, k, v, do, causal=True, smooth_k=True, scaling=scaling, delta_mode=mode)
            colsum = g[3].double().sum(dim=2)
            assert colsum.abs().max().item() < 1e-5 * g[3].double().abs().sum(dim=2).max().item()


# ---- NaN rules ----------------------------------------------------------------------------


def test_nan_rules():
    q, k, v, _ = _inputs(Hq=2, Hkv=1, Sq=64, Sk=64, d=64, dtype=torch.float32)
    k_bad = k.clone()
    k_bad[0, 0, 40, 3] = float("nan")
    # Hadamard keeps the row rule: a NaN key reaches only the rows that see it.
    o, lse = fp8attn.attention(q, k_bad, v, causal=True, qk_rotation="hadamard", return_lse=True)
    assert torch.isfinite(o[:, :, :40]).all() and torch.isnan(o[:, :, 40:]).all()
    # smooth_k: the mean couples all keys of the (batch, kv head): every row is NaN.
    for bad in (float("nan"), float("inf")):
        k_bad[0, 0, 40, 3] = bad
        o, lse = fp8attn.attention(q, k_bad, v, causal=True, smooth_k=True, return_lse=True)
        assert torch.isnan(o).all() and torch.isnan(lse).all()
    # A row that sees no key stays O = 0, LSE = -inf (seqlen_q > seqlen_k, causal),
    # also when a key it does not see poisons the mean.
    k_bad = k.clone()
    k_bad[0, 0, 10, 3] = float("nan")
    o, lse = fp8attn.attention(q, k_bad[:, :, :20], v[:, :, :20], causal=True, smooth_k=True,
                               qk_rotation="hadamard", return_lse=True)
    assert (o[:, :, :44] == 0).all() and (lse[:, :, :44] == float("-inf")).all()
    assert torch.isnan(o[:, :, 44:]).all()
    # NaN in Q row i under Hadamard: only that row of O.
    q_bad = q.clone()
    q_bad[0, 1, 10, 0] = float("nan")
    o = fp8attn.attention(q_bad, k, v, causal=True, qk_rotation="hadamard")
    assert torch.isnan(o[0, 1, 10]).all() and torch.isfinite(o[0, 1, :10]).all() and torch.isfinite(o[0, 0]).all()


# ---- every entry point, argument errors -------------------------------------------------


def test_every_entry_point_applies_the_options():
    q, k, v, _ = _inputs(Hq=2, Hkv=2, Sq=48, Sk=48, d=64)
    want = fp8attn.attention(q, k, v, causal=True, qk_rotation="hadamard", smooth_k=True)
    assert not torch.equal(want, fp8attn.attention(q, k, v, causal=True))
    got = fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                  qk_rotation="hadamard", smooth_k=True)
    assert torch.equal(got.transpose(1, 2), want)
    got = fp8attn.scaled_dot_product_attention(q, k, v, is_causal=True, qk_rotation="hadamard", smooth_k=True)
    assert torch.equal(got, want)
    m = fp8attn.FP8Attention(causal=True, qk_rotation="hadamard", smooth_k=True)
    assert torch.equal(m(q, k, v), want) and "qk_rotation='hadamard'" in repr(m)
    from fp8attn import hf  # the HF attention function (no transformers needed to build it)
    hf_out, _ = hf.make_attention_function(qk_rotation="hadamard", smooth_k=True)(None, q, k, v, None,
                                                                                 scaling=1 / 8)
    assert torch.equal(hf_out, want.transpose(1, 2))
    with fp8attn.diagnostics.record() as rec:
        qq = q.clone().requires_grad_()
        fp8attn.attention(qq, k, v, causal=True, qk_rotation="hadamard", smooth_k=True).sum().backward()
    assert rec.records[0]["qk_rotation"] == "hadamard" and rec.records[0]["smooth_k"] is True
    # The raw op (CPU) takes them too and is differentiable with them.
    s = 1 / 8
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    o_raw, _ = torch.ops.fp8attn.fwd(qr, kr, vr, s, True, "fp8", 128, "row", "hadamard", True)
    assert torch.equal(o_raw.detach(), want)
    do = torch.randn_like(want)
    o_raw.backward(do)
    pub = _grads(fp8attn.attention, q, k, v, do, causal=True, qk_rotation="hadamard", smooth_k=True)
    for a, b in zip((qr.grad, kr.grad, vr.grad), pub[2:]):
        assert torch.equal(a, b)


def test_bad_arguments_name_the_argument():
    q, k, v, _ = _inputs(Sq=8, Sk=8, d=16)
    calls = [
        lambda **kw: fp8attn.attention(q, k, v, **kw),
        lambda **kw: fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw),
        lambda **kw: fp8attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw),
        lambda **kw: fp8attn.FP8Attention(**kw),
        lambda **kw: varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                      torch.tensor([0, 8]), torch.tensor([0, 8]), **kw),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="'qk_rotation'"):
            call(qk_rotation="walsh")
        with pytest.raises(ValueError, match="'qk_rotation'"):
            call(qk_rotation=None)
        with pytest.raises(TypeError, match="'smooth_k'"):
            call(smooth_k=1)
        with pytest.raises(TypeError, match="'smooth_k'"):
            call(smooth_k="yes")
    with pytest.raises(ValueError, match="'qk_rotation'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 128, "row", "random", False)
    try:
        from fp8attn import hf
    except ImportError:  # pragma: no cover
        return
    with pytest.raises(ValueError, match="'qk_rotation'"):
        hf.make_attention_function(qk_rotation="quarot")
    hf.make_attention_function(qk_rotation="hadamard", smooth_k=True)  # accepted


def test_trainer_config_takes_the_options():
    from fp8attn.train.model import ModelConfig
    ModelConfig(fp8_qk_rotation="hadamard", fp8_smooth_k=True)
    with pytest.raises(ValueError, match="fp8_qk_rotation"):
        ModelConfig(fp8_qk_rotation="x")
    with pytest.raises(ValueError, match="fp8_smooth_k"):
        ModelConfig(fp8_smooth_k=1)
    from fp8attn.train.compare import parse_args
    a = parse_args(["--out", "x", "--qk-rotation", "hadamard", "--smooth-k"])
    assert a.qk_rotation == "hadamard" and a.smooth_k is True
    a = parse_args(["--out", "x"])
    assert a.qk_rotation == "none" and a.smooth_k is False


# ---- accuracy on training-shaped inputs (numerics.md section 10) ------------------------------


@pytest.fixture(scope="module")
def accuracy():
    """CPU reference errors vs float64 for each input kind, recipe and option
    (1 head, 2048 x 2048, d = 128, causal; the table of docs/results.md)."""
    return recipe_study.outlier_table(seqlen=2048)


@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_hadamard_halves_the_error_on_channel_outliers(accuracy, scaling):
    r = accuracy["training"]
    none, had, both = r[(scaling, "none")], r[(scaling, "hadamard")], r[(scaling, "both")]
    for key in ("o", "dq", "dk", "dv"):
        assert had[key] <= 0.55 * none[key], (key, had[key], none[key])
        assert both[key] <= 0.6 * none[key], (key, both[key], none[key])
    assert had["lse"] <= 0.6 * none["lse"]


@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_smooth_k_removes_the_common_key_error(accuracy, scaling):
    r = accuracy["common_key"]
    none, sm, both, gauss = r[(scaling, "none")], r[(scaling, "smooth_k")], r[(scaling, "both")], \
        accuracy["gaussian"][(scaling, "none")]
    for key in ("o", "dq", "dk", "dv", "lse"):
        assert sm[key] <= 0.6 * none[key], (key, sm[key], none[key])
        assert both[key] <= 0.6 * none[key], (key, both[key], none[key])
        # Back to the Gaussian-input error: the common part no longer costs anything.
        assert sm[key] <= 1.15 * gauss[key], (key, sm[key], gauss[key])


@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_options_do_not_hurt_gaussian_inputs(accuracy, scaling):
    r = accuracy["gaussian"]
    for name in ("hadamard", "smooth_k", "both"):
        for key in ("o", "dq", "dk", "dv"):
            assert r[(scaling, name)][key] <= 1.05 * r[(scaling, "none")][key], (name, key)


@pytest.mark.parametrize("rot", ["hadamard", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_torch_compile_fullgraph_with_the_options(dtype, rot):
    """Both paths trace without a graph break (aot_eager, as test_op.py): the fused
    raw op through the public function, and the unfused torch path the CUDA op
    runs (forced here on CPU tensors), with the same numbers as eager, gradients
    included. The guarded failure (a helper's break test, 2026-12-03): with float32
    inputs and smooth_k the compiled gradients came out all zero (the raw op's O
    returned as it is from the autograd.Function after the transforms; fwd_op copies it
    under compile now); bfloat16 was not hit (O is converted, a new tensor)."""
    torch._dynamo.reset()
    q, k, v, do = _inputs(Sq=16, Sk=24, d=16, dv=16)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    def step(q, k, v):
        return (fp8attn.attention(q, k, v, causal=True, qk_rotation=rot, smooth_k=True).float() ** 2).sum()

    def unfused(q, k, v):
        o, lse = ops.fwd_op(q, k, v, 0.25, True, "fp8", 128, "row", rot, True, unfused=True)
        return o.float().sum() + lse.sum()

    for fn, grads in ((step, True), (unfused, False)):
        qq, kk, vv = (t.clone().requires_grad_(grads) for t in (q, k, v))
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(qq, kk, vv)
        want = fn(q, k, v)
        assert torch.equal(got, want)
        if grads:
            g = torch.autograd.grad(got, (qq, kk, vv))
            qe, ke, ve = (t.clone().requires_grad_() for t in (q, k, v))
            ge = torch.autograd.grad(step(qe, ke, ve), (qe, ke, ve))
            assert all(x.abs().max() > 0 for x in ge)
            assert all(torch.equal(a, b) for a, b in zip(g, ge))
    torch._dynamo.reset()


@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_delta_matching_invariant_holds_with_the_options(scaling):
    """The DM pre-cast row sums stay at FP32 rounding with the transforms (the
    backward's P comes from the recovered LSE', and delta from that same P)."""
    q, k, v, do = _inputs(Sq=96, Sk=96, d=64, key_offset=4.0)
    for rot, sm in OPTIONS:
        qq = q.clone().requires_grad_()
        with fp8attn.diagnostics.record() as rec:
            o = fp8attn.attention(qq, k, v, causal=True, scaling=scaling, qk_rotation=rot, smooth_k=sm)
            o.backward(do)
        stale = q.clone().requires_grad_()
        with fp8attn.diagnostics.record() as rec_s:
            fp8attn.attention(stale, k, v, causal=True, scaling=scaling, qk_rotation=rot, smooth_k=sm,
                              delta_mode="stale").backward(do)
        dm, st = rec.records[0]["rowsum_pre_mean"], rec_s.records[0]["rowsum_pre_mean"]
        assert dm < 1e-5 and dm < 0.01 * st, (rot, sm, dm, st)


@pytest.mark.parametrize("packed", [False, True])
def test_trainer_model_passes_the_options_to_the_attention_core(packed):
    """The trainer's model (fp8attn.train.model) hands fp8_qk_rotation /
    fp8_smooth_k to every attention call (dense and packed documents), and they
    change the loss gradient (so they are not dropped)."""
    from fp8attn.train.model import ModelConfig, Transformer
    tokens = torch.randint(1, 64, (2, 32))
    if packed:
        tokens[:, 10] = 0  # <|endoftext|>: two documents per row
    grads = {}
    for rot, sm in (("none", False), ("hadamard", True)):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                          mlp_hidden=128, max_seq_len=32, attn_mode="fp8-delta_matching", packed=packed,
                          fp8_qk_rotation=rot, fp8_smooth_k=sm)
        model = Transformer(cfg)
        with fp8attn.diagnostics.record() as rec:
            model(tokens).float().square().mean().backward()
        assert rec.records and all(r["qk_rotation"] == rot and r["smooth_k"] is sm for r in rec.records)
        grads[rot] = model.blocks[0].attn.wq.weight.grad.clone()
    assert not torch.equal(grads["none"], grads["hadamard"])


# ---- smooth_k: the backward keeps the forward's LSE' (no FP32 round trip) -----------------


@pytest.mark.parametrize("kscale", [1e10, 1e30])
def test_smooth_k_huge_keys_have_finite_gradients(kscale):
    """Keys of magnitude 1e10+ (logits ~1e10: a one-hot softmax): LSE = LSE' + shift and
    back in FP32 moves LSE' by one ulp of ~1e10 (~1e3 logit units), P = exp(S' - LSE')
    overflowed and dQ, dK came out NaN. The autograd entry points now hand the backward
    the forward's own LSE' (numerics.md section 10.2); the lossy path (the raw op's
    bwd from the public LSE) is shown failing, the guarded failure."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 130, 64, generator=g).bfloat16()
    k = ((torch.randn(1, 2, 140, 64, generator=g) + 3 * torch.randn(64, generator=g)) * kscale).bfloat16()
    v = torch.randn(1, 2, 140, 64, generator=g).bfloat16()
    do = torch.randn(1, 2, 130, 64, generator=g).bfloat16()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    o = fp8attn.attention(qr, kr, vr, smooth_k=True)
    o.backward(do)
    for name, t in (("O", o), ("dQ", qr.grad), ("dK", kr.grad), ("dV", vr.grad)):
        assert torch.isfinite(t).all(), name
    # One-hot rows: dS = P (dP - delta) ~ 0, so dQ and dK are ~0 next to dV's scale.
    assert qr.grad.float().abs().max() <= 1e-3 * vr.grad.float().abs().max()
    # Without smoothing the same inputs were always finite: the same O.
    o_plain = fp8attn.attention(q, k, v)
    assert torch.isfinite(o_plain).all()
    # The guarded failure: LSE' recovered from the public LSE (the round trip).
    out, lse = ops.fwd_op(q, k, v, 0.125, False, "fp8", 128, "row", "none", True)
    lossy = ops.bwd_op(do, q, k, v, out, lse, 0.125, False, "fp8", "delta_matching", 128, "e4m3", False,
                       "row", "none", True)
    assert not torch.isfinite(lossy[0]).all()


@pytest.mark.parametrize("entry", ["varlen", "raw_op"])
def test_smooth_k_huge_keys_finite_through_varlen_and_the_raw_op(entry):
    """The same fault through varlen_attention (varlen_fwd's third output LSE' reaches
    varlen_bwd) and the raw op's autograd (its backward recomputes LSE')."""
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 130, 64, generator=g).bfloat16()
    k = ((torch.randn(1, 2, 130, 64, generator=g) + 3 * torch.randn(64, generator=g)) * 1e10).bfloat16()
    v = torch.randn(1, 2, 130, 64, generator=g).bfloat16()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    if entry == "varlen":
        cu = torch.tensor([0, 60, 130], dtype=torch.int32)
        o = varlen_attention(*(t[0].transpose(0, 1) for t in (qr, kr, vr)), cu, cu, smooth_k=True)
    else:
        o = torch.ops.fp8attn.fwd(qr, kr, vr, 0.125, False, "fp8", 128, "row", "none", True)[0]
    o.float().sum().backward()
    for name, t in (("O", o), ("dQ", qr.grad), ("dK", kr.grad), ("dV", vr.grad)):
        assert torch.isfinite(t).all(), name


def test_public_helpers_check_their_arguments():
    """qk_transform's helpers took an unknown rotation as "none", an int tensor to all zeros
    and head_dim 300 / 0 to raw shape errors (a break test, 2026-12-03)."""
    from fp8attn import qk_transform as qkt
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="transform_qk: argument 'qk_rotation'"):
        qkt.transform_qk(q, q, "foo", False)
    with pytest.raises(ValueError, match="map_grads_back: argument 'qk_rotation'"):
        qkt.map_grads_back(q, q, "foo", False, q.dtype, q.dtype)
    with pytest.raises(TypeError, match="rotate: argument 'x': expected a floating-point tensor"):
        qkt.rotate(torch.ones(2, 4, dtype=torch.int64))
    for d in (0, 300):
        with pytest.raises(ValueError, match=r"rotate: argument 'x': head_dim \(the last dim\) must be in \[1, 256\]"):
            qkt.rotate(torch.ones(2, d))
    with pytest.raises(ValueError, match="rotate_transposed: argument 'g'"):
        qkt.rotate_transposed(torch.ones(2, 257))
    # The valid range still rotates (orthogonal: norms kept) at its ends.
    for d in (1, 256):
        x = torch.randn(3, d, dtype=torch.float64)
        assert torch.allclose(qkt.rotate(x).norm(dim=-1), x.norm(dim=-1))
