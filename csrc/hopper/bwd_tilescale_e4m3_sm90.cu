// fp8attn: sm_90a main kernel of the `tile`-recipe FP8 backward (numerics.md
// sections 3-5 and 9): dK, dV and the dQ partials of one 128-key tile. The
// pieces of a tile pair (and where each scale is folded in) are in
// mainloop_bwd_tilescale_sm90.cuh; the Delta-Matching delta comes from
// bwd_prepass_tilescale_e4m3_sm90.cu; run_bwd (bwd_e4m3_blockscale_sm90.cu)
// runs pre-pass, row delta, this kernel, the dQ convert and the diagnostics.
// Design, floor and what is unvalidated: docs/kernels/bwd_tilescale_e4m3_sm90.md.
//
// One CTA per (128-key tile, kv head x output slice, batch); it walks the GQA
// group's query heads and the query tiles that see its keys (tile pairs).
// Warp specialization (config_sm90.h, bwdts):
//   * producer warpgroup (threads 256..383, setmaxnreg down to 24): cp.async
//     fills of the key side once (K, V rows, this slice's K^T columns) and of
//     each tile pair's query side into an mbarrier ring of kStages stages
//     (Q, dO rows in q_of_col order; this slice's Q^T, dO^T columns) and
//     the per-query coefficients p_c, p_l2, dp_c and delta (warp 3, formed
//     once per stage, mainloop_bwd_tilescale_sm90.cuh p_coef). full[s]: 128
//     cp.async arrive-ons + warp 3's 32 arrivals after its stores; empty[s]:
//     256 consumer arrivals.
//   * two consumer warpgroups (threads 0..255, setmaxnreg up to 240), warp w
//     owning key rows [16w, 16w + 16), i.e. warpgroup wg the 64 keys
//     [64 wg, 64 wg + 64) of the tile, walking each stage's 128 queries in two
//     64-query sub-tiles (FlashAttention-3's 64 x 128 iteration). v5: the two
//     warpgroups never sync with each other (numerics.md section 9: the P / dS
//     blocks are 64 x 64 and the #6 dS scale is per 64-key half, so every
//     exchange stays inside a warpgroup: its own named barrier kBarWg + wg,
//     three syncs per sub-tile plus one per extra dQ panel); they drift up to
//     a stage apart, so one's elementwise work runs under the other's wgmmas:
//       S^T = K Q^T, dP^T = V dO^T      (SS m64n64k32, both in flight)       #3, #4
//       P = exp2(...), dS = P (dP_hat - delta) (P kept)
//       P / dS block amax (64 x 64), dS row amax (64 keys)
//       dV += P^T dO, dK += dS^T Q       (RS from the codes in registers,
//                                         accumulators in units of 2^e)       #5, #7
//       dS codes [q][k] in the warpgroup's half of shared memory             #6 operand
//       dQ partial = dS K over its 64 keys (SS, every 64-column panel of the
//       slice in turn), times s_dS(i, half) s_K per row -> the warpgroup's
//       shared FP32 panel -> one TMA bulk reduce-add per panel into dq_accum
//       (chunk order, kernel_params_sm90.h dq_accum_rows; both warpgroups add
//       into the same chunk)                                                 #6
// Slices (head_dim > 128): CTA slice s owns dK / dQ / dV columns [128 s,
// 128 s + 128) and recomputes S, P, dP, dS (their sums run over all of head_dim).
// kVarlen (a packed batch, varlen_sm90.h): blockIdx.x runs over the padded key
// tiles of all sequences; the CTA's sequence comes from the metadata and
// everything else is a dense call on that sequence alone (its lengths, window,
// query tiles), addressed at the sequence's padded rows in the codes, scales
// and dq_accum and at its token rows in LSE, delta, the diagnostics and the
// token-major dK / dV (mainloop_bwd_tilescale_sm90.cuh "sequence bounds"). A
// tile no sequence owns is an empty sequence: no iterations, nothing written.
#include <cuda_bf16.h>
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

using bwdts::kConsumerThreads;
using bwdts::kProducerThreads;
using bwdts::kSubQ;

template <int DQK, int DV>
struct MainLayout {
  static constexpr int kNbQK = nb_of<DQK>(), kNbV = nb_of<DV>();
  static constexpr int kSlices = bwdts::slices(DQK, DV);
  static constexpr bool kSliced = kSlices > 1;
  static constexpr int kWk = kSliced ? bwdts::kSliceCols : DQK;  // dK / dQ columns per CTA (at most)
  static constexpr int kWv = kSliced ? bwdts::kSliceCols : DV;   // dV columns per CTA (at most)
  static constexpr int kStages = bwdts::stages(DQK, DV);
  // bytes (every tile 1024-aligned)
  static constexpr int kK = 0;                        // key rows (k_of_row order) [block][128][128 B]
  static constexpr int kV = kK + kNbQK * kTileBytes;  // value rows
  static constexpr int kKc = kV + kNbV * kTileBytes;  // K^T [kWk channels][128 keys] (this slice)
  static constexpr int kDS = kKc + kWk * 128;         // dS codes (#6) of one sub-tile [64 queries][128 keys]
  static constexpr int kStage0 = kDS + bwdts::kSubQ * 128;  // [kStages] query-side stages:
  static constexpr int kSQ = 0;                       //   query rows (q_of_col order) [block][128][128 B]
  static constexpr int kSDO = kSQ + kNbQK * kTileBytes;  // dO rows
  static constexpr int kSQc = kSDO + kNbV * kTileBytes;  // Q^T [kWk][128 queries]
  static constexpr int kSDOc = kSQc + kWk * 128;         // dO^T [kWv][128 queries]
  static constexpr int kStageBytes = kSDOc + kWv * 128;
  // dQ staging (#6 partials, FP32): one 64 x 64 panel per consumer warpgroup in
  // dq_accum's chunk order (kernel_params_sm90.h), added to global memory by a
  // TMA bulk reduce-add.
  static constexpr int kDQ = kStage0 + kStages * kStageBytes;
  static constexpr int kDQPanelFloats = bwdts::kSubQ * 64;
  static constexpr int kF = kDQ + bwdts::kConsumerWGs * kDQPanelFloats * 4;
  // floats from kF
  static constexpr int kBar = 0;                       // mbarriers (8 bytes): full[s], empty[s], kv_full
  static constexpr int kNumBars = 2 * kStages + 1;
  static constexpr int kAmax = kBar + 16;                     // [8 warps][64 columns]: #6 row amax per warp
  static constexpr int kBlk = kAmax + kWarps * bwdts::kSubQ;  // [2][8 warps]: P, dS block amax per warp
  static constexpr int kRowInv = kBlk + 16;  // [2 warpgroups][64 columns]: 1 / s_dS(q, half) (#6)
  static constexpr int kRowSq = kRowInv + bwdts::kConsumerWGs * bwdts::kSubQ;  // [2][64 queries, natural order]
  static constexpr int kFStage = kRowSq + bwdts::kConsumerWGs * bwdts::kSubQ;  // [kStages] per-stage floats, per column (q_of_col):
  // p_c, p_l2, dp_c (mainloop_bwd_tilescale_sm90.cuh p_coef / p_lse2 / dp_coef,
  // formed by the producer once per stage) and delta.
  static constexpr int kFPc = 0, kFPl2 = kTile, kFDPc = 2 * kTile, kFDelta = 3 * kTile;
  static constexpr int kFStageFloats = 4 * kTile;
  static constexpr int kFloats = kFStage + kStages * kFStageFloats;
  static constexpr int kBytes = kF + 4 * kFloats + 1024;  // + alignment slack
  static_assert(kNumBars * 2 <= 16, "mbarrier slots");
  static_assert(kKc % 1024 == 0 && kDS % 1024 == 0 && kStage0 % 1024 == 0 && kStageBytes % 1024 == 0 &&
                    kSQc % 1024 == 0 && kSDOc % 1024 == 0,
                "1024-byte aligned swizzled tiles");
  static_assert(kWk % 64 == 0 && kWv % 64 == 0, "whole n64 output chunks");
  static_assert(kBytes <= 227 * 1024, "shared memory of one CTA");
};

