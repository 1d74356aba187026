"""Fused FP8 projections on one input (fp8attn.linear.fp8_linear_fused; the trainer's
Wq, Wk, Wv in the "projections" scopes): the same quantized operands as three separate
fp8_linear calls, so y, dW_i and db_i equal theirs bit for bit (emulated, CPU) and dx
(one GEMM over all parts instead of three rounded results summed by autograd) within
FP32 rounding; every output and gradient within the FP8 bound of FP64; x and dy
quantized once and one GEMM per pass (the scaled_mm path, with a CPU stand-in for
cuBLASLt); torch.compile(fullgraph=True); the model's projections scope uses it with
its parameters and state_dict unchanged (docs/numerics.md section 8)."""
import math

import pytest
import torch
import torch.nn.functional as F

from fp8attn import linear as L
from fp8attn.linear import FP8Linear
from fp8attn.train.model import SCOPES, Attention, preset_model_config
from fp8attn.train.trainer import build_model, init_fingerprint

from test_linear import RHO, fake_scaled_mm, rel_fro

# (K, [N_q, N_k, N_v]): GQA shapes (gpu-1b's 2048 -> 2048 + 512 + 512 scaled down: 4 q and
# 1 kv heads of 64), MHA, and parts that are not multiples of 128 (emulated only).
SHAPES = [(256, [256, 64, 64]), (256, [256, 128, 128]), (384, [384, 384, 384]), (200, [96, 24, 24])]


def inputs(m, k, ns, bias, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + m + k)
    x = torch.randn(m, k, generator=g)
    ws = [torch.randn(n, k, generator=g) / math.sqrt(k) for n in ns]
    bs = [torch.randn(n, generator=g) for n in ns] if bias else [None] * len(ns)
    dys = [torch.randn(m, n, generator=g) for n in ns]
    cast = lambda t: None if t is None else t.to(dtype)
    return cast(x), [cast(w) for w in ws], [cast(b) for b in bs], [cast(d) for d in dys]


def run(fused, x, ws, bs, dys, backend="emulated", grad_format="e4m3", fn=None):
    """[y_0.., dx, dW_0.., db_0..] of the fused call or of separate fp8_linear calls."""
    xx = x.clone().requires_grad_()
    ww = [w.clone().requires_grad_() for w in ws]
    bb = [None if b is None else b.clone().requires_grad_() for b in bs]
    if fused:
        f = fn or (lambda x, w, b: L.fp8_linear_fused(x, w, b, grad_format=grad_format, backend=backend))
        ys = f(xx, ww, bb)
    else:
        ys = [L.fp8_linear(xx, w, b, grad_format=grad_format, backend=backend) for w, b in zip(ww, bb)]
    torch.autograd.backward(ys, dys)
    return ([y.detach() for y in ys] + [xx.grad] + [w.grad for w in ww]
            + [b.grad for b in bb if b is not None])


def split_names(n, bias):
    return ([f"y{i}" for i in range(n)] + ["dx"] + [f"dW{i}" for i in range(n)]
            + ([f"db{i}" for i in range(n)] if bias else []))


# ---- fused == separate ---------------------------------------------------------------


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,ns", SHAPES)
def test_fused_equals_separate_calls(k, ns, bias, grad_format):
    """y_i, dW_i, db_i bit for bit; dx (the only different rounding: the parts' products
    summed in one FP32 GEMM, not three FP32 GEMMs added afterwards) within 1e-6."""
    x, ws, bs, dys = inputs(200, k, ns, bias)
    a = run(True, x, ws, bs, dys, grad_format=grad_format)
    b = run(False, x, ws, bs, dys, grad_format=grad_format)
    for name, p, q in zip(split_names(len(ns), bias), a, b):
        assert p.shape == q.shape and p.dtype == q.dtype, name
        if name == "dx":
            assert rel_fro(p, q) < 1e-6, (name, rel_fro(p, q))
        else:
            assert torch.equal(p, q), name


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("k,ns", SHAPES[:2] + SHAPES[3:])
def test_fused_error_vs_fp64_within_fp8_bound(k, ns, grad_format):
    """Every y_i, dx (the sum of the three products) and dW_i within the FP8 bound of the
    FP64 products (test_linear.test_error_vs_fp64_within_fp8_bound's bound), and clearly
    rounded."""
    x, ws, bs, dys = inputs(256, k, ns, False)
    got = run(True, x, ws, bs, dys, grad_format=grad_format)
    xd, dyd = x.double(), torch.cat(dys, 1).double()
    wd = torch.cat(ws, 0).double()
    ref = list((xd @ wd.t()).split(ns, 1)) + [dyd @ wd] + list((dyd.t() @ xd).split(ns, 0))
    b_fwd = math.hypot(RHO["e4m3"], RHO["e4m3"])
    b_bwd = math.hypot(RHO[grad_format], RHO["e4m3"])
    for name, g, r in zip(split_names(len(ns), False), got, ref):
        bound = b_fwd if name.startswith("y") else b_bwd
        err = rel_fro(g, r)
        assert 0.1 * bound < err <= bound, (name, err, bound)


