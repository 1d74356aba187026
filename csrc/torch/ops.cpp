// fp8attn: the op schemas (one place). Implementations live in
// ops_attention.cpp and ops_quant.cpp (CPU) and ops_cuda.cpp (CUDA).
// Layouts and semantics: docs/architecture.md, docs/numerics.md.
#include <torch/library.h>

#include "op_stubs.h"

#ifdef FP8ATTN_WITH_CUDA
#define FP8ATTN_CUDA_BUILT true
#else
#define FP8ATTN_CUDA_BUILT false
#endif

TORCH_LIBRARY(fp8attn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, str precision, "
      "int block_size, str scaling=\"row\", str qk_rotation=\"none\", bool smooth_k=False, float softcap=0.0, "
      "int window_left=-1, int window_right=-1) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
      "bool causal, str precision, str delta_mode, int block_size, str grad_format, bool diagnostics, "
      "str scaling=\"row\", str qk_rotation=\"none\", bool smooth_k=False, Tensor? delta=None, "
      "float softcap=0.0, int window_left=-1, int window_right=-1, bool deterministic=False) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor diag)");
  // deterministic (`bwd`, appended last): dQ, dK, dV the same bit for bit from run to
  // run. CPU: always so (the flag is accepted). CUDA: scaling "tile" orders the dQ
  // reduce-adds (KernelParams::dq_sem); scaling "row" raises NotImplementedError.
  // Context parallelism (numerics.md section 11): `bwd` with `delta` (float32
  // [B, Hq, Sq], delta_mode "delta_matching", precision "fp8") takes that delta for
  // every row and P = exp(S - lse) from the lse given (the global LSE'), for a
  // shard of the key axis; bwd_dm_sums is the Delta-Matching pre-pass of one key
  // shard: the FP32 partial row sums sum_j P_ij dP_hat_ij and sum_j P_ij, P from
  // the forward's (global) lse.
  // window_left / window_right (every attention op; appended last so positional
  // callers keep working): FlashAttention's window_size, numerics.md section 14;
  // -1 = unbounded, causal forces window_right = 0. CUDA: scaling "tile" takes any
  // window; scaling "row" raises NotImplementedError naming window_size unless the
  // window masks nothing beyond causal.
  m.def(
      "bwd_dm_sums(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor lse, float softmax_scale, bool causal, "
      "int block_size, str grad_format, str scaling=\"row\", float softcap=0.0, int window_left=-1, "
      "int window_right=-1) -> (Tensor sum_pdp, Tensor sum_p)");
  // Packed variable-length batches in one launch per kernel (CUDA, scaling "tile";
  // hopper/varlen_sm90.h): q [total_q, Hq, D], k / v [total_k, Hkv, D], cu_seqlens
  // int32 / int64 [batch + 1], seqused [batch] or None, read on the device only
  // (unchecked values are clamped inside the tensors: varlen_attention's check=True
  // checks them). out [total_q, Hq, Dv], lse [Hq, total_q]; bwd_varlen's diag
  // [4, Hq, total_q]. Sequence s is the dense fwd / bwd on its slices. CPU tensors:
  // varlen_attention's per-sequence path (these ops raise ValueError on CPU).
  // qk_rotation: "hadamard" rotates Q and K inside the quantization as the dense ops
  // do (numerics.md 10.3; unpadded head_dim_qk only); K smoothing is per sequence
  // and runs through the per-sequence path.
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q, "
      "Tensor? seqused_k, float softmax_scale, bool causal, int block_size, str scaling=\"tile\", "
      "int window_left=-1, int window_right=-1, str qk_rotation=\"none\") -> (Tensor out, Tensor lse)");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, float softmax_scale, bool causal, "
      "str delta_mode, int block_size, str grad_format, bool diagnostics, str scaling=\"tile\", "
      "int window_left=-1, int window_right=-1, str qk_rotation=\"none\") -> (Tensor dq, Tensor dk, Tensor dv, "
      "Tensor diag)");
  m.def("fp8_encode(Tensor x, str fmt) -> Tensor");
  m.def("fp8_decode(Tensor codes, str fmt) -> Tensor");
  m.def("quantize_blockwise(Tensor x, int dim, int block_size, str fmt) -> (Tensor codes, Tensor scales)");
  m.def("dequantize_blockwise(Tensor codes, Tensor scales, int dim, int block_size, str fmt) -> Tensor");
  // The `tile` recipe's operand blockings (numerics.md section 9): dim 3 = one
  // block per token over all of head_dim, dim 2 = one block per block_size
  // tokens over all of head_dim; `transposed` selects the CUDA kernel's
  // sequence-contiguous copy of the dim-2 codes (same values).
  m.def("quantize_tilescale(Tensor x, int dim, int block_size, str fmt, bool transposed=False) -> (Tensor codes, Tensor scales)");
  // The `tile` forward's operands in one call (on CUDA: the one fused launch the
  // forward runs): Q per token, K per 128-token tile, V per tile as V^T codes
  // (a transposed view on CUDA); block_size 128. Same values as three
  // quantize_tilescale calls.
  m.def("quantize_tilescale_fwd(Tensor q, Tensor k, Tensor v, str fmt) -> (Tensor q_codes, Tensor q_scales, "
        "Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales)");
  // Whether this library holds the sm_90a kernels (fp8attn._lib.HAS_CUDA_KERNELS).
  // NOTE: a CPU-only build also registers CUDA-key kernels (errors, below), so
  // the dispatch table cannot tell the builds apart.
  m.def("cuda_kernels_built() -> bool", [] { return FP8ATTN_CUDA_BUILT; });
}

#ifndef FP8ATTN_WITH_CUDA
// A CUDA tensor in a CPU-only build: a ValueError saying so and how to rebuild
// (op_stubs.h), not torch's "Could not run ... 'CUDA' backend".
TORCH_LIBRARY_IMPL(fp8attn, CUDA, m) {
  for (const char* name : {"fwd", "bwd", "bwd_dm_sums", "fp8_encode", "fp8_decode", "quantize_blockwise", "dequantize_blockwise",
                           "quantize_tilescale", "quantize_tilescale_fwd", "fwd_varlen", "bwd_varlen"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fp8attn::cuda_not_built>());
}
#endif

// The single-launch varlen ops have CUDA kernels only (op_stubs.h).
TORCH_LIBRARY_IMPL(fp8attn, CPU, m) {
  for (const char* name : {"fwd_varlen", "bwd_varlen"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fp8attn::cuda_only_op>());
}
