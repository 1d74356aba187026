// fp8attn: sm_90a FP8 quantization of BF16 Q / K / V / dO for the `tile`
// scaling recipe (numerics.md section 9). Contract:
// quant_tilescale_e4m3_sm90.h; math: numerics.md section 2; design, floor and
// predictions: docs/kernels/fwd_tilescale_e4m3_sm90.md ("Quantization").
//
// One launch serves several operands (TileQuantJob each, e.g. the forward's
// Q, K, V): one CTA (kQuantThreads threads) per (128-token tile, batch, head)
// of every job, on one linear grid. The CTA reads its tile of 128 tokens x all
// of head_dim once (32-byte loads per lane, every load in flight at once, held
// in registers: head_dim 256 is 16 vectors per thread) and produces
//   - row pass: per token, one block over all of head_dim (kLanes lanes hold a
//     token row; the row amax is a shuffle reduction), 16-byte code stores;
//   - tile pass: one block over the whole tile (CTA reduction of the same
//     amax bits), 16-byte code stores row-major and / or into a shared
//     [token][channel] copy (16-byte units XOR-swizzled by the token's 16-row
//     chunk), read back as 4-byte words of 16 tokens, transposed 4 x 4 in
//     registers (byte permutes) and written as 16-byte chunks of 16 tokens per
//     channel (8 lanes write one 128-byte run of a channel row).
// Scales equal fp8attn::block_scale (block_scale_fast on the amax found by an
// integer max of the BF16 bits, quant_codec_sm90.cuh), codes the hardware RNE
// conversion (finite blocks) or fp8attn::fp8_encode (blocks holding NaN / inf),
// so both are bit-identical to the CPU quantize_tilescale op.
// FP32 input (TileQuantJob::x_fp32) and the fused Q / K rotation (rotate;
// numerics.md 10.1, hadamard_sm90.cuh) turn the registers into BF16(x R)
// right after the loads: the rest is the same.
#include "hopper/quant_tilescale_e4m3_sm90.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "hopper/config_sm90.h"
#include "hopper/hadamard_sm90.cuh"
#include "hopper/quant_codec_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace {

using namespace quantdev;

constexpr int kWarps = kQuantThreads / 32;
static_assert(kQuantThreads == 256 && kSeqBlock == 128, "lane maps below: 8 warps, 128-token tiles");

// Lane map of a token row: a lane holds kUnit = 16 channels (32 bytes in,
// 16 bytes of codes out); kLanes lanes (a power of two) per row.
template <int kDim>
struct TileGeom {
  static constexpr int kUnit = 16;
  static constexpr int kUnits = kDim / kUnit;  // 4, 8, 12, 16
  static constexpr int kLanes = kUnits <= 4 ? 4 : (kUnits <= 8 ? 8 : 16);  // 12 -> 16, 4 idle
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kRowsPerPass = kWarps * kRowsPerWarp;
  static constexpr int kPasses = kSeqBlock / kRowsPerPass;  // 2, 4, 8, 8
  // Shared [token][channel] codes: 16-byte unit u of token row r sits at unit
  // u ^ ((r / 16) & kSwz) (stays inside u's aligned group of kSwz + 1 units).
  // NOTE: the transposed read has the 8 lanes of one channel word read the
  // same word of the 8 16-token chunks; unswizzled that is one bank (8-way
  // conflicts at head_dim 128 / 256); swizzled: conflict-free at 128 / 256,
  // 2-way at 64 / 192 (rows of 64 / 192 bytes put two chunks on one bank half).
  static constexpr int kSwz = (kDim == 128 || kDim == 256) ? 7 : 3;
  static_assert(kDim % kUnit == 0 && kUnits % (kSwz + 1) == 0, "swizzle stays inside the row");
  static_assert(kSeqBlock % kRowsPerPass == 0, "whole token rows per pass");
};

