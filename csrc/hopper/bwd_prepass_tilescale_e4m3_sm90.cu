// fp8attn: Delta-Matching pre-pass of the sm_90a `tile`-recipe FP8 backward
// (numerics.md sections 4 and 9): delta_dm_i = sum_j P_ij dP_hat_ij with the
// very P and dP_hat the main kernel (bwd_tilescale_e4m3_sm90.cu) forms: the
// same operands, the same m64n64k32 chains over all of head_dim, the same
// FP32 roundings (mainloop_bwd_tilescale_sm90.cuh). Writes p.delta_dm, and
// p.delta too when delta_mode is delta_matching. Design:
// docs/kernels/bwd_tilescale_e4m3_sm90.md. Two variants (FP8ATTN_TILE_PREPASS_Q,
// default bwdts::kPreQ2Default), both 256 threads = two warpgroups, all of
// which fill shared memory with cp.async (Q / dO rows once, K / V rows per key
// tile), __syncthreads between key tiles; K / V tile scales are read from
// global memory (one scalar each per tile):
//
// v1 (64): one CTA per (64-query tile, query head, batch): both warpgroups see
// the 64 queries, warpgroup wg the keys [64 wg, 64 wg + 64) of each 128-key
// tile (the main kernel's rows). K / V stages: two at head_dim <= 128, one
// above; two CTAs per SM. Each K / V tile is read once per 64 queries: at
// 2x16x8192 d = 128 that is ~4.8 TB/s from L2, about the L2's rate.
//
// v2 (128): one CTA per (128-query tile, query head, batch): warpgroup wg takes
// the queries [64 wg, 64 wg + 64) (the main kernel's sub-tile wg) and walks
// BOTH 64-key halves of each key tile, one after the other, each with the
// main kernel's chain for that half (bitwise the same P and dP_hat; the
// mainloop header's contract note), so the per-query sums complete inside one
// warpgroup and each K / V tile is read once per 128 queries (half of v1's
// L2 traffic). Stages and CTAs per SM: bwdts::pre2_stages / pre2_ctas_per_sm.
// Each CTA walks the key tiles its queries' windows touch (numerics.md section
// 14; causal: from tile 0). A warpgroup skips a key half none of its queries
// sees (causal, a window, ragged seqlen_k, sub-tile past seqlen_q):
// warpgroup-uniform, so its wgmmas stay collective; it changes no sum (a
// masked element adds exact zeros: P = 0 and P dP_hat masked).
//
// kVarlen (a packed batch, varlen_sm90.h): the grid's x runs over the padded
// query tiles of all sequences (v1: two CTAs per 128-row tile), each CTA's
// sequence from the metadata; its lengths, windows and key tiles are the
// sequence's own (a dense call on it alone), its codes and scales at the
// sequence's padded rows (row_q, row_k), LSE and the outputs at its token rows
// (tok_q). A CTA past its sequence's queries, or of a tile no sequence owns,
// has no work and returns at once.
//
// kSoftcap (p.softcap > 0, numerics.md section 12; dense batches, both
// variants): P is p_softcap's (the capped logits), so delta_dm and lse_bwd are
// those of the capped softmax.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/env_choice.h"
#include "hopper/bwd_tilescale_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/mainloop_bwd_tilescale_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace ts {
namespace {

using bwdts::kPreQ;
using bwdts::kPreQ2;
using bwdts::kPreThreads;
using bwdts::kSubQ;

// ---- the fills both variants share -----------------------------------------------------

// Where a pre-pass CTA's sequence lies in the arrays (mainloop_bwd_tilescale_sm90.cuh
// "sequence bounds"): rows per head row (the pointer of head row bh: base +
// bh * rows) of the query-side codes and per-token scales (q_row, do_row,
// q_row_s, do_row_s), of the key-side codes (k_row, v_row), of the per-row
// floats (LSE, delta, delta_dm, lse_bwd) and tiles per head row of the K / V
// scales; the sequence's first row or tile in each is added to the 32-bit
// positions. Dense: the [B, H, S] layouts of kernel_params_sm90.h, offsets 0
// (the kernels' expressions before kVarlen); packed: the padded rows
// (seqlen_*_pad = *_tiles_max * 128 per head, run_bwd checks) and the tokens
// of varlen_sm90.h.
template <bool kVarlen>
struct PrepassRows {
  static __device__ __forceinline__ int64_t q_rows(const KernelParams& p, int Sq) {
    return kVarlen ? static_cast<int64_t>(p.seqlen_q_pad) : static_cast<int64_t>(Sq);
  }
  static __device__ __forceinline__ int64_t k_rows(const KernelParams& p, int Sk) {
    return kVarlen ? static_cast<int64_t>(p.seqlen_k_pad) : static_cast<int64_t>(Sk);
  }
  static __device__ __forceinline__ int64_t q_toks(const KernelParams& p, int Sq) {
    return kVarlen ? static_cast<int64_t>(p.seqlen_q) : static_cast<int64_t>(Sq);
  }
  static __device__ __forceinline__ int64_t k_tiles(const KernelParams& p, int nblk_k) {
    return kVarlen ? static_cast<int64_t>(p.k_tiles_max) : static_cast<int64_t>(nblk_k);
  }
  // The sequence's first row: codes (q_row0, k_row0), per-row floats (q_tok0).
  static __device__ __forceinline__ int q_row0(const SeqInfo& si) { return kVarlen ? static_cast<int>(si.row_q) : 0; }
  static __device__ __forceinline__ int k_row0(const SeqInfo& si) { return kVarlen ? static_cast<int>(si.row_k) : 0; }
  static __device__ __forceinline__ int q_tok0(const SeqInfo& si) { return kVarlen ? static_cast<int>(si.tok_q) : 0; }
};

// Key tile `it` (K, V rows in k_of_row order) into stage it % L::kStages: all
// threads, cp.async (L: the variant's layout, kK / kKStage / kV). Head row
// bhk of k_rows code rows, the sequence's keys from row k_row0 (PrepassRows).
template <class L, int DQK, int DV>
__device__ __forceinline__ void prepass_issue_keys(uint8_t* smem, const KernelParams& p, int64_t bhk, int64_t k_rows,
                                                   int k_row0, int Sk, int it) {
  uint8_t* st = smem + L::kK + (it % L::kStages) * L::kKStage;
  cp_rows<DQK, false, kTile>(st, p.k_row + bhk * k_rows * DQK, k_row0 + it * kTile, k_row0 + Sk);
  cp_rows<DV, false, kTile>(st + L::kV, p.v_row + bhk * k_rows * DV, k_row0 + it * kTile, k_row0 + Sk);
}
// The top of key tile `it` (of the CTA's [.., it_end)): its copies visible to
// every thread (which are done with the other stage); with two stages, tile
// it + 1's copies issued into it.
template <int kStages, class F>
__device__ __forceinline__ void prepass_stage_turn(int it, int it_end, F&& issue_keys) {
  cp_wait<0>();
  fence_async_smem();
  __syncthreads();
  if constexpr (kStages == 2) {
    if (it + 1 < it_end) issue_keys(it + 1);
    cp_commit();
  }
}

// ---- v1: 64 queries per CTA ------------------------------------------------------------

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

template <int DQK, int DV, int FMT, bool kVarlen, bool kSoftcap = false>
__global__ void __launch_bounds__(kPreThreads, 2) bwd_tilescale_prepass_kernel(const KernelParams p) {
  using L = PrepassLayout<DQK, DV>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_aligned_1024(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + L::kF);

  int m_tile = blockIdx.x;
  const int hq = blockIdx.y, b = blockIdx.z;
  SeqInfo si;
  if constexpr (kVarlen) {
    // Two 64-query CTAs per padded 128-row tile; m_tile: the sequence's own.
    si = varlen_seq_info(p, varlen_qtile_seq(p, m_tile / (kTile / kPreQ)));
    m_tile -= static_cast<int>(si.row_q / kPreQ);
  } else {
    si = seq_info(p, b);
  }
  const int Sq = si.seqlen_q, Sk = si.seqlen_k;
  const int group = p.num_heads_q / p.num_heads_kv, hk = hq / group;
  const int nblk_k = (Sk + kTile - 1) / kTile;
  const int m0 = m_tile * kPreQ;
  if (kVarlen && m0 >= Sq) return;  // CTA-uniform: no query of a sequence (padding tile)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wg = warpgroup_uniform();
  const uint32_t d_base = desc_lo(smem);
  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;
  using PR = PrepassRows<kVarlen>;

  TileGeom tg;
  tg.m0 = m0;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = Sk - Sq;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);
  // The key tiles [kt_begin, kt_end) that the CTA's queries see.
  const IndexRange keys = window_keys(m0, m0 + kPreQ, Sq, Sk, p.window_left, p.window_right);
  const int kt_begin = keys.begin / kTile, kt_end = (keys.end + kTile - 1) / kTile;

