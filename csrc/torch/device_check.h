// fp8attn: the device check of every CUDA op (device_check_cuda.cpp).
#pragma once

#include <c10/core/Device.h>

namespace fp8attn {

// Raises RuntimeError naming the device (index, name, compute capability) and
// what is supported (compute capability 9.0: H100 / H200 / GH200) when `device`
// cannot run the sm_90a kernels (common/device_support.h sm90_device_error). The
// properties come from at::cuda::getDeviceProperties (cached per device by
// torch), so the check costs a compare per call.
void check_cuda_device(const c10::Device& device);

}  // namespace fp8attn
