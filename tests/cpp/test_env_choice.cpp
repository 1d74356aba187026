// The parsing of the CUDA side's environment knobs (csrc/common/env_choice.h);
// the GPU tests in tests/python/test_cuda.py / test_cuda_bwd.py check that the
// kernels' launchers use it.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "common/env_choice.h"

namespace fp8attn {
namespace {

TEST(EnvChoice, UnsetOrEmptyIsTheDefault) {
  EXPECT_EQ(parse_env_choice("FP8ATTN_X", nullptr, {"a", "b"}), -1);
  EXPECT_EQ(parse_env_choice("FP8ATTN_X", "", {"a", "b"}), -1);
}

TEST(EnvChoice, AcceptedValuesGiveTheirIndex) {
  EXPECT_EQ(parse_env_choice("FP8ATTN_X", "a", {"a", "b"}), 0);
  EXPECT_EQ(parse_env_choice("FP8ATTN_X", "b", {"a", "b"}), 1);
}

TEST(EnvChoice, AnyOtherValueNamesTheVariableAndTheChoices) {
  for (const char* bad : {"c", "A", " a", "a ", "4x", "0"}) {
    try {
      parse_env_choice("FP8ATTN_X", bad, {"4", "8"});
      ADD_FAILURE() << "no error for '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("FP8ATTN_X='" + std::string(bad) + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("4, 8"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace fp8attn
