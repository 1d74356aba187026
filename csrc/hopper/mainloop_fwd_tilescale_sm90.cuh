// fp8attn: producer and consumer loops of the sm_90a `tile` forward
// (numerics.md section 9, matmuls #1 and #2; the kernel that assembles them:
// fwd_tilescale_e4m3_sm90.cu; design notes: docs/kernels/fwd_tilescale_e4m3_sm90.md).
//
// Shared memory (FwdTileTraits): the Q tile (kBlockM rows, head_dim in
// chunks of 128 channels, 128B swizzle; a 64-channel chunk 64B), kStages K
// tiles (same chunking) and kStages V^T tiles (Dv rows of 128 keys, 128B
// swizzle), mbarriers. Barriers per stage: k_full (TMA bytes), k_empty (every
// consumer thread), v_raw (TMA bytes), v_full (the 96 permuting threads),
// v_empty (every consumer thread); q_full / q_empty once per work tile.
//
// Producer warpgroup: warp 0 issues the TMA loads (Q per work tile after
// q_empty; per key tile K into stage s after k_empty, V^T after v_empty). The
// keys of every 16-key group of V^T are in the order the P codes need to stay
// in the registers the S accumulator gave them (the "P fragment" trick of the
// `row` kernel, fwd_wgmma_e4m3_blockscale_sm90.cu: A k index 4t + i of a k32
// step = key 2t + (i & 1) + 8 (i >> 1)): written so by the quantization
// (fwdt::kVPermutedInQuant; the consumers wait on v_raw, v_full is unused),
// else permuted in place by warps 1-3 (v_raw -> v_full).
//
// Consumer warpgroup (64 query rows), per key tile of the rows it sees:
//   S = Q_hat K_hat^T (wgmma m64n128k32 SS over head_dim), [softcap_tile:
//   the capped logits, kSoftcap], mask, softmax_tile
//   (softmax_tilescale_sm90.cuh: all scales folded per row), O *= factor,
//   O += P_hat V_hat (wgmma m64n{Dv}k32 RS straight into the O accumulator).
// Overlap order (kOverlap, dv <= 128): QK^T (t) and P V (t - 1) are issued
// together, the softmax of t runs while P V (t - 1) is on the tensor cores,
// and O is rescaled by t's factor once P V (t - 1) is done, at the top of
// tile t + 1 (after its stage waits, before P V (t) is issued). kPingpong
// adds the two warpgroups taking turns to issue (named barriers), so one's
// softmax runs under the other's GEMMs (FA3's schedule).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "hopper/config_sm90.h"
#include "hopper/kernel_params_sm90.h"
#include "hopper/pipeline_sm90.cuh"
#include "hopper/epilogue_fwd_sm90.cuh"
#include "hopper/scheduler_sm90.cuh"
#include "hopper/softmax_tilescale_sm90.cuh"

namespace fp8attn {
namespace sm90 {

template <int kD_, int kDv_>
struct FwdTileTraits {
  static constexpr int kD = kD_, kDv = kDv_;
  static constexpr int kBlockM = fwdt::kBlockM, kBlockN = fwdt::kBlockN, kStages = fwdt::kStages;
  static constexpr int kChunks = fwdt::qk_chunks(kD);
  static constexpr int kW0 = fwdt::qk_chunk_width(kD, 0);
  static constexpr int kW1 = kChunks > 1 ? fwdt::qk_chunk_width(kD, 1) : 0;
  static constexpr int kQChunkBytes = kBlockM * fwdt::kQKChunk;  // chunk c of Q at c * this
  static constexpr int kKChunkBytes = kBlockN * fwdt::kQKChunk;
  static constexpr int kQBytes = kBlockM * kD, kKBytes = kBlockN * kD, kVBytes = kDv * kBlockN;
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKBytes;
  static constexpr int kOffBar = kOffV + kStages * kVBytes;  // uint64 [2 + 5 kStages]
  static constexpr int kSmemBytes = kOffBar + 8 * (2 + 5 * kStages) + 1024;  // + base alignment
  static constexpr bool kOverlap = fwdt::overlap_fits(kDv);

