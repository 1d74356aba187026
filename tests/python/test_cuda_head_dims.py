"""GPU tests of every head_dim on CUDA and of float32 CUDA inputs (issue 16 item 4).

The CUDA kernels are instantiated for (head_dim_qk, head_dim_v) in {(64, 64),
(128, 128), (192, 128), (256, 256)}; the op (csrc/torch/ops_cuda.cpp) serves
every other pair in [1, 256]^2 by zero-padding Q, K (and V, dO, O) to the
first of those that covers it and slicing O, dQ, dK, dV back (exact under the
FP8 recipe: docs/numerics.md section 7, "Zero-padded head dims"; the CPU
reference's bitwise invariance: tests/python/test_pad_exact.py). Here, on the
GPU, against the CPU reference of the same recipe with the tolerances of
test_cuda.py / test_cuda_bwd.py (numerics.md section 6; their helpers):

  - forward (O, LSE, per-row checks) and backward (dQ, dK, dV; per 64-column
    block too) at every head_dim in HEAD_DIMS, causal and not, GQA;
  - head_dim_qk != head_dim_v pairs (PAIRS), forward + backward on CUDA;
  - GQA ratios, delta modes and grad formats at padded head dims;
  - a padded call equals the same kernel on explicitly zero-padded inputs
    (O, LSE, dK, dV bitwise; dQ to its FP32 atomics' order);
  - softmax_scale defaults to 1/sqrt(true head_dim_qk) in attention() and
    varlen_attention();
  - float32 CUDA inputs: rounded to BF16, outputs and gradients float32 and
    equal to the BF16 call's; float64 CUDA inputs raise TypeError, float16 runs as float32.

Skips cleanly without a GPU or without the CUDA kernels compiled in.
Run: PYTHONPATH=python python3 -m pytest -q tests/python/test_cuda_head_dims.py
"""
import math

import pytest
import torch

import fp8attn
from test_cuda import (OPS, check_close, check_rows, cuda_fwd, f32_scale, make_qkv, needs_bwd, randn,  # noqa: F401
                       ref_fwd, seed_of)
from test_cuda import check_grads as check_grads_pipeline
from test_cuda import full_pipeline
from test_cuda_bwd import check_grads as check_grads_bwd
from test_cuda_bwd import make_inputs, run_bwd
from wgmma_bounds import wgmma_lse_bound

pytestmark = pytest.mark.gpu

# Multiples of 8 without a kernel of their own, the native ones at the edges,
# and head dims that are not multiples of 8.
HEAD_DIMS = [8, 16, 24, 32, 40, 48, 56, 72, 80, 96, 104, 112, 120, 136, 160, 192, 200, 224, 248, 256,
             1, 33, 100, 130, 255]
# (head_dim_qk, head_dim_v): padded on one side or both, the (192, 128) kernel
# from below, a whole zero Q/K block (128 -> 256 for head_dim_v > 128).
PAIRS = [(128, 64), (64, 128), (192, 192), (96, 64), (64, 96), (160, 128), (136, 64), (128, 200), (256, 64),
         (64, 256), (33, 100), (200, 40)]
KERNEL_PAIRS = [(64, 64), (128, 128), (192, 128), (256, 256)]


def kernel_dims(dqk, dv):
    """The kernel pair the op pads (dqk, dv) to (config_sm90.h kernel_head_dims)."""
    return next((a, b) for a, b in KERNEL_PAIRS if dqk <= a and dv <= b)


def pad(x, d):
    return torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def check_fwd_any(shape, causal, seed):
    """test_cuda.check_fwd for any head dims: the FP8 wgmma S bound applies
    (the padded problem runs on the wgmma kernel)."""
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(b, hq, hkv, sq, sk, d, dv, seed)
    out, lse = cuda_fwd(q, k, v, causal)
    (o_cpu, l_cpu), (o_ex, l_ex) = ref_fwd(q, k, v, causal)
    label = f"{shape} causal={causal}"
    assert out.shape == (b, hq, sq, dv) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    check_close("O", out, o_cpu, o_ex, label)
    check_close("LSE", lse, l_cpu, l_ex, label)
    check_rows(out, lse, o_cpu, l_cpu, label, wgmma_lse_bound(q, k, f32_scale(d), causal))
    return q, k, v, out, lse