  auto issue_keys = [&](int it) {
    prepass_issue_keys<L, DQK, DV>(smem, p, bhk, PR::k_rows(p, Sk), PR::k_row0(si), Sk, it);
  };
  // Query side (once) + the first key tile: group 0. NOTE: written out in both
  // variants: as a shared helper it changed the d = 256 instantiations' SASS
  // (address arithmetic), which no GPU has run; prepass_issue_keys is SASS-identical.
  const int q_row0 = PR::q_row0(si);
  cp_rows<DQK, true, kPreQ>(smem + L::kQ, p.q_row + bhq * PR::q_rows(p, Sq) * DQK, q_row0 + m0, q_row0 + Sq);
  cp_rows<DV, true, kPreQ>(smem + L::kDO, p.do_row + bhq * PR::q_rows(p, Sq) * DV, q_row0 + m0, q_row0 + Sq);
  // Per-token scales at code rows, LSE at token rows (the same in a dense batch).
  auto q_idx = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i);
    return r < Sq ? bhq * PR::q_rows(p, Sq) + (q_row0 + r) : -1;
  };
  auto lse_idx = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i);
    return r < Sq ? bhq * PR::q_toks(p, Sq) + (PR::q_tok0(si) + r) : -1;
  };
  cp_floats(sf + L::kQs, p.q_row_s, kPreQ, q_idx);
  cp_floats(sf + L::kDOs, p.do_row_s, kPreQ, q_idx);
  cp_floats(sf + L::kLse, p.lse, kPreQ, lse_idx);
  if (kt_end > kt_begin) issue_keys(kt_begin);
  cp_commit();

  float cs[16];  // per thread: sum over its keys of P * dP_hat; column 8j + 2t + e at [2j + e]
  float cp[16];  // the same of P (the row sums l, prepass_delta_sm90.cuh)
