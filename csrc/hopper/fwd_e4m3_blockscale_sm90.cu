// fp8attn: sm_90a FP8 attention forward with block scales (numerics.md
// sections 2-3, matmuls #1 and #2). Contract and math: fwd_e4m3_blockscale_sm90.h.
//
// Structure (one CTA per (query tile of 16 * fwd_warps(D) rows, query head, batch);
// one warp per 16 query rows; FP8 mma.sync m16n8k32 with FP32 accumulators):
//   prologue   cp.async Q tile and key tile 0 (K row-blocked) into shared memory
//   per key tile kt (increasing):
//     cp.async V^T tile kt (column-blocked, keys contiguous) -- overlaps S
//     S = Q K^T per head_dim block, times s_q * s_k * tau * log2(e)  (log2 domain)
//     mask, online softmax: P = exp2(S - m), l += rowsum P, s_p from
//       exp2(rowmax S - m), codes E4M3(exp2(S - m - log2 s_p)) per query row
//     cp.async key tile kt+1                                         -- overlaps PV
//     O = O * alpha + (P_hat V_hat) * s_p * s_v
//   epilogue   O / l -> BF16, LSE = (m + log2 l) * ln 2
//
// Fragment-layout trick for P @ V (no shuffles): the m16n8 FP32 accumulator of
// S gives a thread keys {2t, 2t+1} of each n8 tile, while the m16n8k32 8-bit A
// fragment wants keys {4t..4t+3} and {16+4t..16+4t+3} of a 32-key step. So the
// QK^T MMA computes its n8 tiles over PERMUTED keys: n8 tile jt, column n holds
//     key(jt, n) = 16 * (jt / 2) + 2 * (jt % 2) + 4 * (n / 2) + (n % 2)
// (a permutation inside each group of 16 keys), chosen so that the thread's
// accumulator values of tiles 4s, 4s+1 (4s+2, 4s+3) are exactly the keys of
// its A-fragment registers for k-step s, in natural order. K rows are fed to
// ldmatrix in that permuted order (free: ldmatrix takes one row address per
// lane), and V^T is then read in natural key order. Masking uses key(jt, n).
//
// Shared memory: row strides padded by 16 bytes (odd number of 16-byte
// chunks); the K tile is additionally XOR-swizzled (16-byte chunk c of key row
// r is stored at c ^ (2 * bit3(r))) because one ldmatrix phase reads the 8 key
// rows {0,1,4,5,8,9,12,13} (+const), which collide pairwise mod 8 otherwise.
#include "hopper/fwd_e4m3_blockscale_sm90.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/env_choice.h"
#include "common/fp8_codec.h"
#include "hopper/config_sm90.h"
#include "hopper/fwd_softmax_sm90.cuh"
#include "hopper/fwd_wgmma_e4m3_blockscale_sm90.h"
#include "hopper/launch_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace {

// ---- PTX wrappers -------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; src_bytes = 0 zero-fills the destination
// without reading global memory.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                            uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// D += A * B, A 16x32 E4M3 (row), B 32x8 E4M3 (col), FP32 accumulate.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// fast_exp2, cvt_e4m3x2, pack_e4m3x4, block_scale_e4m3: fwd_softmax_sm90.cuh.

// ---- shapes --------------------------------------------------------------------

template <int kD, int kDv, int kWarps>
struct FwdTraits {
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = kFwdBlockN;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kNBlkD = num_dim_blocks(kD);         // head_dim blocks of Q, K
  static constexpr int kKSteps0 = dim_block(kD) / 32;        // k32 steps in head_dim block 0
  static constexpr int kKSteps = kD / 32;                    // all k32 steps
  static constexpr int kNT = kBlockN / 8;                    // n8 tiles of S (16)
  static constexpr int kVT = kDv / 8;                        // n8 tiles of O
  static constexpr int kQStride = kD + kSmemRowPad;          // bytes per Q row in smem
  static constexpr int kKStride = kD + kSmemRowPad;          // bytes per K row
  static constexpr int kVStride = kBlockN + kSmemRowPad;     // bytes per V^T row (channel)
  // NOTE: Q stays in registers when it fits; at head_dim > 128 the S, O and
  // partial accumulators need ~210 registers, so Q is re-read from smem.
  static constexpr bool kQInRegs = kD <= 128;
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kBlockM * kQStride;
  static constexpr int kOffV = kOffK + kBlockN * kKStride;
  static constexpr int kOffKs = kOffV + kDv * kVStride;      // float [kNBlkD][kBlockN]
  static constexpr int kOffVs = kOffKs + kNBlkD * kBlockN * 4;  // float [kDv]
  static constexpr int kSmemBytes = kOffVs + kDv * 4;

