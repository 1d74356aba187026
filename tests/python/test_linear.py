"""FP8 linear layers (fp8attn.linear): quantizers vs the reference op, the emulated
GEMMs vs independently built operands, FP8 error bounds vs FP64, the module and
converter; CUDA: cuBLASLt block-scaled scaled_mm vs the emulation (skip without
an sm_90 GPU)."""
import math

import pytest
import torch
import torch.nn as nn

import fp8attn
from fp8attn import linear as L

# rms relative rounding error of one FP8 operand (3 / 2 mantissa bits), as in
# tests/cpp/test_reference_fp8.cpp: rho = 2^-(m+1) / sqrt(3).
RHO = {"e4m3": 2.0 ** -4 / math.sqrt(3), "e5m2": 2.0 ** -3 / math.sqrt(3)}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DT = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def rel_fro(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def varied(rows, cols, seed=0):
    """Random data whose magnitude changes by 2^-20..2^20 between rows and blocks,
    with an all-zero block and a tiny (FP8-subnormal range) block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.exp2(torch.randint(-20, 21, (rows, 1), generator=g).float())
    x[:, : min(cols, 128)] *= 2.0 ** 12
    if rows > 2 and cols > 130:
        x[1, 128:256] = 0.0
        x[2, 128:256] *= 2.0 ** -130
    return x


# ---- quantizers ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("cols", [128, 300, 64])
def test_quantize_1x128_matches_reference_op(fmt, cols):
    x = varied(37, cols, seed=cols)
    codes, s = L.quantize_1x128(x, fmt)
    ref_codes, ref_s = fp8attn.quantize_blockwise(x, dim=-1, block_size=128, fmt=fmt)
    assert codes.dtype == DT[fmt] and s.dtype == torch.float32
    assert torch.equal(codes.view(torch.uint8), ref_codes)
    assert torch.equal(s, ref_s)
    # bf16 input: the same as its exact float32 upcast
    xb = x.bfloat16()
    c2, s2 = L.quantize_1x128(xb, fmt)
    r2, rs2 = fp8attn.quantize_blockwise(xb.float(), dim=-1, block_size=128, fmt=fmt)
    assert torch.equal(c2.view(torch.uint8), r2) and torch.equal(s2, rs2)
    # decode is exact: dequantize == reference dequantize
    assert torch.equal(L.dequantize_1x128(codes, s),
                       fp8attn.dequantize_blockwise(ref_codes, ref_s, dim=-1, block_size=128, fmt=fmt))


def test_quantize_nonfinite_block_is_nan_only_there():
    x = torch.randn(3, 256)
    x[0, 5] = float("nan")
    x[0, 9] = -float("nan")
    x[2, 200] = float("inf")
    codes, s = L.quantize_1x128(x)
    assert math.isnan(s[0, 0]) and math.isnan(s[2, 1])
    assert torch.isfinite(s[0, 1]) and torch.isfinite(s[1]).all() and torch.isfinite(s[2, 0])
    d = L.dequantize_1x128(codes, s)
    assert torch.isnan(d[0, :128]).all() and torch.isnan(d[2, 128:]).all()
    assert torch.isfinite(d[1]).all() and torch.isfinite(d[0, 128:]).all() and torch.isfinite(d[2, :128]).all()
    # every code of a NaN block is the one canonical code 0x7F (same on every device and
    # in the fused CUDA kernels); x / NaN alone would give 0xFF for the -NaN element here
    u = codes.view(torch.uint8)
    assert (u[0, :128] == 0x7F).all() and (u[2, 128:] == 0x7F).all()
    assert int((x[0, 9] / s[0, 0]).to(torch.float8_e4m3fn).view(torch.uint8)) == 0xFF
    for fmt in ("e4m3", "e5m2"):
        wc, ws = L.quantize_128x128(x, fmt)
        assert math.isnan(ws[0, 0]) and math.isnan(ws[0, 1])
        assert (wc.view(torch.uint8) == 0x7F).all()


def slow_tile_quant(w, fmt):
    """Independent 128x128 tile quantizer: scale by exact search in Python floats,
    codes through the reference codec (fp8attn.fp8_encode)."""
    r, c = w.shape
    codes = torch.empty(r, c, dtype=torch.uint8)
    scales = torch.empty(-(-r // 128), -(-c // 128))
    for i in range(0, r, 128):
        for j in range(0, c, 128):
            t = w[i:i + 128, j:j + 128]
            amax = float(t.abs().max())
            if amax == 0:
                e = 0
            else:
                e = -126
                while amax / 2.0 ** e > FMAX[fmt]:
                    e += 1
            s = 2.0 ** e
            scales[i // 128, j // 128] = s
            codes[i:i + 128, j:j + 128] = fp8attn.fp8_encode(t / s, fmt)
    return codes, scales


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 136)])
def test_quantize_128x128_matches_slow_tiles(fmt, shape):
    w = varied(*shape, seed=7)
    codes, s = L.quantize_128x128(w, fmt)
    rc, rs = slow_tile_quant(w, fmt)
    assert torch.equal(s, rs)
    assert torch.equal(codes.view(torch.uint8), rc)
    assert torch.equal(L.dequantize_128x128(codes, s), fp8attn.fp8_decode(rc, fmt) *
                       rs.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]])


# ---- the emulated GEMMs use the documented operands ------------------------------


def ref_deq(t, dim, fmt):
    c, s = fp8attn.quantize_blockwise(t, dim=dim, block_size=128, fmt=fmt)
    return fp8attn.dequantize_blockwise(c, s, dim=dim, block_size=128, fmt=fmt)


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_emulated_gemms_use_operands_blocked_along_each_reduction_dim(grad_format):
    """forward: x along K, W tiles; dgrad: dy along N, same W tiles; wgrad: dy and x
    along tokens. Built here with the reference op (blocking along any dim) and the
    slow tile quantizer; results must be bit-identical."""
    torch.manual_seed(0)
    m, k, n = 200, 320, 264
    # per-token magnitudes spread over 2^-14..2^14 (wider than either format's
    # range), so blocks along tokens and along features round differently
    x = (torch.randn(m, k) * torch.exp2(torch.randint(-14, 15, (m, 1)).float())).requires_grad_()
    lin = L.FP8Linear(k, n, bias=True, grad_format=grad_format, backend="emulated")
    dy = torch.randn(m, n) * torch.exp2(torch.randint(-14, 15, (m, 1)).float())
    y = lin(x)
    y.backward(dy)
    wc, ws = slow_tile_quant(lin.weight.detach(), "e4m3")
    wd = fp8attn.fp8_decode(wc, "e4m3") * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    y_ref = ref_deq(x.detach(), 1, "e4m3") @ wd.t() + lin.bias.detach()
    dx_ref = ref_deq(dy, 1, grad_format) @ wd
    dw_ref = ref_deq(dy, 0, grad_format).t() @ ref_deq(x.detach(), 0, "e4m3")
    assert torch.equal(y, y_ref)
    assert torch.equal(x.grad, dx_ref)
    assert torch.equal(lin.weight.grad, dw_ref)
    assert torch.allclose(lin.bias.grad, dy.sum(0), rtol=1e-6, atol=1e-5)
    # and the blocking dim matters: wgrad with dy blocked along N instead differs
    wrong = ref_deq(dy, 1, grad_format).t() @ ref_deq(x.detach(), 0, "e4m3")
    assert not torch.equal(lin.weight.grad, wrong)


# ---- FP8 error bound vs FP64 -----------------------------------------------------


@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mkn", [(256, 512, 384), (130, 200, 72)])
def test_error_vs_fp64_within_fp8_bound(grad_format, mkn):
    """Relative Frobenius error of y, dx, dW vs FP64 <= sqrt(rho_a^2 + rho_b^2) of the
    two operand formats (independent per-element rounding, errors in quadrature),
    and well above 0 (the operands really were rounded to FP8)."""
    m, k, n = mkn
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g, requires_grad=True)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).requires_grad_()
    b = torch.randn(n, generator=g).requires_grad_()
    dy = torch.randn(m, n, generator=g)
    y = L.fp8_linear(x, w, b, grad_format=grad_format, backend="emulated")
    y.backward(dy)
    xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
    y64 = xd @ wd.t()            # bias excluded: it is exact and would hide the GEMM error
    errs = {
        "y": (rel_fro(y.detach() - b.detach(), y64), math.hypot(RHO["e4m3"], RHO["e4m3"])),
        "dx": (rel_fro(x.grad, dyd @ wd), math.hypot(RHO[grad_format], RHO["e4m3"])),
        "dw": (rel_fro(w.grad, dyd.t() @ xd), math.hypot(RHO[grad_format], RHO["e4m3"])),
    }
    for name, (err, bound) in errs.items():
        assert 0.1 * bound < err <= bound, (name, err, bound)


def test_block_scaling_bound_holds_with_outlier_tokens_where_per_tensor_fails():
    """Tokens whose magnitude differs by 2^16: 1x128 blocks keep the bound; one
    per-tensor scale (what block scaling guards against) breaks it."""
    g = torch.Generator().manual_seed(3)
    m, k, n = 256, 256, 128
    x = torch.randn(m, k, generator=g)
    x[::16] *= 2.0 ** 16
    w = torch.randn(n, k, generator=g)
    y64 = x.double() @ w.double().t()
    bound = math.hypot(RHO["e4m3"], RHO["e4m3"])
    y = L.fp8_linear(x, w, backend="emulated")
    small = torch.ones(m, dtype=torch.bool)
    small[::16] = False
    assert rel_fro(y[small], y64[small]) <= bound
    # per-tensor: one scale for all of x
    amax = float(x.abs().max())
    e = -126
    while amax / 2.0 ** e > 448.0:
        e += 1
    xt = (x / 2.0 ** e).to(torch.float8_e4m3fn).float() * 2.0 ** e
    yt = xt @ L.dequantize_128x128(*L.quantize_128x128(w)).t()
    assert rel_fro(yt[small], y64[small]) > 3 * bound


def test_nan_in_one_token_stays_in_that_token():
    x = torch.randn(8, 256)
    x[3, 10] = float("nan")
    y = L.fp8_linear(x, torch.randn(64, 256), backend="emulated")
    assert torch.isnan(y[3]).all()
    assert torch.isfinite(y[torch.arange(8) != 3]).all()


# ---- module, converter, errors ---------------------------------------------------


def test_fp8linear_is_a_drop_in_linear():
    torch.manual_seed(1)
    ref = nn.Linear(96, 40)
    fp8 = L.FP8Linear.from_linear(ref, backend="emulated")
    assert fp8.weight is ref.weight and fp8.bias is ref.bias
    assert list(fp8.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 5, 96)
    y = fp8(x)
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    y_exact = ref(x)
    assert 0 < rel_fro(y.detach(), y_exact.detach()) <= 2 * RHO["e4m3"]
    y.sum().backward()
    assert ref.weight.grad is not None and ref.bias.grad.shape == (40,)
    # no bias
    nb = L.FP8Linear(96, 40, bias=False)
    assert nb.bias is None and nb(x).shape == (2, 5, 40)
    # empty batch
    assert L.FP8Linear(96, 40)(torch.randn(0, 96)).shape == (0, 40)


def test_cpu_autocast_output_dtype_and_grad_dtypes():
    lin = L.FP8Linear(256, 128)
    x = torch.randn(4, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    ref = nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    assert rel_fro(y.detach().float(), ref) <= 2 * RHO["e4m3"]


def test_autocast_saves_activation_in_autocast_dtype():
    # Memory: like nn.Linear under autocast, the activation kept for wgrad is BF16,
    # not the FP32 input (the FP32 master weight is the parameter itself, not a copy).
    lin = L.FP8Linear(256, 128)
    x = torch.randn(8, 256, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x)
    acts = [dt for shape, dt in saved if shape == (8, 256)]
    assert acts and all(dt == torch.bfloat16 for dt in acts), saved
    # without autocast the input keeps its own dtype
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lin(x)
    assert [dt for shape, dt in saved if shape == (8, 256)] == [torch.float32]


def test_convert_by_name_filter():
    model = nn.Sequential()
    model.add_module("attn", nn.ModuleDict({"wq": nn.Linear(8, 8), "wo": nn.Linear(8, 8)}))
    model.add_module("mlp", nn.ModuleDict({"w1": nn.Linear(8, 16), "w2": nn.Linear(16, 8)}))
    w_before = model.attn.wq.weight
    done = L.convert_to_fp8_linear(model, "attn.*", exclude="attn.wo", backend="emulated")
    assert done == ["attn.wq"]
    assert isinstance(model.attn.wq, L.FP8Linear) and model.attn.wq.weight is w_before
    assert type(model.attn.wo) is nn.Linear and type(model.mlp.w1) is nn.Linear
    done = L.convert_to_fp8_linear(model, lambda n: n.startswith("mlp."), grad_format="e5m2")
    assert done == ["mlp.w1", "mlp.w2"] and model.mlp.w2.grad_format == "e5m2"
    assert L.convert_to_fp8_linear(model, "*") == ["attn.wo"]   # already converted ones are skipped


def test_errors_name_the_argument():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="'grad_format'"):
        L.fp8_linear(x, w, grad_format="e3m4")
    with pytest.raises(ValueError, match="'backend'"):
        L.fp8_linear(x, w, backend="cublas")
    with pytest.raises(ValueError, match="'x'"):
        L.fp8_linear(torch.randn(4, 15), w)
    with pytest.raises(ValueError, match="'bias'"):
        L.fp8_linear(x, w, torch.randn(7))
    with pytest.raises(ValueError, match="'backend'.*scaled_mm"):
        L.fp8_linear(x, w, backend="scaled_mm")        # CPU tensors
    with pytest.raises(ValueError, match="'grad_format'"):
        L.FP8Linear(16, 8, grad_format="bf16")
    with pytest.raises(ValueError, match="'x'"):
        L.quantize_1x128(torch.randn(2, 3, 4))


# ---- the scaled_mm call layout, checked on CPU with a stand-in for cuBLASLt ---------


def fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16):
    """Checks what torch's _scaled_mm_v2 + cuBLASLt demand for the DeepSeek recipes
    (A row-major, B column-major, E4M3, K % 128 == 0; scale shapes and strides as
    in torch/_meta_registrations.py), then computes A B by reading the scales in
    that documented layout (so a transposed or misplaced scale gives wrong numbers)."""
    ST = torch.nn.functional.ScalingType
    m, k = a.shape
    n = b.shape[1]
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert a.stride(1) == 1 and a.stride(0) >= k, ("A must be row-major", a.stride())
    assert b.stride(0) == 1 and b.stride(1) >= k, ("B must be column-major", b.stride())
    assert k % 128 == 0 and m % 16 == 0 and n % 16 == 0
    kb, l4 = k // 128, -(-(k // 128) // 4) * 4
    assert recipe_a == ST.BlockWise1x128
    assert scale_a.shape == (m, kb) and scale_a.stride(0) == 1 and (kb == 1 or scale_a.stride(1) == m)
    ad = a.float() * scale_a.repeat_interleave(128, 1)
    if recipe_b == ST.BlockWise128x128:
        assert n % 128 == 0
        assert scale_b.shape == (l4, n // 128) and scale_b.stride(0) == 1
        assert n // 128 == 1 or scale_b.stride(1) == l4
        bd = b.float() * scale_b[:kb].repeat_interleave(128, 0).repeat_interleave(128, 1)
    else:
        assert recipe_b == ST.BlockWise1x128
        assert scale_b.shape == (n, kb) and scale_b.stride(0) == 1 and (kb == 1 or scale_b.stride(1) == n)
        bd = b.float() * scale_b.t().repeat_interleave(128, 0)
    return (ad @ bd).to(output_dtype)


def test_scaled_mm_call_layout_with_a_stand_in(monkeypatch):
    """The scaled_mm backend's three GEMM calls (incl. token padding to 128, L4
    padding of 128x128 scales, and non-contiguous x / dy) meet the cuBLASLt
    layout rules and give the emulation's numbers."""
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(L, "_scaled_mm_blocker", lambda *a: None)
    g = torch.Generator().manual_seed(9)
    m, k, n = 300, 640, 1152                              # K/128 = 5 -> L4 = 8; M padded to 384
    x_base = torch.randn(k, m, generator=g)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    dy_base = torch.randn(n, m, generator=g)
    out = {}
    for be in ("scaled_mm", "emulated"):
        x = x_base.clone().requires_grad_()
        xt = x.t()                                      # non-contiguous [m, k] input
        ww = w.clone().requires_grad_()
        y = L.fp8_linear(xt, ww, backend=be)
        y.backward(dy_base.t())                         # non-contiguous dy
        out[be] = (y.detach(), x.grad, ww.grad)
    for name, a, e in zip(("y", "dx", "dW"), out["scaled_mm"], out["emulated"]):
        assert rel_fro(a, e) < 1e-6, name


