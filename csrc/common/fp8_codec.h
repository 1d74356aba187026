// fp8attn: bit-exact FP8 codecs (E4M3 "fn" and E5M2) and the power-of-two
// block scale rule. Header-only; usable from host and device code.
// Contract: numerics.md section 2.
//
// Encode (FP32 -> FP8):
//   - round-to-nearest-even on the FP8 grid, subnormals kept (no FTZ);
//   - finite values whose magnitude is >= the format's max saturate to +-max;
//   - NaN -> NaN; +-inf -> NaN for E4M3 (it has no inf) and +-inf for E5M2.
//     Non-finite input is never turned into a finite value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "params.h"

#if defined(__CUDACC__)
#define FP8ATTN_HD __host__ __device__ __forceinline__
#else
#define FP8ATTN_HD inline
#endif

namespace fp8attn {

// Format constants.
struct E4M3Traits {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMax = 448.f;
  static constexpr uint8_t kMaxCode = 0x7E;  // S.1111.110
  static constexpr uint8_t kNaNCode = 0x7F;  // S.1111.111
};
struct E5M2Traits {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMax = 57344.f;
  static constexpr uint8_t kMaxCode = 0x7B;  // S.11110.11
  static constexpr uint8_t kInfCode = 0x7C;  // S.11111.00
  static constexpr uint8_t kNaNCode = 0x7E;  // S.11111.10 (quiet NaN)
};

FP8ATTN_HD constexpr float fp8_max(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? E4M3Traits::kMax : E5M2Traits::kMax;
}

namespace detail {

FP8ATTN_HD uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

FP8ATTN_HD float round_to_int_rne(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);  // default FP environment rounds to nearest even
#endif
}

template <class T>
FP8ATTN_HD uint8_t encode_finite_magnitude(float a) {
  // a = |x|, finite, a < T::kMax (saturation handled by the caller).
  constexpr int kM = T::kMantBits;
  constexpr int kEmin = 1 - T::kBias;  // exponent of the smallest normal
  if (a < ldexpf(1.f, kEmin)) {
    // Subnormal range: count units of 2^(emin - M); an exact scaling.
    // q == 2^M lands on the smallest normal code, which is also correct.
    return static_cast<uint8_t>(round_to_int_rne(ldexpf(a, kM - kEmin)));
  }
  // Normal range: round the FP32 mantissa from 23 to M bits, ties to even;
  // a carry into the exponent is the correct result.
  constexpr int kShift = 23 - kM;
  uint32_t u = float_bits(a);
  u += ((1u << (kShift - 1)) - 1u) + ((u >> kShift) & 1u);
  u >>= kShift;
  return static_cast<uint8_t>(u - (static_cast<uint32_t>(127 - T::kBias) << kM));
}

template <class T>
FP8ATTN_HD float decode_magnitude(uint32_t e, uint32_t m) {
  constexpr int kM = T::kMantBits;
  if (e == 0) return ldexpf(static_cast<float>(m), 1 - T::kBias - kM);
  return ldexpf(static_cast<float>((1u << kM) | m), static_cast<int>(e) - T::kBias - kM);
}

}  // namespace detail

FP8ATTN_HD uint8_t fp8_encode_e4m3(float x) {
  using T = E4M3Traits;
  const uint8_t sign = static_cast<uint8_t>((detail::float_bits(x) >> 24) & 0x80u);
  if (!(x == x) || std::isinf(x)) return sign | T::kNaNCode;
  const float a = fabsf(x);
  if (a >= T::kMax) return sign | T::kMaxCode;
  uint8_t c = detail::encode_finite_magnitude<T>(a);
  if (c > T::kMaxCode) c = T::kMaxCode;
  return sign | c;
}

FP8ATTN_HD uint8_t fp8_encode_e5m2(float x) {
  using T = E5M2Traits;
  const uint8_t sign = static_cast<uint8_t>((detail::float_bits(x) >> 24) & 0x80u);
  if (!(x == x)) return sign | T::kNaNCode;
  if (std::isinf(x)) return sign | T::kInfCode;
  const float a = fabsf(x);
  if (a >= T::kMax) return sign | T::kMaxCode;
  uint8_t c = detail::encode_finite_magnitude<T>(a);
  if (c > T::kMaxCode) c = T::kMaxCode;
  return sign | c;
}