  static_assert(kD % 64 == 0 && kD <= 256 && kDv % 32 == 0 && kDv <= 256, "supported head dims");
  static_assert(kNBlkD <= 2, "at most two head_dim blocks");
  static_assert(kQStride % 16 == 0 && (kQStride / 16) % 2 == 1, "odd number of 16-byte chunks per row");
  static_assert((kVStride / 16) % 2 == 1, "odd number of 16-byte chunks per V^T row");
  static_assert(kOffKs % 16 == 0, "float arrays aligned");
  static_assert(kVT % 4 == 0, "P@V runs in chunks of 4 n8 tiles");
};

// Key held by column n of permuted n8 tile jt (see the file comment), within
// the 128-key tile.
__host__ __device__ constexpr int perm_key(int jt, int n) {
  return 16 * (jt / 2) + 2 * (jt % 2) + 4 * (n / 2) + (n % 2);
}

// ---- the kernel -------------------------------------------------------------------

template <int kD, int kDv, int kWarps>
__global__ void __launch_bounds__(32 * kWarps, 8 / kWarps) fwd_kernel(const KernelParams p) {
  using T = FwdTraits<kD, kDv, kWarps>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kThreads = T::kThreads;
  constexpr int kNBlkD = T::kNBlkD, kNT = T::kNT, kVT = T::kVT;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sQ = smem + T::kOffQ;
  uint8_t* sK = smem + T::kOffK;
  uint8_t* sV = smem + T::kOffV;
  float* sKs = reinterpret_cast<float*>(smem + T::kOffKs);
  float* sVs = reinterpret_cast<float*>(smem + T::kOffVs);

  const int m_tile = gridDim.x - 1 - blockIdx.x;  // NOTE: heaviest causal tiles first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.num_heads_q / p.num_heads_kv);
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int Skp = p.seqlen_k_pad;
  const int nblk_k = (Sk + kBlockN - 1) / kBlockN;
  const int q0 = m_tile * kBlockM;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int diag = Sk - Sq;  // causal: key j visible to query i iff j <= i + diag

  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + h;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;
  const uint8_t* q_g = p.q_row + bhq * Sq * kD;
  const float* qs_g = p.q_row_s + bhq * Sq * kNBlkD;
  const uint8_t* k_g = p.k_row + bhk * Sk * kD;
  const float* ks_g = p.k_row_s + bhk * Sk * kNBlkD;
  const uint8_t* v_g = p.v_colT + bhk * kDv * Skp;
  const float* vs_g = p.v_col_s + bhk * kDv * nblk_k;

  // Key tiles this CTA visits: [0, n_tiles).
  int n_tiles = nblk_k;
  if (p.causal) {
    const int last_row = min(q0 + kBlockM, Sq) - 1;
    const int last_key = last_row + diag;
    n_tiles = last_key < 0 ? 0 : min(n_tiles, last_key / kBlockN + 1);
  }

  // ---- async loaders ----
  auto load_k = [&](int kt) {
    constexpr int kChunks = kD / 16;
    const int key0 = kt * kBlockN;
    for (int idx = tid; idx < kBlockN * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx - r * kChunks;
      const bool ok = key0 + r < Sk;
      const uint8_t* src = k_g + (ok ? static_cast<int64_t>(key0 + r) * kD + c * 16 : 0);
      const int cs = c ^ (((r >> 3) & 1) << 1);  // swizzle (file comment)
      cp_async_16(smem_u32(sK + r * T::kKStride + cs * 16), src, ok ? 16 : 0);
    }
    for (int idx = tid; idx < kNBlkD * kBlockN; idx += kThreads) {
      const int blk = idx / kBlockN, r = idx - blk * kBlockN;
      const int key = key0 + r;
      sKs[idx] = key < Sk ? ks_g[static_cast<int64_t>(key) * kNBlkD + blk] : 0.f;
    }
  };
  auto load_v = [&](int kt) {
    constexpr int kChunks = kBlockN / 16;
    const int key0 = kt * kBlockN;
    for (int idx = tid; idx < kDv * kChunks; idx += kThreads) {
      const int ch = idx / kChunks, c = idx - ch * kChunks;
      const bool ok = key0 + c * 16 < Skp;  // [Sk, Skp) holds zero codes
      const uint8_t* src = v_g + (ok ? static_cast<int64_t>(ch) * Skp + key0 + c * 16 : 0);
      cp_async_16(smem_u32(sV + ch * T::kVStride + c * 16), src, ok ? 16 : 0);
    }
    for (int ch = tid; ch < kDv; ch += kThreads) sVs[ch] = vs_g[static_cast<int64_t>(ch) * nblk_k + kt];
  };

  // ---- prologue: Q tile, key tile 0 ----
  {
    constexpr int kChunks = kD / 16;
    for (int idx = tid; idx < kBlockM * kChunks; idx += kThreads) {
      const int r = idx / kChunks, c = idx - r * kChunks;
      const bool ok = q0 + r < Sq;
      const uint8_t* src = q_g + (ok ? static_cast<int64_t>(q0 + r) * kD + c * 16 : 0);
      cp_async_16(smem_u32(sQ + r * T::kQStride + c * 16), src, ok ? 16 : 0);
    }
  }
  if (n_tiles > 0) load_k(0);
  cp_async_commit();

  // Per-thread rows: g and g + 8 of this warp's 16.
  const int row0 = q0 + warp * 16 + g;
  const float scale_log2 = p.softmax_scale * kLog2e;
  float rq[2];       // s_q (head_dim block 0) * tau * log2(e), per row
  float q_ratio[2];  // s_q of head_dim block 1 over block 0 (a power of two, or NaN)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    // NOTE: padding rows (row >= Sq) get rq = 0 and ratio 0; they are never stored.
    const float sq0 = row < Sq ? qs_g[static_cast<int64_t>(row) * kNBlkD] : 0.f;
    const float sq1 = row < Sq ? qs_g[static_cast<int64_t>(row) * kNBlkD + kNBlkD - 1] : 0.f;
    rq[r] = sq0 * scale_log2;
    q_ratio[r] = row < Sq ? sq1 / sq0 : 0.f;
  }

  // Per-lane ldmatrix row offsets.
  const int lm_mi = lane >> 3, lm_r = lane & 7;
  // A (Q): matrices (rows 0-7 | 8-15) x (bytes 0-15 | 16-31) of a 16x32 step.
  const uint32_t q_lane =
      smem_u32(sQ + (warp * 16 + lm_r + 8 * (lm_mi & 1)) * T::kQStride + 16 * (lm_mi >> 1));
  // B (K): matrices (n8 tile 2p | 2p+1) x (bytes 0-15 | 16-31); rows permuted.
  const int k_lane_key = 2 * (lm_mi >> 1) + 4 * (lm_r >> 1) + (lm_r & 1);  // + 16 p
  const int k_swz = ((k_lane_key >> 3) & 1) << 1;
  const uint32_t k_lane = smem_u32(sK + k_lane_key * T::kKStride);
  const int k_chunk_even = (lm_mi & 1) + k_swz;  // physical chunk - 2 ks, for even ks
  const int k_chunk_odd = (lm_mi & 1) - k_swz;   // for odd ks
  // B (V^T): matrices (channel tile t | t+1) x (bytes 0-15 | 16-31).
  const uint32_t v_lane = smem_u32(sV + (8 * (lm_mi >> 1) + lm_r) * T::kVStride + 16 * (lm_mi & 1));

  float o[kVT][4];
