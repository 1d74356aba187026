// fp8attn: sm_90a FP8 attention forward with block scales on wgmma + TMA
// (numerics.md sections 2-3, matmuls #1 and #2). Contract: run_fwd in
// fwd_e4m3_blockscale_sm90.h (same math, same outputs); this file only changes
// how the products are computed. Design and measurements:
// docs/kernels/fwd_wgmma_e4m3_blockscale_sm90.md.
//
// One CTA per (query tile of 64 rows per consumer warpgroup, query head, batch); 128-key
// tiles in increasing order. Warp-specialized:
//   producer warpgroup (setmaxnreg down)
//     warp 0   TMA of the Q tile once, then per key tile: K tile (k_row,
//              128B/64B-swizzled) + its s_k into stage s, V^T tile (v_colT,
//              128B-swizzled) into stage s
//     warps 1-3  per key tile: permute the V^T tile's keys in place inside each
//              16-key group (see "P fragment" below), copy s_v, hand the stage on
//   consumer warpgroups (setmaxnreg up), 64 query rows each, per key tile:
//     S = Q K^T            wgmma m64n{128}k32 SS, FP32 (one head_dim block)
//     S *= s_k; mask; online softmax in the log2 domain; P quantized per (row,
//       tile) with s_p = block_scale(exp2(rowmax - m_new)) (fwd_softmax_sm90.cuh,
//       as the first, mma.sync forward did: removed 2026-12-07, code at f7729f9)
//     part = P_hat V_hat   wgmma m64n{Dv}k32 RS (P from registers), FP32
//     O = O * alpha + part * s_p * s_v   (the FP32 partial of each 128-key block is
//       promoted into the O accumulator with its scales)
//   epilogue: O / l -> BF16, LSE.
// Consumer schedules (kVariant): v1 serial as above; v2 issues QK^T (kt + 1)
// before the softmax of kt; v3 (default at head_dim 128) pairs the two
// warpgroups so they take turns issuing {P V (kt), QK^T (kt + 1)} (pingpong);
// v11 (default at head_dim 64) runs v1 on three consumer warpgroups (192
// query rows per CTA, 160 registers each). Measurements: the doc.
// Stages are handed over with mbarriers: k_full/v_full (producer -> consumers),
// k_empty/v_empty (consumers -> producer), v_raw (TMA -> permuting warps).
//
// P fragment: the FP32 accumulator of wgmma gives thread (g, t) of a warp the
// columns {8j + 2t, 8j + 2t + 1} of each n8 tile j, while the 8-bit A operand
// of a k32 step wants k indices {4t .. 4t+3} and {16 + 4t .. 16 + 4t + 3}. Packing
// the thread's own S values of tiles (4s, 4s+1) and (4s+2, 4s+3) gives A k index
// 4t + i = key 2t + (i & 1) + 8 (i >> 1) (inside each 16-key group). So the V^T
// tile is permuted the same way in shared memory (byte k of each 16-key chunk
// holds key perm(k)): no shuffles in the consumers, 4 PRMT per 16 bytes of V in
// the otherwise idle producer warps. The permutation stays inside 16-byte
// chunks, so the TMA swizzle is untouched.
//
// head_dim_qk 192 / 256 (two head_dim blocks): fwd_wgmma_d2_kernel below, the
// same producer and the v1 schedule with the second block's S partial in n32
// chunks and P V in 64-channel chains (registers: see its comment).
#include "hopper/fwd_wgmma_e4m3_blockscale_sm90.h"

#include <cuda.h>
#include <cuda_runtime.h>

#if !__has_include(<cute/arch/mma_sm90_gmma.hpp>)
#error "fp8attn: CUTLASS/CuTe headers not found: run scripts/get_cutlass.sh (third_party/cutlass/include) or set FP8ATTN_CUTLASS_INCLUDE"
#endif
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>

#include "hopper/config_sm90.h"
#include "hopper/fwd_softmax_sm90.cuh"
#include "hopper/launch_sm90.h"
#include "hopper/pipeline_sm90.cuh"
#include "hopper/tma_map_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace {

// NOTE: the PTX wrappers, wgmma descriptors and E4M3 atoms are the `tile`
// kernels' (pipeline_sm90.cuh), shared.
using namespace pipe;

// Consumer schedules (template kVariant; FP8ATTN_FWD_KERNEL picks one, see run_fwd_wgmma).
constexpr int kSerial = 1;    // v1: QK^T, softmax, P V in sequence per warpgroup
constexpr int kOverlap = 2;   // v2: QK^T (kt + 1) during softmax (kt)
constexpr int kPingpong = 3;  // v3: warpgroups alternate their wgmma phases
constexpr int kSerial3 = 4;   // v11: v1 with three consumer warpgroups (kBlockM 192)
// Consumer warpgroups of a schedule.
constexpr int consumer_wgs(int variant) { return variant == kSerial3 ? fwdw::k3ConsumerWGs : fwdw::kConsumerWGs; }

// ---- shapes ------------------------------------------------------------------------

template <int kD, int kDv, int kCWG = fwdw::kConsumerWGs>
struct WTraits {
  static constexpr int kConsumerWGs = kCWG, kThreads = 128 * (1 + kCWG);
  // setmaxnreg budgets: three consumer warpgroups (v11) launch at 128 registers.
  static constexpr int kProducerRegs = kCWG == 3 ? fwdw::k3ProducerRegs : fwdw::kProducerRegs;
  static constexpr int kConsumerRegs = kCWG == 3 ? fwdw::k3ConsumerRegs : fwdw::kConsumerRegs;
  static constexpr int kBlockM = 64 * kCWG, kBlockN = fwdw::kBlockN, kStages = fwdw::kStages;
  static constexpr int kQKRow = kD;  // bytes per Q / K smem row = swizzle span
  static constexpr int kQBytes = kBlockM * kD;
  static constexpr int kKBytes = kBlockN * kD;
  static constexpr int kVBytes = kDv * kBlockN;
  static constexpr int kNb = 1, kDvT = kDv;  // head_dim blocks (producer_warpgroup)
  static constexpr int kQ0Bytes = kQBytes, kQ1Bytes = 0;
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffKs = kOffV + kStages * kVBytes;        // float [kStages][kBlockN]
  static constexpr int kOffVs = kOffKs + kStages * kBlockN * 4;   // float [kStages][kDv]
  static constexpr int kOffBar = kOffVs + kStages * kDv * 4;      // uint64 [1 + 5 kStages]
  static constexpr int kSmemBytes = kOffBar + 8 * (1 + 5 * kStages) + 1024;  // + base alignment

  static_assert(kD == 64 || kD == 128, "one head_dim block, rows = one swizzle span");
  static_assert(kDv == 64 || kDv == 128, "P V: m64n{64,128}k32");
  static_assert(kOffK % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0,
                "swizzled tiles start on 1024-byte boundaries");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
};

