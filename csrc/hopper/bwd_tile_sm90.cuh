// fp8attn: device code shared by the sm_90a FP8 backward kernels (Delta-Matching
// pre-pass and main backward). Math: docs/numerics.md sections 3-5; design and
// measurements: docs/kernels/bwd_sm90.md.
//
// Tensor cores. On sm_90a, ptxas lowers the FP8 `mma.sync.m16n8k32.e4m3/e5m2`
// to F2FP conversions (FP8 -> FP16) followed by two HMMA.16816.F32 (seen in
// the SASS of the first version of these kernels). So the kernels decode each
// FP8 operand tile ONCE into exact FP16 values (every E4M3/E5M2 value is an
// FP16 value) and issue m16n8k16 FP16 MMAs with FP32 accumulation: the same
// tensor-core instruction and the same numbers (exact products, FP32 sums per
// block, scales applied to the FP32 partial), without re-converting the
// shared operands in every warp. Operands that one warp reads alone (its K/V
// rows, its dS rows) stay FP8 in shared memory and are decoded per use.
//
// The pre-pass and the main kernel call the SAME tile functions (tile_s,
// tile_p, tile_dp) with the same warp -> key mapping, so P and dP_hat of a tile
// are bitwise identical in both; that makes the Delta-Matching zero-row-sum
// invariant hold to FP32 rounding (numerics.md section 4). Every FP32 step
// that produces P or dP_hat is written with explicit rounding (__fmul_rn,
// __fadd_rn, fmaf) so the compiler cannot contract it differently in the two
// kernels.
//
// Warp layout (both kernels): 8 warps; warp w owns keys [16w, 16w+16) of the
// 128-key tile and computes the transposed tiles S^T, dP^T [16 keys x 128
// queries]. Fragment of n8 tile j, thread (g = lane/4, t = lane%4):
//   c[0] = (key g,   query 8j+2t)   c[1] = (key g,   query 8j+2t+1)
//   c[2] = (key g+8, query 8j+2t)   c[3] = (key g+8, query 8j+2t+1)
// Two adjacent n8 tiles are exactly the A fragment (16 keys x 16 queries) of
// m16n8k16, so P^T and dS^T feed dV = P^T dO and dK = dS^T Q from registers.
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

// Backward tile constants (kTile, kWarps, kSlice, ...) live in config_sm90.h.

constexpr int kFmtE4M3 = static_cast<int>(Fp8Format::kE4M3);
constexpr int kFmtE5M2 = static_cast<int>(Fp8Format::kE5M2);

// Row stride (bytes) of a shared [128][D] operand tile: FP16 when D <= 128
// (one head-dim block: read by all warps as the B operand), else FP8.
constexpr bool half_rows(int d) { return d <= 128; }
constexpr int row_ld(int d) { return (half_rows(d) ? 2 * d : d) + kRowPad; }

// ---- small device helpers --------------------------------------------------------

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

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

// D = A * B + D, m16n8k16, FP16 operands (exact FP8 values), FP32 accumulate.
__device__ __forceinline__ void hmma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                     uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8x8 FP16 matrices from shared memory (rows of 16 bytes at `row_addr`).
__device__ __forceinline__ void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                        const uint8_t* row_addr) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row_addr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(a));
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

// ---- shared-memory tile fills (global FP8 -> shared FP8 or FP16) --------------------
//
// Layouts in shared memory:
//  * "p8" rows: FP8 codes, each 16-element group stored in the order
//    d = 0 1 8 9 2 3 10 11 4 5 12 13 6 7 14 15, so one 32-bit load at byte 4t
//    holds the k16 MMA fragment elements 2t, 2t+1 (low half) and 2t+8, 2t+9
//    (high half).
//  * "h" rows: FP16 values in natural order (ldmatrix operands).
//  * "hk" rows: FP16, each 16-key group stored as key order
//    0 8 1 9 2 10 ... 7 15 (matches how dS is stored, see kernel).

