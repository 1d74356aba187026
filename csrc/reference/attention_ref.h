// fp8attn: CPU reference attention, the oracle for every test and the path
// that runs where there is no GPU. Math: numerics.md sections 1 (exact path; masks:
// also section 14, sliding windows)
// and 2-5 (fp8 path, delta modes, diagnostics).
//
// Conventions shared by every function below
// - Views: q [batch, seqlen_q, num_heads_q, head_dim_qk], k [batch, seqlen_k,
//   num_heads_kv, head_dim_qk], v [batch, seqlen_k, num_heads_kv, head_dim_v],
//   o/dout/dq [batch, seqlen_q, num_heads_q, *], dk/dv like k/v. Any strides
//   (TensorView) with a unit head_dim stride; dtype kFloat32, kFloat64 or
//   kBFloat16 (uint16 storage). Outputs are rounded to their view's dtype with
//   round-to-nearest-even. Only positions inside [0, seqlen) are read.
// - lse: contiguous FP32 [batch, num_heads_q, seqlen_q], natural log.
// - GQA: query head h uses key/value head h / (num_heads_q / num_heads_kv);
//   dk/dv are the sums over the query heads of the group.
// - causal (bottom-right): query i sees key j iff j <= i + (seqlen_k - seqlen_q).
//   Sliding window (p.window_left / p.window_right, FlashAttention's window_size;
//   numerics.md section 14): query i sees key j iff j >= i + (seqlen_k - seqlen_q) -
//   window_left (window_left >= 0) and j <= i + (seqlen_k - seqlen_q) + window_right
//   (window_right >= 0); a negative bound is unbounded; causal forces window_right =
//   0, so causal is the window (-1, 0). A row sees a contiguous range of keys.
//   A row that sees no key gets O = 0, LSE = -inf and zero gradients.
// - Multi-threaded with p.num_threads std::threads (0 = all cores); results
//   are bitwise identical for every thread count.
//
// Precision::kExact: FP64 accumulation throughout (FP64 inputs stay FP64;
//   tau is the FP32 p.softmax_scale widened to FP64).
//   delta_i = sum_j P_ij dP_ij for every delta mode (all modes coincide in
//   exact arithmetic). The backward recomputes LSE in FP64 from Q, K (the lse
//   argument is not read), so gradients are FP64-accurate.
//
// Precision::kFP8: the seven block-scaled FP8 matmuls of numerics.md section
//   3, everything else in FP32.
//   - Block grid: blocks of B = p.block_size consecutive elements along each
//     matmul's reduction dimension, starting at index 0 of the (batch, head)
//     sequence (or of head_dim); the last block is shorter when the length is
//     not a multiple of B (so B = length when the length is below B). The key
//     tiles of the forward online softmax are the blocks of matmul #2, and the
//     query blocks of matmuls #5/#7 are rows [0, B), [B, 2B), ...
//     One exception: the dS operand of #6 (dQ = dS K) is blocked per query row
//     along keys in Bds = min(B, 64) keys, aligned at multiples of Bds from
//     key 0 (K stays in B-blocks); each sub-block's partial is promoted with
//     s_dS(row, sub-block) * s_K(channel, B-block), in increasing key order.
//   - Each per-block partial product is summed in FP32 over the FP8 values
//     (unscaled), then multiplied by the two block scales and added to an FP32
//     accumulator; tau = softmax_scale multiplies the finished S, dQ, dK.
//   - Masking happens before quantization: masked (causal, window) entries are
//     exact zeros in P and dS, and a K/V (Q/dO) block feeding output row i (output
//     key column j) is quantized from the positions that row (column) sees
//     only (the visible part of a tile: a prefix, a suffix, or a middle range
//     under a window narrower than the tile). So a NaN in K/V at key j never reaches O/dQ of a query row that
//     does not see j, and a NaN in Q/dO of row i never reaches dK/dV of a key
//     that row i does not see. NaN/inf anywhere else in a block makes that
//     block's contributions NaN (propagated, never saturated). On finite data
//     this equals quantizing whole tiles (as a GPU kernel does) except when a
//     visible element is FP8-subnormal under one of the two scales, because
//     power-of-two scales leave the rounding of normal FP8 values unchanged.
//   - Forward: online softmax over key tiles of B in increasing order; the
//     unnormalized tile exp(S - m_running) is quantized per row (the P block
//     of #2), the accumulator is rescaled when the running max changes,
//     O = acc / l and LSE = m + log(l) with l the FP32 sum of the unquantized
//     exp values. Backward: P = exp(S - lse) in FP32 from the same Q_hat,
//     K_hat (so lse must be the forward's), delta per p.delta_mode
//     (numerics.md section 4), dS = P o (dP_hat - delta) in FP32.
//   - Formats: Q, K, V, P in E4M3; dO and dS in p.grad_format.
//   The above is p.scaling == Scaling::kRow. Scaling::kTile (numerics.md
//   section 9) keeps everything but the blocking, with T = p.block_size as
//   the tile edge and head_dim never split: Q and dO (#3, #4) one scale per
//   query row; K and V one scale per tile of T keys (one K_hat for #1/#3/#6,
//   one V_hat for #2/#4); P (forward) one per (row, key tile); dS (#6) one
//   per (row, key half of T/2 keys), each half's dQ partial summed on its own;
//   Q (#7) and dO (#5) one per tile of T queries; P (#5) and dS (#7) one per
//   (query sub-tile of T/2 queries, key half of T/2 keys) block, sub-tiles
//   and halves starting at token 0 of the tile (two per tile; a last tile of
//   at most T/2 queries / keys has one). Each partial product is one FP32 sum
//   (over all of head_dim for #1/#3/#4; over the keys of one half for #6;
//   over the queries of one sub-tile for #5/#7, added in increasing sub-tile
//   order) times the product of its two scales. The masking rule is
//   the same: a block a row (key column) reads is quantized from the keys
//   (query rows) it sees, so K/V tiles of a partially visible tile use the
//   visible keys, Q/dO the rows of the query tile that see the key column,
//   and the P/dS blocks of #5/#7 the rows of the query sub-tile that see it.
//   Delta-Matching's delta (and every row sum) is over the keys the row sees.
//
// Outlier transforms (numerics.md section 10; both precisions, both
// scalings): p.qk_rotation == kHadamard replaces Q, K by Q R, K R (R the
// block-diagonal normalized Hadamard matrix of reference/qk_transform.h) and
// p.smooth_k subtracts the mean key of each (batch, kv head) from K first,
// in FP32 (fp8 path; FP64 exact path), stored in the input dtype when it is
// bfloat16 (fp8 path), before the paths above run on them unchanged. The
// forward's lse is that of the untransformed logits (smooth_k: the path's
// LSE' plus tau <q_i, m>); the backward takes that lse, shifts it back and
// maps dQ', dK' back (dQ = dQ' R^T; dK = dK' R^T minus its mean over keys).
// With smooth_k a non-finite key makes every row of its (batch, kv head)
// that sees a key NaN.
//
// Logit softcapping (numerics.md section 12; both precisions, both scalings):
// p.softcap = c > 0 replaces the scaled logits x = tau S by c tanh(x / c) before
// the softmax; the backward multiplies the softmax-input gradient by
// 1 - tanh^2(x / c) before the dS quantizations (rowsum_pre diagnostics are of the
// softmax-input gradient). Not with smooth_k.
//
// Errors: ArgumentError (common/error.h) naming the offending argument.
#pragma once