// ---- shared by both kernels: mbarriers, the producer warpgroup ----

// mbarriers (8 bytes each from T::kOffBar): q_full, then per stage k_full,
// k_empty, v_raw, v_full, v_empty (file comment: who arrives on which).
enum FwdBar { kQFull = 0, kKFull = 1, kKEmpty = 2, kVRaw = 3, kVFull = 4, kVEmpty = 5 };
template <int kStages>
__device__ __forceinline__ uint32_t fwd_bar(uint32_t bar, FwdBar which, int s) {
  return which == kQFull ? bar : bar + 8u * (1 + (static_cast<int>(which) - 1) * kStages + s);
}
// NOTE: every consumer thread arrives on k_empty / v_empty (CUTLASS's
// consumer_release does the same), not one lane per warp after __syncwarp:
// each thread's own shared-memory reads of the stage are then ordered before
// the producer's next stores by one arrive / wait pair, an order
// compute-sanitizer racecheck follows (it reported the lane-0 form as racy).
template <int kStages, int kCWG = fwdw::kConsumerWGs>
__device__ __forceinline__ void fwd_init_bars(uint32_t bar) {
  mbar_init(fwd_bar<kStages>(bar, kQFull, 0), 1);
  for (int s = 0; s < kStages; ++s) {
    mbar_init(fwd_bar<kStages>(bar, kKFull, s), 32);                      // warp 0: TMA bytes + s_k stores
    mbar_init(fwd_bar<kStages>(bar, kKEmpty, s), 128 * kCWG);  // every consumer thread
    mbar_init(fwd_bar<kStages>(bar, kVRaw, s), 1);                         // TMA bytes
    mbar_init(fwd_bar<kStages>(bar, kVFull, s), 96);                       // the permuting threads
    mbar_init(fwd_bar<kStages>(bar, kVEmpty, s), 128 * kCWG);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// The producer warpgroup (after its setmaxnreg.dec). Warp 0: TMA of the Q
// tile once, then per key tile the K tile + its s_k into stage s and the V^T
// tile into stage s. Warps 1-3: V^T key permutation in place (file comment),
// s_v, hand the stage on. T::kNb head_dim blocks of Q and K (1, or 2 at
// d_qk >= 192: block b from map tm_qk[b], columns [kD0 b, ...), s_k as
// [Sk][kNb] in global, [stage][block][key] in shared memory). 32-bit
// shared-memory addresses only (the d >= 192 producer runs at 24 registers).
// Tile geometry: query rows [q0, q0 + kBlockM) of head row bhq, key tiles
// [0, n_tiles) of head row bhk (seqlen_k Sk, nblk_k tiles in all).
template <class T>
__device__ __forceinline__ void producer_warpgroup(const KernelParams& p, uint32_t sbase, uint32_t bar, int q0,
                                                   int Sk, int n_tiles, int nblk_k, int64_t bhq, int64_t bhk,
                                                   const CUtensorMap* tm_q0, const CUtensorMap* tm_q1,
                                                   const CUtensorMap* tm_k0, const CUtensorMap* tm_k1,
                                                   const CUtensorMap* tm_v) {
  constexpr int kBlockN = T::kBlockN, kStages = T::kStages, kNb = T::kNb, kDv = T::kDvT;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  auto sK = [&](int s) { return sbase + T::kOffK + s * T::kKBytes; };  // block 1 at + kK0Bytes
  auto sV = [&](int s) { return sbase + T::kOffV + s * T::kVBytes; };
  if (warp == 0) {
    const float* ks_g = p.k_row_s + bhk * Sk * kNb;
    const uint32_t q_full = fwd_bar<kStages>(bar, kQFull, 0);
    if (lane == 0) {
      mbar_arrive_tx(q_full, T::kQ0Bytes + T::kQ1Bytes);
      tma_load_3d(sbase + T::kOffQ, tm_q0, q_full, 0, q0, static_cast<int>(bhq));
      if constexpr (kNb == 2)
        tma_load_3d(sbase + T::kOffQ + T::kQ0Bytes, tm_q1, q_full, T::kD0, q0, static_cast<int>(bhq));
    }
    for (int kt = 0; kt < n_tiles; ++kt) {
      const int s = kt % kStages;
      const uint32_t ph = (kt / kStages) & 1;
      const uint32_t k_full = fwd_bar<kStages>(bar, kKFull, s);
      mbar_wait(fwd_bar<kStages>(bar, kKEmpty, s), ph ^ 1);
      for (int i = lane; i < kNb * kBlockN; i += 32) {
        const int key = kt * kBlockN + i / kNb;
        // NOTE: keys >= seqlen_k get s_k = 0 (their K rows are TMA zero fill);
        // the mask overwrites those S entries anyway.
        st_shared_f32(sbase + T::kOffKs + 4 * ((s * kNb + i % kNb) * kBlockN + i / kNb),
                      key < Sk ? ks_g[kt * kNb * kBlockN + i] : 0.f);
      }
      if (lane == 0) {
        mbar_arrive_tx(k_full, T::kKBytes);
        tma_load_3d(sK(s), tm_k0, k_full, 0, kt * kBlockN, static_cast<int>(bhk));
        if constexpr (kNb == 2)
          tma_load_3d(sK(s) + T::kK0Bytes, tm_k1, k_full, T::kD0, kt * kBlockN, static_cast<int>(bhk));
        mbar_wait(fwd_bar<kStages>(bar, kVEmpty, s), ph ^ 1);
        const uint32_t v_raw = fwd_bar<kStages>(bar, kVRaw, s);
        mbar_arrive_tx(v_raw, T::kVBytes);
        tma_load_3d(sV(s), tm_v, v_raw, kt * kBlockN, 0, static_cast<int>(bhk));
      } else {
        mbar_arrive(k_full);
      }
      __syncwarp();
    }
  } else {
    const int pt = tid - 32;
    const float* vs_g = p.v_col_s + bhk * kDv * nblk_k;
    for (int kt = 0; kt < n_tiles; ++kt) {
      const int s = kt % kStages;
      const uint32_t ph = (kt / kStages) & 1;
      // NOTE: v_empty first (the same phase warp 0 waits on before the V TMA, so
      // it never holds these warps longer than the v_raw wait behind it would):
      // the consumers' reads of stage s's s_v then happen-before this warp's
      // s_v stores through one release / acquire pair, not only through warp
      // 0's arrive on v_raw and the TMA's completion, which compute-sanitizer
      // racecheck does not follow (it reported the s_v stores racing with
      // promote's loads once a stage is reused).
      mbar_wait(fwd_bar<kStages>(bar, kVEmpty, s), ph ^ 1);
      mbar_wait(fwd_bar<kStages>(bar, kVRaw, s), ph);
      for (uint32_t a = sV(s) + 16 * pt; a < sV(s) + T::kVBytes; a += 16 * 96) {
        const uint4 x = ld_shared_v4(a);
        uint4 y;
        y.x = __byte_perm(x.x, x.z, 0x5410);  // keys 0 1 8 9
        y.y = __byte_perm(x.x, x.z, 0x7632);  // keys 2 3 10 11
        y.z = __byte_perm(x.y, x.w, 0x5410);  // keys 4 5 12 13
        y.w = __byte_perm(x.y, x.w, 0x7632);  // keys 6 7 14 15
        st_shared_v4(a, y);
      }
      // NOTE: not unrolled: hoisted per-channel addresses spill at 24 / 40 registers.
#pragma unroll 1
      for (int ch = pt; ch < kDv; ch += 96)
        st_shared_f32(sbase + T::kOffVs + 4 * (s * kDv + ch), vs_g[static_cast<int64_t>(ch) * nblk_k + kt]);
      // NOTE: generic-proxy writes read next by wgmma (async proxy).
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      mbar_arrive(fwd_bar<kStages>(bar, kVFull, s));
    }
  }
}

// ---- the kernel --------------------------------------------------------------------

template <int kD, int kDv, int kVariant>
__global__ void __launch_bounds__(128 * (1 + consumer_wgs(kVariant)), 1)
    fwd_wgmma_kernel(const __grid_constant__ KernelParams p, const __grid_constant__ CUtensorMap tm_q,
                     const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
  using T = WTraits<kD, kDv, consumer_wgs(kVariant)>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kNT = kBlockN / 8;  // n8 tiles of S (16)
  constexpr int kVT = kDv / 8;      // n8 tiles of O
  // NOTE: P V runs in chunks of 64 output channels (m64n64k32): a 64-register
  // partial next to O, S(kt) and S(kt + 1) would not fit 232 registers.
  constexpr int kPvN = 64;
  constexpr int kPvChunks = kDv / kPvN;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sbase = smem_u32(smem);
  float* sKs = reinterpret_cast<float*>(smem + T::kOffKs);
  float* sVs = reinterpret_cast<float*>(smem + T::kOffVs);
  const uint32_t bar = sbase + T::kOffBar;
  const uint32_t q_full = fwd_bar<kStages>(bar, kQFull, 0);
  auto k_full = [&](int s) { return fwd_bar<kStages>(bar, kKFull, s); };
  auto k_empty = [&](int s) { return fwd_bar<kStages>(bar, kKEmpty, s); };
  auto v_full = [&](int s) { return fwd_bar<kStages>(bar, kVFull, s); };
  auto v_empty = [&](int s) { return fwd_bar<kStages>(bar, kVEmpty, s); };
  auto sK = [&](int s) { return sbase + T::kOffK + s * T::kKBytes; };
  auto sV = [&](int s) { return sbase + T::kOffV + s * T::kVBytes; };

  const int m_tile = gridDim.x - 1 - blockIdx.x;  // NOTE: heaviest causal tiles first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.num_heads_q / p.num_heads_kv);
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int nblk_k = (Sk + kBlockN - 1) / kBlockN;
  const int q0 = m_tile * kBlockM;
  const int diag = Sk - Sq;  // causal: key j visible to query i iff j <= i + diag
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + h;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;

  int n_tiles = nblk_k;  // key tiles [0, n_tiles)
  if (p.causal) {
    const int last_key = min(q0 + kBlockM, Sq) - 1 + diag;
    n_tiles = last_key < 0 ? 0 : min(n_tiles, last_key / kBlockN + 1);
  }

  if (tid == 0) fwd_init_bars<kStages, T::kConsumerWGs>(bar);
  __syncthreads();

  if (wg == 0) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(T::kProducerRegs));
    producer_warpgroup<T>(p, sbase, bar, q0, Sk, n_tiles, nblk_k, bhq, bhk, &tm_q, nullptr, &tm_k, nullptr, &tm_v);
    return;
  }

  // ================= consumer warpgroups =================
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(T::kConsumerRegs));
  const int cw = wg - 1;
  const int t128 = tid - 128 * wg, warp = t128 / 32, lane = t128 & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int row_w0 = q0 + 64 * cw + 16 * warp;  // first query row of this warp
  const int row0 = row_w0 + g;                  // this thread's rows: row0, row0 + 8

  const float scale_log2 = p.softmax_scale * kLog2e;
  float rq[2];  // s_q * tau * log2(e) per row (padding rows: 0, never stored)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    rq[r] = row < Sq ? p.q_row_s[bhq * Sq + row] * scale_log2 : 0.f;
  }

  float o[kDv / 2];