__device__ __forceinline__ uint32_t enc_words(uint32_t w0, uint32_t w1, float inv_s, bool finite, Fp8Format fmt) {
  return encode4(bf16_bits_to_float(w0 & 0xffffu), bf16_bits_to_float(w0 >> 16), bf16_bits_to_float(w1 & 0xffffu),
                 bf16_bits_to_float(w1 >> 16), inv_s, finite, fmt);
}
// Codes of 16 BF16 (a in channels 0-7, b in 8-15), channel 0 in the low byte.
__device__ __forceinline__ uint4 enc16(const uint4& a, const uint4& b, float inv_s, bool finite, Fp8Format fmt) {
  return make_uint4(enc_words(a.x, a.y, inv_s, finite, fmt), enc_words(a.z, a.w, inv_s, finite, fmt),
                    enc_words(b.x, b.y, inv_s, finite, fmt), enc_words(b.z, b.w, inv_s, finite, fmt));
}
__device__ __forceinline__ uint32_t amax16(const uint4& a, const uint4& b) {
  const uint32_t m0 = vmax_u16x2(vmax_u16x2(a.x & kAbsBf16x2, a.y & kAbsBf16x2), vmax_u16x2(a.z & kAbsBf16x2, a.w & kAbsBf16x2));
  const uint32_t m1 = vmax_u16x2(vmax_u16x2(b.x & kAbsBf16x2, b.y & kAbsBf16x2), vmax_u16x2(b.z & kAbsBf16x2, b.w & kAbsBf16x2));
  return vmax_u16x2(m0, m1);
}

