"""The FlashAttention argument surface of flash_attn_func and varlen_attention
(issue #20 items 4, 6, 7): FlashAttention's arguments are accepted at their
defaults and at values that mean the same, anything fp8attn does not implement
raises NotImplementedError naming the argument (never a bare TypeError about an
unexpected keyword, never ignored), a malformed value raises ValueError, and
flash_attn_func's O is contiguous in [batch, seqlen, heads, head_dim]."""
import pytest
import torch

import fp8attn


def _bshd(b=2, sq=37, sk=45, hq=4, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).bfloat16() for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def _varlen(seed=1):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, h, 64, generator=g).bfloat16() for h in (4, 2, 2))
    return q, k, v, cu, cu


def test_output_is_contiguous_in_the_call_layout_and_differentiable():
    q, k, v = (t.requires_grad_() for t in _bshd())
    o = fp8attn.flash_attn_func(q, k, v, causal=True)
    assert o.shape == (2, 37, 4, 64) and o.is_contiguous()
    ref = fp8attn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)
    assert torch.equal(o, ref)
    o.view(2, 37, 4 * 64).float().square().sum().backward()  # what failed on the transposed view
    g1 = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref.reshape(2, 37, 4 * 64).float().square().sum().backward()
    for a, t in zip(g1, (q, k, v)):
        assert torch.isfinite(a.float()).all() and a.abs().sum() > 0
        assert torch.equal(a, t.grad)


@pytest.mark.parametrize("window, causal, same_as", [
    ((-1, -1), False, False), ((-1, 0), False, True), ((-100, 0), False, True), ((-1, -5), True, True),
    ((-1, -1), True, True), ((-1, 0), True, True)])
def test_window_sizes_that_mean_no_window_or_causal(window, causal, same_as):
    q, k, v = _bshd(sq=45)
    o = fp8attn.flash_attn_func(q, k, v, causal=causal, window_size=window)
    assert torch.equal(o, fp8attn.flash_attn_func(q, k, v, causal=same_as))
    # the two masks differ on these inputs, so the check above can fail
    assert not torch.equal(fp8attn.flash_attn_func(q, k, v, causal=True), fp8attn.flash_attn_func(q, k, v))


def test_return_attn_probs_is_the_lse_and_hints_change_nothing():
    q, k, v = _bshd()
    o, lse = fp8attn.flash_attn_func(q, k, v, return_attn_probs=True)
    o2, lse2 = fp8attn.flash_attn_func(q, k, v, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2) and lse.shape == (2, 4, 37)
    o3 = fp8attn.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True, deterministic=False, softcap=0.0,
                                 alibi_slopes=None, attention_chunk=0, sm_margin=0, dropout_p=0.0)
    assert torch.equal(o, o3)


UNSUPPORTED = [
    ("dropout_p", 0.1), ("window_size", (128, 0)), ("window_size", (-1, 64)), ("window_size", (0, 0)),
    ("softcap", 30.0), ("alibi_slopes", torch.ones(4)), ("deterministic", True), ("qv", torch.ones(1)),
    ("q_descale", torch.ones(2, 2)), ("k_descale", torch.ones(2, 2)), ("v_descale", torch.ones(2, 2)),
    ("attention_chunk", 256), ("sm_margin", 8),
]
MALFORMED = [
    ("window_size", 5), ("window_size", (1, 2, 3)), ("window_size", (-1.0, 0)), ("softcap", "big"),
    ("softcap", True), ("deterministic", 1), ("return_attn_probs", "yes"), ("attention_chunk", -1),
    ("num_splits", -2), ("num_splits", 1.5), ("pack_gqa", 1), ("sm_margin", -1),
]


def _call(fn, **kw):
    if fn == "flash_attn_func":
        return fp8attn.flash_attn_func(*_bshd(), **kw)
    q, k, v, cq, ck = _varlen()
    return fp8attn.varlen_attention(q, k, v, cq, ck, 17, 23, **kw)