#pragma unroll
  for (int i = 0; i < kDv / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running row max (log2 domain)
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sum

  const uint32_t sQ = sbase + T::kOffQ + cw * 64 * kD;
  mbar_wait(q_full, 0);

  // Issue t = Q K^T of key tile kt into acc (asynchronous; committed as one group).
  auto qk_issue = [&](float (&acc)[kBlockN / 2], int kt) {
    const int s = kt % kStages;
    mbar_wait(k_full(s), (kt / kStages) & 1);
    fence_acc(acc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < kD / 32; ++ks)
      gmma_ss<kBlockN>(gmma_desc<T::kQKRow>(sQ + 32 * ks), gmma_desc<T::kQKRow>(sK(s) + 32 * ks), acc, ks > 0,
                       std::make_index_sequence<kBlockN / 2>{});
    cute::warpgroup_commit_batch();
  };

  // t (complete) -> S = t * s_k, mask, online softmax, P_hat codes as the A
  // fragments of the 4 k32 steps of P V (file comment); releases K stage kt.
  auto softmax = [&](float (&sacc)[kBlockN / 2], int kt, uint32_t (&pa)[kNT / 4][4], float (&alpha)[2],
                     float (&sp)[2]) {
    const int s = kt % kStages;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const float2 sk = *reinterpret_cast<const float2*>(&sKs[s * kBlockN + 8 * j + 2 * tig]);
      sacc[4 * j + 0] *= sk.x;
      sacc[4 * j + 1] *= sk.y;
      sacc[4 * j + 2] *= sk.x;
      sacc[4 * j + 3] *= sk.y;
    }
    mbar_arrive(k_empty(s));  // this thread is done with K / s_k of stage s (NOTE at fwd_init_bars)

    // ---- mask: keys past seqlen_k, causal ----
    const int key0 = kt * kBlockN;
    const bool need_mask = key0 + kBlockN > Sk || (p.causal && key0 + kBlockN - 1 > row_w0 + diag);
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * j + 2 * tig + (e & 1);
          const int row = row0 + 8 * (e >> 1);
          if (key >= Sk || (p.causal && key > row + diag)) sacc[4 * j + e] = -INFINITY;
        }
    }

    // ---- online softmax, P quantization (softmax_row_step, fwd_softmax_sm90.cuh) ----
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1]));
      const SoftmaxRowStep step = softmax_row_step(mx, rq[r], m_run[r]);
      alpha[r] = step.alpha;
      sp[r] = step.sp;
      const float nbias = step.nbias;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float pv = fast_exp2(fmaf(sacc[4 * j + e], rq[r], nbias));  // P / s_p
          sacc[4 * j + e] = pv;
          sum += pv;
        }
      l_run[r] = l_run[r] * alpha[r] + sum * sp[r];
    }
