// fp8attn: block-scaled FP8 quantization on the CPU (numerics.md section 2).
//
// Two levels:
//   - quantize_block: one block of n strided elements (the primitive the CPU
//     reference uses for its operand and P/dS tiles);
//   - quantize_blockwise / dequantize_blockwise: a whole contiguous FP32
//     tensor of rank 2 or 4, cut into blocks of B consecutive elements along
//     one axis `dim` (the matmul's reduction dimension, numerics.md section 3).
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "common/fp8_codec.h"

namespace fp8attn {

// Decoded value of every one of the 256 codes of a format (a NaN code decodes
// to NaN, an E5M2 inf code to +-inf). Built once from fp8_decode, so it is the
// same function, only faster (no ldexpf per element).
inline const float* fp8_decode_table(Fp8Format fmt) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int c = 0; c < 256; ++c) {
      t[0][c] = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE4M3);
      t[1][c] = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE5M2);
    }
    return t;
  }();
  return tables[fmt == Fp8Format::kE5M2 ? 1 : 0].data();
}

// Quantizes one block of n elements x[0], x[stride], ... with the power-of-two
// block scale of numerics.md section 2. Writes the FP8 codes (if codes != null)
// and the decoded values x_hat * s (if decoded != null, same stride as x) and
// returns the scale s. A block holding NaN or +-inf gets a NaN scale and a
// NaN decoded block (numerics.md: non-finite input is never saturated).
inline float quantize_block(const float* x, int64_t n, int64_t stride, Fp8Format fmt,
                            uint8_t* codes, float* decoded) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i * stride]);
    finite &= std::isfinite(a);
    amax = a > amax ? a : amax;
  }
  const float s = finite ? block_scale(amax, fmt) : NAN;
  const float inv_s = 1.f / s;  // exact: s is a power of two
  const float* table = fp8_decode_table(fmt);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t c = fp8_encode(x[i * stride] * inv_s, fmt);
    if (codes) codes[i * stride] = c;
    if (decoded) decoded[i * stride] = table[c] * s;
  }
  return s;
}

// Number of blocks along an axis of length n: ceil(n / block_size).
inline int64_t num_blocks(int64_t n, int64_t block_size) {
  return (n + block_size - 1) / block_size;
}

// Block-scaled quantization of a whole tensor along one axis.
//
//   x      contiguous (row-major) FP32 tensor of the given shape, rank 2 or 4.
//   dim    the blocked axis, in [-rank, rank) (negative counts from the end).
//          Its length n need not be a multiple of block_size: the last block
//          is then a shorter block of n % block_size elements (so B = 128 on
//          an axis of 64 behaves as numerics.md's "B = d" rule).
//   block_size  B in {32, 64, 128}.
//   codes  out: uint8 FP8 codes, same shape as x (contiguous).
//   scales out: FP32 block scales, contiguous, shape of x with shape[dim]
//          replaced by ceil(n / B); the scale of the block holding x[..., i, ...]
//          (i along dim) is scales[..., i / B, ...].
//
// Scale rule and rounding: numerics.md section 2 (see quantize_block). An
// all-zero block gets scale 1 and zero codes; a block holding NaN or +-inf
// gets a NaN scale and NaN codes, and no other block is affected.
// Pointers may be null only when the tensor has no element.
// Throws ArgumentError (naming the argument) for rank not in {2, 4}, dim out
// of range, a negative extent in shape, block_size not in {32, 64, 128}, an
// unknown fmt or a null pointer.
void quantize_blockwise(const float* x, const int64_t* shape, int rank, int dim, int block_size,
                        Fp8Format fmt, uint8_t* codes, float* scales);

// Inverse of quantize_blockwise: out = decode(codes) * scale of the element's
// block (exact in FP32, since scales are powers of two). Same shapes, layout
// and argument checks as quantize_blockwise; out is FP32, contiguous, the
// shape of codes. A NaN scale gives a NaN block.
void dequantize_blockwise(const uint8_t* codes, const float* scales, const int64_t* shape, int rank,
                          int dim, int block_size, Fp8Format fmt, float* out);

}  // namespace fp8attn
