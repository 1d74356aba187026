// fp8attn: entry point of the sm_90a FP8 backward (numerics.md sections 3-5).
//
// run_bwd(p, stream) computes dQ, dK, dV (BF16, contiguous [B, H, S, D] in
// p.dq / p.dk / p.dv) from the quantized operands in p (layouts documented in
// kernel_params_sm90.h; q_row, k_row, v_row, do_row, k_colT, q_colT, do_colT
// and their scales must be filled) and the BF16 o, dout, lse.
//
// Preconditions set by the launcher (csrc/torch/ops_cuda.cpp):
//   - p.block_size == 128; head_dim_qk, head_dim_v in {64, 128, 256} or
//     (192, 128); num_heads_q % num_heads_kv == 0; seqlen_q, seqlen_k in
//     [1, 2^30); batch * num_heads_q < 2^31 (more than 65535 heads or batch
//     entries run as several launches, launch_sm90.h).
//   - p.delta, p.delta_dm: FP32 [B, Hq, Sq], any content (written here).
//   - p.dq_accum: FP32 [B, Hq, dq_accum_rows(p.scaling, Sq), Dqk] in that recipe's
//     layout (kernel_params_sm90.h), zero-filled.
//   - p.diag: FP32 [4, B, Hq, Sq] (delta, eps, rowsum_pre, rowsum_post) or
//     nullptr; p.rowsum_ws: FP32 [4, B, Hq, Sq], zero-filled, non-null iff
//     p.diag is.
// Packed variable-length batches (p.num_seqs > 0, varlen_sm90.h; `tile`
// recipe only, one launch per kernel): p.batch == 1, p.varlen_meta set,
// num_heads_q and num_heads_kv x slices <= 65535, seqlen_q_pad / seqlen_k_pad
// == q_tiles_max / k_tiles_max * 128, seqlen_q / seqlen_k the total token
// counts. Token-indexed: q, k, v, o, dout through their strides (batch 0);
// lse, delta, delta_dm, lse_bwd [Hq, total_q]; diag, rowsum_ws [4, Hq,
// total_q]; dq [total_q, Hq, Dqk], dk [total_k, Hkv, Dqk], dv [total_k, Hkv,
// Dv] written token-major, only at the tokens of the sequences (the others are
// the caller's). Padded (every sequence from a 128-row tile of its own, rows
// past its length code 0): the codes and scales of kernel_params_sm90.h with
// seqlen_*_pad rows and *_tiles_max tiles per head, and dq_accum [Hq,
// seqlen_q_pad, Dqk] (zero-filled). Each sequence's dQ, dK, dV are a dense
// call's on it alone (bit for bit up to the order of dq_accum's adds).
// The `row` recipe (scaling 0) and prepass_sums throw std::invalid_argument.
// Logit softcapping (p.softcap > 0, numerics.md section 12): the `tile`
// recipe's dense kernels only (with prepass_sums and a given delta too); the
// `row` recipe and packed batches throw std::invalid_argument.
// Errors: an unsupported configuration throws std::runtime_error naming the
// argument; CUDA launch errors throw std::runtime_error.
#pragma once

#include <cuda_runtime.h>

#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {

void run_bwd(const KernelParams& p, cudaStream_t stream);
// dQ = BF16(softmax_scale dq_accum) into p.dq: run_bwd's step 3, which run_bwd
// skips when p.dq is null, so that the caller can allocate dQ after the main
// kernel, in the memory of the quantized operands it no longer needs (the
// backward's peak memory; ops_cuda.cpp bwd_cuda_impl). Throws
// std::invalid_argument without dq or dq_accum.
void run_bwd_dq_convert(const KernelParams& p, cudaStream_t stream);

}  // namespace sm90
}  // namespace fp8attn