def test_bf16_autocast_dtypes_and_partial_requires_grad():
    """Under CPU autocast bf16: outputs bf16, dx in x's dtype (fp32), dW_i in W_i's; a weight
    without requires_grad gets no gradient and the others equal the separate calls'."""
    x, ws, bs, dys = inputs(130, 256, [256, 128, 128], True)
    ws[1].requires_grad_(False)
    out = {}
    for fused in (True, False):
        xx = x.clone().requires_grad_()
        ww = [w.clone().requires_grad_(i != 1) for i, w in enumerate(ws)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ys = (L.fp8_linear_fused(xx, ww, bs, backend="emulated") if fused
                  else [L.fp8_linear(xx, w, b, backend="emulated") for w, b in zip(ww, bs)])
        assert all(y.dtype == torch.bfloat16 for y in ys)
        torch.autograd.backward(ys, [d.bfloat16() for d in dys])
        assert xx.grad.dtype == torch.float32 and ww[1].grad is None
        out[fused] = [y.detach() for y in ys] + [ww[0].grad, ww[2].grad, xx.grad]
    for p, q in zip(out[True][:-1], out[False][:-1]):
        assert torch.equal(p, q)
    # dx: the separate path rounds each part's dx to BF16 (then sums), the fused one only the
    # sum: both within a BF16 rounding (2^-8) of the exact product of the same quantized
    # operands, 2.3e-3 apart (measured; the FP8 error itself is 3.8e-2)
    ex = sum(L.dequantize_1x128(*L.quantize_1x128(d.bfloat16())).double()
             @ L.dequantize_128x128(*L.quantize_128x128(w)).double() for d, w in zip(dys, ws))
    assert rel_fro(out[True][-1], ex) <= 2.0 ** -8 and rel_fro(out[False][-1], ex) <= 2.0 ** -8
    assert rel_fro(out[True][-1], out[False][-1]) < 1e-2


def test_no_weight_grad_and_zero_rows():
    x, ws, _, dys = inputs(64, 128, [128, 128], False)
    xx = x.clone().requires_grad_()
    ys = L.fp8_linear_fused(xx, ws, backend="emulated")     # weights need no grad: no x^T quantization
    torch.autograd.backward(ys, dys)
    ref = run(False, x, ws, [None, None], dys)
    assert torch.equal(ys[0], ref[0]) and rel_fro(xx.grad, ref[2]) < 1e-6
    ww = [w.clone().requires_grad_() for w in ws]
    ys = L.fp8_linear_fused(torch.zeros(0, 128), ww)
    assert [tuple(y.shape) for y in ys] == [(0, 128), (0, 128)]
    sum(y.sum() for y in ys).backward()
    assert all(torch.equal(w.grad, torch.zeros_like(w)) for w in ww)


def test_leading_dims_and_outputs_are_views_of_one_buffer():
    x, ws, _, _ = inputs(24, 128, [128, 256], False)
    ys = L.fp8_linear_fused(x.view(2, 3, 4, 128), ws)
    assert [tuple(y.shape) for y in ys] == [(2, 3, 4, 128), (2, 3, 4, 256)]
    assert ys[0].untyped_storage().data_ptr() == ys[1].untyped_storage().data_ptr()
    assert torch.equal(ys[1].reshape(24, 256), L.fp8_linear(x, ws[1]))


def test_errors_name_the_argument():
    x, ws, _, _ = inputs(8, 128, [128, 128], False)
    with pytest.raises(TypeError, match="'weights'"):
        L.fp8_linear_fused(x, [])
    with pytest.raises(TypeError, match="'weights'"):
        L.fp8_linear_fused(x, ws[0])
    with pytest.raises(ValueError, match=r"'weights\[1\]'.*in_features"):
        L.fp8_linear_fused(x, [ws[0], torch.randn(128, 64)])
    with pytest.raises(ValueError, match="'biases'"):
        L.fp8_linear_fused(x, ws, [None])
    with pytest.raises(ValueError, match=r"'biases\[0\]'"):
        L.fp8_linear_fused(x, ws, [torch.randn(3), None])
    with pytest.raises(TypeError, match=r"'weights\[1\]'"):
        L.fp8_linear_fused(x, [ws[0], ws[1].double()])
    with pytest.raises(ValueError, match="'x'"):
        L.fp8_linear_fused(torch.randn(8, 64), ws)
    with pytest.raises(ValueError, match="'grad_format'"):
        L.fp8_linear_fused(x, ws, grad_format="e3m4")
    with pytest.raises(ValueError, match="'backend'.*scaled_mm"):
        L.fp8_linear_fused(x, ws, backend="scaled_mm")   # CPU: scaled_mm cannot run


def test_double_backward_raises():
    x, ws, _, _ = inputs(8, 128, [128, 128], False)
    xx = x.clone().requires_grad_()
    ww = [w.clone().requires_grad_() for w in ws]
    ys = L.fp8_linear_fused(xx, ww)
    with pytest.raises(RuntimeError, match="fp8_linear_fused: double backward"):
        torch.autograd.grad(sum(y.square().sum() for y in ys), [xx], create_graph=True)


# ---- the scaled_mm path (cuBLASLt stand-in on CPU) ---------------------------------------


def count_calls(monkeypatch, names):
    calls = {n: 0 for n in names}
    for n in names:
        orig = getattr(L, n)

        def wrapped(*a, _o=orig, _n=n, **kw):
            calls[_n] += 1
            return _o(*a, **kw)
        monkeypatch.setattr(L, n, wrapped)
    return calls


def test_scaled_mm_path_quantizes_x_and_dy_once_and_runs_one_gemm_per_pass(monkeypatch):
    """The cuBLASLt path (F.scaled_mm replaced by the dequantized product; M = 300 padded to
    384, K / 128 = 5 scale columns padded to 8): equals the separate emulated calls up to
    FP32 summation order, with one dual quantization of x (forward) and of dy (backward) and
    three GEMMs in all, against three of each (nine GEMMs) for the separate FP8Linear calls."""
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(L, "_scaled_mm_blocker", lambda *a: None)
    x, ws, bs, dys = inputs(300, 640, [512, 128, 128], False)
    ref = run(False, x, ws, bs, dys, backend="emulated")
    names = ["_q_rows_cols", "_q_rows", "_q_cols", "_gemm_1x128_128x128", "_gemm_1x128_1x128"]
    calls = count_calls(monkeypatch, names)
    got = run(True, x, ws, bs, dys, backend="scaled_mm")
    # (on CPU _q_rows_cols is _q_rows and _q_cols: no single-direction quantization besides)
    assert calls == {"_q_rows_cols": 2, "_q_rows": 2, "_q_cols": 2, "_gemm_1x128_128x128": 2,
                     "_gemm_1x128_1x128": 1}
    for name, p, q in zip(split_names(3, False), got, ref):
        assert rel_fro(p, q) < 1e-6, name
    calls.update({n: 0 for n in names})
    run(False, x, ws, bs, dys, backend="scaled_mm")
    assert calls["_q_rows_cols"] == 6 and calls["_gemm_1x128_128x128"] + calls["_gemm_1x128_1x128"] == 9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_path_traces_fullgraph(dtype, bias):
    """As test_linear.test_scaled_mm_path_traces_fullgraph: the fused autograd.Function on the
    scaled_mm path (its GEMMs the custom op fp8attn::blockwise_scaled_mm, whose CPU kernel runs
    here) under torch.compile(fullgraph=True, backend="aot_eager") equals eager bit for bit."""
    torch._dynamo.reset()
    x, ws, bs, dys = inputs(200, 256, [256, 128, 128], bias, dtype)

    def f(x, ws, bs):
        y = L._FP8FusedLinearFn.apply(x, "e4m3", "scaled_mm", dtype, True, 3, bias, *ws,
                                      *(bs if bias else []))
        return y.split([256, 128, 128], dim=-1)

    eager = run(True, x, ws, bs, dys, fn=f)
    comp = run(True, x, ws, bs, dys, fn=torch.compile(f, fullgraph=True, backend="aot_eager"))
    assert all(torch.isfinite(t).all() and t.abs().max() > 0 for t in eager)
    assert all(torch.equal(a, c) for a, c in zip(eager, comp))
    emul = run(True, x, ws, bs, dys, backend="emulated")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, e in zip(eager, emul):
        assert rel_fro(a.float(), e.float()) < tol
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_grads_equal_eager(dtype):
    """fp8_linear_fused (argument checks, backend resolution, the split) under
    torch.compile(fullgraph=True): outputs and every gradient bit for bit eager's, none zero
    (test_linear.test_compiled_grads_equal_eager's guarded failure: a no-op alias output
    whose gradients came out zero under compile)."""
    torch._dynamo.reset()
    x, ws, bs, dys = inputs(4, 128, [128, 64, 64], True, dtype)
    f = lambda x, w, b: L.fp8_linear_fused(x, w, b)
    eager = run(True, x, ws, bs, dys, fn=f)
    comp = run(True, x, ws, bs, dys, fn=torch.compile(f, fullgraph=True, backend="aot_eager"))
    assert all(g.abs().max() > 0 for g in eager)
    assert all(torch.equal(a, c) for a, c in zip(eager, comp))
    torch._dynamo.reset()


# ---- the trainer's projections scopes --------------------------------------------------


def smoke(scope, fused=True, seed=5):
    m = build_model(preset_model_config("smoke", attn_mode="fp8-delta_matching", scope=scope), seed=seed)
    for mod in m.modules():
        if isinstance(mod, Attention):
            mod.fuse_fp8_qkv = fused
    return m


def test_projection_scopes_use_the_fused_qkv(monkeypatch):
    calls = []
    orig = L.fp8_linear_fused
    monkeypatch.setattr(L, "fp8_linear_fused", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    toks = torch.randint(1, 512, (2, 32))
    for scope in SCOPES:
        calls.clear()
        m = smoke(scope)
        m(toks)
        attn = [mod for mod in m.modules() if isinstance(mod, Attention)]
        assert len(calls) == (len(attn) if "projections" in scope else 0), scope
        assert all(a.fused_fp8_qkv() == ("projections" in scope) for a in attn)
    calls.clear()
    smoke(SCOPES[1], fused=False)(toks)
    assert not calls
    # a differently configured FP8Linear among the three: no fusion (separate layers)
    m = smoke(SCOPES[1])
    blk = m.blocks[0].attn
    blk.wk.grad_format = "e5m2"
    assert not blk.fused_fp8_qkv() and m.blocks[1].attn.fused_fp8_qkv()


@pytest.mark.parametrize("scope", SCOPES[1:])
def test_model_fused_equals_separate_and_state_dict_unchanged(scope, tmp_path):
    """Same logits bit for bit (the forward's products are the same), parameter gradients
    within FP32 rounding of the dx sums (rel 1e-5); the same parameters, state_dict keys and
    init fingerprint as the unfused model; a state_dict saved by the fused model loads into
    a fresh one (fused or not) and gives the same logits."""
    toks = torch.randint(1, 512, (2, 48))
    y = torch.randint(1, 512, (2, 48))
    res = {}
    for fused in (True, False):
        m = smoke(scope, fused)
        logits = m(toks)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        res[fused] = (m, logits.detach(), torch.cat([p.grad.flatten() for p in m.parameters()]))
    (mf, lf, gf), (mu, lu, gu) = res[True], res[False]
    assert torch.equal(lf, lu)
    assert 0 < rel_fro(gf, gu) < 1e-5
    assert list(mf.state_dict()) == list(mu.state_dict())
    assert [n for n, _ in mf.named_parameters()] == [n for n, _ in mu.named_parameters()]
    assert init_fingerprint(smoke(scope)) == init_fingerprint(smoke(scope, False))
    assert all(isinstance(getattr(mf.blocks[0].attn, w), FP8Linear) for w in ("wq", "wk", "wv"))
    torch.save(mf.state_dict(), tmp_path / "sd.pt")
    for fused in (True, False):
        fresh = smoke(scope, fused, seed=11)
        assert not torch.equal(fresh(toks), lf)
        fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
        assert torch.equal(fresh(toks).detach(), lf)
        assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), mf.state_dict().values()))


