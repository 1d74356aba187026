// fp8attn: device helpers shared by the two sm_90a forward kernels
// (fwd_e4m3_blockscale_sm90.cu, fwd_wgmma_e4m3_blockscale_sm90.cu): exp2,
// E4M3 packing of P and the exact E4M3 block scale (numerics.md sections 2-3).
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_codec.h"

namespace fp8attn {
namespace sm90 {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two FP32 -> two E4M3 codes (RNE, saturating, NaN kept), `lo` in the low byte.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  return cvt_e4m3x2(x0, x1) | (cvt_e4m3x2(x2, x3) << 16);
}

// numerics.md section 2 E4M3 block scale, exact: the smallest power of two s
// (exponent clamped to [-126, 127]) with amax / s <= 448. For a normal amax =
// m * 2^E (m in [1, 2)), 448 = 1.75 * 2^8 gives e = E - 8 (+1 if m > 1.75).
// Zero, subnormal and non-finite amax go through fp8attn::block_scale.
__device__ __forceinline__ float block_scale_e4m3(float amax) {
  if (!(amax >= 1.17549435e-38f) || !(amax <= 3.40282347e38f)) return block_scale(amax, Fp8Format::kE4M3);
  const uint32_t u = __float_as_uint(amax);
  int e = static_cast<int>(u >> 23) - 127 - 8 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = max(-126, min(127, e));
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

}  // namespace sm90
}  // namespace fp8attn
