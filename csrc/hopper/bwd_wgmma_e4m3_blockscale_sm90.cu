// fp8attn: sm_90a FP8 backward on warpgroup MMAs (wgmma, QGMMA in the SASS),
// block scales (numerics.md sections 3-5): the `row` recipe's backward, run by
// run_bwd (bwd_e4m3_blockscale_sm90.cu; the mma.sync backward it replaced was
// removed on 2026-12-07, code at f7729f9). head_dim 64, 128, 256 and
// (192, 128); at d > 128 the main kernel's CTAs take 128-column slices of
// the outputs (see WgMainLayout).
// Design and measurements: docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md.
//
// Two kernels, both 2 warpgroups (256 threads), warp w (0..7) owning rows
// [16w, 16w+16) of the 128-key tile, i.e. each warpgroup issues the M = 64
// half of every key-row product:
//   * pre-pass (Delta-Matching, or diagnostics): one CTA per (64-query tile,
//     query head, batch), walks the key tiles, delta_dm = sum_j P dP_hat;
//   * main: one CTA per (128-key tile, kv head, batch), walks the GQA group's
//     query heads and the query tiles that see its keys:
//       S^T = K Q^T        SS wgmma m64n64k32 per 64 queries (k_row, q_row)  #3
//       P (FP32) -> P^T E4M3 per key along the 128 queries (registers)
//       dP_hat^T = V dO^T  SS wgmma m64n64k32 per 64 queries                 #4
//       dS = P o (dP_hat - delta)  (FP32)
//       dV += P^T dO       RS wgmma m64n32k32 (d=128) / m64n64k32 (do_colT)  #5
//       dS per query along each warpgroup's 64 keys -> shared [q][k]
//       dK += dS^T Q       RS wgmma m64n64k32 (A dS^T per key, B q_colT)    #7
//       dQ_tile = dS K     SS wgmma m64nNk32 x 2 per 64-key block (A dS, B
//                          k_colT) -> atomics (d <= 128: one pair late)   #6
//   Every product's reduction over one tile (128 elements, or head_dim <= 128)
//   is one quantization block: its FP32 partial is multiplied by the two block
//   scales (an exact power of two) and added to the FP32 accumulator; #6's dS
//   blocks are 64 keys (kWgDsBlock), so dQ takes two partials per tile.
//   d <= 128 (v6): the two warpgroups are decoupled (mbarriers, per-warpgroup
//   named barriers; NOTE at the kernel).
//   NOTE: FP8 wgmma sums keep ~13-14 bits relative to the largest addend, not
//   FP32 (measured against the CPU reference: ~4e-3 relative, numerics.md
//   section 7); P and dP_hat are still bitwise shared with the pre-pass.
//
// Shared-memory operands are K-major with the 128-byte swizzle (rows of 128
// bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8); tiles 1024-byte
// aligned), filled with cp.async (16-byte chunks, so rows can be permuted).
//
// NOTE: register fragments. The FP32 accumulator of S^T/dS^T holds, per
// thread, columns {2t, 2t+1, 2t+8, 2t+9} (+16b) of a 16-column group, while
// the FP8 A fragment of the next wgmma wants K positions {4t..4t+3}. Instead
// of shuffling bytes, the query rows of Q and dO are stored in shared memory
// in the order sigma: S^T column 8a + 2t + e holds query 4t + 2a + e (per 16
// queries), so the quantized P^T/dS^T registers ARE the A fragments of
// natural query order and do_colT / q_colT are used as stored. Likewise the
// key rows of K and V use tau: accumulator row g + 8h (per 16 keys) is key
// 2g + h, so one thread writes keys (2g, 2g+1) of dS as one 16-bit store.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "hopper/bwd_tile_sm90.cuh"
#include "hopper/launch_sm90.h"
#include "hopper/prepass_delta_sm90.cuh"
#include "hopper/wgmma_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace {

// wgmma plumbing, cp.async fills and the partial-tile masks: hopper/wgmma_sm90.cuh.

// ---- the tile computations shared by the pre-pass and the main kernel ------------
//
// Accumulator fragment (wgmma m64nN, per warp of the warpgroup, thread g =
// lane/4, t = lane%4): x[j][e] = (row 16 warp + g + 8 (e >> 1), column
// 8j + 2t + (e & 1)). Rows are keys via k_of_row, columns queries via q_of_col.

// S^T (#3) for this warp's rows x NQ columns (64 or 128): one head-dim block
// (d <= 128). Split in issue (one wgmma group, async) and scale (after the
// group completed) so a caller can overlap work.
// NOTE: always m64n64k32 per 64 columns, in the main kernel (NQ = 128) and the
// pre-pass (NQ = 64): the same instruction per element keeps P bitwise equal.
//   k_lo: descriptor of this warpgroup's 64 key rows (sK + 64 wg rows), q_lo:
//   of the [NQ][DQK] query rows (sQ).
template <int DQK, int NQ>
__device__ __forceinline__ void wg_issue_s(uint32_t k_lo, uint32_t q_lo, float (&s)[NQ / 8][4]) {
  constexpr int W0 = bw_of<DQK, 0>();  // head-dim block 0 (the only one at d <= 128)
  static_assert(W0 == 64 || W0 == 128, "one head-dim block");
  float* acc = &s[0][0];
  fence_regs<NQ / 2>(acc);
  wg_arrive();
#pragma unroll
  for (int h = 0; h < NQ / 64; ++h)
#pragma unroll
    for (int k = 0; k < W0 / 32; ++k)
      gmma_ss<kFmtE4M3, kFmtE4M3, 64>(desc_of(k_lo + kDescK32 * k), desc_of(q_lo + h * kDesc64Rows + kDescK32 * k),
                                      acc + 32 * h, k > 0);
  wg_commit();
}
// S^T times its block scales (sliced path, where block 1 is added to it).
//   sKs [128] key scales (tile rows), sQs [NQ] query scales (columns).
template <int NQ>
__device__ __forceinline__ void wg_scale_s(const float* sKs, const float* sQs, int warp, int lane,
                                           float (&s)[NQ / 8][4]) {
  const int g = lane >> 2, t = lane & 3, r0 = warp * 16 + g;
  fence_regs<NQ / 2>(&s[0][0]);
  const float ks0 = sKs[r0], ks1 = sKs[r0 + 8];
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 qs = *reinterpret_cast<const float2*>(sQs + 8 * j + 2 * t);
    s[j][0] = __fmul_rn(s[j][0], __fmul_rn(qs.x, ks0));
    s[j][1] = __fmul_rn(s[j][1], __fmul_rn(qs.y, ks0));
    s[j][2] = __fmul_rn(s[j][2], __fmul_rn(qs.x, ks1));
    s[j][3] = __fmul_rn(s[j][3], __fmul_rn(qs.y, ks1));
  }
}

// P = exp2(S tau log2(e) - LSE log2(e)) in place, unmasked. sLse2: LSE *
// log2(e) per column (-inf past the sequence: see lse2_in_place).
// d <= 128 (wg_tile_p_raw): s is the raw FP32 partial of S^T and the block
// scales are folded into the exponent's coefficient:
//   fmaf(part, (s_q (s_k c2)), -lse2) == fmaf(part s_q s_k, c2, -lse2)
// bitwise, because s_q, s_k are powers of two (exact products; both are one
// rounding of the same real number), except where s_q s_k c2 or part s_q s_k
// leaves the normal range (|scales| < 2^-100 or so: not a real input). One
// FMUL per element instead of two (docs/kernels/bwd_wgmma_..., v4).
// d > 128 (wg_tile_p_scaled): s is S^T already scaled (sum over the blocks).
template <int NQ>
__device__ __forceinline__ void wg_tile_p_raw(float (&s)[NQ / 8][4], const float* sKs, const float* sQs,
                                              const float* sLse2, float c2, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3, r0 = warp * 16 + g;
  fence_regs<NQ / 2>(&s[0][0]);
  const float kc0 = __fmul_rn(sKs[r0], c2), kc1 = __fmul_rn(sKs[r0 + 8], c2);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 qs = *reinterpret_cast<const float2*>(sQs + 8 * j + 2 * t);
    const float2 l = *reinterpret_cast<const float2*>(sLse2 + 8 * j + 2 * t);
    s[j][0] = ex2(fmaf(s[j][0], __fmul_rn(qs.x, kc0), -l.x));
    s[j][1] = ex2(fmaf(s[j][1], __fmul_rn(qs.y, kc0), -l.y));
    s[j][2] = ex2(fmaf(s[j][2], __fmul_rn(qs.x, kc1), -l.x));
    s[j][3] = ex2(fmaf(s[j][3], __fmul_rn(qs.y, kc1), -l.y));
  }
}
// Main kernel, d <= 128 (v7): wg_tile_p_raw's arithmetic with the query
// scales and LSE in fragment order (frag_pos), one LDS.128 per two j of each
// array. sLse2: __fmul_rn(LSE, log2(e)) per column, stored once per pair and
// warpgroup by the kernel: the product lse2_in_place stores for the pre-pass,
// so the same operations on the same values per element.
__device__ __forceinline__ void wg_tile_p_main(float (&s)[16][4], const float* sKs, const float* sQs,
                                               const float* sLse2, float c2, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3, r0 = warp * 16 + g;
  fence_regs<64>(&s[0][0]);
  const float kc0 = __fmul_rn(sKs[r0], c2), kc1 = __fmul_rn(sKs[r0 + 8], c2);
#pragma unroll
  for (int j2 = 0; j2 < 16; j2 += 2) {
    const float4 q4 = frag_ld4(sQs, j2, t), l4 = frag_ld4(sLse2, j2, t);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j2 + u;
      const float qx = u ? q4.z : q4.x, qy = u ? q4.w : q4.y;
      const float lx = u ? l4.z : l4.x, ly = u ? l4.w : l4.y;
      s[j][0] = ex2(fmaf(s[j][0], __fmul_rn(qx, kc0), -lx));
      s[j][1] = ex2(fmaf(s[j][1], __fmul_rn(qy, kc0), -ly));
      s[j][2] = ex2(fmaf(s[j][2], __fmul_rn(qx, kc1), -lx));
      s[j][3] = ex2(fmaf(s[j][3], __fmul_rn(qy, kc1), -ly));
    }
  }
}
template <int NQ>
__device__ __forceinline__ void wg_tile_p_scaled(float (&s)[NQ / 8][4], const float* sLse2, float c2, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(sLse2 + 8 * j + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = ex2(fmaf(s[j][e], c2, -((e & 1) ? l.y : l.x)));
  }
}

