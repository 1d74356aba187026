// fp8attn: device helpers of the sm_90a forward kernels (the `row` wgmma
// kernel, fwd_wgmma_e4m3_blockscale_sm90.cu, and the `tile` one through
// softmax_tilescale_sm90.cuh): exp2, E4M3 packing of P, the exact E4M3 block
// scale and the online-softmax row step (numerics.md sections 2-3).
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
// NOTE: the rule of fp8attn::block_scale_fast (common/fp8_codec.h, host-tested
// bit-identical to block_scale), kept in this form: calling block_scale_fast
// here made the three-warpgroup forward at head_dim 64 5-9% slower (H200,
// 2026-11-30 03:03 UTC, same call), the other kernels unchanged.
__device__ __forceinline__ float block_scale_e4m3(float amax) {
  if (!(amax >= 1.17549435e-38f) || !(amax <= 3.40282347e38f)) return block_scale(amax, Fp8Format::kE4M3);
  const uint32_t u = __float_as_uint(amax);
  int e = static_cast<int>(u >> 23) - 127 - 8 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = max(-126, min(127, e));
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}

// fp8attn::block_scale_fast for E4M3 (bit-identical on every input: 0 -> 1,
// NaN / inf -> NaN, a subnormal on the clamp 2^-126) with selects instead of
// its early returns, which nvcc keeps as branches; `ex` = the scale's
// exponent field - 127 (128 for NaN), without reading it back from the scale.
__device__ __forceinline__ float block_scale_e4m3_select(float amax, int& ex) {
  const uint32_t u = __float_as_uint(amax);
  int e = static_cast<int>(u >> 23) - 127 - 8 + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = max(-126, min(127, e));
  const bool finite = amax <= 3.402823466e38f;
  ex = finite ? (u == 0u ? 0 : e) : 128;
  return __uint_as_float(finite ? (u == 0u ? 0x3f800000u : static_cast<uint32_t>(e + 127) << 23) : 0x7fc00000u);
}

// One row's online-softmax step over one key tile (numerics.md section 3,
// "Forward P"), shared by every forward kernel so they round the same values.
// In: `mx` this thread's max of the row's raw S values in the tile (S = t * s_k,
// before the row factor), `rq` = s_q * softmax_scale * log2(e), `m_run` the
// running max in the log2 domain (-inf before the first visible key). Reduces
// mx over the 4 threads of the quad, updates m_run and returns
//   alpha = exp2(m_old - m_new)   (rescales O and l),
//   sp    = block scale of the tile's P row = block_scale(exp2(max - m_new)),
//   nbias such that P / sp = exp2(fmaf(S, rq, nbias)) (NaN when sp is NaN).
// P_j = exp2(S_j - m) with m the running max: the block scale comes from
// amax_j P_j = exp2(max_j S_j - m) (exp2 is monotonic) and the codes are
// E4M3(exp2(S_j - m - log2 sp)) (sp is a power of two), so neither the amax
// nor the division needs a pass over the tile.
//   esp   = sp's exponent (its field - 127: 128 for NaN).
// kBranchFree: the block scale by block_scale_e4m3_select (bit-identical to
// block_scale_e4m3 on every amax), for a caller whose two rows' steps should
// interleave (a branch keeps ptxas from moving the second row's shuffles and
// exp2 over the first row's); esp then comes from the integer exponent, not
// read back from sp (4 fewer dependent instructions before the exp2s).
struct SoftmaxRowStep {
  float alpha, sp, nbias;
  int esp;
};
template <bool kBranchFree = false>
__device__ __forceinline__ SoftmaxRowStep softmax_row_step(float mx, float rq, float& m_run) {
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mx2 = mx * rq;  // log2 domain; -inf for a fully masked row
  const float m_new = fmaxf(m_run, mx2);
  // NOTE: a row with no visible key so far keeps m = -inf; exp base 0 then
  // gives P = 0 and alpha = 0 instead of NaN from (-inf) - (-inf).
  const float base = m_new == -INFINITY ? 0.f : m_new;
  SoftmaxRowStep r;
  r.alpha = fast_exp2(m_run - base);
  m_run = m_new;
  const float amax = fast_exp2(mx2 - base);
  if constexpr (kBranchFree) {
    r.sp = block_scale_e4m3_select(amax, r.esp);
  } else {
    r.sp = block_scale_e4m3(amax);
    r.esp = static_cast<int>((__float_as_uint(r.sp) >> 23) & 0xffu) - 127;
  }
  const float bias = base + static_cast<float>(r.esp);
  r.nbias = r.sp == r.sp ? -bias : NAN;  // a NaN scale keeps the row NaN
  return r;
}

}  // namespace sm90
}  // namespace fp8attn