template <int kDim, bool kXform>
__device__ __forceinline__ void quant_tile_ts(const TileQuantJob& j, int nblk, int sblk, int64_t bh, uint8_t* sT,
                                              uint32_t* red) {
  using G = TileGeom<kDim>;
  const int64_t b = bh / j.heads, h = bh - b * j.heads;
  const int t0 = sblk * kSeqBlock;  // first row of the tile in the outputs
  // The tile's tokens in x: n_valid of them from src0 (dense: the tile's own
  // rows; varlen: its sequence's, quant_tilescale_e4m3_sm90.h). Rows r >=
  // n_valid read as zero tokens.
  int src0 = t0, n_valid = min(kSeqBlock, j.seqlen - t0);
  if (j.tile_seq != nullptr) {
    const int s = j.tile_seq[sblk];
    // NOTE: a padded tile no sequence owns is never read (the kernels read only
    // their sequences' tiles): nothing to write. Up to num_seqs of them per head
    // (the tile bound's slack): with short documents as many as real tiles.
    if (s < 0) return;
    const int lt = sblk - j.tiles[s];
    src0 = j.tok[s] + lt * kSeqBlock;
    n_valid = max(0, min(kSeqBlock, j.len[s] - lt * kSeqBlock));
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int u = lane % G::kLanes, rsub = lane / G::kLanes;
  const bool active = u < G::kUnits;
  const uint16_t* xb = static_cast<const uint16_t*>(j.x) + b * j.stride_batch + h * j.stride_head;

  // ---- loads: all of this thread's vectors in flight at once ----
  uint4 raw[G::kPasses][2];
  uint32_t tile_m2 = 0u;
#pragma unroll
  for (int k = 0; k < G::kPasses; ++k) {
    const int r = k * G::kRowsPerPass + warp * G::kRowsPerWarp + rsub;
    raw[k][0] = raw[k][1] = make_uint4(0u, 0u, 0u, 0u);  // rows past the tile's tokens are never read
    if (!(kXform && j.x_fp32) && active && r < n_valid) {
      const uint4* src =
          reinterpret_cast<const uint4*>(xb + static_cast<int64_t>(src0 + r) * j.stride_seq + u * G::kUnit);
      raw[k][0] = src[0];
      raw[k][1] = src[1];
    }
  }

  // ---- FP32 input and / or the fused Q / K rotation (numerics.md 10.1): the
  // registers then hold BF16(x R) (BF16(x) without rotation), the value the
  // unfused path hands a kernel, and everything below quantizes that.
  // NOTE: a separate instantiation (kXform), launched only for such jobs: the
  // FP32 registers raise the kernel's register count (at head_dim 256 from 112
  // to 155, one CTA per SM fewer), which the plain jobs should not pay.
  if constexpr (kXform) {
    const uint32_t neg = j.rotate ? hadamard::unit_sign_mask(u) : 0u;
    const float* xf = static_cast<const float*>(j.x) + b * j.stride_batch + h * j.stride_head;
#pragma unroll
    for (int k = 0; k < G::kPasses; ++k) {
      const int r = k * G::kRowsPerPass + warp * G::kRowsPerWarp + rsub;
      const bool valid = active && r < n_valid;
      float x[hadamard::kUnit];
      if (j.x_fp32) {
#pragma unroll
        for (int i = 0; i < hadamard::kUnit; ++i) x[i] = 0.f;
        if (valid) {
          const float4* src =
              reinterpret_cast<const float4*>(xf + static_cast<int64_t>(src0 + r) * j.stride_seq + u * G::kUnit);
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            const float4 v4 = src[q4];
            x[4 * q4] = v4.x;
            x[4 * q4 + 1] = v4.y;
            x[4 * q4 + 2] = v4.z;
            x[4 * q4 + 3] = v4.w;
          }
        }
      } else {
        const uint32_t w[8] = {raw[k][0].x, raw[k][0].y, raw[k][0].z, raw[k][0].w,
                               raw[k][1].x, raw[k][1].y, raw[k][1].z, raw[k][1].w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          x[2 * i] = bf16_bits_to_float(w[i] & 0xffffu);
          x[2 * i + 1] = bf16_bits_to_float(w[i] >> 16);
        }
      }
      if (j.rotate) hadamard::rotate_unit<kDim>(x, u, neg, lane);  // every lane (shuffles)
      uint32_t o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const __nv_bfloat162 p2 = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);  // .x (low half) = x[2 i]
        o[i] = valid ? *reinterpret_cast<const uint32_t*>(&p2) : 0u;
      }
      raw[k][0] = make_uint4(o[0], o[1], o[2], o[3]);
      raw[k][1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }

  // ---- row pass: per token, one block over all of head_dim ----
#pragma unroll
  for (int k = 0; k < G::kPasses; ++k) {
    const uint32_t m2 = amax16(raw[k][0], raw[k][1]);
    tile_m2 = vmax_u16x2(tile_m2, m2);
    if (j.row == nullptr) continue;
    uint32_t r2 = m2;
    // NOTE: every lane runs every pass (compile-time bounds): full-warp shuffles.
#pragma unroll
    for (int off = G::kLanes / 2; off > 0; off >>= 1) r2 = vmax_u16x2(r2, __shfl_xor_sync(0xffffffffu, r2, off));
    const int t = t0 + k * G::kRowsPerPass + warp * G::kRowsPerWarp + rsub;
    if (!active || t >= j.seqlen) continue;
    const uint32_t amax_bits = max(r2 & 0xffffu, r2 >> 16);
    const BlockScale bs = scale_of_bits(amax_bits, j.fmt);
    const int64_t row_idx = bh * j.seqlen + t;
    *reinterpret_cast<uint4*>(j.row + row_idx * kDim + u * G::kUnit) =
        enc16(raw[k][0], raw[k][1], bs.inv_s, amax_bits < kBf16InfBits, j.fmt);
    if (u == 0) j.row_s[row_idx] = bs.s;
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
  if (tid == 0) j.tile_s[bh * nblk + sblk] = bs.s;

  // ---- tile pass: codes row-major and into the shared [token][channel] copy ----
#pragma unroll
  for (int k = 0; k < G::kPasses; ++k) {
    const int r = k * G::kRowsPerPass + warp * G::kRowsPerWarp + rsub;  // token within the tile
    const int t = t0 + r;
    if (!active) continue;
    uint4 codes = enc16(raw[k][0], raw[k][1], bs.inv_s, finite, j.fmt);
    // NOTE: rows past the tile's tokens get code 0 explicitly (a NaN scale would
    // turn the zero-filled registers into NaN codes): the transposed padding, and
    // a packed batch's padding rows (what a dense call's TMA reads past seqlen).
    if (r >= n_valid) codes = make_uint4(0u, 0u, 0u, 0u);
    if (j.tile != nullptr && t < j.seqlen)
      *reinterpret_cast<uint4*>(j.tile + (bh * j.seqlen + t) * kDim + u * G::kUnit) = codes;
    if (j.tileT != nullptr) *reinterpret_cast<uint4*>(sT + r * kDim + G::kUnit * (u ^ ((r >> 4) & G::kSwz))) = codes;
  }
  if (j.tileT == nullptr) return;
  __syncthreads();

  // ---- transposed codes: item = (16-token chunk kc, 4-channel word g) ----
  constexpr int kWordsRow = kDim / 4;
  for (int idx = tid; idx < 8 * kWordsRow; idx += kQuantThreads) {
    const int kc = idx & 7, g = idx >> 3;
    const int tt = t0 + kc * 16;
    if (tt >= j.seqlen_pad) continue;  // seqlen_pad is a multiple of 16: chunks are wholly in or out
    const uint8_t* src = sT + kc * 16 * kDim + G::kUnit * ((g >> 2) ^ (kc & G::kSwz)) + 4 * (g & 3);
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = *reinterpret_cast<const uint32_t*>(src + i * kDim);
    // 4 x 4 byte transposes: o[c][q] = channel 4g + c of tokens 4q .. 4q + 3.
    uint32_t o[4][4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t p0 = __byte_perm(w[4 * q], w[4 * q + 1], 0x5140), p1 = __byte_perm(w[4 * q], w[4 * q + 1], 0x7362);
      const uint32_t p2 = __byte_perm(w[4 * q + 2], w[4 * q + 3], 0x5140),
                     p3 = __byte_perm(w[4 * q + 2], w[4 * q + 3], 0x7362);
      o[0][q] = __byte_perm(p0, p2, 0x5410);
      o[1][q] = __byte_perm(p0, p2, 0x7632);
      o[2][q] = __byte_perm(p1, p3, 0x5410);
      o[3][q] = __byte_perm(p1, p3, 0x7632);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint4 out = make_uint4(o[c][0], o[c][1], o[c][2], o[c][3]);
      if (j.tileT_perm16)  // tokens 0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15
        out = make_uint4(__byte_perm(o[c][0], o[c][2], 0x5410), __byte_perm(o[c][0], o[c][2], 0x7632),
                         __byte_perm(o[c][1], o[c][3], 0x5410), __byte_perm(o[c][1], o[c][3], 0x7632));
      *reinterpret_cast<uint4*>(j.tileT + (bh * kDim + 4 * g + c) * j.seqlen_pad + tt) = out;
    }
  }
}

// The jobs of one launch (same dim): CTA cta_base + blockIdx.x is tile
// (cta - cta_begin[job]) of its job, (b, h) major, sequence tile minor.
struct TileQuantLaunch {
  TileQuantJob job[kMaxTileQuantJobs];
  int64_t cta_end[kMaxTileQuantJobs];  // exclusive prefix ends
  int nblk[kMaxTileQuantJobs];
  int n = 0;
  int64_t cta_base = 0;
};

template <int kDim, bool kXform>
__global__ void __launch_bounds__(kQuantThreads) quant_tilescale_kernel(const __grid_constant__ TileQuantLaunch p) {
  extern __shared__ __align__(16) uint8_t sT[];  // kSeqBlock x kDim tile codes when a job writes tileT
  __shared__ uint32_t red[kWarps];
  const int64_t cta = p.cta_base + blockIdx.x;
  int ji = 0;
#pragma unroll
  for (int i = 0; i + 1 < kMaxTileQuantJobs; ++i)
    if (i + 1 < p.n && cta >= p.cta_end[i]) ji = i + 1;
  const int64_t local = cta - (ji == 0 ? 0 : p.cta_end[ji - 1]);
  const int nblk = p.nblk[ji];
  const int64_t bh = local / nblk;
  quant_tile_ts<kDim, kXform>(p.job[ji], nblk, static_cast<int>(local - bh * nblk), bh, sT, red);
}

[[noreturn]] void bad(const char* field, const std::string& what) {
  throw std::invalid_argument(std::string("fp8attn: quantize_tilescale_bf16_sm90: '") + field + "': " + what);
}

// Checks one job; true when it has work (non-empty, some output).
bool check_job(const TileQuantJob& j) {
  if (j.recipe != Scaling::kTile) bad("recipe", "must be Scaling::kTile (the `row` recipe: quantize_bf16_sm90)");
  if (j.batch < 0 || j.heads < 0 || j.seqlen < 0) bad("batch", "batch, heads and seqlen must be >= 0");
  if (j.batch == 0 || j.heads == 0 || j.seqlen == 0) return false;
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
  return j.row != nullptr || j.tile != nullptr || j.tileT != nullptr;
}

template <int kDim, bool kXform>
void launch_dim(TileQuantLaunch p, cudaStream_t stream) {
  bool transposed = false;
  int64_t total = 0;
  for (int i = 0; i < p.n; ++i) {
    const TileQuantJob& j = p.job[i];
    p.nblk[i] = (j.seqlen + kSeqBlock - 1) / kSeqBlock;
    total += static_cast<int64_t>(j.batch) * j.heads * p.nblk[i];
    p.cta_end[i] = total;
    transposed = transposed || j.tileT != nullptr;
  }
  const size_t smem = transposed ? static_cast<size_t>(kSeqBlock) * kDim : 0;  // <= 32 KiB: no opt-in
  // NOTE: gridDim.x <= 2^31 - 1; more CTAs (2^31 rows x 2^23 tiles allow it)
  // run as several launches over the same linear CTA numbering.
  constexpr int64_t kChunk = int64_t{1} << 30;
  for (int64_t base = 0; base < total; base += kChunk) {
    p.cta_base = base;
    const unsigned grid = static_cast<unsigned>(std::min(kChunk, total - base));
    quant_tilescale_kernel<kDim, kXform><<<grid, kQuantThreads, smem, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("fp8attn: quantize_tilescale_bf16_sm90 launch failed: ") +
                               cudaGetErrorString(err));
  }
}

}  // namespace

