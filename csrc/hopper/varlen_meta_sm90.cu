// fp8attn: the varlen metadata kernel (layout and clamps: varlen_sm90.h).
// One CTA of 1024 threads: per-sequence starts and lengths, the prefix sums
// of their tile counts (a block scan, 1024 sequences per round), then the
// tile -> sequence maps (a binary search over the prefix sums per tile).
#include "hopper/varlen_sm90.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace fp8attn {
namespace sm90 {
namespace {

constexpr int kThreads = 1024;

// Start and used length of sequence s of one side, clamped (varlen_sm90.h).
__device__ __forceinline__ void seq_span(const int* cu, const int* used, int s, int total, int& start, int& len) {
  start = min(max(cu[s], 0), total);
  const int end = min(max(cu[s + 1], start), total);
  len = end - start;
  if (used != nullptr) len = min(max(used[s], 0), len);
}

// Inclusive block scan of v (every thread of the CTA calls it).
__device__ __forceinline__ int block_scan(int v, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += y;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += y;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  const int r = v + (warp > 0 ? warp_sums[warp - 1] : 0);
  __syncthreads();  // warp_sums reused by the next round
  return r;
}

// One side (q or k): tok, len, tiles, tile_seq.
__device__ void side(const int* cu, const int* used, int n, int total, int tiles_max, int* tok, int* len, int* tiles,
                     int* tile_seq, int* warp_sums) {
  // Tile counts per sequence, prefix sums clamped to tiles_max.
  int carry = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int s = base + static_cast<int>(threadIdx.x);
    int start = 0, l = 0;
    if (s < n) seq_span(cu, used, s, total, start, l);
    const int t = (l + 127) / 128;
    const int incl = block_scan(t, warp_sums);
    if (s < n) {
      const int first = min(carry + incl - t, tiles_max);
      const int last = min(carry + incl, tiles_max);
      tok[s] = start;
      len[s] = min(l, 128 * (last - first));  // cut at the tile bound (invalid inputs only)
      tiles[s + 1] = last;
    }
    // NOTE: the round's total from the last thread's inclusive sum.
    if (threadIdx.x == kThreads - 1) warp_sums[32] = incl;
    __syncthreads();
    carry = min(carry + warp_sums[32], tiles_max);
    __syncthreads();
  }
  if (threadIdx.x == 0) tiles[0] = 0;
  __syncthreads();
  // tile -> sequence: the last s with tiles[s] <= t < tiles[s + 1] (empty
  // sequences have tiles[s] == tiles[s + 1] and own no tile).
  const int used_tiles = tiles[n];
  for (int t = threadIdx.x; t < tiles_max; t += kThreads) {
    int seq = -1;
    if (t < used_tiles) {
      int lo = 0, hi = n - 1;  // tiles[lo] <= t < tiles[hi + 1]
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tiles[mid] <= t) lo = mid; else hi = mid - 1;
      }
      seq = lo;
    }
    tile_seq[t] = seq;
  }
}

__global__ void __launch_bounds__(kThreads) varlen_meta_kernel(const int* cu_q, const int* cu_k, const int* used_q,
                                                               const int* used_k, int n, int total_q, int total_k,
                                                               int q_tiles_max, int k_tiles_max, int* meta) {
  __shared__ int warp_sums[33];
  const VarlenMetaLayout L{n, q_tiles_max, k_tiles_max};
  side(cu_q, used_q, n, total_q, q_tiles_max, meta + L.tok_q(), meta + L.len_q(), meta + L.tiles_q(),
       meta + L.qtile_seq(), warp_sums);
  side(cu_k, used_k, n, total_k, k_tiles_max, meta + L.tok_k(), meta + L.len_k(), meta + L.tiles_k(),
       meta + L.ktile_seq(), warp_sums);
}

// Zero bytes [0, n) of a row (16-byte aligned when n is a multiple of 16).
__device__ __forceinline__ void zero_row(uint8_t* row, int64_t n, int lane) {
  if (n % 16 == 0 && (reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
    for (int64_t i = lane; i < n / 16; i += 32) reinterpret_cast<uint4*>(row)[i] = make_uint4(0u, 0u, 0u, 0u);
  } else {
    for (int64_t i = lane; i < n; i += 32) row[i] = 0;
  }
}

__global__ void __launch_bounds__(256) varlen_gaps_kernel(const int* tok, const int* len, int n, int total,
                                                          uint8_t* rows, int64_t row_bytes, uint8_t* rows2,
                                                          int64_t row_bytes2, float* planes, int n_planes, int heads,
                                                          float value) {
  const int lane = threadIdx.x & 31;
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (t >= total) return;
  // The last sequence starting at or before t (tok is non-decreasing for valid
  // cu_seqlens; for invalid ones any answer stays inside the tensors).
  int covered = 0;
  if (lane == 0) {
    int lo = 0, hi = n - 1;
    if (tok[0] <= t) {
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tok[mid] <= t) lo = mid; else hi = mid - 1;
      }
      covered = t < static_cast<int64_t>(tok[lo]) + len[lo];
    }
  }
  covered = __shfl_sync(0xffffffffu, covered, 0);
  if (covered) return;
  if (rows != nullptr) zero_row(rows + t * row_bytes, row_bytes, lane);
  if (rows2 != nullptr) zero_row(rows2 + t * row_bytes2, row_bytes2, lane);
  for (int64_t i = lane; i < static_cast<int64_t>(n_planes) * heads; i += 32) planes[i * total + t] = value;
}

}  // namespace

void varlen_clear_gaps_sm90(const int* meta, int side, int num_seqs, int q_tiles_max, int k_tiles_max, int total,
                            void* rows, int64_t row_bytes, void* rows2, int64_t row_bytes2, float* planes,
                            int n_planes, int heads, float value, cudaStream_t stream) {
  if (num_seqs <= 0 || total <= 0) return;
  const VarlenMetaLayout L{num_seqs, q_tiles_max, k_tiles_max};
  const int* tok = meta + (side == 0 ? L.tok_q() : L.tok_k());
  const int* len = meta + (side == 0 ? L.len_q() : L.len_k());
  const int64_t blocks = (static_cast<int64_t>(total) * 32 + 255) / 256;
  varlen_gaps_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      tok, len, num_seqs, total, static_cast<uint8_t*>(rows), row_bytes, static_cast<uint8_t*>(rows2), row_bytes2,
      planes, planes == nullptr ? 0 : n_planes, heads, value);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: varlen_clear_gaps_sm90 launch failed: ") + cudaGetErrorString(e));
}

void varlen_meta_sm90(const int* cu_seqlens_q, const int* cu_seqlens_k, const int* seqused_q, const int* seqused_k,
                      int num_seqs, int total_q, int total_k, int q_tiles_max, int k_tiles_max, int* meta,
                      cudaStream_t stream) {
  if (num_seqs <= 0) return;
  varlen_meta_kernel<<<1, kThreads, 0, stream>>>(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, num_seqs, total_q,
                                                 total_k, q_tiles_max, k_tiles_max, meta);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: varlen_meta_sm90 launch failed: ") + cudaGetErrorString(e));
}

}  // namespace sm90
}  // namespace fp8attn