// What one main-kernel CTA works on (from blockIdx; the kernel's top note).
// NOTE: the producer computes its own copy after its setmaxnreg (values
// computed before the split and live in both branches were spilled: the
// producer holds 24 registers); the consumers' copy is computed before it.
// n_tile, n0, Sq, Sk, m_first, m_end: the sequence's own (a packed batch's
// padded key tile minus its sequence's first); tok_q .. row_k: the sequence's
// offsets (SeqInfo; zero in a dense batch, where the kernel does not use them).
struct CtaWork {
  int n_tile, hk, b, slice, cb, wk, wv, Sq, Sk, group, nblk_q, nblk_k, n0, causal_off, m_first, m_end, n_iters;
  int64_t Sq64, Sk64, bhk;
  int tok_q, tok_k, row_q, row_k;
};
// blockIdx through a volatile read (kOpaque: the producer's copy, so the
// compiler cannot merge it with the consumers' and keep it live in both branches).
template <bool kOpaque>
__device__ __forceinline__ uint32_t ctaid(int dim) {
  if constexpr (!kOpaque) return dim == 0 ? blockIdx.x : dim == 1 ? blockIdx.y : blockIdx.z;
  uint32_t r;
  if (dim == 0)
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(r));
  else if (dim == 1)
    asm volatile("mov.u32 %0, %%ctaid.y;\n" : "=r"(r));
  else
    asm volatile("mov.u32 %0, %%ctaid.z;\n" : "=r"(r));
  return r;
}
// kReverse (the deterministic instantiations): key tile gridDim.x - 1 - blockIdx.x,
// so the CTAs of the higher key tiles are dispatched first (the dQ turns, below).
template <class L, int DQK, int DV, bool kVarlen, bool kOpaque = false, bool kReverse = false>
__device__ __forceinline__ CtaWork cta_work(const KernelParams& p) {
  CtaWork w;
  const uint32_t y = ctaid<kOpaque>(1);
  w.n_tile = kReverse ? static_cast<int>(gridDim.x - 1 - ctaid<kOpaque>(0)) : static_cast<int>(ctaid<kOpaque>(0));
  w.hk = y / L::kSlices;
  w.b = ctaid<kOpaque>(2);
  w.slice = static_cast<int>(y % L::kSlices);
  w.cb = bwdts::kSliceCols * w.slice;  // output columns: dK / dQ [cb, cb + wk), dV [cb, cb + wv)
  // NOTE: compile-time where every slice is full (d = 256: both 128 wide), so
  // the sliced kernel's chunk conditions fold away.
  w.wk = !L::kSliced ? DQK : DQK % bwdts::kSliceCols == 0 && DQK == L::kSlices * bwdts::kSliceCols
                                 ? L::kWk
                                 : max(0, min(L::kWk, DQK - w.cb));
  w.wv = !L::kSliced ? DV : DV % bwdts::kSliceCols == 0 && DV == L::kSlices * bwdts::kSliceCols
                                ? L::kWv
                                : max(0, min(L::kWv, DV - w.cb));
  SeqInfo si;
  if constexpr (kVarlen) {
    // The padded key tile's sequence (-1: none, an empty sequence).
    si = varlen_seq_info(p, varlen_ktile_seq(p, w.n_tile));
    w.n_tile -= static_cast<int>(si.row_k / kTile);
  } else {
    si = seq_info(p, w.b);
  }
  w.Sq = si.seqlen_q;
  w.Sk = si.seqlen_k;
  // NOTE: zero-extended copies for the 64-bit offsets (both >= 0): a sign
  // extension's high word was a value live across the loop (spilled).
  w.Sq64 = static_cast<uint32_t>(w.Sq);
  w.Sk64 = static_cast<uint32_t>(w.Sk);
  w.tok_q = static_cast<int>(si.tok_q);
  w.tok_k = static_cast<int>(si.tok_k);
  w.row_q = static_cast<int>(si.row_q);
  w.row_k = static_cast<int>(si.row_k);
  w.group = p.num_heads_q / p.num_heads_kv;
  w.nblk_q = (w.Sq + kTile - 1) / kTile;
  w.nblk_k = (w.Sk + kTile - 1) / kTile;
  w.n0 = w.n_tile * kTile;
  w.bhk = static_cast<int64_t>(static_cast<uint32_t>(w.b * p.num_heads_kv + w.hk));
  // Query tiles that see this key tile under the window (numerics.md section
  // 14; causal: [first that sees key n0, nblk_q)): [m_first, m_end) of every
  // head of the group; none (n_iters = 0: dK = dV = 0) when no query sees it.
  w.causal_off = w.Sk - w.Sq;
  const IndexRange mt = query_tiles_of_key_tile(w.n_tile, kTile, w.Sq, w.Sk, p.window_left, p.window_right);
  w.m_first = mt.begin;
  w.m_end = mt.end;
  w.n_iters = w.group * (w.m_end - w.m_first);
  return w;
}