void quantize_tilescale_bf16_sm90(const TileQuantJob* jobs, int n_jobs, cudaStream_t stream) {
  if (n_jobs < 0 || n_jobs > kMaxTileQuantJobs)
    bad("n_jobs", "must be in [0, " + std::to_string(kMaxTileQuantJobs) + "], got " + std::to_string(n_jobs));
  if (n_jobs > 0 && jobs == nullptr) bad("jobs", "must not be null");
  bool work[kMaxTileQuantJobs] = {};
  for (int i = 0; i < n_jobs; ++i) work[i] = check_job(jobs[i]);  // every job checked before any launch
  // One launch per (dim, transform or not) that has jobs.
  for (const bool xform : {false, true})
    for (const int dim : {64, 128, 192, 256}) {
      TileQuantLaunch p;
      for (int i = 0; i < n_jobs; ++i)
        if (work[i] && jobs[i].dim == dim && (jobs[i].x_fp32 || jobs[i].rotate) == xform) p.job[p.n++] = jobs[i];
      if (p.n == 0) continue;
      switch (dim * 2 + (xform ? 1 : 0)) {
        case 128: launch_dim<64, false>(p, stream); break;
        case 129: launch_dim<64, true>(p, stream); break;
        case 256: launch_dim<128, false>(p, stream); break;
        case 257: launch_dim<128, true>(p, stream); break;
        case 384: launch_dim<192, false>(p, stream); break;
        case 385: launch_dim<192, true>(p, stream); break;
        case 512: launch_dim<256, false>(p, stream); break;
        default: launch_dim<256, true>(p, stream); break;
      }
    }
}

void quantize_tilescale_bf16_sm90(const TileQuantJob& job, cudaStream_t stream) {
  quantize_tilescale_bf16_sm90(&job, 1, stream);
}

}  // namespace sm90
}  // namespace fp8attn