__device__ __forceinline__ uint4 permute_p8(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}

template <int F>
__device__ __forceinline__ void store_h16(uint8_t* dst, uint4 v) {  // 16 codes -> 16 FP16 (32 bytes)
  uint4 lo, hi;
  lo.x = f16x2_from_fp8x2<F>(v.x);
  lo.y = f16x2_from_fp8x2<F>(v.x >> 16);
  lo.z = f16x2_from_fp8x2<F>(v.y);
  lo.w = f16x2_from_fp8x2<F>(v.y >> 16);
  hi.x = f16x2_from_fp8x2<F>(v.z);
  hi.y = f16x2_from_fp8x2<F>(v.z >> 16);
  hi.z = f16x2_from_fp8x2<F>(v.w);
  hi.w = f16x2_from_fp8x2<F>(v.w >> 16);
  reinterpret_cast<uint4*>(dst)[0] = lo;
  reinterpret_cast<uint4*>(dst)[1] = hi;
}

template <int F>
__device__ __forceinline__ void store_hk16(uint8_t* dst, uint4 v) {  // key order 0 8 1 9 ... 7 15
  uint4 lo, hi;
  lo.x = f16x2_from_fp8x2<F>(__byte_perm(v.x, v.z, 0x40));
  lo.y = f16x2_from_fp8x2<F>(__byte_perm(v.x, v.z, 0x51));
  lo.z = f16x2_from_fp8x2<F>(__byte_perm(v.x, v.z, 0x62));
  lo.w = f16x2_from_fp8x2<F>(__byte_perm(v.x, v.z, 0x73));
  hi.x = f16x2_from_fp8x2<F>(__byte_perm(v.y, v.w, 0x40));
  hi.y = f16x2_from_fp8x2<F>(__byte_perm(v.y, v.w, 0x51));
  hi.z = f16x2_from_fp8x2<F>(__byte_perm(v.y, v.w, 0x62));
  hi.w = f16x2_from_fp8x2<F>(__byte_perm(v.y, v.w, 0x73));
  reinterpret_cast<uint4*>(dst)[0] = lo;
  reinterpret_cast<uint4*>(dst)[1] = hi;
}

// Rows [s0, s0 + 128) of one (batch, head) FP8 matrix [S][D] into shared rows
// (FP16 "h" when half_rows(D), else "p8"); rows >= S are zero (never read).
template <int D, int F>
__device__ __forceinline__ void load_rows(uint8_t* dst, const uint8_t* src, int s0, int S) {
  constexpr int kVec = D / 16, kIters = kTile * kVec / kThreads;
  static_assert(D % 16 == 0 && (kTile * kVec) % kThreads == 0, "whole 16-byte vectors per thread");
  uint4 v[kIters];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {  // all global loads first
    const int i = threadIdx.x + k * kThreads, r = i / kVec, cv = i % kVec;
    v[k] = make_uint4(0u, 0u, 0u, 0u);
    if (s0 + r < S) v[k] = __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(s0 + r) * D) + cv);
  }
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / kVec, cv = i % kVec;
    if constexpr (half_rows(D)) {
      store_h16<F>(dst + r * row_ld(D) + cv * 32, v[k]);
    } else {
      *reinterpret_cast<uint4*>(dst + r * row_ld(D) + cv * 16) = permute_p8(v[k]);
    }
  }
}

// Same, always "p8" (the per-warp A operands K and V).
template <int D>
__device__ __forceinline__ void load_rows_p8(uint8_t* dst, const uint8_t* src, int s0, int S) {
  constexpr int kVec = D / 16, kIters = kTile * kVec / kThreads, kLd = D + kRowPad;
  uint4 v[kIters];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / kVec, cv = i % kVec;
    v[k] = make_uint4(0u, 0u, 0u, 0u);
    if (s0 + r < S) v[k] = __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(s0 + r) * D) + cv);
  }
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / kVec, cv = i % kVec;
    *reinterpret_cast<uint4*>(dst + r * kLd + cv * 16) = permute_p8(v[k]);
  }
}

