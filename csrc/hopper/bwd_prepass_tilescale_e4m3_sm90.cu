// fp8attn: Delta-Matching pre-pass of the sm_90a `tile`-recipe FP8 backward
// (numerics.md sections 4 and 9): delta_dm_i = sum_j P_ij dP_hat_ij with the
// very P and dP_hat the main kernel (bwd_tilescale_e4m3_sm90.cu) forms: the
// same operands, the same m64n64k32 chains over all of head_dim, the same
// FP32 roundings (mainloop_bwd_tilescale_sm90.cuh). Writes p.delta_dm, and
// p.delta too when delta_mode is delta_matching. Design:
// docs/kernels/bwd_tilescale_e4m3_sm90.md.
//
// One CTA per (64-query tile, query head, batch), two warpgroups: both see the
// 64 queries, warpgroup wg the keys [64 wg, 64 wg + 64) of each 128-key tile
// (the main kernel's rows). All 256 threads fill shared memory with cp.async
// (Q / dO rows once, K / V rows per key tile: two stages at head_dim <= 128,
// one above), __syncthreads between tiles. K / V tile scales are read from
// global memory (one scalar each per tile).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "hopper/bwd_tilescale_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/mainloop_bwd_tilescale_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace ts {
namespace {

using bwdts::kPreQ;
using bwdts::kPreThreads;

template <int DQK, int DV>
struct PrepassLayout {
  static constexpr int kNbQK = nb_of<DQK>(), kNbV = nb_of<DV>();
  static constexpr int kStages = bwdts::stages(DQK, DV);
  static constexpr int kKStage = (kNbQK + kNbV) * kTileBytes;  // bytes of one key stage: K rows, then V rows
  static constexpr int kQ = 0;                                   // query rows (q_of_col order) [block][64][128 B]
  static constexpr int kDO = kQ + kNbQK * kPreQ * 128;           // dO rows
  static constexpr int kK = kDO + kNbV * kPreQ * 128;            // [stages] key rows (k_of_row order), value rows
  static constexpr int kV = kNbQK * kTileBytes;                  //   (value rows at kK + st * kKStage + kV)
  static constexpr int kF = kK + kStages * kKStage;
  // floats from kF: per column (q_of_col order) Q and dO row scales, LSE; the reduction.
  static constexpr int kQs = 0, kDOs = kQs + kPreQ, kLse = kDOs + kPreQ, kRed = kLse + kPreQ;
  static constexpr int kRedP = kRed + kWarps * kPreQ;  // the P row sums' partials
  static constexpr int kFloats = kRedP + kWarps * kPreQ;
  static constexpr int kBytes = kF + 4 * kFloats + 1024;  // + alignment slack
  static_assert(kQ % 1024 == 0 && kDO % 1024 == 0 && kK % 1024 == 0 && kKStage % 1024 == 0, "1024-byte swizzle atoms");
  static_assert(kBytes <= 113 * 1024, "two CTAs per SM");
};

template <int DQK, int DV, int FMT>
__global__ void __launch_bounds__(kPreThreads, 2) bwd_tilescale_prepass_kernel(const KernelParams p) {
  using L = PrepassLayout<DQK, DV>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_aligned_1024(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + L::kF);

  const int m_tile = blockIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const SeqLens sl = seq_lens(p, b);
  const int Sq = sl.q, Sk = sl.k;
  const int group = p.num_heads_q / p.num_heads_kv, hk = hq / group;
  const int nblk_k = (Sk + kTile - 1) / kTile;
  const int m0 = m_tile * kPreQ;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wg = warpgroup_uniform();
  const uint32_t d_base = desc_lo(smem);
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
    uint8_t* st = smem + L::kK + (it % L::kStages) * L::kKStage;
    cp_rows<DQK, false, kTile>(st, p.k_row + bhk * Sk * DQK, it * kTile, Sk);
    cp_rows<DV, false, kTile>(st + L::kV, p.v_row + bhk * Sk * DV, it * kTile, Sk);
  };
  // Query side (once) + the first key tile: group 0.
  cp_rows<DQK, true, kPreQ>(smem + L::kQ, p.q_row + bhq * Sq * DQK, m0, Sq);
  cp_rows<DV, true, kPreQ>(smem + L::kDO, p.do_row + bhq * Sq * DV, m0, Sq);
  auto q_idx = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i);
    return r < Sq ? bhq * Sq + r : -1;
  };
  cp_floats(sf + L::kQs, p.q_row_s, kPreQ, q_idx);
  cp_floats(sf + L::kDOs, p.do_row_s, kPreQ, q_idx);
  cp_floats(sf + L::kLse, p.lse, kPreQ, q_idx);
  if (n_tiles > 0) issue_keys(0);
  cp_commit();

  float cs[16];  // per thread: sum over its keys of P * dP_hat; column 8j + 2t + e at [2j + e]
  float cp[16];  // the same of P (the row sums l, prepass_delta_sm90.cuh)
