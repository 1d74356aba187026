"""Values in argument errors print short (a new user's trial: softmax_scale=10**600 printed
all 601 digits of it; past 4300 digits str() of the int is itself a ValueError about int
conversion, which named no argument). fp8attn.ops.fmt_value: a float as its shortest
round-trip form (1e+300), an int of more than 16 digits in %g form with its digit count,
other long reprs cut. Floats never print with a fixed "%f" (Python) / std::to_string (C++;
tests/cpp/test_error_format.cpp).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fp8attn
import fp8attn.hf
from fp8attn import context_parallel as cp
from fp8attn.ops import fmt_value
from fp8attn.train.model import ModelConfig

BIG = 10**600
HUGE = 10**5000   # past Python's 4300-digit limit of int -> str
SHORT = 400       # characters: every message below is far shorter


def _bhsd():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 8, 16, generator=g) for _ in range(3)]


def _entries():
    q, k, v = _bhsd()
    f = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    p = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    return {
        "attention": lambda **kw: fp8attn.attention(q, k, v, **kw),
        "flash_attn_func": lambda **kw: fp8attn.flash_attn_func(*f, **kw),
        "varlen_attention": lambda **kw: fp8attn.varlen_attention(*p, cu, cu, **kw),
        "FP8Attention": lambda **kw: fp8attn.FP8Attention(**kw)(q, k, v),
        "scaled_dot_product_attention": lambda **kw: fp8attn.scaled_dot_product_attention(
            q, k, v, **{("scale" if a == "softmax_scale" else a): x for a, x in kw.items()}),
    }


def _raises_short(call, exc, *want):
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    assert len(msg) < SHORT, msg
    for w in want:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("entry", list(_entries()))
@pytest.mark.parametrize("value, shown", [
    (BIG, "1e+600 (an int of 601 digits)"), (-BIG, "-1e+600 (an int of 601 digits)"),
    (HUGE, "1e+5000 (an int of 5001 digits)"), (1e300, "1e+300"), (float("1e308"), "1e+308"),
    (-1e300, "-1e+300"), (np.float64(1e308), "1e+308"), (np.float32(3e38), "3e+38"),
], ids=lambda x: fmt_value(x)[:20])   # NOTE: pytest's own id of HUGE would be str() of it: a ValueError
def test_softmax_scale_errors_print_the_value_short(entry, value, shown):
    _raises_short(lambda: _entries()[entry](softmax_scale=value), ValueError, "softmax_scale" if entry !=
                  "scaled_dot_product_attention" else "'scale'", shown)


@pytest.mark.parametrize("entry", list(_entries()))
def test_other_number_arguments_print_short(entry):
    call = _entries()[entry]
    _raises_short(lambda: call(block_size=BIG), ValueError, "'block_size'", "1e+600 (an int of 601 digits)")
    _raises_short(lambda: call(block_size=HUGE), ValueError, "'block_size'", "(an int of 5001 digits)")
    _raises_short(lambda: call(window_size=(BIG, "a")), ValueError, "'window_size'",
                  "(1e+600 (an int of 601 digits), 'a')")
    for cap, exc in ((-BIG, ValueError), (BIG, ValueError), (1e300, ValueError), (-1e-300, ValueError)):
        _raises_short(lambda: call(softcap=cap), exc, "'softcap'", fmt_value(cap))
    # an int past float's range was shown as the float it overflows to ("got inf")
    msg = _raises_short(lambda: call(softcap=-BIG), ValueError, "-1e+600 (an int of 601 digits)")
    assert "inf" not in msg


@pytest.mark.parametrize("entry", ["flash_attn_func", "varlen_attention", "scaled_dot_product_attention"])
def test_flash_compat_arguments_print_short(entry):
    call = _entries()[entry]
    _raises_short(lambda: call(dropout_p=BIG), ValueError, "'dropout_p'", "1e+600 (an int of 601 digits)")
    _raises_short(lambda: call(dropout_p=1e300), ValueError, "'dropout_p'", "got 1e+300")
    if entry == "scaled_dot_product_attention":
        return
    _raises_short(lambda: call(attention_chunk=BIG), NotImplementedError, "'attention_chunk'", "1e+600 (an int")
    _raises_short(lambda: call(num_splits=-BIG), ValueError, "'num_splits'", "-1e+600 (an int")
    _raises_short(lambda: call(sm_margin=HUGE), NotImplementedError, "'sm_margin'", "1e+5000 (an int")


def test_flash_positional_causal_prints_short():
    q, k, v = (t.transpose(1, 2).contiguous() for t in _bhsd())
    _raises_short(lambda: fp8attn.flash_attn_func(q, k, v, 0.5, BIG), TypeError, "'causal'", "1e+600 (an int")


def test_context_parallel_and_hf_and_model_config_print_short():
    x = torch.randn(1, 2, 8, 16)
    _raises_short(lambda: cp.shard(x, rank=0, world_size=-BIG), ValueError, "'world_size'", "-1e+600 (an int")
    _raises_short(lambda: cp.shard(x, rank=HUGE, world_size=2), ValueError, "'rank'", "1e+5000 (an int")
    _raises_short(lambda: cp.chunk_bounds(-BIG, 2), ValueError, "'seqlen'", "-1e+600 (an int")
    q, k, v = _bhsd()
    fn = fp8attn.hf.make_attention_function(precision="exact")
    _raises_short(lambda: fn(None, q, k, v, None, sliding_window=-BIG), ValueError, "'sliding_window'",
                  "-1e+600 (an int")
    _raises_short(lambda: ModelConfig(head_dim=-BIG), ValueError, "head_dim", "-1e+600 (an int")
    _raises_short(lambda: ModelConfig(fp8_block_size=HUGE), ValueError, "fp8_block_size", "1e+5000 (an int")


def test_fmt_value():
    assert fmt_value(BIG) == "1e+600 (an int of 601 digits)"
    assert fmt_value(123456789012345678) == "1.23457e+17 (an int of 18 digits)"
    assert fmt_value(10**16 - 1) == "9999999999999999" and fmt_value(np.int64(48)) == "48"
    assert fmt_value(1e300) == "1e+300" and fmt_value(np.float32(0.1)) == "0.1" and fmt_value(-0.0) == "-0.0"
    assert fmt_value(np.longdouble("1e600")) in ("1e+600", "inf")   # longdouble's range is the platform's
    assert fmt_value((BIG, -1)) == "(1e+600 (an int of 601 digits), -1)" and fmt_value([1]) == "[1]"
    assert fmt_value((5,)) == "(5,)" and fmt_value(np.True_) == "True" and fmt_value("a") == "'a'"
    long = fmt_value("x" * 1000)
    assert len(long) < 200 and long.endswith("(1002 characters)")
