"""scaling="tile" (docs/numerics.md section 9) through every public entry point on
the CPU: the same numbers as the raw ops (which wrap the CPU reference, tested bit
for bit against a literal emulation in tests/cpp/test_reference_tile.cpp), really
different from scaling="row" (so the argument is not dropped anywhere on the way),
and as accurate as row against the exact path; argument errors name `scaling`.
A GPU test checks that CUDA refuses tile (no silent row run)."""
from __future__ import annotations

import math

import pytest
import torch

import fp8attn
from fp8attn import ops
from fp8attn.varlen import varlen_attention


def _inputs(B=1, Hq=4, Hkv=2, Sq=70, Sk=133, d=32, dv=24, dtype=torch.bfloat16):
    q = torch.randn(B, Hq, Sq, d).to(dtype)
    k = torch.randn(B, Hkv, Sk, d).to(dtype)
    v = torch.randn(B, Hkv, Sk, dv).to(dtype)
    do = torch.randn(B, Hq, Sq, dv).to(dtype)
    return q, k, v, do


def _grads(fn, q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# causal both ways (seqlen_q > seqlen_k: fully masked rows; <), GQA, ragged lengths.
@pytest.mark.parametrize("Sq,Sk,causal,block_size", [(70, 133, True, 64), (100, 75, True, 32),
                                                     (40, 150, False, 128)])
def test_attention_tile_through_autograd_matches_raw_ops(Sq, Sk, causal, block_size):
    q, k, v, do = _inputs(Sq=Sq, Sk=Sk)
    scale = 1 / math.sqrt(q.shape[-1])
    o, dq, dk, dv = _grads(fp8attn.attention, q, k, v, do, causal=causal, block_size=block_size,
                           scaling="tile")
    o_ref, lse = torch.ops.fp8attn.fwd(q, k, v, scale, causal, "fp8", block_size, "tile")
    dq_ref, dk_ref, dv_ref, _ = torch.ops.fp8attn.bwd(do, q, k, v, o_ref, lse, scale, causal, "fp8",
                                                      "delta_matching", block_size, "e4m3", False, "tile")
    for got, want in ((o, o_ref), (dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
    # As accurate as row against the exact path (numerics.md section 9).
    ex = _grads(fp8attn.attention, q.double(), k.double(), v.double(), do.double(), causal=causal,
                precision="exact")
    row = _grads(fp8attn.attention, q, k, v, do, causal=causal, block_size=block_size)
    tile = (o, dq, dk, dv)
    for t, r, e in zip(tile, row, ex):
        assert _rel(t, e) <= 1.05 * _rel(r, e) + 2e-3  # BF16 outputs: ~2e-3 of rounding on top


def test_tile_is_not_row():
    """On inputs spanning many binades (FP8-subnormal elements under one recipe's
    scales and not the other's) the two recipes differ, and every entry point
    returns tile's numbers: the argument is not dropped on the way."""
    q, k, v, do = _inputs(Sq=64, Sk=96, dtype=torch.float32)
    for t in (q, k, v, do):
        t.mul_(torch.exp2(torch.randint(-6, 7, t.shape).float()))
    s = 1 / math.sqrt(q.shape[-1])
    tile = _grads(fp8attn.attention, q, k, v, do, causal=True, scaling="tile")
    row = _grads(fp8attn.attention, q, k, v, do, causal=True)
    for t, r in zip(tile, row):
        assert torch.isfinite(t).all() and not torch.equal(t, r)
    o_ref, lse = torch.ops.fp8attn.fwd(q, k, v, s, True, "fp8", 128, "tile")
    assert torch.equal(tile[0], o_ref)


def test_tile_raw_op_default_is_row_and_bad_value_names_scaling():
    q, k, v, do = _inputs()
    s = 1 / math.sqrt(q.shape[-1])
    a = torch.ops.fp8attn.fwd(q, k, v, s, True, "fp8", 128)
    b = torch.ops.fp8attn.fwd(q, k, v, s, True, "fp8", 128, "row")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="'scaling'.*row.*tile"):
        torch.ops.fp8attn.fwd(q, k, v, s, True, "fp8", 128, "rows")
    with pytest.raises(ValueError, match="'scaling'"):
        torch.ops.fp8attn.bwd(do, q, k, v, a[0], a[1], s, True, "fp8", "delta_matching", 128, "e4m3", False,
                              "Tile")


def test_raw_fwd_op_autograd_keeps_tile():
    q, k, v, do = _inputs(Sq=64, Sk=64)
    s = 1 / math.sqrt(q.shape[-1])
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, _ = torch.ops.fp8attn.fwd(qg, kg, vg, s, True, "fp8", 128, "tile")
    o.backward(do)
    o2, dq2, _, _ = _grads(fp8attn.attention, q, k, v, do, causal=True, scaling="tile")
    assert torch.equal(o.detach(), o2) and torch.equal(qg.grad, dq2)


def test_flash_attn_func_sdpa_module_tile():
    q, k, v, do = _inputs(Hq=2, Hkv=2, Sq=64, Sk=64)
    want = _grads(fp8attn.attention, q, k, v, do, causal=True, scaling="tile")
    t = lambda x: x.transpose(1, 2)
    got = _grads(lambda a, b, c, **kw: t(fp8attn.flash_attn_func(t(a), t(b), t(c), **kw)), q, k, v, do,
                 causal=True, scaling="tile")
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    got = _grads(fp8attn.scaled_dot_product_attention, q, k, v, do, is_causal=True, scaling="tile")
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    m = fp8attn.FP8Attention(causal=True, scaling="tile")
    assert m.scaling == "tile" and "scaling='tile'" in repr(m)
    got = _grads(lambda a, b, c: m(a, b, c), q, k, v, do)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_varlen_tile_equals_attention_per_sequence():
    lens_q, lens_k = [5, 70, 0, 33], [9, 70, 4, 150]
    Hq, Hkv, d = 4, 2, 16
    q = torch.randn(sum(lens_q), Hq, d).bfloat16()
    k = torch.randn(sum(lens_k), Hkv, d).bfloat16()
    v = torch.randn(sum(lens_k), Hkv, d).bfloat16()
    do = torch.randn(sum(lens_q), Hq, d).bfloat16()
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    o, dq, dk, dv = _grads(varlen_attention, q, k, v, do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                           block_size=32, scaling="tile")
    qa = ka = 0
    for lq, lk in zip(lens_q, lens_k):
        if lq and lk:
            sl = lambda x, a, n: x[a:a + n].transpose(0, 1).unsqueeze(0)
            want = _grads(fp8attn.attention, sl(q, qa, lq), sl(k, ka, lk), sl(v, ka, lk), sl(do, qa, lq),
                          causal=True, block_size=32, scaling="tile")
            assert torch.equal(sl(o, qa, lq), want[0])
            assert torch.equal(sl(dq, qa, lq), want[1])
            assert torch.equal(sl(dk, ka, lk), want[2])
            assert torch.equal(sl(dv, ka, lk), want[3])
        qa, ka = qa + lq, ka + lk


def test_diagnostics_record_scaling():
    q, k, v, do = _inputs(Sq=64, Sk=64)
    with fp8attn.diagnostics.record() as recs:
        _grads(fp8attn.attention, q, k, v, do, causal=True, scaling="tile", layer_name="L0")
    assert [r["scaling"] for r in recs.records] == ["tile"]


@pytest.mark.parametrize("bad", ["rows", "TILE", "", None, 1])
def test_bad_scaling_is_a_value_error_naming_it(bad):
    q, k, v, _ = _inputs(Sq=8, Sk=8)
    for call in (lambda: fp8attn.attention(q, k, v, scaling=bad),
                 lambda: fp8attn.flash_attn_func(q, k, v, scaling=bad),
                 lambda: fp8attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, scaling=bad),
                 lambda: fp8attn.FP8Attention(scaling=bad),
                 lambda: varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                          torch.tensor([0, 8]), torch.tensor([0, 8]), scaling=bad)):
        with pytest.raises(ValueError, match=r"argument 'scaling': must be one of \('row', 'tile'\)"):
            call()
    assert ops.SCALINGS == ("row", "tile")