#pragma unroll
  for (int i = 0; i < 16; ++i) cs[i] = cp[i] = 0.f;
  // Softcap constants once (NOTE: formed per key tile, as v2 does, d = 256 spilled 4 bytes).
  Softcap sc{};
  if constexpr (kSoftcap) sc = softcap_consts(p.softcap);

  for (int it = kt_begin; it < kt_end; ++it) {
    prepass_stage_turn<L::kStages>(it, kt_end, issue_keys);
    const int st = it % L::kStages;
    const int n0 = it * kTile;
    tg.n0 = n0;
    const bool interior = n0 + kTile <= Sk && m0 + kPreQ <= Sq &&
                          window_covers(n0, kTile, m0, kPreQ, tg.causal_off, p.window_left, p.window_right);
    const uint32_t k_lo = d_base + (L::kK + st * L::kKStage) / 16 + wg * kDesc64Rows;
    const uint32_t v_lo = k_lo + L::kV / 16;
    const int64_t ks = bhk * PR::k_tiles(p, nblk_k) + (PR::k_row0(si) / kTile + it);
    const float s_k = p.k_row_s[ks], s_v = p.v_row_s[ks];

    // The main kernel's instructions and roundings: P and dP_hat bitwise equal.
    float pt[8][4], dp[8][4];
    issue_s<DQK, kPreQ, kPreQ>(k_lo, d_base + L::kQ / 16, pt);
    issue_dp<DV, FMT, kPreQ, kPreQ>(v_lo, d_base + L::kDO / 16, dp);
    wg_wait<1>();
    if constexpr (kSoftcap) {
      p_from_s<kPreQ, true>(pt, softcap_kc(__fmul_rn(s_k, tg.c2), sc), sf + L::kQs, sf + L::kLse, lane, sc);
    } else {
      p_from_s<kPreQ>(pt, __fmul_rn(s_k, tg.c2), sf + L::kQs, sf + L::kLse, lane);
    }
    if (!interior) mask_tile<kPreQ>(pt, tg, warp, lane, p.window_left, p.window_right);
    wg_wait<0>();
    dp_scale<kPreQ>(dp, s_v, sf + L::kDOs, lane);
    if constexpr (L::kStages == 1) {
      __syncthreads();  // every warpgroup's wgmmas on the stage completed: refill it
      if (it + 1 < kt_end) issue_keys(it + 1);
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
    if (!interior) mask_tile<kPreQ>(dp, tg, warp, lane, p.window_left, p.window_right);  // P = 0 there, but dP_hat may be NaN
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& c = cs[2 * j + (e & 1)];
        c = __fadd_rn(c, dp[j][e]);
      }
  }
  cp_wait<0>();

  prepass_store_delta<kPreQ, kPreThreads>(cs, cp, sf + L::kRed, sf + L::kRedP, warp, lane, m0, Sq, bhq,
                                          PR::q_toks(p, Sq), PR::q_tok0(si), p);
}