#pragma unroll
    for (int st = 0; st < kNT / 4; ++st) {
      const float* x = &sacc[16 * st];  // n8 tiles 4 st .. 4 st + 3
      pa[st][0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
      pa[st][1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
      pa[st][2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
      pa[st][3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
    }
  };

  // Issue part = P_hat V_hat of key tile kt, output channels [kPvN c, kPvN c + kPvN)
  // (asynchronous).
  auto pv_issue = [&](const uint32_t (&pa)[kNT / 4][4], float (&part)[kPvN / 2], int kt, int c) {
    const int s = kt % kStages;
    if (c == 0) mbar_wait(v_full(s), (kt / kStages) & 1);
    fence_acc(part);
    cute::warpgroup_arrive();
#pragma unroll
    for (int st = 0; st < kNT / 4; ++st)
      gmma_rs<kPvN>(pa[st], gmma_desc<128>(sV(s) + c * kPvN * kBlockN + 32 * st), part, st > 0,
                    std::make_index_sequence<kPvN / 2>{});
    cute::warpgroup_commit_batch();
  };

  // part (complete) -> O = O * alpha + part * s_p * s_v on channel chunk c;
  // the last chunk releases V stage kt.
  auto promote = [&](const float (&part)[kPvN / 2], int kt, int c, const float (&alpha)[2], const float (&sp)[2]) {
    const int s = kt % kStages;
#pragma unroll
    for (int tc = 0; tc < kPvN / 8; ++tc) {
      const int t = c * (kPvN / 8) + tc;
      const float2 sv = *reinterpret_cast<const float2*>(&sVs[s * kDv + 8 * t + 2 * tig]);
      o[4 * t + 0] = fmaf(part[4 * tc + 0], sp[0] * sv.x, o[4 * t + 0] * alpha[0]);
      o[4 * t + 1] = fmaf(part[4 * tc + 1], sp[0] * sv.y, o[4 * t + 1] * alpha[0]);
      o[4 * t + 2] = fmaf(part[4 * tc + 2], sp[1] * sv.x, o[4 * t + 2] * alpha[1]);
      o[4 * t + 3] = fmaf(part[4 * tc + 3], sp[1] * sv.y, o[4 * t + 3] * alpha[1]);
    }
    if (c == kPvChunks - 1) {
      mbar_arrive(v_empty(s));  // this thread is done with V / s_v of stage s
    }
  };

  if constexpr (kVariant == kSerial || kVariant == kSerial3) {
    // v1 / v11: QK^T, wait, softmax, PV, wait, promote (overlap only across
    // warpgroups: two in v1, three in v11).
    // NOTE: a warpgroup computes only the key tiles its own 64 rows see
    // (n_mine <= n_tiles: causal rows above the CTA's last rows, rows past
    // seqlen_q); it still takes part in the stage hand-over of the rest. So
    // a non-finite V at key j never reaches a row of an earlier 128-key tile
    // than j's (the documented diagonal-tile deviation), whatever kBlockM.
    int n_mine = 0;
    {
      const int wg_row0 = q0 + 64 * cw, wg_rows_end = min(wg_row0 + 64, Sq);
      if (wg_rows_end > wg_row0) {
        n_mine = n_tiles;
        if (p.causal) {
          const int last_key = wg_rows_end - 1 + diag;
          n_mine = last_key < 0 ? 0 : min(n_tiles, last_key / kBlockN + 1);
        }
      }
    }
    auto handover = [&](int kt) {
      // Not seen by this warpgroup's rows: wait for the stage (so this
      // arrival counts toward its current phase) and release it.
      const int s = kt % kStages;
      const uint32_t ph = (kt / kStages) & 1;
      mbar_wait(k_full(s), ph);
      mbar_arrive(k_empty(s));
      mbar_wait(v_full(s), ph);
      mbar_arrive(v_empty(s));
    };
    if constexpr (kVariant == kSerial) {
      // NOTE: early QK^T: QK^T (kt + 1) is issued right after the last P V chunk
      // of tile kt (S (kt) is dead once packed), so it runs on the tensor cores
      // during that chunk's promotion (v1 only: at v11's 160 registers it
      // spills). The last tile is peeled (kNext a literal at both calls): a
      // wgmma in a branch makes ptxas serialize them (C7518).
      float sacc[kBlockN / 2];
      auto body = [&](int kt, auto next_tag) {
        constexpr bool kNext = decltype(next_tag)::value;
        float part[kPvN / 2], alpha[2], sp[2];
        uint32_t pa[kNT / 4][4];
        cute::warpgroup_wait<0>();
        fence_acc(sacc);
        softmax(sacc, kt, pa, alpha, sp);
#pragma unroll
        for (int c = 0; c < kPvChunks; ++c) {
          pv_issue(pa, part, kt, c);
          if (kNext && c == kPvChunks - 1) {
            qk_issue(sacc, kt + 1);
            cute::warpgroup_wait<1>();  // P V (kt) chunk c; QK^T (kt + 1) may still run
          } else {
            cute::warpgroup_wait<0>();
          }
          fence_acc(part);
          promote(part, kt, c, alpha, sp);
        }
      };
      if (n_mine > 0) {
        qk_issue(sacc, 0);
        for (int kt = 0; kt + 1 < n_mine; ++kt) body(kt, std::true_type{});
        body(n_mine - 1, std::false_type{});
      }
    } else {
      for (int kt = 0; kt < n_mine; ++kt) {
        float sacc[kBlockN / 2], part[kPvN / 2], alpha[2], sp[2];
        uint32_t pa[kNT / 4][4];
        qk_issue(sacc, kt);
        cute::warpgroup_wait<0>();
        fence_acc(sacc);
        softmax(sacc, kt, pa, alpha, sp);
#pragma unroll
        for (int c = 0; c < kPvChunks; ++c) {
          pv_issue(pa, part, kt, c);
          cute::warpgroup_wait<0>();
          fence_acc(part);
          promote(part, kt, c, alpha, sp);
        }
      }
    }
    for (int kt = n_mine; kt < n_tiles; ++kt) handover(kt);
  } else if constexpr (kVariant == kOverlap) {
    // v2: QK^T of tile kt + 1 runs on the tensor cores during the softmax of
    // tile kt. NOTE: fixed roles (snxt is copied into scur once complete): no
    // instruction but wgmma writes an accumulator while it is in flight, else
    // ptxas serializes the wgmmas (C7515).
    float scur[kBlockN / 2], snxt[kBlockN / 2], part[kPvN / 2];
    if (n_tiles > 0) {
      qk_issue(scur, 0);
      cute::warpgroup_wait<0>();
    }
    for (int kt = 0; kt < n_tiles; ++kt) {
      float alpha[2], sp[2];
      uint32_t pa[kNT / 4][4];
      const bool has_next = kt + 1 < n_tiles;
      if (has_next) qk_issue(snxt, kt + 1);
      fence_acc(scur);
      softmax(scur, kt, pa, alpha, sp);
#pragma unroll
      for (int c = 0; c < kPvChunks; ++c) {
        pv_issue(pa, part, kt, c);
        cute::warpgroup_wait<0>();  // P V (kt, chunk c); QK^T (kt + 1) is older
        fence_acc(part);
        promote(part, kt, c, alpha, sp);
      }
      fence_acc(snxt);
      if (has_next) {
#pragma unroll
        for (int i = 0; i < kBlockN / 2; ++i) scur[i] = snxt[i];
      }
    }
  } else {
    // v3 (pingpong): the two consumer warpgroups take turns issuing their
    // wgmmas (named barriers 1 and 2, FA3's scheme), so one warpgroup's softmax
    // runs while the other's P V (kt) and QK^T (kt + 1) occupy the tensor cores.
    // S (kt) is dead once packed into P, so QK^T (kt + 1) reuses its registers.
    static_assert(kVariant == kPingpong && fwdw::kConsumerWGs == 2, "pingpong pairs two warpgroups");
    auto turn_wait = [&] { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + cw) : "memory"); };
    auto turn_pass = [&] { asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (cw ^ 1)) : "memory"); };
    if (cw == 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");  // warpgroup 0 starts
    float sacc[kBlockN / 2], part[kDv / 2];
    if (n_tiles > 0) {
      turn_wait();
      qk_issue(sacc, 0);
      turn_pass();
      cute::warpgroup_wait<0>();
    }
    for (int kt = 0; kt < n_tiles; ++kt) {
      float alpha[2], sp[2];
      uint32_t pa[kNT / 4][4];
      fence_acc(sacc);
      softmax(sacc, kt, pa, alpha, sp);
      turn_wait();
      {
        const int s = kt % kStages;
        mbar_wait(v_full(s), (kt / kStages) & 1);
        fence_acc(part);
        cute::warpgroup_arrive();
#pragma unroll
        for (int st = 0; st < kNT / 4; ++st)
          gmma_rs<kDv>(pa[st], gmma_desc<128>(sV(s) + 32 * st), part, st > 0, std::make_index_sequence<kDv / 2>{});
        cute::warpgroup_commit_batch();
      }
      if (kt + 1 < n_tiles) qk_issue(sacc, kt + 1);
      turn_pass();
      cute::warpgroup_wait<0>();
      fence_acc(part);
      fence_acc(sacc);
#pragma unroll
      for (int c = 0; c < kDv / kPvN; ++c) {
        float (&pc)[kPvN / 2] = *reinterpret_cast<float (*)[kPvN / 2]>(&part[c * (kPvN / 2)]);
        promote(pc, kt, c, alpha, sp);
      }
    }
    if (cw == 0) turn_wait();  // consumes warpgroup 1's last pass (every arrive is matched)
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
    __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(p.out) + (bhq * Sq + row) * static_cast<int64_t>(kDv);
#pragma unroll
    for (int t = 0; t < kVT; ++t) {
      const __nv_bfloat162 v2 = __floats2bfloat162_rn(o[4 * t + 2 * r] * inv_l, o[4 * t + 2 * r + 1] * inv_l);
      *reinterpret_cast<__nv_bfloat162*>(out_row + 8 * t + 2 * tig) = v2;
    }
    if (tig == 0) p.lse[bhq * Sq + row] = l == 0.f ? -INFINITY : (m_run[r] + __log2f(l)) * kLn2;
  }
}

