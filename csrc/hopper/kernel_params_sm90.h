// fp8attn: the one parameter struct of the sm_90a CUDA kernels (quantization,
// forward, backward). Built from AttnParams (common/params.h) by the launcher in
// csrc/torch/ops_cuda.cpp. Math: docs/numerics.md sections 2-5.
//
// Quantized operand layouts (all FP8 codes are uint8; scales FP32; "row" =
// blocked along head_dim, "col" = blocked along the sequence, stored
// TRANSPOSED so the sequence is the contiguous dimension, which is also the
// K-major layout that FP8 tensor-core MMAs need for those products):
//
//   q_row  [B, Hq,  Sq, Dqk]       scale q_row_s  [B, Hq,  Sq, nblk(Dqk)]   matmuls #1 #3
//   k_row  [B, Hkv, Sk, Dqk]       scale k_row_s  [B, Hkv, Sk, nblk(Dqk)]   matmuls #1 #3
//   v_row  [B, Hkv, Sk, Dv]        scale v_row_s  [B, Hkv, Sk, nblk(Dv)]    matmul  #4
//   do_row [B, Hq,  Sq, Dv]        scale do_row_s [B, Hq,  Sq, nblk(Dv)]    matmul  #4 (grad_format)
//   v_colT  [B, Hkv, Dv,  Sk_pad]  scale v_col_s  [B, Hkv, Dv,  nblk_k]     matmul  #2
//   k_colT  [B, Hkv, Dqk, Sk_pad]  scale k_col_s  [B, Hkv, Dqk, nblk_k]     matmul  #6
//   q_colT  [B, Hq,  Dqk, Sq_pad]  scale q_col_s  [B, Hq,  Dqk, nblk_q]     matmul  #7
//   do_colT [B, Hq,  Dv,  Sq_pad]  scale do_col_s [B, Hq,  Dv,  nblk_q]     matmul  #5 (grad_format)
//
// nblk(D) = ceil(D / min(128, D)) blocks along head_dim (block length
// min(block_size, D)); along the sequence, blocks of block_size tokens starting
// at token 0 of each (batch, head); nblk_k = ceil(Sk / block_size). *_pad is the
// sequence length rounded up to a multiple of 16 (16-byte rows); padding codes
// are 0 and are never used. Everything is contiguous in the order written.
//
// scaling == 1 (`tile` recipe, numerics.md section 9): the same code arrays,
// scales one per row or per 128-token tile over all of head_dim:
//   q_row_s, do_row_s [B, Hq, Sq]; k_row_s, v_row_s, k_col_s, v_col_s
//   [B, Hkv, nblk_k]; q_col_s, do_col_s [B, Hq, nblk_q] (k_colT / v_colT hold
//   the same codes as k_row / v_row, transposed; quant_tilescale_e4m3_sm90.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fp8attn {
namespace sm90 {

struct KernelParams {
  // Problem (same meaning as AttnParams).
  int batch, seqlen_q, seqlen_k, num_heads_q, num_heads_kv, head_dim_qk, head_dim_v;
  int block_size;          // sequence block (tokens); 128 on CUDA
  float softmax_scale;
  bool causal;
  // Key window (numerics.md section 14) after effective_window (common/params.h):
  // query i sees key j iff j >= i + (seqlen_k - seqlen_q) - window_left and j <=
  // i + (seqlen_k - seqlen_q) + window_right, -1 = unbounded side. The launcher
  // sets it for every call: (-1, -1) no mask, (-1, 0) with causal = true, a
  // sliding window only with scaling == 1 (the `tile` kernels read these two,
  // the `row` kernels read `causal`).
  int window_left, window_right;
  int delta_mode;          // DeltaMode
  int grad_format;         // Fp8Format of dO and dS
  int scaling;             // Scaling: 0 = `row`, 1 = `tile` (the scale layouts above)
  // Logit softcap c (numerics.md section 12): the scaled logits x = tau S become
  // c tanh(x / c) before the softmax; 0 = off. Only the dense `tile` kernels take
  // c > 0 (their kSoftcap instantiations; run_fwd_tile / run_bwd refuse it
  // elsewhere). NOTE: placed in the padding before the pointers, so no other
  // field moves (sizeof 480, the same parameter offsets as without it).
  float softcap;

