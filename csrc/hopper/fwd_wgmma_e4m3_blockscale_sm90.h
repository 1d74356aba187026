// fp8attn: sm_90a FP8 forward on wgmma + TMA (numerics.md sections 1-3,
// matmuls #1 and #2). Same contract and math as run_fwd
// (fwd_e4m3_blockscale_sm90.h): O (BF16, contiguous [B, Hq, Sq, Dv]) and LSE
// (FP32 [B, Hq, Sq]) from q_row / k_row / v_colT and their block scales.
//
// run_fwd dispatches here after its argument checks (the `row` recipe's one
// forward kernel; the mma.sync one was removed on 2026-12-07, code at f7729f9);
// FP8ATTN_FWD_KERNEL=wgmma_serial | wgmma_overlap | wgmma_pingpong |
// wgmma_serial3 selects the v1 | v2 | v3 | v11 consumer schedule at
// head_dim_qk <= 128 instead of the default (v11 at 64, v3 at 128; head_dim_qk
// 192 and 256 have one schedule); another value is an error (run_fwd). Design
// and measurements:
// docs/kernels/fwd_wgmma_e4m3_blockscale_sm90.md.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {

// True when the wgmma kernel covers p: (head_dim_qk, head_dim_v) in
// {(64, 64), (128, 128), (256, 256), (192, 128)}, block_size 128, 16-byte
// aligned operand buffers.
bool fwd_wgmma_supported(const KernelParams& p);

// Preconditions: those of run_fwd and fwd_wgmma_supported(p). Errors: a CUDA
// or tensor-map failure throws std::runtime_error.
void run_fwd_wgmma(const KernelParams& p, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
