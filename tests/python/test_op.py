"""Tests of the PyTorch op layer: fp8attn.attention / flash_attn_func /
scaled_dot_product_attention / FP8Attention over torch.ops.fp8attn.fwd/bwd (CPU
reference). Math: docs/numerics.md. Small shapes: the file runs in well under
2 minutes on 2 cores.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fp8attn
from fp8attn import diagnostics
from torch.utils._python_dispatch import TorchDispatchMode

from compile_helpers import assert_compiled_matches_eager


# ---- helpers ---------------------------------------------------------------------


def f32_scale(head_dim):
    # NOTE: AttnParams.softmax_scale is an FP32 float, so the op uses the FP32
    # rounding of 1/sqrt(d); the FP64 math reference must use the same tau.
    return float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))


def attention_math(q, k, v, scale, causal):
    """Exact attention in float64 (numerics.md section 1), SDPA layout, GQA by
    repeat_interleave, bottom-right causal mask. Returns O, LSE; rows that see
    no key give O = 0, LSE = -inf and zero gradients."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = scale * q @ k.transpose(-1, -2)
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])  # exp(-inf) = 0 on masked entries
    return p @ v, lse


def make_qkv(b=2, hq=4, hkv=2, sq=24, sk=24, d=32, dv=None, dtype=torch.float32, requires_grad=True):
    dv = d if dv is None else dv
    q = torch.randn(b, hq, sq, d, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, dtype=dtype)
    v = torch.randn(b, hkv, sk, dv, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def run(q, k, v, dout=None, **kw):
    """Forward + backward through fp8attn.attention; returns O, LSE, dQ, dK, dV."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fp8attn.attention(q, k, v, return_lse=True, **kw)
    if dout is None:
        dout = torch.randn_like(out)
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class OpCalls(TorchDispatchMode):
    """Records the fp8attn op calls (name, args) made while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fp8attn":
            self.calls.append((func.__name__, args))
        return func(*args, **(kwargs or {}))


CASES = [  # (hq, hkv, sq, sk, d, dv, causal)
    (2, 2, 16, 16, 16, 16, False),
    (2, 2, 16, 16, 16, 16, True),
    (4, 2, 12, 20, 16, 8, True),    # GQA, seqlen_q < seqlen_k, dqk != dv
    (6, 2, 20, 12, 8, 16, True),    # GQA 3:1, seqlen_q > seqlen_k: fully masked rows
    (4, 1, 9, 33, 24, 24, False),   # MQA, odd lengths
]


# ---- exact path vs float64 math --------------------------------------------------


@pytest.mark.parametrize("hq,hkv,sq,sk,d,dv,causal", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_exact_matches_math(hq, hkv, sq, sk, d, dv, causal, dtype, tol):
    q, k, v = make_qkv(2, hq, hkv, sq, sk, d, dv, dtype=dtype)
    dout = torch.randn(2, hq, sq, dv, dtype=dtype)
    out, lse, dq, dk, dv_ = run(q, k, v, dout, causal=causal, precision="exact")
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == (2, hq, sq, dv) and lse.shape == (2, hq, sq)

    qm, km, vm = (t.detach().double().requires_grad_() for t in (q, k, v))
    om, lsem = attention_math(qm, km, vm, f32_scale(d), causal)
    om.backward(dout.double())
    assert rel_err(out, om) < tol
    seen = torch.isfinite(lsem)
    assert torch.equal(torch.isfinite(lse), seen)
    assert torch.allclose(lse[seen].double(), lsem[seen], rtol=1e-6, atol=1e-6)  # LSE is FP32
    for got, want in ((dq, qm.grad), (dk, km.grad), (dv_, vm.grad)):
        assert rel_err(got, want) < tol


def test_bf16_is_alias_of_exact():
    q, k, v = make_qkv(dtype=torch.bfloat16)
    dout = torch.randn(2, 4, 24, 32, dtype=torch.bfloat16)
    a = run(q, k, v, dout, causal=True, precision="exact")
    b = run(q, k, v, dout, causal=True, precision="bf16")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# FP8 error budget of each output against the exact path (numerics.md section 7,
# "FP8 error budget"): round-to-nearest with m mantissa bits gives a relative
# error of RMS SIGMA[m] per element (log-uniform mantissas: 2^-m / sqrt(12) *
# sqrt(3 / (8 ln 2))); errors of independent operands add in quadrature, so an
# output's norm-wise relative error is ~ sqrt(sum of SIGMA^2 over the FP8
# operands it depends on, to first order):
#   O:      Q, K (through S and P), P, V                      4 x E4M3
#   dV:     Q, K (through P), P, dO                           3 x E4M3 + dO
#   dQ, dK: Q, K (through P), V and dO (through dP), dS, and K (dQ) / Q (dK)
#                                                             4 x E4M3 + dO + dS
#           stale: + dO once more (its delta <dO, O> misses dO's rounding)
# (dO, dS in grad_format). Measured / model on standard-normal inputs, seqlen
# 96-160, every delta mode, both formats: O 0.82-1.03, dV 0.90-1.03, dQ/dK
# 0.94-1.08.
SIGMA = {"e4m3": 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2))),
         "e5m2": 2.0**-2 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))}


