"""The identities the slow GPU limit tests (tests/python/test_cuda_limits.py)
check against, shown on the CPU reference of the same FP8 recipe (fast):

  - a causal sequence's first N rows (O, LSE; Delta-Matching dQ) equal the op
    on its first N tokens alone: those rows see no later key, and the block
    grid starts at token 0 either way;
  - with the stale delta (<dO_i, O_i>, per row) and the full O, LSE, the last N
    keys' dK, dV equal the op on the last N tokens alone, when N is a multiple
    of 128 (the query blocks of matmuls #5 / #7 start at the same tokens);
  - one kv head with its query heads, or one batch entry, alone equals that
    slice of the full call.

And the negative controls that show each comparison can fail: Delta-Matching
dK, dV of the last keys need all keys of their rows (differ), and a window
start that is not a multiple of 128 moves the query blocks (differs).
"""
import math

import pytest
import torch

import fp8attn  # noqa: F401  (registers torch.ops.fp8attn)

OPS = torch.ops.fp8attn
S, N, D = 1024, 384, 64


def f32_scale(d):
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


@pytest.fixture(scope="module")
def seq():
    g = torch.Generator().manual_seed(20261202)
    q = torch.randn(1, 2, S, D, generator=g).bfloat16()
    k = torch.randn(1, 1, S, D, generator=g).bfloat16()
    v = torch.randn(1, 1, S, D, generator=g).bfloat16()
    do = torch.randn(1, 2, S, D, generator=g).bfloat16()
    tau = f32_scale(D)
    o, lse = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    return q, k, v, do, o, lse, tau


def bwd(seq, mode, t):
    q, k, v, do, o, lse, tau = seq
    return OPS.bwd(do[:, :, t], q[:, :, t], k[:, :, t], v[:, :, t], o[:, :, t], lse[:, :, t].contiguous(), tau, True,
                   "fp8", mode, 128, "e4m3", False)


def test_first_rows_equal_the_first_tokens_alone(seq):
    q, k, v, do, o, lse, tau = seq
    w = slice(0, N)
    o_w, l_w = OPS.fwd(q[:, :, w], k[:, :, w], v[:, :, w], tau, True, "fp8", 128)
    assert torch.equal(o[:, :, w], o_w) and torch.equal(lse[:, :, w], l_w)
    full = bwd(seq, "delta_matching", slice(0, S))
    assert torch.equal(full[0][:, :, w], bwd(seq, "delta_matching", w)[0])


def test_last_keys_equal_the_last_tokens_alone_with_stale_delta(seq):
    t = slice(S - N, S)
    full, win = bwd(seq, "stale", slice(0, S)), bwd(seq, "stale", t)
    assert torch.equal(full[1][:, :, t], win[1]) and torch.equal(full[2][:, :, t], win[2])
    # Negative controls: Delta-Matching's delta needs every key of the row ...
    full, win = bwd(seq, "delta_matching", slice(0, S)), bwd(seq, "delta_matching", t)
    assert not torch.equal(full[1][:, :, t], win[1])
    # ... and a window not on the 128-token block grid quantizes other blocks.
    t2 = slice(S - N - 64, S)
    full, win = bwd(seq, "stale", slice(0, S)), bwd(seq, "stale", t2)
    assert not torch.equal(full[1][:, :, t2], win[1])


def test_slices_equal_the_full_call():
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, sq, sk = 3, 6, 2, 100, 70
    q = torch.randn(b, hq, sq, D, generator=g).bfloat16()
    k = torch.randn(b, hkv, sk, D, generator=g).bfloat16()
    v = torch.randn(b, hkv, sk, D, generator=g).bfloat16()
    do = torch.randn(b, hq, sq, D, generator=g).bfloat16()
    tau = f32_scale(D)
    o, lse = OPS.fwd(q, k, v, tau, True, "fp8", 128)
    grads = OPS.bwd(do, q, k, v, o, lse, tau, True, "fp8", "delta_matching", 128, "e4m3", False)
    for bi, hk in ((0, 0), (2, 1)):
        bs, qs, ks = slice(bi, bi + 1), slice(3 * hk, 3 * hk + 3), slice(hk, hk + 1)
        o1, l1 = OPS.fwd(q[bs, qs], k[bs, ks], v[bs, ks], tau, True, "fp8", 128)
        assert torch.equal(o[bs, qs], o1) and torch.equal(lse[bs, qs], l1)
        g1 = OPS.bwd(do[bs, qs], q[bs, qs], k[bs, ks], v[bs, ks], o1, l1, tau, True, "fp8", "delta_matching", 128,
                     "e4m3", False)
        assert torch.equal(grads[0][bs, qs], g1[0])
        assert torch.equal(grads[1][bs, ks], g1[1]) and torch.equal(grads[2][bs, ks], g1[2])
