// fp8attn: sm_90a FP8 quantization of BF16 Q / K / V / dO for the `tile`
// scaling recipe (numerics.md section 9). Contract:
// quant_tilescale_e4m3_sm90.h; math: numerics.md section 2.
//
// One CTA (kQuantThreads threads) reads one tile of kSeqBlock tokens x all of
// head_dim of one (batch, head) once, with 16-byte loads held in registers
// (head_dim 256: 16 vectors per thread), and produces
//   - row pass: per token, one block over all of head_dim (kLanes lanes hold a
//     token row; the row amax is a shuffle reduction), codes written at once;
//   - tile pass: one block over the whole tile (CTA reduction of the same
//     amax bits), codes written row-major and/or, through a shared-memory
//     [channel][token] copy of the codes, transposed with 16-byte stores.
// Scales equal fp8attn::block_scale (block_scale_fast on the amax found by an
// integer max of the BF16 bits, quant_codec_sm90.cuh), codes the hardware RNE
// conversion (finite blocks) or fp8attn::fp8_encode (blocks holding NaN / inf),
// so both are bit-identical to the CPU quantize_tilescale op.
#include "hopper/quant_tilescale_e4m3_sm90.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "hopper/config_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/quant_codec_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace {

using namespace quantdev;

constexpr int kWarps = kQuantThreads / 32;
constexpr int kLdT = kSeqBlock;  // bytes per channel row of the transposed codes
static_assert(kQuantThreads % 32 == 0 && kLdT == 8 * 16, "whole warps; a channel row = 8 chunks of 16 tokens");

// Byte offset of (channel c, token r) in the shared [channel][token] copy of the
// tile codes: the 16-token chunks of channel row c are XOR-swizzled by (c / 8) % 8.
// NOTE: the lanes of a warp write the same token of channels 8 apart; unswizzled
// (rows of 128 or 144 bytes) those bytes share one bank (16- to 32-way conflicts);
// swizzled they spread over 8 bank groups (1-, 2-, 4-way at head_dim 64, 128, 256).
__device__ __forceinline__ int t_offset(int c, int r) {
  return c * kLdT + ((((r >> 4) ^ (c >> 3)) & 7) << 4) + (r & 15);
}
static_assert(kSeqBlock % 16 == 0, "transposed stores are 16-token chunks");

constexpr int pow2_at_least(int x) { return x <= 8 ? 8 : (x <= 16 ? 16 : 32); }

template <int kDim>
__device__ __forceinline__ void quant_tile_ts(const TileQuantJob& j, int nblk, int sblk, int bh, uint8_t* sT,
                                              uint32_t* red) {
  constexpr int kVecs = kDim / kQuantVec;          // 16-byte vectors per token row: 8, 16, 24, 32
  constexpr int kLanes = pow2_at_least(kVecs);      // lanes per token row (24 -> 32, 8 idle)
  constexpr int kRowsPerWarp = 32 / kLanes;
  constexpr int kRowsPerPass = kWarps * kRowsPerWarp;
  constexpr int kPasses = kSeqBlock / kRowsPerPass;  // 4, 8 or 16
  static_assert(kVecs <= 32 && kSeqBlock % kRowsPerPass == 0, "whole token rows per pass");

  const int b = bh / j.heads, h = bh - b * j.heads;
  const int t0 = sblk * kSeqBlock;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int v = lane % kLanes, rsub = lane / kLanes;
  const bool active = v < kVecs;
  const uint16_t* xb = static_cast<const uint16_t*>(j.x) + b * j.stride_batch + h * j.stride_head;

  // ---- loads: all of this thread's vectors in flight at once ----
  uint4 raw[kPasses];
  uint32_t tile_m2 = 0u;
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int t = t0 + k * kRowsPerPass + warp * kRowsPerWarp + rsub;
    raw[k] = make_uint4(0u, 0u, 0u, 0u);  // tokens past seqlen are never read
    if (active && t < j.seqlen)
      raw[k] = *reinterpret_cast<const uint4*>(xb + static_cast<int64_t>(t) * j.stride_seq + v * kQuantVec);
  }

  // ---- row pass: per token, one block over all of head_dim ----
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const uint32_t m2 = vmax_u16x2(vmax_u16x2(raw[k].x & kAbsBf16x2, raw[k].y & kAbsBf16x2),
                                   vmax_u16x2(raw[k].z & kAbsBf16x2, raw[k].w & kAbsBf16x2));
    tile_m2 = vmax_u16x2(tile_m2, m2);
    if (j.row == nullptr) continue;
    uint32_t r2 = m2;
    // NOTE: every lane runs every pass (compile-time bounds): full-warp shuffles.