// Main kernel, d <= 128 (v7): wg_mask_p (kLse, sLse in fragment order) and
// wg_mask_vis with per-thread bounds instead of TileGeom::visible per element
// (the same predicate; ~4 instead of ~25 instructions per element). This
// thread's column 8j + 2t + e is query ql = 4t + C, C = 16 (j >> 1) +
// 2 (j & 1) + e (q_of_col) a constant, so with kl_r = k_of_row(row r):
//   visible <=> n0 + kl_r < Sk && m0 + ql < Sq && (!causal || n0 + kl_r <= m0 + ql + off)
//           <=> C < qlim && C >= lo_r,
// qlim = Sq - m0 - 4t, lo_r = n0 + kl_r - off - m0 - 4t (causal), INT_MIN (not
// causal), INT_MAX (key past Sk). Pre-pass and sliced kernels: unchanged.
template <bool kLse>
__device__ __forceinline__ void wg_mask_main(float (&s)[16][4], const float* sLse, const TileGeom& tg, int warp,
                                             int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int qlim = tg.seqlen_q - tg.m0 - 4 * t;
  int lo[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = tg.n0 + k_of_row(warp * 16 + g + 8 * r);
    lo[r] = key >= tg.seqlen_k ? 0x7fffffff : (tg.causal ? key - tg.causal_off - tg.m0 - 4 * t : -0x7fffffff - 1);
  }
#pragma unroll
  for (int j2 = 0; j2 < 16; j2 += 2) {
    float4 l4 = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (kLse) l4 = frag_ld4(sLse, j2, t);
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = j2 + u;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 16 * (j >> 1) + 2 * (j & 1) + e;
        bool col = c < qlim;
        if constexpr (kLse) col = col && (u ? (e ? l4.w : l4.z) : (e ? l4.y : l4.x)) != -INFINITY;
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (!(col && c >= lo[r])) s[j][e + 2 * r] = 0.f;
      }
    }
  }
}


// dP^T (#4) for this warp's rows x the 64 columns [64 half, 64 half + 64), one
// dv block: FP32 partial times s_dO * s_V. Issue / scale as for S^T.
//   v_lo: this warpgroup's 64 value rows, do_lo: the dO rows tile.
template <int DV, int FMT>
__device__ __forceinline__ void wg_issue_dp(uint32_t v_lo, uint32_t do_lo, int half, float (&dp)[8][4]) {
  constexpr int W0 = bw_of<DV, 0>();  // head-dim block 0 (the only one at d <= 128)
  static_assert(W0 == 64 || W0 == 128, "one dv block");
  float* acc = &dp[0][0];
  const uint32_t b = do_lo + half * kDesc64Rows;
  fence_regs<32>(acc);
  wg_arrive();
#pragma unroll
  for (int k = 0; k < W0 / 32; ++k)
    gmma_ss<kFmtE4M3, FMT, 64>(desc_of(v_lo + kDescK32 * k), desc_of(b + kDescK32 * k), acc, k > 0);
  wg_commit();
}
__device__ __forceinline__ void wg_scale_dp(const float* sVs, const float* sdOs, int warp, int lane, int half,
                                            float (&dp)[8][4]) {
  const int g = lane >> 2, t = lane & 3, r0 = warp * 16 + g;
  fence_regs<32>(&dp[0][0]);
  const float vs0 = sVs[r0], vs1 = sVs[r0 + 8];
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    const float2 os = *reinterpret_cast<const float2*>(sdOs + 64 * half + 8 * jj + 2 * t);
    dp[jj][0] = __fmul_rn(dp[jj][0], __fmul_rn(os.x, vs0));
    dp[jj][1] = __fmul_rn(dp[jj][1], __fmul_rn(os.y, vs0));
    dp[jj][2] = __fmul_rn(dp[jj][2], __fmul_rn(os.x, vs1));
    dp[jj][3] = __fmul_rn(dp[jj][3], __fmul_rn(os.y, vs1));
  }
}

// ---- head_dim 192 / 256: the second head-dim block ------------------------------
//
// S^T (and dP^T) over every head-dim block, shared by the pre-pass and the main
// kernel (so P and dP_hat stay bitwise equal): block 0 exactly as at d <= 128
// (its scaled partial is __fmul_rn(part, s_a * s_b)), then block 1's partial is
// added as fmaf(part, s_a * s_b, acc), the order of numerics.md section 3
// (and of the removed mma.sync kernels). Scales: block b of a key
// tile at sKs[b * 128 + row], of a query tile at sQs[b * NQ + column].
// NOTE: block 1 of S^T runs per 64 columns (one m64n64 chain, 32 more
// registers while dP is not live); block 1 of dP^T per 32 columns (m64n32,
// 16 registers), because dP is computed with P, dK and dV all live.
template <int DQK, int NQ>
__device__ __forceinline__ void wg_compute_s(uint32_t k_lo, uint32_t q_lo, const float* sKs, const float* sQs,
                                             int warp, int lane, float (&s)[NQ / 8][4]) {
  static_assert(nb_of<DQK>() == 2, "d <= 128 uses wg_issue_s + wg_tile_p_raw");
  wg_issue_s<DQK, NQ>(k_lo, q_lo, s);
  constexpr int W1 = bw_of<DQK, 1>();
  static_assert(W1 == 64 || W1 == 128, "second head-dim block of 64 or 128");
  const int g = lane >> 2, t = lane & 3, r0 = warp * 16 + g;
  const uint32_t a = k_lo + kTileBytes / 16;
  const uint32_t b1 = q_lo + NQ * 128 / 16;
#pragma unroll
  for (int h = 0; h < NQ / 64; ++h) {
    float part[8][4];
    fence_regs<32>(&part[0][0]);
    wg_arrive();
#pragma unroll
    for (int k = 0; k < W1 / 32; ++k)
      gmma_ss<kFmtE4M3, kFmtE4M3, 64>(desc_of(a + kDescK32 * k), desc_of(b1 + h * kDesc64Rows + kDescK32 * k),
                                      &part[0][0], k > 0);
    wg_commit();
    if (h == 0) {
      wg_wait<1>();
      wg_scale_s<NQ>(sKs, sQs, warp, lane, s);
    }
    wg_wait<0>();
    fence_regs<32>(&part[0][0]);
    const float ks0 = sKs[kTile + r0], ks1 = sKs[kTile + r0 + 8];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int j = 8 * h + jj;
      const float2 qs = *reinterpret_cast<const float2*>(sQs + NQ + 8 * j + 2 * t);
      s[j][0] = fmaf(part[jj][0], __fmul_rn(qs.x, ks0), s[j][0]);
      s[j][1] = fmaf(part[jj][1], __fmul_rn(qs.y, ks0), s[j][1]);
      s[j][2] = fmaf(part[jj][2], __fmul_rn(qs.x, ks1), s[j][2]);
      s[j][3] = fmaf(part[jj][3], __fmul_rn(qs.y, ks1), s[j][3]);
    }
  }
}

// dP^T (#4) for the 64 columns of `half`, every dv block (NQ: query rows of
// the sdO tile, so block 1 of dO sits at sdO + NQ * 128).
template <int DV, int FMT, int NQ>
__device__ __forceinline__ void wg_compute_dp(uint32_t v_lo, uint32_t do_lo, const float* sVs, const float* sdOs,
                                              int warp, int lane, int half, float (&dp)[8][4]) {
  wg_issue_dp<DV, FMT>(v_lo, do_lo, half, dp);
  if constexpr (nb_of<DV>() == 1) {
    wg_wait<0>();
    wg_scale_dp(sVs, sdOs, warp, lane, half, dp);
  } else {
    constexpr int W1 = bw_of<DV, 1>();
    static_assert(W1 == 64 || W1 == 128, "second dv block of 64 or 128");
    const int g = lane >> 2, t = lane & 3, r0 = warp * 16 + g;
    const uint32_t a = v_lo + kTileBytes / 16;
    const uint32_t b1 = do_lo + (NQ * 128 + half * (64 * 128)) / 16;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float part[4][4];
      fence_regs<16>(&part[0][0]);
      wg_arrive();
#pragma unroll
      for (int k = 0; k < W1 / 32; ++k)
        gmma_ss<kFmtE4M3, FMT, 32>(desc_of(a + kDescK32 * k), desc_of(b1 + c * (32 * 128 / 16) + kDescK32 * k),
                                   &part[0][0], k > 0);
      wg_commit();
      if (c == 0) {
        wg_wait<1>();
        wg_scale_dp(sVs, sdOs, warp, lane, half, dp);
      }
      wg_wait<0>();
      fence_regs<16>(&part[0][0]);
      const float vs0 = sVs[kTile + r0], vs1 = sVs[kTile + r0 + 8];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * c + jj;
        const float2 os = *reinterpret_cast<const float2*>(sdOs + NQ + 64 * half + 8 * j + 2 * t);
        dp[j][0] = fmaf(part[jj][0], __fmul_rn(os.x, vs0), dp[j][0]);
        dp[j][1] = fmaf(part[jj][1], __fmul_rn(os.y, vs0), dp[j][1]);
        dp[j][2] = fmaf(part[jj][2], __fmul_rn(os.x, vs1), dp[j][2]);
        dp[j][3] = fmaf(part[jj][3], __fmul_rn(os.y, vs1), dp[j][3]);
      }
    }
  }
}

// ---- pre-pass -------------------------------------------------------------------
//
// One CTA per (64-query tile, query head, batch): both warpgroups see the 64
// queries, warpgroup wg the keys [64 wg, 64 wg + 64) of each 128-key tile (the
// main kernel's rows and instructions). NOTE: 64 queries (not 128) keep the
// registers under 128 so two CTAs share an SM (the pre-pass is latency-bound).

constexpr int kPreQ = kWgPreQ;

template <int DQK, int DV>
struct WgPrepassLayout {
  static constexpr int kNbQK = nb_of<DQK>(), kNbV = nb_of<DV>();
  // NOTE: one key stage at d > 128 (double buffers would not fit two CTAs per
  // SM); the second CTA on the SM hides the load latency instead.
  static constexpr int kStages = (kNbQK > 1 || kNbV > 1) ? 1 : 2;
  static constexpr int kKStage = (kNbQK + kNbV) * kTileBytes;  // bytes of one key stage
  static constexpr int kQ = 0;                          // query rows (q_of_col order) [blocks][64][128 B]
  static constexpr int kDO = kQ + kNbQK * kPreQ * 128;  // dO rows
  static constexpr int kK = kDO + kNbV * kPreQ * 128;   // [stages] key rows (k_of_row order), then value rows
  static constexpr int kV = kK + kNbQK * kTileBytes;    //   (stage st at + st * kKStage)
  static constexpr int kF = kK + kStages * kKStage;
  static constexpr int kQs = 0, kDOs = kQs + kNbQK * kPreQ, kLse = kDOs + kNbV * kPreQ;  // [block][64]
  static constexpr int kKStageF = (kNbQK + kNbV) * kTile;  // floats of one key stage
  static constexpr int kKs = kLse + kPreQ;                // [stages]: [block][128] K scales, then V scales
  static constexpr int kVs = kKs + kNbQK * kTile;
  static constexpr int kRed = kKs + kStages * kKStageF;  // [8][64]
  static constexpr int kRedP = kRed + kWarps * kPreQ;  // [8][64]: the P row sums' partials
  static constexpr int kFloats = kRedP + kWarps * kPreQ;
  static constexpr int kBytes = kF + 4 * kFloats + 1024;  // + alignment slack
  static_assert(kBytes <= 113 * 1024, "two CTAs per SM");
};