// Where the CTA's sequence lies in the arrays (mainloop_bwd_tilescale_sm90.cuh
// "sequence bounds"): the rows per head row of an array (the pointer of head
// row bh: base + bh * rows) and the sequence's first row in it, added to the
// 32-bit positions within the sequence. Dense: the [B, H, S] rows of
// kernel_params_sm90.h at offset 0 (the kernel's expressions before kVarlen).
// Packed: the padded rows and tiles (seqlen_*_pad = *_tiles_max * 128 per
// head, checked by run_bwd) and the token rows of varlen_sm90.h.
// NOTE: the offsets stay 32-bit, added to the positions (fill_rows /
// fill_cols' s0 and S, the scale and dq_accum indices): as 64-bit parts of
// the base addresses a packed batch's kernels spilled 4 bytes more at d >= 192
// in the serial issue order (nvcc 13.0).
template <bool kVarlen>
struct SeqRows {
  // Codes and per-token scales: q_row, do_row, q_row_s, do_row_s (and the
  // padded rows of dq_accum); k_row, v_row. Positions in q_colT / do_colT /
  // k_colT are these rows too.
  static __device__ __forceinline__ int64_t q_rows(const KernelParams& p, const CtaWork& w) {
    return kVarlen ? static_cast<int64_t>(p.seqlen_q_pad) : w.Sq64;
  }
  static __device__ __forceinline__ int64_t k_rows(const KernelParams& p, const CtaWork& w) {
    return kVarlen ? static_cast<int64_t>(p.seqlen_k_pad) : w.Sk64;
  }
  static __device__ __forceinline__ int q_row0(const CtaWork& w) { return kVarlen ? w.row_q : 0; }
  static __device__ __forceinline__ int k_row0(const CtaWork& w) { return kVarlen ? w.row_k : 0; }
  // Token rows: LSE, delta, rowsum_ws.
  static __device__ __forceinline__ int64_t q_toks(const KernelParams& p, const CtaWork& w) {
    return kVarlen ? static_cast<int64_t>(p.seqlen_q) : w.Sq64;
  }
  // Scale index of the CTA's key tile (k_row_s, v_row_s: one per tile).
  static __device__ __forceinline__ int64_t k_tile(const KernelParams& p, const CtaWork& w) {
    return kVarlen ? w.bhk * p.k_tiles_max + (w.row_k / kTile + w.n_tile) : w.bhk * w.nblk_k + w.n_tile;
  }
  // Scale index of the sequence's query tile m_tile of head row bhq (q_col_s, do_col_s).
  static __device__ __forceinline__ int64_t q_tile(const KernelParams& p, const CtaWork& w, int64_t bhq, int m_tile) {
    return kVarlen ? bhq * p.q_tiles_max + (w.row_q / kTile + m_tile) : bhq * w.nblk_q + m_tile;
  }
  // NOTE: the consumers' token offsets (diagnostics, dK / dV) are read again
  // from the metadata where used (the opaque ctaid keeps the compiler from
  // reusing cta_work's loads): CtaWork's tok_q / tok_k, live across the loop,
  // were spilled at d >= 192.
  static __device__ __forceinline__ SeqInfo reread(const KernelParams& p) {
    return varlen_seq_info(p, varlen_ktile_seq(p, ctaid<true>(0)));
  }
  // Token row of the sequence's query 0 of head row bhq (the consumers').
  static __device__ __forceinline__ int64_t q_tok0(const KernelParams& p, const CtaWork& w, int64_t bhq) {
    return kVarlen ? bhq * p.seqlen_q + static_cast<int>(reread(p).tok_q) : bhq * w.Sq64;
  }
};

// kPingpong (FP8ATTN_TILE_BWD_PINGPONG=1): the two consumer warpgroups take
// turns to issue their S^T / dP^T chains (FlashAttention-3's pingpong order:
// named barriers kBarPingpong + wg), so one's elementwise work is pinned
// under the other's wgmmas; without it the tensor core's own serialization
// sets their offset.
// kSoftcap: logit softcapping, p.softcap > 0 (numerics.md section 12; dense,
// default order only: launch_tilescale_main). P is p_softcap's (the producer's
// p_c is kc2's), the cap's derivative is kept per element from P to dS
// (p_from_coefs_softcap, cap_grad; mainloop_bwd_tilescale_sm90.cuh).
// ---- deterministic dQ (KernelParams::dq_sem; kDeterministic instantiations) ----
//
// The dQ partials of a 64-query sub-tile come from the warpgroups of every CTA whose
// key tile the sub-tile's queries see: key tiles [n_lo, n_hi] (contiguous: a CTA's
// query tiles [m_first(n), m_end(n)) move forward with n under every mask), two
// warpgroups each. Turn t = 2 (n_hi - n) + wg adds when the sub-tile's counter reads
// t (acquire), its bulk reduce-adds complete, then counter + 1 (release): the adds
// of every dq_accum element happen in the order of t, so dQ is the same bit for bit
// from run to run.
// Descending key tiles: the CTA of key tile n walks query tiles from m_first(n),
// which grows with n (causal, windows), so it reaches query tile m after
// m - m_first(n) steps: the higher key tiles arrive first, and the turns go in the
// order of arrival (ascending turns made every CTA wait for key tile n_lo's, which
// arrives last: 2.3x the default's time causal at 8K on an H100, docs/benchmarks.md
// 2026-12-07 19:30). Without a mask all arrive together and the order is free.
// No deadlock: the grid runs key tiles in reverse (cta_work kReverse), so turn t's
// CTA was dispatched before turn t + 2's (CTAs are dispatched in blockIdx order)
// and every CTA walks its query tiles in the same order (query head, then tile):
// the earliest-dispatched unfinished CTA waits for no one.
// The first turn: last_key_tile_of (kernel_params_sm90.h, host-tested).
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

