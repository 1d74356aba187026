"""Fused FP8 block quantizers for CUDA (Triton): 1x128 rows, 1x128 of the transpose,
both at once, and 128x128 tiles. Used by fp8attn.linear on CUDA tensors.

Each kernel reads its input once and writes FP8 codes and FP32 power-of-two
scales in one pass (amax, scale and cast fused). The codes and scales are bit
for bit those of the torch-op quantizers in fp8attn.linear (docs/numerics.md
section 2 and section 8), computed without floating-point rounding questions:

  * amax is the integer max of |x|'s FP32 bit patterns (for non-negative floats
    the integer order is the float order; NaN patterns sort above +inf), so a
    NaN anywhere in a block shows up (a float max would drop it) and subnormal
    inputs are compared exactly (no flush to zero);
  * the scale exponent comes from amax's exponent and mantissa fields:
    amax = 1.f * 2^(E-127), e = E - 126 - p + [f > 0.75], clamped to [-126, 127]
    (the same e as frexp in fp8attn.linear._scale_from_amax; a subnormal amax
    always clamps to -126); s = 1 for amax == 0, NaN when E == 255 (NaN or inf);
  * codes = fp8(x * 2^-e): 2^-e is an exact normal FP32 number and the product
    is the correctly rounded x / 2^e, the same FP32 value as the torch path's
    x / s; then one round-to-nearest-even cast to FP8 (|x / s| <= fp8_max, so no
    saturation question arises);
  * a block with a NaN scale gets code 0x7F everywhere (a NaN code in both E4M3
    and E5M2); fp8attn.linear canonicalizes its torch path the same way.

Layouts: inputs are any-strided 2-D views; codes are written row-major; scales
are written with the strides the caller gives (fp8attn.linear asks for the
outer-major layout cuBLASLt wants, so no later copy). Output rows (or, for the
transposed codes, output columns) past the input are zero padding: code 0,
scale 1, exactly what zero-padding the input would give.

Why hand-written Triton and not torch.compile of the torch-op quantizers:
bit-exactness is the contract, and here it rests on instructions checked in the
PTX (integer max, mul.f32 without .ftz, cvt.rn.satfinite.e4m3x2/e5m2x2.f32, no
division), where Inductor would choose its own division, float max/NaN
handling and rounding path per version; the transpose and the row+column dual
quantization are one kernel each; and there is no per-shape Inductor compile
(several seconds each) at the first step. Not measured against Inductor.

Requires triton and a CUDA device; fp8attn.linear checks `available()`.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    _HAVE_TRITON = True
except Exception:  # pragma: no cover - triton missing
    _HAVE_TRITON = False

_BLOCK = 128
# fp8_max = 0.875 * 2^P; the code of NaN blocks.
_P = {"e4m3": 9, "e5m2": 16}
_NAN_CODE = 0x7F


def available() -> bool:
    """True when triton imports and a CUDA device is present."""
    return _HAVE_TRITON and torch.cuda.is_available()


if _HAVE_TRITON:

    @triton.jit
    def _scale_bits(amax_bits, P: tl.constexpr):
        """amax bit pattern (int32, >= 0) -> (scale FP32, reciprocal FP32, is_nan)."""
        ex = amax_bits >> 23
        frac = amax_bits & 0x7FFFFF
        e = ex - 126 - P + (frac > 0x600000).to(tl.int32)
        e = tl.minimum(tl.maximum(e, -126), 127)
        is_nan = ex == 255
        is_zero = amax_bits == 0
        e = tl.where(is_nan | is_zero, 0, e)
        # 0x7FC00000: the quiet NaN torch writes for a NaN scale.
        s = tl.where(is_nan, 0x7FC00000, (e + 127) << 23).to(tl.float32, bitcast=True)
        # NOTE: 2^-e for e in [-126, 120] (the largest finite amax gives 120) is normal.
        r = ((127 - e) << 23).to(tl.float32, bitcast=True)
        return s, r, is_nan

    @triton.jit
    def _codes(x, r, is_nan, FP8: tl.constexpr):
        """x FP32 tile, r / is_nan broadcastable -> uint8 codes."""
        q = (x * r).to(FP8).to(tl.uint8, bitcast=True)
        return tl.where(is_nan, (q & 0) | 0x7F, q)

    # NOTE: no specialization on the scale strides (nor on R for the dual kernel, whose
    # loads run along C): fewer compiles per shape, and those stores are scalar per row.
    @triton.jit(do_not_specialize=["ss_r", "ss_b"])
    def _q1x128_kernel(x_ptr, q_ptr, s_ptr, R, C, R_out, C_out, sx_r, sx_c, sq_r, ss_r, ss_b,
                       P: tl.constexpr, FP8: tl.constexpr, BLOCK_R: tl.constexpr):
        """Blocks of 128 along the logical columns of x [R, C] (strides sx_r, sx_c).
        codes [R_out, C_out] (row stride sq_r), scales [R_out, cdiv(C_out, 128)]."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        m_in = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows64[:, None] * sx_r + cols64[None, :] * sx_c, mask=m_in, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        s, r, is_nan = _scale_bits(amax, P)
        q = _codes(x, r[:, None], is_nan[:, None], FP8)
        m_out = (rows[:, None] < R_out) & (cols[None, :] < C_out)
        tl.store(q_ptr + rows64[:, None] * sq_r + cols64[None, :], q, mask=m_out)
        tl.store(s_ptr + rows64 * ss_r + tl.program_id(1) * ss_b, s, mask=rows < R_out)

    @triton.jit(do_not_specialize=["R", "ss_r", "ss_b", "sst_c", "sst_b"])
    def _q1x128_dual_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, R_out, sx_r, sx_c,
                            ss_r, ss_b, sst_c, sst_b,
                            P: tl.constexpr, FP8: tl.constexpr):
        """One 128x128 tile of x [R, C] -> its 1x128 row blocks (codes [R_out, C], scales
        [R_out, C/128]) and its 1x128 column blocks = row blocks of x^T (codes [C, R_out],
        scales [C, R_out/128]). C % 128 == 0; rows past R are zero padding."""
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        rows = pr * 128 + tl.arange(0, 128)
        cols = pc * 128 + tl.arange(0, 128)
        rows64 = rows.to(tl.int64)
        cols64 = cols.to(tl.int64)
        m_in = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows64[:, None] * sx_r + cols64[None, :] * sx_c, mask=m_in, other=0.0)
        x = x.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        # rows (blocks along C)
        s, r, is_nan = _scale_bits(tl.max(bits, axis=1), P)
        q = _codes(x, r[:, None], is_nan[:, None], FP8)
        m_out = (rows[:, None] < R_out) & (cols[None, :] < C)
        tl.store(q_ptr + rows64[:, None] * C + cols64[None, :], q, mask=m_out)
        tl.store(s_ptr + rows64 * ss_r + pc * ss_b, s, mask=rows < R_out)
        # columns (blocks along R): codes of x^T at [col, row]
        st, rt, nan_t = _scale_bits(tl.max(bits, axis=0), P)
        qt = _codes(x, rt[None, :], nan_t[None, :], FP8)
        tl.store(qt_ptr + cols64[None, :] * R_out + rows64[:, None], qt, mask=m_out)
        tl.store(st_ptr + cols64 * sst_c + pr * sst_b, st, mask=cols < C)

    @triton.jit
    def _q128x128_kernel(w_ptr, q_ptr, s_ptr, R, C, sw_r, sw_c, ss_r, ss_c,
                         P: tl.constexpr, FP8: tl.constexpr):
        """One 128x128 tile of w [R, C] -> codes (row-major [R, C]) and one scale."""
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        rows = (pr * 128 + tl.arange(0, 128)).to(tl.int64)
        cols = (pc * 128 + tl.arange(0, 128)).to(tl.int64)
        m = (rows[:, None] < R) & (cols[None, :] < C)
        w = tl.load(w_ptr + rows[:, None] * sw_r + cols[None, :] * sw_c, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(w.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
        s, r, is_nan = _scale_bits(amax, P)
        q = _codes(w, r, is_nan, FP8)
        tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=m)
        tl.store(s_ptr + pr * ss_r + pc * ss_c, s)


def _fp8(fmt: str):
    return (tl.float8e4nv, torch.float8_e4m3fn) if fmt == "e4m3" else (tl.float8e5, torch.float8_e5m2)


def _scales(rows: int, nb: int, outer_major: bool, device) -> torch.Tensor:
    if outer_major:
        return torch.empty(nb, rows, dtype=torch.float32, device=device).t()
    return torch.empty(rows, nb, dtype=torch.float32, device=device)


def quantize_1x128(x: torch.Tensor, fmt: str, rows_out: int = None, cols_out: int = None,
                   outer_major: bool = False):
    """Fused `fp8attn.linear.quantize_1x128` of a CUDA [R, C] view (any strides; pass
    x.t() to quantize the transpose: the transpose is fused into the kernel).

    rows_out >= R / cols_out >= C pad the output with zero rows / columns (code 0,
    and scale 1 for padded rows). outer_major: scales [rows_out, nb] with strides
    (1, rows_out) (cuBLASLt's layout), else contiguous. Returns (codes [rows_out,
    cols_out] fp8 contiguous, scales [rows_out, cdiv(cols_out, 128)] float32).
    """
    r, c = x.shape
    rows_out = r if rows_out is None else rows_out
    cols_out = c if cols_out is None else cols_out
    p = _P[fmt]
    tfp8, dt = _fp8(fmt)
    nb = -(-cols_out // _BLOCK)
    q = torch.empty(rows_out, cols_out, dtype=dt, device=x.device)
    s = _scales(rows_out, nb, outer_major, x.device)
    if rows_out and cols_out:
        # NOTE: 64 rows per program: when the rows are the contiguous dim (a transposed
        # input) 64 x 2 bytes per load row still coalesce; triton specializes stride 1.
        br = 64
        grid = (triton.cdiv(rows_out, br), nb)
        with torch.cuda.device(x.device):
            _q1x128_kernel[grid](x, q.view(torch.uint8), s, r, c, rows_out, cols_out, x.stride(0), x.stride(1),
                                 q.stride(0), s.stride(0), s.stride(1), P=p, FP8=tfp8, BLOCK_R=br, num_warps=8)
    return q, s


def quantize_1x128_dual(x: torch.Tensor, fmt: str, rows_out: int = None, outer_major: bool = True):
    """Both 1x128 quantizations of a CUDA [R, C] view (C % 128 == 0) from one read:
    (codes [rows_out, C], scales [rows_out, C/128]) along C, and (codes^T [C, rows_out],
    scales [C, cdiv(rows_out, 128)]) along R, i.e. quantize_1x128(x) and
    quantize_1x128(x.t()) with rows_out - R zero rows appended to x."""
    r, c = x.shape
    if c % _BLOCK:
        raise ValueError(f"quantize_1x128_dual: argument 'x': columns ({c}) must be a multiple of 128")
    rows_out = r if rows_out is None else rows_out
    p = _P[fmt]
    tfp8, dt = _fp8(fmt)
    nbr = -(-rows_out // _BLOCK)
    q = torch.empty(rows_out, c, dtype=dt, device=x.device)
    qt = torch.empty(c, rows_out, dtype=dt, device=x.device)
    s = _scales(rows_out, c // _BLOCK, outer_major, x.device)
    st = _scales(c, nbr, outer_major, x.device)
    if rows_out and c:
        grid = (nbr, c // _BLOCK)
        with torch.cuda.device(x.device):
            _q1x128_dual_kernel[grid](x, q.view(torch.uint8), s, qt.view(torch.uint8), st, r, c, rows_out,
                                      x.stride(0), x.stride(1), s.stride(0), s.stride(1), st.stride(0),
                                      st.stride(1), P=p, FP8=tfp8, num_warps=8)
    return q, s, qt, st


def quantize_128x128(w: torch.Tensor, fmt: str):
    """Fused `fp8attn.linear.quantize_128x128` of a CUDA [R, C] view: (codes [R, C]
    contiguous, scales [cdiv(R, 128), cdiv(C, 128)] contiguous)."""
    r, c = w.shape
    p = _P[fmt]
    tfp8, dt = _fp8(fmt)
    nr, nc = -(-r // _BLOCK), -(-c // _BLOCK)
    q = torch.empty(r, c, dtype=dt, device=w.device)
    s = torch.empty(nr, nc, dtype=torch.float32, device=w.device)
    if r and c:
        with torch.cuda.device(w.device):
            _q128x128_kernel[(nr, nc)](w, q.view(torch.uint8), s, r, c, w.stride(0), w.stride(1),
                                       s.stride(0), s.stride(1), P=p, FP8=tfp8, num_warps=8)
    return q, s
