"""Argument values at the edges of their types (a new user's trial, 2026-12-07): each one
either runs correctly or raises a clear error naming the argument, never NaN output, a
silently ignored option, a bare OverflowError or a schema RuntimeError.

- softcap past FLT_MAX / below the smallest float32 on the fp8 path (held in FP32 there:
  inf -> every P NaN; 0 -> the cap silently off): ValueError naming softcap, in the
  Python entry points and the raw op (the C++ reference's check); the exact path (FP64)
  takes them.
- Python ints past float's range (2**2000) for softmax_scale / softcap: ValueError.
- varlen_attention's max_seqlen past int64: as loose as any bound (clamped), not a
  schema error.
- dropout_p of the drop-ins: a probability (ValueError outside [0, 1] or NaN or not a
  number); a valid non-zero one: NotImplementedError.
- flash_attn_func's pre-quantized FP8 inputs in mixed formats: TypeError.
- flash_attn_func(softcap=<tensor requiring grad>): TypeError, no torch warning first.
- convert_to_fp8_linear: the README's patterns convert an HF-named model; patterns that
  match nothing warn.
"""
import math
import warnings

import pytest
import torch
from torch import nn

import fp8attn
from fp8attn.linear import FP8Linear, convert_to_fp8_linear


def _qkv(b=1, h=2, s=10, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize("cap", [3.5e38, 1e300, 1e-46, 1e-39])
@pytest.mark.parametrize("scaling", ["row", "tile"])
def test_softcap_outside_float32_refused_on_the_fp8_path(cap, scaling):
    q, k, v = _qkv()
    # The failure guarded: float32(c) is inf or 0 (or subnormal, below the normal range).
    c32 = torch.tensor(cap, dtype=torch.float64).float().item()
    assert math.isinf(c32) or c32 == 0.0 or c32 < torch.finfo(torch.float32).tiny
    with pytest.raises(ValueError, match="'softcap'.*float32"):
        fp8attn.attention(q, k, v, softcap=cap, scaling=scaling)
    with pytest.raises(ValueError, match="softcap"):
        torch.ops.fp8attn.fwd(q, k, v, 0.25, False, "fp8", 64, scaling, softcap=cap)


def test_softcap_extremes_on_the_exact_path():
    """FP64 holds these caps: a cap past every logit is no cap (the uncapped result)."""
    q, k, v = (t.double() for t in _qkv(seed=1))
    o, lse = fp8attn.attention(q, k, v, softcap=3.5e38, precision="exact", return_lse=True)
    o0, lse0 = fp8attn.attention(q, k, v, precision="exact", return_lse=True)
    assert torch.allclose(o, o0, rtol=1e-12, atol=1e-12) and torch.allclose(lse, lse0, rtol=1e-12)
    o, lse = fp8attn.attention(q, k, v, softcap=1e-46, precision="exact", return_lse=True)
    assert torch.isfinite(o).all() and torch.allclose(lse, torch.full_like(lse, math.log(10)), rtol=1e-9)


def test_softcap_at_the_float32_limits_runs():
    q, k, v = _qkv(seed=2)
    for cap in (torch.finfo(torch.float32).tiny, 3.0e38):
        o = fp8attn.attention(q, k, v, softcap=cap)
        assert torch.isfinite(o).all(), cap


@pytest.mark.parametrize("arg", ["softmax_scale", "softcap"])
def test_huge_python_ints_are_value_errors(arg):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"'{arg}'"):
        fp8attn.attention(q, k, v, **{arg: 2**2000})
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(ValueError, match=f"'{arg}'"):
        fp8attn.flash_attn_func(qf, kf, vf, **{arg: 2**2000})
    if arg == "softmax_scale":
        with pytest.raises(ValueError, match="'scale'"):
            fp8attn.scaled_dot_product_attention(q, k, v, scale=2**2000)


@pytest.mark.parametrize("val", [2**70, -(2**70), 2**63])
def test_quantization_ints_past_int64_are_value_errors(val):
    """The quantization functions' dim / block_size beyond int64: a ValueError naming the
    argument (torch's op binder said only "Expected a value of type 'int' ... found type
    'int'", naming neither the argument nor the limit)."""
    x = torch.randn(4, 256)
    for name in ("dim", "block_size"):
        with pytest.raises(ValueError, match=f"'{name}'"):
            fp8attn.quantize_blockwise(x, **{name: val})
        codes, scales = fp8attn.quantize_blockwise(x, dim=1, block_size=128)
        with pytest.raises(ValueError, match=f"'{name}'"):
            fp8attn.dequantize_blockwise(codes, scales, **{name: val})