// ---- head_dim 192 / 256: two head_dim blocks ---------------------------------------
//
// fwd_wgmma_d2_kernel: the v1 (kSerial) schedule per consumer warpgroup, the
// same producer, and the same math (numerics.md sections 2-3) as the removed
// mma.sync forward at d_qk > 128 (code at f7729f9):
//   Q and K tiles are stored per head_dim block (block 0: rows of 128 bytes,
//     128B swizzle; block 1: rows of kD - 128 = 64 or 128 bytes, 64B / 128B
//     swizzle), each block with its own TMA map;
//   S = t0 * s_k0 (t0 = Q0 K0^T, m64n128k32 SS over block 0), then block 1's
//     FP32 partial t1 in n32 chunks, each added right away as
//     fmaf(t1, s_k1 * (s_q1 / s_q0), S) (the mma.sync forward's order; the row
//     factor s_q0 * tau * log2(e) stays in the exp's FMA);
//   mask, online softmax, P quantization: exactly as fwd_wgmma_kernel;
//   P V in chains of fwdw::kD2PvN output channels (m64n64k32 RS), two partial
//     buffers so chain c + 1 runs while chain c is promoted into O.
// NOTE: registers per consumer thread (setmaxnreg 240): O kDv / 2 (128 at
// dv = 256) is live throughout; QK^T phase + S 64 + one S chunk 16 = 208;
// P V phase + P codes 16 + two partials 2 x 32 = 208. A whole-width t1 (64)
// or a single m64n256 P V partial (128) would not fit.

template <int kD, int kDv>
struct WTraits2 {
  static constexpr int kBlockM = fwdw::kBlockM, kBlockN = fwdw::kBlockN, kStages = fwdw::kStages;
  static constexpr int kD0 = kMaxDimBlock, kD1 = kD - kMaxDimBlock;  // head_dim blocks (bytes per row)
  static constexpr int kQ0Bytes = kBlockM * kD0, kQ1Bytes = kBlockM * kD1;
  static constexpr int kK0Bytes = kBlockN * kD0, kK1Bytes = kBlockN * kD1;
  static constexpr int kKBytes = kK0Bytes + kK1Bytes;  // one stage: block 0, then block 1
  static constexpr int kVBytes = kDv * kBlockN;
  static constexpr int kNb = 2, kDvT = kDv;  // (producer_warpgroup)
  static constexpr int kOffQ = 0;                                    // block 0, then block 1
  static constexpr int kOffK = kOffQ + kQ0Bytes + kQ1Bytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffKs = kOffV + kStages * kVBytes;           // float [kStages][2][kBlockN]
  static constexpr int kOffVs = kOffKs + kStages * 2 * kBlockN * 4;  // float [kStages][kDv]
  static constexpr int kOffBar = kOffVs + kStages * kDv * 4;         // uint64 [1 + 5 kStages]
  static constexpr int kSmemBytes = kOffBar + 8 * (1 + 5 * kStages) + 1024;  // + base alignment