// ---- v2: 128 queries per CTA ----------------------------------------------------------

template <int DQK, int DV>
struct Prepass2Layout {
  static constexpr int kNbQK = nb_of<DQK>(), kNbV = nb_of<DV>();
  static constexpr int kStages = bwdts::pre2_stages(DQK, DV);
  static constexpr int kCtasPerSm = bwdts::pre2_ctas_per_sm(DQK, DV);
  static constexpr int kKStage = (kNbQK + kNbV) * kTileBytes;  // bytes of one key stage: K rows, then V rows
  // The main kernel's query-side row tiles: [block][128][128 B], q_of_col order.
  static constexpr int kQ = 0;                          // query rows
  static constexpr int kDO = kQ + kNbQK * kTileBytes;   // dO rows
  static constexpr int kK = kDO + kNbV * kTileBytes;    // [stages] key rows (k_of_row order), value rows
  static constexpr int kV = kNbQK * kTileBytes;         //   (value rows at kK + st * kKStage + kV)
  static constexpr int kF = kK + kStages * kKStage;
  // floats from kF: per column (q_of_col order, 128) Q and dO row scales, LSE; the reduction.
  static constexpr int kQs = 0, kDOs = kQs + kPreQ2, kLse = kDOs + kPreQ2, kRed = kLse + kPreQ2;
  static constexpr int kRedP = kRed + kWarps * 64;  // the P row sums' partials
  static constexpr int kFloats = kRedP + kWarps * 64;
  static constexpr int kBytes = kF + 4 * kFloats + 1024;  // + alignment slack
  static_assert(kQ % 1024 == 0 && kDO % 1024 == 0 && kK % 1024 == 0 && kKStage % 1024 == 0, "1024-byte swizzle atoms");
  static_assert(kNbQK + kNbV == bwdts::pre2_tiles(DQK, DV), "the config's tile count");
  // 228 KB of shared memory per SM, 1 KB of it reserved per CTA.
  static_assert(kCtasPerSm * (kBytes + 1024) <= 228 * 1024 && kBytes <= 227 * 1024, "CTAs per SM");
};