def fp8_budget(name, grad_format="e4m3", p_format="e4m3", delta_mode="delta_matching"):
    """Model norm-wise relative error of output `name` (O, dQ, dK, dV) of the fp8
    path against the exact one (p_format: the format P is rounded to, E4M3 in
    the recipe; another value models a mutation)."""
    e4, g, p = SIGMA["e4m3"] ** 2, SIGMA[grad_format] ** 2, SIGMA[p_format] ** 2
    var = {"O": 3 * e4 + p, "dV": 2 * e4 + p + g, "dQ": 4 * e4 + 2 * g, "dK": 4 * e4 + 2 * g}[name]
    if delta_mode == "stale" and name in ("dQ", "dK"):
        var += g
    return math.sqrt(var)


def test_fp8_budget_model_values():
    # The numbers the comment above quotes (E4M3 0.0266, E5M2 0.0531 per element).
    assert abs(SIGMA["e4m3"] - 0.0266) < 1e-4 and abs(SIGMA["e5m2"] - 0.0531) < 1e-4
    assert abs(fp8_budget("dV") - 0.0531) < 1e-4 and abs(fp8_budget("dV", p_format="e5m2") - 0.0702) < 1e-4


@pytest.mark.parametrize("hq,hkv,sq,sk,d,dv,causal", CASES)
@pytest.mark.parametrize("delta_mode", ["delta_matching", "stale"])
def test_fp8_close_to_exact(hq, hkv, sq, sk, d, dv, causal, delta_mode):
    # Tolerance: 1.25 x the error budget (fp8_budget) of each output: these short
    # rows (seqlen 9-33) scatter more around the model (measured / model: O
    # 0.69-1.05, dQ/dK 1.08 at most, dV 0.79-0.96); LSE (FP32 log-sum-exp of
    # S, measured <= 1.1%) < 0.02. test_fp8_error_budget is the tight one.
    q, k, v = make_qkv(2, hq, hkv, sq, sk, d, dv, dtype=torch.bfloat16)
    dout = torch.randn(2, hq, sq, dv, dtype=torch.bfloat16)
    fp8 = run(q, k, v, dout, causal=causal, precision="fp8", delta_mode=delta_mode)
    ex = run(q, k, v, dout, causal=causal, precision="exact")
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), fp8, ex):
        assert torch.isfinite(a).all() or name == "LSE", name
        if name == "LSE":
            seen = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), seen)
            a, b = a[seen], b[seen]
        bound = 0.02 if name == "LSE" else 1.25 * fp8_budget(name, delta_mode=delta_mode)
        assert rel_err(a, b) < bound, (name, rel_err(a, b), bound)


BUDGET_SHAPES = [  # (b, hq, hkv, sq, sk, d, dv, causal)
    (2, 4, 2, 128, 128, 64, 64, True),
    (2, 4, 2, 128, 128, 64, 64, False),
    (1, 4, 2, 96, 160, 32, 48, True),
]


@pytest.mark.parametrize("shape", BUDGET_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("delta_mode", fp8attn.DELTA_MODES)
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_fp8_error_budget(shape, delta_mode, grad_format):
    # Every output within 1.12 x its budget (fp8_budget; measured / model <= 1.08
    # here). Guards the recipe's formats: the CPU reference mutated to round P of
    # dV = P^T dO to E5M2 (budget 0.0702) measured dV 0.0636-0.0716 at these
    # shapes in e4m3 (bound 1.12 x 0.0531 = 0.0595: fails; the old bound 0.15
    # and test_fp8_close_to_exact's short rows passed it).
    b, hq, hkv, sq, sk, d, dv, causal = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dv, dtype=torch.bfloat16)
    dout = torch.randn(b, hq, sq, dv, dtype=torch.bfloat16)
    fp8 = run(q, k, v, dout, causal=causal, precision="fp8", delta_mode=delta_mode, grad_format=grad_format)
    ex = run(q, k, v, dout, causal=causal, precision="exact")
    for name, a, e in zip(("O", "LSE", "dQ", "dK", "dV"), fp8, ex):
        if name == "LSE":
            seen = torch.isfinite(e)
            assert rel_err(a[seen], e[seen]) < 0.01, name  # measured 0.15-0.26%
            continue
        assert torch.isfinite(a).all(), name
        bound = 1.12 * fp8_budget(name, grad_format, delta_mode=delta_mode)
        assert rel_err(a, e) < bound, (name, rel_err(a, e), bound)


