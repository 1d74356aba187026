// fp8attn: sm_90a FP8 backward with block scales (numerics.md sections 3-5):
// the main backward kernel, the small row kernels around it, and run_bwd.
//
// Main kernel: one CTA per (key tile of 128, kv head x head-dim slice, batch).
// It loops over the query heads of the GQA group and over the query tiles that
// see its keys, and for each tile pair (warp w = keys [16w, 16w+16)):
//   S^T, P (FP32)                     #3   (tile_s, tile_p: shared with the pre-pass)
//   P^T -> E4M3 per key along queries; dV += P^T dO                   #5
//   dP_hat^T chunks; dS = P o (dP_hat - delta)      #4   (tile_dp, shared)
//   dS^T -> grad_format per key along queries; dK += dS^T Q           #7
//   dS -> grad_format per query in 64-key blocks (kDsBlock; amax across the
//   4 warps of each block), stored to shared memory; dQ_tile = dS K with one
//   FP32 partial per 64-key block -> atomicAdd into dq_accum           #6
// dK/dV accumulate in registers (FP32) over the whole group, so no atomics
// are needed for them. Each CTA handles kSlice output columns of dK, dV, dQ;
// MMAs are FP16 m16n8k16 on exactly decoded FP8 operands (bwd_tile_sm90.cuh);
// S and dP are recomputed per slice (see docs/kernels/bwd_sm90.md).
#include "hopper/bwd_sm90.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/env_choice.h"
#include "hopper/bwd_tile_sm90.cuh"
#include "hopper/bwd_tilescale_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/scheduler_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace {

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: ") + what + " launch failed: " + cudaGetErrorString(err));
}

template <int DQK, int DV>
struct MainLayout {
  static constexpr int kNbQK = num_dim_blocks(DQK), kNbV = num_dim_blocks(DV);
  // bytes
  static constexpr int kK = 0;                              // K_hat rows "p8"   [128][DQK]
  static constexpr int kV = kK + kTile * (DQK + kRowPad);   // V_hat rows "p8"   [128][DV]
  static constexpr int kQ = kV + kTile * (DV + kRowPad);    // Q_hat rows        [128][DQK] (row_ld)
  static constexpr int kDO = kQ + kTile * row_ld(DQK);      // dO_hat rows       [128][DV]  (row_ld)
  static constexpr int kQc = kDO + kTile * row_ld(DV);      // q_colT slice  FP16 [kSlice][128 q]
  static constexpr int kDOc = kQc + kSlice * kLdH;          // do_colT slice FP16 [kSlice][128 q]
  static constexpr int kKc = kDOc + kSlice * kLdH;          // k_colT slice  FP16 [kSlice][128 k] ("hk")
  static constexpr int kDS = kKc + kSlice * kLdH;           // dS codes [128 q][128 k] (see kernel)
  static constexpr int kF = kDS + kTile * kLd8;
  // floats from kF
  static constexpr int kKs = 0;
  static constexpr int kVs = kKs + kTile * kNbQK;
  static constexpr int kQs = kVs + kTile * kNbV;
  static constexpr int kDOs = kQs + kTile * kNbQK;
  static constexpr int kQcs = kDOs + kTile * kNbV;
  static constexpr int kDOcs = kQcs + kSlice;
  static constexpr int kKcs = kDOcs + kSlice;
  static constexpr int kLse2 = kKcs + kSlice;
  static constexpr int kDelta = kLse2 + kTile;
  static constexpr int kRowS = kDelta + kTile;               // [kDsBlocks][128 q] dS scales (#6)
  static constexpr int kRowInv = kRowS + kDsBlocks * kTile;  // [kDsBlocks][128 q] their inverses
  static constexpr int kAmax = kRowInv + kDsBlocks * kTile;
  static constexpr int kFloats = kAmax + kWarps * kTile;
  static constexpr int kBytes = kF + 4 * kFloats;
  static_assert(kF % 16 == 0, "aligned float section");
  static_assert(kBytes <= 227 * 1024, "shared memory of one CTA");
  static_assert(DQK % kSlice == 0 && DV % kSlice == 0, "whole slices");
  static constexpr int kSlices = (DQK > DV ? DQK : DV) / kSlice;
};