  static_assert(kChunks <= 2 && (kW0 == 64 || kW0 == 128) && (kW1 == 0 || kW1 == 64 || kW1 == 128),
                "Q / K rows: one or two swizzle spans");
  static_assert(kDv == 64 || kDv == 128 || kDv == 256, "P V: m64n{64,128,256}k32");
  static_assert(kQBytes % 1024 == 0 && kKBytes % 1024 == 0 && kVBytes % 1024 == 0 && kQChunkBytes % 1024 == 0,
                "swizzled tiles start on 1024-byte boundaries");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one SM");
};

enum TileBar { kTbQFull = 0, kTbKFull = 1, kTbKEmpty = 2, kTbVRaw = 3, kTbVFull = 4, kTbVEmpty = 5, kTbQEmpty = 6 };
template <int kStages>
__device__ __forceinline__ uint32_t tile_bar(uint32_t bar, TileBar which, int s) {
  if (which == kTbQFull) return bar;
  if (which == kTbQEmpty) return bar + 8u * (1 + 5 * kStages);
  return bar + 8u * (1 + (static_cast<int>(which) - 1) * kStages + s);
}
// NOTE: every consumer thread arrives on k_empty / v_empty (its own reads of
// the stage are then ordered before the producer's next writes by one
// arrive / wait pair, which compute-sanitizer racecheck follows).
template <int kStages>
__device__ __forceinline__ void tile_init_bars(uint32_t bar) {
  using namespace pipe;
  mbar_init(tile_bar<kStages>(bar, kTbQFull, 0), 1);
  mbar_init(tile_bar<kStages>(bar, kTbQEmpty, 0), 128 * fwdt::kConsumerWGs);
  for (int s = 0; s < kStages; ++s) {
    mbar_init(tile_bar<kStages>(bar, kTbKFull, s), 1);
    mbar_init(tile_bar<kStages>(bar, kTbKEmpty, s), 128 * fwdt::kConsumerWGs);
    mbar_init(tile_bar<kStages>(bar, kTbVRaw, s), 1);
    mbar_init(tile_bar<kStages>(bar, kTbVFull, s), 96);
    mbar_init(tile_bar<kStages>(bar, kTbVEmpty, s), 128 * fwdt::kConsumerWGs);
  }
  fence_mbar_init();
}

// ---- producer warpgroup -------------------------------------------------------------
// Q code rows [q_row0, q_row0 + kBlockM) of head row bhq; key tiles [kt0, kt1)
// (those the rows' windows touch, scheduler_sm90.cuh key_tiles_seen) of the
// sequence whose keys start at code row k_row0 of head row bhk (0 dense; the
// padded rows of a packed batch, varlen_sm90.h).
// it: the CTA's work tile count so far (persistent scheduler; 0 otherwise), kb
// the key tiles it streamed before this work tile (stage / phase of key tile
// kt: kb + kt - kt0, the same count in the producer and both consumers).
template <class T>
__device__ __forceinline__ void fwd_tile_producer(uint32_t sbase, uint32_t bar, int q_row0, int k_row0, int kt0, int kt1,
                                                  int bhq, int bhk,
                                                  const CUtensorMap* tm_q0, const CUtensorMap* tm_q1,
                                                  const CUtensorMap* tm_k0, const CUtensorMap* tm_k1,
                                                  const CUtensorMap* tm_v, int kb, int it) {
  using namespace pipe;
  constexpr int kStages = T::kStages, kBlockN = T::kBlockN;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid & 31;
  if (warp == 0) {
    if (lane != 0) return;
    const uint32_t q_full = tile_bar<kStages>(bar, kTbQFull, 0);
    // NOTE: the previous work tile's Q is free once every consumer thread has
    // arrived on q_empty (after its last QK^T).
    if (it > 0) mbar_wait(tile_bar<kStages>(bar, kTbQEmpty, 0), (it - 1) & 1);
    mbar_arrive_tx(q_full, T::kQBytes);
    tma_load_3d(sbase + T::kOffQ, tm_q0, q_full, 0, q_row0, bhq);
    if constexpr (T::kChunks == 2)
      tma_load_3d(sbase + T::kOffQ + T::kQChunkBytes, tm_q1, q_full, fwdt::kQKChunk, q_row0, bhq);
    for (int kt = kt0; kt < kt1; ++kt) {
      const int s = (kb + kt - kt0) % kStages;
      const uint32_t ph = ((kb + kt - kt0) / kStages) & 1;
      const uint32_t sK = sbase + T::kOffK + s * T::kKBytes;
      mbar_wait(tile_bar<kStages>(bar, kTbKEmpty, s), ph ^ 1);
      const uint32_t k_full = tile_bar<kStages>(bar, kTbKFull, s);
      mbar_arrive_tx(k_full, T::kKBytes);
      tma_load_3d(sK, tm_k0, k_full, 0, k_row0 + kt * kBlockN, bhk);
      if constexpr (T::kChunks == 2)
        tma_load_3d(sK + T::kKChunkBytes, tm_k1, k_full, fwdt::kQKChunk, k_row0 + kt * kBlockN, bhk);
      mbar_wait(tile_bar<kStages>(bar, kTbVEmpty, s), ph ^ 1);
      const uint32_t v_raw = tile_bar<kStages>(bar, kTbVRaw, s);
      mbar_arrive_tx(v_raw, T::kVBytes);
      tma_load_3d(sbase + T::kOffV + s * T::kVBytes, tm_v, v_raw, k_row0 + kt * kBlockN, 0, bhk);
    }
    return;
  }
  // warps 1-3: the V^T key permutation, in place (16-byte chunks: the TMA
  // swizzle moves whole chunks, so it is untouched); nothing to do when the
  // quantization wrote V^T permuted (the consumers then wait for v_raw).
  if constexpr (fwdt::kVPermutedInQuant) return;
  const int pt = tid - 32;
  for (int kt = kt0; kt < kt1; ++kt) {
    const int s = (kb + kt - kt0) % kStages;
    const uint32_t ph = ((kb + kt - kt0) / kStages) & 1;
    const uint32_t sV = sbase + T::kOffV + s * T::kVBytes;
    // NOTE: v_empty first, then v_raw: the consumers' reads of the stage
    // happen-before these stores through one release / acquire pair.
    mbar_wait(tile_bar<kStages>(bar, kTbVEmpty, s), ph ^ 1);
    mbar_wait(tile_bar<kStages>(bar, kTbVRaw, s), ph);
    for (uint32_t a = sV + 16 * pt; a < sV + T::kVBytes; a += 16 * 96) {
      const uint4 x = ld_shared_v4(a);
      uint4 y;
      y.x = __byte_perm(x.x, x.z, 0x5410);  // keys 0 1 8 9
      y.y = __byte_perm(x.x, x.z, 0x7632);  // keys 2 3 10 11
      y.z = __byte_perm(x.y, x.w, 0x5410);  // keys 4 5 12 13
      y.w = __byte_perm(x.y, x.w, 0x7632);  // keys 6 7 14 15
      st_shared_v4(a, y);
    }
    fence_proxy_async();
    mbar_arrive(tile_bar<kStages>(bar, kTbVFull, s));
  }
}

// ---- consumer warpgroup ---------------------------------------------------------------
// kt0, kt1, kb, it: as the producer's; first / last: the CTA's first / last
// work tile (the pingpong turns continue from one work tile to the next); q0
// the work tile's first row within its sequence si. kVarlen: a packed batch
// (O token-major [total_q, Hq, Dv], varlen_sm90.h). kSoftcap: logit softcap
// p.softcap > 0 (numerics.md section 12): each tile's S becomes the capped
// logits before the mask (softcap_tile), the softmax runs on them.
template <class T, bool kPingpong, bool kVarlen, bool kSoftcap = false>
__device__ __forceinline__ void fwd_tile_consumer(const KernelParams& p, const SeqInfo& si, uint32_t sbase, uint32_t bar,
                                                  int q0, int kt0, int kt1, int64_t bhq, int64_t bhk, int kb, int it,
                                                  bool first, bool last) {
  using namespace pipe;
  constexpr int kStages = T::kStages, kBlockN = T::kBlockN, kDv = T::kDv;
  constexpr int kNT = kBlockN / 8;  // n8 tiles of S (16)
  constexpr float kLog2e = 1.4426950408889634f;
  static_assert(!kPingpong || T::kOverlap, "the pingpong phases follow the overlap order");

  const int tid = threadIdx.x, wg = tid / 128, cw = wg - 1;
  const int t128 = tid - 128 * wg, warp = t128 / 32, lane = t128 & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int Sq = si.seqlen_q, Sk = si.seqlen_k, diag = Sk - Sq;
  const int nblk_k = (Sk + kBlockN - 1) / kBlockN;
  const int wg_row0 = q0 + 64 * cw;
  const int row_w0 = wg_row0 + 16 * warp;  // first query row of this warp
  const int row0 = row_w0 + g;             // this thread's rows: row0, row0 + 8
  const int wl = p.window_left, wr = p.window_right;
  // The key tiles this warpgroup's rows see, [m_begin, m_end) inside [kt0,
  // kt1); none: the empty range at kt0 (the tiles are all handed over after
  // its one dummy phase, as before windows).
  const IndexRange mine = key_tiles_seen(wg_row0, wg_row0 + 64, si, p, kBlockN);
  const bool sees = mine.end > mine.begin;
  const int m_begin = sees ? mine.begin : kt0, m_end = sees ? mine.end : kt0;
  // One scale per key tile (K and V), the sequence's first at tile row_k / 128.
  const int64_t ks_off = kVarlen ? bhk * scale_tiles_k(p) + si.row_k / kBlockN : bhk * nblk_k;
  const float* ks_g = p.k_row_s + ks_off;
  const float* vs_g = p.v_col_s + ks_off;

  TileSoftmaxState st;
  Softcap sc{};
  if constexpr (kSoftcap) sc = softcap_consts(p.softcap);
  {
    const float scale_log2 = p.softmax_scale * kLog2e;
    float rq[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      const int64_t qs_row = kVarlen ? bhq * code_rows_q(p) + si.row_q + row : bhq * Sq + row;
      rq[r] = row < Sq ? p.q_row_s[qs_row] * scale_log2 : 0.f;
      if constexpr (kSoftcap) rq[r] = __fmul_rn(rq[r], sc.k2);  // softcap_tile's coefficient (TileSoftmaxState)
    }
    softmax_state_init(st, rq[0], rq[1]);
  }
  float o[kDv / 2];
#pragma unroll
  for (int i = 0; i < kDv / 2; ++i) o[i] = 0.f;
  float factor[2];  // O's rescale of the latest softmax_tile

  auto k_full = [&](int s) { return tile_bar<kStages>(bar, kTbKFull, s); };
  auto k_empty = [&](int s) { return tile_bar<kStages>(bar, kTbKEmpty, s); };
  // NOTE: V^T permuted by the quantization (fwdt::kVPermutedInQuant): the
  // TMA's own barrier says the tile is ready.
  auto v_full = [&](int s) { return tile_bar<kStages>(bar, fwdt::kVPermutedInQuant ? kTbVRaw : kTbVFull, s); };
  auto v_empty = [&](int s) { return tile_bar<kStages>(bar, kTbVEmpty, s); };
  const uint32_t sQ = sbase + T::kOffQ + cw * 64 * T::kW0;  // chunk 0 rows of this warpgroup
  const uint32_t sQ1 = sbase + T::kOffQ + T::kQChunkBytes + cw * 64 * T::kW1;

  auto turn_wait = [&] {
    if constexpr (kPingpong) named_sync(fwdt::kBarPingpong + cw, 256);
  };
  auto turn_pass = [&] {
    if constexpr (kPingpong) named_arrive(fwdt::kBarPingpong + (cw ^ 1), 256);
  };
  if constexpr (kPingpong) {
    if (cw == 1 && first) named_arrive(fwdt::kBarPingpong, 256);  // warpgroup 0 issues first
  }
  // NOTE: unsigned (kb + kt - kt0 >= 0: kt >= kt0): a shift and a mask, not
  // signed division.
  auto stage = [&](int kt) { return static_cast<int>(static_cast<uint32_t>(kb + kt - kt0) % kStages); };
  auto phase = [&](int kt) { return (static_cast<uint32_t>(kb + kt - kt0) / kStages) & 1u; };

  // The wgmma batches. NOTE: every barrier wait and descriptor is done before
  // the warpgroup fence, so no non-wgmma instruction defines a wgmma input
  // inside an open batch (else ptxas serializes them, C7513).
  auto qk_batch = [&](float (&acc)[kBlockN / 2], uint32_t sK) {
#pragma unroll
    for (int ks = 0; ks < T::kW0 / 32; ++ks)
      gmma_ss<kBlockN>(gmma_desc<T::kW0>(sQ, 32 * ks), gmma_desc<T::kW0>(sK, 32 * ks), acc, ks > 0,
                       std::make_index_sequence<kBlockN / 2>{});
    if constexpr (T::kChunks == 2) {
#pragma unroll
      for (int ks = 0; ks < T::kW1 / 32; ++ks)
        gmma_ss<kBlockN>(gmma_desc<T::kW1>(sQ1, 32 * ks), gmma_desc<T::kW1>(sK, T::kKChunkBytes + 32 * ks), acc,
                         true, std::make_index_sequence<kBlockN / 2>{});
    }
    wg_commit();
  };
  auto pv_batch = [&](const uint32_t (&pa)[kNT / 4][4], uint32_t sV) {
#pragma unroll
    for (int q = 0; q < kNT / 4; ++q)
      gmma_rs<kDv>(pa[q], gmma_desc<128>(sV, 32 * q), o, true, std::make_index_sequence<kDv / 2>{});
    wg_commit();
  };
  auto k_tile = [&](int kt) {  // waits for K tile kt, returns its stage address
    const int s = stage(kt);
    mbar_wait(k_full(s), phase(kt));
    return sbase + T::kOffK + s * T::kKBytes;
  };
  auto v_tile = [&](int kt) {
    const int s = stage(kt);
    mbar_wait(v_full(s), phase(kt));
    return sbase + T::kOffV + s * T::kVBytes;
  };
  // Issue S = Q_hat K_hat^T of key tile kt (asynchronous, one commit group).
  auto qk_issue = [&](float (&acc)[kBlockN / 2], int kt) {
    const uint32_t sK = k_tile(kt);
    fence_acc(acc);
    wg_arrive();
    qk_batch(acc, sK);
  };
  // P V (kv) done: its stage handed back, O moved to the unit of tile kv + 1
  // (the factor of softmax (kv + 1)), before P V (kv + 1) adds to it.
  // NOTE: run at the top of the next tile, after its stage waits, not
  // right after the softmax: the waits' try-wait loop ends the softmax's
  // basic block, and inside one block ptxas hoists the wgmma wait above
  // the softmax (seen with a branch-free softmax_tile: every MUFU.EX2
  // after the WARPGROUP.DEPBAR), so the softmax would no longer run under
  // the P V. Same operations on O in the same order.
  auto settle = [&](int kv) {
    wg_wait<0>();
    fence_acc(o);
    mbar_arrive(v_empty(stage(kv)));
    rescale_o(o, factor);
  };
  // Issue O += P_hat V_hat of key tile kt (asynchronous), in this warpgroup's
  // turn: the stage wait, settle (kt - 1) if asked, turn_wait, the batch (the
  // caller passes the turn).
  // NOTE: the stage waits come before turn_wait (as FA3's consumer_wait
  // before its scheduler barrier): their try-wait branch also keeps ptxas
  // from hoisting the turn's BAR.SYNC above the softmax before it (seen with
  // the branch-free softmax_tile: every MUFU.EX2 of the first tile of the
  // unrolled pair inside the turn). No wait can deadlock: a stage the
  // warpgroup waits for needs only the other warpgroup's earlier turns.
  auto pv_issue = [&](const uint32_t (&pa)[kNT / 4][4], int kt, bool settle_prev) {
    const uint32_t sV = v_tile(kt);
    if (settle_prev) settle(kt - 1);
    turn_wait();
    fence_acc(o);
    wg_arrive();
    pv_batch(pa, sV);
  };
  // Both: QK^T (kt) then P V (kv), two commit groups (waits, settle (kv - 1)
  // and turn as in pv_issue).
  auto qk_pv_issue = [&](float (&acc)[kBlockN / 2], int kt, const uint32_t (&pa)[kNT / 4][4], int kv,
                         bool settle_prev) {
    const uint32_t sK = k_tile(kt);
    const uint32_t sV = v_tile(kv);
    if (settle_prev) settle(kv - 1);
    turn_wait();
    fence_acc(acc);
    fence_acc(o);
    wg_arrive();
    qk_batch(acc, sK);
    pv_batch(pa, sV);
  };
  // Masked entries of tile kt (keys past seqlen_k, outside the row's window:
  // numerics.md section 14; causal is the window (-1, 0)) -> -inf. Only
  // where the tile is not inside every window of the warp's 16 rows
  // (window_covers(key0, kBlockN, row_w0, 16, diag, wl, wr) and no key past
  // seqlen_k), which holds iff kt_nomask_lo <= kt < kt_mask:
  //   no key past Sk:   key0 + kBlockN <= Sk                  <=> kt < Sk >> 7;
  //   right bound (the warp's first row's last key):
  //     key0 + kBlockN - 1 <= row_w0 + diag + wr              <=> kt < ((row_w0 + diag + wr - 127) >> 7) + 1;
  //   left bound (the warp's last row's first key):
  //     key0 >= row_w0 + 15 + diag - wl                       <=> kt >= (row_w0 + 15 + diag - wl + 127) >> 7
  // (floor division by the arithmetic shift, ceil as floor of + 127).
  // NOTE: one unsigned compare per tile (the test was ~8 instructions):
  // kt - kt_nomask_lo wraps for kt < kt_nomask_lo (both >= 0).
  static_assert(kBlockN == 128, "kt_mask's shifts");
  const int kt_mask = wr < 0 ? Sk >> 7 : min(Sk >> 7, ((row_w0 + diag + wr - (kBlockN - 1)) >> 7) + 1);
  const int kt_nomask_lo = wl < 0 ? 0 : max(0, (row_w0 + 15 + diag - wl + (kBlockN - 1)) >> 7);
  const uint32_t n_nomask = static_cast<uint32_t>(max(0, kt_mask - kt_nomask_lo));
  auto mask = [&](float (&sacc)[kBlockN / 2], int kt) {
    const int key0 = kt * kBlockN;
    if (static_cast<uint32_t>(kt - kt_nomask_lo) < n_nomask) return;
    int lo[2], hi[2];  // row r sees the keys [lo[r], hi[r]]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + 8 * r;
      lo[r] = wl < 0 ? 0 : row + diag - wl;
      hi[r] = wr < 0 ? Sk - 1 : min(Sk - 1, row + diag + wr);
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * j + 2 * tig + (e & 1);
        const int r = e >> 1;
        if (key < lo[r] || key > hi[r]) sacc[4 * j + e] = -INFINITY;
      }
  };
  // A tile none of this warpgroup's rows sees: take part in the stage hand-over only.
  auto handover = [&](int kt) {
    const int s = stage(kt);
    const uint32_t ph = phase(kt);
    mbar_wait(k_full(s), ph);
    mbar_arrive(k_empty(s));
    mbar_wait(v_full(s), ph);
    mbar_arrive(v_empty(s));
  };

