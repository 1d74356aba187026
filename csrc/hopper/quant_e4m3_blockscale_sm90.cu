// fp8attn: sm_90a block-scaled FP8 quantization of BF16 Q / K / V / dO into
// the row-blocked and column-blocked (transposed) layouts of
// kernel_params_sm90.h. Contract: quant_e4m3_blockscale_sm90.h; math:
// numerics.md section 2.
//
// One CTA reads one tile of kSeqBlock tokens x one head_dim block (64 or 128
// channels) of one (batch, head) once, with 16-byte loads, and produces
//   - row pass: per token, the block along head_dim (that is the whole tile
//     row), reduced across the lanes holding the row, codes written at once;
//   - column pass (from a shared-memory copy of the tile): per channel, the
//     block of kSeqBlock tokens, codes written transposed with 16-byte stores.
// Scales equal fp8attn::block_scale (block_scale_fast, common/fp8_codec.h, on the
// amax found by an integer max of the BF16 bits), codes come from the hardware
// RNE conversion (finite blocks) or fp8attn::fp8_encode (common/fp8_codec.h;
// blocks holding NaN / inf), so both are bit-identical to the CPU quantize_blockwise.
#include "hopper/quant_e4m3_blockscale_sm90.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/fp8_codec.h"
#include "hopper/config_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/quant_codec_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace {

using namespace quantdev;

// One tile of kSeqBlock tokens x kCw channels (kCw = 64 or 128: the head_dim
// block of this CTA).
template <int kCw>
__device__ __forceinline__ void quant_tile(const QuantJob& j, int nblk_d, int nblk_s, int sblk, int dblk, int bh,
                                           uint16_t* tile, uint32_t* red_amax) {
  constexpr int kVpr = kCw / kQuantVec;             // 16-byte vectors per token row: 8 or 16
  constexpr int kRowsPerPass = kQuantThreads / kVpr;  // 32 or 16
  constexpr int kPasses = kSeqBlock / kRowsPerPass;   // 4 or 8
  constexpr int kGroups = kQuantThreads / kCw;        // column pass: token groups (4 or 2)
  constexpr int kTpg = kSeqBlock / kGroups;           // tokens per group (32 or 64)
  static_assert(kQuantThreads % kVpr == 0 && kSeqBlock % kRowsPerPass == 0, "whole rows per pass");
  static_assert(kQuantThreads % kCw == 0 && kTpg % 16 == 0, "column pass: whole 16-token chunks per group");

  const int b = bh / j.heads, h = bh - b * j.heads;
  const int c0 = dblk * kMaxDimBlock;
  const int t0 = sblk * kSeqBlock;
  const int tid = threadIdx.x;
  const int v = tid % kVpr, r0 = tid / kVpr;
  const bool want_col = j.colT != nullptr;
  const uint16_t* xb = static_cast<const uint16_t*>(j.x) + b * j.stride_batch + h * j.stride_head;

  // ---- loads: all of this thread's 16-byte vectors in flight at once ----
  // NOTE: issued before any use (the row pass's shuffles would otherwise
  // serialize one load per pass: the kernel was latency-bound at ~2x its byte
  // floor, docs/kernels/quant_e4m3_blockscale_sm90.md).
  uint4 raw[kPasses];
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int t = t0 + r0 + k * kRowsPerPass;
    raw[k] = make_uint4(0u, 0u, 0u, 0u);  // tokens past seqlen are never read
    if (t < j.seqlen) raw[k] = *reinterpret_cast<const uint4*>(xb + t * j.stride_seq + c0 + v * kQuantVec);
  }
  if (want_col) {
#pragma unroll
    for (int k = 0; k < kPasses; ++k)
      *reinterpret_cast<uint4*>(&tile[(r0 + k * kRowsPerPass) * kCw + v * kQuantVec]) = raw[k];
  }

  // ---- row pass: per token, the block along head_dim (one tile row) ----
  if (j.row != nullptr) {
#pragma unroll
    for (int k = 0; k < kPasses; ++k) {
      const int t = t0 + r0 + k * kRowsPerPass;
      const uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = bf16_bits_to_float(w[i] & 0xffffu);
        f[2 * i + 1] = bf16_bits_to_float(w[i] >> 16);
      }
      uint32_t m2 = vmax_u16x2(vmax_u16x2(w[0] & kAbsBf16x2, w[1] & kAbsBf16x2),
                               vmax_u16x2(w[2] & kAbsBf16x2, w[3] & kAbsBf16x2));
      // NOTE: every lane runs every pass (the bounds are compile-time), so
      // the shuffles see full warps.
#pragma unroll
      for (int off = kVpr / 2; off > 0; off >>= 1) m2 = vmax_u16x2(m2, __shfl_xor_sync(0xffffffffu, m2, off));
      if (t >= j.seqlen) continue;
      const uint32_t amax_bits = max(m2 & 0xffffu, m2 >> 16);
      const bool finite = amax_bits < kBf16InfBits;
      const BlockScale bs = scale_of_bits(amax_bits, j.fmt);
      const uint32_t lo = encode4(f[0], f[1], f[2], f[3], bs.inv_s, finite, j.fmt);
      const uint32_t hi = encode4(f[4], f[5], f[6], f[7], bs.inv_s, finite, j.fmt);
      const int64_t row_idx = static_cast<int64_t>(bh) * j.seqlen + t;
      *reinterpret_cast<uint2*>(j.row + row_idx * j.dim + c0 + v * kQuantVec) = make_uint2(lo, hi);
      if (v == 0) j.row_s[row_idx * nblk_d + dblk] = bs.s;
    }
  }
  if (!want_col) return;
  __syncthreads();

  // ---- column pass: per channel, the block of kSeqBlock tokens -------------
  // Each thread reads its kTpg values of channel c once (two BF16 per register).
  const int c = tid % kCw;   // channel within the head_dim block
  const int grp = tid / kCw;  // token group
  uint32_t pk[kTpg / 2];
  uint32_t m2 = 0u;
