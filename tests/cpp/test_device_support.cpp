// The device decision of the CUDA ops (csrc/common/device_support.h): compute
// capability 9.0 runs, anything else gets a message naming the device and what
// is supported. tests/python/test_device_support.py checks the Python twin.
#include <gtest/gtest.h>

#include <string>

#include "common/device_support.h"

namespace fp8attn {
namespace {

TEST(DeviceSupport, OnlyComputeCapability90Runs) {
  EXPECT_EQ(sm90_device_error("NVIDIA H100 80GB HBM3", 0, 9, 0), "");
  EXPECT_EQ(sm90_device_error("NVIDIA H200", 1, 9, 0), "");
  struct Case {
    const char* name;
    int major, minor;
  };
  for (const Case& c : {Case{"NVIDIA A100-SXM4-80GB", 8, 0}, Case{"NVIDIA L40S", 8, 9},
                        Case{"NVIDIA B200", 10, 0}, Case{"NVIDIA GeForce RTX 5090", 12, 0},
                        Case{"Tesla V100-SXM2-16GB", 7, 0}, Case{"hypothetical", 9, 1}}) {
    const std::string msg = sm90_device_error(c.name, 3, c.major, c.minor);
    EXPECT_NE(msg.find(std::string("CUDA device 3 (") + c.name), std::string::npos) << msg;
    EXPECT_NE(msg.find("compute capability " + std::to_string(c.major) + "." + std::to_string(c.minor)),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("sm_90, Hopper: H100 / H200"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace fp8attn
