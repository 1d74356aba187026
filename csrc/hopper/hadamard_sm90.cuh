// fp8attn: the `qk_rotation="hadamard"` rotation of Q / K rows in registers
// (numerics.md section 10.1, the bit-exact rule; CPU counterpart:
// reference/qk_transform.h). Used where a kernel already holds whole rows:
// the `tile` quantization (quant_tilescale_e4m3_sm90.cu, x R before the
// codes) and the gradient map-back (hadamard_rows_bf16_sm90.cu, g R^T).
//
// Lane map (the `tile` quantizer's, TileGeom): a lane holds one 16-channel
// unit u of a row (channels [16 u, 16 u + 16), value i = channel 16 u + i),
// and the lanes of a row are consecutive with u in their low bits, so the
// partner of unit u at butterfly distance h >= 16 is lane ^ (h / 16).
// head_dim 64 / 128 / 256 is one block; 192 is 128 + 64 (units 0-7, 8-11).
//
// Arithmetic: the reference's operations in its order (signs, butterflies h =
// 1, 2, ..., n / 2, times 1/sqrt(n) rounded to FP32; transposed: butterflies,
// norm, signs), each FP32 add / sub / mul rounded on its own (__fadd_rn and
// friends: no contraction), so the values are the reference's bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fp8attn {
namespace sm90 {
namespace hadamard {

constexpr int kUnit = 16;  // channels per lane

// The fixed sign of channel c (numerics.md 10.1 "Signs"): true when -1.
__device__ __forceinline__ bool sign_negative(int c) {
  uint64_t z = (static_cast<uint64_t>(c) + 1u) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 63) != 0;
}

// Bit i set: channel 16 u + i has sign -1 (once per thread: the 64-bit hash is
// not free; callers that rotate several rows of the same unit reuse it).
__device__ __forceinline__ uint32_t unit_sign_mask(int u) {
  uint32_t m = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) m |= sign_negative(16 * u + i) ? (1u << i) : 0u;
  return m;
}

// The Hadamard block size of unit u of a kDim-channel row.
template <int kDim>
__device__ __forceinline__ int block_of_unit(int u) {
  static_assert(kDim == 64 || kDim == 128 || kDim == 192 || kDim == 256, "head_dim of the fused rotation");
  if constexpr (kDim == 192) return u < 8 ? 128 : 64;
  return kDim;
}

// 1/sqrt(n) computed in FP64 and rounded to FP32 (reference hadamard_norm<float>).
__device__ __forceinline__ float norm_of_block(int n) {
  return static_cast<float>(1.0 / sqrt(static_cast<double>(n)));
}

// Butterflies h = 1 .. n / 2 of the lane's unit (in-lane h < 16, then across
// lanes). Every lane of the warp must call it (full-warp shuffles); a lane whose
// unit is past the row (u >= kDim / 16) passes n = 0 and keeps its values.
__device__ __forceinline__ void butterflies(float (&x)[kUnit], int n, int lane) {
#pragma unroll
  for (int h = 1; h < kUnit; h *= 2)
#pragma unroll
    for (int i = 0; i < kUnit; ++i)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = __fadd_rn(a, b);
        x[i + h] = __fsub_rn(a, b);
      }
#pragma unroll
  for (int s = 1; s < 16; s *= 2) {  // h = 16 s: lanes s apart
    const bool upper = (lane & s) != 0;
    const bool apply = kUnit * s < n;  // uniform over the row's lanes
#pragma unroll
    for (int i = 0; i < kUnit; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, x[i], s);
      // (a, b) -> (a + b, a - b) with a the lower unit's value, b the upper's.
      if (apply) x[i] = upper ? __fsub_rn(other, x[i]) : __fadd_rn(x[i], other);
    }
  }
}

// x <- x R on unit u of a kDim row (forward rotation of Q / K); neg =
// unit_sign_mask(u).
template <int kDim>
__device__ __forceinline__ void rotate_unit(float (&x)[kUnit], int u, uint32_t neg, int lane) {
  const int n = u < kDim / kUnit ? block_of_unit<kDim>(u) : 0;
#pragma unroll
  for (int i = 0; i < kUnit; ++i)
    if (n > 0 && ((neg >> i) & 1u)) x[i] = -x[i];
  butterflies(x, n, lane);
  if (n == 0) return;
  const float c = norm_of_block(n);
#pragma unroll
  for (int i = 0; i < kUnit; ++i) x[i] = __fmul_rn(x[i], c);
}

// g <- g R^T on unit u of a kDim row (a gradient mapped back); neg as above.
template <int kDim>
__device__ __forceinline__ void rotate_unit_transposed(float (&x)[kUnit], int u, uint32_t neg, int lane) {
  const int n = u < kDim / kUnit ? block_of_unit<kDim>(u) : 0;
  butterflies(x, n, lane);
  if (n == 0) return;
  const float c = norm_of_block(n);
#pragma unroll
  for (int i = 0; i < kUnit; ++i) {
    x[i] = __fmul_rn(x[i], c);
    if ((neg >> i) & 1u) x[i] = -x[i];
  }
}

}  // namespace hadamard
}  // namespace sm90
}  // namespace fp8attn