# ---- every head_dim: forward, backward ---------------------------------------------------


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_every_head_dim(d, causal):
    check_fwd_any((1, 4, 2, 200, 333, d, d), causal, seed_of("hd-any", d, causal))


@needs_bwd
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_every_head_dim(d, causal):
    # The backward alone (O, LSE from the CPU forward), per 64-column block too.
    shape = (1, 4, 2, 333, 200, d, d)
    inp = make_inputs(*shape, causal, seed=seed_of("bwd-any", d, causal))
    cuda, cpu, exact = run_bwd(inp, causal, "delta_matching", "e4m3")
    for name, t, want in zip(("dQ", "dK", "dV"), cuda[:3], (inp[0], inp[1], inp[2])):
        assert t.shape == want.shape and t.dtype == torch.bfloat16 and t.is_contiguous(), name
    check_grads_bwd(cuda, cpu, exact, f"{shape} causal={causal}")


@needs_bwd
@pytest.mark.parametrize("dims", PAIRS, ids=lambda x: "%dx%d" % x)
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_pairs_fwd_bwd(dims, causal):
    # head_dim_qk != head_dim_v: the CUDA forward vs the reference, then the CUDA
    # forward + backward vs the CPU forward + backward.
    shape = (1, 6, 2, 250, 190) + dims
    check_fwd_any(shape, causal, seed_of("pair-fwd", dims, causal))
    b, hq, hkv, sq, sk, d, dv = shape
    q, k, v = make_qkv(*shape, seed=seed_of("pair-bwd", dims, causal))
    dout = randn(b, hq, sq, dv, gen=torch.Generator().manual_seed(seed_of("pair-do", dims, causal)))
    cuda, cpu, exact = full_pipeline(q, k, v, dout, causal, "delta_matching")
    check_grads_pipeline(cuda, cpu, exact, f"{shape} causal={causal}")


@needs_bwd
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
@pytest.mark.parametrize("dims", [(80, 80), (40, 160)], ids=lambda x: "%dx%d" % x)
def test_gqa_padded(hq, hkv, dims):
    shape = (2, hq, hkv, 170, 230) + dims
    check_fwd_any(shape, True, seed_of("gqa-pad", hq, hkv, dims))
    inp = make_inputs(*shape, True, seed=seed_of("gqa-pad-bwd", hq, hkv, dims))
    cuda, cpu, exact = run_bwd(inp, True, "delta_matching", "e4m3")
    check_grads_bwd(cuda, cpu, exact, f"{shape}")


