// fp8attn: environment knobs of the C++/CUDA side (FP8ATTN_FWD_KERNEL,
// FP8ATTN_TILE_PINGPONG, FP8ATTN_TILE_FWD, ...; the table of every knob is in
// docs/architecture.md, "Environment variables"). Host-only and torch-free, so
// the parsing is unit-tested on the CPU (tests/cpp/test_env_choice.cpp).
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace fp8attn {

// The index of `value` in `accepted`, or -1 when `value` is null or empty (the
// variable is unset: the caller's default). Any other value throws
// std::invalid_argument (ValueError in Python) naming the variable, the value
// and the accepted values: a misspelt knob must never silently pick the default.
inline int parse_env_choice(const char* name, const char* value, std::initializer_list<const char*> accepted) {
  if (value == nullptr || value[0] == '\0') return -1;
  int i = 0;
  std::string list;
  for (const char* a : accepted) {
    if (std::string(value) == a) return i;
    list += (i ? ", " : "") + std::string(a);
    ++i;
  }
  throw std::invalid_argument(std::string("fp8attn: environment variable ") + name + "='" + value +
                              "' is not one of " + list + " (or unset / empty for the default)");
}

// parse_env_choice on the process environment (read at every call, so a test or
// benchmark can change it between calls).
inline int env_choice(const char* name, std::initializer_list<const char*> accepted) {
  return parse_env_choice(name, std::getenv(name), accepted);
}

}  // namespace fp8attn
