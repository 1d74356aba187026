"""fp8attn.linear on hostile input: degenerate shapes, wrong types / dtypes / devices,
meta tensors, and the converter's edge cases. Every bad input must raise an error
naming the argument; every degenerate shape must behave like nn.Linear."""
import pytest
import torch
import torch.nn as nn

from fp8attn import linear as L


@pytest.mark.parametrize("x_shape,w_shape", [((4, 0), (8, 0)),        # in_features 0
                                             ((2, 3, 0), (8, 0)),
                                             ((0, 16), (8, 16)),       # no rows
                                             ((2, 0, 16), (8, 16)),
                                             ((4, 16), (0, 16))])      # out_features 0
def test_zero_size_shapes_match_nn_linear(x_shape, w_shape):
    x = torch.randn(*x_shape, requires_grad=True)
    w = torch.randn(*w_shape, requires_grad=True)
    b = torch.randn(w_shape[0], requires_grad=True)
    y = L.fp8_linear(x, w, b)
    ref = torch.nn.functional.linear(x.detach(), w.detach(), b.detach())
    assert y.shape == ref.shape and torch.equal(y.detach(), ref)
    y.sum().backward()
    # NOTE: like nn.Linear, every parameter gets a (zero-size or zero) gradient, none is
    # left None (DDP would report it as unused).
    for t in (x, w, b):
        assert t.grad is not None and t.grad.shape == t.shape
    assert torch.equal(b.grad, torch.full_like(b, float(x.shape[:-1].numel())))


def test_non_tensor_arguments_raise_type_error_naming_them():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(TypeError, match="'x'"):
        L.fp8_linear([[1.0] * 16], w)
    with pytest.raises(TypeError, match="'weight'"):
        L.fp8_linear(x, [[1.0] * 16])
    with pytest.raises(TypeError, match="'bias'"):
        L.fp8_linear(x, w, [0.0] * 8)
    with pytest.raises(ValueError, match="'grad_format'"):
        L.fp8_linear(x, w, grad_format=["e4m3"])        # unhashable: was a bare TypeError
    with pytest.raises(ValueError, match="'backend'"):
        L.FP8Linear(16, 8, backend=["auto"])


@pytest.mark.parametrize("name", ["x", "weight", "bias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_bad_dtypes_name_the_public_argument(name, dtype):
    args = {"x": torch.randn(4, 16), "weight": torch.randn(8, 16), "bias": torch.randn(8)}
    args[name] = args[name].to(dtype)
    with pytest.raises(TypeError, match=f"'{name}'"):
        L.fp8_linear(args["x"], args["weight"], args["bias"])


def test_float64_module_names_weight():
    with pytest.raises(TypeError, match="'weight'"):
        L.FP8Linear(16, 8, dtype=torch.float64)(torch.randn(2, 16))


def test_device_mismatch_and_meta_tensors():
    with pytest.raises(ValueError, match="'weight'.*device"):
        L.fp8_linear(torch.randn(4, 16, device="meta"), torch.randn(8, 16))
    with pytest.raises(ValueError, match="'bias'.*device"):
        L.fp8_linear(torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, device="meta"))
    # Meta tensors (deferred init, shape inference): shapes only, no autocast crash.
    m = L.FP8Linear(16, 8, device="meta")
    y = m(torch.randn(2, 3, 16, device="meta"))
    assert y.shape == (2, 3, 8) and y.device.type == "meta"


def test_convert_refuses_the_root_module_instead_of_a_silent_no_op():
    lin = nn.Linear(16, 8)
    with pytest.raises(ValueError, match="'model'.*from_linear"):
        L.convert_to_fp8_linear(lin)
    assert not hasattr(lin, "") and "" not in lin._modules
    # excluded root: nothing to do, no error
    assert L.convert_to_fp8_linear(lin, exclude="") == []


def test_convert_and_from_linear_argument_errors():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="'include'"):
        L.convert_to_fp8_linear(model, include=5)
    with pytest.raises(TypeError, match="'exclude'"):
        L.convert_to_fp8_linear(model, exclude=[None])
    with pytest.raises(TypeError, match="'model'"):
        L.convert_to_fp8_linear("model")
    with pytest.raises(ValueError, match="'grad_format'"):
        L.convert_to_fp8_linear(nn.Sequential(), grad_format="e3m4")   # checked even with no match
    with pytest.raises(TypeError, match="'lin'"):
        L.FP8Linear.from_linear(nn.Conv1d(3, 3, 1))
    assert type(model[0]) is nn.Linear   # untouched by the failed calls


def test_fp8_linear_compiles_with_fullgraph():
    """torch.compile(fullgraph=True) traces FP8Linear (dynamo only: the eager backend keeps
    this fast). The CPU NaN-code shortcut's data-dependent branch broke the trace."""
    m = L.FP8Linear(256, 128)
    x = torch.randn(4, 256, requires_grad=True)
    y = torch.compile(m, fullgraph=True, backend="eager")(x)
    y.sum().backward()
    assert torch.equal(y.detach(), m(x.detach())) and x.grad is not None