// dst[4 * ng + jj] += (sum over the 128-query tile of A * B) * sa(row) * sb(col)
// for kSlice output columns: A = this warp's 16 x 128 codes (quantize_rows), B
// = an FP16 [kSlice][128] shared tile (channels x queries). Used for dV (#5)
// and dK (#7). sa * sb is an exact power of two, so fmaf adds the same number
// as the reference's acc + (partial * sa) * sb.
template <int FA>
__device__ __forceinline__ void mma_rows_x_tile(const uint32_t (&codes)[8][2], float sa0, float sa1,
                                                const uint8_t* sB, const float* sBs, int lane,
                                                float (&dst)[kSlice / 8][4]) {
  const int t = lane & 3;
  const uint8_t* bb = sB + (8 * (lane >> 4) + (lane & 7)) * kLdH + 16 * ((lane >> 3) & 1);
#pragma unroll
  for (int ng = 0; ng < kSlice / 32; ++ng) {
    float part[4][4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) part[jj][0] = part[jj][1] = part[jj][2] = part[jj][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const uint32_t a0 = f16x2_from_fp8x2<FA>(codes[ks][0]), a2 = f16x2_from_fp8x2<FA>(codes[ks][0] >> 16);
      const uint32_t a1 = f16x2_from_fp8x2<FA>(codes[ks][1]), a3 = f16x2_from_fp8x2<FA>(codes[ks][1] >> 16);
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, bb + (32 * ng + 16 * jp) * kLdH + 32 * ks);
        hmma(part[2 * jp], a0, a1, a2, a3, b0, b1);
        hmma(part[2 * jp + 1], a0, a1, a2, a3, b2, b3);
      }
    }
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const float2 sb = *reinterpret_cast<const float2*>(sBs + 32 * ng + 8 * jj + 2 * t);
      float* d = dst[4 * ng + jj];
      d[0] = fmaf(part[jj][0], sa0 * sb.x, d[0]);
      d[1] = fmaf(part[jj][1], sa0 * sb.y, d[1]);
      d[2] = fmaf(part[jj][2], sa1 * sb.x, d[2]);
      d[3] = fmaf(part[jj][3], sa1 * sb.y, d[3]);
    }
  }
}

// dS = P o (dP_hat - delta) for this warp's tile, in place over P (#4 via the
// shared tile_dp). With kMask, invisible entries are exact zeros.
template <int DV, int FMT, bool kMask>
__device__ __forceinline__ void tile_ds(float (&pt)[16][4], const uint8_t* sV, const float* sVs,
                                        const uint8_t* sdO, const float* sdOs, const float* sDelta,
                                        const TileGeom& tg, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int jg = 0; jg < 4; ++jg) {
    float dp[4][4];
    tile_dp<DV, FMT>(sV, sVs, sdO, sdOs, warp, lane, jg, dp);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const float2 dl = *reinterpret_cast<const float2*>(sDelta + 32 * jg + 8 * jj + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = pt[4 * jg + jj][e];
        const float v = __fmul_rn(x, __fsub_rn(dp[jj][e], (e & 1) ? dl.y : dl.x));
        if constexpr (kMask) {
          const int ql = 32 * jg + 8 * jj + 2 * t + (e & 1), kl = warp * 16 + g + 8 * (e >> 1);
          x = tg.visible(kl, ql) ? v : 0.f;
        } else {
          x = v;
        }
      }
    }
  }
}

template <int DQK, int DV, int FMT>
__global__ void __launch_bounds__(kThreads, 1) bwd_main_kernel(const KernelParams p) {
  using L = MainLayout<DQK, DV>;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* sK = smem + L::kK;
  uint8_t* sV = smem + L::kV;
  uint8_t* sQ = smem + L::kQ;
  uint8_t* sdO = smem + L::kDO;
  uint8_t* sQc = smem + L::kQc;
  uint8_t* sdOc = smem + L::kDOc;
  uint8_t* sKc = smem + L::kKc;
  uint8_t* sDS = smem + L::kDS;
  float* sf = reinterpret_cast<float*>(smem + L::kF);
  float* sKs = sf + L::kKs;
  float* sVs = sf + L::kVs;
  float* sQs = sf + L::kQs;
  float* sdOs = sf + L::kDOs;
  float* sQcs = sf + L::kQcs;
  float* sdOcs = sf + L::kDOcs;
  float* sKcs = sf + L::kKcs;
  float* sLse2 = sf + L::kLse2;
  float* sDelta = sf + L::kDelta;
  float* sRowS = sf + L::kRowS;
  float* sRowInv = sf + L::kRowInv;
  float* sAmax = sf + L::kAmax;

  const int n_tile = blockIdx.x;
  const int hk = blockIdx.y / L::kSlices, slice = blockIdx.y % L::kSlices;
  const int b = blockIdx.z;
  const int c_base = slice * kSlice;
  const bool do_dk = c_base < DQK, do_dv = c_base < DV;  // dQ goes with dK
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int group = p.num_heads_q / p.num_heads_kv;
  const int nblk_q = (Sq + kTile - 1) / kTile, nblk_k = (Sk + kTile - 1) / kTile;
  const int n0 = n_tile * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool diag = p.diag != nullptr && slice == 0;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;
  const int64_t n_rows = static_cast<int64_t>(p.batch) * p.num_heads_q * Sq;  // rowsum_ws plane

  // Key-side operands, once per CTA: K_hat, V_hat rows (#3, #4 A operands) and
  // the k_colT slice (#6 B operand, per channel along keys).
  load_rows_p8<DQK>(sK, p.k_row + bhk * Sk * DQK, n0, Sk);
  load_rows_p8<DV>(sV, p.v_row + bhk * Sk * DV, n0, Sk);
  load_row_scales<L::kNbQK>(sKs, p.k_row_s + bhk * Sk * L::kNbQK, n0, Sk);
  load_row_scales<L::kNbV>(sVs, p.v_row_s + bhk * Sk * L::kNbV, n0, Sk);
  if (do_dk) {
    load_cols<kSlice, kFmtE4M3, true>(sKc, p.k_colT + (bhk * DQK + c_base) * p.seqlen_k_pad, p.seqlen_k_pad,
                                      n0, Sk);
    for (int i = threadIdx.x; i < kSlice; i += kThreads)
      sKcs[i] = p.k_col_s[(bhk * DQK + c_base + i) * nblk_k + n_tile];
  }

  TileGeom tg;
  tg.n0 = n0;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = Sk - Sq;
  tg.causal = p.causal;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);

  float dk_acc[kSlice / 8][4], dv_acc[kSlice / 8][4];
