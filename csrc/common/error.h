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
