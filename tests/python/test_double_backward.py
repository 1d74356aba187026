"""Double backward through fp8attn fails loudly (RuntimeError), never silently.

The backwards of attention / varlen_attention / the raw op fwd / fp8_linear have
no derivative of their own. A backward that runs with create_graph=True while an
input requires grad must raise "double backward is not supported", whatever the
loss: in particular a loss linear in the output (o.sum()), whose dO is a
constant. NOTE: torch's once_differentiable let that case through: the gradient
came back without a graph and a gradient penalty got a second derivative of 0.
First-order backward (create_graph=False) and torch.compile keep working.
"""
import pytest
import torch

import fp8attn
from fp8attn.linear import fp8_linear

MSG = "double backward is not supported"


def _attention(q, k, v):
    return fp8attn.attention(q, k, v, precision="exact")


def _flash(q, k, v):
    return fp8attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   precision="exact").transpose(1, 2)


def _sdpa(q, k, v):
    return fp8attn.scaled_dot_product_attention(q, k, v, precision="exact")


def _raw_op(q, k, v):
    return torch.ops.fp8attn.fwd(q, k, v, 0.3, False, "exact", 128)[0]


def _varlen(q, k, v):
    # [1, H, S, D] -> packed [S, H, D], two sequences (3 + 5 tokens)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    pq, pk, pv = (t[0].transpose(0, 1) for t in (q, k, v))
    return fp8attn.varlen_attention(pq, pk, pv, cu, cu, precision="exact")


def _linear(q, k, v):
    # x = q, weight = k (as [N, K]); v unused but kept for the common signature
    return fp8_linear(q.reshape(-1, q.shape[-1]).float(), k[0, 0].float(), backend="emulated") + 0 * v.sum()


FNS = {"attention": _attention, "flash_attn_func": _flash, "sdpa": _sdpa, "raw_op": _raw_op,
       "varlen_attention": _varlen, "fp8_linear": _linear}
LOSSES = {"linear": lambda o: o.sum(), "quadratic": lambda o: (o ** 2).sum()}


def _inputs(which):
    q, k, v = [torch.randn(1, 2, 8, 8, dtype=torch.float64) for _ in range(3)]
    for name, t in zip("qkv", (q, k, v)):
        t.requires_grad_(name in which)
    return q, k, v


@pytest.mark.parametrize("which", ["qkv", "q", "k"])
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("fn", FNS)
def test_double_backward_raises(fn, loss, which):
    """Raised by the first create_graph backward. Before: the 'linear' cases gave a
    first gradient with no graph (no error at all), the 'quadratic' ones raised
    only later, at the second backward."""
    q, k, v = _inputs(which)
    o = FNS[fn](q, k, v)
    wrt = [t for t in (q, k, v) if t.requires_grad]
    with pytest.raises(RuntimeError, match=MSG):
        torch.autograd.grad(LOSSES[loss](o), wrt, create_graph=True)


@pytest.mark.parametrize("fn", FNS)
def test_gradient_penalty_does_not_return_zero(fn):
    """The tester's case: pen = |dL/dq|^2 (+ 0 * q.sum() to keep q in the graph)
    gave d pen / dq == 0 with no error."""
    q, k, v = _inputs("q")
    o = FNS[fn](q, k, v)
    with pytest.raises(RuntimeError, match=MSG):
        (g,) = torch.autograd.grad(o.sum(), q, create_graph=True)
        ((g ** 2).sum() + 0 * q.sum()).backward()
    assert q.grad is None


@pytest.mark.parametrize("fn", FNS)
def test_first_order_backward_still_works(fn):
    q, k, v = _inputs("qkv")
    o = FNS[fn](q, k, v)
    grads = torch.autograd.grad(o.sum(), (q, k, v), allow_unused=True)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    assert not any(g.requires_grad for g in grads if g is not None)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("fn", ["attention", "varlen_attention"])
def test_activation_checkpointing_unaffected(fn, use_reentrant):
    """torch.utils.checkpoint recomputes the forward under grad mode and runs its
    backward inside the outer one (reentrant: a nested autograd.backward); that
    is a first-order backward, so the guard must stay silent and the gradients
    must be bitwise those of the same step without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _inputs("qkv")
    x = torch.randn_like(q, requires_grad=True)  # reentrant checkpoint needs an input that requires grad
    loss = checkpoint(lambda a, b, c, d: FNS[fn](a + d, b, c), q, k, v, x,
                      use_reentrant=use_reentrant).pow(2).sum()
    loss.backward()
    want = [t.detach().clone().requires_grad_() for t in (q, k, v, x)]
    FNS[fn](want[0] + want[3], want[1], want[2]).pow(2).sum().backward()
    for got, ref in zip((q, k, v, x), want):
        assert got.grad is not None and torch.equal(got.grad, ref.grad)


@pytest.mark.parametrize("fn", ["attention", "varlen_attention"])
def test_compiled_first_order_backward_unaffected(fn):
    """torch.compile traces the backward (AOTAutograd) with the same wrapper."""
    torch._dynamo.reset()
    q, k, v = _inputs("qkv")
    compiled = torch.compile(lambda a, b, c: FNS[fn](a, b, c).pow(2).sum(), fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    want = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    FNS[fn](*want).pow(2).sum().backward()
    for got, ref in zip((q, k, v), want):
        assert torch.equal(got.grad, ref.grad)
    torch._dynamo.reset()