#pragma unroll
  for (int j = 0; j < kSlice / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[j][e] = dv_acc[j][e] = 0.f;

  for (int hq = hk * group; hq < (hk + 1) * group; ++hq) {
    const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
    for (int m_tile = 0; m_tile < nblk_q; ++m_tile) {
      const int m0 = m_tile * kTile;
      // Skip query tiles that see none of this CTA's keys (causal).
      if (p.causal && min(m0 + kTile - 1, Sq - 1) + tg.causal_off < n0) continue;
      tg.m0 = m0;
      const bool interior = tg.interior();

      __syncthreads();  // the previous tile pair is done with shared memory
      load_rows<DQK, kFmtE4M3>(sQ, p.q_row + bhq * Sq * DQK, m0, Sq);
      load_rows<DV, FMT>(sdO, p.do_row + bhq * Sq * DV, m0, Sq);
      load_row_scales<L::kNbQK>(sQs, p.q_row_s + bhq * Sq * L::kNbQK, m0, Sq);
      load_row_scales<L::kNbV>(sdOs, p.do_row_s + bhq * Sq * L::kNbV, m0, Sq);
      if (do_dk) {
        load_cols<kSlice, kFmtE4M3, false>(sQc, p.q_colT + (bhq * DQK + c_base) * p.seqlen_q_pad,
                                           p.seqlen_q_pad, m0, Sq);
        for (int i = threadIdx.x; i < kSlice; i += kThreads)
          sQcs[i] = p.q_col_s[(bhq * DQK + c_base + i) * nblk_q + m_tile];
      }
      if (do_dv) {
        load_cols<kSlice, FMT, false>(sdOc, p.do_colT + (bhq * DV + c_base) * p.seqlen_q_pad,
                                      p.seqlen_q_pad, m0, Sq);
        for (int i = threadIdx.x; i < kSlice; i += kThreads)
          sdOcs[i] = p.do_col_s[(bhq * DV + c_base + i) * nblk_q + m_tile];
      }
      for (int i = threadIdx.x; i < kTile; i += kThreads) {
        const bool in = m0 + i < Sq;
        sLse2[i] = in ? __fmul_rn(p.lse[bhq * Sq + m0 + i], kLog2e) : -INFINITY;
        sDelta[i] = in ? p.delta[bhq * Sq + m0 + i] : 0.f;
      }
      __syncthreads();

      // ---- S^T and P (#3), shared with the pre-pass.
      float pt[16][4];
      tile_s<DQK>(sK, sKs, sQ, sQs, warp, lane, pt);
      if (interior)
        tile_p<false>(pt, sLse2, tg, warp, lane);
      else
        tile_p<true>(pt, sLse2, tg, warp, lane);

      // ---- dV += P^T dO (#5): P per key along the 128 queries (E4M3).
      if (do_dv) {
        uint32_t codes[8][2];
        float sp0, sp1;
        quantize_rows<kFmtE4M3>(pt, codes, sp0, sp1);
        mma_rows_x_tile<kFmtE4M3>(codes, sp0, sp1, sdOc, sdOcs, lane, dv_acc);
      }

      // ---- dP_hat^T (#4, shared with the pre-pass) and dS = P o (dP_hat - delta).
      if (interior)
        tile_ds<DV, FMT, false>(pt, sV, sVs, sdO, sdOs, sDelta, tg, warp, lane);
      else
        tile_ds<DV, FMT, true>(pt, sV, sVs, sdO, sdOs, sDelta, tg, warp, lane);

      // ---- Diagnostics: pre-cast row sums of dS over this tile's keys.
      if (diag) {
        float v[32], a[32], rs[4], ra[4];
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            v[2 * j + e] = pt[j][e] + pt[j][e + 2];
            a[2 * j + e] = fabsf(pt[j][e]) + fabsf(pt[j][e + 2]);
          }
        reduce_cols(v, rs, lane, OpAdd());
        reduce_cols(a, ra, lane, OpAdd());
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int ql = reduced_col(lane, i);
          if (m0 + ql < Sq) {
            atomicAdd(p.rowsum_ws + bhq * Sq + m0 + ql, rs[i]);
            atomicAdd(p.rowsum_ws + n_rows + bhq * Sq + m0 + ql, ra[i]);
          }
        }
      }

      // ---- dK += dS^T Q (#7): dS per key along the 128 queries (grad_format).
      if (do_dk) {
        uint32_t codes[8][2];
        float sd0, sd1;
        quantize_rows<FMT>(pt, codes, sd0, sd1);
        mma_rows_x_tile<FMT>(codes, sd0, sd1, sQc, sQcs, lane, dk_acc);
      }

      // ---- dS per query in 64-key blocks (#6 operand): amax across the 4
      // warps of each block.
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
      __syncthreads();
      for (int i = threadIdx.x; i < kDsBlocks * kTile; i += kThreads) {
        const int blk = i / kTile, q = i % kTile;
        float m = 0.f;
#pragma unroll
        for (int w = 0; w < kDsWarps; ++w) m = max_nan(m, sAmax[(blk * kDsWarps + w) * kTile + q]);
        const float2 sc = fast_scale<FMT>(m);
        sRowS[i] = sc.x;  // sRowS[blk * kTile + q]
        sRowInv[i] = sc.y;
      }
      __syncthreads();
      // sDS row q (bytes): the codes of the warp's keys g and g+8 sit at
      // 16 warp + 4 (g % 4) + 2 (g / 4) + {0, 1}; so a 32-bit load at byte
      // 16 ks + 4 t holds keys 16 ks + {t, t+8, t+4, t+12}: the k16 fragment
      // positions {2t, 2t+1, 2t+8, 2t+9} under the key order of sKc ("hk").
      {
        const float* blk_s = sRowS + (warp / kDsWarps) * kTile;  // this warp's dS block
        const float* blk_inv = sRowInv + (warp / kDsWarps) * kTile;
        float pv[32], pa[32];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float2 inv = *reinterpret_cast<const float2*>(blk_inv + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int ql = 8 * j + 2 * t + e;
            const float iv = e ? inv.y : inv.x;
            const uint32_t two = cvt2<FMT>(pt[j][e] * iv, pt[j][e + 2] * iv);
            *reinterpret_cast<uint16_t*>(sDS + ql * kLd8 + warp * 16 + 4 * (g & 3) + 2 * (g >> 2)) =
                static_cast<uint16_t>(two);
            if (diag) {  // post-cast row sums on the decoded #6 operand
              const float s = blk_s[ql];
              const float2 d = half2_bits_to_float2(f16x2_from_fp8x2<FMT>(two));
              pv[2 * j + e] = d.x * s + d.y * s;
              pa[2 * j + e] = fabsf(d.x * s) + fabsf(d.y * s);
            }
          }
        }
        if (diag) {
          float rs[4], ra[4];
          reduce_cols(pv, rs, lane, OpAdd());
          reduce_cols(pa, ra, lane, OpAdd());
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int ql = reduced_col(lane, i);
            if (m0 + ql < Sq) {
              atomicAdd(p.rowsum_ws + 2 * n_rows + bhq * Sq + m0 + ql, rs[i]);
              atomicAdd(p.rowsum_ws + 3 * n_rows + bhq * Sq + m0 + ql, ra[i]);
            }
          }
        }
      }
      __syncthreads();

      // ---- dQ_tile = dS K (#6) for query rows [16 warp, 16 warp + 16) -> dq_accum.
      // One FP32 partial per 64-key dS block (k16 steps [4 blk, 4 blk + 4)),
      // promoted with s_dS(row, blk) * s_K(channel) in key order; the sum of
      // the tile's blocks goes to dq_accum with one atomicAdd.
      if (do_dk) {
        constexpr int kStepsPerBlk = kDsBlock / 16;
        const uint8_t* arow = sDS + (warp * 16 + g) * kLd8;
        const uint8_t* bb = sKc + (8 * (lane >> 4) + (lane & 7)) * kLdH + 16 * ((lane >> 3) & 1);
        const int ql0 = warp * 16 + g;
        float* dq_row0 = p.dq_accum + (bhq * Sq + m0 + ql0) * DQK + c_base;
#pragma unroll
        for (int ng = 0; ng < kSlice / 32; ++ng) {
          float acc[4][4];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) acc[jj][0] = acc[jj][1] = acc[jj][2] = acc[jj][3] = 0.f;
#pragma unroll
          for (int blk = 0; blk < kDsBlocks; ++blk) {
            float part[4][4];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) part[jj][0] = part[jj][1] = part[jj][2] = part[jj][3] = 0.f;
#pragma unroll
            for (int ks = blk * kStepsPerBlk; ks < (blk + 1) * kStepsPerBlk; ++ks) {
              uint32_t a0, a1, a2, a3;
              a_frag_p8<FMT>(arow, kLd8, ks, t, a0, a1, a2, a3);
#pragma unroll
              for (int jp = 0; jp < 2; ++jp) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, bb + (32 * ng + 16 * jp) * kLdH + 32 * ks);
                hmma(part[2 * jp], a0, a1, a2, a3, b0, b1);
                hmma(part[2 * jp + 1], a0, a1, a2, a3, b2, b3);
              }
            }
            // s_dS * s_K is an exact power of two, so fmaf adds the same
            // number as the reference's acc + partial * (s_dS * s_K).
            const float rs0 = sRowS[blk * kTile + ql0], rs1 = sRowS[blk * kTile + ql0 + 8];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              const float2 ksc = *reinterpret_cast<const float2*>(sKcs + 32 * ng + 8 * jj + 2 * t);
              acc[jj][0] = fmaf(part[jj][0], rs0 * ksc.x, acc[jj][0]);
              acc[jj][1] = fmaf(part[jj][1], rs0 * ksc.y, acc[jj][1]);
              acc[jj][2] = fmaf(part[jj][2], rs1 * ksc.x, acc[jj][2]);
              acc[jj][3] = fmaf(part[jj][3], rs1 * ksc.y, acc[jj][3]);
            }
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (m0 + ql0 + 8 * h >= Sq) continue;
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              const int c = 32 * ng + 8 * jj + 2 * t;
              atomicAdd(reinterpret_cast<float2*>(dq_row0 + 8 * h * DQK + c),
                        make_float2(acc[jj][2 * h], acc[jj][2 * h + 1]));
            }
          }
        }
      }
    }
  }

  // ---- Epilogue: dK = tau * acc, dV = acc (BF16), rows < seqlen_k.
  __nv_bfloat16* dk = static_cast<__nv_bfloat16*>(p.dk);
  __nv_bfloat16* dv = static_cast<__nv_bfloat16*>(p.dv);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = n0 + warp * 16 + g + 8 * h;
    if (key >= Sk) continue;