  // BF16 inputs/outputs at the op boundary, strided [b, s, h, d] (unit d stride).
  const void *q, *k, *v, *o, *dout;
  int64_t q_sb, q_ss, q_sh;  // strides (elements): batch, seq, head
  int64_t k_sb, k_ss, k_sh;
  int64_t v_sb, v_ss, v_sh;
  int64_t o_sb, o_ss, o_sh;
  int64_t do_sb, do_ss, do_sh;
  void *out, *dq, *dk, *dv;  // outputs, contiguous [B, H, S, D] (BF16)
  float* lse;                // [B, Hq, Sq]

  // Quantized operands (layouts above).
  uint8_t *q_row, *k_row, *v_row, *do_row, *v_colT, *k_colT, *q_colT, *do_colT;
  float *q_row_s, *k_row_s, *v_row_s, *do_row_s, *v_col_s, *k_col_s, *q_col_s, *do_col_s;
  int seqlen_q_pad, seqlen_k_pad;

  // Backward workspace and diagnostics.
  float* delta;      // [B, Hq, Sq] delta used by the backward
  float* delta_dm;   // [B, Hq, Sq] Delta-Matching delta (diagnostics: eps)
  float* lse_bwd;    // [B, Hq, Sq] or nullptr: the backward-consistent LSE the pre-pass
                     // writes, read by a delta_matching main kernel (prepass_delta_sm90.cuh)
  float* dq_accum;   // FP32 accumulation buffer, [B, Hq, dq_accum_rows(scaling, Sq), Dqk] (layout below)
  float* diag;       // [4, B, Hq, Sq] or nullptr: delta, eps, rowsum_pre, rowsum_post
  float* rowsum_ws;  // [4, B, Hq, Sq] workspace: sum dS, sum |dS| pre and post cast
  // Deterministic backward (`tile` recipe, dense; bwd(deterministic=True)): nullptr, or
  // int32 [B, Hq, dq_sem_subtiles(Sq), slices] zeros, one turn counter per 64-query
  // sub-tile and head-dim slice: the main kernel's warpgroups add their dQ partials
  // into dq_accum one after another in a fixed order (key tile, then warpgroup), so
  // dQ is the same bit for bit from run to run (bwd_tilescale_e4m3_sm90.cu, "turns").
  int* dq_sem;

  // Packed variable-length batches (varlen_sm90.h; `tile` kernels only):
  // num_seqs > 0 sequences described by varlen_meta (int32 metadata on the
  // device), batch == 1, seqlen_q / seqlen_k the total token counts (the
  // token-indexed arrays), seqlen_q_pad / seqlen_k_pad = q_tiles_max / k_tiles_max
  // * 128 (the padded rows of codes, scales and dq_accum), outputs token-major
  // [total, H, D]. num_seqs == 0: a dense batch, the fields below unused.
  int num_seqs;
  int q_tiles_max, k_tiles_max;
  const int* varlen_meta;