def test_hf_register_takes_scaling():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "AttentionInterface"):
        pytest.skip("transformers has no AttentionInterface")
    import fp8attn.hf
    with pytest.raises(ValueError, match="'scaling'"):
        fp8attn.hf.make_attention_function(scaling="rows")
    fn = fp8attn.hf.make_attention_function(scaling="tile")
    q, k, v, _ = _inputs(Hq=2, Hkv=2, Sq=16, Sk=16, d=16, dv=16)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fn(module, q, k, v, None, scaling=0.3)  # HF's per-call scaling = softmax scale
    want = fp8attn.attention(q, k, v, causal=True, softmax_scale=0.3, scaling="tile")
    assert torch.equal(out, want.transpose(1, 2))


def test_trainer_scaling_flag_and_config():
    from fp8attn.train import compare
    from fp8attn.train.model import ModelConfig
    assert compare.parse_args(["--out", "x", "--scaling", "tile"]).scaling == "tile"
    assert compare.parse_args(["--out", "x"]).scaling == "row"
    with pytest.raises(SystemExit):
        compare.parse_args(["--out", "x", "--scaling", "rows"])
    with pytest.raises(ValueError, match="fp8_scaling"):
        ModelConfig(fp8_scaling="rows")
    from fp8attn.train.model import Attention
    cfg = ModelConfig(attn_mode="fp8-delta_matching", fp8_scaling="tile", n_layers=1, d_model=32, n_heads=2,
                      n_kv_heads=1, head_dim=16, mlp_hidden=32, max_seq_len=16, vocab_size=16)
    seen = []
    attn = Attention(cfg, "L0")
    attn.core.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["scaling"]),
                                        with_kwargs=True)
    x = torch.randn(1, 16, 32)
    cos = torch.ones(16, 8)
    sin = torch.zeros(16, 8)
    attn(x, cos, sin)
    assert seen == ["tile"]