#pragma unroll
    for (int j = 0; j < kSlice / 8; ++j) {
      const int c = c_base + 8 * j + 2 * t;
      if (do_dk) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(dk_acc[j][2 * h], p.softmax_scale),
                                                       __fmul_rn(dk_acc[j][2 * h + 1], p.softmax_scale));
        *reinterpret_cast<__nv_bfloat162*>(dk + (bhk * Sk + key) * DQK + c) = v;
      }
      if (do_dv) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]);
        *reinterpret_cast<__nv_bfloat162*>(dv + (bhk * Sk + key) * DV + c) = v;
      }
    }
  }
}

// delta for stale (<dO_i, O_i>, BF16 operands) or matched_do (<dO_hat_i, O_i>,
// decoded row-blocked dO), FP32 sums; one warp per row. kVarlen (a packed
// batch, `tile` only, varlen_sm90.h): one warp per padded row of
// [Hq, seqlen_q_pad] (the dO codes' and scales' row), its token row
// (h total_q + token) for O, dO and delta; padding rows have no warp's work.
template <bool kMatched, bool kVarlen>
__global__ void bwd_delta_kernel(const KernelParams p) {
  const int64_t n_rows = static_cast<int64_t>(p.batch) * p.num_heads_q * (kVarlen ? p.seqlen_q_pad : p.seqlen_q);
  int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n_rows) return;
  int64_t code_row = row;  // the row of do_row / do_row_s
  int s, h, b;
  if constexpr (kVarlen) {
    h = static_cast<int>(row / p.seqlen_q_pad);
    b = 0;
    SeqInfo si;
    int local;
    if (!varlen_q_row(p, row - int64_t{h} * p.seqlen_q_pad, si, local)) return;  // warp-uniform
    s = static_cast<int>(si.tok_q) + local;
    row = int64_t{h} * p.seqlen_q + s;
  } else {
    s = static_cast<int>(row % p.seqlen_q);
    const int64_t bh = row / p.seqlen_q;
    h = static_cast<int>(bh % p.num_heads_q), b = static_cast<int>(bh / p.num_heads_q);
  }
  const int dv = p.head_dim_v, nb = num_dim_blocks(dv);
  const __nv_bfloat16* o = static_cast<const __nv_bfloat16*>(p.o) + b * p.o_sb + s * p.o_ss + h * p.o_sh;
  const __nv_bfloat16* d = static_cast<const __nv_bfloat16*>(p.dout) + b * p.do_sb + s * p.do_ss + h * p.do_sh;
  const Fp8Format fmt = static_cast<Fp8Format>(p.grad_format);
  float sum = 0.f;
  for (int c = lane; c < dv; c += 32) {
    float x;
    if constexpr (kMatched) {
      // `tile` (numerics.md section 9): one dO scale per row over all of dv.
      const int64_t si =
          p.scaling == static_cast<int>(Scaling::kTile) ? code_row : code_row * nb + c / dim_block(dv);
      x = fp8_decode(p.do_row[code_row * dv + c], fmt) * p.do_row_s[si];
    } else {
      x = __bfloat162float(d[c]);
    }
    sum += x * __bfloat162float(o[c]);
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) p.delta[row] = sum;
}