def _eager_and_compiled(lin, x, dy):
    """[y, dx, dW(, db)] of `lin` on x with upstream dy: eager, then under
    torch.compile(fullgraph=True, backend="aot_eager")."""
    grads = []
    for f in (lin, torch.compile(lin, fullgraph=True, backend="aot_eager")):
        xx = x.clone().requires_grad_()
        lin.zero_grad(set_to_none=True)
        y = f(xx)
        y.backward(dy)
        grads.append([y.detach(), xx.grad] + [p.grad for p in lin.parameters()])
    return grads


# ---- CUDA: cuBLASLt block-scaled GEMMs vs the emulation ----------------------------

cuda_sm90 = pytest.mark.skipif(not L.scaled_mm_available(),
                               reason="needs an sm_90 GPU and torch with CUDA >= 12.9")


@cuda_sm90
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cuda_quantizers_match_cpu(fmt):
    x = varied(300, 640, seed=11)
    c1, s1 = L.quantize_1x128(x, fmt)
    c2, s2 = L.quantize_1x128(x.cuda(), fmt)
    assert torch.equal(c1.view(torch.uint8), c2.cpu().view(torch.uint8)) and torch.equal(s1, s2.cpu())
    c1, s1 = L.quantize_128x128(x, fmt)
    c2, s2 = L.quantize_128x128(x.cuda(), fmt)
    assert torch.equal(c1.view(torch.uint8), c2.cpu().view(torch.uint8)) and torch.equal(s1, s2.cpu())


