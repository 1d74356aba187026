// Exhaustive tests of the bit-exact FP8 codecs and the block scale rule
// (csrc/common/fp8_codec.h; contract: numerics.md section 2).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/fp8_codec.h"
#include "quant/block_quant.h"

namespace fp8attn {
namespace {

struct FormatInfo {
  Fp8Format fmt;
  const char* name;
  uint8_t max_code;   // largest finite positive code
  float max;          // its value
  float min_sub;      // smallest positive subnormal
  float min_normal;   // smallest positive normal
};

const FormatInfo kFormats[] = {
    {Fp8Format::kE4M3, "E4M3", E4M3Traits::kMaxCode, 448.f, 0x1p-9f, 0x1p-6f},
    {Fp8Format::kE5M2, "E5M2", E5M2Traits::kMaxCode, 57344.f, 0x1p-16f, 0x1p-14f},
};

bool is_nan_code(uint8_t c, Fp8Format f) { return std::isnan(fp8_decode(c, f)); }

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// ---- decode: known values, monotonicity, the decode table --------------------

TEST(Fp8Codec, DecodeKnownValues) {
  EXPECT_EQ(fp8_decode_e4m3(0x38), 1.f);
  EXPECT_EQ(fp8_decode_e4m3(0x7E), 448.f);
  EXPECT_EQ(fp8_decode_e4m3(0xFE), -448.f);
  EXPECT_EQ(fp8_decode_e4m3(0x01), 0x1p-9f);
  EXPECT_EQ(fp8_decode_e4m3(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(fp8_decode_e4m3(0x08), 0x1p-6f);
  EXPECT_TRUE(std::isnan(fp8_decode_e4m3(0x7F)));
  EXPECT_TRUE(std::isnan(fp8_decode_e4m3(0xFF)));
  EXPECT_EQ(fp8_decode_e5m2(0x3C), 1.f);
  EXPECT_EQ(fp8_decode_e5m2(0x7B), 57344.f);
  EXPECT_EQ(fp8_decode_e5m2(0x01), 0x1p-16f);
  EXPECT_EQ(fp8_decode_e5m2(0x04), 0x1p-14f);
  EXPECT_EQ(fp8_decode_e5m2(0x7C), INFINITY);
  EXPECT_EQ(fp8_decode_e5m2(0xFC), -INFINITY);
  for (uint8_t c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(fp8_decode_e5m2(c)));
  // Exactly one NaN code per sign in E4M3, three in E5M2.
  int nan_e4m3 = 0, nan_e5m2 = 0;
  for (int c = 0; c < 256; ++c) {
    nan_e4m3 += is_nan_code(static_cast<uint8_t>(c), Fp8Format::kE4M3);
    nan_e5m2 += is_nan_code(static_cast<uint8_t>(c), Fp8Format::kE5M2);
  }
  EXPECT_EQ(nan_e4m3, 2);
  EXPECT_EQ(nan_e5m2, 6);
}

TEST(Fp8Codec, PositiveCodesStrictlyIncreaseAndNegativesMirror) {
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    for (int c = 1; c <= f.max_code; ++c)
      ASSERT_LT(fp8_decode(c - 1, f.fmt), fp8_decode(c, f.fmt)) << "code " << c;
    for (int c = 0; c <= f.max_code; ++c) {
      const float p = fp8_decode(c, f.fmt), n = fp8_decode(c | 0x80, f.fmt);
      ASSERT_EQ(n, -p);
      ASSERT_TRUE(std::signbit(n));
    }
    EXPECT_EQ(fp8_decode(f.max_code, f.fmt), f.max);
    EXPECT_EQ(fp8_decode(1, f.fmt), f.min_sub);
  }
}

TEST(Fp8Codec, DecodeTableMatchesDecode) {
  for (const auto& f : kFormats) {
    const float* t = fp8_decode_table(f.fmt);
    for (int c = 0; c < 256; ++c) {
      const float d = fp8_decode(static_cast<uint8_t>(c), f.fmt);
      if (std::isnan(d)) {
        EXPECT_TRUE(std::isnan(t[c])) << f.name << " code " << c;
      } else {
        uint32_t a, b;
        std::memcpy(&a, &d, 4);
        std::memcpy(&b, &t[c], 4);
        EXPECT_EQ(a, b) << f.name << " code " << c;  // bitwise: keeps -0
      }
    }
  }
}

// ---- every code round-trips ----------------------------------------------------

TEST(Fp8Codec, EveryCodeDecodesAndReencodesToItself) {
  for (const auto& f : kFormats) {
    for (int ci = 0; ci < 256; ++ci) {
      const auto c = static_cast<uint8_t>(ci);
      const float v = fp8_decode(c, f.fmt);
      const uint8_t back = fp8_encode(v, f.fmt);
      if (std::isnan(v)) {
        EXPECT_TRUE(is_nan_code(back, f.fmt)) << f.name << " code " << ci;
      } else {
        EXPECT_EQ(back, c) << f.name << " code " << ci << " value " << v;
      }
    }
  }
  EXPECT_EQ(fp8_encode_e5m2(fp8_decode_e5m2(0x7C)), 0x7C);
  EXPECT_EQ(fp8_encode_e5m2(fp8_decode_e5m2(0xFC)), 0xFC);
}

// ---- round to nearest, ties to even ------------------------------------------

// Every midpoint between adjacent representable values of one sign, from the
// one between 0 and the smallest subnormal up to the one below max, rounds to
// the code with an even mantissa (= even code); the floats just below and just
// above round to the nearer neighbour.
TEST(Fp8Codec, MidpointsRoundToEvenAndNeighboursToNearer) {
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    int checked = 0;
    for (int c = 0; c < f.max_code; ++c) {
      const float lo = fp8_decode(c, f.fmt), hi = fp8_decode(c + 1, f.fmt);
      const float mid = 0.5f * (lo + hi);  // exact: FP8 values have <= 4 significant bits
      ASSERT_EQ(static_cast<double>(mid), 0.5 * (static_cast<double>(lo) + hi));
      const uint8_t even = (c % 2 == 0) ? c : c + 1;
      for (int sign : {0, 1}) {
        const float sg = sign ? -1.f : 1.f;
        const uint8_t sbit = sign ? 0x80 : 0x00;
        ASSERT_EQ(fp8_encode(sg * mid, f.fmt), sbit | even) << "midpoint " << sg * mid;
        const float below = std::nextafter(mid, 0.f), above = std::nextafter(mid, INFINITY);
        ASSERT_EQ(fp8_encode(sg * below, f.fmt), sbit | c) << "just below " << sg * mid;
        ASSERT_EQ(fp8_encode(sg * above, f.fmt), sbit | (c + 1)) << "just above " << sg * mid;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 2 * f.max_code);
  }
  // The first midpoint is between 0 and the smallest subnormal: ties to +-0.
  EXPECT_EQ(fp8_encode_e4m3(0x1p-10f), 0x00);
  EXPECT_EQ(fp8_encode_e4m3(-0x1p-10f), 0x80);
  EXPECT_EQ(fp8_encode_e5m2(0x1p-17f), 0x00);
  EXPECT_EQ(fp8_encode_e5m2(-0x1p-17f), 0x80);
  // 3 * 2^-10 lies between subnormal codes 1 and 2: ties to even code 2.
  EXPECT_EQ(fp8_encode_e4m3(3 * 0x1p-10f), 0x02);
  // Midpoint between the largest subnormal (7 * 2^-9) and the smallest normal.
  EXPECT_EQ(fp8_encode_e4m3(15 * 0x1p-10f), 0x08);
}

// Independent oracle: nearest of the 2 * (max_code + 1) finite values by
// brute force, ties to the even code, saturation past max.
uint8_t encode_oracle(float x, const FormatInfo& f) {
  const uint8_t sbit = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= f.max) return sbit | f.max_code;
  int best = 0;
  double best_err = INFINITY;
  for (int c = 0; c <= f.max_code; ++c) {
    const double err = std::fabs(static_cast<double>(fp8_decode(c, f.fmt)) - a);
    if (err < best_err || (err == best_err && c % 2 == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sbit | static_cast<uint8_t>(best);
}

TEST(Fp8Codec, RandomValuesInEveryBinadeMatchBruteForceNearest) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    // log2 |x| uniform over [log2(min_sub) - 3, log2(max) + 2]: every binade,
    // the subnormal range, values rounding to 0 and values that saturate.
    std::uniform_real_distribution<float> lg(std::log2(f.min_sub) - 3.f, std::log2(f.max) + 2.f);
    std::bernoulli_distribution neg(0.5);
    for (int i = 0; i < 20000; ++i) {
      const float x = (neg(rng) ? -1.f : 1.f) * std::exp2(lg(rng));
      ASSERT_EQ(fp8_encode(x, f.fmt), encode_oracle(x, f)) << "x = " << x;
    }
  }
}

// ---- saturation, non-finite input, signed zero ---------------------------------

TEST(Fp8Codec, SaturatesBeyondMax) {
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    const uint8_t mx = f.max_code, nmx = 0x80 | f.max_code;
    for (float v : {f.max, std::nextafter(f.max, INFINITY), f.max * 1.0625f, f.max * 1.125f,
                    f.max * 1.5f, f.max * 2.f, 1e20f, FLT_MAX}) {
      EXPECT_EQ(fp8_encode(v, f.fmt), mx) << v;
      EXPECT_EQ(fp8_encode(-v, f.fmt), nmx) << -v;
    }
    EXPECT_EQ(fp8_decode(fp8_encode(1e30f, f.fmt), f.fmt), f.max);
    EXPECT_EQ(fp8_decode(fp8_encode(-1e30f, f.fmt), f.fmt), -f.max);
  }
}

TEST(Fp8Codec, NaNStaysNaN) {
  const float nans[] = {NAN, -NAN, std::numeric_limits<float>::signaling_NaN(),
                        from_bits(0x7F800001u), from_bits(0xFFFFFFFFu), from_bits(0x7FC00000u)};
  for (const auto& f : kFormats)
    for (float x : nans) EXPECT_TRUE(is_nan_code(fp8_encode(x, f.fmt), f.fmt)) << f.name;
}

TEST(Fp8Codec, InfinityIsNaNInE4M3AndInfInE5M2) {
  EXPECT_TRUE(std::isnan(fp8_decode_e4m3(fp8_encode_e4m3(INFINITY))));
  EXPECT_TRUE(std::isnan(fp8_decode_e4m3(fp8_encode_e4m3(-INFINITY))));
  EXPECT_EQ(fp8_encode_e5m2(INFINITY), 0x7C);
  EXPECT_EQ(fp8_encode_e5m2(-INFINITY), 0xFC);
  EXPECT_EQ(fp8_decode_e5m2(fp8_encode_e5m2(-INFINITY)), -INFINITY);
}

TEST(Fp8Codec, SignedZeroKeepsItsSign) {
  for (const auto& f : kFormats) {
    EXPECT_EQ(fp8_encode(0.f, f.fmt), 0x00);
    EXPECT_EQ(fp8_encode(-0.f, f.fmt), 0x80);
    EXPECT_TRUE(std::signbit(fp8_decode(0x80, f.fmt)));
    EXPECT_EQ(fp8_decode(0x80, f.fmt), 0.f);
    // A tiny negative value rounds to -0, not +0.
    EXPECT_EQ(fp8_encode(-f.min_sub * 0.25f, f.fmt), 0x80);
    EXPECT_EQ(fp8_encode(-FLT_TRUE_MIN, f.fmt), 0x80);
  }
}

// ---- block scale (numerics.md section 2) --------------------------------------

TEST(BlockScale, ExactPowersOfTwoAtAndAboveThresholds) {
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    int checked = 0;
    for (int k = -126; k <= 127; ++k) {
      const float amax = std::ldexp(f.max, k);
      if (!std::isfinite(amax)) break;
      ASSERT_EQ(block_scale(amax, f.fmt), std::ldexp(1.f, k)) << "k " << k;
      ASSERT_EQ(block_scale(std::nextafter(amax, 0.f), f.fmt), std::ldexp(1.f, k)) << "k " << k;
      // amax is finite, so k + 1 <= 127 - 8 here: no clamp at the top.
      ASSERT_EQ(block_scale(std::nextafter(amax, INFINITY), f.fmt), std::ldexp(1.f, k + 1)) << "k " << k;
      ++checked;
    }
    EXPECT_GT(checked, 200);
  }
  EXPECT_EQ(block_scale(448.f, Fp8Format::kE4M3), 1.f);
  EXPECT_EQ(block_scale(449.f, Fp8Format::kE4M3), 2.f);
  EXPECT_EQ(block_scale(1.f, Fp8Format::kE4M3), 0x1p-8f);  // 1 / 2^-8 = 256 <= 448 < 512
  EXPECT_EQ(block_scale(57344.f, Fp8Format::kE5M2), 1.f);
}

TEST(BlockScale, ScaledAmaxLandsInTopBinadeOfTheFormat) {
  // Definition: the smallest power of two s with amax / s <= fmax.
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> lg(-100.f, 100.f);
  for (const auto& f : kFormats) {
    for (int i = 0; i < 20000; ++i) {
      const float amax = std::exp2(lg(rng));
      const float s = block_scale(amax, f.fmt);
      int e;
      ASSERT_EQ(std::frexp(s, &e), 0.5f) << "not a power of two: " << s;
      ASSERT_LE(amax / s, f.max) << amax;
      ASSERT_GT(amax / s, f.max / 2) << amax;
    }
  }
}

TEST(BlockScale, ZeroTinyAndNonFiniteAmax) {
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    EXPECT_EQ(block_scale(0.f, f.fmt), 1.f);
    // Tiny amax: the exponent clamps at -126 (a normal scale, finite 1/s).
    for (float amax : {FLT_TRUE_MIN, 1e-40f, FLT_MIN, 1e-37f, std::ldexp(f.max, -127),
                       std::ldexp(f.max, -140)}) {
      EXPECT_EQ(block_scale(amax, f.fmt), 0x1p-126f) << amax;
      EXPECT_LE(amax / block_scale(amax, f.fmt), f.max);
    }
    EXPECT_TRUE(std::isnan(block_scale(NAN, f.fmt)));
    EXPECT_TRUE(std::isnan(block_scale(INFINITY, f.fmt)));
    // Largest finite amax: a finite scale that brings it into range.
    const float s = block_scale(FLT_MAX, f.fmt);
    EXPECT_TRUE(std::isfinite(s));
    EXPECT_LE(FLT_MAX / s, f.max);
  }
}