// dq = BF16(tau * dq_accum), contiguous [B, Hq, Sq, Dqk].
__global__ void bwd_dq_convert_kernel(const float* __restrict__ acc, __nv_bfloat16* __restrict__ dq,
                                      int64_t n, float tau) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= n) return;  // n is a multiple of 4 (head_dim >= 64)
  const float4 v = *reinterpret_cast<const float4*>(acc + i);
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(dq + i);
  out[0] = __floats2bfloat162_rn(__fmul_rn(v.x, tau), __fmul_rn(v.y, tau));
  out[1] = __floats2bfloat162_rn(__fmul_rn(v.z, tau), __fmul_rn(v.w, tau));
}

// diag [4, B, Hq, Sq] = (delta, eps, rowsum_pre, rowsum_post) from delta,
// delta_dm and the row-sum workspace; rows that see no key get zeros.
// kVarlen (a packed batch, varlen_sm90.h): diag [4, Hq, total_q]; one thread
// per padded row of [Hq, seqlen_q_pad], the rows of a sequence at its token
// rows with its own lengths (window); padding rows write nothing.
template <bool kVarlen>
__global__ void bwd_diag_finish_kernel(const KernelParams p) {
  const int64_t n = static_cast<int64_t>(p.batch) * p.num_heads_q * p.seqlen_q;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int qi = 0, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;  // the query within its sequence, its lengths
  if constexpr (kVarlen) {
    if (i >= int64_t{p.num_heads_q} * p.seqlen_q_pad) return;
    const int h = static_cast<int>(i / p.seqlen_q_pad);
    SeqInfo si;
    if (!varlen_q_row(p, i - int64_t{h} * p.seqlen_q_pad, si, qi)) return;
    seqlen_q = si.seqlen_q;
    seqlen_k = si.seqlen_k;
    i = int64_t{h} * p.seqlen_q + si.tok_q + qi;
  } else {
    if (i >= n) return;
  }
  const float* ws = p.rowsum_ws;
  const bool empty = p.lse[i] == -INFINITY;
  const float delta = p.delta[i];
  // NOTE: a row that sees < 2 keys has dS == 0 in exact arithmetic; its ratio
  // would only measure rounding noise, so it reports 0 (numerics.md section 7).
  // The keys it sees: its window (numerics.md section 14; causal: (-1, 0)).
  if constexpr (!kVarlen) qi = static_cast<int>(i % p.seqlen_q);
  const IndexRange keys = window_keys(qi, qi + 1, seqlen_q, seqlen_k, p.window_left, p.window_right);
  const int nvis = keys.end - keys.begin;
  const bool no_ratio = empty || nvis < 2;
  p.diag[i] = empty ? 0.f : delta;
  p.diag[n + i] = empty ? 0.f : delta - p.delta_dm[i];
  // A non-finite dS row reports NaN so monitoring sees it (like the reference).
  auto ratio = [no_ratio](float sum, float sum_abs) {
    if (!isfinite(sum) || !isfinite(sum_abs)) return NAN;
    return (no_ratio || !(sum_abs > 0.f)) ? 0.f : fabsf(sum) / sum_abs;
  };
  p.diag[2 * n + i] = ratio(ws[i], ws[n + i]);
  p.diag[3 * n + i] = ratio(ws[2 * n + i], ws[3 * n + i]);
}