#include <cstdint>

#include "common/params.h"

namespace fp8attn {

// Validates the scalar parameters: batch/seqlen_q/seqlen_k >= 0, num_heads_q
// and num_heads_kv >= 1 with num_heads_q a multiple of num_heads_kv, head_dim_qk
// and head_dim_v in [1, 256], softmax_scale positive and finite, precision /
// delta_mode / grad_format / scaling valid enum values, block_size in
// {32, 64, 128}, num_threads >= 0. Throws ArgumentError naming the argument.
void check_attention_params(const AttnParams& p);

// Optional helper for bindings: checks tensor sizes given in the views' logical
// order [batch, seqlen, heads, head_dim] against each other and against p
// (e.g. k's head_dim must equal q's: "k" / head_dim_qk). Any pointer may be null
// to skip that tensor. q/k/v as in the forward; o, dout, dq as q but with
// head_dim_v (o, dout) or head_dim_qk (dq); dk like k; dv like v.
void check_attention_shapes(const AttnParams& p, const int64_t* q_sizes, const int64_t* k_sizes,
                            const int64_t* v_sizes, const int64_t* o_sizes = nullptr,
                            const int64_t* dout_sizes = nullptr, const int64_t* dq_sizes = nullptr,
                            const int64_t* dk_sizes = nullptr, const int64_t* dv_sizes = nullptr);

// Forward (numerics.md sections 1 and 3, matmuls #1-#2). q,k,v,o: strided
// views (see TensorView); o has the dtype the caller wants (rounded to it with
// RNE). lse: contiguous FP32 [batch, num_heads_q, seqlen_q], natural log;
// -inf for a row that sees no key (then O row = 0).
// Throws ArgumentError for bad parameters or null data pointers.
void attention_forward_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& o, float* lse);

// Backward (numerics.md sections 1, 3 #3-#7, 4, 5). o: the saved forward
// output (used by the stale / matched_do deltas of the fp8 path); lse from the
// forward (fp8 path: P = exp(S - lse) in FP32). dq/dk/dv: strided outputs, fully
// written (GQA: dk/dv summed over the query heads of the group). diag: optional
// per-row diagnostics (numerics.md section 5, see BackwardDiagnostics); nullptr
// or null members = off. Diagnostic row sums are accumulated in FP64 over the
// FP32 (pre-cast) or decoded FP8 (post-cast: the matmul #6 operand, with its
// Bds-key scales) dS. In the exact path eps = 0 and rowsum_post = rowsum_pre.
// Rows that see no key get delta = eps = rowsum = 0. Every view and lse must
// be non-null when its tensor is non-empty, also where the selected path/mode
// does not read it.
// p.sharded (context parallelism, numerics.md section 11): with ->delta set,
// delta_mode must be delta_matching and each row's delta is ->delta[row], P =
// exp(S - lse) with the lse given (no renormalization); fp8 path only, no qk
// transforms, diag must be null.
// Throws ArgumentError for bad parameters or null data pointers.
void attention_backward_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& dout,
                            const float* lse, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv, const BackwardDiagnostics* diag);

// The Delta-Matching pre-pass over one shard of the key axis (context
// parallelism, numerics.md section 11): per query row, the FP32 partial sums
// sum_pdp_i = sum_j P_ij dP_hat_ij and sum_p_i = sum_j P_ij over this call's
// keys, P = exp(S - lse) from the given lse (the forward's, over all shards),
// in the key order of the unsharded pre-pass. No gradients. sum_pdp, sum_p:
// contiguous FP32 [batch, num_heads_q, seqlen_q]; rows that see no key get 0.
// The main pass of a shard is attention_backward_ref with p.sharded->delta =
// (sum over shards of sum_pdp) / (sum of sum_p) and lse = LSE + ln(sum of sum_p).
// fp8 path only, no qk transforms. Throws ArgumentError naming the argument.
void attention_dm_sums_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& dout, const float* lse,
                           float* sum_pdp, float* sum_p);

}  // namespace fp8attn