def _raw_fwd_bwd(q, k, v, dout, causal, block_size, grad_format, delta_mode="delta_matching"):
    """O, LSE, dQ, dK, dV from torch.ops.fp8attn.fwd / bwd called directly."""
    tau = f32_scale(q.shape[-1])
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = torch.ops.fp8attn.fwd(q, k, v, tau, causal, "fp8", block_size)
    dq, dk, dv, _ = torch.ops.fp8attn.bwd(dout, q, k, v, out, lse, tau, causal, "fp8", delta_mode, block_size,
                                          grad_format, False)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_fp8_options(block_size, grad_format):
    # seqlen 150 and head_dim 96: every reduction dim is longer than 64, so each
    # block_size gives other blocks (32 / 64 / 128 along keys, queries, d), and
    # block_size 64 and 128 are told apart too.
    q, k, v = make_qkv(1, 2, 2, 150, 150, 96, dtype=torch.bfloat16)
    dout = torch.randn(1, 2, 150, 96, dtype=torch.bfloat16)
    fp8 = run(q, k, v, dout, causal=True, block_size=block_size, grad_format=grad_format)
    ex = run(q, k, v, dout, causal=True, precision="exact")
    # 1.25 x the error budget, as test_fp8_close_to_exact (E5M2: 2 mantissa bits for dO, dS)
    for name, a, b in zip(("dQ", "dK", "dV"), fp8[2:], ex[2:]):
        assert rel_err(a, b) < 1.25 * fp8_budget(name, grad_format), (name, rel_err(a, b))
    # The options reach the op: the public call is bitwise the raw op with these
    # options, and differs from the raw op with any other block_size or grad_format
    # (O and LSE depend on block_size only; dV = P^T dO on both).
    # NOTE: with power-of-two block scales, a block size changes only the values
    # that fall into the FP8 subnormals (~2^-15 of the block's amax) or flush to
    # zero, which standard-normal inputs of this size hardly have (dK came out
    # bitwise the same for 32 and 64): magnitudes spread over 2^-40..1 per token
    # (E5M2 subnormals start ~2^-30 below amax) and 2^-20..1 per channel make the
    # blocks' amax, and so the results, differ.
    g = torch.Generator().manual_seed(block_size * 10 + len(grad_format))

    def spread(t):
        tok = torch.exp2(-40 * torch.rand(t.shape[:-1] + (1,), generator=g))
        ch = torch.exp2(-20 * torch.rand(t.shape[-1], generator=g))
        return (t.detach().float() * tok * ch).bfloat16()

    q, k, v, dout = (spread(t) for t in (q, k, v, dout))
    fp8 = run(q, k, v, dout, causal=True, block_size=block_size, grad_format=grad_format)
    assert all(torch.equal(a, b) for a, b in zip(fp8, _raw_fwd_bwd(q, k, v, dout, True, block_size, grad_format)))
    for bs in fp8attn.BLOCK_SIZES:
        for fmt in fp8attn.GRAD_FORMATS:
            if (bs, fmt) == (block_size, grad_format):
                continue
            other = _raw_fwd_bwd(q, k, v, dout, True, bs, fmt)
            # NOTE: dV = P^T dO changes with block_size only through values ~2^-15
            # (E4M3) / ~2^-30 (E5M2) below a block's amax: with E5M2 too small to
            # flip a BF16 rounding of dV, so dV is asked to differ with the format.
            names = ("dQ", "dK") + (("dV",) if fmt != grad_format else ()) + (("O",) if bs != block_size else ())
            got = dict(zip(("O", "LSE", "dQ", "dK", "dV"), fp8))
            want = dict(zip(("O", "LSE", "dQ", "dK", "dV"), other))
            for name in names:
                assert not torch.equal(got[name], want[name]), (
                    f"{name} with block_size={block_size}, grad_format={grad_format} equals the result of "
                    f"block_size={bs}, grad_format={fmt}: an option was ignored")


# ---- gradcheck of the exact path ---------------------------------------------


@pytest.mark.parametrize("hq,hkv,sq,sk,d,dv,causal", [
    (2, 1, 5, 7, 6, 4, True),   # GQA, dqk != dv, causal with seqlen_q < seqlen_k
    (2, 2, 6, 4, 4, 5, True),   # fully masked rows
    (3, 3, 4, 4, 3, 3, False),
])
def test_gradcheck_exact(hq, hkv, sq, sk, d, dv, causal):
    q, k, v = make_qkv(1, hq, hkv, sq, sk, d, dv, dtype=torch.float64)
    fn = lambda q, k, v: fp8attn.attention(q, k, v, causal=causal, precision="exact", softmax_scale=0.7)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-6)


# ---- drop-ins and layouts ------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_drop_in(causal, gqa):
    q, k, v = make_qkv(2, 4, 2 if gqa else 4, 16, 16, 16)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    got = fp8attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, precision="exact")
    assert rel_err(got, want) < 1e-5
    got8 = fp8attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    assert rel_err(got8, want) < 1.25 * fp8_budget("O")  # fp8 path, tolerance as in test_fp8_close_to_exact
    # gradients of the drop-in against PyTorch's
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    got = fp8attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, precision="exact")
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), want_grads):
        assert rel_err(a, b) < 1e-5