template <int DQK, int DV, int FMT>
void launch_main_t(const KernelParams& p, cudaStream_t stream) {
  using L = MainLayout<DQK, DV>;
  auto kernel = bwd_main_kernel<DQK, DV, FMT>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: bwd main: cudaFuncSetAttribute failed: ") +
                             cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_kv * slices exceed 65535 (launch_sm90.h).
  launch_attn_chunks(p, (p.seqlen_k + kTile - 1) / kTile, GridHeads::kKv, L::kSlices, "bwd main kernel",
                     [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                       kernel<<<dim3(gx, gy, gz), kThreads, L::kBytes, stream>>>(pc);
                       check_launch("bwd main kernel");
                     });
}

}  // namespace

void launch_main(const KernelParams& p, cudaStream_t stream) {
  dispatch_shapes(p, [&](auto dqk, auto dv, auto fmt) {
    launch_main_t<decltype(dqk)::value, decltype(dv)::value, decltype(fmt)::value>(p, stream);
  });
}

}  // namespace bwd

namespace {
// FP8ATTN_BWD_KERNEL=wgmma (default: wgmma where it supports the shape, else
// mma.sync) or mma (always the mma.sync kernels; benchmarking both).
// Any other non-empty value is a std::invalid_argument (ValueError) naming it.
bool want_wgmma() { return env_choice("FP8ATTN_BWD_KERNEL", {"wgmma", "mma"}) != 1; }
}  // namespace