@needs_bwd
@pytest.mark.parametrize("mode", ["stale", "matched_do", "delta_matching"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_modes_formats_padded(mode, fmt):
    shape = (1, 6, 2, 290, 260, 96, 72)
    causal = fmt == "e5m2"
    inp = make_inputs(*shape, causal, seed=seed_of("modes-pad", mode, fmt))
    cuda, cpu, exact = run_bwd(inp, causal, mode, fmt)
    check_grads_bwd(cuda, cpu, exact, f"{mode} {fmt}")


@needs_bwd
def test_diagnostics_padded():
    # The diagnostics of a padded backward (numerics.md section 5) equal the CPU
    # reference's, as test_cuda.py::test_bwd_diagnostics_vs_reference checks them.
    shape = (1, 4, 2, 384, 384, 80, 80)
    q, k, v = make_qkv(*shape, seed=seed_of("diag-pad"))
    dout = randn(1, 4, 384, 80, gen=torch.Generator().manual_seed(seed_of("diag-pad-do")))
    cuda, cpu, _ = full_pipeline(q, k, v, dout, True, "stale", diagnostics=True, shared_fwd=True)
    dc, dr = cuda[3].double(), cpu[3].double()
    assert dc.shape == (4, 1, 4, 384) and torch.isfinite(dc).all()
    assert (dc[0] - dr[0]).norm() < 1e-3 * dr[0].norm(), "delta"
    assert (dc[1] - dr[1]).norm() < 2e-2 * dr[1].norm(), "eps"
    assert (dc[2] - dr[2]).norm() < 2e-2 * dr[2].norm(), "rowsum_pre"


# ---- padding is the kernel on zero-padded inputs, nothing else -----------------------------


@needs_bwd
@pytest.mark.parametrize("dims", [(96, 96), (33, 100), (128, 200), (160, 128)], ids=lambda x: "%dx%d" % x)
def test_padded_call_equals_kernel_on_zero_padded_inputs(dims):
    d, dv = dims
    a, b = kernel_dims(d, dv)
    q, k, v = (t.cuda() for t in make_qkv(2, 4, 2, 300, 260, d, dv, seed_of("pad-eq", dims)))
    dout = torch.randn(2, 4, 300, dv, generator=torch.Generator().manual_seed(seed_of("pad-eq-do", dims)))
    dout = dout.bfloat16().cuda()
    tau = f32_scale(d)
    out, lse = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    out_p, lse_p = OPS.fwd(pad(q, a), pad(k, a), pad(v, b), tau, True, "fp8", 128)
    assert torch.equal(out, out_p[..., :dv]) and torch.equal(lse, lse_p)
    assert (out_p[..., dv:] == 0).all()
    g = OPS.bwd(dout, q, k, v, out, lse, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    gp = OPS.bwd(pad(dout, b), pad(q, a), pad(k, a), pad(v, b), pad(out, b), lse, tau, True, "fp8",
                 "delta_matching", 128, "e4m3", False)
    # dK, dV accumulate in registers per key tile (a fixed order); dQ through FP32
    # atomics across key tiles, whose order may differ: one BF16 rounding apart.
    assert torch.equal(g[1], gp[1][..., :d]) and torch.equal(g[2], gp[2][..., :dv])
    torch.testing.assert_close(g[0], gp[0][..., :d], rtol=2.0**-7, atol=1e-6 * gp[0].abs().max().item())


def test_default_softmax_scale_is_the_true_head_dims():
    q, k, v = (t.cuda() for t in make_qkv(1, 2, 2, 150, 150, 80, 80, seed_of("tau")))
    out = fp8attn.attention(q, k, v, causal=True)
    want, _ = OPS.fwd(q, k, v, 1.0 / math.sqrt(80), True, "fp8", 128)
    wrong, _ = OPS.fwd(q, k, v, 1.0 / math.sqrt(128), True, "fp8", 128)  # the kernel's head_dim
    assert torch.equal(out, want)
    assert not torch.equal(out, wrong)
    # varlen: the same default, per sequence
    qv, kv, vv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # [total, heads, d]
    cu = torch.tensor([0, 60, 150], dtype=torch.int32, device="cuda")
    o_var = fp8attn.varlen_attention(qv, kv, vv, cu, cu, causal=True)
    for a, b in ((0, 60), (60, 150)):
        o_seq = fp8attn.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True)
        assert torch.equal(o_var[a:b], o_seq[0].transpose(0, 1))


def test_padded_autograd_through_attention():
    # The public autograd path with a padded head_dim: gradients have the true
    # shapes and equal the raw ops' (the same op calls).
    q, k, v = (t.cuda().requires_grad_() for t in make_qkv(1, 4, 2, 200, 200, 72, 40, seed_of("ag")))
    dout = torch.randn(1, 4, 200, 40, device="cuda").bfloat16()
    out = fp8attn.attention(q, k, v, causal=True, delta_mode="stale")
    out.backward(dout)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    o, lse = OPS.fwd(q.detach(), k.detach(), v.detach(), 1.0 / math.sqrt(72), True, "fp8", 128)
    g = OPS.bwd(dout, q.detach(), k.detach(), v.detach(), o, lse, 1.0 / math.sqrt(72), True, "fp8", "stale",
                128, "e4m3", False)
    assert torch.equal(out.detach(), o)
    assert torch.equal(k.grad, g[1]) and torch.equal(v.grad, g[2])
    torch.testing.assert_close(q.grad, g[0], rtol=2.0**-7, atol=1e-6 * g[0].abs().max().item())


# ---- float32 CUDA inputs ----------------------------------------------------------------


@needs_bwd
@pytest.mark.parametrize("dims", [(64, 64), (96, 96)], ids=lambda x: "%dx%d" % x)
def test_float32_inputs_are_rounded_to_bf16(dims):
    # float32 CUDA inputs are rounded to BF16 (the kernels read BF16): outputs
    # and gradients are float32, equal to the BF16 call's results.
    d, dv = dims
    gen = torch.Generator().manual_seed(seed_of("f32", dims))
    q32, k32, v32 = (torch.randn(1, 4, 180, n, generator=gen).cuda() for n in (d, d, dv))
    k32, v32 = k32[:, :2], v32[:, :2]
    do32 = torch.randn(1, 4, 180, dv, generator=gen).cuda()
    q16, k16, v16, do16 = (t.bfloat16() for t in (q32, k32, v32, do32))
    tau = f32_scale(d)
    o32, l32 = OPS.fwd(q32, k32, v32, tau, True, "fp8", 128)
    o16, l16 = OPS.fwd(q16, k16, v16, tau, True, "fp8", 128)
    assert o32.dtype == torch.float32 and o32.shape == (1, 4, 180, dv) and o32.is_contiguous()
    assert torch.equal(o32, o16.float()) and torch.equal(l32, l16)
    g32 = OPS.bwd(do32, q32, k32, v32, o32, l32, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    g16 = OPS.bwd(do16, q16, k16, v16, o16, l16, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    for x, y in zip(g32[:3], g16[:3]):
        assert x.dtype == torch.float32 and x.shape == y.shape
    assert torch.equal(g32[1], g16[1].float()) and torch.equal(g32[2], g16[2].float())
    torch.testing.assert_close(g32[0], g16[0].float(), rtol=2.0**-7, atol=1e-6 * g16[0].abs().max().item())
    # the public API: a float32 model's attention trains (float32 gradients)
    qa, ka, va = (t.clone().requires_grad_() for t in (q32, k32, v32))
    out = fp8attn.attention(qa, ka, va, causal=True)
    assert out.dtype == torch.float32 and torch.equal(out.detach(), o16.float())
    out.backward(do32)
    assert qa.grad.dtype == torch.float32 and torch.isfinite(qa.grad).all() and qa.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_float_dtypes_on_cuda(dtype):
    # The raw op reads BF16 / FP32 only; the public functions refuse float64 on CUDA
    # and run float16 as float32, returning float16 (issue #20 item 3).
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=dtype)
    with pytest.raises(TypeError, match="'q'"):
        OPS.fwd(q, q, q, 0.125, False, "fp8", 128)
    if dtype == torch.float64:
        with pytest.raises(TypeError, match="dtype"):
            fp8attn.attention(q, q, q)
        return
    qh = q.clone().requires_grad_()
    out = fp8attn.attention(qh, qh, qh, causal=True)
    ref = fp8attn.attention(q.float(), q.float(), q.float(), causal=True)
    assert out.dtype == torch.float16 and torch.equal(out, ref.half())
    out.float().sum().backward()
    assert qh.grad.dtype == torch.float16 and torch.isfinite(qh.grad).all() and qh.grad.abs().sum() > 0


def test_deterministic_is_refused_on_cuda_with_row_scaling():
    """The row backward adds dQ with atomics: deterministic=True there names the argument
    (scaling='tile' runs it: test_tile_cuda_bwd.py's deterministic tests)."""
    q = torch.randn(1, 64, 2, 64, device="cuda").bfloat16()
    with pytest.raises(NotImplementedError, match="argument 'deterministic'"):
        fp8attn.flash_attn_func(q, q, q, deterministic=True)


def test_fp8_inputs_with_descale_on_cuda():
    # FlashAttention-3's pre-quantized FP8 forward (issue #20): the kernels run on
    # x * descale (FP32, rounded to BF16 by the op) and O comes back in bfloat16.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 300, h, 128, generator=g).cuda() * 2 for h in (8, 2, 2))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    ds = [torch.rand(2, 2, generator=g).cuda() + 0.5 for _ in range(3)]
    o = fp8attn.flash_attn_func(q8, k8, v8, causal=True, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    qf = q8.float() * ds[0].repeat_interleave(4, dim=1)[:, None, :, None]
    kf, vf = (t.float() * d[:, None, :, None] for t, d in ((k8, ds[1]), (v8, ds[2])))
    assert torch.equal(o, fp8attn.flash_attn_func(qf, kf, vf, causal=True).bfloat16())


def test_mixed_dtypes_on_cuda_raise_type_error():
    q = torch.randn(1, 2, 64, 64, device="cuda")
    with pytest.raises(TypeError, match="'k'"):
        OPS.fwd(q, q.bfloat16(), q, 0.125, False, "fp8", 128)


def test_out_of_range_head_dim_and_block_size_on_cuda():
    q = torch.randn(1, 2, 64, 257, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="head_dim"):
        OPS.fwd(q, q, q, 0.125, False, "fp8", 128)
    q = torch.randn(1, 2, 64, 96, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="block_size.*CPU"):
        OPS.fwd(q, q, q, 0.125, False, "fp8", 64)