@pytest.mark.gpu
@pytest.mark.parametrize("knob", [None, "", "1", "0"])
def test_cuda_tile_backward_default_and_switch(monkeypatch, knob):
    # The CUDA `tile` forward and backward run by default (unset / empty / 1):
    # autograd trains through them. FP8ATTN_TILE_BWD=0 switches the backward off:
    # autograd's forward succeeds and the backward raises NotImplementedError
    # naming `scaling` and the knob, as does the raw bwd op (never a silent `row` run).
    from fp8attn import _lib
    if not torch.cuda.is_available() or not _lib.HAS_CUDA_KERNELS:
        pytest.skip("needs a CUDA GPU and the CUDA kernels")
    monkeypatch.delenv("FP8ATTN_TILE_FWD", raising=False)
    if knob is None:
        monkeypatch.delenv("FP8ATTN_TILE_BWD", raising=False)
    else:
        monkeypatch.setenv("FP8ATTN_TILE_BWD", knob)
    q, k, v, do = (t.cuda() for t in _inputs(Hq=2, Hkv=2, Sq=128, Sk=128, d=64, dv=64))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fp8attn.attention(qg, kg, vg, causal=True, scaling="tile")
    assert torch.isfinite(out).all()
    if knob != "0":
        out.backward(do)
        for g in (qg.grad, kg.grad, vg.grad):
            assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        return
    with pytest.raises(NotImplementedError, match="argument 'scaling'.*FP8ATTN_TILE_BWD=0"):
        out.backward(do)
    s = 1 / 8
    o, lse = torch.ops.fp8attn.fwd(q, k, v, s, True, "fp8", 128, "tile")
    with pytest.raises(NotImplementedError, match="'scaling'"):
        torch.ops.fp8attn.bwd(do, q, k, v, o, lse, s, True, "fp8", "delta_matching", 128, "e4m3", False, "tile")
