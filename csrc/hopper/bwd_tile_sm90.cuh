// fp8attn: device code shared by the sm_90a FP8 backward kernels: FP8 codec
// and block-scale helpers, the tile-pair geometry (TileGeom), the per-row
// quantization of a warp's 16 x 128 accumulator (quantize_rows), the column
// reductions over a warp's keys, the `row` wgmma launchers and the shape
// dispatch of the `tile` kernels. Users: the `row` wgmma backward
// (bwd_wgmma_e4m3_blockscale_sm90.cu) and, through wgmma_sm90.cuh, the `tile`
// backward (mainloop_bwd_tilescale_sm90.cuh). Math: docs/numerics.md sections
// 3-5; design and measurements: docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md.
//
// NOTE: the mma.sync backward (FP16 m16n8k16 on exactly decoded FP8 operands;
// docs/kernels/bwd_sm90.md) was removed on 2026-12-07 with its tile functions
// (shared-memory fills, tile_s / tile_p / tile_dp): code at f7729f9.
//
// Fragment map shared by the kernels: warp w owns keys [16w, 16w+16) of the
// 128-key tile and holds the transposed tiles S^T, dP^T [16 keys x 128
// queries]. Fragment of n8 tile j, thread (g = lane/4, t = lane%4):
//   c[0] = (key g,   query 8j+2t)   c[1] = (key g,   query 8j+2t+1)
//   c[2] = (key g+8, query 8j+2t)   c[3] = (key g+8, query 8j+2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/fp8_codec.h"
#include "hopper/config_sm90.h"
#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace bwd {

// Backward tile constants (kTile, kWarps, kDsBlock, ...) live in config_sm90.h.

constexpr int kFmtE4M3 = static_cast<int>(Fp8Format::kE4M3);
constexpr int kFmtE5M2 = static_cast<int>(Fp8Format::kE5M2);

// ---- small device helpers --------------------------------------------------------

// NaN-propagating max (fmaxf drops NaN): a NaN anywhere in a block must make
// its scale NaN (numerics.md section 2).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Two FP8 codes (byte 0 -> low half) -> FP16x2, exact.
template <int F>
__device__ __forceinline__ uint32_t f16x2_from_fp8x2(uint32_t two) {
  uint32_t h2;
  const uint16_t in = static_cast<uint16_t>(two);
  if constexpr (F == kFmtE4M3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(in));
  }
  return h2;
}

// Two FP32 -> FP8 codes, round-to-nearest-even, finite values saturate, NaN
// stays NaN (the codec's rule; inputs here are x / s with |x / s| <= max or NaN).
// Returns lo in byte 0 and hi in byte 1.
template <int F>
__device__ __forceinline__ uint32_t cvt2(float lo, float hi) {
  uint16_t r;
  if constexpr (F == kFmtE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t h2) {
  __half2 h;
  memcpy(&h, &h2, sizeof(h));
  return __half22float2(h);
}

// Block scale of numerics.md section 2 and its inverse, (s, 1/s), from the
// block's amax (>= 0 or NaN): fp8attn::block_scale_fast / block_scale_inverse
// (common/fp8_codec.h; bit-identical to block_scale, tested on the host over
// every BF16 amax and the clamp ends), not block_scale's frexpf/ldexpf loops.
template <int F>
__device__ __forceinline__ float2 fast_scale(float amax) {
  if (!(amax <= 3.402823466e38f)) return make_float2(NAN, NAN);  // NOTE: one early exit for both
  const float s = block_scale_fast(amax, F == kFmtE4M3 ? Fp8Format::kE4M3 : Fp8Format::kE5M2);
  return make_float2(s, block_scale_inverse(s));
}

// ---- tile geometry and masking ---------------------------------------------------

struct TileGeom {
  int n0, m0;        // first key / query of the tile pair
  int seqlen_q, seqlen_k;
  int causal_off;    // seqlen_k - seqlen_q
  bool causal;
  float c2;          // softmax_scale * log2(e)

  // Query m0 + ql sees key n0 + kl (numerics.md section 1, bottom-right causal).
  __device__ __forceinline__ bool visible(int kl, int ql) const {
    const int key = n0 + kl, qi = m0 + ql;
    return key < seqlen_k && qi < seqlen_q && (!causal || key <= qi + causal_off);
  }
  // Every (key, query) of the tile pair is visible: no per-element masking.
  __device__ __forceinline__ bool interior() const {
    return n0 + kTile <= seqlen_k && m0 + kTile <= seqlen_q &&
           (!causal || n0 + kTile - 1 <= m0 + causal_off);
  }
};

// Quantizes this warp's [16 keys x 128 queries] FP32 tile x (C fragments) per
// key row along the queries (one block = the 128-query tile: the column
// blocking of P for #5 and of dS for #7). Returns the FP8 codes packed per k16
// step (codes[ks][0]: key g, queries 16ks + {2t, 2t+1, 2t+8, 2t+9}; [1]: key
// g+8) and the two row scales (keys g and g+8).
template <int F>
__device__ __forceinline__ void quantize_rows(const float (&x)[16][4], uint32_t (&codes)[8][2], float& s0,
                                              float& s1) {
  // NOTE: the running max starts from the first pair instead of 0: the same
  // value bitwise (max.NaN of |.| >= +0 with +0 is the other operand, and a
  // NaN is the canonical NaN either way); two FMNMX fewer per call (v7).
  float m0 = max_nan(fabsf(x[0][0]), fabsf(x[0][1])), m1 = max_nan(fabsf(x[0][2]), fabsf(x[0][3]));
#pragma unroll
  for (int j = 1; j < 16; ++j) {
    m0 = max_nan(m0, max_nan(fabsf(x[j][0]), fabsf(x[j][1])));
    m1 = max_nan(m1, max_nan(fabsf(x[j][2]), fabsf(x[j][3])));
  }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    m0 = max_nan(m0, __shfl_xor_sync(0xffffffffu, m0, o));
    m1 = max_nan(m1, __shfl_xor_sync(0xffffffffu, m1, o));
  }
  const float2 sc0 = fast_scale<F>(m0), sc1 = fast_scale<F>(m1);
  s0 = sc0.x;
  s1 = sc1.x;
  const float i0 = sc0.y, i1 = sc1.y;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const int j = 2 * ks;
    codes[ks][0] = cvt2<F>(x[j][0] * i0, x[j][1] * i0) | (cvt2<F>(x[j + 1][0] * i0, x[j + 1][1] * i0) << 16);
    codes[ks][1] = cvt2<F>(x[j][2] * i1, x[j][3] * i1) | (cvt2<F>(x[j + 1][2] * i1, x[j + 1][3] * i1) << 16);
  }
}