  static_assert((kD == 256 && kDv == 256) || (kD == 192 && kDv == 128), "two head_dim blocks: (256,256), (192,128)");
  static_assert(num_dim_blocks(kD) == 2 && dim_block(kD) == kD0, "head_dim block rule (numerics.md section 2)");
  static_assert(kD1 == 64 || kD1 == 128, "block 1 rows = one 64B or 128B swizzle span");
  static_assert(kDv % fwdw::kD2PvN == 0, "whole P V chains");
  static_assert(kQ0Bytes % 1024 == 0 && kOffK % 1024 == 0 && kK0Bytes % 1024 == 0 && kKBytes % 1024 == 0 &&
                    kVBytes % 1024 == 0 && (fwdw::kD2S1ChunkN * kD1) % 1024 == 0,
                "swizzled tiles and chunk starts on 1024-byte boundaries");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
};

template <int kD, int kDv>
__global__ void __launch_bounds__(fwdw::kThreads, 1)
    fwd_wgmma_d2_kernel(const __grid_constant__ KernelParams p, const __grid_constant__ CUtensorMap tm_q0,
                        const __grid_constant__ CUtensorMap tm_q1, const __grid_constant__ CUtensorMap tm_k0,
                        const __grid_constant__ CUtensorMap tm_k1, const __grid_constant__ CUtensorMap tm_v) {
  using T = WTraits2<kD, kDv>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kStages = T::kStages;
  constexpr int kD0 = T::kD0, kD1 = T::kD1;
  constexpr int kNT = kBlockN / 8;  // n8 tiles of S (16)
  constexpr int kVT = kDv / 8;      // n8 tiles of O
  constexpr int kCN = fwdw::kD2S1ChunkN;
  constexpr int kPvN = fwdw::kD2PvN;
  constexpr int kPvChunks = kDv / kPvN;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sbase = smem_u32(smem);
  float* sKs = reinterpret_cast<float*>(smem + T::kOffKs);
  float* sVs = reinterpret_cast<float*>(smem + T::kOffVs);
  const uint32_t bar = sbase + T::kOffBar;
  const uint32_t q_full = fwd_bar<kStages>(bar, kQFull, 0);
  auto k_full = [&](int s) { return fwd_bar<kStages>(bar, kKFull, s); };
  auto k_empty = [&](int s) { return fwd_bar<kStages>(bar, kKEmpty, s); };
  auto v_full = [&](int s) { return fwd_bar<kStages>(bar, kVFull, s); };
  auto v_empty = [&](int s) { return fwd_bar<kStages>(bar, kVEmpty, s); };
  auto sK = [&](int s) { return sbase + T::kOffK + s * T::kKBytes; };  // block 1 at + kK0Bytes
  auto sV = [&](int s) { return sbase + T::kOffV + s * T::kVBytes; };

  const int m_tile = gridDim.x - 1 - blockIdx.x;  // NOTE: heaviest causal tiles first
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.num_heads_q / p.num_heads_kv);
  const int Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int nblk_k = (Sk + kBlockN - 1) / kBlockN;
  const int q0 = m_tile * kBlockM;
  const int diag = Sk - Sq;  // causal: key j visible to query i iff j <= i + diag
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + h;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;

  int n_tiles = nblk_k;  // key tiles [0, n_tiles)
  if (p.causal) {
    const int last_key = min(q0 + kBlockM, Sq) - 1 + diag;
    n_tiles = last_key < 0 ? 0 : min(n_tiles, last_key / kBlockN + 1);
  }

  if (tid == 0) fwd_init_bars<kStages>(bar);
  __syncthreads();

  if (wg == 0) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(fwdw::kD2ProducerRegs));
    producer_warpgroup<T>(p, sbase, bar, q0, Sk, n_tiles, nblk_k, bhq, bhk, &tm_q0, &tm_q1, &tm_k0, &tm_k1, &tm_v);
    return;
  }

  // ================= consumer warpgroups =================
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(fwdw::kD2ConsumerRegs));
  const int cw = wg - 1;
  const int t128 = tid - 128 * wg, warp = t128 / 32, lane = t128 & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int row_w0 = q0 + 64 * cw + 16 * warp;  // first query row of this warp
  const int row0 = row_w0 + g;                  // this thread's rows: row0, row0 + 8

  const float scale_log2 = p.softmax_scale * kLog2e;
  float rq[2];  // s_q (head_dim block 0) * tau * log2(e) per row
  float qr[2];  // s_q of head_dim block 1 over block 0 (a power of two, or NaN)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    // NOTE: padding rows (row >= Sq) get rq = 0 and ratio 0; they are never stored.
    const float sq0 = row < Sq ? p.q_row_s[(bhq * Sq + row) * 2] : 0.f;
    const float sq1 = row < Sq ? p.q_row_s[(bhq * Sq + row) * 2 + 1] : 0.f;
    rq[r] = sq0 * scale_log2;
    qr[r] = row < Sq ? sq1 / sq0 : 0.f;
  }

  float o[kDv / 2];