template <int DQK, int DV, int FMT, bool kPingpong, bool kVarlen, bool kSoftcap = false, bool kDeterministic = false>
__global__ void __launch_bounds__(bwdts::kThreads, 1) bwd_tilescale_main_kernel(const KernelParams p) {
  static_assert(!(kDeterministic && kVarlen), "the deterministic backward is dense-only (varlen_attention loops)");
  static_assert(bwdts::kSubQ == 64, "dq_sem: one turn counter per 64 queries (ops_cuda.cpp, launch_sm90.h at_chunk)");
  using L = MainLayout<DQK, DV>;
  using R = SeqRows<kVarlen>;
  constexpr int kStages = L::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_aligned_1024(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + L::kF);
  const uint32_t bar0 = smem_u32(sf + L::kBar);
  auto bar_full = [&](int s) { return bar0 + 8 * s; };
  auto bar_empty = [&](int s) { return bar0 + 8 * (kStages + s); };
  const uint32_t bar_kv = bar0 + 8 * (2 * kStages);

  const CtaWork wc = cta_work<L, DQK, DV, kVarlen, false, kDeterministic>(p);  // the consumers' (NOTE at CtaWork)
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      // The producer's 128 cp.async arrivals plus warp 3's 32 plain arrivals after
      // its per-column coefficient stores (generic st.shared).
      mbar_init(bar_full(s), kProducerThreads + 32);
      mbar_init(bar_empty(s), kConsumerThreads);
    }
    mbar_init(bar_kv, kProducerThreads);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // ---- producer warpgroup ----------------------------------------------------------
  if (threadIdx.x >= kConsumerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(bwdts::kProducerRegs));
    const CtaWork w = cta_work<L, DQK, DV, kVarlen, true, kDeterministic>(p);
    const int n_tile = w.n_tile, hk = w.hk, b = w.b, slice = w.slice, cb = w.cb, wk = w.wk, wv = w.wv;
    const int Sq = w.Sq, Sk = w.Sk, group = w.group, nblk_q = w.nblk_q, nblk_k = w.nblk_k, n0 = w.n0;
    const int causal_off = w.causal_off, m_first = w.m_first, m_end = w.m_end, n_iters = w.n_iters;
    const int64_t bhk = w.bhk;  // the rows of K, Q, ...: SeqRows
    const int q_row0 = R::q_row0(w), k_row0 = R::k_row0(w);
    (void)slice, (void)nblk_q, (void)nblk_k, (void)causal_off, (void)n_tile;
    if (n_iters == 0) return;
    // Warp roles (NOTE at fill_rows): warp 0 K / Q rows, warp 1 V / dO rows,
    // warp 2 K^T / Q^T columns, warp 3 dO^T columns and the per-query floats.
    const int tid = threadIdx.x - kConsumerThreads, pw = tid >> 5, pl = tid & 31;
    // Warp 3's per-tile factors of the per-column coefficients (the consumers'
    // kc and s_v, formed the same way).
    float kc = 0.f, s_v = 0.f;
    if (pw == 3) {
      kc = __fmul_rn(p.k_row_s[R::k_tile(p, w)], __fmul_rn(p.softmax_scale, kLog2e));
      if constexpr (kSoftcap) kc = softcap_kc(kc, softcap_consts(p.softcap));  // p_c2 (p_softcap)
      s_v = p.v_row_s[R::k_tile(p, w)];
    }
    // Key side, once.
    if (pw == 0)
      fill_rows<DQK, false, 32>(smem + L::kK, p.k_row + bhk * R::k_rows(p, w) * DQK, k_row0 + n0, k_row0 + Sk, pl);
    else if (pw == 1)
      fill_rows<DV, false, 32>(smem + L::kV, p.v_row + bhk * R::k_rows(p, w) * DV, k_row0 + n0, k_row0 + Sk, pl);
    else if (pw == 2)
      fill_cols<32>(smem + L::kKc, p.k_colT + (bhk * DQK + cb) * p.seqlen_k_pad, p.seqlen_k_pad, wk, k_row0 + n0,
                    k_row0 + Sk, pl);
    cp_async_mbar_arrive(bar_kv);
    int hq = hk * group, m_tile = m_first;
    for (int it = 0; it < n_iters; ++it) {
      const int st = it % kStages;
      if (it >= kStages) mbar_wait(bar_empty(st), (it / kStages - 1) & 1);
      const int m0 = m_tile * kTile;
      const int64_t bhq = static_cast<int64_t>(static_cast<uint32_t>(b * p.num_heads_q + hq));
      uint8_t* S = smem + L::kStage0 + st * L::kStageBytes;
      if (pw == 0) {
        fill_rows<DQK, true, 32>(S + L::kSQ, p.q_row + bhq * R::q_rows(p, w) * DQK, q_row0 + m0, q_row0 + Sq, pl);
      } else if (pw == 1) {
        fill_rows<DV, true, 32>(S + L::kSDO, p.do_row + bhq * R::q_rows(p, w) * DV, q_row0 + m0, q_row0 + Sq, pl);
      } else if (pw == 2) {
        fill_cols<32>(S + L::kSQc, p.q_colT + (bhq * DQK + cb) * p.seqlen_q_pad, p.seqlen_q_pad, wk, q_row0 + m0,
                      q_row0 + Sq, pl);
      } else {
        // NOTE: a packed batch takes the column base through an opaque copy:
        // cb + (the thread's first row) hoisted out of the loop as a 64-bit
        // value, and one more, were spilled there (d >= 192: 8 bytes).
        const int cb3 = kVarlen ? static_cast<int>(opaque_u32(cb)) : cb;
        fill_cols<32>(S + L::kSDOc, p.do_colT + (bhq * DV + cb3) * p.seqlen_q_pad, p.seqlen_q_pad, wv, q_row0 + m0,
                      q_row0 + Sq, pl);
        // Per-column coefficients: column n is query m0 + q_of_col(n); zeros past
        // Sq (as zero-filled raw floats would give: p_c = p_l2 = dp_c = 0).
        // Formed here once per stage instead of by every consumer thread per
        // sub-tile (the same roundings: P and dP_hat stay bitwise the pre-pass's).
        float* F = sf + L::kFStage + st * L::kFStageFloats;
#pragma unroll 1
        for (int n = pl; n < kTile; n += 32) {
          const int r = m0 + q_of_col(n);
          float c = 0.f, l2 = 0.f, cdo = 0.f, dl = 0.f;
          if (r < Sq) {
            // Per-token scales at the code row, LSE and delta at the token row (the same in a dense batch).
            const int64_t row = bhq * R::q_rows(p, w) + (q_row0 + r);
            const int64_t tok = bhq * R::q_toks(p, w) + (kVarlen ? w.tok_q + r : r);
            c = p_coef(p.q_row_s[row], kc);
            l2 = p_lse2(p.lse[tok]);
            cdo = dp_coef(p.do_row_s[row], s_v);
            dl = p.delta[tok];
          }
          F[L::kFPc + n] = c;
          F[L::kFPl2 + n] = l2;
          F[L::kFDPc + n] = cdo;
          F[L::kFDelta + n] = dl;
        }
        mbar_arrive(bar_full(st));  // release: the stores above before the consumers' reads
      }
      cp_async_mbar_arrive(bar_full(st));
      if (++m_tile == m_end) {
        m_tile = m_first;
        ++hq;
      }
    }
    // NOTE: wait_all (commit + wait): the copies above were never committed to a
    // group, so wait_group alone would not cover them; no thread leaves with
    // copies in flight.
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // ---- consumer warpgroups -----------------------------------------------------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(bwdts::kConsumerRegs));
  const CtaWork& w = wc;
  const int n_tile = w.n_tile, hk = w.hk, b = w.b, slice = w.slice, cb = w.cb, wk = w.wk, wv = w.wv;
  const int Sq = w.Sq, Sk = w.Sk, group = w.group, nblk_q = w.nblk_q, nblk_k = w.nblk_k, n0 = w.n0;
  const int causal_off = w.causal_off, m_first = w.m_first, m_end = w.m_end, n_iters = w.n_iters;
  const int64_t Sq64 = w.Sq64, Sk64 = w.Sk64, bhk = w.bhk;
  (void)hk, (void)n_tile, (void)nblk_q, (void)nblk_k;  // the rows of K, Q, ...: SeqRows
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wg = warpgroup_uniform();
  const uint32_t d_base = desc_lo(smem);
  const bool diag = p.diag != nullptr && slice == 0;  // the row sums are over keys: one slice adds them
  // rowsum_ws plane: B Hq Sq floats (a packed batch: Hq total_q).
  const int64_t n_rows = kVarlen ? static_cast<int64_t>(p.num_heads_q) * p.seqlen_q
                                 : static_cast<int64_t>(static_cast<uint32_t>(p.batch * p.num_heads_q)) * Sq64;
  uint8_t* sDS = smem + L::kDS;
  float* sAmax = sf + L::kAmax;
  float* sBlk = sf + L::kBlk;
  // This warpgroup's #6 row scales and dQ panel (v5: per warpgroup).
  float* sRowInv = sf + L::kRowInv + kSubQ * wg;
  float* sRowSq = sf + L::kRowSq + kSubQ * wg;
  float* panel = reinterpret_cast<float*>(smem + L::kDQ) + L::kDQPanelFloats * wg;
  const int bar_wg = bwdts::kBarWg + wg;  // this warpgroup's named barrier (128 threads)
  const int wt = threadIdx.x & 127;        // thread within the warpgroup
  // One thread per warpgroup issues that warpgroup's dQ bulk reduce-adds.
  const bool dq_issuer = (threadIdx.x & 127) == 0;
  // dq_accum rows per head row (a packed batch: its padded rows, the sequence's from row_q).
  const int64_t dq_rows = kVarlen ? R::q_rows(p, wc) : dq_accum_rows(1, Sq64);

  TileGeom tg;
  tg.n0 = n0;
  tg.seqlen_q = Sq;
  tg.seqlen_k = Sk;
  tg.causal_off = causal_off;
  tg.c2 = __fmul_rn(p.softmax_scale, kLog2e);
  // K's scale per key tile (#6's dQ factor below; the P / dP coefficients come
  // per stage from producer warp 3).
  const float s_k = p.k_row_s[R::k_tile(p, wc)];

  // dK, dV accumulators (64-column chunks), in units of 2^ek, 2^ev.
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
  int ek = 0, ev = 0;

  if (n_iters > 0) {
    mbar_wait(bar_kv, 0);
    fence_async_smem();  // NOTE (proxy order): cp.async writes -> this thread's wgmma reads, as the row kernel
  }

  // Pingpong turns (kPingpong): warpgroup wg waits on kBarPingpong + wg before
  // its S^T / dP^T issue and hands the turn over after it; warpgroup 1 hands
  // warpgroup 0 the first turn, warpgroup 0 takes one last turn after the loop
  // (both walk the same sub-tiles), so every arrival is consumed.
  auto turn_wait = [&] {
    if constexpr (kPingpong) named_bar_sync(bwdts::kBarPingpong + wg, 256);
  };
  auto turn_pass = [&] {
    if constexpr (kPingpong) named_bar_arrive(bwdts::kBarPingpong + (wg ^ 1), 256);
  };
  if (wg == 1 && n_iters > 0) turn_pass();

  // NOTE: (head, query tile) of iteration it from it itself (one division;
  // the producer's running pair walks the same sequence): a running pair
  // wrapping at m_end kept both m_first and m_end live across the loop (d =
  // 192: 4 more bytes of spill loads).
  const int per_head = m_end - m_first;
  for (int it = 0; it < n_iters; ++it) {
    const int st = it % kStages;
    const int hq = hk * group + it / per_head, m_tile = m_first + it % per_head;
    const int m0 = m_tile * kTile;
    const int64_t bhq = static_cast<int64_t>(static_cast<uint32_t>(b * p.num_heads_q + hq));
    mbar_wait(bar_full(st), (it / kStages) & 1);
    fence_async_smem();
    const float* F = sf + L::kFStage + st * L::kFStageFloats;
    // Q (#7) and dO (#5): one scale per query tile.
    const float s_qc = p.q_col_s[R::q_tile(p, wc, bhq, m_tile)], s_doc = p.do_col_s[R::q_tile(p, wc, bhq, m_tile)];

    // Two sub-tiles of 64 queries per stage (query rows [64 s, 64 s + 64) of
    // the stage's row tiles, k32 steps 2s, 2s + 1 of its column tiles).
#pragma unroll 1
    for (int s = 0; s < kTile / kSubQ; ++s) {
      const int m0s = m0 + kSubQ * s;
      if (m0s >= Sq) break;  // warp-uniform: the rest of the stage is past the sequence
      // Descriptor bases (NOTE: from an opaque copy of the shared base, made in
      // every iteration: loop-invariant descriptors hoisted out of the loop
      // took ~40 registers at head_dim 256 (spills)).
      const uint32_t base = opaque_u32(d_base);
      const uint32_t k_lo = base + L::kK / 16 + wg * kDesc64Rows;
      const uint32_t v_lo = base + L::kV / 16 + wg * kDesc64Rows;
      const uint32_t st_lo = base + (L::kStage0 + st * L::kStageBytes) / 16;
      const uint32_t q_lo = st_lo + L::kSQ / 16 + s * kDesc64Rows, do_lo = st_lo + L::kSDO / 16 + s * kDesc64Rows;
      const uint32_t qc_lo = st_lo + L::kSQc / 16 + s * 2 * kDescK32, doc_lo = st_lo + L::kSDOc / 16 + s * 2 * kDescK32;
      const float* Fs = F + kSubQ * s;  // this sub-tile's per-column floats
      tg.m0 = m0s;
      // Every (key, query) of the 128 x 64 pair is visible: no masks.
      const bool interior =
          n0 + kTile <= Sk && m0s + kSubQ <= Sq && window_covers(n0, kTile, m0s, kSubQ, causal_off, p.window_left, p.window_right);

      // ---- S^T (#3) and dP^T (#4), both in flight; P = exp2(...) under dP.
      float pt[8][4], dp[8][4];
      float dcap[kSoftcap ? 8 : 1][4];  // softcap: the cap's derivative per element (P to dS)
      turn_wait();
      issue_s<DQK, kSubQ, kTile>(k_lo, q_lo, pt);
      issue_dp<DV, FMT, kSubQ, kTile>(v_lo, do_lo, dp);
      turn_pass();
      wg_wait<1>();
      if constexpr (kSoftcap)
        p_from_coefs_softcap<kSubQ>(pt, dcap, Fs + L::kFPc, Fs + L::kFPl2, softcap_consts(p.softcap), lane);
      else
        p_from_coefs<kSubQ>(pt, Fs + L::kFPc, Fs + L::kFPl2, lane);
      if (!interior) mask_tile<kSubQ>(pt, tg, warp, lane, p.window_left, p.window_right);
      {
        const float m = warp_amax(pt);
        if (lane == 0) sBlk[warp] = m;
      }
      // ---- dS = P o (dP_hat - delta), in place over dP (P stays for #5).
      wg_wait<0>();
      ds_from_dp<kSubQ>(pt, dp, Fs + L::kFDPc, Fs + L::kFDelta, lane);
      if (!interior) mask_tile<kSubQ>(dp, tg, warp, lane, p.window_left, p.window_right);  // P = 0 there, but dP_hat may be NaN
      if (diag) diag_pre<kSubQ>(dp, p.rowsum_ws, n_rows, R::q_tok0(p, wc, bhq), m0s, Sq, lane);
      // Softcap: dS = dX' (1 - tanh^2), what #6 and #7 quantize (the pre-cast
      // row sums above are dX''s, numerics.md section 12).
      if constexpr (kSoftcap) cap_grad<kSubQ>(dp, dcap);

      // ---- Block amaxes over this warpgroup's 64 keys (v5: nothing crosses
      // warpgroups): P and dS per 64 x 64 block (#5, #7), dS per query over
      // the 64 keys (#6).
      {
        float v[16], m[2];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) v[2 * j + e] = max_nan(fabsf(dp[j][e]), fabsf(dp[j][e + 2]));
        reduce_cols(v, m, lane, OpMaxNan());  // m[e]: column 8g + 2t + e
#pragma unroll
        for (int e = 0; e < 2; ++e) sAmax[warp * kSubQ + 8 * g + 2 * t + e] = m[e];
        float mb = max_nan(m[0], m[1]);
#pragma unroll
        for (int o = 1; o <= 16; o <<= 1) mb = max_nan(mb, __shfl_xor_sync(0xffffffffu, mb, o));
        if (lane == 0) sBlk[kWarps + warp] = mb;
      }
      // This warpgroup's dQ panel has been read by its last bulk reduce-add
      // before anyone passes (1) (the panel is rewritten below).
      if (dq_issuer) bulk_wait_read<0>();
      named_bar_sync(bar_wg, 128);  // (1) the amaxes of this warpgroup's 4 warps
      if (wt < kSubQ) {
        const int n = wt;  // column n = query m0s + q_of_col(n)
        float m = 0.f;
#pragma unroll
        for (int w = 0; w < 4; ++w) m = max_nan(m, sAmax[(4 * wg + w) * kSubQ + n]);
        const float2 sc = fast_scale<FMT>(m);
        sRowInv[n] = sc.y;
        sRowSq[q_of_col(n)] = sc.x;
      }
      float m_p = 0.f, m_s = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        m_p = max_nan(m_p, sBlk[4 * wg + w]);
        m_s = max_nan(m_s, sBlk[kWarps + 4 * wg + w]);
      }
      const float2 sc_p = fast_scale<kFmtE4M3>(m_p), sc_s = fast_scale<FMT>(m_s);

      // ---- dV += s_P s_dO(qt) P_hat^T dO_hat (#5) and dK += s_dS s_Q(qt)
      // dS_hat^T Q_hat (#7), RS (the codes are A fragments in natural query
      // order), straight into the accumulators, left in flight.
      // (An all-zero block, e.g. a sub-tile that sees none of the keys, adds
      // exact zeros: its scale 1 must not move the accumulator's units.)
      if (m_s != 0.f) rescale_to<L::kWk / 2>(&dk_acc[0][0][0], ek, sc_s.x, s_qc);
      if (m_p != 0.f) rescale_to<L::kWv / 2>(&dv_acc[0][0][0], ev, sc_p.x, s_doc);
      uint32_t a_p[2][4], a_s[2][4];
      codes_block<kFmtE4M3, 8>(pt, sc_p.y, a_p);
      codes_block<FMT, 8>(dp, sc_s.y, a_s);
      fence_regs<L::kWv / 2>(&dv_acc[0][0][0]);
      fence_regs<L::kWk / 2>(&dk_acc[0][0][0]);
      wg_arrive();
      if (wv > 0) {
#pragma unroll
        for (int h = 0; h < L::kWv / 64; ++h)
          if (64 * h < wv)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              gmma_rs<kFmtE4M3, FMT, 64>(a_p[c], desc_of(doc_lo + h * (64 * 128 / 16) + kDescK32 * c),
                                         &dv_acc[h][0][0], true);
      }
