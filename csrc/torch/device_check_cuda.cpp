// fp8attn: the device check of every CUDA op (see device_check.h).
#include "device_check.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <string>

#include "common/device_support.h"

namespace fp8attn {

void check_cuda_device(const c10::Device& device) {
  const int index = device.has_index() ? device.index() : at::cuda::current_device();
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
  const std::string msg = sm90_device_error(prop->name, index, prop->major, prop->minor);
  TORCH_CHECK(msg.empty(), msg);
}

}  // namespace fp8attn
