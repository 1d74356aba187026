"""tests/python/test_cuda_bwd.py's check_grads on synthetic tensors (CPU): the per-64-column
check must catch a wrong block, including one where the reference block is ~zero."""
import pytest
import torch

from test_cuda_bwd import check_grads


def _grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    e = [torch.randn(1, 2, 70, 192, generator=g, dtype=torch.float64) for _ in range(2)]
    e.append(torch.randn(1, 2, 70, 128, generator=g, dtype=torch.float64))
    return e


def test_identical_grads_pass():
    e = _grads()
    check_grads(tuple(t.clone() for t in e), tuple(e), tuple(e), "same")


def test_wrong_block_fails():
    e = _grads()
    c = [t.clone() for t in e]
    c[0][..., 0:64] *= 1.2       # dQ columns 0..63 off by 20%
    with pytest.raises(AssertionError):
        check_grads(tuple(c), tuple(e), tuple(e), "bad block")


def test_garbage_where_the_reference_block_is_zero_fails():
    e = _grads()
    g = torch.Generator().manual_seed(1)
    r = [t + 0.03 * torch.randn(t.shape, generator=g, dtype=t.dtype) for t in e]   # the FP8 reference's error
    for t in e + r:
        t[..., 128:] = 0.0        # reference dQ/dK columns 128..191 exactly zero
    c = [t.clone() for t in r]
    # O(0.02) garbage in that block: small enough for the whole-tensor checks.
    c[0][..., 128:] = 0.02 * torch.randn(c[0][..., 128:].shape, generator=g, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"128:192"):
        check_grads(tuple(c), tuple(r), tuple(e), "zero block")
