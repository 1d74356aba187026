// fp8attn: which GPUs the CUDA kernels run on. Host-only and torch-free, so the
// decision is unit-tested on the CPU (tests/cpp/test_device_support.cpp); the
// ops call it through csrc/torch/device_check.h.
#pragma once

#include <string>

namespace fp8attn {

// The device check of every CUDA op (the kernels are compiled for sm_90a, whose
// wgmma / TMA / setmaxnreg instructions exist on compute capability 9.0 only):
// empty when a device of compute capability major.minor runs them, else the
// error message naming the device. Python's fp8attn._lib.device_support_error
// gives the same text.
inline std::string sm90_device_error(const std::string& name, int index, int major, int minor) {
  if (major == 9 && minor == 0) return {};
  return "fp8attn: CUDA device " + std::to_string(index) + " (" + name + ", compute capability " +
         std::to_string(major) + "." + std::to_string(minor) +
         ") is not supported: the CUDA kernels need compute capability 9.0 (sm_90, Hopper: H100 / H200 / "
         "GH200); use CPU tensors for the CPU reference";
}

}  // namespace fp8attn
