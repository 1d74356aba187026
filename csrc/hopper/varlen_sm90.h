// fp8attn: packed variable-length batches on the sm_90a `tile` kernels
// (varlen_attention in one launch per kernel; numerics.md section 7: the FP8
// block grid restarts at token 0 of every sequence; issue 19).
//
// Token layout (what the caller passes): Q [total_q, Hq, D], K / V [total_k,
// Hkv, D], sequence s holding tokens [cu_seqlens[s], cu_seqlens[s + 1]) (its
// first seqused[s] of them when seqused is given). The kernels see it as batch
// 1 with seqlen_q = total_q, seqlen_k = total_k for the token-indexed arrays
// (BF16 inputs through their strides; O / dQ / dK / dV written token-major
// [total, H, D]; LSE, delta and the other per-row floats [H, total]).
//
// Padded layout (what the quantization writes and the kernels read: codes,
// their scales, dq_accum): every sequence starts on a 128-token tile of its
// own, sequence s at row 128 tiles[s], so a tile never mixes two sequences and
// each sequence's FP8 blocks are those of a dense call on it alone. Rows past
// a sequence's length hold code 0 (what a dense call's TMA reads past its
// seqlen). Per head: q_tiles_max * 128 rows (KernelParams::seqlen_q_pad;
// q_tiles_max = ceil(total_q / 128) + num_seqs >= the sum of ceil(len / 128)),
// per-tile scales q_tiles_max per head.
//
// Metadata (varlen_meta_sm90, one small kernel before the others; int32, from
// cu_seqlens / seqused on the device, never read on the host) at
// KernelParams::varlen_meta, n = num_seqs:
//   tok_q[n]   first token of sequence s          len_q[n]   its used length
//   tok_k[n]                                      len_k[n]
//   tiles_q[n + 1]  first padded tile of s (prefix sum of ceil(len_q / 128))
//   tiles_k[n + 1]
//   qtile_seq[q_tiles_max]  the sequence of padded query tile t (-1: none)
//   ktile_seq[k_tiles_max]
// Unchecked cu_seqlens / seqused (varlen_attention's check=False) are clamped
// so that nothing is read or written outside the tensors: start clamped to
// [0, total], end to [start, total], used length to [0, end - start], and a
// sequence whose tiles would pass the tile bound is cut at it. Valid inputs
// are never changed by the clamps.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fp8attn {
namespace sm90 {

// Offsets (ints) of the metadata arrays.
struct VarlenMetaLayout {
  int n, q_tiles, k_tiles;
  constexpr int64_t tok_q() const { return 0; }
  constexpr int64_t len_q() const { return n; }
  constexpr int64_t tok_k() const { return 2 * int64_t{n}; }
  constexpr int64_t len_k() const { return 3 * int64_t{n}; }
  constexpr int64_t tiles_q() const { return 4 * int64_t{n}; }
  constexpr int64_t tiles_k() const { return 5 * int64_t{n} + 1; }
  constexpr int64_t qtile_seq() const { return 6 * int64_t{n} + 2; }
  constexpr int64_t ktile_seq() const { return qtile_seq() + q_tiles; }
  constexpr int64_t ints() const { return ktile_seq() + k_tiles; }
};

// The tile bound of a packed side: ceil(total / 128) + num_seqs >= sum over
// the sequences of ceil(len / 128) (each sequence adds less than one tile of
// padding).
constexpr int64_t varlen_tiles_max(int64_t total, int64_t num_seqs) { return (total + 127) / 128 + num_seqs; }

// Writes the metadata (layout above) from int32 cu_seqlens_q / _k [n + 1] and
// optional int32 seqused_q / _k [n] (nullptr: the whole sequence). One launch
// on `stream`; throws std::runtime_error on a launch error.
void varlen_meta_sm90(const int* cu_seqlens_q, const int* cu_seqlens_k, const int* seqused_q, const int* seqused_k,
                      int num_seqs, int total_q, int total_k, int q_tiles_max, int k_tiles_max, int* meta,
                      cudaStream_t stream);

// Tokens outside every sequence of one side (side 0: queries, 1: keys; a
// token is inside sequence s iff tok[s] <= t < tok[s] + len[s] of the
// metadata) get what a dense call gives a row outside its problem: `rows`
// [total, row_bytes] (e.g. O or dQ token-major, BF16) zero bytes, and up to
// `n_planes` float planes [n_planes][heads][total] (LSE: -inf; diagnostics: 0)
// `value`. `rows2` (nullptr: none) likewise (dK and dV of the key side). One
// warp per token (a binary search over tok, then the row's stores); tokens
// inside a sequence are not touched. Throws std::runtime_error on a launch error.
void varlen_clear_gaps_sm90(const int* meta, int side, int num_seqs, int q_tiles_max, int k_tiles_max, int total,
                            void* rows, int64_t row_bytes, void* rows2, int64_t row_bytes2, float* planes,
                            int n_planes, int heads, float value, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