def test_varlen_max_seqlen_past_int64_is_a_loose_bound():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(30, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    want = fp8attn.varlen_attention(q, k, v, cu, cu, causal=True)
    got = fp8attn.varlen_attention(q, k, v, cu, cu, max_seqlen_q=2**70, max_seqlen_k=2**64, causal=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fp8attn.varlen_attention(q, k, v, cu, cu, max_seqlen_q=-(2**70))


@pytest.mark.parametrize("bad", ["a", float("nan"), -0.1, 1.5])
def test_dropout_p_is_a_probability(bad):
    q, k, v = _qkv()
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(ValueError, match="'dropout_p'"):
        fp8attn.flash_attn_func(qf, kf, vf, dropout_p=bad)
    with pytest.raises(ValueError, match="'dropout_p'"):
        fp8attn.scaled_dot_product_attention(q, k, v, dropout_p=bad)
    with pytest.raises(NotImplementedError, match="'dropout_p'"):
        fp8attn.flash_attn_func(qf, kf, vf, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="'dropout_p'"):
        fp8attn.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def test_flash_fp8_inputs_of_mixed_formats_are_refused():
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv())
    with pytest.raises(TypeError, match="float8_e4m3fn or all float8_e5m2"):
        fp8attn.flash_attn_func(q.to(torch.float8_e4m3fn), k.to(torch.float8_e5m2), v.to(torch.float8_e4m3fn))
    out = fp8attn.flash_attn_func(q.to(torch.float8_e5m2), k.to(torch.float8_e5m2), v.to(torch.float8_e5m2))
    assert torch.isfinite(out).all()


def test_flash_softcap_tensor_requiring_grad_is_a_type_error_without_warning():
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="'softcap'"):
            fp8attn.flash_attn_func(q, k, v, softcap=torch.tensor(5.0, requires_grad=True))


class _HFLike(nn.Module):
    """Module names as in an HF Llama: model.layers.N.{self_attn,mlp}.*_proj, lm_head."""

    def __init__(self):
        super().__init__()
        layer = nn.ModuleDict({"self_attn": nn.ModuleDict({n: nn.Linear(8, 8, bias=False)
                                                           for n in ("q_proj", "k_proj", "v_proj", "o_proj")}),
                               "mlp": nn.ModuleDict({n: nn.Linear(8, 8, bias=False)
                                                     for n in ("gate_proj", "up_proj", "down_proj")})})
        self.model = nn.ModuleDict({"layers": nn.ModuleList([layer])})
        self.lm_head = nn.Linear(8, 16, bias=False)


def test_convert_readme_patterns_on_hf_names_and_no_match_warns():
    m = _HFLike()
    names = convert_to_fp8_linear(m, ["*.self_attn.*_proj", "*.mlp.*"], exclude="lm_head")
    assert len(names) == 7 and all(n.startswith("model.layers.0.") for n in names)
    assert type(m.lm_head) is nn.Linear and isinstance(m.model["layers"][0]["mlp"]["up_proj"], FP8Linear)
    m = _HFLike()
    with pytest.warns(UserWarning, match="matched no nn.Linear module"):
        assert convert_to_fp8_linear(m, ["layers.*.self_attn.*_proj"]) == []
    assert type(m.model["layers"][0]["self_attn"]["q_proj"]) is nn.Linear
    # A second call on a converted model says the layers are FP8Linear already (it said
    # "matched no nn.Linear module ... some nn.Linear names here: []", a new-user trial).
    m = _HFLike()
    convert_to_fp8_linear(m, "*")
    with pytest.warns(UserWarning, match="FP8Linear already") as rec:
        assert convert_to_fp8_linear(m, "*") == []
    assert not any("some nn.Linear names" in str(w.message) for w in rec)


def test_fp8attention_module_takes_softcap():
    """FP8Attention has every option attention has (softcap was missing): the module's
    output equals the function's, and its bad values are refused at construction."""
    q, k, v = _qkv(seed=4)
    m = fp8attn.FP8Attention(causal=True, softcap=5.0)
    assert torch.equal(m(q, k, v), fp8attn.attention(q, k, v, causal=True, softcap=5.0))
    assert not torch.equal(m(q, k, v), fp8attn.attention(q, k, v, causal=True))
    assert "softcap=5.0" in repr(m)
    with pytest.raises(ValueError, match="'softcap'"):
        fp8attn.FP8Attention(softcap=-1.0)
    with pytest.raises(ValueError, match="'softcap'"):
        fp8attn.FP8Attention(softcap=5.0, smooth_k=True)


def test_fp8_linear_fused_weights_not_a_list_error_is_short():
    from fp8attn.linear import fp8_linear_fused
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    with pytest.raises(TypeError, match=r"'weights'.*a tensor of shape \(16, 8\) \(wrap it in a list\)") as e:
        fp8_linear_fused(x, w)
    assert "tensor([" not in str(e.value)
    with pytest.raises(TypeError, match="got \\[\\]"):
        fp8_linear_fused(x, [])


def test_sdpa_drop_in_enable_gqa_must_be_a_bool():
    """enable_gqa='yes' was taken as True; torch's SDPA raises TypeError (a new-user trial)."""
    q, k, v = _qkv()
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="'enable_gqa'"):
            fp8attn.scaled_dot_product_attention(q, k, v, enable_gqa=bad)
    fp8attn.scaled_dot_product_attention(q, k, v, enable_gqa=False)