#pragma unroll
  for (int t = 0; t < kVT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running row max (log2 domain)
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sum

  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[T::kQInRegs ? T::kKSteps : 1][4];
  if constexpr (T::kQInRegs) {
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks) ldmatrix_x4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], q_lane + ks * 32);
  }

  // One k32 step of S += Q K^T over all 16 n8 tiles (or the 4 tiles of chunk cq).
  auto qk_step = [&](float (*acc)[4], int ks, int tile_first, int tile_count) {
    uint32_t a[4];
    if constexpr (T::kQInRegs) {
      a[0] = qf[ks][0]; a[1] = qf[ks][1]; a[2] = qf[ks][2]; a[3] = qf[ks][3];
    } else {
      ldmatrix_x4(a[0], a[1], a[2], a[3], q_lane + ks * 32);
    }
    const int chunk = 2 * ks + ((ks & 1) ? k_chunk_odd : k_chunk_even);
    for (int pp = 0; pp < tile_count / 2; ++pp) {
      const int pr = tile_first / 2 + pp;  // tile pair index: keys 16 pr .. 16 pr + 15
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(b0, b1, b2, b3, k_lane + 16 * pr * T::kKStride + chunk * 16);
      mma_e4m3(acc[2 * pp], a, b0, b1);
      mma_e4m3(acc[2 * pp + 1], a, b2, b3);
    }
  };

  for (int kt = 0; kt < n_tiles; ++kt) {
    load_v(kt);
    cp_async_commit();

    // ---- t = Q K^T * s_k (S = t * rq in the log2 domain) ----
    // NOTE: the row factor rq = s_q * tau * log2(e) (> 0) is applied inside
    // the exp's FMA below, so S never needs its own multiply; a second head_dim
    // block enters with the exact power-of-two ratio s_q1 / s_q0.
    float s[kNT][4];
#pragma unroll
    for (int jt = 0; jt < kNT; ++jt) s[jt][0] = s[jt][1] = s[jt][2] = s[jt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < T::kKSteps0; ++ks) qk_step(s, ks, 0, kNT);
#pragma unroll
    for (int jt = 0; jt < kNT; ++jt) {
      const float2 sk = *reinterpret_cast<const float2*>(&sKs[perm_key(jt, 2 * tig)]);
      s[jt][0] *= sk.x;
      s[jt][1] *= sk.y;
      s[jt][2] *= sk.x;
      s[jt][3] *= sk.y;
    }
    if constexpr (kNBlkD == 2) {
      // Second head_dim block: partial sums in chunks of 4 n8 tiles.
#pragma unroll
      for (int cq = 0; cq < kNT / 4; ++cq) {
        float part[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) part[i][0] = part[i][1] = part[i][2] = part[i][3] = 0.f;
#pragma unroll
        for (int ks = T::kKSteps0; ks < T::kKSteps; ++ks) qk_step(part, ks, 4 * cq, 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int jt = 4 * cq + i;
          const float2 sk = *reinterpret_cast<const float2*>(&sKs[kBlockN + perm_key(jt, 2 * tig)]);
          s[jt][0] = fmaf(part[i][0], sk.x * q_ratio[0], s[jt][0]);
          s[jt][1] = fmaf(part[i][1], sk.y * q_ratio[0], s[jt][1]);
          s[jt][2] = fmaf(part[i][2], sk.x * q_ratio[1], s[jt][2]);
          s[jt][3] = fmaf(part[i][3], sk.y * q_ratio[1], s[jt][3]);
        }
      }
    }

    // ---- mask: keys past seqlen_k, causal ----
    const int key0 = kt * kBlockN;
    const bool need_mask =
        key0 + kBlockN > Sk || (p.causal && key0 + kBlockN - 1 > q0 + warp * 16 + diag);
    if (need_mask) {
#pragma unroll
      for (int jt = 0; jt < kNT; ++jt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + perm_key(jt, 2 * tig + (e & 1));
          const int row = row0 + 8 * (e >> 1);
          if (key >= Sk || (p.causal && key > row + diag)) s[jt][e] = -INFINITY;
        }
    }

    // ---- online softmax, P quantization (softmax_row_step, fwd_softmax_sm90.cuh) ----
    float alpha[2], sp[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int jt = 0; jt < kNT; ++jt) mx = fmaxf(mx, fmaxf(s[jt][2 * r], s[jt][2 * r + 1]));
      const SoftmaxRowStep step = softmax_row_step(mx, rq[r], m_run[r]);
      alpha[r] = step.alpha;
      sp[r] = step.sp;
      const float nbias = step.nbias;
      float sum = 0.f;
#pragma unroll
      for (int jt = 0; jt < kNT; ++jt)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float pv = fast_exp2(fmaf(s[jt][e], rq[r], nbias));  // P / s_p
          s[jt][e] = pv;
          sum += pv;
        }
      l_run[r] = l_run[r] * alpha[r] + sum * sp[r];
    }
    // P_hat codes as A fragments of the 4 k32 steps (see the file comment).
    uint32_t pa[kNT / 4][4];
