// fp8attn: sm_90a g R^T over rows of BF16 gradients (contract:
// hadamard_rows_bf16_sm90.h; math: numerics.md section 10.1). One lane per
// 16-channel unit of a row (the `tile` quantizer's lane map, hadamard_sm90.cuh),
// 256-thread CTAs striding over the rows; 32-byte loads, 32- / 64-byte stores.
#include "hopper/hadamard_rows_bf16_sm90.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "hopper/hadamard_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace {

constexpr int kThreads = 256;

template <int kDim>
__global__ void __launch_bounds__(kThreads)
    hadamard_rows_t_kernel(const uint16_t* __restrict__ g, int64_t rows, void* __restrict__ y, bool y_fp32) {
  constexpr int kUnits = kDim / hadamard::kUnit;
  constexpr int kLanes = kUnits <= 4 ? 4 : (kUnits <= 8 ? 8 : 16);  // a power of two (192: 12 of 16)
  constexpr int kRowsPerCta = kThreads / kLanes;
  const int lane = threadIdx.x % 32, u = lane % kLanes;
  const bool active = u < kUnits;
  const uint32_t neg = hadamard::unit_sign_mask(u);
  // NOTE: the loop bound is the same for every lane of a warp (whole rows per
  // warp, rows striding by whole CTAs), so the shuffles see full warps.
  const int64_t warp_row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x / 32) * (32 / kLanes);
  for (int64_t base = warp_row0; base < rows; base += static_cast<int64_t>(gridDim.x) * kRowsPerCta) {
    const int64_t r = base + lane / kLanes;
    const bool valid = active && r < rows;
    float x[hadamard::kUnit];
#pragma unroll
    for (int i = 0; i < hadamard::kUnit; ++i) x[i] = 0.f;
    if (valid) {
      const uint4* src = reinterpret_cast<const uint4*>(g + r * kDim + u * hadamard::kUnit);
      const uint4 a = src[0], b = src[1];
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        x[2 * i] = __uint_as_float((w[i] & 0xffffu) << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    }
    hadamard::rotate_unit_transposed<kDim>(x, u, neg, lane);  // every lane (shuffles)
    if (!valid) continue;
    if (y_fp32) {
      float4* dst = reinterpret_cast<float4*>(static_cast<float*>(y) + r * kDim + u * hadamard::kUnit);
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) dst[q4] = make_float4(x[4 * q4], x[4 * q4 + 1], x[4 * q4 + 2], x[4 * q4 + 3]);
    } else {
      uint32_t o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const __nv_bfloat162 p2 = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
        o[i] = *reinterpret_cast<const uint32_t*>(&p2);
      }
      uint4* dst = reinterpret_cast<uint4*>(static_cast<uint16_t*>(y) + r * kDim + u * hadamard::kUnit);
      dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
}

[[noreturn]] void bad(const char* arg, const std::string& what) {
  throw std::invalid_argument(std::string("fp8attn: hadamard_rows_transposed_bf16_sm90: '") + arg + "': " + what);
}

}  // namespace

void hadamard_rows_transposed_bf16_sm90(const void* g, int64_t rows, int dim, void* y, bool y_fp32,
                                        cudaStream_t stream) {
  if (rows < 0) bad("rows", "must be >= 0, got " + std::to_string(rows));
  if (dim != 64 && dim != 128 && dim != 192 && dim != 256)
    bad("dim", "must be 64, 128, 192 or 256, got " + std::to_string(dim));
  if (rows == 0) return;
  if (g == nullptr || reinterpret_cast<uintptr_t>(g) % 16 != 0) bad("g", "must be a non-null 16-byte aligned pointer");
  if (y == nullptr || reinterpret_cast<uintptr_t>(y) % 16 != 0) bad("y", "must be a non-null 16-byte aligned pointer");
  const int lanes = dim <= 64 ? 4 : (dim <= 128 ? 8 : 16);
  const int64_t rows_per_cta = kThreads / lanes;
  // Enough CTAs to fill the GPU several times over; the kernel strides past that.
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((rows + rows_per_cta - 1) / rows_per_cta, 1 << 20));
  const uint16_t* gp = static_cast<const uint16_t*>(g);
  switch (dim) {
    case 64: hadamard_rows_t_kernel<64><<<grid, kThreads, 0, stream>>>(gp, rows, y, y_fp32); break;
    case 128: hadamard_rows_t_kernel<128><<<grid, kThreads, 0, stream>>>(gp, rows, y, y_fp32); break;
    case 192: hadamard_rows_t_kernel<192><<<grid, kThreads, 0, stream>>>(gp, rows, y, y_fp32); break;
    default: hadamard_rows_t_kernel<256><<<grid, kThreads, 0, stream>>>(gp, rows, y, y_fp32); break;
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: hadamard_rows_transposed_bf16_sm90 launch failed: ") +
                             cudaGetErrorString(err));
}

}  // namespace sm90
}  // namespace fp8attn