// NOTE: register budget of v2 at two CTAs per SM is v1's (128): one key half
// in flight per warpgroup (S^T, dP^T: 32 + 32 accumulator registers, the 32
// sums); both halves in flight would need 64 more.
template <int DQK, int DV, int FMT, bool kVarlen, bool kSoftcap = false>
__global__ void __launch_bounds__(kPreThreads, bwdts::pre2_ctas_per_sm(DQK, DV))
    bwd_tilescale_prepass_q128_kernel(const KernelParams p) {
  using L = Prepass2Layout<DQK, DV>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_aligned_1024(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + L::kF);

  int m_tile = blockIdx.x;
  const int hq = blockIdx.y, b = blockIdx.z;
  SeqInfo si;
  if constexpr (kVarlen) {
    // One CTA per padded 128-row tile; m_tile: the sequence's own.
    si = varlen_seq_info(p, varlen_qtile_seq(p, m_tile));
    m_tile -= static_cast<int>(si.row_q / kPreQ2);
  } else {
    si = seq_info(p, b);
  }
  const int Sq = si.seqlen_q, Sk = si.seqlen_k;
  const int group = p.num_heads_q / p.num_heads_kv, hk = hq / group;
  const int nblk_k = (Sk + kTile - 1) / kTile;
  const int m0 = m_tile * kPreQ2;
  if (kVarlen && m0 >= Sq) return;  // CTA-uniform: a tile no sequence owns
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wg = warpgroup_uniform(), w4 = warp & 3;
  const uint32_t d_base = desc_lo(smem);
  const int64_t bhq = static_cast<int64_t>(b) * p.num_heads_q + hq;
  const int64_t bhk = static_cast<int64_t>(b) * p.num_heads_kv + hk;
  using PR = PrepassRows<kVarlen>;
  const int causal_off = Sk - Sq;

  const int wl = p.window_left, wr = p.window_right;
  // The CTA's key tiles [kt_begin, kt_end): those any of its 128 queries sees.
  const IndexRange keys = window_keys(m0, m0 + kPreQ2, Sq, Sk, wl, wr);
  const int kt_begin = keys.begin / kTile, kt_end = (keys.end + kTile - 1) / kTile;
  // This warpgroup's sub-tile: queries [m0s, m0s + 64); keys outside keys_wg
  // are masked for all of them (empty: the sub-tile is past seqlen_q or sees
  // no key).
  const int m0s = m0 + kSubQ * wg;
  const IndexRange keys_wg = window_keys(m0s, m0s + kSubQ, Sq, Sk, wl, wr);
  TileGeom tg;
  tg.m0 = m0s;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = causal_off;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);

  auto issue_keys = [&](int it) {
    prepass_issue_keys<L, DQK, DV>(smem, p, bhk, PR::k_rows(p, Sk), PR::k_row0(si), Sk, it);
  };
  // Query side (once: the main kernel's stage layout) + the first key tile: group 0.
  const int q_row0 = PR::q_row0(si);
  cp_rows<DQK, true, kPreQ2>(smem + L::kQ, p.q_row + bhq * PR::q_rows(p, Sq) * DQK, q_row0 + m0, q_row0 + Sq);
  cp_rows<DV, true, kPreQ2>(smem + L::kDO, p.do_row + bhq * PR::q_rows(p, Sq) * DV, q_row0 + m0, q_row0 + Sq);
  // Per-token scales at code rows, LSE at token rows (the same in a dense batch).
  auto q_idx = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i);
    return r < Sq ? bhq * PR::q_rows(p, Sq) + (q_row0 + r) : -1;
  };
  auto lse_idx = [&](int i) -> int64_t {
    const int r = m0 + q_of_col(i);
    return r < Sq ? bhq * PR::q_toks(p, Sq) + (PR::q_tok0(si) + r) : -1;
  };
  cp_floats(sf + L::kQs, p.q_row_s, kPreQ2, q_idx);
  cp_floats(sf + L::kDOs, p.do_row_s, kPreQ2, q_idx);
  cp_floats(sf + L::kLse, p.lse, kPreQ2, lse_idx);
  if (kt_end > kt_begin) issue_keys(kt_begin);
  cp_commit();

  // This sub-tile's per-column floats (the main kernel's Fs + L::kSQs etc.).
  const float* sQs = sf + L::kQs + kSubQ * wg;
  const float* sDOs = sf + L::kDOs + kSubQ * wg;
  const float* sLse = sf + L::kLse + kSubQ * wg;

  float cs[16];  // per thread: sum over its keys of P * dP_hat; column 8j + 2t + e at [2j + e]
  float cp[16];  // the same of P (the row sums l, prepass_delta_sm90.cuh)
