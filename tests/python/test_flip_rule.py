"""CPU tests of the GPU tests' rare-flip closeness rule (test_cuda_bwd.close_to_reference,
docs/numerics.md section 6): what it lets through (one row moved by one FP8 step, as
one flipped P code moved the dV of a one-query case on the H200) and the faults it must
still catch (a wrong fragment of rows, a wrong scale, a row off by more than a step,
noise over the whole tensor)."""
import torch

from test_cuda_bwd import FLIP_ROW_MAX, close_to_reference


def _ref(rows=77, cols=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, rows, cols, generator=gen, dtype=torch.float64)


def test_plain_closeness_passes():
    r = _ref()
    ok, rel, _ = close_to_reference(r * (1 + 1e-3), r)
    assert ok and rel < 2e-2


def test_one_flipped_row_passes():
    # one row moved by an E4M3 step (2^-3 of a dominant term) while the tensor misses 2e-2
    r = _ref(rows=20)
    c = r.clone()
    c[0, 3] *= 1 + 2.0**-3
    c[0, 3] *= 4  # make that row dominate the norm so the tensor-wide check alone fails
    r2 = r.clone()
    r2[0, 3] *= 4
    ok, rel, why = close_to_reference(c, r2)
    assert rel >= 2e-2, rel  # the plain rule alone would fail this kernel
    assert ok, why


def test_a_wrong_fragment_fails():
    # 16 rows (one wgmma fragment of keys) 10% off: a kernel fault, not a flip
    r = _ref(rows=2000)
    c = r.clone()
    c[0, 16:32] *= 1.5
    ok, rel, why = close_to_reference(c, r)
    assert not ok, why


def test_a_row_beyond_one_step_fails():
    r = _ref(rows=20)
    c = r.clone()
    c[1, 5] *= 1 + 1.2 * FLIP_ROW_MAX
    ok, _, why = close_to_reference(c, r)
    assert not ok, why


def test_a_wrong_scale_or_noise_everywhere_fails():
    r = _ref()
    assert not close_to_reference(r * 1.05, r)[0]
    gen = torch.Generator().manual_seed(1)
    assert not close_to_reference(r + 0.03 * torch.randn(r.shape, generator=gen, dtype=torch.float64), r)[0]


def test_zero_reference_rows_are_judged_at_the_tensor_scale():
    r = _ref(rows=30)
    r[0, 7] = 0
    c = r.clone()
    c[0, 7] = 0.5  # a ~zero reference row that the kernel made O(1): fails
    ok, _, why = close_to_reference(c, r)
    assert not ok, why