#pragma unroll
  for (int i = 0; i < kTpg / 2; ++i) {
    const uint32_t lo = tile[(grp * kTpg + 2 * i) * kCw + c], hi = tile[(grp * kTpg + 2 * i + 1) * kCw + c];
    pk[i] = lo | (hi << 16);
    m2 = vmax_u16x2(m2, pk[i] & kAbsBf16x2);
  }
  red_amax[grp * kCw + c] = max(m2 & 0xffffu, m2 >> 16);
  __syncthreads();
  uint32_t amax_bits = 0u;
#pragma unroll
  for (int g2 = 0; g2 < kGroups; ++g2) amax_bits = max(amax_bits, red_amax[g2 * kCw + c]);
  const bool finite = amax_bits < kBf16InfBits;
  const BlockScale bs = scale_of_bits(amax_bits, j.fmt);
  const float inv_s = bs.inv_s;
  const int64_t col_idx = static_cast<int64_t>(bh) * j.dim + c0 + c;
  if (grp == 0) j.col_s[col_idx * nblk_s + sblk] = bs.s;
  uint8_t* dst = j.colT + col_idx * j.seqlen_pad;
#pragma unroll
  for (int k16 = 0; k16 < kTpg / 16; ++k16) {
    const int tt = t0 + grp * kTpg + k16 * 16;  // first token of this 16-byte chunk
    if (tt >= j.seqlen_pad) break;
    uint32_t packed[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t p0 = pk[8 * k16 + 2 * q], p1 = pk[8 * k16 + 2 * q + 1];
      // NOTE: the tile holds zeros past seqlen (never read from x)
      uint32_t word = encode4(bf16_bits_to_float(p0 & 0xffffu), bf16_bits_to_float(p0 >> 16),
                              bf16_bits_to_float(p1 & 0xffffu), bf16_bits_to_float(p1 >> 16), inv_s, finite,
                              j.fmt);
      // NOTE: padding tokens get code 0 explicitly (a NaN scale would
      // otherwise turn the zero-filled padding into NaN codes).
      if (tt + 16 > j.seqlen) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (tt + 4 * q + e >= j.seqlen) word &= ~(0xffu << (8 * e));
      }
      packed[q] = word;
    }
    *reinterpret_cast<uint4*>(dst + tt) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