// block_scale_fast / block_scale_inverse: the kernels' exponent-arithmetic forms
// (quantization kernel, backward fast_scale for P^T / dS) must give block_scale's
// bits. (The forward's P scale uses the same rule in its own form,
// fwd_softmax_sm90.cuh, checked by the GPU tests against the CPU reference.)
float bits_to_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

void expect_fast_equals_generic(float amax, Fp8Format fmt) {
  const float want = block_scale(amax, fmt), got = block_scale_fast(amax, fmt);
  if (std::isnan(want)) {
    ASSERT_TRUE(std::isnan(got)) << "amax " << amax;
  } else {
    ASSERT_EQ(detail::float_bits(got), detail::float_bits(want)) << "amax " << amax << " (bits 0x" << std::hex
                                                                 << detail::float_bits(amax) << ")";
  }
}

TEST(BlockScaleFast, EveryBf16AmaxBothFormats) {
  // Every non-negative BF16 value (the quantization kernel's amax), incl. zero,
  // subnormals, +inf and NaN payloads.
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    for (uint32_t b = 0; b <= 0x7fffu; ++b) expect_fast_equals_generic(bits_to_float(b << 16), f.fmt);
  }
}

TEST(BlockScaleFast, MantissaEdgesOfEveryBinadeAndRandomFloats) {
  // FP32 amax (the backward's FP32 dS / P amax): around
  // m = 1.75 (the rounding edge of the rule) and the ends of every binade, plus
  // random bit patterns.
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (const auto& f : kFormats) {
    SCOPED_TRACE(f.name);
    for (uint32_t ex = 0; ex <= 0xffu; ++ex)
      for (uint32_t frac : {0u, 1u, 0x5fffffu, 0x600000u, 0x600001u, 0x7ffffeu, 0x7fffffu})
        expect_fast_equals_generic(bits_to_float(ex << 23 | frac), f.fmt);
    for (int i = 0; i < 200000; ++i) expect_fast_equals_generic(bits_to_float(rng() & 0x7fffffffu), f.fmt);
  }
}

TEST(BlockScaleFast, InverseIsExactForEveryScale) {
  for (int e = -126; e <= 127; ++e) {
    const float s = std::ldexp(1.f, e);
    const float inv = block_scale_inverse(s);
    ASSERT_EQ(detail::float_bits(inv), detail::float_bits(1.f / s)) << "e " << e;
    ASSERT_EQ(inv, std::ldexp(1.f, -e)) << "e " << e;  // 2^-127 included: a subnormal, still exact
  }
  EXPECT_TRUE(std::isnan(block_scale_inverse(NAN)));
  // Not a block scale: NaN, never a silent finite value.
  for (float bad : {0.f, FLT_TRUE_MIN, INFINITY, -1.f}) EXPECT_TRUE(std::isnan(block_scale_inverse(bad))) << bad;
}

}  // namespace
}  // namespace fp8attn