#pragma unroll
  for (int i = 0; i < 16; ++i) cs[i] = cp[i] = 0.f;

  for (int it = kt_begin; it < kt_end; ++it) {
    prepass_stage_turn<L::kStages>(it, kt_end, issue_keys);
    const int st = it % L::kStages;
    const int n0 = it * kTile;
    const int64_t ks = bhk * PR::k_tiles(p, nblk_k) + (PR::k_row0(si) / kTile + it);
    const float s_k = p.k_row_s[ks], s_v = p.v_row_s[ks];
    // Softcap: kc2 (p_softcap's coefficient, the main kernel's producer forms the same).
    // NOTE: the constants per key tile here (formed before the loop, d = 256 took 157
    // registers, not 136; v1 the other way round: 4 bytes of spill at d = 256 per tile).
    const Softcap sc = kSoftcap ? softcap_consts(p.softcap) : Softcap{};
    const float kc = kSoftcap ? softcap_kc(__fmul_rn(s_k, tg.c2), sc) : __fmul_rn(s_k, tg.c2);
    // Descriptor bases from an opaque copy of the shared base (the main kernel's NOTE).
    const uint32_t base = opaque_u32(d_base);
    const uint32_t q_lo = base + L::kQ / 16 + wg * kDesc64Rows, do_lo = base + L::kDO / 16 + wg * kDesc64Rows;
    const uint32_t st_lo = base + (L::kK + st * L::kKStage) / 16;

    // Key half h = the main kernel's warpgroup h: its keys [n0 + 64 h, n0 + 64 h + 64).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int nh = n0 + 64 * h;
      // warpgroup-uniform: some query of the sub-tile sees a key of the half
      const bool run = nh < keys_wg.end && nh + 64 > keys_wg.begin;
      float pt[8][4], dp[8][4];
      if (run) {
        tg.n0 = n0;
        // Every (key, query) of the 64 x 64 block is visible: no masks.
        const bool interior =
            nh + 64 <= Sk && m0s + kSubQ <= Sq && window_covers(nh, 64, m0s, kSubQ, causal_off, wl, wr);
        const uint32_t k_lo = st_lo + h * kDesc64Rows, v_lo = k_lo + L::kV / 16;
        // The main kernel's instructions and roundings: P and dP_hat bitwise equal.
        issue_s<DQK, kSubQ, kTile>(k_lo, q_lo, pt);
        issue_dp<DV, FMT, kSubQ, kTile>(v_lo, do_lo, dp);
        wg_wait<1>();
        p_from_s<kSubQ, kSoftcap>(pt, kc, sQs, sLse, lane, sc);
        if (!interior) mask_tile<kSubQ>(pt, tg, 4 * h + w4, lane, p.window_left, p.window_right);  // rows of main-kernel warp 4 h + w4
        wg_wait<0>();
        dp_scale<kSubQ>(dp, s_v, sDOs, lane);
        if (!interior) mask_tile<kSubQ>(dp, tg, 4 * h + w4, lane, p.window_left, p.window_right);  // P = 0 there, but dP_hat may be NaN
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& l = cp[2 * j + (e & 1)];
            l = __fadd_rn(l, pt[j][e]);  // P is 0 where masked (mask_tile)
          }
      }
      if constexpr (L::kStages == 1) {
        if (h == 1) {
          __syncthreads();  // every warpgroup's wgmmas on the stage completed: refill it
          if (it + 1 < kt_end) issue_keys(it + 1);
          cp_commit();
        }
      }
      if (run) {
        // NOTE: sum P dP_hat by FMA (v1: a rounded product, then the add): P and
        // dP_hat are the contract's, the rounding of the row sum is free (it is
        // not bitwise v1's either way: v2 sums in another order); one
        // instruction less per element.
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& c = cs[2 * j + (e & 1)];
            c = fmaf(pt[j][e], dp[j][e], c);
          }
      }
    }
  }
  cp_wait<0>();

  prepass_store_delta<kPreQ2, kPreThreads, 2>(cs, cp, sf + L::kRed, sf + L::kRedP, warp, lane, m0, Sq, bhq,
                                              PR::q_toks(p, Sq), PR::q_tok0(si), p);
}

