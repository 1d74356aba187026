// fp8attn: Delta-Matching pre-pass of the sm_90a FP8 backward (numerics.md
// section 4): delta_dm_i = sum_j P_ij dP_hat_ij, row-parallel.
//
// One CTA per (query tile of 128, query head, batch). It walks the key tiles
// the tile sees and recomputes S^T, P and dP_hat^T with the very tile functions
// of the main kernel (bwd_tile_sm90.cuh: same operands, same warp -> key map,
// same reduction order over d and dv), so the main kernel's dS row sums are
// zero to FP32 rounding. Writes p.delta_dm, p.delta too when delta_mode is
// delta_matching, and the backward-consistent LSE p.lse_bwd (prepass_delta_sm90.cuh).
#include <stdexcept>
#include <string>

#include "hopper/bwd_tile_sm90.cuh"
#include "hopper/launch_sm90.h"
#include "hopper/prepass_delta_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace {

template <int DQK, int DV>
struct PrepassLayout {
  static constexpr int kNbQK = num_dim_blocks(DQK), kNbV = num_dim_blocks(DV);
  // bytes
  static constexpr int kK = 0;                                  // K_hat rows "p8"
  static constexpr int kV = kK + kTile * (DQK + kRowPad);       // V_hat rows "p8"
  static constexpr int kQ = kV + kTile * (DV + kRowPad);        // Q_hat rows (row_ld)
  static constexpr int kDO = kQ + kTile * row_ld(DQK);          // dO_hat rows (row_ld)
  static constexpr int kF = kDO + kTile * row_ld(DV);
  // floats from kF
  static constexpr int kKs = 0;
  static constexpr int kVs = kKs + kTile * kNbQK;
  static constexpr int kQs = kVs + kTile * kNbV;
  static constexpr int kDOs = kQs + kTile * kNbQK;
  static constexpr int kLse2 = kDOs + kTile * kNbV;
  static constexpr int kRed = kLse2 + kTile;
  static constexpr int kRedP = kRed + kWarps * kTile;  // the P row sums' partials
  static constexpr int kFloats = kRedP + kWarps * kTile;
  static constexpr int kBytes = kF + 4 * kFloats;
  static_assert(kF % 16 == 0, "aligned float section");
};

template <int DQK, int DV, int FMT>
__global__ void __launch_bounds__(kThreads, 1) bwd_prepass_kernel(const KernelParams p) {
  using L = PrepassLayout<DQK, DV>;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* sK = smem + L::kK;
  uint8_t* sV = smem + L::kV;
  uint8_t* sQ = smem + L::kQ;
  uint8_t* sdO = smem + L::kDO;
  float* sf = reinterpret_cast<float*>(smem + L::kF);
  float* sKs = sf + L::kKs;
  float* sVs = sf + L::kVs;
  float* sQs = sf + L::kQs;
  float* sdOs = sf + L::kDOs;
  float* sLse2 = sf + L::kLse2;
  float* sRed = sf + L::kRed;

  const int m_tile = blockIdx.x, hq = blockIdx.y, b = blockIdx.z;
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int group = p.num_heads_q / p.num_heads_kv, hk = hq / group;
  const int m0 = m_tile * kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;

  // Query-side operands of the tile: Q_hat, dO_hat rows (#3 and #4 B operands), LSE.
  load_rows<DQK, kFmtE4M3>(sQ, p.q_row + bhq * Sq * DQK, m0, Sq);
  load_rows<DV, FMT>(sdO, p.do_row + bhq * Sq * DV, m0, Sq);
  load_row_scales<L::kNbQK>(sQs, p.q_row_s + bhq * Sq * L::kNbQK, m0, Sq);
  load_row_scales<L::kNbV>(sdOs, p.do_row_s + bhq * Sq * L::kNbV, m0, Sq);
  for (int i = threadIdx.x; i < kTile; i += kThreads)
    sLse2[i] = m0 + i < Sq ? __fmul_rn(p.lse[bhq * Sq + m0 + i], kLog2e) : -INFINITY;

  TileGeom tg;
  tg.m0 = m0;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = Sk - Sq;
  tg.causal = p.causal;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);

  // Keys seen by at least one row of the tile: [0, n_end).
  const int last_q = min(m0 + kTile - 1, Sq - 1);
  const int n_end = p.causal ? max(0, min(Sk, last_q + tg.causal_off + 1)) : Sk;

  float cs[32];  // per thread: sum over its keys of P * dP, query 8j + 2t + e at [2j + e]
  float cp[32];  // the same of P (the row sums l, prepass_delta_sm90.cuh)