#pragma unroll
  for (int i = 0; i < kDv / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // running row max (log2 domain)
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sum

  const uint32_t sQ0 = sbase + T::kOffQ + cw * 64 * kD0;
  const uint32_t sQ1 = sbase + T::kOffQ + T::kQ0Bytes + cw * 64 * kD1;
  mbar_wait(q_full, 0);

  for (int kt = 0; kt < n_tiles; ++kt) {
    const int s = kt % kStages;
    const uint32_t ph = (kt / kStages) & 1;
    const float* ks0 = sKs + s * 2 * kBlockN;  // s_k of head_dim block 0
    const float* ks1 = ks0 + kBlockN;          // block 1

    // ---- S = t0 * s_k0, then + t1 * s_k1 * (s_q1 / s_q0) per n32 chunk ----
    float sacc[kBlockN / 2], part[kCN / 2];
    mbar_wait(k_full(s), ph);
    fence_acc(sacc);
    cute::warpgroup_arrive();
#pragma unroll
    for (int ks = 0; ks < kD0 / 32; ++ks)
      gmma_ss<kBlockN>(gmma_desc<kD0>(sQ0 + 32 * ks), gmma_desc<kD0>(sK(s) + 32 * ks), sacc, ks > 0,
                       std::make_index_sequence<kBlockN / 2>{});
    cute::warpgroup_commit_batch();
#pragma unroll
    for (int c = 0; c < kBlockN / kCN; ++c) {
      fence_acc(part);
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < kD1 / 32; ++ks)
        gmma_ss<kCN>(gmma_desc<kD1>(sQ1 + 32 * ks), gmma_desc<kD1>(sK(s) + T::kK0Bytes + c * kCN * kD1 + 32 * ks),
                     part, ks > 0, std::make_index_sequence<kCN / 2>{});
      cute::warpgroup_commit_batch();
      if (c == 0) {
        cute::warpgroup_wait<1>();  // t0 complete; chunk 0 of t1 still in flight
        fence_acc(sacc);
#pragma unroll
        for (int j = 0; j < kNT; ++j) {
          const float2 sk = *reinterpret_cast<const float2*>(&ks0[8 * j + 2 * tig]);
          sacc[4 * j + 0] *= sk.x;
          sacc[4 * j + 1] *= sk.y;
          sacc[4 * j + 2] *= sk.x;
          sacc[4 * j + 3] *= sk.y;
        }
      }
      cute::warpgroup_wait<0>();
      fence_acc(part);
#pragma unroll
      for (int i = 0; i < kCN / 8; ++i) {
        const int j = c * (kCN / 8) + i;
        const float2 sk = *reinterpret_cast<const float2*>(&ks1[8 * j + 2 * tig]);
        sacc[4 * j + 0] = fmaf(part[4 * i + 0], sk.x * qr[0], sacc[4 * j + 0]);
        sacc[4 * j + 1] = fmaf(part[4 * i + 1], sk.y * qr[0], sacc[4 * j + 1]);
        sacc[4 * j + 2] = fmaf(part[4 * i + 2], sk.x * qr[1], sacc[4 * j + 2]);
        sacc[4 * j + 3] = fmaf(part[4 * i + 3], sk.y * qr[1], sacc[4 * j + 3]);
      }
    }
    mbar_arrive(k_empty(s));  // this thread is done with K / s_k of stage s (NOTE at fwd_init_bars)

    // ---- mask: keys past seqlen_k, causal ----
    const int key0 = kt * kBlockN;
    const bool need_mask = key0 + kBlockN > Sk || (p.causal && key0 + kBlockN - 1 > row_w0 + diag);
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * j + 2 * tig + (e & 1);
          const int row = row0 + 8 * (e >> 1);
          if (key >= Sk || (p.causal && key > row + diag)) sacc[4 * j + e] = -INFINITY;
        }
    }

    // ---- online softmax, P quantization (as fwd_wgmma_kernel) ----
    float alpha[2], sp[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * r], sacc[4 * j + 2 * r + 1]));
      const SoftmaxRowStep step = softmax_row_step(mx, rq[r], m_run[r]);
      alpha[r] = step.alpha;
      sp[r] = step.sp;
      const float nbias = step.nbias;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
          const float pv = fast_exp2(fmaf(sacc[4 * j + e], rq[r], nbias));  // P / s_p
          sacc[4 * j + e] = pv;
          sum += pv;
        }
      l_run[r] = l_run[r] * alpha[r] + sum * sp[r];
    }
    uint32_t pa[kNT / 4][4];  // S is dead after this: P V runs on the E4M3 codes
#pragma unroll
    for (int st = 0; st < kNT / 4; ++st) {
      const float* x = &sacc[16 * st];  // n8 tiles 4 st .. 4 st + 3
      pa[st][0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
      pa[st][1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
      pa[st][2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
      pa[st][3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
    }

    // ---- O = O * alpha + (P_hat V_hat) * s_p * s_v, kPvN channels per chain ----
    // NOTE: chain c + 1 is issued before chain c is promoted (two fixed
    // partial buffers, selected by the unrolled c: no register moves while a
    // wgmma is in flight).
    float pv[2][kPvN / 2];
    auto pv_issue = [&](int c) {
      fence_acc(pv[c & 1]);
      cute::warpgroup_arrive();
#pragma unroll
      for (int st = 0; st < kNT / 4; ++st)
        gmma_rs<kPvN>(pa[st], gmma_desc<128>(sV(s) + c * kPvN * kBlockN + 32 * st), pv[c & 1], st > 0,
                      std::make_index_sequence<kPvN / 2>{});
      cute::warpgroup_commit_batch();
    };
    mbar_wait(v_full(s), ph);
    pv_issue(0);
#pragma unroll
    for (int c = 0; c < kPvChunks; ++c) {
      if (c + 1 < kPvChunks) {
        pv_issue(c + 1);
        cute::warpgroup_wait<1>();  // chain c complete, chain c + 1 in flight
      } else {
        cute::warpgroup_wait<0>();
      }
      fence_acc(pv[c & 1]);
#pragma unroll
      for (int tc = 0; tc < kPvN / 8; ++tc) {
        const int t = c * (kPvN / 8) + tc;
        const float2 sv = *reinterpret_cast<const float2*>(&sVs[s * kDv + 8 * t + 2 * tig]);
        o[4 * t + 0] = fmaf(pv[c & 1][4 * tc + 0], sp[0] * sv.x, o[4 * t + 0] * alpha[0]);
        o[4 * t + 1] = fmaf(pv[c & 1][4 * tc + 1], sp[0] * sv.y, o[4 * t + 1] * alpha[0]);
        o[4 * t + 2] = fmaf(pv[c & 1][4 * tc + 2], sp[1] * sv.x, o[4 * t + 2] * alpha[1]);
        o[4 * t + 3] = fmaf(pv[c & 1][4 * tc + 3], sp[1] * sv.y, o[4 * t + 3] * alpha[1]);
      }
    }
    mbar_arrive(v_empty(s));  // this thread is done with V / s_v of stage s
  }

  // ---- epilogue: O = acc / l (BF16), LSE (as fwd_wgmma_kernel) ----
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
    __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(p.out) + (bhq * Sq + row) * static_cast<int64_t>(kDv);
#pragma unroll
    for (int t = 0; t < kVT; ++t) {
      const __nv_bfloat162 v2 = __floats2bfloat162_rn(o[4 * t + 2 * r] * inv_l, o[4 * t + 2 * r + 1] * inv_l);
      *reinterpret_cast<__nv_bfloat162*>(out_row + 8 * t + 2 * tig) = v2;
    }
    if (tig == 0) p.lse[bhq * Sq + row] = l == 0.f ? -INFINITY : (m_run[r] + __log2f(l)) * kLn2;
  }
}

// ---- host: tensor maps, launch ------------------------------------------------------

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("fp8attn: run_fwd_wgmma: " + what);
}

// 3-D uint8 tensor [d2][d1][d0] (contiguous), box [1][b1][b0] (tma_map_sm90.h).
CUtensorMap make_map(const void* base, uint64_t d0, uint64_t d1, uint64_t d2, uint32_t b0, uint32_t b1,
                     CUtensorMapSwizzle swizzle, const char* what) {
  return tma::make_map_u8(base, d0, d1, d2, b0, b1, swizzle, what);
}