template <class L, class K>
void launch_prepass_kernel(const KernelParams& p, K kernel, int queries_per_cta, cudaStream_t stream) {
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: bwd tile pre-pass: cudaFuncSetAttribute failed: ") +
                             cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h;
  // a packed batch is one launch: run_bwd checks its heads <= 65535). Packed:
  // the padded query tiles of all sequences (varlen_sm90.h).
  const int64_t n_m = p.num_seqs > 0 ? int64_t{p.q_tiles_max} * (kTile / queries_per_cta)
                                     : (p.seqlen_q + queries_per_cta - 1) / queries_per_cta;
  launch_attn_chunks(p, n_m, GridHeads::kQuery, 1, "bwd tile pre-pass",
                     [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                       kernel<<<dim3(gx, gy, gz), kPreThreads, L::kBytes, stream>>>(pc);
                       const cudaError_t e = cudaGetLastError();
                       if (e != cudaSuccess)
                         throw std::runtime_error(std::string("fp8attn: bwd tile pre-pass launch failed: ") +
                                                  cudaGetErrorString(e));
                     });
}

}  // namespace

void launch_tilescale_prepass(const KernelParams& p, cudaStream_t stream) {
  // NOTE: FP8ATTN_TILE_PREPASS_Q=64|128 picks v1 / v2 (queries per CTA; default
  // bwdts::kPreQ2Default; a bad value throws std::invalid_argument, ValueError in
  // Python), read at every call so one process can time both.
  const int env = env_choice("FP8ATTN_TILE_PREPASS_Q", {"64", "128"});
  const bool v2 = env < 0 ? bwdts::kPreQ2Default : env == 1;
  dispatch_shapes(p, [&](auto dqk, auto dv, auto fmt) {
    constexpr int DQK = decltype(dqk)::value, DV = decltype(dv)::value, FMT = decltype(fmt)::value;
    // A packed batch: the kVarlen instantiations (the dense kernels stay free
    // of the metadata reads).
    const bool vl = p.num_seqs > 0;
    // Softcap (numerics.md section 12): dense only (run_bwd refuses a packed
    // batch), both variants.
    const bool sc = p.softcap > 0.f;
    if (v2) {
      auto kernel = sc   ? bwd_tilescale_prepass_q128_kernel<DQK, DV, FMT, false, true>
                    : vl ? bwd_tilescale_prepass_q128_kernel<DQK, DV, FMT, true>
                         : bwd_tilescale_prepass_q128_kernel<DQK, DV, FMT, false>;
      launch_prepass_kernel<Prepass2Layout<DQK, DV>>(p, kernel, kPreQ2, stream);
    } else {
      auto kernel = sc   ? bwd_tilescale_prepass_kernel<DQK, DV, FMT, false, true>
                    : vl ? bwd_tilescale_prepass_kernel<DQK, DV, FMT, true>
                         : bwd_tilescale_prepass_kernel<DQK, DV, FMT, false>;
      launch_prepass_kernel<PrepassLayout<DQK, DV>>(p, kernel, kPreQ, stream);
    }
  });
}

}  // namespace ts
}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
