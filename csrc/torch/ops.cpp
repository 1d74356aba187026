// fp8attn: the op schemas (one place). Implementations live in
// ops_attention.cpp and ops_quant.cpp (CPU) and ops_cuda.cpp (CUDA).
// Layouts and semantics: docs/architecture.md, docs/numerics.md.
#include <torch/library.h>

TORCH_LIBRARY(fp8attn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, str precision, "
      "int block_size, str scaling=\"row\") -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, "
      "bool causal, str precision, str delta_mode, int block_size, str grad_format, bool diagnostics, "
      "str scaling=\"row\") "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor diag)");
  m.def("fp8_encode(Tensor x, str fmt) -> Tensor");
  m.def("fp8_decode(Tensor codes, str fmt) -> Tensor");
  m.def("quantize_blockwise(Tensor x, int dim, int block_size, str fmt) -> (Tensor codes, Tensor scales)");
  m.def("dequantize_blockwise(Tensor codes, Tensor scales, int dim, int block_size, str fmt) -> Tensor");
}
