// fp8attn: sm_90a FP8 quantization of a BF16 attention operand (Q, K, V or dO)
// for the `tile` scaling recipe (numerics.md section 9; layouts of
// kernel_params_sm90.h as the `tile` kernels read them, /work TILE_SPEC).
// Math: numerics.md section 2 (scale rule, RNE, saturation, block NaN),
// section 9 (which operand gets which block).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace fp8attn {
namespace sm90 {

// One BF16 operand X [batch, heads, seqlen, dim] (strides in elements, the
// dim stride is 1; the data pointer and the three strides multiples of 8
// elements, so every row starts on a 16-byte boundary) and where to put its
// `tile`-recipe quantized forms. Any output group may be null (not produced).
//
//   row   [batch, heads, seqlen, dim] codes, row_s [batch, heads, seqlen]:
//         one block per token, all of dim (Q for #1/#3, dO for #4).
//   tile  [batch, heads, seqlen, dim] codes, tile_s [batch, heads, nblk]:
//         one block per tile of 128 tokens (starting at token 0; the last one
//         shorter), all of dim (K for #1/#3/#6, V for #2/#4).
//   tileT [batch, heads, dim, seqlen_pad] codes: the same codes as `tile`,
//         transposed (sequence contiguous), padding tokens [seqlen,
//         seqlen_pad) code 0; its scales are tile_s (K #6, V #2, Q #7, dO #5).
//
// nblk = ceil(seqlen / 128). Codes and scales are bit-identical to the CPU
// op quantize_tilescale (csrc/torch/ops_quant.cpp, quantize_block of
// quant/block_quant.h on the block's values): scale fp8attn::block_scale of
// the block's amax, codes fp8_encode(x * (1 / scale)); a block holding NaN or
// +-inf gets a NaN scale and NaN codes (0x7F for a positive-NaN product).
// The CPU reference's `tile` path quantizes the same whole tiles (it differs
// only where causal masking makes it requantize the visible part of a
// diagonal tile, numerics.md section 9 "Masking before quantization").
struct TileQuantJob {
  const void* x = nullptr;  // BF16 (float32 with x_fp32)
  int64_t stride_batch = 0, stride_head = 0, stride_seq = 0;
  // x_fp32: x holds float32 (strides in its elements, the same alignment rule),
  // read and rounded to BF16 before quantizing. rotate: the fused
  // qk_rotation="hadamard" (numerics.md 10.1, hadamard_sm90.cuh): each row x
  // becomes x R in FP32 (read as FP32, the reference's operations in its
  // order), rounded to BF16, then quantized: the codes of the unfused path
  // (torch / Triton rotation, then this kernel on the BF16 result) bit for bit.
  bool x_fp32 = false;
  bool rotate = false;
  int batch = 0, heads = 0, seqlen = 0, dim = 0;
  Fp8Format fmt = Fp8Format::kE4M3;
  Scaling recipe = Scaling::kTile;  // only kTile here (the `row` recipe: QuantJob)
  uint8_t* row = nullptr;
  float* row_s = nullptr;
  uint8_t* tile = nullptr;
  uint8_t* tileT = nullptr;
  float* tile_s = nullptr;  // required when tile or tileT is set
  int seqlen_pad = 0;       // multiple of 16, >= seqlen (only read when tileT != null)
  // tileT's 16-token groups in the order 0 1 8 9 2 3 10 11 4 5 12 13 6 7 14 15
  // (byte j of a group holds token order[j]): the forward's P V operand, whose
  // A fragments are the S accumulator's registers (fwdt::kVPermutedInQuant).
  bool tileT_perm16 = false;
  // A packed batch (varlen_sm90.h): x is [1, heads, total, dim] (stride_batch
  // unused), batch == 1, and seqlen is the padded rows per head (tiles_max *
  // 128; seqlen_pad equal to it): the CTA of padded tile t quantizes tokens
  // [tok[s] + 128 (t - tiles[s]), ...) of sequence s = tile_seq[t], at most
  // len[s] - 128 (t - tiles[s]) of them, into rows 128 t + r; its other rows
  // are zero tokens: code 0, the scale of a zero block. A tile no sequence owns
  // is not written (no kernel reads it). Pointers into the metadata of one side.
  const int* tile_seq = nullptr;  // nullptr: a dense operand
  const int* tiles = nullptr;
  const int* tok = nullptr;
  const int* len = nullptr;
};

// Launches the quantization on `stream`. Requirements (checked, throwing
// std::invalid_argument naming the field): recipe == kTile, dim in {64, 128,
// 192, 256}, 16-byte aligned x and strides, batch * heads < 2^31, seqlen <
// 2^30. seqlen == 0 or batch * heads == 0 is a no-op. Throws
// std::runtime_error on a CUDA launch error.
void quantize_tilescale_bf16_sm90(const TileQuantJob& job, cudaStream_t stream);

// Several operands (the forward's Q, K, V; later dO) in one launch per
// distinct (dim, x_fp32 || rotate) (one launch when every job has the same dim and
// none transforms, two for head dims 192 / 128 or rotated Q / K): one CTA per (128-token tile, batch, head) of every job, the
// jobs' tiles on one linear grid (more than 2^30 CTAs: several launches).
// Each job is checked as above; outputs bit-identical to one call per job.
constexpr int kMaxTileQuantJobs = 4;
void quantize_tilescale_bf16_sm90(const TileQuantJob* jobs, int n_jobs, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
