"""A helper shared by the torch.compile tests (test_op.py, test_window.py)."""
from __future__ import annotations

import torch


def assert_compiled_matches_eager(step, *inputs, dynamic=None):
    """torch.compile(step, fullgraph=True, backend="aot_eager") gives eager's loss and gradients
    (w.r.t. `inputs`) bit for bit; returns the compiled gradients. dynamic: torch.compile's
    (True traces sizes and float arguments symbolically).

    NOTE: backend="aot_eager" traces the whole graph through the fake kernels and the
    autograd.Function exactly as inductor would, but skips inductor's C++ codegen, which
    costs ~50 s of compiler time on 2 cores."""
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    loss_c = compiled(*inputs)
    grads_c = torch.autograd.grad(loss_c, inputs)
    loss_e = step(*inputs)
    grads_e = torch.autograd.grad(loss_e, inputs)
    assert torch.equal(loss_c, loss_e)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)
    return grads_c