  mbar_wait(tile_bar<kStages>(bar, kTbQFull, 0), it & 1);

  if constexpr (T::kOverlap) {
    // NOTE: the phases (turns of the pingpong) of every warpgroup number
    // kt1 - kt0 + 1, whatever its [m_begin, m_end): the tiles it does not see
    // are handed over inside dummy turns, in order (those before m_begin one
    // per turn ahead of its first QK^T, so phase kt - kt0 issues K tile kt in
    // both warpgroups; those from m_end after its last P V), so neither
    // warpgroup waits on a stage the other still holds.
    float sacc[kBlockN / 2];
    uint32_t pa[kNT / 4][4];
    for (int kt = kt0; kt < m_begin; ++kt) {
      turn_wait();
      turn_pass();
      handover(kt);
    }
    if (m_end > m_begin) {
      turn_wait();
      qk_issue(sacc, m_begin);
      turn_pass();
      const float sk = __ldg(ks_g + m_begin), sv = __ldg(vs_g + m_begin);
      wg_wait<0>();
      fence_acc(sacc);
      mbar_arrive(k_empty(stage(m_begin)));
      if constexpr (kSoftcap) softcap_tile<kNT>(sacc, sk, st, sc);
      mask(sacc, m_begin);
      softmax_tile<kNT, kSoftcap>(sacc, sk, sv, st, pa, factor);  // O = 0: no rescale
      // One tile: settle (kt - 2) (none at kt = m_begin + 1: P V (m_begin) is
      // issued here, and O = 0 takes no rescale), QK^T (kt) with P V (kt - 1)
      // from pa_prev; softmax (kt) into pa_new.
      // NOTE: two P arrays in fixed roles (the loop is unrolled by two): a
      // copy pa = pn lets ptxas give both the same registers, so the softmax
      // would define the A operand of the P V still in flight (C7513).
      auto step = [&](int kt, const uint32_t (&pa_prev)[kNT / 4][4], uint32_t (&pa_new)[kNT / 4][4]) {
        qk_pv_issue(sacc, kt, pa_prev, kt - 1, kt > m_begin + 1);
        turn_pass();
        const float skn = __ldg(ks_g + kt), svn = __ldg(vs_g + kt);
        wg_wait<1>();  // S (kt); P V (kt - 1) may still run
        fence_acc(sacc);
        mbar_arrive(k_empty(stage(kt)));
        if constexpr (kSoftcap) softcap_tile<kNT>(sacc, skn, st, sc);
        mask(sacc, kt);
        softmax_tile<kNT, kSoftcap>(sacc, skn, svn, st, pa_new, factor);
      };
      uint32_t pb[kNT / 4][4];
      int kt = m_begin + 1;
      for (; kt + 1 < m_end; kt += 2) {
        step(kt, pa, pb);
        step(kt + 1, pb, pa);
      }
      auto last_pv = [&](const uint32_t (&pa_last)[kNT / 4][4]) {
        pv_issue(pa_last, m_end - 1, m_end - m_begin > 1);  // settles P V (m_end - 2), if any
        turn_pass();
        wg_wait<0>();
        fence_acc(o);
        mbar_arrive(v_empty(stage(m_end - 1)));
      };
      // NOTE: the odd tail calls the last P V on pb itself (a copy pa = pb
      // would be coalesced, C7513 again).
      if (kt < m_end) {
        step(kt, pa, pb);
        last_pv(pb);
      } else {
        last_pv(pa);
      }
    } else {
      turn_wait();
      turn_pass();
    }
    for (int kt = m_end; kt < kt1; ++kt) {
      turn_wait();
      turn_pass();
      handover(kt);
    }
    if constexpr (kPingpong) {
      // Consumes warpgroup 1's last pass (every arrive is matched); before
      // the CTA's next work tile warpgroup 0's first turn_wait does it.
      if (cw == 0 && last) turn_wait();
    }
  } else {
    // Serial order (dv = 256): QK^T, softmax, O *= factor, P V, per tile.
    for (int kt = kt0; kt < m_begin; ++kt) handover(kt);
    for (int kt = m_begin; kt < m_end; ++kt) {
      float sacc[kBlockN / 2];
      uint32_t pa[kNT / 4][4];
      qk_issue(sacc, kt);
      const float sk = __ldg(ks_g + kt), sv = __ldg(vs_g + kt);
      wg_wait<0>();
      fence_acc(sacc);
      mbar_arrive(k_empty(stage(kt)));
      if constexpr (kSoftcap) softcap_tile<kNT>(sacc, sk, st, sc);
      mask(sacc, kt);
      softmax_tile<kNT, kSoftcap>(sacc, sk, sv, st, pa, factor);
      rescale_o(o, factor);
      pv_issue(pa, kt, false);
      wg_wait<0>();
      fence_acc(o);
      mbar_arrive(v_empty(stage(kt)));
    }
    for (int kt = m_end; kt < kt1; ++kt) handover(kt);
  }
  mbar_arrive(tile_bar<kStages>(bar, kTbQEmpty, 0));  // this thread's reads of Q are done

  // O [B, Hq, Sq, Dv] and LSE [B, Hq, Sq] (dense); a packed batch: O token-major
  // [total_q, Hq, Dv], LSE [Hq, total_q] (varlen_sm90.h).
  if constexpr (kVarlen)
    store_o_lse<kDv>(o, st, p.out, p.lse, (si.tok_q * p.num_heads_q + bhq) * kDv,
                     static_cast<int64_t>(p.num_heads_q) * kDv, bhq * p.seqlen_q + si.tok_q, Sq, row0, tig);
  else
    store_o_lse<kDv>(o, st, p.out, p.lse, bhq * Sq * kDv, kDv, bhq * Sq, Sq, row0, tig);
}

}  // namespace sm90
}  // namespace fp8attn
