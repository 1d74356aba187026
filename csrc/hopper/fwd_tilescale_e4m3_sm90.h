// fp8attn: sm_90a forward of the `tile` scaling recipe (numerics.md section 9,
// matmuls #1 and #2). Kernel notes: docs/kernels/fwd_tilescale_e4m3_sm90.md.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {

// Whether run_fwd_tile serves p: block_size 128, (head_dim_qk, head_dim_v) in
// {(64,64), (128,128), (192,128), (256,256)}, 16-byte aligned operands.
bool fwd_tile_supported(const KernelParams& p);

// O [B, Hq, Sq, Dv] BF16 (p.out, contiguous) and LSE [B, Hq, Sq] (p.lse,
// natural log; -inf and O = 0 for a row that sees no key) from the `tile`
// operands of kernel_params_sm90.h / quant_tilescale_e4m3_sm90.h:
//   q_row  [B, Hq, Sq, Dqk] codes, q_row_s [B, Hq, Sq] (one scale per query row);
//   k_row  [B, Hkv, Sk, Dqk] codes, k_row_s [B, Hkv, nblk_k] (one per 128-key tile);
//   v_colT [B, Hkv, Dv, Sk_pad] codes, v_col_s [B, Hkv, nblk_k] (one per tile).
// GQA (query head h reads kv head h / (Hq / Hkv)), causal bottom-right
// aligned (numerics.md section 1). Any batch x heads (launch_sm90.h chunks).
// p.softcap > 0: logit softcapping (numerics.md section 12), dense batches only.
// Throws std::runtime_error for an unsupported configuration or a launch error.
void run_fwd_tile(const KernelParams& p, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