@cuda_sm90
@pytest.mark.parametrize("mkn", [(512, 768, 384), (300, 640, 1152), (1000, 1792, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_cuda_scaled_mm_matches_emulation(mkn, bias):
    """Same quantized operands -> the cuBLASLt GEMMs equal the FP32 emulation up to
    accumulation (order and the tensor cores' FP8 accumulator width inside a
    128-block): |diff| <= 2^-8 * (|a| |b|) elementwise and relative Frobenius
    < 2e-3, i.e. >= 20x below the FP8 rounding error itself (~0.037), for y, dx, dW."""
    m, k, n = mkn
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).cuda()
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).cuda()
    b = torch.randn(n, generator=g).cuda() if bias else None
    dy = torch.randn(m, n, generator=g).cuda()
    out = {}
    for be in ("scaled_mm", "emulated"):
        xx = x.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        bb = None if b is None else b.clone().requires_grad_()
        y = L.fp8_linear(xx, ww, bb, backend=be)
        y.backward(dy)
        out[be] = (y.detach(), xx.grad, ww.grad, None if bb is None else bb.grad)
    xd = L.dequantize_1x128(*L.quantize_1x128(x)).abs()
    wd = L.dequantize_128x128(*L.quantize_128x128(w)).abs()
    g1 = L.dequantize_1x128(*L.quantize_1x128(dy)).abs()
    mags = {"y": xd @ wd.t(), "dx": g1 @ wd, "dw": g1.t() @ xd}
    for i, name in enumerate(("y", "dx", "dw")):
        a, e = out["scaled_mm"][i], out["emulated"][i]
        assert torch.isfinite(a).all(), name
        assert ((a - e).abs() <= 2.0 ** -8 * mags[name] + 1e-6).all(), (name, float((a - e).abs().max()))
        assert rel_fro(a, e) < 2e-3, name
    if bias:
        assert torch.allclose(out["scaled_mm"][3], out["emulated"][3])


@cuda_sm90
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_compiled_grads_equal_eager(dtype):
    """test_compiled_grads_equal_eager on the cuBLASLt path (backend="scaled_mm"): under
    torch.compile(fullgraph=True) y, dx, dW and db equal eager's bit for bit and are
    nonzero (the float32 no-op-alias zero-gradient bug of 2026-12-03, ops.as_dtype)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = L.FP8Linear(256, 128, bias=True, backend="scaled_mm").to(dtype).cuda()
    x = torch.randn(256, 256, dtype=dtype, device="cuda")
    dy = torch.randn(256, 128, dtype=dtype, device="cuda")
    eager, comp = _eager_and_compiled(lin, x, dy)
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in eager[1:])
    assert all(torch.equal(a, b) for a, b in zip(eager, comp))
    torch._dynamo.reset()


@cuda_sm90
def test_cuda_autocast_bf16_training_step():
    torch.manual_seed(0)
    lin = L.FP8Linear(512, 256).cuda()
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert x.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
    assert torch.isfinite(x.grad).all() and torch.isfinite(lin.weight.grad).all()
    ref = nn.functional.linear(x.detach().float(), lin.weight.detach(), lin.bias.detach())
    assert rel_fro(y.detach().float(), ref) <= 2 * RHO["e4m3"]


@cuda_sm90
def test_cuda_auto_falls_back_with_a_warning_and_scaled_mm_refuses():
    L._WARNED.clear()          # the warning is given once per reason per process
    x = torch.randn(64, 100, device="cuda")
    w = torch.randn(128, 100, device="cuda")
    with pytest.warns(UserWarning, match="multiples of 128"):
        L.fp8_linear(x, w)
    with pytest.raises(ValueError, match="multiples of 128"):
        L.fp8_linear(x, w, backend="scaled_mm")
    with pytest.raises(ValueError, match="E4M3"):
        L.fp8_linear(torch.randn(128, 128, device="cuda"), torch.randn(128, 128, device="cuda"),
                     grad_format="e5m2", backend="scaled_mm")


# ---- CUDA: fused (Triton) quantizers vs the torch-op quantizers, bit for bit --------

cuda_triton = pytest.mark.skipif(not (torch.cuda.is_available() and L._TQ.available()),
                                 reason="needs a CUDA GPU and triton")


def special(rows, cols, seed):
    """varied() plus the cases a fused quantizer can get wrong: FP32 subnormals (a whole
    block, and mixed into a normal block), FP32-max-sized values, -0.0, NaN, -NaN,
    +-inf, a partial last block; all in distinct rows so each block has one case."""
    x = varied(rows, cols, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x[0] = torch.randn(cols, generator=g) * 2.0 ** -128            # all-subnormal blocks
    x[3] = torch.randn(cols, generator=g) * 2.0 ** 120              # huge (amax near 2^127)
    x[3, 0] = 3.0e38
    x[4, ::3] = torch.randn(len(range(0, cols, 3)), generator=g) * 2.0 ** -135
    x[5, 1] = -0.0
    x[5, 2:4] = 0.0
    x[6, 3] = float("nan")
    x[7, 1] = -float("nan")
    x[8, -1] = float("inf")                                        # in the partial block
    x[9, 0] = -float("inf")
    x[10] = 0.0                                                     # all-zero row
    x[11] = torch.randn(cols, generator=g) * 1e-4                   # E4M3 subnormal codes
    x[12] = torch.randn(cols, generator=g) * 1e-9                   # E5M2 subnormal codes
    x[11:13, ::128] = 1.0
    return x


def _u8(t):
    return t.view(torch.uint8)


def _same(a, b):
    """Bit-identical codes (uint8) and scales (FP32 bit patterns)."""
    return (torch.equal(_u8(a[0]).cpu(), _u8(b[0]).cpu())
            and torch.equal(a[1].cpu().view(torch.int32), b[1].cpu().view(torch.int32)))


def _sm90_ptx(fn, sig, consts):
    """PTX of a triton kernel compiled ahead of time for sm_90 (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    return k.asm["ptx"]


def _inexact_ops(ptx):
    """Instructions that would break bit-exactness: flush-to-zero, division (IEEE or
    approximate), approximate math; and the RNE saturating FP8 cast must be there."""
    bad = sorted({w for w in ("ftz", "div.", "approx") if w in ptx})
    return bad + ([] if "cvt.rn.satfinite.e" in ptx else ["no cvt.rn.satfinite"])


@pytest.mark.skipif(not L._TQ._HAVE_TRITON, reason="needs triton")
def test_fused_quantizer_ptx_is_exact():
    """Runs without a GPU: the fused kernels compile for sm_90 and use only exact
    operations (integer amax, multiply by an exact power of two, one RNE cast):
    no .ftz (would flush subnormal inputs), no division, no approximate math."""
    import triton
    import triton.language as tl
    TQ = L._TQ
    q1 = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "R": "i32", "C": "i32", "R_out": "i32",
          "C_out": "i32", "sx_r": "i32", "sx_c": "constexpr", "sq_r": "i32", "ss_r": "i32", "ss_b": "i32",
          "P": "constexpr", "FP8": "constexpr", "BLOCK_R": "constexpr"}
    dual = {"x_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*fp32", "qt_ptr": "*u8", "st_ptr": "*fp32", "R": "i32",
            "C": "i32", "R_out": "i32", "sx_r": "i32", "sx_c": "constexpr", "ss_r": "i32", "ss_b": "i32",
            "sst_c": "i32", "sst_b": "i32", "P": "constexpr", "FP8": "constexpr"}
    w = {"w_ptr": "*fp32", "q_ptr": "*u8", "s_ptr": "*fp32", "R": "i32", "C": "i32", "sw_r": "i32",
         "sw_c": "constexpr", "ss_r": "i32", "ss_c": "constexpr", "P": "constexpr", "FP8": "constexpr"}
    ptxs = [_sm90_ptx(TQ._q1x128_kernel, q1, {"sx_c": 1, "P": 9, "FP8": tl.float8e4nv, "BLOCK_R": 64}),
            _sm90_ptx(TQ._q1x128_dual_kernel, dual, {"sx_c": 1, "P": 16, "FP8": tl.float8e5}),
            _sm90_ptx(TQ._q128x128_kernel, w, {"sw_c": 1, "ss_c": 1, "P": 9, "FP8": tl.float8e4nv})]
    for ptx in ptxs:
        assert _inexact_ops(ptx) == [], _inexact_ops(ptx)
        assert "mul.f32" in ptx or "mul.rn.f32" in ptx
    assert "cvt.rn.satfinite.e5m2x2.f32" in ptxs[1] and "cvt.rn.satfinite.e4m3x2.f32" in ptxs[0]

    # the check sees what it guards against: a quantizer dividing by the scale and
    # using approximate math is flagged
    @triton.jit
    def divide(x_ptr, s_ptr, q_ptr):
        o = tl.arange(0, 128)
        y = tl.exp(tl.load(x_ptr + o)) / tl.load(s_ptr)
        tl.store(q_ptr + o, y.to(tl.float8e4nv).to(tl.uint8, bitcast=True))

    bad = _inexact_ops(_sm90_ptx(divide, {"x_ptr": "*fp32", "s_ptr": "*fp32", "q_ptr": "*u8"}, {}))
    assert "div." in bad and "approx" in bad, bad


@cuda_triton
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cuda_fused_quantizers_bit_identical(fmt):
    """The fused kernels give the torch path's codes and scales bit for bit (CUDA torch
    path and CPU torch path): 1x128 rows, 1x128 of the transpose (fused transpose,
    also of a non-contiguous view), row/column zero padding for cuBLASLt, both at once
    (dual), and 128x128 tiles; FP32 and BF16 inputs incl. partial blocks, zeros,
    subnormals, huge values, -0.0, NaN, -NaN and +-inf."""
    TQ = L._TQ
    # NOTE: few shapes and dtypes: each new specialization is one more triton compile.
    for (r, c), dts in [((300, 640), (torch.float32, torch.bfloat16)), ((37, 300), (torch.bfloat16,))]:
        x = special(r, c, seed=r + c)
        for xc in [x.cuda().to(dt) for dt in dts]:
            ref = L._quantize_1x128_torch(xc, fmt)
            got = TQ.quantize_1x128(xc, fmt)
            assert _same(got, ref), (r, c, xc.dtype, "rows")
            assert _same(got, L._quantize_1x128_torch(xc.cpu(), fmt)), (r, c, xc.dtype, "rows vs cpu")
            assert _same(L.quantize_1x128(xc, fmt), ref)        # the public entry uses the kernel
            # transpose (strided input: stride 1 along the block dim's neighbour)
            assert _same(TQ.quantize_1x128(xc.t(), fmt), L._quantize_1x128_torch(xc.t(), fmt)), (r, c, "t")
            # cuBLASLt padding: rows to a multiple of 128, for rows and for the transpose
            mp = r + (-r) % 128
            got = TQ.quantize_1x128(xc, fmt, rows_out=mp, outer_major=True)
            assert got[1].stride() == (1, mp)
            assert _same(got, L._quantize_1x128_torch(L._pad_rows(xc), fmt)), (r, c, "rows padded")
            got_t = TQ.quantize_1x128(xc.t(), fmt, cols_out=mp, outer_major=True)
            ref_t = L._quantize_1x128_torch(L._pad_rows(xc).t(), fmt)
            assert _same(got_t, ref_t), (r, c, "t padded")
            if c % 128 == 0:
                d = TQ.quantize_1x128_dual(xc, fmt, rows_out=mp)
                assert _same(d[:2], got) and _same(d[2:], ref_t), (r, c, "dual")
                xn = xc.t().contiguous().t()                     # column-major input
                d = TQ.quantize_1x128_dual(xn, fmt, rows_out=mp)
                assert _same(d[:2], got) and _same(d[2:], ref_t), (r, c, "dual col-major")
            got = TQ.quantize_128x128(xc, fmt)
            assert _same(got, L._quantize_128x128_torch(xc, fmt)), (r, c, "128x128")
            assert _same(got, L._quantize_128x128_torch(xc.cpu(), fmt)), (r, c, "128x128 vs cpu")
    # the inputs really exercise the special cases (else the test would be vacuous) ...
    x = special(300, 640, seed=940)
    codes, s = L._quantize_1x128_torch(x, fmt)
    assert torch.isnan(s).any() and (s == 1).any() and (s == 2.0 ** -126).any() and (s >= 2.0 ** 100).any()
    u = _u8(codes) & 0x7F
    assert ((u > 0) & (u < (8 if fmt == "e4m3" else 4))).any()    # FP8 subnormal codes
    assert (_u8(codes)[0] & 0x7F > 0).any()                      # from FP32 subnormal inputs
    assert (_u8(codes) == 0x80).any()                               # -0.0
    # ... and the comparison sees the faults it guards against: flushing subnormal
    # inputs to zero, or a float max that drops NaN
    ftz = torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x)
    assert not _same(L._quantize_1x128_torch(ftz, fmt), (codes, s))
    assert not _same(L._quantize_1x128_torch(x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), fmt), (codes, s))