def test_sdpa_unsupported():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 8, requires_grad=False)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        fp8attn.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fp8attn.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="is_causal"):
        fp8attn.scaled_dot_product_attention(q, k[:, :, :6], v[:, :, :6], is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        fp8attn.scaled_dot_product_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fp8attn.flash_attn_func(q, k, v, dropout_p=0.1)


def test_sdpa_errors_name_pytorchs_arguments():
    """The drop-in's errors name its own (PyTorch's) arguments (a break test, 2026-12-03:
    attention's causal / softmax_scale passed here gave a bare "multiple values" TypeError,
    an unknown keyword one without the function's name, is_causal=1 and scale=0.0 errors
    named 'causal' / 'softmax_scale')."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 8, requires_grad=False)
    sdpa = fp8attn.scaled_dot_product_attention
    for kw, arg in ((dict(causal=True), "causal"), (dict(softmax_scale=0.5), "softmax_scale")):
        with pytest.raises(TypeError, match=rf"scaled_dot_product_attention: argument '{arg}' is "
                                            r"fp8attn.attention's name"):
            sdpa(q, k, v, **kw)
    with pytest.raises(TypeError, match=r"scaled_dot_product_attention: unexpected argument 'foo'"):
        sdpa(q, k, v, foo=1)
    with pytest.raises(TypeError, match=r"scaled_dot_product_attention: argument 'is_causal'"):
        sdpa(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match=r"scaled_dot_product_attention: argument 'scale'"):
        sdpa(q, k, v, scale=0.0)
    # fp8attn's own options still pass through.
    assert sdpa(q, k, v, is_causal=True, scale=0.5, delta_mode="stale", softcap=0.0).shape == q.shape


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_flash_layout_matches(precision):
    q, k, v = make_qkv(2, 4, 2, 12, 20, 16, 8, dtype=torch.bfloat16)
    dout = torch.randn(2, 4, 12, 8, dtype=torch.bfloat16)
    want = run(q, k, v, dout, causal=True, precision=precision)
    # flash layout [batch, seqlen, heads, head_dim] as contiguous tensors
    qf, kf, vf = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    out, lse = fp8attn.flash_attn_func(qf, kf, vf, causal=True, precision=precision, return_lse=True)
    assert out.shape == (2, 12, 4, 8)
    out.backward(dout.transpose(1, 2))
    # The same values reach the reference through other strides: bitwise equal.
    assert torch.equal(out.transpose(1, 2), want[0]) and torch.equal(lse, want[1])
    for a, b in zip((qf.grad, kf.grad, vf.grad), want[2:]):
        assert torch.equal(a.transpose(1, 2), b)


def test_module():
    q, k, v = make_qkv(1, 4, 2, 10, 10, 16)
    m = fp8attn.FP8Attention(causal=True, precision="exact", layer_name="blk0")
    assert "layer_name='blk0'" in repr(m)
    want = fp8attn.attention(q, k, v, causal=True, precision="exact")
    assert torch.equal(m(q, k, v), want)
    mf = fp8attn.FP8Attention(causal=True, precision="exact", layout="bshd")
    got = mf(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert torch.equal(got.transpose(1, 2), want)
    with pytest.raises(ValueError, match="delta_mode"):
        fp8attn.FP8Attention(delta_mode="fresh")
    with pytest.raises(ValueError, match="layout"):
        fp8attn.FP8Attention(layout="sbhd")


def test_module_deterministic(monkeypatch):
    """FP8Attention(deterministic=True) passes it to the op on every call, in both layouts;
    a non-bool is a TypeError naming it."""
    import fp8attn.modules as mods
    seen = []
    for name in ("attention", "flash_attn_func"):
        real = getattr(mods, name)

        def spy(*a, _real=real, **kw):
            seen.append(kw.get("deterministic"))
            return _real(*a, **kw)
        monkeypatch.setattr(mods, name, spy)
    q, k, v = make_qkv(1, 4, 2, 10, 10, 16)
    m = fp8attn.FP8Attention(causal=True, deterministic=True)
    assert "deterministic=True" in repr(m)
    m(q, k, v)
    fp8attn.FP8Attention(causal=True, layout="bshd", deterministic=True)(*(t.transpose(1, 2) for t in (q, k, v)))
    fp8attn.FP8Attention(causal=True)(q, k, v)
    assert seen == [True, True, False]
    with pytest.raises(TypeError, match="'deterministic'"):
        fp8attn.FP8Attention(deterministic=1)


def test_torch_compile_fullgraph_dynamic():
    """torch.compile(fullgraph=True, dynamic=True): symbolic sizes make the default
    softmax_scale (and float options) SymFloats; the argument checks take them (they
    used math.isfinite, which dynamo refuses on a SymFloat: Unsupported at
    check_softcap). Two sequence lengths through the same compiled function."""
    torch._dynamo.reset()

    def step(q, k, v):
        out = fp8attn.attention(q, k, v, causal=True, window_size=(5, 0))  # softcap: its default
        return (out.float() ** 2).sum()

    for s in (16, 24):
        q, k, v = make_qkv(1, 4, 2, s, s, 16, dtype=torch.bfloat16)
        assert_compiled_matches_eager(step, q, k, v, dynamic=True)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 4, 2, 16, 16, 16, dtype=torch.bfloat16)

    def step(q, k, v):
        out = fp8attn.attention(q, k, v, causal=True, delta_mode="stale")
        return (out.float() ** 2).sum()

    assert_compiled_matches_eager(step, q, k, v)  # backend="aot_eager" (compile_helpers.py says why)
    # raw op: differentiable with the default backward, fake kernels in the graph
    torch._dynamo.reset()
    raw = torch.compile(lambda q, k, v: torch.ops.fp8attn.fwd(q, k, v, 0.25, True, "fp8", 128)[0].float().sum(),
                        fullgraph=True, backend="aot_eager")
    g_raw = torch.autograd.grad(raw(q, k, v), (q, k, v))
    g_pub = torch.autograd.grad(fp8attn.attention(q, k, v, causal=True, softmax_scale=0.25).float().sum(), (q, k, v))
    for a, b in zip(g_raw, g_pub):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_fake_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(2, 4, 5, 16), torch.empty(2, 2, 7, 16), torch.empty(2, 2, 7, 8))
        out, lse = torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 128)
        assert out.shape == (2, 4, 5, 8) and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
        dq, dk, dv, diag = torch.ops.fp8attn.bwd(out, q, k, v, out, lse, 0.25, False, "fp8", "stale",
                                                 128, "e4m3", True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert diag.shape == (4, 2, 4, 5)


def test_lse_is_not_differentiable():
    q, k, v = make_qkv(1, 2, 2, 6, 6, 8)
    _, lse = fp8attn.attention(q, k, v, return_lse=True)
    assert not lse.requires_grad
    with pytest.raises(RuntimeError):
        lse.sum().backward()


# ---- argument validation ---------------------------------------------------------


def _bad_calls():
    q, k, v = make_qkv(2, 4, 2, 8, 8, 16, dv=8, requires_grad=False)
    A = fp8attn.attention
    return [
        # (exception, match, thunk)
        (TypeError, "'q'.*dtype", lambda: A(*(t.to(torch.float8_e4m3fn) for t in (q, k, v)))),  # FP8 inputs: not yet (float16 runs)
        (TypeError, "'q'.*dtype", lambda: A(q.int(), k, v)),
        (TypeError, "'k'.*dtype", lambda: A(q, k.double(), v)),
        (TypeError, "'q'.*torch.Tensor", lambda: A(q.numpy(), k, v)),
        (ValueError, "'k'.*device", lambda: A(q, k.to("meta"), v)),
        (ValueError, "'q'.*4-D", lambda: A(q[0], k, v)),
        (ValueError, "'v'.*4-D", lambda: A(q, k, v[..., None])),
        (ValueError, "'k'.*batch", lambda: A(q, k[:1], v)),
        (ValueError, "'v'.*batch", lambda: A(q, k, v[:1])),
        (ValueError, "'k'.*head_dim", lambda: A(q, k[..., :8], v)),
        (ValueError, "'v'.*seqlen", lambda: A(q, k, v[:, :, :5])),
        (ValueError, "'v'.*num_heads", lambda: A(q, k, v[:, :1])),
        (ValueError, "'q'.*multiple", lambda: A(q[:, :3], k, v)),
        (ValueError, "'q'.*head_dim", lambda: A(q[..., :0], k[..., :0], v)),
        (ValueError, "'q'.*head_dim", lambda: A(*(torch.randn(1, 1, 2, 257) for _ in range(3)))),
        (ValueError, "'v'.*head_dim", lambda: A(q, k, v[..., :0])),
        (ValueError, "delta_mode", lambda: A(q, k, v, delta_mode="fresh")),
        (ValueError, "precision", lambda: A(q, k, v, precision="fp16")),
        (ValueError, "grad_format", lambda: A(q, k, v, grad_format="e3m4")),
        (ValueError, "block_size", lambda: A(q, k, v, block_size=48)),
        (ValueError, "block_size", lambda: A(q, k, v, block_size=True)),
        (ValueError, "softmax_scale", lambda: A(q, k, v, softmax_scale=float("nan"))),
        (ValueError, "softmax_scale", lambda: A(q, k, v, softmax_scale=float("inf"))),
        (ValueError, "softmax_scale", lambda: A(q, k, v, softmax_scale=0.0)),
        (ValueError, "softmax_scale", lambda: A(q, k, v, softmax_scale=-1.0)),
        (TypeError, "softmax_scale", lambda: A(q, k, v, softmax_scale="0.1")),
        (TypeError, "causal", lambda: A(q, k, v, causal="yes")),
        (ValueError, "'q'.*flash_attn_func|flash_attn_func.*'q'", lambda: fp8attn.flash_attn_func(q[0], k, v)),
    ]


@pytest.mark.parametrize("idx", range(len(_bad_calls())))
def test_validation_errors(idx):
    exc, match, thunk = _bad_calls()[idx]
    with pytest.raises(exc, match=match):
        thunk()


def test_op_level_errors_are_value_errors():
    # Calling the C++ op directly: the binding's checks and the reference's
    # ArgumentError (head_dim > 256 here) surface as ValueError naming the argument.
    q, k, v = make_qkv(1, 2, 2, 4, 4, 8, requires_grad=False)
    with pytest.raises(ValueError, match="block_size"):
        torch.ops.fp8attn.fwd(q, k, v, 0.5, False, "fp8", 48)
    with pytest.raises(ValueError, match="precision"):
        torch.ops.fp8attn.fwd(q, k, v, 0.5, False, "bf16", 128)
    with pytest.raises(ValueError, match="'v'"):
        torch.ops.fp8attn.fwd(q, k, v[:, :, :3], 0.5, False, "fp8", 128)
    with pytest.raises(TypeError, match="'q'"):
        torch.ops.fp8attn.fwd(q.half(), k, v, 0.5, False, "fp8", 128)
    big = torch.randn(1, 1, 2, 300)
    with pytest.raises(ValueError, match="head_dim"):
        torch.ops.fp8attn.fwd(big, big, big, 0.5, False, "fp8", 128)
    out, lse = torch.ops.fp8attn.fwd(q, k, v, 0.5, False, "fp8", 128)
    with pytest.raises(ValueError, match="delta_mode"):
        torch.ops.fp8attn.bwd(out, q, k, v, out, lse, 0.5, False, "fp8", "fresh", 128, "e4m3", False)
    with pytest.raises(ValueError, match="'dout'"):
        torch.ops.fp8attn.bwd(out[:, :1], q, k, v, out, lse, 0.5, False, "fp8", "stale", 128, "e4m3", False)


# ---- empty problems ----------------------------------------------------------------


@pytest.mark.parametrize("b,hq,hkv,sq,sk", [
    (2, 4, 2, 0, 8),   # seqlen_q = 0
    (2, 4, 2, 6, 0),   # seqlen_k = 0: every row sees no key
    (0, 4, 2, 6, 8),   # batch 0
    (2, 0, 2, 6, 8),   # no query heads
    (2, 0, 0, 6, 8),   # no heads at all
])
@pytest.mark.parametrize("causal", [False, True])
def test_empty(b, hq, hkv, sq, sk, causal):
    q, k, v = make_qkv(b, hq, hkv, sq, sk, 16, 8)
    with OpCalls() as calls:
        out, lse = fp8attn.attention(q, k, v, causal=causal, return_lse=True)
        assert out.shape == (b, hq, sq, 8) and lse.shape == (b, hq, sq)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.all(lse == float("-inf"))
        out.sum().backward()
    assert calls.calls == []  # the kernel is not called
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.equal(t.grad, torch.zeros_like(t))
    # the op itself also handles it
    out2, lse2 = torch.ops.fp8attn.fwd(q.detach(), k.detach(), v.detach(), 0.25, causal, "fp8", 128)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


# ---- strides -----------------------------------------------------------------------


def test_noncontiguous_dout():
    q, k, v = make_qkv(2, 4, 2, 12, 12, 16, 8, dtype=torch.bfloat16)
    dout_t = torch.randn(2, 4, 8, 12, dtype=torch.bfloat16).transpose(-1, -2)  # head_dim stride != 1
    dout_p = torch.randn(2, 12, 4, 8, dtype=torch.bfloat16).transpose(1, 2)    # permuted, unit head_dim stride
    assert not dout_t.is_contiguous() and not dout_p.is_contiguous()
    for dout in (dout_t, dout_p):
        a = run(q, k, v, dout, causal=True, delta_mode="stale")
        b = run(q, k, v, dout.contiguous(), causal=True, delta_mode="stale")
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    # expanded dO (all strides 0) from out.sum()
    a = run(q, k, v, torch.ones(1, dtype=torch.bfloat16).expand(2, 4, 12, 8), causal=True)
    b = run(q, k, v, torch.ones(2, 4, 12, 8, dtype=torch.bfloat16), causal=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kind", ["transposed", "sliced", "headdim_strided", "expanded"])
@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_strided_inputs(kind, precision):
    b, hq, hkv, s, d = 2, 4, 2, 10, 16
    if kind == "transposed":  # [b, s, h, d] memory seen as [b, h, s, d]
        q, k, v = (torch.randn(b, s, h, d).transpose(1, 2) for h in (hq, hkv, hkv))
    elif kind == "sliced":  # every other position, a sub-range of heads and head_dim
        q = torch.randn(b + 1, hq + 1, 2 * s, d + 5)[1:, 1:, ::2, 2:2 + d]
        k = torch.randn(b, hkv, 2 * s, d + 3)[:, :, 1::2, :d]
        v = torch.randn(b, hkv + 2, s, d)[:, 2:]
    elif kind == "headdim_strided":  # non-unit head_dim stride: copied by the binding
        q, k, v = (torch.randn(b, h, s, 2 * d)[..., ::2] for h in (hq, hkv, hkv))
    else:  # broadcast batch and kv heads (stride 0)
        q = torch.randn(1, hq, s, d).expand(b, hq, s, d)
        k = torch.randn(b, 1, s, d).expand(b, hkv, s, d)
        v = torch.randn(1, 1, s, d).expand(b, hkv, s, d)
    assert not all(t.is_contiguous() for t in (q, k, v))
    dout = torch.randn(b, hq, s, d)
    got = run(q, k, v, dout, causal=True, precision=precision)
    want = run(q.contiguous(), k.contiguous(), v.contiguous(), dout, causal=True, precision=precision)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


# ---- diagnostics -------------------------------------------------------------------


def test_diagnostics_record_and_invariant():
    # numerics.md section 6: on standard-normal inputs delta_matching's pre-cast
    # mean row-sum residual is < 1e-5 and stale's is >= 10x larger.
    q, k, v = make_qkv(2, 4, 2, 48, 40, 32, dtype=torch.bfloat16)  # causal, fully masked rows
    dout = torch.randn(2, 4, 48, 32, dtype=torch.bfloat16)
    mods = {m: fp8attn.FP8Attention(causal=True, delta_mode=m) for m in fp8attn.DELTA_MODES}
    model = torch.nn.ModuleDict(mods)
    assert diagnostics.name_layers(model) == 3
    with diagnostics.record() as rec:
        for mode, mod in mods.items():
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            mod(qq, kk, vv).backward(dout)
        fp8attn.attention(q, k, v, causal=True, precision="exact", layer_name="exact").backward(dout)
    r = {x["layer"]: x for x in rec.records}
    assert list(r) == ["stale", "matched_do", "delta_matching", "exact"]
    rows_seeing_keys = 2 * 4 * 40  # seqlen_q - seqlen_k = 8 rows per head see no key
    for x in rec.records:
        assert x["rows"] == rows_seeing_keys
        assert x["shape"]["seqlen_q"] == 48 and x["shape"]["num_heads_kv"] == 2
        for key, val in x.items():
            if isinstance(val, float):
                assert math.isfinite(val), (x["layer"], key)
    dm, stale = r["delta_matching"], r["stale"]
    assert dm["delta_mode"] == "delta_matching" and stale["delta_mode"] == "stale"
    assert dm["eps_absmax"] == 0.0 and stale["eps_absmax"] > 0.0
    assert dm["rowsum_pre_mean"] < 1e-5
    assert stale["rowsum_pre_mean"] >= 10 * dm["rowsum_pre_mean"]
    assert stale["rowsum_pre_mean"] > 1e-5  # the failure the invariant guards against shows up
    assert r["matched_do"]["rowsum_pre_mean"] >= 10 * dm["rowsum_pre_mean"]
    assert stale["rowsum_post_mean"] > dm["rowsum_post_mean"]
    assert r["exact"]["eps_absmax"] == 0.0 and r["exact"]["rowsum_pre_mean"] < 1e-12
    summ = rec.summary()
    assert summ[("stale", "stale")]["calls"] == 1
    assert summ[("stale", "stale")]["rowsum_pre_max"] == stale["rowsum_pre_max"]


def test_diagnostics_off_costs_nothing():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16)
    with OpCalls() as calls:
        fp8attn.attention(q, k, v).sum().backward()
    bwd = [args for name, args in calls.calls if name.startswith("bwd")]
    assert len(bwd) == 1 and bwd[0][-1] is False  # diagnostics=False reaches the kernel
    with diagnostics.record(keep_raw=True) as rec, OpCalls() as calls:
        assert diagnostics.is_recording()
        fp8attn.attention(q, k, v).sum().backward()
    assert not diagnostics.is_recording()
    bwd = [args for name, args in calls.calls if name.startswith("bwd")]
    assert bwd[0][-1] is True and len(rec.records) == 1
    assert rec.records[0]["raw"]["eps"].shape == (2 * 8,)
    # outside the context nothing more is recorded
    fp8attn.attention(q, k, v).sum().backward()
    assert len(rec.records) == 1


def test_compiled_raw_op_backward_under_record_takes_no_records():
    """torch.ops.fp8attn.fwd's backward (register_autograd) is traced by AOT
    autograd outside dynamo, where torch.compiler.is_compiling() reads False.
    is_recording() must still read False there: before that check (fake / proxy
    mode), compiling inside a record() context failed in diag_stats with a
    data-dependent guard on the fake diag tensor."""
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16)
    f = torch.compile(lambda q, k, v: torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 32)[0].sum(),
                      fullgraph=True, backend="aot_eager")
    with diagnostics.record() as rec:
        f(q, k, v).backward()
        assert rec.records == []
        torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 32)[0].sum().backward()  # eager: recorded
    assert len(rec.records) == 1
    torch._dynamo.reset()


# ---- non-finite values ---------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp8", "exact"])
@pytest.mark.parametrize("delta_mode", fp8attn.DELTA_MODES)
def test_clean_inputs_give_finite_outputs(precision, delta_mode):
    # seqlen_q > seqlen_k with causal: the first 8 rows see no key.
    q, k, v = make_qkv(2, 4, 2, 24, 16, 16, 8, dtype=torch.bfloat16)
    q = (q * 4).detach().requires_grad_()  # large logits too
    out, lse, dq, dk, dv = run(q, k, v, causal=True, precision=precision, delta_mode=delta_mode)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()
    blind = slice(0, 8)
    assert torch.all(lse[:, :, blind] == float("-inf")) and torch.isfinite(lse[:, :, 8:]).all()
    assert torch.equal(out[:, :, blind], torch.zeros_like(out[:, :, blind]))
    assert torch.equal(dq[:, :, blind], torch.zeros_like(dq[:, :, blind]))


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_nan_propagates_only_where_numerics_says(precision):
    # A NaN in key position j of batch 0, kv head 0 (causal, seqlen_q == seqlen_k):
    # it reaches exactly the rows i >= j of the query heads of that kv group
    # (numerics.md section 2: rows that do not see a position never read it).
    b, hq, hkv, s, d, j = 2, 4, 2, 16, 16, 9
    q, k, v = make_qkv(b, hq, hkv, s, s, d, requires_grad=False)
    k[0, 0, j, 3] = float("nan")
    out = fp8attn.attention(q, k, v, causal=True, precision=precision)
    nan_rows = torch.isnan(out).any(-1)  # [b, hq, s]
    want = torch.zeros(b, hq, s, dtype=torch.bool)
    want[0, :2, j:] = True  # query heads 0, 1 use kv head 0
    assert torch.equal(nan_rows, want)
    assert torch.isfinite(out[~want]).all()


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_nan_in_dout_propagates_only_where_numerics_says(precision):
    # A NaN in dO row i of query head h (causal, seqlen_q < seqlen_k, offset
    # sk - sq): dQ gets NaN in row i of head h only; dK/dV get NaN only in the
    # keys row i sees (j <= i + offset) of kv head h // group.
    b, hq, hkv, sq, sk, d, i, h = 2, 4, 2, 12, 16, 16, 5, 3
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d)
    dout = torch.randn(b, hq, sq, d)
    dout[1, h, i, 7] = float("nan")
    _, _, dq, dk, dv = run(q, k, v, dout, causal=True, precision=precision)
    want_q = torch.zeros(b, hq, sq, dtype=torch.bool)
    want_q[1, h, i] = True
    want_kv = torch.zeros(b, hkv, sk, dtype=torch.bool)
    want_kv[1, h // (hq // hkv), : i + (sk - sq) + 1] = True
    assert torch.equal(torch.isnan(dq).any(-1), want_q)
    assert torch.equal(torch.isnan(dk).any(-1), want_kv)
    assert torch.equal(torch.isnan(dv).any(-1), want_kv)
    assert torch.isfinite(dq[~want_q]).all() and torch.isfinite(dk[~want_kv]).all()


# ---- regressions found by adversarial use -----------------------------------

# Double backward: tests/python/test_double_backward.py (all entry points, both loss kinds).


def test_fp8_backward_large_finite_values_stay_finite():
    """Block-scale products are formed scale*scale first (exact powers of two), so a
    large but finite V (|V| ~ 1e36) does not overflow the partial-sum scaling."""
    q, k, v = [torch.randn(1, 1, 40, 32, requires_grad=True) for _ in range(3)]
    o = fp8attn.attention(q, k, v * 1e36)
    o.backward(torch.randn_like(o))
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(g).all(), name
    ref_q = q.detach().clone().requires_grad_()
    o_ref = F.scaled_dot_product_attention(ref_q, k.detach(), v.detach() * 1e36)
    assert torch.isfinite(o_ref).all()
    # Finite is not enough: O and the gradients are the FP8 recipe's, within the
    # error budget of the exact result (block scales absorb the 1e36: the relative
    # error is that of unit-sized inputs).
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) < 1.25 * fp8_budget("O"), rel_err(o, o_ref)
    dout = torch.randn(1, 1, 40, 32, generator=torch.Generator().manual_seed(3))
    fp8 = run(q, k, v * 1e36, dout)
    ex = run(q, k, v * 1e36, dout, precision="exact")
    assert rel_err(ex[0], o_ref) < 1e-5
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), fp8, ex):
        assert torch.isfinite(a).all(), name
        bound = 0.02 if name == "LSE" else 1.25 * fp8_budget(name)
        assert rel_err(a, b) < bound, (name, rel_err(a, b), bound)


def test_diagnostics_report_nan_rows_as_nan():
    """A NaN in K makes dS non-finite; the row-sum residual must say so (NaN), not 0."""
    q, k, v = [torch.randn(1, 1, 8, 16, requires_grad=True) for _ in range(3)]
    with torch.no_grad():
        k[0, 0, 3, 0] = float("nan")
    for precision in ("fp8", "exact"):
        with fp8attn.diagnostics.record() as rec:
            fp8attn.attention(q, k, v, precision=precision).sum().backward()
        r = rec.records[0]
        assert math.isnan(r["rowsum_pre_mean"]) and math.isnan(r["rowsum_post_max"]), (precision, r)


def test_rowsum_single_key_rows_report_zero():
    """Causal with seqlen_q == seqlen_k: row 0 sees one key, dS == 0 mathematically,
    and its residual is defined as 0 (numerics.md section 7) in every mode."""
    q, k, v, do = [torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(4)]
    o, lse = torch.ops.fp8attn.fwd(q, k, v, 32 ** -0.5, True, "fp8", 128)
    for mode in ("stale", "matched_do", "delta_matching"):
        diag = torch.ops.fp8attn.bwd(do, q, k, v, o, lse, 32 ** -0.5, True, "fp8", mode, 128, "e4m3", True)[3]
        assert (diag[2:, :, :, 0] == 0).all(), mode
        assert (diag[2, :, :, 1:] > 0).any() or mode == "delta_matching"


# ---- options checked alike by attention and varlen_attention ---------------------


def _both_entry_points():
    """(name, call(**options)) for attention and varlen_attention on the same
    input (varlen: one sequence of all 8 tokens)."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, requires_grad=False)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    return [("attention", lambda **kw: fp8attn.attention(q, k, v, **kw)),
            ("varlen_attention", lambda **kw: fp8attn.varlen_attention(*packed, cu, cu, **kw))]