#pragma unroll
    for (int st = 0; st < kNT / 4; ++st) {
      const int j0 = 4 * st;
      pa[st][0] = pack_e4m3x4(s[j0][0], s[j0][1], s[j0 + 1][0], s[j0 + 1][1]);
      pa[st][1] = pack_e4m3x4(s[j0][2], s[j0][3], s[j0 + 1][2], s[j0 + 1][3]);
      pa[st][2] = pack_e4m3x4(s[j0 + 2][0], s[j0 + 2][1], s[j0 + 3][0], s[j0 + 3][1]);
      pa[st][3] = pack_e4m3x4(s[j0 + 2][2], s[j0 + 2][3], s[j0 + 3][2], s[j0 + 3][3]);
    }

    __syncthreads();  // every warp is done with sK / sKs
    if (kt + 1 < n_tiles) {
      load_k(kt + 1);
      cp_async_commit();
      cp_async_wait<1>();  // V tile kt has landed
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // V tile kt (and sVs) visible to every warp

    // ---- O = O * alpha + (P_hat V_hat) * s_p * s_v ----
#pragma unroll
    for (int cq = 0; cq < kVT / 4; ++cq) {
      float part[4][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) part[i][0] = part[i][1] = part[i][2] = part[i][3] = 0.f;
#pragma unroll
      for (int st = 0; st < kNT / 4; ++st)
#pragma unroll
        for (int pp = 0; pp < 2; ++pp) {
          const int t = 4 * cq + 2 * pp;  // channel tiles t, t+1
          uint32_t b0, b1, b2, b3;
          ldmatrix_x4(b0, b1, b2, b3, v_lane + 8 * t * T::kVStride + 32 * st);
          mma_e4m3(part[2 * pp], pa[st], b0, b1);
          mma_e4m3(part[2 * pp + 1], pa[st], b2, b3);
        }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = 4 * cq + i;
        const float2 sv = *reinterpret_cast<const float2*>(&sVs[8 * t + 2 * tig]);
        o[t][0] = fmaf(part[i][0], sp[0] * sv.x, o[t][0] * alpha[0]);
        o[t][1] = fmaf(part[i][1], sp[0] * sv.y, o[t][1] * alpha[0]);
        o[t][2] = fmaf(part[i][2], sp[1] * sv.x, o[t][2] * alpha[1]);
        o[t][3] = fmaf(part[i][3], sp[1] * sv.y, o[t][3] * alpha[1]);
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // key tile kt+1 visible; every warp is done with sV / sVs
  }

  // ---- epilogue: O = acc / l (BF16), LSE ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + 8 * r;
    if (row >= Sq) continue;
    // NOTE: l == 0 only for a row that sees no key: O = 0, LSE = -inf. A NaN l
    // (non-finite input) propagates into O and LSE.
    const float inv_l = l == 0.f ? 0.f : 1.f / l;
    __nv_bfloat16* out_row =
        static_cast<__nv_bfloat16*>(p.out) + (bhq * Sq + row) * static_cast<int64_t>(kDv);
#pragma unroll
    for (int t = 0; t < kVT; ++t) {
      const __nv_bfloat162 v2 = __floats2bfloat162_rn(o[t][2 * r] * inv_l, o[t][2 * r + 1] * inv_l);
      *reinterpret_cast<__nv_bfloat162*>(out_row + 8 * t + 2 * tig) = v2;
    }
    if (tig == 0) p.lse[bhq * Sq + row] = l == 0.f ? -INFINITY : (m_run[r] + __log2f(l)) * kLn2;
  }
}

