// fp8attn: launchers of the sm_90a `tile`-recipe FP8 backward kernels
// (numerics.md section 9), called by run_bwd (bwd_sm90.h) when p.scaling is
// Scaling::kTile. Operand layouts: kernel_params_sm90.h (the `tile` scale
// shapes). Preconditions: those of run_bwd (bwd_sm90.h); in particular
// p.block_size == 128 and (head_dim_qk, head_dim_v) in {(64, 64), (128, 128),
// (192, 128), (256, 256)}. Design: docs/kernels/bwd_tilescale_e4m3_sm90.md.
// Validated on the H200 (tests/python/test_tile_cuda_bwd.py, compute-sanitizer) but
// slower than the `row` backward: the op runs them only with FP8ATTN_TILE_BWD=1
// (csrc/torch/ops_cuda.cpp). p.num_seqs > 0 (a packed batch, bwd_sm90.h):
// their kVarlen instantiations (not yet run on a GPU).
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace ts {

// Delta-Matching pre-pass: writes p.delta_dm (and p.delta for delta_matching).
void launch_tilescale_prepass(const KernelParams& p, cudaStream_t stream);
// Main backward: dK, dV (BF16, p.dk / p.dv), dQ partials into p.dq_accum
// (zero-filled before; FP32, without tau; the `tile` layout of dq_accum_rows,
// added by TMA bulk reduce-adds), row-sum diagnostics into p.rowsum_ws.
void launch_tilescale_main(const KernelParams& p, cudaStream_t stream);
// dQ = BF16(tau dq_accum) into p.dq from the chunk order of the `tile`
// dq_accum (kernel_params_sm90.h, dq_accum_rows).
void launch_tilescale_dq_convert(const KernelParams& p, cudaStream_t stream);

}  // namespace ts
}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
