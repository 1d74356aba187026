// fp8attn: argument checks that throw a clear error naming the argument.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace fp8attn {

// Thrown for a bad argument; the message names the argument and what was
// expected. The PyTorch layer maps it to ValueError.
class ArgumentError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A floating-point value as an error message shows it: iostream's default %g-like
// form, as TORCH_CHECK streams a double (6 significant digits: "1e+300", "-1e-07",
// "inf", "nan"). Never std::to_string, whose fixed "%f" gives 301 digits for 1e300
// and "-0.000000" for -1e-7.
inline std::string format_float(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

namespace detail {
template <typename... Args>
[[noreturn]] inline void throw_argument_error(const char* arg, Args&&... parts) {
  std::ostringstream os;
  os << "fp8attn: argument '" << arg << "': ";
  (os << ... << parts);
  throw ArgumentError(os.str());
}
}  // namespace detail

}  // namespace fp8attn

// FP8ATTN_CHECK_ARG(cond, "arg_name", "expected ...", value, ...)
#define FP8ATTN_CHECK_ARG(cond, arg, ...)                                \
  do {                                                                   \
    if (!(cond)) ::fp8attn::detail::throw_argument_error(arg, __VA_ARGS__); \
  } while (0)
