// fp8attn: CUDA-key kernels for ops that have no CUDA implementation, so a CUDA
// tensor gets a clear error naming the argument instead of torch's "Could not
// run 'fp8attn::...' with arguments from the 'CUDA' backend":
//   - in a CPU-only build (no FP8ATTN_WITH_CUDA): every op (ops.cpp);
//   - in a CUDA build: fp8_encode, fp8_decode, dequantize_blockwise (CPU only).
// And the CPU-key kernel of the CUDA-only ops (fwd_varlen, bwd_varlen: cuda_only_op).
// Boxed, so one function serves every schema.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

#include <string>

namespace fp8attn {

// Name and device of the first CUDA tensor argument on the stack (else of the
// first tensor argument: a call redispatched to the CUDA key, as the CPU test does).
inline std::pair<std::string, std::string> first_cuda_arg(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  std::pair<std::string, std::string> first{"?", "?"};
  for (size_t i = 0; i < n && stack->size() >= n; ++i) {
    const c10::IValue& v = (*stack)[stack->size() - n + i];
    if (!v.isTensor() || !v.toTensor().defined()) continue;
    if (v.toTensor().is_cuda()) return {args[i].name(), v.toTensor().device().str()};
    if (first.first == "?") first = {args[i].name(), v.toTensor().device().str()};
  }
  return first;
}

// "fwd" for fp8attn::fwd.
inline std::string op_name(const c10::OperatorHandle& op) {
  const std::string& full = op.schema().operator_name().name;
  const size_t colon = full.rfind("::");
  return colon == std::string::npos ? full : full.substr(colon + 2);
}

// CPU-only build: the library has no CUDA kernels at all.
inline void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto [arg, dev] = first_cuda_arg(op, stack);
  TORCH_CHECK_VALUE(false, "fp8attn.", op_name(op), ": argument '", arg, "': got a tensor on ", dev,
                    " for the CUDA kernels, but this fp8attn library was built without CUDA kernels "
                    "(FP8ATTN_BUILD_CUDA=0, or no nvcc matching torch.version.cuda / no GPU visible at build "
                    "time); rebuild on the GPU machine with `FP8ATTN_BUILD_CUDA=1 pip install "
                    "--no-build-isolation .`, or use CPU tensors");
}

// CUDA build, op with a CPU kernel only.
inline void cpu_only_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto [arg, dev] = first_cuda_arg(op, stack);
  TORCH_CHECK_VALUE(false, "fp8attn.", op_name(op), ": argument '", arg,
                    "': expected a CPU tensor (this op has a CPU kernel only), got device ", dev);
}

// Op with a CUDA kernel only (the single-launch varlen ops), called on CPU tensors.
inline void cuda_only_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto [arg, dev] = first_cuda_arg(op, stack);
  TORCH_CHECK_VALUE(false, "fp8attn.", op_name(op), ": argument '", arg, "': expected a CUDA tensor (this op has "
                    "CUDA kernels only; fp8attn.varlen_attention runs CPU tensors per sequence), got device ", dev);
}

}  // namespace fp8attn