#pragma unroll
      for (int h = 0; h < L::kWk / 64; ++h)
        if (64 * h < wk)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            gmma_rs<FMT, kFmtE4M3, 64>(a_s[c], desc_of(qc_lo + h * (64 * 128 / 16) + kDescK32 * c), &dk_acc[h][0][0],
                                       true);
      wg_commit();
      named_bar_sync(bar_wg, 128);  // (2) this warpgroup's #6 row scales in sRowInv / sRowSq

      // ---- dS codes of #6 into sDS [query][key] (natural orders): this
      // warpgroup's 64 keys are the 16-byte chunks 4 wg .. 4 wg + 3 of each
      // row (before the swizzle). Thread rows g, g + 8 are keys 16 warp + 2g, + 1
      // (k_of_row): one 16-bit store per column; column 8j + 2t + e is query
      // 16 (j >> 1) + 4t + c, c = 2 (j & 1) + e, whose swizzled chunk is
      // warp ^ 4 (t & 1) ^ c (the row kernel's addressing).
      {
        uint8_t* ds_base[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) ds_base[c] = sDS + 128 * (4 * t + c) + ((warp ^ (4 * (t & 1)) ^ c) << 4) + 2 * g;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 inv = *reinterpret_cast<const float2*>(sRowInv + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float iv = e ? inv.y : inv.x;
            const uint32_t two = cvt2<FMT>(dp[j][e] * iv, dp[j][e + 2] * iv);
            *reinterpret_cast<uint16_t*>(ds_base[2 * (j & 1) + e] + 2048 * (j >> 1)) = static_cast<uint16_t>(two);
          }
        }
      }
      fence_async_smem();           // st.shared (generic proxy) -> the dQ wgmmas (async proxy)
      named_bar_sync(bar_wg, 128);  // (3) this warpgroup's dS codes

      // Diagnostics: post-cast row sums of the #6 operand (codes times
      // s_dS(q, half)) over this warpgroup's 64 keys, two threads per query
      // row (32 keys each).
      if (diag) {
        const int ql = wt >> 1, qr = wt & 1;
        const float sq = sRowSq[ql];
        float acc[2] = {0.f, 0.f};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const uint4 c16 = *reinterpret_cast<const uint4*>(sDS + sw128(ql, 4 * wg + 2 * qr + u));
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
          float r = acc[pass] * sq;
          r += __shfl_xor_sync(0xffffffffu, r, 1);
          if (qr == 0 && m0s + ql < Sq)
            atomicAdd(p.rowsum_ws + (2 + pass) * n_rows + R::q_tok0(p, wc, bhq) + m0s + ql, r);
        }
      }

      // ---- dQ partial (#6): dS_hat K_hat over this warpgroup's 64 keys (k32
      // steps 2 wg, 2 wg + 1 of the dS and K^T tiles) for the sub-tile's 64
      // queries, every 64-column panel h of the slice in turn, per query row
      // times s_dS(q, half) s_K, stored to the warpgroup's shared panel in
      // dq_accum's chunk order and added to dq_accum (FP32; tau at the
      // convert) by one TMA bulk reduce-add per panel. Both warpgroups add into
      // the same chunk (the bulk reduce-adds are atomic per element). Panel
      // h + 1's wgmma runs while panel h's bulk read is in flight. Rows past
      // seqlen_q are zeros (their dS codes are masked), into dq_accum's padding.
      {
        const uint32_t ds_lo = base + L::kDS / 16 + 2 * kDescK32 * wg;
        const int w4 = warp & 3, q0 = w4 * 16 + g;  // accumulator rows q0, q0 + 8: queries m0s + q0, + 8
        const float f0 = sRowSq[q0] * s_k, f1 = sRowSq[q0 + 8] * s_k;
        int h_done = 0;
        int* turn = nullptr;  // kDeterministic: this sub-tile's counter (the issuer's)
        if constexpr (kDeterministic) {
          if (dq_issuer) {
            const int nsub = (Sq + kSubQ - 1) / kSubQ;
            turn = p.dq_sem + (bhq * nsub + m0s / kSubQ) * L::kSlices + slice;
            const int want =
                2 * (last_key_tile_of(m_tile, kTile, nblk_k, Sq, Sk, p.window_left, p.window_right) - n_tile) + wg;
            while (ld_acquire_gpu(turn) != want) __nanosleep(64);
            fence_proxy_async_global();  // the earlier turns' adds before this one's (async proxy)
          }
        }
#pragma unroll
        for (int h = 0; h < L::kWk / 64; ++h) {
          if (64 * h >= wk) break;  // CTA-uniform
          const uint32_t kc_lo = base + L::kKc / 16 + h * (64 * 128 / 16) + 2 * kDescK32 * wg;
          float pq[8][4];
          fence_regs<32>(&pq[0][0]);
          wg_arrive();
#pragma unroll
          for (int k = 0; k < 2; ++k)
            gmma_ss<FMT, kFmtE4M3, 64>(desc_of(ds_lo + kDescK32 * k), desc_of(kc_lo + kDescK32 * k), &pq[0][0], k > 0);
          wg_commit();
          wg_wait<0>();
          fence_regs<32>(&pq[0][0]);
          if (h_done > 0) {  // the panel's previous bulk read is done before it is rewritten
            if (dq_issuer) bulk_wait_read<0>();
            named_bar_sync(bar_wg, 128);
          }
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float f = hh ? f1 : f0;
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
              *reinterpret_cast<float2*>(panel + (((w4 * 2 + hh) * 8 + jj) * 32 + lane) * 2) =
                  make_float2(pq[jj][2 * hh] * f, pq[jj][2 * hh + 1] * f);
          }
          fence_async_smem();           // st.shared (generic proxy) -> the bulk reduce's reads (async proxy)
          named_bar_sync(bar_wg, 128);  // the warpgroup's whole panel
          if (dq_issuer) {
            float* dst = p.dq_accum + (bhq * dq_rows + (R::q_row0(wc) + m0s)) * DQK +
                         static_cast<int64_t>(cb + 64 * h) * 64;
            bulk_reduce_add_f32(dst, smem_u32(panel), L::kDQPanelFloats * 4);
            bulk_commit();
          }
          ++h_done;
        }
        if (h_done == 0) wg_wait<0>();  // the dV / dK wgmmas
        if constexpr (kDeterministic) {
          if (turn != nullptr) {  // this turn's adds complete, then the next turn
            bulk_wait<0>();
            fence_proxy_async_global();
            __threadfence();
            atomicAdd(turn, 1);
          }
        }
      }
      fence_regs<L::kWk / 2>(&dk_acc[0][0][0]);
      fence_regs<L::kWv / 2>(&dv_acc[0][0][0]);
      fence_regs_u(&a_p[0][0], 8);
      fence_regs_u(&a_s[0][0], 8);
    }
    // Every read of stage st by this thread is done (S, dP, dV, dK wgmmas
    // completed, the per-column floats read): the producer may refill it.
    mbar_arrive(bar_empty(st));
  }

  // The last dQ reduce-adds are complete before the CTA's shared memory goes.
  if (wg == 0 && n_iters > 0) turn_wait();  // warpgroup 1's last hand-over
  if (dq_issuer) bulk_wait<0>();

  // ---- Epilogue: dK = tau 2^ek acc, dV = 2^ev acc (BF16), keys < seqlen_k.
  pow2_scale<L::kWk / 2>(&dk_acc[0][0][0], ek);
  pow2_scale<L::kWv / 2>(&dv_acc[0][0][0], ev);
  __nv_bfloat16* dk = static_cast<__nv_bfloat16*>(p.dk);
  __nv_bfloat16* dv = static_cast<__nv_bfloat16*>(p.dv);
  // Row of key `key` of the sequence in dK / dV: [B, Hkv, Sk, D] (dense),
  // token-major [total_k, Hkv, D] (packed, varlen_sm90.h).
  int tok_k = 0;
  if constexpr (kVarlen) tok_k = static_cast<int>(R::reread(p).tok_k);  // NOTE at SeqRows::reread
  auto kv_row = [&](int key) -> int64_t {
    return kVarlen ? static_cast<int64_t>(static_cast<uint32_t>(tok_k + key)) * p.num_heads_kv + hk
                   : bhk * Sk64 + key;
  };
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
        const float x = __fmul_rn(dk_acc[h][jj][2 * hh], p.softmax_scale);
        const float y = __fmul_rn(dk_acc[h][jj][2 * hh + 1], p.softmax_scale);
        *reinterpret_cast<__nv_bfloat162*>(dk + kv_row(key) * DQK + c) = __floats2bfloat162_rn(x, y);
      }
    }
