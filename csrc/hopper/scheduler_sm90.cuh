// fp8attn: which (query tile, head, batch) a CTA of the sm_90a `tile`
// forward computes, and where each sequence lies. Layout notes:
// ../shared/design/kernel-layout.md ("how are tiles ordered").
//
// Default: one CTA per work tile (grid = (query tiles, query heads, batch),
// launch_sm90.h splits grids past 65535), heaviest causal tiles first: with
// causal masking the last query tile sees the most keys, so blockIdx.x = 0
// takes it (the block scheduler hands out low indices first and the short
// tiles fill the tail). Persistent (FP8ATTN_TILE_PERSISTENT=1, default off
// until measured): gridDim.x = min(work tiles, SMs) CTAs, CTA c computes the
// work tiles c, c + gridDim.x, ... of one linear longest-first order
// (work_tile_at: every (head, batch)'s last query tile, then the one before,
// ...), so the tiles of a wave have about equal length and the shortest come
// last; the CTA's barriers and pipeline stages carry over from tile to tile.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params_sm90.h"
#include "hopper/varlen_sm90.h"

namespace fp8attn {
namespace sm90 {

// One sequence of a work tile: its lengths, its first token in the
// token-indexed arrays and its first row in the padded code arrays
// (varlen_sm90.h). NOTE: the single place sequence boundaries come from.
// Dense: every batch entry has seqlen_q / seqlen_k at offset 0 (its (batch,
// head) row gives the rest); varlen: from the metadata of cu_seqlens.
struct SeqInfo {
  int seqlen_q, seqlen_k;
  int64_t tok_q, tok_k;  // first token of the sequence (token-indexed arrays)
  int64_t row_q, row_k;  // first row in the padded code arrays (multiple of 128)
};
__device__ __forceinline__ SeqInfo seq_info(const KernelParams& p, int /*batch*/) {
  return {p.seqlen_q, p.seqlen_k, 0, 0, 0, 0};
}
// Sequence s of a packed batch (s < 0: an empty one, for a padded tile no
// sequence owns).
__device__ __forceinline__ SeqInfo varlen_seq_info(const KernelParams& p, int s) {
  if (s < 0) return {0, 0, 0, 0, 0, 0};
  const VarlenMetaLayout L{p.num_seqs, p.q_tiles_max, p.k_tiles_max};
  const int* m = p.varlen_meta;
  return {m[L.len_q() + s], m[L.len_k() + s], m[L.tok_q() + s], m[L.tok_k() + s],
          int64_t{128} * m[L.tiles_q() + s], int64_t{128} * m[L.tiles_k() + s]};
}
// The sequence owning padded query tile t (-1: none).
__device__ __forceinline__ int varlen_qtile_seq(const KernelParams& p, int t) {
  const VarlenMetaLayout L{p.num_seqs, p.q_tiles_max, p.k_tiles_max};
  return p.varlen_meta[L.qtile_seq() + t];
}
__device__ __forceinline__ int varlen_ktile_seq(const KernelParams& p, int t) {
  const VarlenMetaLayout L{p.num_seqs, p.q_tiles_max, p.k_tiles_max};
  return p.varlen_meta[L.ktile_seq() + t];
}
// Padded query row R (0 <= R < seqlen_q_pad, one head) of a packed batch:
// false for a padding row (its tile has no sequence, or it lies past the
// sequence's queries); else si = its sequence, local = R - si.row_q (token
// si.tok_q + local). For the row-wise kernels that walk the padded rows (the
// backward's dQ convert, delta, diagnostics).
__device__ __forceinline__ bool varlen_q_row(const KernelParams& p, int64_t R, SeqInfo& si, int& local) {
  const int s = varlen_qtile_seq(p, static_cast<int>(R / 128));
  if (s < 0) return false;
  si = varlen_seq_info(p, s);
  local = static_cast<int>(R - si.row_q);
  return local < si.seqlen_q;
}

struct WorkTile {
  int m_tile, head_q, batch;
};

// Longest-first order of the query tiles of one (head, batch).
__device__ __forceinline__ WorkTile tile_of() {
  WorkTile w;
  w.m_tile = static_cast<int>(gridDim.x - 1 - blockIdx.x);
  w.head_q = static_cast<int>(blockIdx.y);
  w.batch = static_cast<int>(blockIdx.z);
  return w;
}

// Work tile L of the persistent order over n_m query tiles x n_h query heads
// x n_b batch entries (0 <= L < n_m n_h n_b): query tile n_m - 1 - L / (n_h
// n_b) (longest first), then head, then batch entry.
__device__ __forceinline__ WorkTile work_tile_at(int64_t L, int n_m, int n_h, int n_b) {
  const int64_t hb = static_cast<int64_t>(n_h) * n_b;
  const int64_t r = L % hb;
  WorkTile w;
  w.m_tile = n_m - 1 - static_cast<int>(L / hb);
  w.batch = static_cast<int>(r / n_h);
  w.head_q = static_cast<int>(r - static_cast<int64_t>(w.batch) * n_h);
  return w;
}

// Key tiles [begin, end) that query rows [row_begin, row_end) see under the
// window of p (bottom-right aligned, numerics.md sections 1 and 14: causal is
// the window (-1, 0), no mask (-1, -1), so begin is 0 for both). {0, 0} for
// an empty row range or rows that see no key.
__device__ __forceinline__ IndexRange key_tiles_seen(int row_begin, int row_end, const SeqInfo& s,
                                                     const KernelParams& p, int block_n) {
  const IndexRange k = window_keys(row_begin, row_end, s.seqlen_q, s.seqlen_k, p.window_left, p.window_right);
  return {k.begin / block_n, (k.end + block_n - 1) / block_n};
}

}  // namespace sm90
}  // namespace fp8attn
