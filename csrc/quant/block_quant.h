// fp8attn: block-scaled FP8 quantization on the CPU (numerics.md section 2).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/fp8_codec.h"

namespace fp8attn {

// Quantizes one block of n elements x[0], x[stride], ... with the power-of-two
// block scale of numerics.md section 2. Writes the FP8 codes (if codes != null)
// and the decoded values x_hat * s (if decoded != null, same stride as x) and
// returns the scale s. A block holding NaN or +-inf gets a NaN scale and a
// NaN decoded block (numerics.md: non-finite input is never saturated).
inline float quantize_block(const float* x, int64_t n, int64_t stride, Fp8Format fmt,
                            uint8_t* codes, float* decoded) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i * stride]);
    finite &= std::isfinite(a);
    amax = a > amax ? a : amax;
  }
  const float s = finite ? block_scale(amax, fmt) : NAN;
  const float inv_s = 1.f / s;  // exact: s is a power of two
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t c = fp8_encode(x[i * stride] * inv_s, fmt);
    if (codes) codes[i * stride] = c;
    if (decoded) decoded[i * stride] = fp8_decode(c, fmt) * s;
  }
  return s;
}

}  // namespace fp8attn