#pragma unroll
    for (int h = 0; h < L::kWv / 64; ++h) {
      if (64 * h >= wv) continue;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int c = cb + 64 * h + 8 * jj + 2 * t;
        *reinterpret_cast<__nv_bfloat162*>(dv + kv_row(key) * DV + c) =
            __floats2bfloat162_rn(dv_acc[h][jj][2 * hh], dv_acc[h][jj][2 * hh + 1]);
      }
    }
  }
}

// dQ = BF16(tau dq_accum) from the `tile` chunk order (kernel_params_sm90.h,
// dq_accum_rows): one thread per 4 floats, which are lanes 2u, 2u + 1's pairs:
// 4 consecutive columns of one query. Padding rows (>= seqlen_q) are skipped.
__global__ void tilescale_dq_convert_kernel(const float* __restrict__ acc, __nv_bfloat16* __restrict__ dq,
                                            int64_t n4, int64_t Sq, int64_t rows, int dqk, float tau) {
  const int64_t i4 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i4 >= n4) return;
  const int64_t f = 4 * i4, chunk_floats = 64 * static_cast<int64_t>(dqk);
  const int64_t chunk = f / chunk_floats;
  const int within = static_cast<int>(f - chunk * chunk_floats);
  const int panel = within >> 12, j = within & 4095;
  const int lane = (j >> 1) & 31, jj = (j >> 6) & 7, r8 = (j >> 9) & 1, w = j >> 10;
  const int64_t per_head = rows / 64;
  const int64_t bh = chunk / per_head;
  const int64_t q = (chunk - bh * per_head) * 64 + 16 * w + 8 * r8 + (lane >> 2);
  if (q >= Sq) return;
  const float4 v = *reinterpret_cast<const float4*>(acc + f);
  __nv_bfloat162* out =
      reinterpret_cast<__nv_bfloat162*>(dq + (bh * Sq + q) * dqk + 64 * panel + 8 * jj + 2 * (lane & 3));
  out[0] = __floats2bfloat162_rn(__fmul_rn(v.x, tau), __fmul_rn(v.y, tau));
  out[1] = __floats2bfloat162_rn(__fmul_rn(v.z, tau), __fmul_rn(v.w, tau));
}
// The same for a packed batch (varlen_sm90.h): dq_accum holds the padded rows
// [Hq, seqlen_q_pad]; padded row R of head h is token tok_q + (R - row_q) of
// its sequence, written to dQ token-major [total_q, Hq, Dqk]. Rows no sequence
// owns or past their sequence's queries are skipped (tokens outside every
// sequence are the caller's).
// NOTE: the chunk-order decode is the dense kernel's, written out again (as a
// shared helper it changed the dense kernel's SASS).
__global__ void tilescale_dq_convert_varlen_kernel(const KernelParams p, int64_t n4) {
  const int64_t i4 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i4 >= n4) return;
  const int dqk = p.head_dim_qk;
  const int64_t f = 4 * i4, chunk_floats = 64 * static_cast<int64_t>(dqk);
  const int64_t chunk = f / chunk_floats;
  const int within = static_cast<int>(f - chunk * chunk_floats);
  const int panel = within >> 12, j = within & 4095;
  const int lane = (j >> 1) & 31, jj = (j >> 6) & 7, r8 = (j >> 9) & 1, w = j >> 10;
  const int64_t per_head = p.seqlen_q_pad / 64;
  const int64_t h = chunk / per_head;  // query head (batch 1)
  const int64_t R = (chunk - h * per_head) * 64 + 16 * w + 8 * r8 + (lane >> 2);  // padded row
  SeqInfo si;
  int local;
  if (!varlen_q_row(p, R, si, local)) return;
  const float tau = p.softmax_scale;
  const float4 v = *reinterpret_cast<const float4*>(p.dq_accum + f);
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.dq) +
                                                          ((si.tok_q + local) * p.num_heads_q + h) * dqk +
                                                          64 * panel + 8 * jj + 2 * (lane & 3));
  out[0] = __floats2bfloat162_rn(__fmul_rn(v.x, tau), __fmul_rn(v.y, tau));
  out[1] = __floats2bfloat162_rn(__fmul_rn(v.z, tau), __fmul_rn(v.w, tau));
}

}  // namespace