// Scales of rows [s0, s0 + 128) of a [S][NB] FP32 array; rows >= S get 0.
template <int NB>
__device__ __forceinline__ void load_row_scales(float* dst, const float* src, int s0, int S) {
  for (int i = threadIdx.x; i < kTile * NB; i += kThreads) {
    const int r = i / NB;
    dst[i] = (s0 + r < S) ? __ldg(src + static_cast<int64_t>(s0) * NB + i) : 0.f;
  }
}

// Positions [s0, s0 + 128) of ROWS rows of a sequence-contiguous FP8 matrix
// (row stride ld_src = S_pad, first row at src) into FP16 shared rows of stride
// kLdH ("h", or "hk" when KEYS). Positions >= S are zero; reads never go past
// S_pad (S rounded up to 16).
template <int ROWS, int F, bool KEYS>
__device__ __forceinline__ void load_cols(uint8_t* dst, const uint8_t* src, int64_t ld_src, int s0, int S) {
  constexpr int kIters = ROWS * (kTile / 16) / kThreads;
  static_assert((ROWS * (kTile / 16)) % kThreads == 0, "whole vectors per thread");
  uint4 v[kIters];
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / (kTile / 16), cv = i % (kTile / 16);
    const int pos = s0 + 16 * cv;
    v[k] = make_uint4(0u, 0u, 0u, 0u);
    if (pos < S) {
      v[k] = __ldg(reinterpret_cast<const uint4*>(src + r * ld_src + pos));
      const int nvalid = S - pos;
      if (nvalid < 16) {  // zero the padding codes past the sequence end
        uint32_t w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int nb = nvalid - 4 * q;
          w[q] = nb >= 4 ? w[q] : (nb <= 0 ? 0u : (w[q] & ((1u << (8 * nb)) - 1u)));
        }
        v[k] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kIters; ++k) {
    const int i = threadIdx.x + k * kThreads, r = i / (kTile / 16), cv = i % (kTile / 16);
    if constexpr (KEYS) {
      store_hk16<F>(dst + r * kLdH + cv * 32, v[k]);
    } else {
      store_h16<F>(dst + r * kLdH + cv * 32, v[k]);
    }
  }
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

// ---- the tile computations shared by the pre-pass and the main kernel ------------

// A fragment (16 rows x k16 step ks) of a "p8" FP8 tile: rows r0, r0 + 8.
template <int F>
__device__ __forceinline__ void a_frag_p8(const uint8_t* row0, int ld, int ks, int t, uint32_t& a0,
                                          uint32_t& a1, uint32_t& a2, uint32_t& a3) {
  const uint32_t w0 = lds32(row0 + 16 * ks + 4 * t), w1 = lds32(row0 + 8 * ld + 16 * ks + 4 * t);
  a0 = f16x2_from_fp8x2<F>(w0);
  a2 = f16x2_from_fp8x2<F>(w0 >> 16);
  a1 = f16x2_from_fp8x2<F>(w1);
  a3 = f16x2_from_fp8x2<F>(w1 >> 16);
}

// S^T (#3) for this warp's 16 keys x 128 queries, block-scaled along d: per
// head-dim block the FP32 partial times s_q * s_k (an exact power of two, so
// the same number as the reference's (partial * s_q) * s_k), summed over blocks.
//   sK "p8" [128][DQK] key rows, sKs [128][NB]; sQ [128][DQK] (row_ld), sQs [128][NB].
template <int DQK>
__device__ __forceinline__ void tile_s(const uint8_t* sK, const float* sKs, const uint8_t* sQ,
                                       const float* sQs, int warp, int lane, float (&s)[16][4]) {
  constexpr int kLdK = DQK + kRowPad, kLdQ = row_ld(DQK), kNb = num_dim_blocks(DQK);
  const int g = lane >> 2, t = lane & 3, kl0 = warp * 16 + g;
  const uint8_t* ka = sK + kl0 * kLdK;
  if constexpr (kNb == 1) {
    // One block: all 16 n8 tiles accumulate together (16 independent MMAs per k step).
#pragma unroll
    for (int j = 0; j < 16; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    const uint8_t* qb = sQ + (8 * (lane >> 4) + (lane & 7)) * kLdQ + 16 * ((lane >> 3) & 1);
#pragma unroll
    for (int ks = 0; ks < DQK / 16; ++ks) {
      uint32_t a0, a1, a2, a3;
      a_frag_p8<kFmtE4M3>(ka, kLdK, ks, t, a0, a1, a2, a3);
#pragma unroll
      for (int jp = 0; jp < 8; ++jp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, qb + 16 * jp * kLdQ + 32 * ks);
        hmma(s[2 * jp], a0, a1, a2, a3, b0, b1);
        hmma(s[2 * jp + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    const float ks0 = sKs[kl0], ks1 = sKs[kl0 + 8];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 qs = *reinterpret_cast<const float2*>(sQs + 8 * j + 2 * t);
      s[j][0] = __fmul_rn(s[j][0], __fmul_rn(qs.x, ks0));
      s[j][1] = __fmul_rn(s[j][1], __fmul_rn(qs.y, ks0));
      s[j][2] = __fmul_rn(s[j][2], __fmul_rn(qs.x, ks1));
      s[j][3] = __fmul_rn(s[j][3], __fmul_rn(qs.y, ks1));
    }
  } else {
    // Several blocks (d = 192, 256): groups of four n8 tiles, a partial per block;
    // Q stays FP8 ("p8") in shared memory and is decoded per use.
#pragma unroll
    for (int jg = 0; jg < 4; ++jg) {
#pragma unroll
      for (int b = 0; b < kNb; ++b) {
        constexpr int kBlk = dim_block(DQK);
        float part[4][4];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) part[jj][0] = part[jj][1] = part[jj][2] = part[jj][3] = 0.f;
#pragma unroll
        for (int ks = b * kBlk / 16; ks < (b * kBlk + kBlk < DQK ? b * kBlk + kBlk : DQK) / 16; ++ks) {
          uint32_t a0, a1, a2, a3;
          a_frag_p8<kFmtE4M3>(ka, kLdK, ks, t, a0, a1, a2, a3);
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            const uint32_t w = lds32(sQ + (32 * jg + 8 * jj + g) * kLdQ + 16 * ks + 4 * t);
            hmma(part[jj], a0, a1, a2, a3, f16x2_from_fp8x2<kFmtE4M3>(w), f16x2_from_fp8x2<kFmtE4M3>(w >> 16));
          }
        }
        const float ks0 = sKs[kl0 * kNb + b], ks1 = sKs[(kl0 + 8) * kNb + b];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ql = 32 * jg + 8 * jj + 2 * t + (e & 1);
            const float f = __fmul_rn(sQs[ql * kNb + b], e < 2 ? ks0 : ks1);
            float& dst = s[4 * jg + jj][e];
            dst = b == 0 ? __fmul_rn(part[jj][e], f) : fmaf(part[jj][e], f, dst);
          }
      }
    }
  }
}

// P = exp(S * tau - LSE) in place, as exp2(S * tau * log2(e) - LSE * log2(e))
// in FP32 (sLse2 = LSE * log2(e)); with kMask, invisible entries and rows with
// LSE = -inf are exact zeros (no NaN).
template <bool kMask>
__device__ __forceinline__ void tile_p(float (&s)[16][4], const float* sLse2, const TileGeom& tg, int warp,
                                       int lane) {
  const int g = lane >> 2, t = lane & 3, kl0 = warp * 16 + g;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 l2 = *reinterpret_cast<const float2*>(sLse2 + 8 * j + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lse2 = (e & 1) ? l2.y : l2.x;
      const float p = ex2(fmaf(s[j][e], tg.c2, -lse2));
      if constexpr (kMask) {
        const int ql = 8 * j + 2 * t + (e & 1), kl = kl0 + 8 * (e >> 1);
        s[j][e] = (tg.visible(kl, ql) && lse2 != -INFINITY) ? p : 0.f;
      } else {
        s[j][e] = p;
      }
    }
  }
}