template <int kD, int kDv, int kWarps>
void launch_fwd_warps(const KernelParams& p, cudaStream_t stream) {
  using T = FwdTraits<kD, kDv, kWarps>;
  auto kernel = fwd_kernel<kD, kDv, kWarps>;
  // NOTE: the attribute is per function and cheap to set; setting it on every
  // call keeps this free of static state across devices.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: run_fwd: cudaFuncSetAttribute failed: ") +
                             cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h).
  launch_attn_chunks(p, (p.seqlen_q + T::kBlockM - 1) / T::kBlockM, GridHeads::kQuery, 1, "run_fwd",
                     [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                       kernel<<<dim3(gx, gy, gz), T::kThreads, T::kSmemBytes, stream>>>(pc);
                       const cudaError_t e = cudaGetLastError();
                       if (e != cudaSuccess)
                         throw std::runtime_error(std::string("fp8attn: run_fwd: launch failed: ") +
                                                  cudaGetErrorString(e));
                     });
}

template <int kD, int kDv>
void launch_fwd(const KernelParams& p, cudaStream_t stream) {
  // NOTE: FP8ATTN_FWD_WARPS=4|8 overrides the CTA shape (benchmarking; 4 warps:
  // 64 query rows, two CTAs per SM; 8 warps: 128 rows, one CTA per SM); read at
  // every call, any other non-empty value is an error (run_fwd checks it first).
  const int env_warps = env_choice("FP8ATTN_FWD_WARPS", {"4", "8"});
  const int warps = env_warps == 0 ? 4 : env_warps == 1 ? 8 : fwd_warps(kD);
  if (warps == 4) return launch_fwd_warps<kD, kDv, 4>(p, stream);
  return launch_fwd_warps<kD, kDv, 8>(p, stream);
}

