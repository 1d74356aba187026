"""fp8attn's attention entry points under torch.autocast behave as SDPA's: float32 /
float16 / bfloat16 Q, K, V are cast to the autocast dtype (differentiably), O comes back
in it, and the result equals a call with the inputs cast by hand. The guarded failure
(stop 32's break test): under CPU autocast fp8attn.attention returned float32 where SDPA
returns bfloat16. float64 and FP8 inputs are not cast. CPU here; the CUDA entry is the
same Python (ops._autocast_in)."""
import pytest
import torch

import fp8attn
from fp8attn import varlen_attention


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(1, 2, 40, 32, generator=g).to(dtype).requires_grad_() for _ in range(3)]


ENTRIES = {
    "attention": lambda q, k, v: fp8attn.attention(q, k, v, causal=True),
    "sdpa": lambda q, k, v: fp8attn.scaled_dot_product_attention(q, k, v, is_causal=True),
    "flash_attn_func": lambda q, k, v: fp8attn.flash_attn_func(
        *(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2),
    "varlen": lambda q, k, v: varlen_attention(
        *(t[0].transpose(0, 1) for t in (q, k, v)), torch.tensor([0, 15, 40], dtype=torch.int32),
        torch.tensor([0, 15, 40], dtype=torch.int32), causal=True).transpose(0, 1)[None],
    "module": lambda q, k, v: fp8attn.FP8Attention(causal=True)(q, k, v),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_autocast_casts_like_sdpa(entry):
    fn = ENTRIES[entry]
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = fn(q, k, v)
        ref_dtype = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).dtype
    assert o.dtype == ref_dtype == torch.bfloat16
    o.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() and g.abs().max() > 0 for g in grads)
    # the same as casting by hand, forward and gradients
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    ob = fn(qb, kb, vb)
    assert torch.equal(o, ob)
    ob.float().square().sum().backward()
    assert all(torch.equal(g, t.grad.float()) for g, t in zip(grads, (qb, kb, vb)))


def test_autocast_leaves_float64_and_off_alone():
    q, k, v = _qkv(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp8attn.attention(q, k, v).dtype == torch.float64
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert fp8attn.attention(q, k, v).dtype == torch.float32


@pytest.mark.parametrize("ac_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_inputs_of_flash_attn_func_ignore_autocast(ac_dtype):
    """Pre-quantized FP8 q, k, v (with descales) give the same O and LSE with autocast on as
    off (FA3's FP8 forward ignores autocast). The guarded failure (a break test, 2026-12-03):
    the dequantized float32 x * descale was cast to the autocast dtype: bfloat16 rounding
    (O off by up to 480) and, under float16, inf past 65504 and a NaN O."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 64, 4, 64, generator=g).mul(50).to(torch.float8_e4m3fn) for _ in range(3))
    ds = torch.rand(2, 4, generator=g) * 1000 + 0.1       # x * descale well past float16 65504
    kw = dict(q_descale=ds, k_descale=ds, v_descale=ds, causal=True, return_lse=True)
    o_ref, lse_ref = fp8attn.flash_attn_func(q, k, v, **kw)
    assert torch.isfinite(o_ref).all() and (k.float() * ds[:, None, :, None]).abs().max() > 65504
    with torch.autocast("cpu", dtype=ac_dtype):
        o, lse = fp8attn.flash_attn_func(q, k, v, **kw)
    assert o.dtype == o_ref.dtype == torch.bfloat16
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


def test_blockwise_scaled_mm_cpu_kernel_ignores_autocast():
    """The CPU kernel of fp8attn::blockwise_scaled_mm (FP8Linear's GEMM op) computes in FP32
    also when called under CPU autocast (it ran the product in bfloat16 there, rel. 2e-3)."""
    from fp8attn import linear as L
    g = torch.Generator().manual_seed(0)
    a, sa = L.quantize_1x128(torch.randn(64, 256, generator=g))
    b, sb = L.quantize_128x128(torch.randn(128, 256, generator=g))
    want = torch.ops.fp8attn.blockwise_scaled_mm(a, sa, b, sb, True, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.fp8attn.blockwise_scaled_mm(a, sa, b, sb, True, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)