  // Context parallelism (numerics.md section 11), both 0 otherwise.
  // delta_given: `delta` holds the Delta-Matching delta of a sharded key axis and
  //   `lse` the global LSE': no pre-pass, the main kernel reads both as given.
  // prepass_sums: run only the pre-pass, which writes the raw partial sums
  //   sum_j P dP_hat to delta_dm and sum_j P to lse_bwd (prepass_delta_sm90.cuh).
  int delta_given;
  int prepass_sums;
};

// softcap sits in the padding that followed `scaling` (no other field moved).
static_assert(offsetof(KernelParams, q) == offsetof(KernelParams, softcap) + sizeof(float) || sizeof(void*) != 8,
              "KernelParams::softcap: expected in the padding before the pointers");

// Rows per (batch, head) of the row-major codes and per-token scales (q_row,
// do_row, q_row_s, do_row_s; k_row, v_row): seqlen (dense), the padded rows
// (varlen, varlen_sm90.h). Tiles per (batch, head) of the per-tile scales:
// ceil(rows / 128) in both.
constexpr int64_t code_rows_q(const KernelParams& p) { return p.num_seqs > 0 ? p.seqlen_q_pad : p.seqlen_q; }
constexpr int64_t code_rows_k(const KernelParams& p) { return p.num_seqs > 0 ? p.seqlen_k_pad : p.seqlen_k; }
constexpr int64_t scale_tiles_q(const KernelParams& p) { return (code_rows_q(p) + 127) / 128; }
constexpr int64_t scale_tiles_k(const KernelParams& p) { return (code_rows_k(p) + 127) / 128; }

// Half-open index range [begin, end); {0, 0} when empty.
struct IndexRange {
  int begin, end;
};
// Keys that the query rows [r0, r1) see under the window (left, right) (-1
// unbounded; KernelParams::window_left): the union of their windows, which is
// contiguous (numerics.md section 14). Rows past seqlen_q see nothing.
// constexpr: callable from device code (--expt-relaxed-constexpr).
constexpr IndexRange window_keys(int r0, int r1, int seqlen_q, int seqlen_k, int left, int right) {
  if (r1 > seqlen_q) r1 = seqlen_q;
  if (r1 <= r0) return {0, 0};
  const int off = seqlen_k - seqlen_q;
  int b = left < 0 ? 0 : r0 + off - left;
  int e = right < 0 ? seqlen_k : r1 + off + right;
  if (b < 0) b = 0;
  if (e > seqlen_k) e = seqlen_k;
  return e > b ? IndexRange{b, e} : IndexRange{0, 0};
}
// Query rows that see a key of [k0, k1) (query i sees key j iff j - off - right
// <= i <= j - off + left); keys past seqlen_k are seen by none.
constexpr IndexRange window_queries(int k0, int k1, int seqlen_q, int seqlen_k, int left, int right) {
  if (k1 > seqlen_k) k1 = seqlen_k;
  if (k1 <= k0) return {0, 0};
  const int off = seqlen_k - seqlen_q;
  int b = right < 0 ? 0 : k0 - off - right;
  int e = left < 0 ? seqlen_q : k1 - off + left;
  if (b < 0) b = 0;
  if (e > seqlen_q) e = seqlen_q;
  return e > b ? IndexRange{b, e} : IndexRange{0, 0};
}
// The query tiles [m_first, m_end) of `tile` rows that see a key of key tile n
// (the `tile` backward's CTA of key tile n walks them; {0, 0}: none).
constexpr IndexRange query_tiles_of_key_tile(int n, int tile, int seqlen_q, int seqlen_k, int left, int right) {
  const IndexRange qr = window_queries(n * tile, n * tile + tile, seqlen_q, seqlen_k, left, right);
  return {qr.begin / tile, (qr.end + tile - 1) / tile};
}
// The last of the key tiles [0, nblk_k) whose query tiles (above) hold query tile m,
// for an m that some key tile's do: one before the first n with m_first(n) > m.
// The key tiles holding m are contiguous and m_first, m_end are nondecreasing in n
// (a key tile no query sees, {0, 0}, is a leading one, cut off by `left`; host test
// tests/cpp/test_cuda_shapes.cpp). The deterministic backward's first dQ turn.
constexpr int last_key_tile_of(int m, int tile, int nblk_k, int seqlen_q, int seqlen_k, int left, int right) {
  int lo = 0, hi = nblk_k;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (query_tiles_of_key_tile(mid, tile, seqlen_q, seqlen_k, left, right).begin > m)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo - 1;
}
// Every key of [k0, k0 + nk) inside the window of every query of [m0, m0 + nq)
// (the window's part of a tile pair's "no mask needed" test).
constexpr bool window_covers(int k0, int nk, int m0, int nq, int off, int left, int right) {
  return (right < 0 || k0 + nk - 1 <= m0 + off + right) && (left < 0 || k0 >= m0 + nq - 1 + off - left);
}

// Rows per (batch, query head) of KernelParams::dq_accum. `row` (scaling 0):
// seqlen_q, row-major [query][Dqk]. `tile` (scaling 1): seqlen_q rounded up to
// 64, in 64-query chunks of 64 x Dqk floats (the main kernel adds each one
// with TMA bulk reduce-adds, bwd_tilescale_e4m3_sm90.cu): chunk c of (b, h) at
// ((b Hq + h) rows + 64 c) Dqk, 64-column panel P (columns [64 P, 64 P + 64))
// at 4096 P within it, and inside a panel the order of a warpgroup's m64n64
// accumulator fragments: float ((((w * 2 + r8) * 8 + j) * 32 + lane) * 2 + e)
// is query 16 w + 8 r8 + lane / 4, column 8 j + 2 (lane % 4) + e of the panel
// (conflict-free 8-byte shared-memory stores, whole chunks to reduce).
// constexpr: callable from device code (--expt-relaxed-constexpr).
constexpr int64_t dq_accum_rows(int scaling, int64_t seqlen_q) {
  return scaling == 1 ? (seqlen_q + 63) / 64 * 64 : seqlen_q;
}

}  // namespace sm90
}  // namespace fp8attn
