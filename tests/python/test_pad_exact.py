"""Zero-padding the head dims is exact under the FP8 recipe (CPU, fast).

The CUDA op serves every (head_dim_qk, head_dim_v) in [1, 256]^2 by padding Q,
K (and V, dO, O) with zero channels to the first instantiated kernel pair that
covers both, (64, 64), (128, 128), (192, 128), (256, 256) in that order
(kernel_head_dims in csrc/hopper/config_sm90.h, tested in
tests/cpp/test_cuda_shapes.cpp), and slicing O, dQ, dK, dV back
(docs/numerics.md section 7, "Zero-padded head dims"). Here the claim is
checked on the CPU reference of the same recipe, bit for bit: the block
quantization of the true channels is unchanged by the zero channels, and the
padded problem's O, LSE, dQ, dK, dV restricted to the true channels equal the
unpadded problem's, for every delta mode and grad format; the padded columns
are exactly 0. A negative control shows the test can fail: zero channels put
in FRONT of the true ones move channels across a 128-channel block boundary
and change the result.
"""
import math
import zlib

import pytest
import torch

import fp8attn  # noqa: F401  (registers torch.ops.fp8attn)

OPS = torch.ops.fp8attn

# The instantiated CUDA pairs, in the op's order (config_sm90.h kKernelHeadDims).
KERNEL_PAIRS = [(64, 64), (128, 128), (192, 128), (256, 256)]


def kernel_dims(dqk, dv):
    return next((a, b) for a, b in KERNEL_PAIRS if dqk <= a and dv <= b)


def pad(x, d):
    return torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def f32_scale(d):
    return float(torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32))


def gen(*key):
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# Head dim pairs: one head_dim block (incl. 1 and non-multiples of 8), a second
# block partly used (136, 200, 255), a whole zero block added to Q/K (128 -> 256
# when head_dim_v > 128) and head_dim_qk != head_dim_v both ways.
PAIRS = [(1, 1), (8, 8), (33, 33), (96, 96), (100, 100), (136, 136), (200, 200), (255, 255), (192, 192),
         (128, 64), (64, 128), (96, 64), (160, 128), (128, 200)]


@pytest.mark.parametrize("d", [8, 33, 100, 136, 200])
@pytest.mark.parametrize("dim", [3, 2])
def test_block_quantization_of_true_channels_is_unchanged(d, dim):
    # Values over many binades, so the block scales differ from block to block.
    g = gen("quant", d, dim)
    x = torch.randn(2, 3, 130, d, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 3, 130, 1), generator=g).float())
    x = x.bfloat16().float()
    kd = kernel_dims(d, d)[0]
    codes, scales = OPS.quantize_blockwise(x, dim, 128, "e4m3")
    codes_p, scales_p = OPS.quantize_blockwise(pad(x, kd), dim, 128, "e4m3")
    assert torch.equal(codes_p[..., :d], codes)
    assert (codes_p[..., d:] == 0).all()
    if dim == 3:  # blocks along head_dim: the same blocks hold the true channels
        nb = scales.shape[-1]
        assert torch.equal(scales_p[..., :nb], scales)
        assert (scales_p[..., nb:] == 1).all()  # an all-zero block: scale 1 (numerics.md section 2)
    else:  # blocks along the sequence, one per channel: the zero channels are their own
        assert torch.equal(scales_p[..., :d], scales)
        assert (scales_p[..., d:] == 1).all()


def run_both(dqk, dv, causal, mode, fmt, front=False):
    """(unpadded, padded) fwd + bwd of the CPU fp8 reference; padded outputs sliced
    to the true channels (front: zero channels before the true ones instead)."""
    g = gen("pair", dqk, dv, causal, mode, fmt)
    # Channel gains over 2^-3 .. 2^3, and 16x on channels >= 128 (the second
    # head_dim block): block amaxes depend on which channels share a block.
    c = torch.arange(max(dqk, dv))
    gain = torch.exp2((c % 7 - 3).float()) * torch.where(c >= 128, 16.0, 1.0)
    gq = gain[:dqk] / gain[:dqk].square().mean().sqrt()  # logits of order 1
    q = (torch.randn(1, 2, 100, dqk, generator=g) * gq).bfloat16()
    k = (torch.randn(1, 1, 140, dqk, generator=g) * gq).bfloat16()
    v = (torch.randn(1, 1, 140, dv, generator=g) * gain[:dv]).bfloat16()
    do = (torch.randn(1, 2, 100, dv, generator=g) * gain[:dv]).bfloat16()
    tau = f32_scale(dqk)  # the true head_dim's default
    a, b = kernel_dims(dqk, dv)
    if front:
        padf = lambda x, d: torch.nn.functional.pad(x, (d - x.shape[-1], 0))  # noqa: E731
        cut = lambda x, n: x[..., x.shape[-1] - n:]  # noqa: E731
    else:
        padf, cut = pad, (lambda x, n: x[..., :n])
    o, lse = OPS.fwd(q, k, v, tau, causal, "fp8", 128)
    grads = OPS.bwd(do, q, k, v, o, lse, tau, causal, "fp8", mode, 128, fmt, True)
    op, lp = OPS.fwd(padf(q, a), padf(k, a), padf(v, b), tau, causal, "fp8", 128)
    gp = OPS.bwd(padf(do, b), padf(q, a), padf(k, a), padf(v, b), padf(o, b), lse, tau, causal, "fp8", mode, 128,
                 fmt, True)
    plain = (o, lse) + tuple(grads)
    padded = (cut(op, dv), lp, cut(gp[0], dqk), cut(gp[1], dqk), cut(gp[2], dv), gp[3])
    rest = (op[..., dv:], gp[0][..., dqk:], gp[1][..., dqk:], gp[2][..., dv:]) if not front else ()
    return plain, padded, rest


@pytest.mark.parametrize("dqk,dv", PAIRS, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
def test_padded_problem_equals_unpadded_bitwise(dqk, dv, causal):
    plain, padded, rest = run_both(dqk, dv, causal, "delta_matching", "e4m3")
    for name, x, y in zip(("O", "LSE", "dQ", "dK", "dV", "diag"), plain, padded):
        assert torch.equal(x, y), f"({dqk}, {dv}) causal={causal}: {name} differs after zero padding"
        assert x.abs().amax() > 0, f"{name} is all zero: a vacuous comparison"
    for x in rest:
        assert (x == 0).all(), "padded columns of O / dQ / dK / dV must be exactly 0"


@pytest.mark.parametrize("mode", ["stale", "matched_do", "delta_matching"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_padded_problem_equals_unpadded_every_mode(mode, fmt):
    plain, padded, _ = run_both(200, 72, True, mode, fmt)
    for name, x, y in zip(("O", "LSE", "dQ", "dK", "dV", "diag"), plain, padded):
        assert torch.equal(x, y), f"{mode} {fmt}: {name} differs after zero padding"


def test_negative_control_front_padding_moves_block_boundaries():
    # Zero channels in front of the 200 true ones put true channels 0..71 into
    # the first 128-channel block and 72..199 into the second: other block
    # amaxes (the channel gains of run_both), other codes, another result.
    plain, padded, _ = run_both(200, 200, False, "delta_matching", "e4m3", front=True)
    assert not torch.equal(plain[0], padded[0])
    assert torch.equal(plain[1].isfinite(), padded[1].isfinite())