template <int DQK, int DV, int FMT>
__global__ void __launch_bounds__(kWgThreads, 2) bwd_wgmma_prepass_kernel(const KernelParams p) {
  using L = WgPrepassLayout<DQK, DV>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_aligned_1024(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + L::kF);

  const int m_tile = blockIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int group = p.num_heads_q / p.num_heads_kv, hk = hq / group;
  const int m0 = m_tile * kPreQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wg = warpgroup_uniform();
  const uint32_t d_base = desc_lo(smem);  // descriptor low word of smem + 0
  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;

  TileGeom tg;
  tg.m0 = m0;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = Sk - Sq;
  tg.causal = p.causal;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);
  const int last_q = min(m0 + kPreQ - 1, Sq - 1);
  const int n_end = p.causal ? max(0, min(Sk, last_q + tg.causal_off + 1)) : Sk;
  const int n_tiles = (n_end + kTile - 1) / kTile;

  auto issue_keys = [&](int it) {
    const int n0 = it * kTile, st = it % L::kStages;
    cp_rows<DQK, false, kTile>(smem + L::kK + st * L::kKStage, p.k_row + bhk * Sk * DQK, n0, Sk);
    cp_rows<DV, false, kTile>(smem + L::kV + st * L::kKStage, p.v_row + bhk * Sk * DV, n0, Sk);
    // scale of tile row i % 128, head-dim block i / 128 (row-major [S][nb] in global)
    auto k_idx_qk = [&](int i) -> int64_t {
      const int r = n0 + k_of_row(i % kTile);
      return r < Sk ? (bhk * Sk + r) * L::kNbQK + i / kTile : -1;
    };
    auto k_idx_v = [&](int i) -> int64_t {
      const int r = n0 + k_of_row(i % kTile);
      return r < Sk ? (bhk * Sk + r) * L::kNbV + i / kTile : -1;
    };
    cp_floats(sf + L::kKs + st * L::kKStageF, p.k_row_s, L::kNbQK * kTile, k_idx_qk);
    cp_floats(sf + L::kVs + st * L::kKStageF, p.v_row_s, L::kNbV * kTile, k_idx_v);
  };

  // Query side (once) + first key tile: group 0.
  cp_rows<DQK, true, kPreQ>(smem + L::kQ, p.q_row + bhq * Sq * DQK, m0, Sq);
  cp_rows<DV, true, kPreQ>(smem + L::kDO, p.do_row + bhq * Sq * DV, m0, Sq);
  auto q_idx = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i);
    return r < Sq ? bhq * Sq + r : -1;
  };
  auto q_idx_qk = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i % kPreQ);
    return r < Sq ? (bhq * Sq + r) * L::kNbQK + i / kPreQ : -1;
  };
  auto q_idx_v = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i % kPreQ);
    return r < Sq ? (bhq * Sq + r) * L::kNbV + i / kPreQ : -1;
  };
  cp_floats(sf + L::kQs, p.q_row_s, L::kNbQK * kPreQ, q_idx_qk);
  cp_floats(sf + L::kDOs, p.do_row_s, L::kNbV * kPreQ, q_idx_v);
  cp_floats(sf + L::kLse, p.lse, kPreQ, q_idx);
  if (n_tiles > 0) issue_keys(0);
  cp_commit();

  float cs[16];  // per thread: sum over its keys of P * dP; column 8j + 2t + e at [2j + e]
  float cp[16];  // the same of P (the row sums l, prepass_delta_sm90.cuh)
#pragma unroll
  for (int i = 0; i < 16; ++i) cs[i] = cp[i] = 0.f;

  for (int it = 0; it < n_tiles; ++it) {
    cp_wait<0>();
    if (it == 0) lse2_in_place(sf + L::kLse, kPreQ, m0, Sq);
    fence_async_smem();
    __syncthreads();  // tile it visible; everyone is done with the other stage
    if constexpr (L::kStages == 2) {
      if (it + 1 < n_tiles) issue_keys(it + 1);
      cp_commit();
    }
    const int st = it % L::kStages;
    const int n0 = it * kTile;
    tg.n0 = n0;
    const bool interior = n0 + kTile <= Sk && m0 + kPreQ <= Sq && (!p.causal || n0 + kTile - 1 <= m0 + tg.causal_off);
    // Descriptors of this warpgroup's 64 key / value rows and of the query-side tiles.
    const uint32_t k_lo = d_base + (L::kK + st * L::kKStage) / 16 + wg * kDesc64Rows;
    const uint32_t v_lo = d_base + (L::kV + st * L::kKStage) / 16 + wg * kDesc64Rows;
    const float* sKs = sf + L::kKs + st * L::kKStageF;
    const float* sVs = sf + L::kVs + st * L::kKStageF;

    // The same instructions and scaling as the main kernel: bitwise equal.
    float pt[8][4], dp[8][4];
    if constexpr (L::kStages == 2) {
      // d <= 128: S^T and dP^T in flight together; P is computed while dP runs.
      wg_issue_s<DQK, kPreQ>(k_lo, d_base + L::kQ / 16, pt);
      wg_issue_dp<DV, FMT>(v_lo, d_base + L::kDO / 16, 0, dp);
      wg_wait<1>();
      wg_tile_p_raw<kPreQ>(pt, sKs, sf + L::kQs, sf + L::kLse, tg.c2, warp, lane);
      if (!interior) wg_mask_p<kPreQ>(pt, sf + L::kLse, tg, warp, lane);
      wg_wait<0>();
      wg_scale_dp(sVs, sf + L::kDOs, warp, lane, 0, dp);
    } else {
      wg_compute_s<DQK, kPreQ>(k_lo, d_base + L::kQ / 16, sKs, sf + L::kQs, warp, lane, pt);
      wg_tile_p_scaled<kPreQ>(pt, sf + L::kLse, tg.c2, lane);
      if (!interior) wg_mask_p<kPreQ>(pt, sf + L::kLse, tg, warp, lane);
      wg_compute_dp<DV, FMT, kPreQ>(v_lo, d_base + L::kDO / 16, sVs, sf + L::kDOs, warp, lane, 0, dp);
      __syncthreads();  // everyone's wgmmas of this stage completed: refill it
      if (it + 1 < n_tiles) issue_keys(it + 1);
      cp_commit();
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& l = cp[2 * j + (e & 1)];
        l = __fadd_rn(l, pt[j][e]);  // P is 0 where masked (wg_mask_p)
      }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j][e] = __fmul_rn(pt[j][e], dp[j][e]);
    if (!interior) wg_mask_vis<kPreQ>(dp, tg, warp, lane);  // P = 0 there, but dP may be NaN
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& c = cs[2 * j + (e & 1)];
        c = __fadd_rn(c, dp[j][e]);
      }
  }
  cp_wait<0>();

  // Sum over the 8 lanes g of a warp (its 16 keys), then over the 8 warps.
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) {
      cs[i] += __shfl_xor_sync(0xffffffffu, cs[i], o);
      cp[i] += __shfl_xor_sync(0xffffffffu, cp[i], o);
    }
  float* sRed = sf + L::kRed;
  float* sRedP = sf + L::kRedP;
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sRed[warp * kPreQ + 8 * j + 2 * t + e] = cs[2 * j + e];
        sRedP[warp * kPreQ + 8 * j + 2 * t + e] = cp[2 * j + e];
      }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kPreQ; i += kWgThreads) {
    const int q = m0 + q_of_col(i);
    if (q >= Sq) continue;
    float s = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      s += sRed[w * kPreQ + i];
      l += sRedP[w * kPreQ + i];
    }
    prepass_finish_row(p, bhq * Sq + q, s, l);
  }
}

// ---- main kernel ---------------------------------------------------------------------