void launch_tilescale_dq_convert(const KernelParams& p, cudaStream_t stream) {
  if (p.num_seqs > 0) {
    const int64_t n4 = static_cast<int64_t>(p.num_heads_q) * p.seqlen_q_pad * p.head_dim_qk / 4;
    if (n4 == 0) return;
    tilescale_dq_convert_varlen_kernel<<<static_cast<unsigned>((n4 + 255) / 256), 256, 0, stream>>>(p, n4);
  } else {
    const int64_t rows = dq_accum_rows(1, p.seqlen_q);
    const int64_t n4 = static_cast<int64_t>(p.batch) * p.num_heads_q * rows * p.head_dim_qk / 4;
    if (n4 == 0) return;
    tilescale_dq_convert_kernel<<<static_cast<unsigned>((n4 + 255) / 256), 256, 0, stream>>>(
        p.dq_accum, static_cast<__nv_bfloat16*>(p.dq), n4, p.seqlen_q, rows, p.head_dim_qk, p.softmax_scale);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: bwd tile dq convert launch failed: ") + cudaGetErrorString(e));
}

void launch_tilescale_main(const KernelParams& p, cudaStream_t stream) {
  dispatch_shapes(p, [&](auto dqk, auto dv, auto fmt) {
    constexpr int DQK = decltype(dqk)::value, DV = decltype(dv)::value, FMT = decltype(fmt)::value;
    using L = MainLayout<DQK, DV>;
    // NOTE: FP8ATTN_TILE_BWD_PINGPONG=0|1 picks the issue order (default
    // bwdts::kBwdPingpongDefault; a bad value throws std::invalid_argument).
    const int pp_env = env_choice("FP8ATTN_TILE_BWD_PINGPONG", {"0", "1"});
    const bool pp = pp_env < 0 ? bwdts::kBwdPingpongDefault : pp_env == 1;
    // A packed batch: the kVarlen instantiations (the dense kernels stay free of
    // the metadata reads), one CTA per padded key tile of all sequences.
    const bool vl = p.num_seqs > 0;
    // Softcap (numerics.md section 12): the dense default order only (a softcap
    // call ignores FP8ATTN_TILE_BWD_PINGPONG; run_bwd refuses a packed batch).
    // Deterministic (KernelParams::dq_sem, dense only: run_bwd checks): the default order.
    const bool det = p.dq_sem != nullptr;
    constexpr bool kPp = bwdts::kBwdPingpongDefault;
    auto kernel = det ? (p.softcap > 0.f ? bwd_tilescale_main_kernel<DQK, DV, FMT, kPp, false, true, true>
                                         : bwd_tilescale_main_kernel<DQK, DV, FMT, kPp, false, false, true>)
                  : p.softcap > 0.f ? bwd_tilescale_main_kernel<DQK, DV, FMT, bwdts::kBwdPingpongDefault, false, true>
                  : vl ? (pp ? bwd_tilescale_main_kernel<DQK, DV, FMT, true, true>
                             : bwd_tilescale_main_kernel<DQK, DV, FMT, false, true>)
                       : (pp ? bwd_tilescale_main_kernel<DQK, DV, FMT, true, false>
                             : bwd_tilescale_main_kernel<DQK, DV, FMT, false, false>);
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes);
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fp8attn: bwd tile main: cudaFuncSetAttribute failed: ") +
                               cudaGetErrorString(err));
    // NOTE: one launch unless batch or num_heads_kv * slices exceed 65535
    // (launch_sm90.h; a packed batch is one launch, run_bwd checks its heads).
    const int64_t n_k = vl ? int64_t{p.k_tiles_max} : (p.seqlen_k + kTile - 1) / kTile;
    launch_attn_chunks(p, n_k, GridHeads::kKv, L::kSlices, "bwd tile main",
                       [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk&) {
                         kernel<<<dim3(gx, gy, gz), bwdts::kThreads, L::kBytes, stream>>>(pc);
                         const cudaError_t e = cudaGetLastError();
                         if (e != cudaSuccess)
                           throw std::runtime_error(std::string("fp8attn: bwd tile main launch failed: ") +
                                                    cudaGetErrorString(e));
                       });
  });
}

}  // namespace ts
}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