#pragma unroll
    for (int off = kLanes / 2; off > 0; off >>= 1) r2 = vmax_u16x2(r2, __shfl_xor_sync(0xffffffffu, r2, off));
    const int t = t0 + k * kRowsPerPass + warp * kRowsPerWarp + rsub;
    if (!active || t >= j.seqlen) continue;
    const uint32_t amax_bits = max(r2 & 0xffffu, r2 >> 16);
    const bool finite = amax_bits < kBf16InfBits;
    const BlockScale bs = scale_of_bits(amax_bits, j.fmt);
    const uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
    const uint32_t lo = encode4(bf16_bits_to_float(w[0] & 0xffffu), bf16_bits_to_float(w[0] >> 16),
                                bf16_bits_to_float(w[1] & 0xffffu), bf16_bits_to_float(w[1] >> 16), bs.inv_s, finite,
                                j.fmt);
    const uint32_t hi = encode4(bf16_bits_to_float(w[2] & 0xffffu), bf16_bits_to_float(w[2] >> 16),
                                bf16_bits_to_float(w[3] & 0xffffu), bf16_bits_to_float(w[3] >> 16), bs.inv_s, finite,
                                j.fmt);
    const int64_t row_idx = static_cast<int64_t>(bh) * j.seqlen + t;
    *reinterpret_cast<uint2*>(j.row + row_idx * kDim + v * kQuantVec) = make_uint2(lo, hi);
    if (v == 0) j.row_s[row_idx] = bs.s;
  }
  if (j.tile == nullptr && j.tileT == nullptr) return;

  // ---- tile amax: CTA reduction of the |x| bits ----
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) tile_m2 = vmax_u16x2(tile_m2, __shfl_xor_sync(0xffffffffu, tile_m2, off));
  if (lane == 0) red[warp] = max(tile_m2 & 0xffffu, tile_m2 >> 16);
  __syncthreads();
  uint32_t amax_bits = 0u;
#pragma unroll
  for (int w2 = 0; w2 < kWarps; ++w2) amax_bits = max(amax_bits, red[w2]);
  const bool finite = amax_bits < kBf16InfBits;
  const BlockScale bs = scale_of_bits(amax_bits, j.fmt);
  if (tid == 0) j.tile_s[static_cast<int64_t>(bh) * nblk + sblk] = bs.s;

  // ---- tile pass: codes row-major and into the transposed shared copy ----
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int r = k * kRowsPerPass + warp * kRowsPerWarp + rsub;  // token within the tile
    const int t = t0 + r;
    if (!active) continue;
    const uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
    const uint32_t lo = encode4(bf16_bits_to_float(w[0] & 0xffffu), bf16_bits_to_float(w[0] >> 16),
                                bf16_bits_to_float(w[1] & 0xffffu), bf16_bits_to_float(w[1] >> 16), bs.inv_s, finite,
                                j.fmt);
    const uint32_t hi = encode4(bf16_bits_to_float(w[2] & 0xffffu), bf16_bits_to_float(w[2] >> 16),
                                bf16_bits_to_float(w[3] & 0xffffu), bf16_bits_to_float(w[3] >> 16), bs.inv_s, finite,
                                j.fmt);
    if (j.tile != nullptr && t < j.seqlen)
      *reinterpret_cast<uint2*>(j.tile + (static_cast<int64_t>(bh) * j.seqlen + t) * kDim + v * kQuantVec) =
          make_uint2(lo, hi);
    if (j.tileT != nullptr) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sT[t_offset(v * kQuantVec + e, r)] = static_cast<uint8_t>(lo >> (8 * e));
        sT[t_offset(v * kQuantVec + 4 + e, r)] = static_cast<uint8_t>(hi >> (8 * e));
      }
    }
  }
  if (j.tileT == nullptr) return;
  __syncthreads();
  // 16-token chunks of every channel row: kDim * kSeqBlock / 16 stores per tile.
  constexpr int kChunks = kSeqBlock / 16;
  for (int idx = tid; idx < kDim * kChunks; idx += kQuantThreads) {
    const int c = idx / kChunks, k16 = idx % kChunks;
    const int tt = t0 + k16 * 16;
    if (tt >= j.seqlen_pad) continue;
    uint4 word = *reinterpret_cast<const uint4*>(sT + t_offset(c, k16 * 16));  // 16 tokens of channel c
    if (tt + 16 > j.seqlen) {
      // NOTE: padding tokens get code 0 explicitly (a NaN scale would turn the
      // zero-filled registers into NaN codes).
      uint32_t p[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
      for (int e = 0; e < 16; ++e)
        if (tt + e >= j.seqlen) p[e / 4] &= ~(0xffu << (8 * (e % 4)));
      word = make_uint4(p[0], p[1], p[2], p[3]);
    }
    *reinterpret_cast<uint4*>(j.tileT + (static_cast<int64_t>(bh) * kDim + c) * j.seqlen_pad + tt) = word;
  }
}