void run_bwd(const KernelParams& p, cudaStream_t stream) {
  using namespace bwd;
  if (p.block_size != kTile)
    throw std::runtime_error("fp8attn: argument 'block_size': the CUDA backward supports 128 only, got " +
                             std::to_string(p.block_size));
  if (!supported_head_dims(p.head_dim_qk, p.head_dim_v))
    throw std::runtime_error("fp8attn: argument 'head_dim': the CUDA backward supports (64, 64), (128, 128), "
                             "(256, 256) and (192, 128) for (head_dim_qk, head_dim_v), got (" +
                             std::to_string(p.head_dim_qk) + ", " + std::to_string(p.head_dim_v) + ")");
  if (p.grad_format != kFmtE4M3 && p.grad_format != kFmtE5M2)
    throw std::runtime_error("fp8attn: argument 'grad_format': expected E4M3 (0) or E5M2 (1), got " +
                             std::to_string(p.grad_format));
  if (p.delta_mode < 0 || p.delta_mode > 2)
    throw std::runtime_error("fp8attn: argument 'delta_mode': expected 0, 1 or 2, got " +
                             std::to_string(p.delta_mode));
  if (p.num_heads_kv < 1 || p.num_heads_q % p.num_heads_kv != 0)
    throw std::runtime_error("fp8attn: argument 'num_heads_q': must be a multiple of num_heads_kv");
  if ((p.diag == nullptr) != (p.rowsum_ws == nullptr))
    throw std::runtime_error("fp8attn: argument 'diag': diag and rowsum_ws must both be set or both null");
  // Softcap (numerics.md section 12): the `tile` kernels' kSoftcap
  // instantiations, dense batches only (varlen_attention runs a packed batch
  // with softcap per sequence).
  if (p.softcap != 0.f) {
    if (!(p.softcap > 0.f) || !(p.softcap <= 3.4e38f))
      throw std::invalid_argument("fp8attn: argument 'softcap': must be finite and > 0 (0 = off), got " +
                                  std::to_string(p.softcap));
    if (p.scaling != static_cast<int>(Scaling::kTile) || p.num_seqs > 0)
      throw std::invalid_argument("fp8attn: argument 'softcap': the CUDA backward takes it with the `tile` recipe "
                                  "(scaling 1) on dense batches only");
  }
  // A packed batch (varlen_sm90.h): the `tile` kernels' kVarlen instantiations,
  // one launch each (heads and kv heads x slices <= 65535: never chunked,
  // launch_sm90.h at_chunk); the padded rows are whole tiles per head.
  const bool varlen = p.num_seqs > 0;
  if (varlen) {
    if (p.scaling != static_cast<int>(Scaling::kTile))
      throw std::invalid_argument("fp8attn: run_bwd: a packed (varlen) batch needs the `tile` recipe (scaling 1); "
                                  "the `row` backward is dense-only");
    if (p.prepass_sums)
      throw std::invalid_argument("fp8attn: run_bwd: 'prepass_sums' (the sharded pre-pass) is dense-only");
    if (p.batch != 1 || p.varlen_meta == nullptr || p.num_heads_q > kMaxGridYZ ||
        int64_t{p.num_heads_kv} * bwdts::slices(p.head_dim_qk, p.head_dim_v) > kMaxGridYZ || p.q_tiles_max <= 0 ||
        p.k_tiles_max <= 0 || p.seqlen_q_pad != int64_t{p.q_tiles_max} * kTile ||
        p.seqlen_k_pad != int64_t{p.k_tiles_max} * kTile)
      throw std::runtime_error(
          "fp8attn: run_bwd: a packed batch needs batch 1, its metadata, heads (and kv heads x slices) <= 65535 and "
          "seqlen_*_pad = *_tiles_max * 128");
  }
  if (p.batch == 0 || p.num_heads_q == 0 || p.seqlen_q == 0) return;  // nothing to compute
  if (p.seqlen_k == 0)
    throw std::runtime_error("fp8attn: argument 'seqlen_k': the CUDA backward needs seqlen_k >= 1");

  if (p.scaling != static_cast<int>(Scaling::kRow) && p.scaling != static_cast<int>(Scaling::kTile))
    throw std::runtime_error("fp8attn: argument 'scaling': expected Scaling::kRow (0) or kTile (1), got " +
                             std::to_string(p.scaling));
  const bool dm = p.delta_mode == static_cast<int>(DeltaMode::kDeltaMatching);
  const bool tile = p.scaling == static_cast<int>(Scaling::kTile);
  const int64_t n_rows = static_cast<int64_t>(p.batch) * p.num_heads_q * p.seqlen_q;
  // The row kernels below (delta, diagnostics) of a packed batch walk the padded rows.
  const int64_t n_rows_k = varlen ? static_cast<int64_t>(p.num_heads_q) * p.seqlen_q_pad : n_rows;

  // 1. delta: Delta-Matching pre-pass (also for eps diagnostics) and/or the row delta.
  // NOTE: the pre-pass and the main kernel must be the same family (`tile`
  // kernels, wgmma or mma.sync): Delta-Matching needs their dP_hat bitwise equal.
  // `tile` (numerics.md section 9) has its own pair (bwd_tilescale_sm90.h);
  // FP8ATTN_BWD_KERNEL selects among the `row` kernels only.
  const bool wg = !tile && want_wgmma() && wgmma_supported(p);
  const auto prepass = tile ? ts::launch_tilescale_prepass : wg ? launch_wgmma_prepass : launch_prepass;
  if (p.prepass_sums) {  // the partial sums of one key shard only (numerics.md section 11)
    if (!dm || p.lse_bwd == nullptr || p.diag != nullptr)
      throw std::runtime_error("fp8attn: argument 'prepass_sums': needs delta_matching, lse_bwd and no diag");
    prepass(p, stream);
    return;
  }
  if (p.delta_given && (!dm || p.diag != nullptr))
    throw std::runtime_error("fp8attn: argument 'delta': a given delta needs delta_matching and no diag");
  if ((dm && !p.delta_given) || p.diag != nullptr) prepass(p, stream);
  if (!dm) {
    const int rows_per_block = 8;
    const dim3 grid(static_cast<unsigned>((n_rows_k + rows_per_block - 1) / rows_per_block));
    const bool matched = p.delta_mode == static_cast<int>(DeltaMode::kMatchedDO);
    auto delta_kernel = varlen ? (matched ? bwd_delta_kernel<true, true> : bwd_delta_kernel<false, true>)
                               : (matched ? bwd_delta_kernel<true, false> : bwd_delta_kernel<false, false>);
    delta_kernel<<<grid, 32 * rows_per_block, 0, stream>>>(p);
    check_launch("bwd delta kernel");
  }
  // 2. main backward: dK, dV, dq_accum (+ row-sum workspace). Delta-Matching
  // reads the pre-pass's backward-consistent LSE (prepass_delta_sm90.cuh,
  // numerics.md section 4): its P sums to 1 to FP32 rounding.
  KernelParams pm = p;
  if (dm && p.lse_bwd != nullptr && !p.delta_given) pm.lse = p.lse_bwd;
  (tile ? ts::launch_tilescale_main : wg ? launch_wgmma_main : launch_main)(pm, stream);
  // 3. dQ to BF16.
  // (`tile`: dq_accum in 64-query chunks, kernel_params_sm90.h dq_accum_rows.)
  if (tile) {
    ts::launch_tilescale_dq_convert(p, stream);
  } else {
    const int64_t n_dq = n_rows * p.head_dim_qk;
    bwd_dq_convert_kernel<<<static_cast<unsigned>((n_dq / 4 + 255) / 256), 256, 0, stream>>>(
        p.dq_accum, static_cast<__nv_bfloat16*>(p.dq), n_dq, p.softmax_scale);
    check_launch("bwd dq convert kernel");
  }
  // 4. diagnostics.
  if (p.diag != nullptr) {
    auto diag_kernel = varlen ? bwd_diag_finish_kernel<true> : bwd_diag_finish_kernel<false>;
    diag_kernel<<<static_cast<unsigned>((n_rows_k + 255) / 256), 256, 0, stream>>>(p);
    check_launch("bwd diagnostics kernel");
  }
}

}  // namespace sm90
}  // namespace fp8attn