// NOTE: head_dim 192 / 256 ("sliced"): one CTA per (key tile, kv head, batch,
// 128-column slice of the outputs): slice s owns columns [128 s, 128 s + 128)
// of dK, dV and dQ (192: slice 1 has 64 dK/dQ columns and no dV) and
// recomputes S^T, P, dP_hat^T and dS over the full head_dim, so the dK + dV
// accumulators stay at the d = 128 size (128 registers). Its query-side tiles
// are single-buffered (two stages would not fit 227 KB): the column tiles of
// the tile pair load during S/dP, the next pair's row tiles during dV/dK/dQ.
template <int DQK, int DV>
struct WgMainLayout {
  static constexpr int kNbQK = nb_of<DQK>(), kNbV = nb_of<DV>();
  static constexpr bool kSliced = kNbQK > 1 || kNbV > 1;
  static constexpr int kSlices = kSliced ? ((DQK > DV ? DQK : DV) + 127) / 128 : 1;
  static constexpr int kWk = kSliced ? 128 : DQK;  // dK / dQ columns per CTA (at most)
  static constexpr int kWv = kSliced ? 128 : DV;   // dV columns per CTA (at most)
  static constexpr int kStages = kSliced ? 1 : 2;
  // dS code buffers: d <= 128 double-buffers them (dQ of pair it - 1 reads one
  // while pair it writes the other, v6); sliced kernels keep one (lockstep).
  static constexpr int kDsBufs = kSliced ? 1 : kWgDsBufs;
  // bytes (every tile 1024-aligned)
  static constexpr int kK = 0;                               // key rows (k_of_row order) [block][128][128 B]
  static constexpr int kV = kK + kNbQK * kTileBytes;         // value rows
  static constexpr int kKc = kV + kNbV * kTileBytes;         // k_colT [kWk][128 keys] (this slice)
  static constexpr int kDS = kKc + kWk * 128;                // [kDsBufs] dS codes [128 q][128 keys]
  static constexpr int kStage = kDS + kDsBufs * kTileBytes;  // [kStages] query-side stages:
  static constexpr int kSQ = 0;                              //   query rows (q_of_col order) [block][128][128 B]
  static constexpr int kSDO = kSQ + kNbQK * kTileBytes;      //   dO rows
  static constexpr int kSQc = kSDO + kNbV * kTileBytes;      //   q_colT [kWk][128 q]
  static constexpr int kSDOc = kSQc + kWk * 128;             //   do_colT [kWv][128 q]
  static constexpr int kStageBytes = kSDOc + kWv * 128;
  static constexpr int kF = kStage + kStages * kStageBytes;
  // floats from kF
  // mbarriers (d <= 128, 8 bytes each): full[2], empty[2] (query-side stages),
  // ds_full[2], ds_empty[2] (dS code buffers); v6 NOTE in the kernel.
  static constexpr int kBar = 0, kNumBars = 8;
  static constexpr int kKs = kBar + 2 * kNumBars, kVs = kKs + kNbQK * kTile, kKcs = kVs + kNbV * kTile;  // [block][128]
  // (kKcs: [kWk] K column scales, fragment order at d <= 128, v7)
  static constexpr int kAmax = kKcs + kWk;                    // [8 warps][128 columns]
  // 1 / s_dS, [2 key halves][128 columns] (fragment order at d <= 128, v7)
  static constexpr int kRowInv = kAmax + kWarps * kTile;
  static constexpr int kRowSq = kRowInv + 2 * kTile;          // [kDsBufs][2 key halves][128 queries (natural)]: s_dS
  // [2 warpgroups][128 columns] (d <= 128, v7): LSE * log2(e) of the pair, fragment order.
  static constexpr int kLse2 = kRowSq + kDsBufs * 2 * kTile;
  static constexpr int kFStage = kLse2 + (kSliced ? 0 : 2 * kTile);  // [kStages] per-stage floats:
  static constexpr int kSQs = 0, kSDOs = kNbQK * kTile;       //   per column, [block][128]
  static constexpr int kSLse = kSDOs + kNbV * kTile, kSDelta = kSLse + kTile;  // per column
  static constexpr int kSQcs = kSDelta + kTile, kSDOcs = kSQcs + kWk;          // per channel
  static constexpr int kFStageFloats = kSDOcs + kWv;
  static constexpr int kFloats = kFStage + kStages * kFStageFloats;
  static constexpr int kBytes = kF + 4 * kFloats + 1024;  // + alignment slack
  static_assert(kStageBytes % 1024 == 0 && kDS % 1024 == 0, "1024-byte aligned swizzled tiles");
  static_assert(kF % 8 == 0 && kBar % 2 == 0, "8-byte aligned mbarriers");
  static_assert(kKs % 2 == 0 && kAmax % 2 == 0 && kRowInv % 2 == 0 && kRowSq % 2 == 0 && kFStage % 2 == 0 &&
                    kFStageFloats % 2 == 0 && kSLse % 2 == 0 && kSDelta % 2 == 0 && kSQcs % 2 == 0,
                "float2 loads");
  static_assert(kSliced || (kKcs % 4 == 0 && kRowInv % 4 == 0 && kLse2 % 4 == 0 && kFStage % 4 == 0 && kFStageFloats % 4 == 0 &&
                            kSQs % 4 == 0 && kSDOs % 4 == 0 && kSLse % 4 == 0 && kSDelta % 4 == 0 &&
                            kSQcs % 4 == 0 && kSDOcs % 4 == 0),
                "float4 loads of the fragment-ordered floats (v7)");
  // NOTE (v6): d = 128 is 228928 bytes (223.6 KB) with the second dS buffer
  // (d = 64: 186688, d = 256 single-buffered: 210496); the limit is 227 KB.
  // v7: + 1 KB (kLse2) at d <= 128: 229952 bytes at d = 128.
  static_assert(kBytes <= 227 * 1024, "shared memory of one CTA");
};
static_assert(WgMainLayout<128, 128>::kDsBufs == 2 && WgMainLayout<128, 128>::kBytes <= 227 * 1024 &&
                  WgMainLayout<64, 64>::kBytes <= 227 * 1024,
              "d <= 128: two dS buffers fit");

// part (m64 x N, this warp's rows) of A (registers, per-row scales sa) times B
// [N channels][128 positions] (swizzled, column scales sBs) accumulated into
// dst: dst += part * (sa * sb) (an exact power of two, numerics.md section 3).
// b_lo: descriptor of the B tile.
// kFrag (v7, d <= 128): sBs in fragment order (frag_pos; N >= 32).
template <int FA, int FB, int N, bool kFrag = false>
__device__ __forceinline__ void wg_rows_x_tile(const uint32_t (&codes)[8][2], float sa0, float sa1,
                                               uint32_t b_lo, const float* sBs, int lane, float* dst) {
  const int t = lane & 3;
  float part[N / 8][4];
  uint32_t a[4][4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    a[c][0] = codes[2 * c][0];
    a[c][1] = codes[2 * c][1];
    a[c][2] = codes[2 * c + 1][0];
    a[c][3] = codes[2 * c + 1][1];
  }
  fence_regs<N / 2>(&part[0][0]);
  wg_arrive();
#pragma unroll
  for (int c = 0; c < 4; ++c) gmma_rs<FA, FB, N>(a[c], desc_of(b_lo + kDescK32 * c), &part[0][0], c > 0);
  wg_commit();
  wg_wait<0>();
  fence_regs<N / 2>(&part[0][0]);
  fence_regs_u(&a[0][0], 16);
  auto acc = [&](int jj, float2 sb) {
    float* d = dst + 4 * jj;
    d[0] = fmaf(part[jj][0], sa0 * sb.x, d[0]);
    d[1] = fmaf(part[jj][1], sa0 * sb.y, d[1]);
    d[2] = fmaf(part[jj][2], sa1 * sb.x, d[2]);
    d[3] = fmaf(part[jj][3], sa1 * sb.y, d[3]);
  };
  if constexpr (kFrag) {
#pragma unroll
    for (int jj = 0; jj < N / 8; jj += 2) {
      const float4 s4 = frag_ld4(sBs, jj, t);
      acc(jj, make_float2(s4.x, s4.y));
      acc(jj + 1, make_float2(s4.z, s4.w));
    }
  } else {
#pragma unroll
    for (int jj = 0; jj < N / 8; ++jj) acc(jj, *reinterpret_cast<const float2*>(sBs + 8 * jj + 2 * t));
  }
}