BAD_OPTIONS = [
    # (exception, argument, options)
    (TypeError, "layer_name", dict(layer_name=5)),
    (TypeError, "layer_name", dict(layer_name=b"attn0")),
    (TypeError, "layer_name", dict(layer_name=("attn", 0))),
    (TypeError, "return_lse", dict(return_lse=1)),
    (TypeError, "return_lse", dict(return_lse="yes")),
    (TypeError, "return_lse", dict(return_lse=np.int64(1))),   # a NumPy bool is taken (test_bool_options.py)
    (ValueError, "block_size", dict(block_size=True)),
    (ValueError, "block_size", dict(block_size=np.True_)),
    (ValueError, "block_size", dict(block_size=32.0)),
    (ValueError, "block_size", dict(block_size=np.int64(48))),
    # float32(tau) finite, tau * log2(e) not: the kernels' FP32 product overflows
    (ValueError, "softmax_scale", dict(softmax_scale=3e38)),
    (ValueError, "softmax_scale", dict(softmax_scale=np.float32(3e38))),
    (ValueError, "softmax_scale", dict(softmax_scale=1e39)),        # finite in float64, inf in FP32
    # the FP32 number just above MAX_SOFTMAX_SCALE (2.3586574e38)
    (ValueError, "softmax_scale", dict(softmax_scale=np.nextafter(np.float32(2.3586574e38), np.float32(np.inf)))),
]


