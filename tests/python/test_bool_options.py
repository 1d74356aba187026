"""Boolean options of the public API, one rule everywhere (a new user's trial: causal=np.bool_(True)
ran through flash_attn_func and was a TypeError in attention; return_lse, smooth_k, ... alike).

Every boolean option takes a Python bool or a NumPy bool (numpy.bool_, as from an array or a
comparison), with the same result as the Python bool; anything else (an int, a str, None, a
0-d tensor) raises naming the argument, with the function's exception type (TypeError; the
FlashAttention-compatibility arguments and ModelConfig's fields: ValueError). The one check is
fp8attn.ops.check_bool.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fp8attn
import fp8attn.hf
from fp8attn.ops import check_bool
from fp8attn.train.model import ModelConfig

NOT_BOOLS = [1, 0, "yes", "", None, torch.tensor(True), 1.0]


def _bhsd(h=2, s=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, s, d, generator=g) for _ in range(3)]


def _calls():
    """name -> (call(**options), {option: exception type for a non-bool})."""
    q, k, v = _bhsd()
    f = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    p = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    op = dict(causal=TypeError, return_lse=TypeError, smooth_k=TypeError, deterministic=TypeError)
    # the FlashAttention-compatibility checks' ValueError (deterministic there too)
    flash = dict(op, deterministic=ValueError, return_attn_probs=ValueError, pack_gqa=ValueError)
    module = torch.nn.Module()
    module.is_causal = True
    return {
        "attention": (lambda **kw: fp8attn.attention(q, k, v, **kw), op),
        "flash_attn_func": (lambda **kw: fp8attn.flash_attn_func(*f, **kw), flash),
        "varlen_attention": (lambda **kw: fp8attn.varlen_attention(*p, cu, cu, **kw),
                             dict(flash, check=TypeError)),
        "scaled_dot_product_attention": (lambda **kw: fp8attn.scaled_dot_product_attention(q, k, v, **kw),
                                         dict(is_causal=TypeError, enable_gqa=TypeError, smooth_k=TypeError)),
        "FP8Attention": (lambda **kw: fp8attn.FP8Attention(**kw)(q, k, v),
                         dict(causal=TypeError, smooth_k=TypeError, deterministic=TypeError)),
        "hf.register": (lambda **kw: fp8attn.hf.make_attention_function(**kw)(module, q, k, v, None)[0],
                        dict(smooth_k=TypeError, deterministic=TypeError)),
        "quantize_tilescale": (lambda **kw: fp8attn.quantize_tilescale(q, **kw),
                               dict(transposed=TypeError)),
    }


CASES = [(fn, opt) for fn, (_, opts) in _calls().items() for opt in opts]


def _same(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("fn,opt", CASES, ids=[f"{fn}-{opt}" for fn, opt in CASES])
@pytest.mark.parametrize("value", [True, False])
def test_numpy_bools_are_taken_like_python_ones(fn, opt, value):
    call, _ = _calls()[fn]
    want = call(**{opt: value})
    assert _same(call(**{opt: np.bool_(value)}), want)
    assert _same(call(**{opt: np.array([value])[0]}), want)   # a NumPy bool as it comes from an array


@pytest.mark.parametrize("fn,opt", CASES, ids=[f"{fn}-{opt}" for fn, opt in CASES])
def test_non_bools_raise_naming_the_argument(fn, opt):
    call, opts = _calls()[fn]
    for bad in NOT_BOOLS:
        if bad is None and opt == "pack_gqa":
            continue   # None is FlashAttention's default for pack_gqa
        with pytest.raises(opts[opt], match=rf"fp8attn\.{fn}: argument '{opt}': must be (None or )?a bool"):
            call(**{opt: bad})


def test_sdpa_is_causal_string_is_a_type_error_before_the_seqlen_rule():
    """is_causal="yes" with seqlen_q != seqlen_k was the NotImplementedError of a causal
    mask (the string read as True), not the TypeError of a non-bool."""
    q, k, v = _bhsd()
    with pytest.raises(TypeError, match="argument 'is_causal': must be a bool"):
        fp8attn.scaled_dot_product_attention(q[:, :, :4], k, v, is_causal="yes")


def test_module_stores_python_bools():
    m = fp8attn.FP8Attention(causal=np.True_, smooth_k=np.False_, deterministic=np.True_)
    assert type(m.causal) is bool and type(m.smooth_k) is bool and type(m.deterministic) is bool
    assert "causal=True" in repr(m)


@pytest.mark.parametrize("field", ["qk_norm", "rope", "tie_embeddings", "fp8_smooth_k", "packed",
                                   "activation_checkpointing"])
def test_model_config_bool_fields(field):
    default = getattr(ModelConfig(), field)
    cfg = ModelConfig(**{field: np.bool_(not default)})
    assert type(getattr(cfg, field)) is bool and getattr(cfg, field) is (not default)
    json.dumps(cfg.to_dict())   # the config is saved as JSON (a NumPy bool is not serializable)
    for bad in NOT_BOOLS:
        with pytest.raises(ValueError, match=f"argument '{field}': must be a bool"):
            ModelConfig(**{field: bad})


def test_check_bool_itself():
    assert check_bool(np.True_, "x") is True and check_bool(False, "x") is False
    assert check_bool(None, "x", none_ok=True) is None
    with pytest.raises(ValueError, match=r"^fp8attn\.f: argument 'x': must be a bool \(Python or NumPy\), got int$"):
        check_bool(1, "x", "f", ValueError)
    with pytest.raises(TypeError, match=r"got numpy\.int64$"):
        check_bool(np.int64(1), "x")


def test_ring_attention_takes_numpy_bools(tmp_path):
    """context_parallel.ring_attention: a ring of one process (gloo), NumPy bools as the
    Python ones (causal=np.True_ was a TypeError, and `causal is True` would miss it)."""
    import torch.distributed as dist
    from fp8attn import context_parallel as cp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        q, k, v = (cp.shard(t, rank=0, world_size=1) for t in _bhsd(s=256))
        want_o, want_lse = cp.ring_attention(q, k, v, causal=True, return_lse=True, smooth_k=False)
        got_o, got_lse = cp.ring_attention(q, k, v, causal=np.True_, return_lse=np.True_, smooth_k=np.False_)
        assert torch.equal(got_o, want_o) and torch.equal(got_lse, want_lse)
        for opt in ("causal", "return_lse", "smooth_k"):
            with pytest.raises(TypeError, match=f"argument '{opt}': must be a bool"):
                cp.ring_attention(q, k, v, **{opt: 1})
    finally:
        dist.destroy_process_group()