// Column reduction over the 8 lanes that share t (the 16 keys of a warp, with
// each thread's two rows already combined in v). N = 32: v[2j + e] is the
// thread's value for query 8j + 2t + e (j < 16); out[i] is query
// 16g + 8(i/2) + 2t + i%2 (4 columns per thread). N = 16 (one 64-column half,
// the wgmma backward): j < 8, out[e] is column 8g + 2t + e. Exchange-halving
// butterfly: 28 (N = 32) / 14 (N = 16) shuffles instead of 3N.
template <class Op, int N>
__device__ __forceinline__ void reduce_cols(const float (&v)[N], float (&out)[N / 8], int lane, Op op) {
  static_assert(N == 16 || N == 32, "16 or 32 values per thread");
  const int g = lane >> 2;
  float w[N / 2], x[N / 4];
  const bool b2 = (g >> 2) & 1, b1 = (g >> 1) & 1, b0 = g & 1;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float mine = b2 ? v[i + N / 2] : v[i], send = b2 ? v[i] : v[i + N / 2];
    w[i] = op(mine, __shfl_xor_sync(0xffffffffu, send, 16));
  }
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    const float mine = b1 ? w[i + N / 4] : w[i], send = b1 ? w[i] : w[i + N / 4];
    x[i] = op(mine, __shfl_xor_sync(0xffffffffu, send, 8));
  }
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    const float mine = b0 ? x[i + N / 8] : x[i], send = b0 ? x[i] : x[i + N / 8];
    out[i] = op(mine, __shfl_xor_sync(0xffffffffu, send, 4));
  }
}
__device__ __forceinline__ int reduced_col(int lane, int i) {
  return 16 * (lane >> 2) + 8 * (i >> 1) + 2 * (lane & 3) + (i & 1);
}

struct OpAdd {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct OpMaxNan {
  __device__ __forceinline__ float operator()(float a, float b) const { return max_nan(a, b); }
};

// Launchers of the `row` backward (bwd_wgmma_e4m3_blockscale_sm90.cu; every
// supported_head_dims pair, config_sm90.h).
void launch_wgmma_prepass(const KernelParams& p, cudaStream_t stream);
void launch_wgmma_main(const KernelParams& p, cudaStream_t stream);

// Calls f(Int<DQK>, Int<DV>, Int<FMT>) for the compiled (head_dim_qk,
// head_dim_v) pairs and the grad format of p; throws for other head dims.
// One place for the `tile` backward kernels' shape dispatch (pre-pass and main).
template <int N>
using Int = std::integral_constant<int, N>;

template <class F>
void dispatch_shapes(const KernelParams& p, F&& f) {
  auto with_fmt = [&](auto dqk, auto dv) {
    if (p.grad_format == kFmtE5M2)
      f(dqk, dv, Int<kFmtE5M2>{});
    else
      f(dqk, dv, Int<kFmtE4M3>{});
  };
  const int dqk = p.head_dim_qk, dv = p.head_dim_v;
  if (dqk == 64 && dv == 64) return with_fmt(Int<64>{}, Int<64>{});
  if (dqk == 128 && dv == 128) return with_fmt(Int<128>{}, Int<128>{});
  if (dqk == 256 && dv == 256) return with_fmt(Int<256>{}, Int<256>{});
  if (dqk == 192 && dv == 128) return with_fmt(Int<192>{}, Int<128>{});
  throw std::runtime_error("fp8attn: argument 'head_dim': unsupported (head_dim_qk, head_dim_v) = (" +
                           std::to_string(dqk) + ", " + std::to_string(dv) + ") for the CUDA backward");
}

}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