@cuda_sm90
@pytest.mark.skipif(not L._TQ.available(), reason="needs triton")
def test_cuda_fp8linear_fused_equals_unfused_and_saves_fp8_xt(monkeypatch):
    """FP8Linear (scaled_mm) with the fused quantizers gives bit-identical y, dx, dW to
    the torch-op quantizers (same operands, same GEMM calls), and saves x^T as FP8
    codes (not the BF16 x) for wgrad; without a weight gradient it saves no x at all."""
    m, k, n = 300, 640, 384
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).cuda().bfloat16()
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).cuda()
    dy = torch.randn(m, n, generator=g).cuda().bfloat16()
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(L, "FUSED_QUANT", fused)
        xx = x.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = L.fp8_linear(xx, ww, backend="scaled_mm")
        y.backward(dy)
        out[fused] = (y.detach(), xx.grad, ww.grad)
        assert (k, 384) in [sh for sh, dt in saved if dt == torch.float8_e4m3fn], saved
        assert not [sh for sh, dt in saved if sh == (m, k)], saved
    for a, b, name in zip(out[True], out[False], ("y", "dx", "dW")):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b), name
    monkeypatch.setattr(L, "FUSED_QUANT", True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                  lambda t: t):
        xx = x.clone().requires_grad_()
        y = L.fp8_linear(xx, w, backend="scaled_mm")             # frozen weight
    y.backward(dy)
    assert not [sh for sh, dt in saved if k in sh and sh != (n, k) and sh != (k, n)], saved
    assert torch.equal(xx.grad, out[True][1])