#pragma unroll
  for (int i = 0; i < 16; ++i) cs[i] = cp[i] = 0.f;

  for (int it = 0; it < n_tiles; ++it) {
    cp_wait<0>();
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
    const uint32_t k_lo = d_base + (L::kK + st * L::kKStage) / 16 + wg * kDesc64Rows;
    const uint32_t v_lo = k_lo + L::kV / 16;
    const float s_k = p.k_row_s[bhk * nblk_k + it], s_v = p.v_row_s[bhk * nblk_k + it];

    // The main kernel's instructions and roundings: P and dP_hat bitwise equal.
    float pt[8][4], dp[8][4];
    issue_s<DQK, kPreQ, kPreQ>(k_lo, d_base + L::kQ / 16, pt);
    issue_dp<DV, FMT, kPreQ, kPreQ>(v_lo, d_base + L::kDO / 16, dp);
    wg_wait<1>();
    p_from_s<kPreQ>(pt, __fmul_rn(s_k, tg.c2), sf + L::kQs, sf + L::kLse, lane);
    if (!interior) mask_tile<kPreQ>(pt, tg, warp, lane);
    wg_wait<0>();
    dp_scale<kPreQ>(dp, s_v, sf + L::kDOs, lane);
    if constexpr (L::kStages == 1) {
      __syncthreads();  // every warpgroup's wgmmas on the stage completed: refill it
      if (it + 1 < n_tiles) issue_keys(it + 1);
      cp_commit();
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& l = cp[2 * j + (e & 1)];
        l = __fadd_rn(l, pt[j][e]);  // P is 0 where masked (mask_tile)
      }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[j][e] = __fmul_rn(pt[j][e], dp[j][e]);
    if (!interior) mask_tile<kPreQ>(dp, tg, warp, lane);  // P = 0 there, but dP_hat may be NaN
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& c = cs[2 * j + (e & 1)];
        c = __fadd_rn(c, dp[j][e]);
      }
  }
  cp_wait<0>();

  prepass_store_delta<kPreQ, kPreThreads>(cs, cp, sf + L::kRed, sf + L::kRedP, warp, lane, m0, Sq, bhq, p);
}

}  // namespace

void launch_tilescale_prepass(const KernelParams& p, cudaStream_t stream) {
  dispatch_shapes(p, [&](auto dqk, auto dv, auto fmt) {
    constexpr int DQK = decltype(dqk)::value, DV = decltype(dv)::value, FMT = decltype(fmt)::value;
    using L = PrepassLayout<DQK, DV>;
    auto kernel = bwd_tilescale_prepass_kernel<DQK, DV, FMT>;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fp8attn: bwd tile pre-pass: cudaFuncSetAttribute failed: ") +
                               cudaGetErrorString(err));
    // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h).
    launch_attn_chunks(p, (p.seqlen_q + kPreQ - 1) / kPreQ, GridHeads::kQuery, 1, "bwd tile pre-pass",
                       [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                         kernel<<<dim3(gx, gy, gz), kPreThreads, L::kBytes, stream>>>(pc);
                         const cudaError_t e = cudaGetLastError();
                         if (e != cudaSuccess)
                           throw std::runtime_error(std::string("fp8attn: bwd tile pre-pass launch failed: ") +
                                                    cudaGetErrorString(e));
                       });
  });
}

}  // namespace ts
}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
