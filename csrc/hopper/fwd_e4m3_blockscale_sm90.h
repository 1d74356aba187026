// fp8attn: entry point of the sm_90a FP8 forward of the `row` recipe
// (numerics.md sections 1-3, matmuls #1 and #2); the kernel is the wgmma one
// (fwd_wgmma_e4m3_blockscale_sm90.h).
//
// run_fwd(p, stream) computes O (BF16, contiguous [B, Hq, Sq, Dv] in p.out)
// and LSE (FP32 [B, Hq, Sq] in p.lse, natural log) from the quantized operands
// p.q_row / p.k_row (row-blocked, E4M3) and p.v_colT (column-blocked,
// transposed, E4M3) and their scales (layouts: kernel_params_sm90.h):
//
//   for each (batch, query head, query tile), key tiles of 128 keys in
//   increasing order:
//     S = tau * sum_d-blocks (Q_hat K_hat^T partial) * s_q * s_k      (#1, FP32)
//     m_new = max(m, rowmax S); P = exp(S - m_new)  (FP32, unnormalized)
//     l = l * exp(m - m_new) + rowsum P              (unquantized P)
//     P_hat = E4M3(P / s_p), s_p = block_scale(rowmax P)  (one block per
//             query row: the 128 keys of the tile)
//     acc = acc * exp(m - m_new) + (P_hat V_hat partial) * s_p * s_v   (#2)
//   O = acc / l; LSE = m + log(l). A row that sees no key: O = 0, LSE = -inf.
//
// Causal (bottom-right): query i sees key j iff j <= i + Sk - Sq; key tiles
// entirely above the diagonal are skipped, partial tiles masked.
//
// Preconditions (set by csrc/torch/ops_cuda.cpp): block_size == 128;
// (head_dim_qk, head_dim_v) in {(64,64), (128,128), (256,256), (192,128)};
// num_heads_q % num_heads_kv == 0; seqlen_q, seqlen_k in [1, 2^30); batch * num_heads_q
// < 2^31 (more than 65535 heads or batch entries run as several launches,
// launch_sm90.h).
// Errors: an unsupported configuration (including q_row, k_row or v_colT not
// 16-byte aligned) throws std::invalid_argument naming the field, as does an
// FP8ATTN_FWD_KERNEL value other than wgmma / wgmma_serial / wgmma_overlap /
// wgmma_pingpong / wgmma_serial3 (unset or empty: the default schedule); a
// CUDA launch error throws std::runtime_error.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {

void run_fwd(const KernelParams& p, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