// (b, h) rows of the query and kv side from a chunk's first row to the end:
// the TMA maps' outermost extent (the kernel's coordinate bhq / bhk is
// chunk-local; launch_sm90.h).
uint64_t rows_q(const KernelParams& p, const AttnChunk& c) {
  return static_cast<uint64_t>(p.batch * static_cast<int64_t>(p.num_heads_q) - (c.b0 * p.num_heads_q + c.hq0));
}
uint64_t rows_kv(const KernelParams& p, const AttnChunk& c) {
  return static_cast<uint64_t>(p.batch * static_cast<int64_t>(p.num_heads_kv) - (c.b0 * p.num_heads_kv + c.hk0));
}

template <int kD, int kDv, int kVariant>
void launch(const KernelParams& p, cudaStream_t stream) {
  using T = WTraits<kD, kDv, consumer_wgs(kVariant)>;
  auto kernel = fwd_wgmma_kernel<kD, kDv, kVariant>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) fail(std::string("cudaFuncSetAttribute failed: ") + cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h).
  launch_attn_chunks(
      p, (p.seqlen_q + T::kBlockM - 1) / T::kBlockM, GridHeads::kQuery, 1, "run_fwd_wgmma",
      [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk& c) {
        const uint64_t bhq = rows_q(p, c), bhk = rows_kv(p, c);
        const CUtensorMapSwizzle swz_qk = kD == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
        const CUtensorMap tm_q = make_map(pc.q_row, kD, p.seqlen_q, bhq, kD, T::kBlockM, swz_qk, "q_row");
        const CUtensorMap tm_k = make_map(pc.k_row, kD, p.seqlen_k, bhk, kD, T::kBlockN, swz_qk, "k_row");
        const CUtensorMap tm_v =
            make_map(pc.v_colT, p.seqlen_k_pad, kDv, bhk, T::kBlockN, kDv, CU_TENSOR_MAP_SWIZZLE_128B, "v_colT");
        kernel<<<dim3(gx, gy, gz), T::kThreads, T::kSmemBytes, stream>>>(pc, tm_q, tm_k, tm_v);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) fail(std::string("launch failed: ") + cudaGetErrorString(e));
      });
}

template <int kD, int kDv>
void launch_d2(const KernelParams& p, cudaStream_t stream) {
  using T = WTraits2<kD, kDv>;
  auto kernel = fwd_wgmma_d2_kernel<kD, kDv>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) fail(std::string("cudaFuncSetAttribute failed: ") + cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h).
  launch_attn_chunks(
      p, (p.seqlen_q + T::kBlockM - 1) / T::kBlockM, GridHeads::kQuery, 1, "run_fwd_wgmma",
      [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk& c) {
        const uint64_t bhq = rows_q(p, c), bhk = rows_kv(p, c);
        // NOTE: one map per head_dim block: the box of block 1 is 64 bytes wide at
        // d = 192 (64B swizzle), and a box row must be one swizzle span.
        const CUtensorMapSwizzle swz1 = T::kD1 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
        const CUtensorMap tm_q0 =
            make_map(pc.q_row, kD, p.seqlen_q, bhq, T::kD0, T::kBlockM, CU_TENSOR_MAP_SWIZZLE_128B, "q_row (block 0)");
        const CUtensorMap tm_q1 = make_map(pc.q_row, kD, p.seqlen_q, bhq, T::kD1, T::kBlockM, swz1, "q_row (block 1)");
        const CUtensorMap tm_k0 =
            make_map(pc.k_row, kD, p.seqlen_k, bhk, T::kD0, T::kBlockN, CU_TENSOR_MAP_SWIZZLE_128B, "k_row (block 0)");
        const CUtensorMap tm_k1 = make_map(pc.k_row, kD, p.seqlen_k, bhk, T::kD1, T::kBlockN, swz1, "k_row (block 1)");
        const CUtensorMap tm_v =
            make_map(pc.v_colT, p.seqlen_k_pad, kDv, bhk, T::kBlockN, kDv, CU_TENSOR_MAP_SWIZZLE_128B, "v_colT");
        kernel<<<dim3(gx, gy, gz), fwdw::kThreads, T::kSmemBytes, stream>>>(pc, tm_q0, tm_q1, tm_k0, tm_k1, tm_v);
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) fail(std::string("launch failed: ") + cudaGetErrorString(e));
      });
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

bool fwd_wgmma_supported(const KernelParams& p) {
  return p.block_size == kSeqBlock && fwdw::supported(p.head_dim_qk, p.head_dim_v) && aligned16(p.q_row) &&
         aligned16(p.k_row) && aligned16(p.v_colT) && p.seqlen_k_pad % kSeqPad == 0;
}

void run_fwd_wgmma(const KernelParams& p, cudaStream_t stream) {
  if (!fwd_wgmma_supported(p)) fail("unsupported configuration (see fwd_wgmma_supported)");
  // Default schedule (kernel doc, "v11", "v1b / v11b"): three warpgroups on
  // the serial schedule at head_dim 64 (+6-11% over pingpong), pingpong at 128
  // (v11 there: 0-6% above, within run-to-run drift, and -5% at 1K tokens from
  // its 192-row tiles).
  // NOTE: FP8ATTN_FWD_KERNEL=wgmma_serial | wgmma_overlap | wgmma_pingpong |
  // wgmma_serial3 picks v1 | v2 | v3 | v11 at head_dim_qk <= 128 instead
  // (benchmarks and tests; measurements in the kernel doc).
  const char* env = std::getenv("FP8ATTN_FWD_KERNEL");
  const std::string which = env != nullptr ? env : "";
  const int variant = which == "wgmma_serial"     ? kSerial
                      : which == "wgmma_overlap"  ? kOverlap
                      : which == "wgmma_serial3"  ? kSerial3
                      : which == "wgmma_pingpong" ? kPingpong
                      : p.head_dim_qk == 64       ? kSerial3
                                                  : kPingpong;
  // NOTE: two head_dim blocks run fwd_wgmma_d2_kernel (one schedule, v1-like).
  if (p.head_dim_qk == 256) return launch_d2<256, 256>(p, stream);
  if (p.head_dim_qk == 192) return launch_d2<192, 128>(p, stream);
  if (p.head_dim_qk == 64) {
    if (variant == kSerial) return launch<64, 64, kSerial>(p, stream);
    if (variant == kOverlap) return launch<64, 64, kOverlap>(p, stream);
    if (variant == kSerial3) return launch<64, 64, kSerial3>(p, stream);
    return launch<64, 64, kPingpong>(p, stream);
  }
  if (variant == kSerial) return launch<128, 128, kSerial>(p, stream);
  if (variant == kOverlap) return launch<128, 128, kOverlap>(p, stream);
  if (variant == kSerial3) return launch<128, 128, kSerial3>(p, stream);
  return launch<128, 128, kPingpong>(p, stream);
}

}  // namespace sm90
}  // namespace fp8attn
