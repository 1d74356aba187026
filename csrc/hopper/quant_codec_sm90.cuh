// fp8attn: device helpers shared by the sm_90a quantization kernels of both
// scaling recipes (quant_e4m3_blockscale_sm90.cu: `row`;
// quant_tilescale_e4m3_sm90.cu: `tile`). Math: numerics.md section 2 (scale
// rule, RNE, saturation, block NaN); the CPU counterparts are
// fp8attn::block_scale / fp8_encode (common/fp8_codec.h).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_codec.h"

namespace fp8attn {
namespace sm90 {
namespace quantdev {

__device__ __forceinline__ float bf16_bits_to_float(uint32_t u16) { return __uint_as_float(u16 << 16); }

// Largest |x| of the two BF16 in each 16-bit half, as bits: for non-negative
// floats the bit patterns order like the values, and a half >= 0x7f80 is inf
// or NaN, so one integer max gives both the amax and the block's finiteness.
__device__ __forceinline__ uint32_t vmax_u16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("max.u16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
constexpr uint32_t kAbsBf16x2 = 0x7fff7fffu;
constexpr uint32_t kBf16InfBits = 0x7f80u;  // |x| bits >= this: inf or NaN

// Scale of a block from the bits of its amax (vmax_u16x2; NaN for a block
// holding inf / NaN) and 1 / scale, exact (a power of two; 2^-127 is subnormal).
struct BlockScale {
  float s, inv_s;
};
__device__ __forceinline__ BlockScale scale_of_bits(uint32_t amax_bits, Fp8Format fmt) {
  BlockScale r;
  if (amax_bits >= kBf16InfBits) {
    r.s = r.inv_s = NAN;
    return r;
  }
  // NOTE: block_scale_fast / block_scale_inverse (common/fp8_codec.h): the
  // generic block_scale's frexp / ldexp loops were most of this kernel's
  // instructions, and 1.f / s a full division.
  r.s = block_scale_fast(__uint_as_float(amax_bits << 16), fmt);
  r.inv_s = block_scale_inverse(r.s);
  return r;
}

// Codes of (a, b, c, d) * inv_s, `a` in the low byte.
// NOTE: in a finite block every |x * inv_s| <= the format's max (the scale
// rule) and the product is exact (inv_s is a power of two), so the hardware
// round-to-nearest-even conversion (F2FP, two values per instruction) gives
// exactly fp8_encode's codes; a non-finite block (NaN scale) keeps the
// software encoder, whose NaN codes keep the value's sign bit.
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d, float inv_s, bool finite,
                                            Fp8Format fmt) {
  if (finite) {
    const __nv_fp8_interpretation_t k = fmt == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a * inv_s, b * inv_s), __NV_SATFINITE, k);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c * inv_s, d * inv_s), __NV_SATFINITE, k);
    return lo | (hi << 16);
  }
  return static_cast<uint32_t>(fp8_encode(a * inv_s, fmt)) | static_cast<uint32_t>(fp8_encode(b * inv_s, fmt)) << 8 |
         static_cast<uint32_t>(fp8_encode(c * inv_s, fmt)) << 16 | static_cast<uint32_t>(fp8_encode(d * inv_s, fmt)) << 24;
}

}  // namespace quantdev
}  // namespace sm90
}  // namespace fp8attn