// NOTE (v6, d <= 128): the two warpgroups run decoupled (no CTA barrier in the
// tile-pair loop), so one's FP32 work can run under the other's wgmmas:
//  * query-side stages complete through mbarriers: every thread issues its
//    cp.async copies of stage s, then cp.async.mbarrier.arrive.noinc on
//    full[s] (256 expected arrivals: the phase completes when every thread's
//    copies landed); readers wait full[s], then fence.proxy.async (see the
//    proxy NOTE at the wait); stage s is free when empty[s] (256 arrivals,
//    each after the thread's last read of the stage, wgmma reads completed)
//    completed;
//  * the #6 dS amax is per warpgroup (64-key blocks, numerics.md): a named
//    barrier per warpgroup (bar kWgBarWarpgroup + wg, 128 threads) instead of __syncthreads
//    (v7: also after the warpgroup's LSE * log2(e) stores); bar 3 (256) only
//    for the pingpong start offset (kWgPingpong);
//  * dQ (#6) runs one tile pair late from double-buffered dS codes: ds_full[b]
//    (256 arrivals: st.shared, fence.proxy.async, arrive) and ds_empty[b]
//    (256 arrivals after the thread's dQ wgmmas on buffer b completed).
// Phases: tile pair it uses stage and dS buffer it & 1; full / ds_full of pair
// j are the (j >> 1)-th completion of their barrier (parity (j >> 1) & 1),
// empty / ds_empty likewise. Deadlock freedom and parity: kernel note, v6.
template <int DQK, int DV, int FMT>
__global__ void __launch_bounds__(kWgThreads, 1) bwd_wgmma_main_kernel(const KernelParams p) {
  using L = WgMainLayout<DQK, DV>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_aligned_1024(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + L::kF);
  uint8_t* sDS = smem + L::kDS;
  const float* sKs = sf + L::kKs;
  const float* sVs = sf + L::kVs;
  const float* sKcs = sf + L::kKcs;
  float* sAmax = sf + L::kAmax;
  float* sRowInv = sf + L::kRowInv;
  float* sRowSq = sf + L::kRowSq;
  // mbarrier addresses (d <= 128): full[s], empty[s], ds_full[b], ds_empty[b].
  const uint32_t bar0 = smem_u32(sf + L::kBar);
  auto bar_full = [&](int s) { return bar0 + 8 * s; };
  auto bar_empty = [&](int s) { return bar0 + 16 + 8 * s; };
  auto bar_dsf = [&](int b) { return bar0 + 32 + 8 * b; };
  auto bar_dse = [&](int b) { return bar0 + 48 + 8 * b; };

  constexpr bool kSliced = L::kSliced;
  const int n_tile = blockIdx.x, hk = blockIdx.y / L::kSlices, b = blockIdx.z;
  // This CTA's output columns: dK/dQ [cb, cb + wk), dV [cb, cb + wv).
  const int slice = kSliced ? static_cast<int>(blockIdx.y) % L::kSlices : 0;
  const int cb = 128 * slice;
  const int wk = kSliced ? max(0, min(L::kWk, DQK - cb)) : DQK;
  const int wv = kSliced ? max(0, min(L::kWv, DV - cb)) : DV;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int group = p.num_heads_q / p.num_heads_kv;
  const int nblk_q = (Sq + kTile - 1) / kTile, nblk_k = (Sk + kTile - 1) / kTile;
  const int n0 = n_tile * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // wg: re-derived per tile pair in the loop (warpgroup_uniform_fresh, NOTE there).
  const uint32_t d_base = desc_lo(smem);  // descriptor low word of smem + 0
  // NOTE: the diagnostics' row sums are over keys only: one slice adds them.
  const bool diag = p.diag != nullptr && slice == 0;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;
  const int64_t n_rows = static_cast<int64_t>(p.batch) * p.num_heads_q * Sq;

  TileGeom tg;
  tg.n0 = n0;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = Sk - Sq;
  tg.causal = p.causal;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);

  // Query tiles that see this key tile: [m_first, nblk_q) of every head of the group.
  int m_first = 0;
  if (p.causal) {
    // first query that sees key n0: qi + off >= n0
    const int q_min = max(0, n0 - tg.causal_off);
    m_first = q_min >= Sq ? nblk_q : q_min / kTile;
  }
  const int per_head = nblk_q - m_first;
  const int n_iters = group * per_head;
  // Query-side tiles of tile pair `it` into stage st: the row tiles (#3, #4
  // operands, with their scales, LSE and delta) and this slice's column tiles
  // (#5, #7 operands).
  // Tile pair it = (query head hq, query tile m_tile); the loop walks them
  // with counters (NOTE: no integer division per tile pair).
  auto issue_rows = [&](int hq, int m_tile, int st) {
    const int m0 = m_tile * kTile;
    const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
    uint8_t* S = smem + L::kStage + st * L::kStageBytes;
    float* F = sf + L::kFStage + st * L::kFStageFloats;
    cp_rows<DQK, true, kTile>(S + L::kSQ, p.q_row + bhq * Sq * DQK, m0, Sq);
    cp_rows<DV, true, kTile>(S + L::kSDO, p.do_row + bhq * Sq * DV, m0, Sq);
    if constexpr (kSliced) {
      auto q_idx = [&](int i) -> int64_t {
        const int r = m0 + q_of_col(i);
        return r < Sq ? bhq * Sq + r : -1;
      };
      // scale of tile column i % 128, head-dim block i / 128
      auto q_idx_qk = [&](int i) -> int64_t {
        const int r = m0 + q_of_col(i % kTile);
        return r < Sq ? (bhq * Sq + r) * L::kNbQK + i / kTile : -1;
      };
      auto q_idx_v = [&](int i) -> int64_t {
        const int r = m0 + q_of_col(i % kTile);
        return r < Sq ? (bhq * Sq + r) * L::kNbV + i / kTile : -1;
      };
      cp_floats(F + L::kSQs, p.q_row_s, L::kNbQK * kTile, q_idx_qk);
      cp_floats(F + L::kSDOs, p.do_row_s, L::kNbV * kTile, q_idx_v);
      cp_floats(F + L::kSLse, p.lse, kTile, q_idx);
      cp_floats(F + L::kSDelta, p.delta, kTile, q_idx);
    }
  };
  auto issue_cols = [&](int hq, int m_tile, int st) {
    const int m0 = m_tile * kTile;
    const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
    uint8_t* S = smem + L::kStage + st * L::kStageBytes;
    float* F = sf + L::kFStage + st * L::kFStageFloats;
    if constexpr (kSliced) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (64 * h < wk)
          cp_cols<64>(S + L::kSQc + h * 64 * 128, p.q_colT + (bhq * DQK + cb + 64 * h) * p.seqlen_q_pad,
                      p.seqlen_q_pad, m0, Sq);
        if (64 * h < wv)
          cp_cols<64>(S + L::kSDOc + h * 64 * 128, p.do_colT + (bhq * DV + cb + 64 * h) * p.seqlen_q_pad,
                      p.seqlen_q_pad, m0, Sq);
      }
      cp_floats(F + L::kSQcs, p.q_col_s, wk,
                [&](int i) -> int64_t { return (bhq * DQK + cb + i) * nblk_q + m_tile; });
      cp_floats(F + L::kSDOcs, p.do_col_s, wv,
                [&](int i) -> int64_t { return (bhq * DV + cb + i) * nblk_q + m_tile; });
    } else {
      cp_cols<DQK>(S + L::kSQc, p.q_colT + bhq * DQK * p.seqlen_q_pad, p.seqlen_q_pad, m0, Sq);
      cp_cols<DV>(S + L::kSDOc, p.do_colT + bhq * DV * p.seqlen_q_pad, p.seqlen_q_pad, m0, Sq);
    }
  };
  // d <= 128: every per-query / per-channel float of tile pair `it` in one
  // step, one float column per thread (NOTE: replaces four generic cp_floats
  // loops, ~250 integer instructions per tile pair; ncu 2026-11-29):
  // threads 0..127 query column fi (q_of_col order): Q and dO row scales, LSE,
  // delta; threads 128..255 channel fi: Q and dO column scales.
  const int fi = threadIdx.x & (kTile - 1);
  const int q_fi = q_of_col(fi);
  const int fp_fi = frag_pos(fi);  // v7: every per-column / per-channel float in fragment order
  auto issue_floats = [&](int hq, int m_tile, int st) {
    const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
    float* F = sf + L::kFStage + st * L::kFStageFloats;
    if (threadIdx.x < kTile) {
      const int r = m_tile * kTile + q_fi;
      const bool ok = r < Sq;
      const int64_t row = bhq * Sq + (ok ? r : 0);
      cp_async4(F + L::kSQs + fp_fi, p.q_row_s + row, ok);
      cp_async4(F + L::kSDOs + fp_fi, p.do_row_s + row, ok);
      cp_async4(F + L::kSLse + fp_fi, p.lse + row, ok);
      cp_async4(F + L::kSDelta + fp_fi, p.delta + row, ok);
    } else {
      if (fi < DQK) cp_async4(F + L::kSQcs + fp_fi, p.q_col_s + (bhq * DQK + fi) * nblk_q + m_tile, true);
      if (fi < DV) cp_async4(F + L::kSDOcs + fp_fi, p.do_col_s + (bhq * DV + fi) * nblk_q + m_tile, true);
    }
  };

  // d <= 128: the mbarriers, initialized before any copy can arrive on them.
  if constexpr (!kSliced) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int i = 0; i < L::kNumBars; ++i) mbar_init(bar0 + 8 * i, kWgThreads);
      // NOTE: the initialized barriers visible to the async (cp.async
      // arrive-on) side too, as CUTLASS's pipelines do after their init.
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }

  // Key side (once) + the first query tile: cp.async group 0 (sliced: the
  // first column tiles load at the top of the loop).
  cp_rows<DQK, false, kTile>(smem + L::kK, p.k_row + bhk * Sk * DQK, n0, Sk);
  cp_rows<DV, false, kTile>(smem + L::kV, p.v_row + bhk * Sk * DV, n0, Sk);
  if constexpr (kSliced) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (64 * h < wk)
        cp_cols<64>(smem + L::kKc + h * 64 * 128, p.k_colT + (bhk * DQK + cb + 64 * h) * p.seqlen_k_pad,
                    p.seqlen_k_pad, n0, Sk);
    auto k_idx_qk = [&](int i) -> int64_t {
      const int r = n0 + k_of_row(i % kTile);
      return r < Sk ? (bhk * Sk + r) * L::kNbQK + i / kTile : -1;
    };
    auto k_idx_v = [&](int i) -> int64_t {
      const int r = n0 + k_of_row(i % kTile);
      return r < Sk ? (bhk * Sk + r) * L::kNbV + i / kTile : -1;
    };
    cp_floats(sf + L::kKs, p.k_row_s, L::kNbQK * kTile, k_idx_qk);
    cp_floats(sf + L::kVs, p.v_row_s, L::kNbV * kTile, k_idx_v);
  } else {
    cp_cols<DQK>(smem + L::kKc, p.k_colT + bhk * DQK * p.seqlen_k_pad, p.seqlen_k_pad, n0, Sk);
    auto k_idx = [&](int i) -> int64_t {
      const int r = n0 + k_of_row(i);
      return r < Sk ? bhk * Sk + r : -1;
    };
    cp_floats(sf + L::kKs, p.k_row_s, kTile, k_idx);
    cp_floats(sf + L::kVs, p.v_row_s, kTile, k_idx);
  }
  if constexpr (kSliced) {
    cp_floats(sf + L::kKcs, p.k_col_s, wk, [&](int i) -> int64_t { return (bhk * DQK + cb + i) * nblk_k + n_tile; });
  } else {
    // v7: fragment order (frag_pos), like the per-stage floats.
    if (threadIdx.x < DQK) cp_async4(sf + L::kKcs + frag_pos(threadIdx.x), p.k_col_s + (bhk * DQK + threadIdx.x) * nblk_k + n_tile, true);
  }
  if (n_iters > 0) {
    issue_rows(hk * group, m_first, 0);
    if constexpr (!kSliced) {
      issue_cols(hk * group, m_first, 0);
      issue_floats(hk * group, m_first, 0);
    }
  }
  cp_commit();
  if constexpr (!kSliced) {
    // Key side: waited and fenced here, visible to all after the barrier (the
    // only CTA barrier of the d <= 128 kernel after the init). Stage 0 (same
    // copies, already complete) goes through full[0] like every later stage.
    if (n_iters > 0) cp_async_mbar_arrive(bar_full(0));
    cp_wait<0>();
    fence_async_smem();
    __syncthreads();
  }

  float dk_acc[L::kWk / 64][8][4], dv_acc[L::kWv / 64][8][4];
