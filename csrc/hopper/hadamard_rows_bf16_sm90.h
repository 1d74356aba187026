// fp8attn: sm_90a map-back of the fused Q / K rotation's gradients
// (numerics.md section 10.1 "Gradients"): rows g of dQ' / dK' (BF16, what the
// `tile` backward writes) become g R^T, computed in FP32 by the reference's
// operations in its order (hadamard_sm90.cuh) and rounded once to the output.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fp8attn {
namespace sm90 {

// y[r] = g[r] R^T for rows r in [0, rows) of `dim` channels (64, 128, 192 or
// 256; R of numerics.md 10.1 for that head_dim). g: BF16 [rows, dim]
// contiguous, 16-byte aligned; y: the same shape, BF16 (rounded once, RNE) or
// float32 (y_fp32), contiguous, 16-byte aligned; y may not alias g. rows == 0
// is a no-op. Throws std::invalid_argument naming a bad argument and
// std::runtime_error on a launch error.
void hadamard_rows_transposed_bf16_sm90(const void* g, int64_t rows, int dim, void* y, bool y_fp32,
                                        cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