@pytest.mark.parametrize("entry", ["attention", "varlen_attention"])
@pytest.mark.parametrize("exc,arg,options", BAD_OPTIONS, ids=[f"{a}={o[a]!r}" for _, a, o in BAD_OPTIONS])
def test_bad_options_raise_naming_the_argument(entry, exc, arg, options):
    call = dict(_both_entry_points())[entry]
    with pytest.raises(exc, match=f"fp8attn.{entry}: argument '{arg}'"):
        call(**options)


@pytest.mark.parametrize("entry", ["attention", "varlen_attention"])
def test_good_edge_options_are_accepted(entry):
    """Integer types other than int for block_size (operator.index), the largest
    softmax_scale whose FP32 product with log2(e) is finite, layer_name str/None."""
    call = dict(_both_entry_points())[entry]
    want = call(block_size=32)
    for bs in (np.int64(32), np.int32(32), np.uint8(32), torch.tensor(32)):
        assert torch.equal(call(block_size=bs), want), type(bs)
    top = fp8attn.ops.MAX_SOFTMAX_SCALE   # the bound itself: finite product, the next FP32 up is not
    assert top == float(np.float32(2.3586574e38))
    assert math.isfinite(fp8attn.ops._scale_log2_fp32(top))
    assert not math.isfinite(fp8attn.ops._scale_log2_fp32(np.nextafter(np.float32(top), np.float32(np.inf))))
    call(softmax_scale=top)          # accepted (the output is not the point)
    call(layer_name="attn0", return_lse=True)
    call(layer_name=None, return_lse=False)