#pragma unroll
  for (int h = 0; h < L::kWk / 64; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk_acc[h][j][e] = 0.f;
#pragma unroll
  for (int h = 0; h < L::kWv / 64; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv_acc[h][j][e] = 0.f;

  // ---- dQ (#6) pieces, shared by the lockstep (sliced) and the delayed (d <=
  // 128) schedules. dS is block-scaled per query along 64-key blocks
  // (kWgDsBlock: keys [0, 64) and [64, 128) of the tile, one per warpgroup), K
  // per channel along the 128 keys: per output chunk two wgmma sub-chains (k32
  // steps 0-1 and 2-3) into two partials, each times its own s_dS(query,
  // block) s_K(channel) and summed into one float2 atomic per element.
  // Accumulator rows: queries q0 = 16 warp + g and q0 + 8 (warpgroup wg takes
  // queries [64 wg, 64 wg + 64)).
  const int q0 = warp * 16 + g;
  const uint32_t kc_lo = d_base + L::kKc / 16;
  // Issue both sub-chains of output columns [col0, col0 + N) (one commit group).
  //   ds_lo: descriptor of the dS buffer's 64 query rows of this warpgroup.
  auto issue_dq2 = [&](uint32_t ds_lo, int col0, auto n_c, float* pa, float* pb) {
    constexpr int N = decltype(n_c)::value;
    fence_regs<N / 2>(pa);
    fence_regs<N / 2>(pb);
    wg_arrive();
    constexpr int kKs = kWgDsBlock / 32;  // k32 steps per #6 dS block: pa keys block 0, pb block 1
#pragma unroll
    for (int k = 0; k < kKs; ++k)
      gmma_ss<FMT, kFmtE4M3, N>(desc_of(ds_lo + kDescK32 * k), desc_of(kc_lo + col0 * (128 / 16) + kDescK32 * k), pa,
                                k > 0);
#pragma unroll
    for (int k = kKs; k < 2 * kKs; ++k)
      gmma_ss<FMT, kFmtE4M3, N>(desc_of(ds_lo + kDescK32 * k), desc_of(kc_lo + col0 * (128 / 16) + kDescK32 * k), pb,
                                k > kKs);
    wg_commit();
  };
  // After the wait: dq_accum[rows q0, q0 + 8][col0 + ...] += pa s_dS(q, keys 0-63) s_K + pb s_dS(q, keys 64-127) s_K.
  //   sq: the buffer's s_dS [2 halves][128 queries]; ksc: K column scales
  //   (8 j + 2t, +1) of the chunk; dq_t: this thread's dq_accum base (row q0, column cb + 2t).
  //   s4: (s_dS(q0, 0), s_dS(q0 + 8, 0), s_dS(q0, 1), s_dS(q0 + 8, 1)) from sq (dq_scales).
  auto dq_scales = [&](const float* sq) {
    return make_float4(sq[q0], sq[q0 + 8], sq[kTile + q0], sq[kTile + q0 + 8]);
  };
  auto store_dq2 = [&](auto n_c, const float* pa_, const float* pb_, const float2* ksc, const float4 s4, float* dq_t,
                       int m0_, int col0) {
    constexpr int N = decltype(n_c)::value;  // pa_[4 jj + e]: accumulator register [jj][e]
    const float s00 = s4.x, s01 = s4.y, s10 = s4.z, s11 = s4.w;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (m0_ + q0 + 8 * hh >= Sq) continue;
      const float sa = hh ? s01 : s00, sb = hh ? s11 : s10;
#pragma unroll
      for (int jj = 0; jj < N / 8; ++jj) {
        // NOTE: (pa s_a + pb s_b) s_K as fmaf(pb, s_b, pa s_a) * s_K: three
        // instructions per value instead of four for fmaf(pb, s_b s_K, pa (s_a
        // s_K)); the same value (every scale is a power of two, so the only
        // rounding is the fmaf's, of the same real number, in the normal range).
        const float2 k2 = ksc[jj];
        const float x = fmaf(pb_[4 * jj + 2 * hh], sb, pa_[4 * jj + 2 * hh] * sa);
        const float y = fmaf(pb_[4 * jj + 2 * hh + 1], sb, pa_[4 * jj + 2 * hh + 1] * sa);
        const float2 v = make_float2(x * k2.x, y * k2.y);
        atomicAdd(reinterpret_cast<float2*>(dq_t + 8 * hh * DQK + col0 + 8 * jj), v);
      }
    }
  };
  // Diagnostics: post-cast row sums on the #6 operand: the codes of query row
  // ql over the 64 keys of block hf (sDS buffer ds, any key order) decoded,
  // summed, times s_dS(ql, hf); the two blocks' sums added by a shuffle (the
  // partner lane holds the other block of the same row).
  auto diag_post = [&](const uint8_t* ds, const float* sq, int ql, int hf, int64_t bhq_, int m0_) {
    const float s = sq[hf * kTile + ql];
    float acc[2] = {0.f, 0.f};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint4 c16 = *reinterpret_cast<const uint4*>(ds + sw128(ql, 4 * hf + u));
      const uint32_t w4[4] = {c16.x, c16.y, c16.z, c16.w};
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int hw = 0; hw < 2; ++hw) {
          const float2 d = half2_bits_to_float2(f16x2_from_fp8x2<FMT>(w4[k] >> (16 * hw)));
          acc[0] += d.x + d.y;
          acc[1] += fabsf(d.x) + fabsf(d.y);
        }
    }
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const float mine = acc[pass] * s;
      const float r = mine + __shfl_xor_sync(0xffffffffu, mine, 1);
      if (hf == 0 && m0_ + ql < Sq) atomicAdd(p.rowsum_ws + (2 + pass) * n_rows + bhq_ * Sq + m0_ + ql, r);
    }
  };
  // d <= 128: dQ of an earlier tile pair (buffer pb_, its head / query tile
  // bhq_ / m0_): begin = wait for both warpgroups' dS codes, diagnostics,
  // issue chunk 0; finish = the remaining chunks, then buffer pb_ is free.
  // NOTE: pqa / pqb (the two partials, 32 registers each) are declared where
  // used: declared outside the loop, the fence_regs "+f" reads would keep them
  // live across the whole loop (548 B of spills at d = 64 and 128).
  auto dq_begin = [&](int wg, int pb_, int parity, int64_t bhq_, int m0_, float* pqa, float* pqb) {
    mbar_wait(bar_dsf(pb_), parity);
    if (diag) diag_post(sDS + pb_ * kTileBytes, sRowSq + pb_ * 2 * kTile, 64 * wg + ((threadIdx.x & 127) >> 1),
                        threadIdx.x & 1, bhq_, m0_);
    const uint32_t ds_lo = d_base + (L::kDS + pb_ * kTileBytes) / 16 + wg * kDesc64Rows;
    issue_dq2(ds_lo, 0, Int<64>{}, pqa, pqb);
  };
  auto dq_finish = [&](int wg, int pb_, int64_t bhq_, int m0_, float* pqa, float* pqb) {
    const uint32_t ds_lo = d_base + (L::kDS + pb_ * kTileBytes) / 16 + wg * kDesc64Rows;
    // v7: the s_dS of both row halves once for every chunk (before the
    // atomics, which the compiler cannot order against shared memory).
    const float4 sq4 = dq_scales(sRowSq + pb_ * 2 * kTile);
    float* dq_t = p.dq_accum + (bhq_ * Sq + m0_ + q0) * DQK + 2 * t;
    constexpr int kQch = L::kWk / 64;
#pragma unroll
    for (int h = 0; h < kQch; ++h) {
      if (h > 0) issue_dq2(ds_lo, 64 * h, Int<64>{}, pqa, pqb);
      float2 ksc[8];
#pragma unroll
      for (int jj = 0; jj < 8; jj += 2) {  // v7: fragment order
        const float4 k4 = frag_ld4(sKcs + 64 * h, jj, t);
        ksc[jj] = make_float2(k4.x, k4.y);
        ksc[jj + 1] = make_float2(k4.z, k4.w);
      }
      wg_wait<0>();
      fence_regs<32>(pqa);
      fence_regs<32>(pqb);
      store_dq2(Int<64>{}, pqa, pqb, ksc, sq4, dq_t, m0_, 64 * h);
    }
    mbar_arrive(bar_dse(pb_));  // this thread's dQ wgmmas and reads of buffer pb_ are done
  };

  int hq_it = hk * group, m_it = m_first;  // tile pair it (then it + 1, see the top of the loop)
  int64_t bhq_prev = 0;                    // d <= 128: tile pair it - 1, whose dQ runs in pair it
  int m0_prev = 0;
  // Pingpong (kWgPingpong): warpgroup 1 starts half a tile pair late.
  if constexpr (!kSliced && kWgPingpong) {
    if (n_iters > 0 && warpgroup_uniform() == 1) named_bar_sync(kWgBarPingpong, kWgThreads);
  }
  for (int it = 0; it < n_iters; ++it) {
    const int hq = hq_it, m_tile = m_it, st = it % L::kStages;
    // the next tile pair
    if (++m_it == nblk_q) {
      m_it = m_first;
      ++hq_it;
    }
    const int m0 = m_tile * kTile;
    const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
    const int wg = warpgroup_uniform_fresh();
    // d <= 128: tile pair it + 1's copies into stage st ^ 1 once pair it - 1
    // (both warpgroups) is done with it (kWgStageIssue: where).
    auto issue_next = [&]() {
      if constexpr (!kSliced) {
        if (it + 1 < n_iters) {
          if (it >= 1) mbar_wait(bar_empty(st ^ 1), ((it - 1) >> 1) & 1);
          issue_rows(hq_it, m_it, st ^ 1);
          issue_cols(hq_it, m_it, st ^ 1);
          issue_floats(hq_it, m_it, st ^ 1);
          cp_async_mbar_arrive(bar_full(st ^ 1));
        }
      }
    };
    if constexpr (kSliced) {
      cp_wait<0>();  // this thread's copies of tile it (issued one iteration ago)
      lse2_in_place(sf + L::kFStage + st * L::kFStageFloats + L::kSLse, kTile, m0, Sq);
      fence_async_smem();
      // Tile it visible to all; everyone is done with iteration it - 1, so the
      // column tiles and sDS are free.
      __syncthreads();
      issue_cols(hq, m_tile, st);
      cp_commit();
    } else {
      // NOTE (proxy order): the copies are cp.async (generic proxy) by all 256
      // threads; the readers are this thread's wgmmas (async proxy) and LDS.
      // The writer cannot fence after its own copies (it never waits for
      // them: the mbarrier's arrive-on does), so the fence is on the reader
      // side: the mbarrier wait (acquire) makes every thread's completed
      // copies visible to this thread, then fence.proxy.async orders them
      // before this thread's async-proxy reads. (CUTLASS's sm90 cp.async GMMA
      // mainloop, sm90_mma_multistage_gmma_ss_warpspecialized.hpp, uses the
      // mbarrier alone; the fence here is the conservative reading of the PTX
      // proxy rules, as v1-v5 fenced after cp.async.wait_group;
      // kWgStageReaderFence = false drops it, for a measurement.)
      mbar_wait(bar_full(st), (it >> 1) & 1);
      if constexpr (kWgStageReaderFence) fence_async_smem();
      if constexpr (kWgStageIssue == 0) issue_next();
    }
    const float* F = sf + L::kFStage + st * L::kFStageFloats;
    // Descriptors (warp-uniform): key / value rows of this warpgroup's 64
    // keys, the stage's query-side tiles.
    const uint32_t k_lo = d_base + L::kK / 16 + wg * kDesc64Rows;
    const uint32_t v_lo = d_base + L::kV / 16 + wg * kDesc64Rows;
    const uint32_t st_lo = d_base + (L::kStage + st * L::kStageBytes) / 16;
    const uint32_t q_lo = st_lo + L::kSQ / 16, do_lo = st_lo + L::kSDO / 16;
    const uint32_t qc_lo = st_lo + L::kSQc / 16, doc_lo = st_lo + L::kSDOc / 16;
    tg.m0 = m0;
    const bool interior = tg.interior();

    // ---- S^T and P (#3) (same instructions and scaling as the pre-pass). At
    // d = 64 both dP^T halves (#4) are issued with S^T (registers allow it).
    // d <= 128: the stage holds LSE itself (no in-place pass, v6); P reads the
    // warpgroup's LSE * log2(e) array written below (v7).
    constexpr bool kEarlyDp = DV <= 64;
    float pt[16][4];
    float dpe[kEarlyDp ? 2 : 1][8][4];
    if constexpr (kSliced) {
      wg_compute_s<DQK, kTile>(k_lo, q_lo, sKs, F + L::kSQs, warp, lane, pt);
      wg_tile_p_scaled<kTile>(pt, F + L::kSLse, tg.c2, lane);
    } else {
      wg_issue_s<DQK, kTile>(k_lo, q_lo, pt);
      if constexpr (kEarlyDp) {
        wg_issue_dp<DV, FMT>(v_lo, do_lo, 0, dpe[0]);
        wg_issue_dp<DV, FMT>(v_lo, do_lo, 1, dpe[1]);
      }
      // v7: LSE * log2(e) once per column and warpgroup (one FMUL per thread
      // instead of 32), issued under the S^T wgmma. NOTE (order): every warp
      // of this warpgroup read the previous pair's values before that pair's
      // amax barrier (named barrier kWgBarWarpgroup + wg), which this thread passed before
      // writing; the barrier below publishes the new values to the warpgroup.
      float* sLse2 = sf + L::kLse2 + wg * kTile;
      sLse2[threadIdx.x & (kTile - 1)] = __fmul_rn(F[L::kSLse + (threadIdx.x & (kTile - 1))], kLog2e);
      named_bar_sync(kWgBarWarpgroup + wg, 128);
      if constexpr (kEarlyDp) {
        wg_wait<2>();
      } else {
        wg_wait<0>();
      }
      wg_tile_p_main(pt, sKs, F + L::kSQs, sLse2, tg.c2, warp, lane);
    }
    if (!interior) {
      if constexpr (kSliced)
        wg_mask_p<kTile>(pt, F + L::kSLse, tg, warp, lane);
      else
        wg_mask_main<true>(pt, F + L::kSLse, tg, warp, lane);
    }

    // P^T codes for dV (#5): per key along the 128 queries (E4M3).
    uint32_t codes_p[8][2];
    float sp0, sp1;
    quantize_rows<kFmtE4M3>(pt, codes_p, sp0, sp1);

    // ---- dV += P^T dO (#5).
    // NOTE: N = 32 chunks at d = 128 keep the partial small (registers).
    // d <= 128: right after P^T's codes, before dP (the codes are dead before
    // dP's 32 accumulator registers are live: peak pt + dP instead of pt +
    // codes + dP; spills). Sliced: after the mid-pair barrier (do_colT loads
    // at the top of the pair).
    auto dv_step = [&](const uint32_t (&cp)[8][2], float s0, float s1) {
      constexpr int kNv = L::kWv > 64 ? 32 : 64;
#pragma unroll
      for (int h = 0; h < L::kWv / kNv; ++h)
        if (kNv * h < wv)
          wg_rows_x_tile<kFmtE4M3, FMT, kNv, !kSliced>(cp, s0, s1, doc_lo + h * (kNv * 128 / 16), F + L::kSDOcs + kNv * h, lane,
                                             &dv_acc[0][0][0] + h * (kNv / 2));
    };
    if constexpr (!kSliced) {
      dv_step(codes_p, sp0, sp1);
      if constexpr (kWgPingpong) {
        if (it == 0 && wg == 0) named_bar_arrive(kWgBarPingpong, kWgThreads);
      }
      if constexpr (kWgStageIssue == 1) issue_next();
    }
    // ---- dP_hat^T (#4) and dS = P o (dP_hat - delta), in place over P.
    // NOTE: d <= 128: dP_hat - delta = fmaf(part, s_dO s_V, -delta), the same
    // value as __fsub_rn(part * (s_dO s_V), delta) (the scale product is a
    // power of two, so part * s_dO * s_V is exact: one rounding either way),
    // i.e. the pre-pass's dP_hat bitwise; one FMUL + FFMA per element instead
    // of two FMUL + FADD.
    if constexpr (kEarlyDp) wg_wait<0>();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float(&dp)[8][4] = dpe[kEarlyDp ? half : 0];
      if constexpr (kSliced) {
        wg_compute_dp<DV, FMT, kTile>(v_lo, do_lo, sVs, F + L::kSDOs, warp, lane, half, dp);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = 8 * half + jj;
          const float2 dl = *reinterpret_cast<const float2*>(F + L::kSDelta + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) pt[j][e] = __fmul_rn(pt[j][e], __fsub_rn(dp[jj][e], (e & 1) ? dl.y : dl.x));
        }
      } else {
        if constexpr (!kEarlyDp) {
          wg_issue_dp<DV, FMT>(v_lo, do_lo, half, dp);
          wg_wait<0>();
        }
        fence_regs<32>(&dp[0][0]);
        const int r0 = warp * 16 + g;
        const float vs0 = sVs[r0], vs1 = sVs[r0 + 8];
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          const int j = 8 * half + jj;
          // v7: fragment order, one float4 of each array per two jj.
          const float4 dl4 = frag_ld4(F + L::kSDelta, j & ~1, t), os4 = frag_ld4(F + L::kSDOs, j & ~1, t);
          const float2 dl = (j & 1) ? make_float2(dl4.z, dl4.w) : make_float2(dl4.x, dl4.y);
          const float2 os = (j & 1) ? make_float2(os4.z, os4.w) : make_float2(os4.x, os4.y);
          pt[j][0] = __fmul_rn(pt[j][0], fmaf(dp[jj][0], __fmul_rn(os.x, vs0), -dl.x));
          pt[j][1] = __fmul_rn(pt[j][1], fmaf(dp[jj][1], __fmul_rn(os.y, vs0), -dl.y));
          pt[j][2] = __fmul_rn(pt[j][2], fmaf(dp[jj][2], __fmul_rn(os.x, vs1), -dl.x));
          pt[j][3] = __fmul_rn(pt[j][3], fmaf(dp[jj][3], __fmul_rn(os.y, vs1), -dl.y));
        }
      }
    }
    if (!interior) {  // P = 0 there, but dP_hat may be NaN
      if constexpr (kSliced)
        wg_mask_vis<kTile>(pt, tg, warp, lane);
      else
        wg_mask_main<false>(pt, nullptr, tg, warp, lane);
    }

    // Sliced: this pair's column tiles are in; the row tiles are free (every
    // S/dP wgmma completed, the row scales, LSE and delta read): load the
    // next pair's rows under dV, dK and dQ.
    if constexpr (kSliced) {
      cp_wait<0>();
      fence_async_smem();
      __syncthreads();
      if (it + 1 < n_iters) issue_rows(hq_it, m_it, st);
      cp_commit();
    }

    if constexpr (kSliced) dv_step(codes_p, sp0, sp1);

    // ---- Diagnostics: pre-cast row sums of dS over this tile's keys (sum,
    // then sum of |.|, one at a time and per 64 columns to keep registers
    // low). NOTE: the diagnostics' register peak sets the kernel's spills
    // (ptxas allocates the loop as a whole): 16 values at a time here, and
    // the post-cast sums below read the codes from shared memory.
    if (diag) {
#pragma unroll
      for (int pass = 0; pass < 2; ++pass)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          float v[16], rs[2];
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float* x = pt[8 * hf + j];
              v[2 * j + e] = pass == 0 ? x[e] + x[e + 2] : fabsf(x[e]) + fabsf(x[e + 2]);
            }
          reduce_cols(v, rs, lane, OpAdd());  // N = 16: one 64-column half
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int q = m0 + q_of_col(64 * hf + 8 * g + 2 * t + e);
            if (q < Sq) atomicAdd(p.rowsum_ws + pass * n_rows + bhq * Sq + q, rs[e]);
          }
        }
    }

    // ---- dS per query along the 64 keys of this warpgroup (#6 operand, one
    // kWgDsBlock block): amax across the warpgroup's 4 warps.
    // d <= 128: buffer st (pair it & 1); before writing it (codes and s_dS),
    // both warpgroups' dQ of pair it - 2 must be done with it.
    const int buf = kSliced ? 0 : st;
    if constexpr (!kSliced) {
      if (it >= 2) mbar_wait(bar_dse(buf), ((it >> 1) & 1) ^ 1);
    }
    {
      float v[32], m[4];
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) v[2 * j + e] = max_nan(fabsf(pt[j][e]), fabsf(pt[j][e + 2]));
      reduce_cols(v, m, lane, OpMaxNan());