def test_attention_qkv_compiles_fullgraph():
    """Attention.qkv (the lazy import, the fusion check, the fused call) under
    torch.compile(fullgraph=True, backend="aot_eager"): q, k, v and Wq, Wk, Wv's and x's
    gradients bit for bit eager's."""
    torch._dynamo.reset()
    attn = smoke(SCOPES[1]).blocks[0].attn
    x = torch.randn(2, 16, attn.cfg.d_model)
    res = []
    for f in (attn.qkv, torch.compile(attn.qkv, fullgraph=True, backend="aot_eager")):
        attn.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        q, k, v = f(xx)
        (q.square().sum() + k.sum() + (v * 3).sum()).backward()
        res.append([q.detach(), k.detach(), v.detach(), xx.grad, attn.wq.weight.grad, attn.wk.weight.grad,
                    attn.wv.weight.grad])
    assert all(torch.equal(a, c) for a, c in zip(*res))
    torch._dynamo.reset()


# ---- CUDA: cuBLASLt block-scaled GEMMs (sm_90) ---------------------------------------------

cuda_sm90 = pytest.mark.skipif(not L.scaled_mm_available(),
                               reason="needs an sm_90 GPU and torch with CUDA >= 12.9")


@cuda_sm90
@pytest.mark.parametrize("k,ns", [(768, [768, 256, 256]), (640, [512, 128, 128])])
@pytest.mark.parametrize("m", [512, 300])
def test_cuda_fused_matches_separate_and_emulation(k, ns, m):
    """The fused cuBLASLt path (x and dy quantized by the fused Triton kernels once) against the
    separate FP8Linear calls on cuBLASLt and against the FP32 emulation: the bounds of
    test_linear.test_cuda_scaled_mm_matches_emulation (relative Frobenius < 2e-3, >= 20x below
    the FP8 error), for every y_i, dx and dW_i; under torch.compile(fullgraph=True) bit for bit
    eager's."""
    x, ws, bs, dys = inputs(m, k, ns, True)
    x, dys = x.cuda(), [d.cuda() for d in dys]
    ws, bs = [w.cuda() for w in ws], [b.cuda() for b in bs]
    fused = run(True, x, ws, bs, dys, backend="scaled_mm")
    for other in (run(False, x, ws, bs, dys, backend="scaled_mm"), run(True, x, ws, bs, dys, backend="emulated")):
        for name, a, e in zip(split_names(len(ns), True), fused, other):
            assert torch.isfinite(a).all(), name
            assert rel_fro(a, e) < 2e-3, (name, rel_fro(a, e))
    torch._dynamo.reset()
    f = lambda x, w, b: L.fp8_linear_fused(x, w, b, backend="scaled_mm")
    comp = run(True, x, ws, bs, dys, fn=torch.compile(f, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(a, c) for a, c in zip(fused, comp))
    torch._dynamo.reset()


@cuda_sm90
def test_cuda_bf16_autocast_fused_equals_separate_layers():
    """As the trainer's projections scope runs on CUDA (BF16 autocast, FP32 master weights, three
    FP8Linear layers on scaled_mm: d_model 256, 2 q / 1 kv heads of 128): the fused call's
    outputs and dW_i finite and within 2e-3 of the separate layers', dx within 2^-7 (the separate
    path rounds each part's dx to BF16: 2.3e-3 apart on the CPU, test_bf16_autocast_...)."""
    lins = [FP8Linear(256, n, bias=False, backend="scaled_mm").cuda() for n in (256, 128, 128)]
    x = torch.randn(4, 256, 256, device="cuda")
    out = []
    for fused in (True, False):
        xx = x.clone().requires_grad_()
        for m in lins:
            m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ys = (L.fp8_linear_fused(xx, [m.weight for m in lins], backend="scaled_mm") if fused
                  else [m(xx) for m in lins])
        sum(y.float().square().sum() for y in ys).backward()
        out.append([y.detach().float() for y in ys] + [xx.grad] + [m.weight.grad for m in lins])
    for i, (a, e) in enumerate(zip(*out)):
        assert torch.isfinite(a).all() and rel_fro(a, e) < (2.0 ** -7 if i == 3 else 2e-3), (i, rel_fro(a, e))
