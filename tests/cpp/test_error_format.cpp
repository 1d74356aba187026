// Floating values in error messages (common/error.h format_float): the %g-like form
// TORCH_CHECK streams, never std::to_string's fixed "%f" (a new user's trial: a huge
// value printed hundreds of digits; a tiny negative softcap printed "-0.000000").
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "common/error.h"

namespace fp8attn {
namespace {

TEST(FormatFloat, HugeAndTinyValuesPrintShort) {
  EXPECT_EQ(format_float(1e300), "1e+300");
  EXPECT_EQ(format_float(std::numeric_limits<double>::max()), "1.79769e+308");
  EXPECT_EQ(format_float(3.4e38f), "3.4e+38");
  EXPECT_EQ(format_float(-1e-7f), "-1e-07");   // std::to_string: "-0.000000"
  EXPECT_EQ(format_float(-2.5), "-2.5");
  EXPECT_EQ(format_float(0.0), "0");
}

TEST(FormatFloat, NonFinite) {
  EXPECT_EQ(format_float(std::numeric_limits<double>::infinity()), "inf");
  EXPECT_EQ(format_float(-std::numeric_limits<float>::infinity()), "-inf");
  EXPECT_EQ(format_float(std::nan("")), "nan");
}

TEST(FormatFloat, MessagesStayShort) {
  for (double x : {1e300, -1e300, 1e-300, 3.4028234663852886e38}) {
    EXPECT_LE(format_float(x).size(), 13u) << format_float(x);
  }
}

}  // namespace
}  // namespace fp8attn