__global__ void __launch_bounds__(kQuantThreads) quant_bf16_kernel(const QuantJob j, int nblk_d, int nblk_s) {
  __shared__ __align__(16) uint16_t tile[kSeqBlock * kMaxDimBlock];  // BF16 bits, [token][channel]
  __shared__ uint32_t red_amax[kQuantThreads];  // column pass: |x| bits of each thread's share
  const int dblk = blockIdx.y;
  // The head_dim block of this CTA: 128 channels, or 64 (d = 64, and block 1 of d = 192).
  if (j.dim - dblk * kMaxDimBlock >= 128)
    quant_tile<128>(j, nblk_d, nblk_s, blockIdx.x, dblk, blockIdx.z, tile, red_amax);
  else
    quant_tile<64>(j, nblk_d, nblk_s, blockIdx.x, dblk, blockIdx.z, tile, red_amax);
}

[[noreturn]] void bad(const char* field, const std::string& what) {
  throw std::invalid_argument(std::string("fp8attn: quantize_bf16_sm90: '") + field + "': " + what);
}

}  // namespace

void quantize_bf16_sm90(const QuantJob& j, cudaStream_t stream) {
  if (j.batch == 0 || j.heads == 0 || j.seqlen == 0) return;
  if (j.dim != 64 && j.dim != 128 && j.dim != 192 && j.dim != 256)
    bad("dim", "must be 64, 128, 192 or 256, got " + std::to_string(j.dim));
  if (j.x == nullptr) bad("x", "must not be null");
  if (reinterpret_cast<uintptr_t>(j.x) % 16 != 0 || j.stride_batch % 8 != 0 || j.stride_head % 8 != 0 ||
      j.stride_seq % 8 != 0)
    bad("x", "data pointer and strides must be 16-byte aligned");
  if ((j.row == nullptr) != (j.row_s == nullptr)) bad("row", "row and row_s must both be set or both null");
  if ((j.colT == nullptr) != (j.col_s == nullptr)) bad("colT", "colT and col_s must both be set or both null");
  if (j.colT != nullptr && (j.seqlen_pad < j.seqlen || j.seqlen_pad % kSeqPad != 0))
    bad("seqlen_pad", "must be a multiple of 16 and >= seqlen");
  if (j.seqlen >= (1 << 30)) bad("seqlen", "must be < 2^30, got " + std::to_string(j.seqlen));
  if (static_cast<int64_t>(j.batch) * j.heads >= (int64_t{1} << 31))
    bad("batch", "batch * heads must be < 2^31, got " + std::to_string(static_cast<int64_t>(j.batch) * j.heads));
  if (j.row == nullptr && j.colT == nullptr) return;
  const int nblk_d = (j.dim + kMaxDimBlock - 1) / kMaxDimBlock;
  const int nblk_s = (j.seqlen + kSeqBlock - 1) / kSeqBlock;
  // NOTE: (b, h) rows on gridDim.z (<= 65535): more run as several launches,
  // each on a job whose pointers start at its first row (launch_sm90.h); the
  // kernel is unchanged, and batch * heads <= 65535 is one launch on j itself.
  for_each_row_chunk(j.batch, j.heads, [&](const RowChunk& c) {
    QuantJob jc = j;
    const int64_t r0 = c.b0 * j.heads + c.h0;  // first (b, h) row of the chunk
    jc.x = static_cast<const uint16_t*>(j.x) + c.b0 * j.stride_batch + c.h0 * j.stride_head;
    jc.batch = static_cast<int>(c.nb);
    jc.heads = static_cast<int>(c.nh);
    if (j.row != nullptr) {
      jc.row = j.row + r0 * j.seqlen * j.dim;
      jc.row_s = j.row_s + r0 * j.seqlen * nblk_d;
    }
    if (j.colT != nullptr) {
      jc.colT = j.colT + r0 * j.dim * j.seqlen_pad;
      jc.col_s = j.col_s + r0 * j.dim * nblk_s;
    }
    const dim3 grid(nblk_s, nblk_d, static_cast<unsigned>(c.nb * c.nh));
    quant_bf16_kernel<<<grid, kQuantThreads, 0, stream>>>(jc, nblk_d, nblk_s);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fp8attn: quantize_bf16_sm90 launch failed: ") + cudaGetErrorString(err));
  });
}

}  // namespace sm90
}  // namespace fp8attn