// dP^T (#4) for this warp's 16 keys x the 32 queries [32 jg, 32 jg + 32),
// block-scaled along dv (partial * s_dO * s_V, exact power-of-two product).
//   sV "p8" [128][DV], sVs [128][NB]; sdO [128][DV] (row_ld), sdOs [128][NB].
template <int DV, int FMT>
__device__ __forceinline__ void tile_dp(const uint8_t* sV, const float* sVs, const uint8_t* sdO,
                                        const float* sdOs, int warp, int lane, int jg, float (&dp)[4][4]) {
  constexpr int kLdV = DV + kRowPad, kLdO = row_ld(DV), kNb = num_dim_blocks(DV), kBlk = dim_block(DV);
  const int g = lane >> 2, t = lane & 3, kl0 = warp * 16 + g;
  const uint8_t* va = sV + kl0 * kLdV;
#pragma unroll
  for (int b = 0; b < kNb; ++b) {
    float part[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) part[jj][0] = part[jj][1] = part[jj][2] = part[jj][3] = 0.f;
#pragma unroll
    for (int ks = b * kBlk / 16; ks < (b * kBlk + kBlk < DV ? b * kBlk + kBlk : DV) / 16; ++ks) {
      uint32_t a0, a1, a2, a3;
      a_frag_p8<kFmtE4M3>(va, kLdV, ks, t, a0, a1, a2, a3);
      if constexpr (half_rows(DV)) {
        const uint8_t* ob = sdO + (32 * jg + 8 * (lane >> 4) + (lane & 7)) * kLdO + 16 * ((lane >> 3) & 1) + 32 * ks;
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(b0, b1, b2, b3, ob + 16 * jp * kLdO);
          hmma(part[2 * jp], a0, a1, a2, a3, b0, b1);
          hmma(part[2 * jp + 1], a0, a1, a2, a3, b2, b3);
        }
      } else {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const uint32_t w = lds32(sdO + (32 * jg + 8 * jj + g) * kLdO + 16 * ks + 4 * t);
          hmma(part[jj], a0, a1, a2, a3, f16x2_from_fp8x2<FMT>(w), f16x2_from_fp8x2<FMT>(w >> 16));
        }
      }
    }
    const float vs0 = sVs[kl0 * kNb + b], vs1 = sVs[(kl0 + 8) * kNb + b];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int ql = 32 * jg + 8 * jj + 2 * t + (e & 1);
        const float f = __fmul_rn(sdOs[ql * kNb + b], e < 2 ? vs0 : vs1);
        dp[jj][e] = b == 0 ? __fmul_rn(part[jj][e], f) : fmaf(part[jj][e], f, dp[jj][e]);
      }
  }
}

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

// Launchers (defined in the .cu files).
void launch_prepass(const KernelParams& p, cudaStream_t stream);
void launch_main(const KernelParams& p, cudaStream_t stream);
// wgmma backward (bwd_wgmma_e4m3_blockscale_sm90.cu): head_dim_qk == head_dim_v
// in {64, 128}; other shapes use the kernels above.
bool wgmma_supported(const KernelParams& p);
void launch_wgmma_prepass(const KernelParams& p, cudaStream_t stream);
void launch_wgmma_main(const KernelParams& p, cudaStream_t stream);

// Calls f(Int<DQK>, Int<DV>, Int<FMT>) for the compiled (head_dim_qk,
// head_dim_v) pairs and the grad format of p; throws for other head dims.
// One place for the backward kernels' shape dispatch (pre-pass and main).
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