#pragma unroll
      for (int i = 0; i < 4; ++i) sAmax[warp * kTile + reduced_col(lane, i)] = m[i];
    }
    // NOTE: the sliced kernels keep their lockstep (__syncthreads); d <= 128
    // syncs the warpgroup only (named barrier kWgBarWarpgroup + wg; 0 is __syncthreads).
    auto wg_sync = [&]() {
      if constexpr (kSliced)
        __syncthreads();
      else
        named_bar_sync(kWgBarWarpgroup + wg, 128);
    };
    wg_sync();
    static_assert(kTile == 128 && kWgThreads == 2 * kTile, "one column per thread of each warpgroup");
    {
      const int i = threadIdx.x & (kTile - 1);  // column of this warpgroup's block wg
      float m = 0.f;
#pragma unroll
      for (int w = 0; w < kDsWarps; ++w) m = max_nan(m, sAmax[(kDsWarps * wg + w) * kTile + i]);
      const float2 sc = fast_scale<FMT>(m);
      sRowInv[wg * kTile + (kSliced ? i : frag_pos(i))] = sc.y;  // v7: fragment order at d <= 128
      sRowSq[(2 * buf + wg) * kTile + q_of_col(i)] = sc.x;
    }
    wg_sync();
    // sDS row q, byte (key): keys 16 warp + 2g, +1 are this thread's rows g, g + 8.
    // NOTE: column 8j + 2t + e is query ql = 16 (j >> 1) + 4t + c with
    // c = 2 (j & 1) + e, so ql & 7 = 4 (t & 1) + c and its swizzled chunk is
    // warp ^ 4 (t & 1) ^ c: four per-thread bases (one per c), then
    // compile-time offsets 2048 (j >> 1) (was ~190 integer instructions per
    // tile pair of sw128 / q_of_col arithmetic, ncu 2026-11-29). Warpgroup wg
    // writes chunks 4 wg .. 4 wg + 3 (keys [64 wg, 64 wg + 64)) of every row.
    {
      uint8_t* ds_base[4];
      const float* inv_wg = sRowInv + wg * kTile;
      uint8_t* sDSb = sDS + buf * kTileBytes;
#pragma unroll
      for (int c = 0; c < 4; ++c)
        ds_base[c] = sDSb + 128 * (4 * t + c) + ((warp ^ (4 * (t & 1)) ^ c) << 4) + 2 * g;
      // v7 (d <= 128): fragment order, one float4 per two j, loaded before
      // the pair's stores (the byte stores could alias it for the compiler).
      float4 inv4 = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float2 inv;
        if constexpr (kSliced) {
          inv = *reinterpret_cast<const float2*>(inv_wg + 8 * j + 2 * t);
        } else {
          if ((j & 1) == 0) inv4 = frag_ld4(inv_wg, j, t);
          inv = (j & 1) ? make_float2(inv4.z, inv4.w) : make_float2(inv4.x, inv4.y);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float iv = e ? inv.y : inv.x;
          const uint32_t two = cvt2<FMT>(pt[j][e] * iv, pt[j][e + 2] * iv);
          *reinterpret_cast<uint16_t*>(ds_base[2 * (j & 1) + e] + 2048 * (j >> 1)) = static_cast<uint16_t>(two);
        }
      }
    }
    // sDS stores (generic proxy) -> fence.proxy.async -> (d <= 128) ds_full
    // arrive (release); the dQ readers wait ds_full (acquire) before their
    // wgmmas (async proxy). Sliced: -> the "sDS complete" __syncthreads below.
    fence_async_smem();
    if constexpr (!kSliced) {
      mbar_arrive(bar_dsf(buf));
      if constexpr (kWgStageIssue == 2) issue_next();
    }
    // dS^T codes for dK (#7): per key along the 128 queries (grad_format).
    uint32_t codes_s[8][2];
    float sd0, sd1;
    quantize_rows<FMT>(pt, codes_s, sd0, sd1);
    uint32_t a_s[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      a_s[c][0] = codes_s[2 * c][0];
      a_s[c][1] = codes_s[2 * c][1];
      a_s[c][2] = codes_s[2 * c + 1][0];
      a_s[c][3] = codes_s[2 * c + 1][1];
    }
    if constexpr (kSliced) {
      __syncthreads();  // sDS complete
      // Two threads per query row, one 64-key block each.
      if (diag) diag_post(sDS, sRowSq, threadIdx.x >> 1, threadIdx.x & 1, bhq, m0);
    }

    // ---- dK += dS^T Q (#7, RS, per 32 output columns) and dQ = dS K (#6).
    // d <= 128: dK software-pipelined (two chunks in flight, each scaled while
    // the next runs), then dQ of tile pair it - 1 (v6: one pair late, from the
    // other dS buffer), its chunk 0 issued under the last dK scaling.
    // NOTE: registers: at most 16 (dK chunk) + 16 (dS^T codes) + 64 (the two
    // dQ sub-chain partials of one 64-column chunk) accumulator registers in
    // flight next to dK + dV (128), the peak of v5's schedule.
    {
      constexpr int kKch = L::kWk / 32;
      auto issue_dk = [&](int c, float(&pk)[4][4]) {
        fence_regs<16>(&pk[0][0]);
        wg_arrive();
#pragma unroll
        for (int k = 0; k < 4; ++k)
          gmma_rs<FMT, kFmtE4M3, 32>(a_s[k], desc_of(qc_lo + c * (32 * 128 / 16) + kDescK32 * k), &pk[0][0], k > 0);
        wg_commit();
      };
      // Q column scales of dK chunk c (4 float2 per thread).
      auto load_sb = [&](int c, float2(&sb)[4]) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          if constexpr (kSliced) {
            sb[jj] = *reinterpret_cast<const float2*>(F + L::kSQcs + 32 * c + 8 * jj + 2 * t);
          } else if ((jj & 1) == 0) {  // v7: fragment order
            const float4 s4 = frag_ld4(F + L::kSQcs + 32 * c, jj, t);
            sb[jj] = make_float2(s4.x, s4.y);
            sb[jj + 1] = make_float2(s4.z, s4.w);
          }
        }
      };
      auto scale_dk_sb = [&](int c, float(&pk)[4][4], const float2(&sb)[4]) {
        fence_regs<16>(&pk[0][0]);
        float* d = &dk_acc[0][0][0] + 16 * c;  // columns [32 c, 32 c + 32): dk_acc[c / 2][4 (c % 2) + jj]
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          d[4 * jj + 0] = fmaf(pk[jj][0], sd0 * sb[jj].x, d[4 * jj + 0]);
          d[4 * jj + 1] = fmaf(pk[jj][1], sd0 * sb[jj].y, d[4 * jj + 1]);
          d[4 * jj + 2] = fmaf(pk[jj][2], sd1 * sb[jj].x, d[4 * jj + 2]);
          d[4 * jj + 3] = fmaf(pk[jj][3], sd1 * sb[jj].y, d[4 * jj + 3]);
        }
      };
      float pk0[4][4], pk1[4][4];
      if constexpr (!kSliced) {
        static_assert(kKch == 4 || kKch == 2, "dK chunk schedule");
        // NOTE: two straight-line instances (with / without the dQ of pair
        // it - 1, i.e. it > 0 / it == 0): with one instance and runtime
        // branches around the dQ issue and its waits, ptxas could not prove
        // the dQ partials complete on every path (C7517: injected
        // warpgroup.wait) and spilled 548 B at d = 64 and 128.
        auto dk_dq = [&](auto with_dq) {
          constexpr bool kDq = decltype(with_dq)::value;
          float2 sb[4];
          float pqa[8][4], pqb[8][4];
          issue_dk(0, pk0);
          issue_dk(1, pk1);
#pragma unroll
          for (int c = 0; c < kKch; ++c) {
            float(&pk)[4][4] = (c & 1) ? pk1 : pk0;
            // NOTE (v5): each chunk's scales are loaded (LDS) before its wgmma
            // wait, so their latency hides under the wait.
            load_sb(c, sb);
            if (c == kKch - 1 && kDq) {
              dq_begin(wg, buf ^ 1, ((it - 1) >> 1) & 1, bhq_prev, m0_prev, &pqa[0][0], &pqb[0][0]);
              wg_wait<1>();
            } else if (c == kKch - 1) {
              wg_wait<0>();
            } else {
              wg_wait<1>();
            }
            scale_dk_sb(c, pk, sb);
            if (c + 2 < kKch) issue_dk(c + 2, pk);
          }
          fence_regs_u(&a_s[0][0], 16);
          // Every read of stage st by this thread is done (the dK wgmmas
          // completed, the scales loaded): the stage may be refilled.
          mbar_arrive(bar_empty(st));
          if constexpr (kDq) dq_finish(wg, buf ^ 1, bhq_prev, m0_prev, &pqa[0][0], &pqb[0][0]);
        };
        if (it > 0)
          dk_dq(std::true_type{});
        else
          dk_dq(std::false_type{});
        bhq_prev = bhq;
        m0_prev = m0;
      } else {
        // Sliced: one chunk at a time (NOTE: the pipelined schedule gave wrong
        // dQ columns 0..63 of slice 0 at (192, 128) on the H200, cause not
        // found; the serial schedule is correct for any wk). dQ per 32
        // columns: two m64n32 sub-chains (32 registers, as one m64n64 chain).
        float2 sb[4];
#pragma unroll
        for (int c = 0; c < kKch; ++c) {
          if (32 * c >= wk) continue;
          issue_dk(c, pk0);
          wg_wait<0>();
          load_sb(c, sb);
          scale_dk_sb(c, pk0, sb);
        }
        fence_regs_u(&a_s[0][0], 16);
        const uint32_t ds_lo = d_base + L::kDS / 16 + wg * kDesc64Rows;  // this warpgroup's 64 queries
        float* dq_t = p.dq_accum + (bhq * Sq + m0 + q0) * DQK + cb + 2 * t;
#pragma unroll
        for (int c = 0; c < kKch; ++c) {
          if (32 * c >= wk) continue;
          issue_dq2(ds_lo, 32 * c, Int<32>{}, &pk0[0][0], &pk1[0][0]);
          wg_wait<0>();
          fence_regs<16>(&pk0[0][0]);
          fence_regs<16>(&pk1[0][0]);
          float2 ksc[4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) ksc[jj] = *reinterpret_cast<const float2*>(sKcs + 32 * c + 8 * jj + 2 * t);
          store_dq2(Int<32>{}, &pk0[0][0], &pk1[0][0], ksc, dq_scales(sRowSq), dq_t, m0, 32 * c);
        }
      }
    }
  }
  // d <= 128: dQ of the last tile pair.
  if constexpr (!kSliced) {
    if (n_iters > 0) {
      const int wg = warpgroup_uniform_fresh();
      const int pb_ = (n_iters - 1) & 1;
      float pqa[8][4], pqb[8][4];
      dq_begin(wg, pb_, ((n_iters - 1) >> 1) & 1, bhq_prev, m0_prev, &pqa[0][0], &pqb[0][0]);
      dq_finish(wg, pb_, bhq_prev, m0_prev, &pqa[0][0], &pqb[0][0]);
    }
  }
  cp_wait<0>();

  // ---- Epilogue: dK = tau * acc, dV = acc (BF16), keys < seqlen_k.
  __nv_bfloat16* dk = static_cast<__nv_bfloat16*>(p.dk);
  __nv_bfloat16* dv = static_cast<__nv_bfloat16*>(p.dv);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + k_of_row(warp * 16 + g + 8 * hh);
    if (key >= Sk) continue;