[[noreturn]] void bad(const char* field, const std::string& what) {
  throw std::invalid_argument(std::string("fp8attn: run_fwd: '") + field + "': " + what);
}

}  // namespace

void run_fwd(const KernelParams& p, cudaStream_t stream) {
  if (p.block_size != kSeqBlock) bad("block_size", "must be 128, got " + std::to_string(p.block_size));
  if (p.seqlen_q < 1 || p.seqlen_k < 1) bad("seqlen", "seqlen_q and seqlen_k must be >= 1");
  if (p.num_heads_kv < 1 || p.num_heads_q % p.num_heads_kv != 0)
    bad("num_heads_kv", "num_heads_q must be a multiple of num_heads_kv");
  if (p.batch < 1 || p.num_heads_q < 1 || static_cast<int64_t>(p.batch) * p.num_heads_q > 2147483647)
    bad("batch", "batch and num_heads_q must be >= 1 with batch * num_heads_q < 2^31");
  if (p.seqlen_k_pad < p.seqlen_k || p.seqlen_k_pad % kSeqPad != 0)
    bad("seqlen_k_pad", "must be a multiple of 16 and >= seqlen_k");
  // NOTE: the wgmma kernel (fwd_wgmma_e4m3_blockscale_sm90.cu) takes the shapes
  // it supports; FP8ATTN_FWD_KERNEL=mma forces this kernel (read on every call,
  // so one process can benchmark both).
  // NOTE: a misspelt value would silently benchmark / test the default kernel,
  // so both knobs are checked here, before any kernel is picked.
  const int which = env_choice("FP8ATTN_FWD_KERNEL", {"mma", "wgmma", "wgmma_serial", "wgmma_overlap",
                                                      "wgmma_pingpong", "wgmma_serial3"});
  env_choice("FP8ATTN_FWD_WARPS", {"4", "8"});
  const bool force_mma = which == 0;
  if (!force_mma && fwd_wgmma_supported(p)) return run_fwd_wgmma(p, stream);
  const int d = p.head_dim_qk, dv = p.head_dim_v;
  if (d == 64 && dv == 64) return launch_fwd<64, 64>(p, stream);
  if (d == 128 && dv == 128) return launch_fwd<128, 128>(p, stream);
  if (d == 256 && dv == 256) return launch_fwd<256, 256>(p, stream);
  if (d == 192 && dv == 128) return launch_fwd<192, 128>(p, stream);
  bad("head_dim", "(head_dim_qk, head_dim_v) must be (64,64), (128,128), (256,256) or (192,128), got (" +
                      std::to_string(d) + "," + std::to_string(dv) + ")");
}

}  // namespace sm90
}  // namespace fp8attn