def test_convert_warns_about_linear_subclasses_it_leaves_alone():
    # nn.MultiheadAttention's out_proj is an nn.Linear subclass whose weight the
    # parent reads directly: converting it would do nothing, skipping it silently
    # would mislead; it is skipped with a warning that names it.
    model = nn.ModuleDict({"mha": nn.MultiheadAttention(16, 2), "fc": nn.Linear(16, 16)})
    with pytest.warns(UserWarning, match="mha.out_proj"):
        done = L.convert_to_fp8_linear(model)
    assert done == ["fc"] and type(model["mha"].out_proj) is not L.FP8Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_grads_equal_eager(dtype, bias):
    """torch.compile(fullgraph=True) of FP8Linear: forward and every gradient bit for bit
    eager's. The guarded failure (a break test, 2026-12-03): with float32 in and out the
    autograd.Function returned y.to(float32), a no-op alias, and under compile (every
    backend) dx, dW and db came out all zero, silently (ops.as_dtype)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = L.FP8Linear(128, 64, bias=bias, backend="emulated").to(dtype)
    x = torch.randn(4, 128, dtype=dtype)
    dy = torch.randn(4, 64, dtype=dtype)
    eager, comp = _eager_and_compiled(lin, x, dy)
    assert all(g.abs().max() > 0 for g in eager[1:])
    assert all(torch.equal(a, b) for a, b in zip(eager, comp))
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scaled_mm_path_traces_fullgraph(dtype):
    """The scaled_mm backend's autograd.Function (quantizers, padding, the GEMMs, saved
    FP8 x^T) traces under torch.compile(fullgraph=True): its GEMMs are the custom op
    fp8attn::blockwise_scaled_mm, whose CPU kernel (the dequantized product) lets this run
    here. The guarded failure (the H200, 2026-12-03): F.scaled_mm called directly is
    torch._scaled_mm_v2, which dynamo refuses ("marked as skipped"), so a compiled model
    with FP8Linear graph-broke, and fullgraph=True raised. Also: equals the emulated
    backend up to FP32 summation order (same quantized operands)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 256, generator=g).to(dtype)
    w = (torch.randn(128, 256, generator=g) / 16).to(dtype)
    b = torch.randn(128, generator=g).to(dtype)
    dy = torch.randn(200, 128, generator=g).to(dtype)

    def f(x, w, b):
        return L._FP8LinearFn.apply(x, w, b, "e4m3", "scaled_mm", dtype, True)

    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xx, ww, bb)
        y.backward(dy)
        res.append([y.detach(), xx.grad, ww.grad, bb.grad])
    assert all(torch.isfinite(t).all() and t.abs().max() > 0 for t in res[0])
    assert all(torch.equal(a, c) for a, c in zip(*res))
    xx, ww, bb = (t.clone().requires_grad_() for t in (x, w, b))
    ye = L.fp8_linear(xx, ww, bb, backend="emulated")
    ye.backward(dy)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, e in zip(res[0], [ye.detach(), xx.grad, ww.grad, bb.grad]):
        assert rel_fro(a.float(), e.float()) < tol
    torch._dynamo.reset()


def test_convert_converts_every_use_of_a_shared_linear():
    """A module used twice (nn.Sequential(s, s)) was converted at its first name only, the
    second use kept running in full precision (a break test, 2026-12-03: named_modules()
    drops duplicates). Now every use is the same FP8Linear, sharing s's parameters."""
    s = nn.Linear(128, 128)
    seq = nn.Sequential(s, nn.ReLU(), s)
    assert L.convert_to_fp8_linear(seq) == ["0", "2"]
    assert isinstance(seq[0], L.FP8Linear) and seq[0] is seq[2] and seq[0].weight is s.weight
    # A shared container: both paths reach the same converted child.
    blk = nn.Sequential(nn.Linear(128, 128))
    model = nn.ModuleDict({"a": blk, "b": blk})
    assert L.convert_to_fp8_linear(model) == ["a.0", "b.0"]
    assert isinstance(model["a"][0], L.FP8Linear) and model["a"][0] is model["b"][0]