__global__ void __launch_bounds__(kQuantThreads) quant_tilescale_kernel(const TileQuantJob j, int nblk) {
  __shared__ __align__(16) uint8_t sT[kMaxHeadDim * kLdT];  // tile codes, [channel][token] (t_offset)
  __shared__ uint32_t red[kWarps];
  switch (j.dim) {
    case 64: quant_tile_ts<64>(j, nblk, blockIdx.x, blockIdx.y, sT, red); break;
    case 128: quant_tile_ts<128>(j, nblk, blockIdx.x, blockIdx.y, sT, red); break;
    case 192: quant_tile_ts<192>(j, nblk, blockIdx.x, blockIdx.y, sT, red); break;
    default: quant_tile_ts<256>(j, nblk, blockIdx.x, blockIdx.y, sT, red); break;
  }
}

[[noreturn]] void bad(const char* field, const std::string& what) {
  throw std::invalid_argument(std::string("fp8attn: quantize_tilescale_bf16_sm90: '") + field + "': " + what);
}

}  // namespace

void quantize_tilescale_bf16_sm90(const TileQuantJob& j, cudaStream_t stream) {
  if (j.recipe != Scaling::kTile) bad("recipe", "must be Scaling::kTile (the `row` recipe: quantize_bf16_sm90)");
  if (j.batch == 0 || j.heads == 0 || j.seqlen == 0) return;
  if (j.dim != 64 && j.dim != 128 && j.dim != 192 && j.dim != 256)
    bad("dim", "must be 64, 128, 192 or 256, got " + std::to_string(j.dim));
  if (j.x == nullptr) bad("x", "must not be null");
  if (reinterpret_cast<uintptr_t>(j.x) % 16 != 0 || j.stride_batch % 8 != 0 || j.stride_head % 8 != 0 ||
      j.stride_seq % 8 != 0)
    bad("x", "data pointer and strides must be 16-byte aligned");
  if ((j.row == nullptr) != (j.row_s == nullptr)) bad("row", "row and row_s must both be set or both null");
  if ((j.tile != nullptr || j.tileT != nullptr) && j.tile_s == nullptr)
    bad("tile_s", "must be set when tile or tileT is");
  if (j.tileT != nullptr && (j.seqlen_pad < j.seqlen || j.seqlen_pad % kSeqPad != 0))
    bad("seqlen_pad", "must be a multiple of 16 and >= seqlen");
  if (j.seqlen >= (1 << 30)) bad("seqlen", "must be < 2^30, got " + std::to_string(j.seqlen));
  if (static_cast<int64_t>(j.batch) * j.heads >= (int64_t{1} << 31))
    bad("batch", "batch * heads must be < 2^31, got " + std::to_string(static_cast<int64_t>(j.batch) * j.heads));
  if (j.row == nullptr && j.tile == nullptr && j.tileT == nullptr) return;
  const int nblk = (j.seqlen + kSeqBlock - 1) / kSeqBlock;
  // NOTE: (b, h) rows on gridDim.y (<= 65535): more run as several launches on
  // jobs whose pointers start at their first row (launch_sm90.h).
  for_each_row_chunk(j.batch, j.heads, [&](const RowChunk& c) {
    TileQuantJob jc = j;
    const int64_t r0 = c.b0 * j.heads + c.h0;
    jc.x = static_cast<const uint16_t*>(j.x) + c.b0 * j.stride_batch + c.h0 * j.stride_head;
    jc.batch = static_cast<int>(c.nb);
    jc.heads = static_cast<int>(c.nh);
    if (j.row != nullptr) {
      jc.row = j.row + r0 * j.seqlen * j.dim;
      jc.row_s = j.row_s + r0 * j.seqlen;
    }
    if (j.tile != nullptr) jc.tile = j.tile + r0 * j.seqlen * j.dim;
    if (j.tileT != nullptr) jc.tileT = j.tileT + r0 * j.dim * j.seqlen_pad;
    if (j.tile_s != nullptr) jc.tile_s = j.tile_s + r0 * nblk;
    const dim3 grid(nblk, static_cast<unsigned>(c.nb * c.nh));
    quant_tilescale_kernel<<<grid, kQuantThreads, 0, stream>>>(jc, nblk);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fp8attn: quantize_tilescale_bf16_sm90 launch failed: ") +
                               cudaGetErrorString(err));
  });
}

}  // namespace sm90
}  // namespace fp8attn