FP8ATTN_HD float fp8_decode_e4m3(uint8_t c) {
  const float s = (c & 0x80u) ? -1.f : 1.f;
  const uint32_t e = (c >> 3) & 0xFu, m = c & 0x7u;
  if (e == 0xF && m == 0x7) return NAN;
  return s * detail::decode_magnitude<E4M3Traits>(e, m);
}

FP8ATTN_HD float fp8_decode_e5m2(uint8_t c) {
  const float s = (c & 0x80u) ? -1.f : 1.f;
  const uint32_t e = (c >> 2) & 0x1Fu, m = c & 0x3u;
  if (e == 0x1F) return m == 0 ? s * INFINITY : NAN;
  return s * detail::decode_magnitude<E5M2Traits>(e, m);
}

FP8ATTN_HD uint8_t fp8_encode(float x, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? fp8_encode_e4m3(x) : fp8_encode_e5m2(x);
}
FP8ATTN_HD float fp8_decode(uint8_t c, Fp8Format f) {
  return f == Fp8Format::kE4M3 ? fp8_decode_e4m3(c) : fp8_decode_e5m2(c);
}

// numerics.md section 2: s = 2^ceil(log2(amax / fp8_max)), s = 1 when
// amax == 0, exponent clamped to [-126, 127]. Computed exactly: the smallest
// power of two s with amax / s <= fp8_max. A non-finite amax (the block holds
// NaN or +-inf) gives a NaN scale, so the block's contribution is NaN.
FP8ATTN_HD int block_scale_exponent(float amax, Fp8Format f) {
  const float fmax = fp8_max(f);
  int e;
  frexpf(amax / fmax, &e);  // amax / fmax in [2^(e-1), 2^e)
  if (e > 127) e = 127;
  if (e < -126) e = -126;
  while (e < 127 && ldexpf(amax, -e) > fmax) ++e;
  while (e > -126 && ldexpf(amax, -(e - 1)) <= fmax) --e;
  return e;
}

FP8ATTN_HD float block_scale(float amax, Fp8Format f) {
  if (!(amax == amax) || std::isinf(amax)) return NAN;
  if (amax == 0.f) return 1.f;
  return ldexpf(1.f, block_scale_exponent(amax, f));
}

// block_scale by exponent arithmetic, for the kernels (the loops above cost
// tens of instructions), for amax >= 0 or NaN (a block's largest |x|): for a
// normal amax = m 2^E (m in [1, 2)) and the format's max 1.75 2^P (E4M3 P = 8,
// E5M2 P = 15), the smallest power of two s with amax / s <= max is 2^(E - P),
// or 2^(E - P + 1) if m > 1.75, the exponent clamped to [-126, 127]; a
// subnormal amax lands on the clamp 2^-126 by the same expression; 0 -> 1;
// NaN / inf -> NaN. Bit-identical to block_scale on that domain
// (tests/cpp/test_fp8_codec.cpp, BlockScaleFast).
FP8ATTN_HD float block_scale_fast(float amax, Fp8Format f) {
  if (!(amax <= 3.402823466e38f)) return NAN;
  const uint32_t u = detail::float_bits(amax);
  if (u == 0u) return 1.f;
  int e = static_cast<int>(u >> 23) - 127 - (f == Fp8Format::kE4M3 ? 8 : 15) + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = e < -126 ? -126 : (e > 127 ? 127 : e);
  const uint32_t r = static_cast<uint32_t>(e + 127) << 23;
  float s;
  memcpy(&s, &r, sizeof(s));
  return s;
}

// 1 / s for a block scale s (a power of two 2^e, e in [-126, 127]), exact and
// without a division: 2^-127 is the subnormal 0x00400000. NaN for anything
// else (a NaN scale stays NaN).
FP8ATTN_HD float block_scale_inverse(float s) {
  const uint32_t ex = detail::float_bits(s) >> 23;
  // NOTE: selects, no branch (the backward's register budget is tight).
  const uint32_t r = ex == 0u || ex >= 0xffu ? 0x7fc00000u : (ex < 254u ? (254u - ex) << 23 : 0x00400000u);
  float inv;
  memcpy(&inv, &r, sizeof(inv));
  return inv;
}

}  // namespace fp8attn
