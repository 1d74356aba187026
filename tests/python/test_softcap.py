"""Logit softcapping (numerics.md section 12; FlashAttention's softcap) on the CPU
reference: x = softmax_scale * Q K^T becomes softcap * tanh(x / softcap) before the
softmax, and the backward multiplies the softmax-input gradient by 1 - tanh^2.

- the exact path equals a float64 autograd implementation written here from the
  formula (O, dQ, dK, dV), causal or not, GQA;
- the fp8 path (both recipes) is within its usual FP8 error of the capped exact
  result and far from the uncapped one (a kernel that ignored softcap would fail);
- Delta-Matching keeps the zero row sums of the softmax-input gradient with softcap
  (diagnostics rowsum_pre), stale does not (section 6 rule);
- flash_attn_func takes softcap; errors name it (bad values, smooth_k, CUDA with
  scaling="row": no kernel; CUDA with scaling="tile" runs it, tested on a GPU in
  test_softcap_tile_cuda.py);
- the log2-domain form the CUDA kernels use (csrc/hopper/softcap_sm90.cuh) is the
  formula.
"""
import math

import pytest
import torch

import fp8attn
from fp8attn import diagnostics


def _inputs(seed=0, b=1, hq=4, hkv=2, s=150, d=32, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, s, d, generator=g) * scale for h in (hq, hkv))
    v = torch.randn(b, hkv, s, d, generator=g)
    do = torch.randn(b, hq, s, d, generator=g)
    return q, k, v, do