#pragma unroll
  for (int i = 0; i < 32; ++i) cs[i] = cp[i] = 0.f;

  for (int n0 = 0; n0 < n_end; n0 += kTile) {
    __syncthreads();  // previous tile's K/V reads are done
    load_rows_p8<DQK>(sK, p.k_row + bhk * Sk * DQK, n0, Sk);
    load_rows_p8<DV>(sV, p.v_row + bhk * Sk * DV, n0, Sk);
    load_row_scales<L::kNbQK>(sKs, p.k_row_s + bhk * Sk * L::kNbQK, n0, Sk);
    load_row_scales<L::kNbV>(sVs, p.v_row_s + bhk * Sk * L::kNbV, n0, Sk);
    __syncthreads();
    tg.n0 = n0;
    const bool interior = tg.interior();

    float pt[16][4];
    tile_s<DQK>(sK, sKs, sQ, sQs, warp, lane, pt);
    if (interior)
      tile_p<false>(pt, sLse2, tg, warp, lane);
    else
      tile_p<true>(pt, sLse2, tg, warp, lane);
#pragma unroll
    for (int jg = 0; jg < 4; ++jg) {
      float dp[4][4];
      tile_dp<DV, FMT>(sV, sVs, sdO, sdOs, warp, lane, jg, dp);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ql = 32 * jg + 8 * jj + 2 * t + (e & 1), kl = warp * 16 + g + 8 * (e >> 1);
          float v = __fmul_rn(pt[4 * jg + jj][e], dp[jj][e]);
          if (!interior && !tg.visible(kl, ql)) v = 0.f;  // P = 0 there, but dP may be NaN
          float& c = cs[2 * (4 * jg + jj) + (e & 1)];
          c = __fadd_rn(c, v);
          float& l = cp[2 * (4 * jg + jj) + (e & 1)];
          l = __fadd_rn(l, pt[4 * jg + jj][e]);  // P is 0 where masked (tile_p)
        }
    }
  }

  // Sum over the 16 keys of each warp (8 lanes g), then over the warps.
  float red[4];
  reduce_cols(cs, red, lane, OpAdd());
#pragma unroll
  for (int i = 0; i < 4; ++i) sRed[warp * kTile + reduced_col(lane, i)] = red[i];
  reduce_cols(cp, red, lane, OpAdd());
#pragma unroll
  for (int i = 0; i < 4; ++i) sf[L::kRedP + warp * kTile + reduced_col(lane, i)] = red[i];
  __syncthreads();
  for (int i = threadIdx.x; i < kTile; i += kThreads) {
    if (m0 + i >= Sq) continue;
    float s = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      s += sRed[w * kTile + i];
      l += sf[L::kRedP + w * kTile + i];
    }
    prepass_finish_row(p, bhq * Sq + m0 + i, s, l);
  }
}

template <int DQK, int DV, int FMT>
void launch(const KernelParams& p, cudaStream_t stream) {
  using L = PrepassLayout<DQK, DV>;
  auto kernel = bwd_prepass_kernel<DQK, DV, FMT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: bwd pre-pass: cudaFuncSetAttribute failed: ") +
                             cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h).
  launch_attn_chunks(p, (p.seqlen_q + kTile - 1) / kTile, GridHeads::kQuery, 1, "bwd pre-pass",
                     [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                       kernel<<<dim3(gx, gy, gz), kThreads, L::kBytes, stream>>>(pc);
                       const cudaError_t e = cudaGetLastError();
                       if (e != cudaSuccess)
                         throw std::runtime_error(std::string("fp8attn: bwd pre-pass launch failed: ") +
                                                  cudaGetErrorString(e));
                     });
}

}  // namespace

void launch_prepass(const KernelParams& p, cudaStream_t stream) {
  dispatch_shapes(p, [&](auto dqk, auto dv, auto fmt) {
    launch<decltype(dqk)::value, decltype(dv)::value, decltype(fmt)::value>(p, stream);
  });
}

}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
