// fp8attn: sm_90a block-scaled FP8 quantization of a BF16 attention operand
// (Q, K, V or dO) into the two blockings of kernel_params_sm90.h.
// Math: numerics.md section 2 (scale rule, RNE, saturation, block NaN) and
// section 3 (which operand is blocked along which dimension).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"

namespace fp8attn {
namespace sm90 {

// One BF16 operand X [batch, heads, seqlen, dim] (strides in elements, the
// dim stride is 1; the data pointer and the three strides must be multiples
// of 8 elements so every row starts on a 16-byte boundary) and where to put
// its quantized forms. Either output pair may be null (not produced).
//
//   row  [batch, heads, seqlen, dim] FP8 codes, row_s [batch, heads, seqlen, nblk(dim)]:
//        blocks of min(128, dim) channels along dim (the last block may be
//        shorter: dim = 192 -> 128 + 64), one per token.
//   colT [batch, heads, dim, seqlen_pad] FP8 codes, col_s [batch, heads, dim, ceil(seqlen / 128)]:
//        blocks of 128 tokens along the sequence (starting at token 0), one per
//        channel, stored transposed (sequence contiguous); codes of the
//        padding tokens [seqlen, seqlen_pad) are 0.
//
// Codes and scales are bit-identical to the CPU quantize_blockwise
// (block_quant.h) on the same values: scale from fp8attn::block_scale, codes
// fp8_encode(x * (1 / scale)); a block holding NaN or +-inf gets a NaN scale
// and NaN codes.
struct QuantJob {
  const void* x = nullptr;  // BF16
  int64_t stride_batch = 0, stride_head = 0, stride_seq = 0;
  int batch = 0, heads = 0, seqlen = 0, dim = 0;
  Fp8Format fmt = Fp8Format::kE4M3;
  uint8_t* row = nullptr;
  float* row_s = nullptr;
  uint8_t* colT = nullptr;
  float* col_s = nullptr;
  int seqlen_pad = 0;  // multiple of 16, >= seqlen (only read when colT != null)
};

// Launches the quantization on `stream`. Requirements (checked, throwing
// std::invalid_argument naming the field): dim in {64, 128, 192, 256} (head
// dims whose blocks are 64 or 128 channels), 16-byte aligned x and strides,
// batch * heads < 2^31 (any number of (b, h) rows: more than 65535 run as
// several launches, launch_sm90.h), seqlen < 2^30 (token indices are int,
// element offsets 64-bit). seqlen == 0 or batch * heads == 0 is a no-op.
// Throws std::runtime_error on a CUDA launch error.
void quantize_bf16_sm90(const QuantJob& job, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