def _naive(q, k, v, do, cap, causal):
    q, k, v = (t.double().clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    x = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if cap:
        x = cap * torch.tanh(x / cap)
    if causal:
        x = x.masked_fill(torch.ones(x.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    o = torch.softmax(x, -1) @ v.repeat_interleave(g, 1)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def _run(q, k, v, do, cap, causal, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = fp8attn.attention(q, k, v, causal=causal, softcap=cap, **kw)
    o.backward(do.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("causal", [False, True])
def test_exact_path_is_the_formula(causal):
    q, k, v, do = _inputs()
    ref = _naive(q, k, v, do, 5.0, causal)
    got = _run(q.double(), k.double(), v.double(), do.double(), 5.0, causal, precision="exact")
    for a, b in zip(got, ref):
        assert _rel(a, b) < 1e-10
    # softcap = 0 is off
    off = _run(q.double(), k.double(), v.double(), do.double(), 0.0, causal, precision="exact")
    for a, b in zip(off, _naive(q, k, v, do, 0.0, causal)):
        assert _rel(a, b) < 1e-10


@pytest.mark.parametrize("scaling", ["row", "tile"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_path_follows_the_capped_softmax(scaling, causal):
    q, k, v, do = _inputs(1)
    cap = 3.0   # logits have std ~ 4 here: the cap changes the softmax a lot
    capped, plain = _naive(q, k, v, do, cap, causal), _naive(q, k, v, do, 0.0, causal)
    got = _run(q, k, v, do, cap, causal, scaling=scaling)
    got_plain = _run(q, k, v, do, 0.0, causal, scaling=scaling)
    for name, a, c, p, ap in zip(("O", "dQ", "dK", "dV"), got, capped, plain, got_plain):
        # The FP8 error with the cap is no larger than the FP8 error without it on the
        # same inputs (measured 0.050-0.083 vs 0.076-0.124: the cap narrows the logits).
        err, err_plain, sep = _rel(a, c), _rel(ap, p), _rel(p, c)
        assert err < 1.1 * err_plain, (name, err, err_plain)
        assert sep > 5 * err, (name, err, sep)   # a path that ignored softcap is this far off


def test_delta_matching_row_sums_with_softcap():
    q, k, v, do = _inputs(2, scale=1.0)
    res = {}
    for mode in ("delta_matching", "stale"):
        with diagnostics.record(keep_raw=True) as rec:
            _run(q.bfloat16(), k.bfloat16(), v.bfloat16(), do.bfloat16(), 4.0, True, delta_mode=mode)
        res[mode] = rec.records[0]["rowsum_pre_mean"]
    assert res["delta_matching"] < 1e-5, res
    assert res["stale"] > 10 * res["delta_matching"], res


def test_flash_attn_func_and_the_raw_op_take_softcap():
    q, k, v, do = _inputs(3)
    o = fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softcap=4.0)
    assert torch.equal(o.transpose(1, 2), fp8attn.attention(q, k, v, causal=True, softcap=4.0))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = torch.ops.fp8attn.fwd(qr, kr, vr, 32 ** -0.5, True, "fp8", 128, softcap=4.0)
    out.backward(do)
    ref = _run(q, k, v, do, 4.0, True)
    for a, b in zip((out.detach(), qr.grad, kr.grad, vr.grad), ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("value,exc", [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                                       ("big", TypeError), (True, TypeError)])
def test_bad_softcap_is_named(value, exc):
    q, k, v, _ = _inputs()
    with pytest.raises(exc, match="argument 'softcap'"):
        fp8attn.attention(q, k, v, softcap=value)


def test_learnable_softcap_tensor_is_refused():
    # float(tensor) would detach a cap that requires grad: it would train as a constant.
    q, k, v, _ = _inputs()
    cap = torch.tensor(3.0, requires_grad=True)
    with pytest.raises(TypeError, match="argument 'softcap'.*requires grad"):
        fp8attn.attention(q, k, v, softcap=cap)
    with pytest.raises(TypeError, match="'softcap'.*requires grad"):
        fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softcap=cap)
    # a plain 0-d tensor is a number
    out = fp8attn.attention(q, k, v, softcap=torch.tensor(3.0))
    assert torch.equal(out, fp8attn.attention(q, k, v, softcap=3.0))


def test_softcap_with_smooth_k_is_refused():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="argument 'softcap'.*smooth_k"):
        fp8attn.attention(q, k, v, softcap=5.0, smooth_k=True)
    with pytest.raises(ValueError, match="'softcap'"):
        torch.ops.fp8attn.fwd(q, k, v, 0.2, False, "fp8", 128, "row", "none", True, 5.0)


def test_varlen_takes_softcap_per_sequence():
    """Each sequence as `attention` with the same softcap, forward and backward."""
    q, k, v, do = _inputs(4, s=70)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    flat = lambda t: t[0].transpose(0, 1).contiguous()  # noqa: E731  [total, heads, d]
    qf, kf, vf = (flat(t).requires_grad_() for t in (q, k, v))
    o = fp8attn.varlen_attention(qf, kf, vf, cu, cu, causal=True, softcap=4.0)
    o.backward(flat(do))
    for a, b in ((0, 30), (30, 70)):
        sl = lambda t: t[:, :, a:b]  # noqa: E731
        ref = _run(sl(q), sl(k), sl(v), sl(do), 4.0, True)
        assert torch.equal(o[a:b], ref[0][0].transpose(0, 1))
        assert torch.equal(qf.grad[a:b], ref[1][0].transpose(0, 1))
        assert torch.equal(kf.grad[a:b], ref[2][0].transpose(0, 1))
    with pytest.raises(ValueError, match="varlen_attention: argument 'softcap'"):
        fp8attn.varlen_attention(qf, kf, vf, cu, cu, softcap=-1.0)


def test_cuda_softcap_rules_without_a_gpu():
    """check_softcap's CUDA rules (numerics.md section 12): scaling="tile" takes c > 0
    (its kernels; c in CUDA_SOFTCAP_RANGE), scaling="row" raises NotImplementedError
    naming softcap and saying that "tile" runs it; CPU tensors take either."""
    from fp8attn import ops
    assert ops.check_softcap(5.0, False, "cuda", scaling="tile") == 5.0
    assert ops.check_softcap(0.0, False, "cuda", scaling="row") == 0.0
    assert ops.check_softcap(5.0, False, "cpu", scaling="row") == 5.0
    with pytest.raises(NotImplementedError, match=r"argument 'softcap'.*scaling='row'.*scaling='tile' runs it"):
        ops.check_softcap(5.0, False, "cuda", scaling="row")
    lo, hi = ops.CUDA_SOFTCAP_RANGE
    assert ops.check_softcap(lo, False, "cuda", scaling="tile") == lo
    for bad in (lo / 2, hi * 2):
        with pytest.raises(ValueError, match=r"varlen_attention: argument 'softcap'.*on CUDA"):
            ops.check_softcap(bad, False, "cuda", fn="varlen_attention", scaling="tile")
        assert ops.check_softcap(bad, False, "cpu", scaling="tile") == bad   # the reference takes any finite c
    with pytest.raises(ValueError, match="argument 'softcap'.*smooth_k"):
        ops.check_softcap(5.0, True, "cuda", scaling="tile")


def test_public_functions_pass_the_recipe_to_the_softcap_check(monkeypatch):
    """attention, flash_attn_func and varlen_attention hand their scaling to
    check_softcap (on CUDA it decides between the `tile` kernels and the refusal)."""
    from fp8attn import ops, varlen
    seen = []

    def spy(softcap, smooth_k, device_type, fn="attention", scaling="row", precision="fp8"):
        seen.append((fn, scaling, precision))
        return float(softcap)

    monkeypatch.setattr(ops, "check_softcap", spy)
    monkeypatch.setattr(varlen, "check_softcap", spy)
    q, k, v, _ = _inputs(5, s=40)
    fp8attn.attention(q, k, v, softcap=4.0, scaling="tile")
    fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softcap=4.0, scaling="tile")
    cu = torch.tensor([0, 40], dtype=torch.int32)
    flat = lambda t: t[0].transpose(0, 1).contiguous()  # noqa: E731
    fp8attn.varlen_attention(flat(q), flat(k), flat(v), cu, cu, softcap=4.0, scaling="tile", precision="exact")
    assert seen == [("attention", "tile", "fp8"), ("attention", "tile", "fp8"),
                    ("varlen_attention", "tile", "exact")], seen


def test_kernel_formula_is_the_cap():
    """The CUDA kernels' form (csrc/hopper/softcap_sm90.cuh), in float32: with the
    logit in log2 units u = x log2(e) and C = c log2(e), r = 1 / (1 + 2^(u 2 / c)),
    y = C - 2 C r = c tanh(x / c) log2(e) and 4 r (1 - r) = 1 - tanh^2(x / c):
    float32 with IEEE exp2 / division gives y within 3.1e-7 C and the derivative
    within 4.7e-7 (measured; the kernels' ex2 / rcp approximations add ~2 ulp)."""
    x = torch.linspace(-400.0, 400.0, 200001, dtype=torch.float64)
    for c in (0.5, 3.0, 20.0, 50.0, 1000.0):
        log2e = 1.0 / math.log(2.0)
        u = (x * log2e).float()
        C, k2 = torch.tensor(c * log2e).float(), torch.tensor(2.0 / c).float()
        r = 1.0 / (1.0 + torch.exp2(u * k2))
        y = C - 2.0 * C * r
        grad = 4.0 * (r - r * r)
        t = torch.tanh(x / c)
        assert ((y.double() - c * t * log2e).abs().max() / (c * log2e)).item() < 5e-7, c
        assert (grad.double() - (1.0 - t * t)).abs().max().item() < 1e-6, c
    # the ends: 2^(u 2 / c) = inf gives r = 0, y = C; 0 gives r = 1, y = -C; NaN stays NaN
    u = torch.tensor([float("inf"), -float("inf"), float("nan")])
    r = 1.0 / (1.0 + torch.exp2(u))
    assert torch.equal(r[:2], torch.tensor([0.0, 1.0])) and torch.isnan(r[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_softcap_on_cuda_is_refused_naming_it():
    # scaling="row" (the default) has no softcap kernel; "tile" runs it (test_softcap_tile_cuda.py).
    q = torch.randn(1, 2, 64, 64, device="cuda").bfloat16()
    with pytest.raises(NotImplementedError, match="argument 'softcap'.*scaling='tile' runs it"):
        fp8attn.attention(q, q, q, softcap=5.0)
    with pytest.raises(NotImplementedError, match="'softcap'.*scaling='tile' runs it"):
        torch.ops.fp8attn.fwd(q, q, q, 0.125, False, "fp8", 128, softcap=5.0)