@pytest.mark.parametrize("fn", ["flash_attn_func", "varlen_attention"])
@pytest.mark.parametrize("arg, value", UNSUPPORTED, ids=lambda x: str(x)[:20])
def test_unsupported_arguments_raise_naming_them(fn, arg, value):
    with pytest.raises(NotImplementedError, match=rf"fp8attn.{fn}: argument '{arg}'"):
        _call(fn, **{arg: value})


@pytest.mark.parametrize("fn", ["flash_attn_func", "varlen_attention"])
@pytest.mark.parametrize("arg, value", MALFORMED, ids=lambda x: str(x)[:20])
def test_malformed_arguments_raise_value_error_naming_them(fn, arg, value):
    with pytest.raises(ValueError, match=rf"fp8attn.{fn}: argument '{arg}'"):
        _call(fn, **{arg: value})


@pytest.mark.parametrize("arg", ["seqused_q", "seqused_k"])
def test_varlen_seqused_is_refused_clearly(arg):
    with pytest.raises(NotImplementedError, match=rf"varlen_attention: argument '{arg}'"):
        _call("varlen_attention", **{arg: torch.tensor([10, 20], dtype=torch.int32)})


def test_varlen_flash_arguments_at_their_defaults_and_equivalents():
    q, k, v, cq, ck = _varlen()
    o, lse = fp8attn.varlen_attention(q, k, v, cq, ck, causal=True, return_lse=True)
    o2, lse2 = fp8attn.varlen_attention(q, k, v, cq, ck, window_size=(-1, 0), return_attn_probs=True,
                                        num_splits=0, pack_gqa=False)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert not torch.equal(o, fp8attn.varlen_attention(q, k, v, cq, ck))


def test_a_non_bool_causal_is_still_a_type_error():
    with pytest.raises(TypeError, match="'causal'"):
        fp8attn.flash_attn_func(*_bshd(), causal="yes", window_size=(-1, 0))


@pytest.mark.parametrize("fn", ["attention", "flash_attn_func", "varlen_attention"])
def test_float16_inputs_run_as_float32_and_come_back_in_float16(fn):
    # issue #20 item 3: FP16 Q / K / V as FlashAttention takes them; the op runs them as
    # float32 (exact: FP16 values are FP32 values) and returns O and the gradients in FP16.
    g = torch.Generator().manual_seed(5)
    if fn == "varlen_attention":
        cu = torch.tensor([0, 17, 40], dtype=torch.int32)
        base = [torch.randn(40, h, 64, generator=g) for h in (4, 2, 2)]
        call = lambda q, k, v: fp8attn.varlen_attention(q, k, v, cu, cu, causal=True)  # noqa: E731
    else:
        base = [torch.randn(2, h, s, 64, generator=g) for h, s in ((4, 37), (2, 45), (2, 45))]
        if fn == "flash_attn_func":
            base = [t.transpose(1, 2).contiguous() for t in base]
        call = getattr(fp8attn, fn)
        call = (lambda f: lambda q, k, v: f(q, k, v, causal=True))(call)
    h = [t.half().requires_grad_() for t in base]
    f = [t.half().float().requires_grad_() for t in base]
    oh, of = call(*h), call(*f)
    assert oh.dtype == torch.float16 and torch.equal(oh, of.half())
    do = torch.randn(oh.shape, generator=g)
    oh.backward(do.half())
    of.backward(do.half().float())
    for a, b in zip(h, f):
        assert a.grad.dtype == torch.float16 and torch.isfinite(a.grad).all() and a.grad.abs().sum() > 0
        assert torch.equal(a.grad, b.grad.half())


def test_float16_mixed_with_another_dtype_is_a_type_error():
    q, k, v = _bshd()
    with pytest.raises(TypeError, match="argument 'k'"):
        fp8attn.flash_attn_func(q.half(), k.float(), v.float())
