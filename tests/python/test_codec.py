"""Cross-check of the FP8 codecs and block-scaled quantization ops against
ml_dtypes, an independent implementation (contract: docs/numerics.md section 2).

ml_dtypes' astype() rounds to nearest even like ours but does not saturate
(out of range -> inf or NaN), so bit-for-bit equality is asserted for
|x| <= fp8_max and our saturation rule is checked separately.
"""
import os

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8attn  # noqa: F401  (loads the ops)
from fp8attn import quant

FORMATS = {
    # fmt: (ml_dtypes type, max, max code, smallest subnormal)
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 0x7E, 2.0**-9),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 0x7B, 2.0**-16),
}


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown by pytest on failure
    return np.random.default_rng(seed)


def ml_encode(x: np.ndarray, fmt: str) -> np.ndarray:
    return x.astype(np.float32).astype(FORMATS[fmt][0]).view(np.uint8)


def ours_encode(x: np.ndarray, fmt: str) -> np.ndarray:
    return quant.fp8_encode(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), fmt).numpy()


def ml_decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    return codes.view(FORMATS[fmt][0]).astype(np.float32)


def assert_same_floats(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Equal bit patterns for non-NaN values (so -0 != +0), NaN exactly where NaN."""
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    assert np.array_equal(nan_a, nan_b), f"{what}: NaN positions differ at {np.flatnonzero(nan_a != nan_b)[:10]}"
    bad = np.flatnonzero(a.view(np.uint32)[~nan_a] != b.view(np.uint32)[~nan_b])
    assert bad.size == 0, f"{what}: {bad.size} values differ, first {a[~nan_a][bad[:5]]} vs {b[~nan_b][bad[:5]]}"


# ---- decode: all 256 codes ------------------------------------------------------


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_code_decodes_like_ml_dtypes(fmt):
    codes = np.arange(256, dtype=np.uint8)
    ours = quant.fp8_decode(torch.from_numpy(codes), fmt).numpy()
    assert ours.dtype == np.float32
    assert_same_floats(ours, ml_decode(codes, fmt), f"{fmt} decode")
    assert np.isnan(ours).sum() == (2 if fmt == "e4m3" else 6)
    # and re-encoding gives the code back (NaN codes: some NaN code)
    back = ours_encode(ours, fmt)
    finite_or_inf = ~np.isnan(ours)
    assert np.array_equal(back[finite_or_inf], codes[finite_or_inf])
    assert np.isnan(ml_decode(back[~finite_or_inf], fmt)).all()


# ---- encode: random values in every binade, midpoints, special values -------------


def random_floats(rng, n: int, fmt: str) -> np.ndarray:
    """Random float32 with log2|x| uniform from 4 binades below the smallest
    subnormal to 3 above max (random 23-bit mantissas), plus FP32 subnormals."""
    _, fmax, _, min_sub = FORMATS[fmt]
    lo, hi = int(np.log2(min_sub)) - 4, int(np.ceil(np.log2(fmax))) + 3
    exp = rng.integers(lo, hi, size=n)
    mant = rng.integers(0, 1 << 23, size=n, dtype=np.uint32)
    sign = rng.integers(0, 2, size=n, dtype=np.uint32) << 31
    bits = sign | ((exp + 127).astype(np.uint32) << 23) | mant
    x = bits.view(np.float32)
    sub = (rng.integers(1, 1 << 23, size=n // 50, dtype=np.uint32)).view(np.float32)  # FP32 subnormals
    return np.concatenate([x, sub, -sub])


def midpoints(fmt: str) -> np.ndarray:
    """Every midpoint between adjacent non-negative finite values, their
    float32 neighbours, all of both signs."""
    _, _, max_code, _ = FORMATS[fmt]
    v = ml_decode(np.arange(max_code + 1, dtype=np.uint8), fmt).astype(np.float64)
    mid = ((v[:-1] + v[1:]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (v[:-1] + v[1:]) / 2)  # exact in float32
    pts = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    return np.concatenate([pts, -pts])


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_encode_matches_ml_dtypes_bit_for_bit_within_range(fmt, rng):
    _, fmax, _, _ = FORMATS[fmt]
    x = np.concatenate([random_floats(rng, 500_000, fmt), midpoints(fmt)])
    inside = np.abs(x) <= fmax
    assert inside.sum() > 400_000 and (~inside).sum() > 10_000  # both regimes well covered
    ours, ref = ours_encode(x, fmt), ml_encode(x, fmt)
    bad = np.flatnonzero((ours != ref) & inside)
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[bad[:5]]} ours={ours[bad[:5]]} ml={ref[bad[:5]]}"
    # Subnormal outputs and signed zeros really occur in the compared set.
    mag = ours[inside] & 0x7F
    assert (mag == 0).any() and ((mag > 0) & (mag < (8 if fmt == "e4m3" else 4))).any()
    assert (ours[inside] == 0x80).any()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_midpoints_round_to_even(fmt):
    _, _, max_code, _ = FORMATS[fmt]
    v = ml_decode(np.arange(max_code + 1, dtype=np.uint8), fmt)
    mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    lower = np.arange(max_code, dtype=np.uint8)
    even = np.where(lower % 2 == 0, lower, lower + 1).astype(np.uint8)
    assert np.array_equal(ours_encode(mid, fmt), even)
    assert np.array_equal(ours_encode(-mid, fmt), even | 0x80)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_saturation_and_non_finite_follow_the_documented_rule(fmt, rng):
    _, fmax, max_code, _ = FORMATS[fmt]
    big = np.concatenate(
        [
            np.float32(fmax) * (1 + rng.random(10_000, dtype=np.float32)) * 2.0 ** rng.integers(0, 90, 10_000),
            np.array([np.nextafter(np.float32(fmax), np.float32(np.inf)), np.finfo(np.float32).max]),
        ]
    ).astype(np.float32)
    assert np.isfinite(big).all() and (big > fmax).all()
    assert (ours_encode(big, fmt) == max_code).all()
    assert (ours_encode(-big, fmt) == (0x80 | max_code)).all()
    # ml_dtypes does not saturate: this is where the two rules differ.
    assert not np.isfinite(ml_decode(ml_encode(big[-1:], fmt), fmt)).any()

    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=np.float32)
    dec = quant.fp8_decode(quant.fp8_encode(torch.from_numpy(special), fmt), fmt).numpy()
    assert np.isnan(dec[:2]).all()
    if fmt == "e4m3":
        assert np.isnan(dec[2:4]).all()  # no inf in E4M3: inf -> NaN, never +-448
    else:
        assert dec[2] == np.inf and dec[3] == -np.inf
    assert dec[4] == 0 and not np.signbit(dec[4])
    assert dec[5] == 0 and np.signbit(dec[5])


def test_encode_accepts_bf16_and_strided_input(rng):
    x = torch.from_numpy(random_floats(rng, 4096, "e4m3")[:4096].reshape(64, 64))
    assert torch.equal(quant.fp8_encode(x.t(), "e4m3"), quant.fp8_encode(x.t().contiguous(), "e4m3"))
    xb = x.clamp(-400, 400).to(torch.bfloat16)
    assert torch.equal(quant.fp8_encode(xb, "e5m2"), quant.fp8_encode(xb.float(), "e5m2"))


# ---- blockwise quantization vs a numpy implementation of numerics.md --------------


def ref_quantize_blockwise(x: np.ndarray, dim: int, B: int, fmt: str):
    """numerics.md section 2, written directly: s = 2^ceil(log2(amax / fmax)),
    s = 1 for amax == 0, exponent clamped to [-126, 127], NaN for a non-finite
    block; codes = fp8(x / s) by ml_dtypes."""
    ml_t, fmax, _, _ = FORMATS[fmt]
    xt = np.moveaxis(x, dim, -1)
    n = xt.shape[-1]
    nb = -(-n // B)
    pad = np.zeros(xt.shape[:-1] + (nb * B - n,), dtype=np.float32)
    blocks = np.concatenate([xt, pad], axis=-1).reshape(xt.shape[:-1] + (nb, B))
    with np.errstate(invalid="ignore", divide="ignore"):
        amax = np.abs(blocks).max(axis=-1).astype(np.float64)
        finite = np.isfinite(blocks).all(axis=-1)
        e = np.ceil(np.log2(amax / fmax))
        e = np.clip(np.where(amax > 0, e, 0.0), -126, 127)
    scales = np.where(finite, np.exp2(e), np.nan).astype(np.float32)  # [..., nb]
    s_elem = np.repeat(scales, B, axis=-1)[..., :n]
    with np.errstate(invalid="ignore"):
        codes = (xt / s_elem).astype(np.float32).astype(ml_t)
    deq = codes.astype(np.float32) * s_elem
    deq[~np.isfinite(s_elem)] = np.nan
    return (
        np.moveaxis(codes.view(np.uint8), -1, dim),
        np.moveaxis(scales, -1, dim),
        np.moveaxis(deq, -1, dim),
        np.moveaxis(~np.isfinite(s_elem), -1, dim),
    )


def random_tensor(rng, shape, spread=10):
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-spread, spread // 2, shape))
    x[x == 0] = 1.0
    return x.astype(np.float32)


CASES = [((33, 200), d) for d in (0, 1, -1)] + [((2, 3, 70, 20), d) for d in (0, 1, 2, 3)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("B", [32, 64, 128])
@pytest.mark.parametrize("shape,dim", CASES)
def test_blockwise_matches_numpy_reference(shape, dim, B, fmt, rng):
    x = random_tensor(rng, shape)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size)] = np.nan  # poisons exactly one block
    if fmt == "e5m2":
        flat[rng.integers(0, flat.size)] = -np.inf
    codes, scales = quant.quantize_blockwise(torch.from_numpy(x), dim, B, fmt)
    rc, rs, rd, bad = ref_quantize_blockwise(x, dim, B, fmt)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float32
    assert tuple(codes.shape) == shape and tuple(scales.shape) == rs.shape
    assert_same_floats(scales.numpy(), rs, "scales")
    assert np.array_equal(codes.numpy()[~bad], rc[~bad])
    deq = quant.dequantize_blockwise(codes, scales, dim, B, fmt).numpy()
    assert_same_floats(deq, rd, "dequantized")
    # The NaN / inf poisoned only its own block(s): everything else is finite.
    assert 0 < bad.sum() <= 2 * B and np.isfinite(deq[~bad]).all()
    # Error bound (tests/cpp/test_block_quant.cpp derives it): |x - deq| <=
    # max(2^-(M+1) |x|, half the smallest subnormal * s).
    M, half_sub = (3, 2.0**-10) if fmt == "e4m3" else (2, 2.0**-17)
    s_elem = np.take(rs, np.arange(x.shape[dim]) // B, axis=dim)
    bound = np.maximum(2.0 ** -(M + 1) * np.abs(x), half_sub * s_elem)
    assert (np.abs(x - deq)[~bad] <= bound[~bad]).all()


def test_blockwise_zero_and_subnormal_blocks(rng):
    x = random_tensor(rng, (4, 128))
    x[1] = 0.0
    x[2] *= np.float32(1e-39)  # FP32 subnormals: the scale clamps at 2^-126
    codes, scales = quant.quantize_blockwise(torch.from_numpy(x), -1, 128, "e4m3")
    assert scales[1, 0] == 1.0 and (codes[1] == 0).all()
    assert scales[2, 0] == 2.0**-126
    deq = quant.dequantize_blockwise(codes, scales, -1, 128, "e4m3").numpy()
    assert np.isfinite(deq).all() and (deq[1] == 0).all() and (deq[2] != 0).sum() > 64
    _, rs, rd, _ = ref_quantize_blockwise(x, 1, 128, "e4m3")
    assert_same_floats(scales.numpy(), rs, "scales")
    assert_same_floats(deq, rd, "dequantized")


def test_blockwise_strided_and_bf16_input(rng):
    x = torch.from_numpy(random_tensor(rng, (2, 40, 3, 64))).transpose(1, 2)  # non-contiguous
    c1, s1 = quant.quantize_blockwise(x, 2, 32, "e4m3")
    c2, s2 = quant.quantize_blockwise(x.contiguous(), 2, 32, "e4m3")
    assert torch.equal(c1, c2) and torch.equal(s1, s2) and c1.is_contiguous()
    xb = x.to(torch.bfloat16)
    c3, s3 = quant.quantize_blockwise(xb, -1, 64, "e5m2")
    c4, s4 = quant.quantize_blockwise(xb.float(), -1, 64, "e5m2")
    assert torch.equal(c3, c4) and torch.equal(s3, s4)


def test_fake_kernels_give_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 70, 20)
        codes, scales = quant.quantize_blockwise(x, 2, 32, "e4m3")
        assert codes.shape == x.shape and codes.dtype == torch.uint8
        assert scales.shape == (2, 3, 3, 20) and scales.dtype == torch.float32
        out = quant.dequantize_blockwise(codes, scales, 2, 32, "e4m3")
        assert out.shape == x.shape and out.dtype == torch.float32
        assert quant.fp8_encode(x, "e5m2").dtype == torch.uint8
        assert quant.fp8_decode(codes, "e5m2").dtype == torch.float32


# ---- argument errors name the argument ---------------------------------------------


def _raises(fn, arg):
    with pytest.raises(ValueError, match=f"'{arg}'"):
        fn()


def test_bad_arguments_raise_value_error_naming_the_argument():
    x = torch.randn(4, 64)
    codes, scales = quant.quantize_blockwise(x, 1, 32)
    _raises(lambda: quant.fp8_encode(x, "e4m3fn"), "fmt")
    _raises(lambda: quant.fp8_encode(x.double(), "e4m3"), "x")
    _raises(lambda: quant.fp8_encode(x.int(), "e4m3"), "x")
    _raises(lambda: quant.fp8_decode(x, "e4m3"), "codes")
    _raises(lambda: quant.fp8_decode(codes, "E5"), "fmt")
    _raises(lambda: quant.quantize_blockwise(torch.randn(2, 3, 64), -1, 32), "x")  # rank 3
    _raises(lambda: quant.quantize_blockwise(x, 2, 32), "dim")
    _raises(lambda: quant.quantize_blockwise(x, -3, 32), "dim")
    for B in (0, 16, 48, 256):
        _raises(lambda: quant.quantize_blockwise(x, 1, B), "block_size")
    _raises(lambda: quant.quantize_blockwise(x, 1, 32, "fp8"), "fmt")
    _raises(lambda: quant.dequantize_blockwise(codes, scales[:, :1], 1, 32), "scales")
    _raises(lambda: quant.dequantize_blockwise(codes, scales.double(), 1, 32), "scales")
    _raises(lambda: quant.dequantize_blockwise(codes.float(), scales, 1, 32), "codes")
    _raises(lambda: quant.dequantize_blockwise(codes, scales, 1, 64), "scales")  # wrong B for these scales
    _raises(lambda: quant.dequantize_blockwise(codes, scales, 5, 32), "dim")


@pytest.mark.parametrize("op", ["quantize", "dequantize", "encode"])
def test_quant_ops_refuse_backward(op):
    """FP8 rounding has no useful derivative: backward must raise, not silently give None."""
    x = torch.randn(4, 64, requires_grad=True)
    if op == "encode":
        # uint8 codes cannot carry a gradient at all.
        assert not fp8attn.fp8_encode(x).requires_grad
        return
    codes, scales = fp8attn.quantize_blockwise(x, -1, 32)
    y = scales if op == "quantize" else fp8attn.dequantize_blockwise(codes, scales, -1, 32)
    with pytest.raises(RuntimeError, match="not differentiable"):
        y.sum().backward()