#pragma unroll
    for (int h = 0; h < L::kWk / 64; ++h) {
      if (64 * h >= wk) continue;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int c = cb + 64 * h + 8 * jj + 2 * t;
        const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(dk_acc[h][jj][2 * hh], p.softmax_scale),
                                                       __fmul_rn(dk_acc[h][jj][2 * hh + 1], p.softmax_scale));
        *reinterpret_cast<__nv_bfloat162*>(dk + (bhk * Sk + key) * DQK + c) = v;
      }
    }
#pragma unroll
    for (int h = 0; h < L::kWv / 64; ++h) {
      if (64 * h >= wv) continue;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int c = cb + 64 * h + 8 * jj + 2 * t;
        const __nv_bfloat162 v = __floats2bfloat162_rn(dv_acc[h][jj][2 * hh], dv_acc[h][jj][2 * hh + 1]);
        *reinterpret_cast<__nv_bfloat162*>(dv + (bhk * Sk + key) * DV + c) = v;
      }
    }
  }
}


template <class K>
void set_smem(K kernel, int bytes, const char* what) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: ") + what + ": cudaFuncSetAttribute failed: " +
                             cudaGetErrorString(err));
}
void check(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: ") + what + " launch failed: " + cudaGetErrorString(err));
}

template <class F>
void dispatch_wgmma(const KernelParams& p, F&& f) {
  auto with_fmt = [&](auto dqk, auto dv) {
    if (p.grad_format == kFmtE5M2)
      f(dqk, dv, Int<kFmtE5M2>{});
    else
      f(dqk, dv, Int<kFmtE4M3>{});
  };
  if (p.head_dim_qk == 64 && p.head_dim_v == 64) return with_fmt(Int<64>{}, Int<64>{});
  if (p.head_dim_qk == 128 && p.head_dim_v == 128) return with_fmt(Int<128>{}, Int<128>{});
  if (p.head_dim_qk == 256 && p.head_dim_v == 256) return with_fmt(Int<256>{}, Int<256>{});
  if (p.head_dim_qk == 192 && p.head_dim_v == 128) return with_fmt(Int<192>{}, Int<128>{});
  throw std::runtime_error(
      "fp8attn: argument 'head_dim': the wgmma backward supports (64, 64), (128, 128), (256, 256) and (192, 128)");
}

}  // namespace

void launch_wgmma_prepass(const KernelParams& p, cudaStream_t stream) {
  dispatch_wgmma(p, [&](auto dqk, auto dv, auto fmt) {
    constexpr int DQK = decltype(dqk)::value, DV = decltype(dv)::value, FMT = decltype(fmt)::value;
    using L = WgPrepassLayout<DQK, DV>;
    auto kernel = bwd_wgmma_prepass_kernel<DQK, DV, FMT>;
    set_smem(kernel, L::kBytes, "bwd wgmma pre-pass");
    // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h).
    launch_attn_chunks(p, (p.seqlen_q + kPreQ - 1) / kPreQ, GridHeads::kQuery, 1, "bwd wgmma pre-pass",
                       [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                         kernel<<<dim3(gx, gy, gz), kWgThreads, L::kBytes, stream>>>(pc);
                         check("bwd wgmma pre-pass");
                       });
  });
}

void launch_wgmma_main(const KernelParams& p, cudaStream_t stream) {
  dispatch_wgmma(p, [&](auto dqk, auto dv, auto fmt) {
    constexpr int DQK = decltype(dqk)::value, DV = decltype(dv)::value, FMT = decltype(fmt)::value;
    using L = WgMainLayout<DQK, DV>;
    auto kernel = bwd_wgmma_main_kernel<DQK, DV, FMT>;
    set_smem(kernel, L::kBytes, "bwd wgmma main");
    // NOTE: one launch unless batch or num_heads_kv * slices exceed 65535 (launch_sm90.h).
    launch_attn_chunks(p, (p.seqlen_k + kTile - 1) / kTile, GridHeads::kKv, L::kSlices, "bwd wgmma main",
                       [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                         kernel<<<dim3(gx, gy, gz), kWgThreads, L::kBytes, stream>>>(pc);
                         check("bwd wgmma main");
                       });
  });
}

}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
