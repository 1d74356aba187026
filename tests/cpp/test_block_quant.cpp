// Tests of block-scaled quantization along any axis (csrc/quant/block_quant.h;
// contract: numerics.md section 2).
//
// Round-trip error bound used below. With block scale s (a power of two) and
// y = x / s (exact), |y| <= fmax by the scale rule, so nothing saturates and
// decoding x_hat * s is exact; the only error is the FP8 rounding of y, times s.
// For a format with M mantissa bits and smallest normal exponent emin:
//   - y normal (|y| >= 2^emin) in binade [2^e, 2^(e+1)): step 2^(e-M), so
//     |y - fp8(y)| <= 2^(e-M-1) <= 2^-(M+1) |y|;
//   - y subnormal: step 2^(emin-M), so |y - fp8(y)| <= 2^(emin-M-1).
// Hence |x - x_hat s| <= max(2^-(M+1) |x|, 2^(emin-M-1) s):
//   E4M3 (M=3, emin=-6): max(2^-4 |x|, 2^-10 s); E5M2 (M=2, emin=-14): max(2^-3 |x|, 2^-17 s).
// Since amax / s > fmax / 2 unless the scale is clamped, 2^(emin-M-1) s is also
// below 2^(emin-M) amax / fmax: a tiny fraction of the block's largest value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/fp8_codec.h"
#include "quant/block_quant.h"

namespace fp8attn {
namespace {

struct Bound {
  float rel;      // 2^-(M+1)
  float sub_abs;  // 2^(emin-M-1), times s
};
Bound bound_for(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Bound{0x1p-4f, 0x1p-10f} : Bound{0x1p-3f, 0x1p-17f};
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// Fresh random data: standard normal times 2^k with k drawn per element, so a
// block spans many binades (small elements land in FP8's subnormal range).
std::vector<float> random_tensor(int64_t n, std::mt19937& rng, int spread = 12) {
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> k(-spread, spread / 2);
  std::vector<float> x(n);
  for (auto& v : x) {
    do v = nd(rng); while (v == 0.f);
    v = std::ldexp(v, k(rng));
  }
  return x;
}

// Oracle written independently of block_quant.cpp's [outer, n, inner] walk:
// every element finds its block through its multi-index.
struct Oracle {
  std::vector<int64_t> scale_shape;
  std::vector<int64_t> block_of;  // element -> flat scale index
  std::vector<float> scales;
};

Oracle oracle(const std::vector<float>& x, std::vector<int64_t> shape, int dim, int B, Fp8Format fmt) {
  const int rank = static_cast<int>(shape.size());
  if (dim < 0) dim += rank;
  Oracle o;
  o.scale_shape = shape;
  o.scale_shape[dim] = (shape[dim] + B - 1) / B;
  const int64_t n = numel_of(shape), ns = numel_of(o.scale_shape);
  std::vector<float> amax(ns, 0.f);
  std::vector<bool> finite(ns, true);
  o.block_of.resize(n);
  std::vector<int64_t> idx(rank, 0);
  for (int64_t e = 0; e < n; ++e) {
    int64_t rem = e;
    for (int a = rank - 1; a >= 0; --a) {
      idx[a] = rem % shape[a];
      rem /= shape[a];
    }
    int64_t si = 0;
    for (int a = 0; a < rank; ++a) si = si * o.scale_shape[a] + (a == dim ? idx[a] / B : idx[a]);
    o.block_of[e] = si;
    if (!std::isfinite(x[e])) finite[si] = false;
    else amax[si] = std::max(amax[si], std::fabs(x[e]));
  }
  o.scales.resize(ns);
  for (int64_t s = 0; s < ns; ++s) o.scales[s] = finite[s] ? block_scale(amax[s], fmt) : NAN;
  return o;
}

struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> deq;
};

Quantized run(const std::vector<float>& x, const std::vector<int64_t>& shape, int dim, int B,
              Fp8Format fmt) {
  const int rank = static_cast<int>(shape.size());
  std::vector<int64_t> sshape = shape;
  const int d = dim < 0 ? dim + rank : dim;
  sshape[d] = num_blocks(shape[d], B);
  Quantized q;
  q.codes.assign(x.size(), 0xAA);
  q.scales.assign(numel_of(sshape), -7.f);  // poison: every entry must be written
  q.deq.assign(x.size(), -7.f);
  quantize_blockwise(x.data(), shape.data(), rank, dim, B, fmt, q.codes.data(), q.scales.data());
  dequantize_blockwise(q.codes.data(), q.scales.data(), shape.data(), rank, dim, B, fmt, q.deq.data());
  return q;
}

// Checks codes, scales and the round trip of one case against the oracle and
// the error bound; returns the max error relative to the element's bound.
double check_case(const std::vector<float>& x, const std::vector<int64_t>& shape, int dim, int B,
                  Fp8Format fmt) {
  const Oracle o = oracle(x, shape, dim, B, fmt);
  const Quantized q = run(x, shape, dim, B, fmt);
  EXPECT_EQ(q.scales.size(), o.scales.size());
  for (size_t s = 0; s < o.scales.size(); ++s) {
    if (std::isnan(o.scales[s])) EXPECT_TRUE(std::isnan(q.scales[s])) << "scale " << s;
    else EXPECT_EQ(q.scales[s], o.scales[s]) << "scale " << s;
  }
  const Bound bd = bound_for(fmt);
  double worst = 0;
  for (size_t e = 0; e < x.size(); ++e) {
    const float s = o.scales[o.block_of[e]];
    if (std::isnan(s)) {
      EXPECT_TRUE(std::isnan(q.deq[e])) << "element " << e;
      continue;
    }
    EXPECT_EQ(q.codes[e], fp8_encode(x[e] / s, fmt)) << "element " << e;
    EXPECT_TRUE(std::isfinite(q.deq[e])) << "element " << e;
    const double err = std::fabs(static_cast<double>(x[e]) - q.deq[e]);
    const double bound = std::max(bd.rel * std::fabs(static_cast<double>(x[e])),
                                  static_cast<double>(bd.sub_abs) * s);
    EXPECT_LE(err, bound) << "element " << e << " x " << x[e] << " deq " << q.deq[e];
    worst = std::max(worst, err / bound);
  }
  return worst;
}

class BlockQuant : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

// ---- round trip along every axis, every B, both formats ---------------------

TEST_F(BlockQuant, RoundTripEveryAxis2D) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  // 37 and 200 are not multiples of any B: every case has a partial last block.
  const std::vector<int64_t> shape = {37, 200};
  const auto x = random_tensor(numel_of(shape), rng_);
  double worst = 0;
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2})
    for (int B : {32, 64, 128})
      for (int dim : {0, 1, -1, -2}) {
        SCOPED_TRACE(::testing::Message() << "fmt " << int(fmt) << " B " << B << " dim " << dim);
        worst = std::max(worst, check_case(x, shape, dim, B, fmt));
      }
  // The bound is tight: some element uses most of it (a loose bound would hide bugs).
  EXPECT_GT(worst, 0.5);
  EXPECT_LE(worst, 1.0);
}

TEST_F(BlockQuant, RoundTripEveryAxis4D) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<int64_t> shape = {2, 3, 70, 45};
  const auto x = random_tensor(numel_of(shape), rng_);
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2})
    for (int B : {32, 64, 128})
      for (int dim : {0, 1, 2, 3, -1}) {
        SCOPED_TRACE(::testing::Message() << "fmt " << int(fmt) << " B " << B << " dim " << dim);
        check_case(x, shape, dim, B, fmt);
      }
}

TEST_F(BlockQuant, ExactMultipleAndSingleShortBlock) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  // 256 = 2 full blocks of 128; a 64-long axis with B = 128 is one 64-element
  // block (numerics.md: B = d when the reduction dimension is shorter).
  const std::vector<int64_t> shape = {5, 256};
  const auto x = random_tensor(numel_of(shape), rng_);
  check_case(x, shape, 1, 128, Fp8Format::kE4M3);
  const std::vector<int64_t> shape2 = {9, 64};
  const auto x2 = random_tensor(numel_of(shape2), rng_);
  const Quantized a = run(x2, shape2, 1, 128, Fp8Format::kE4M3);
  const Quantized b = run(x2, shape2, 1, 64, Fp8Format::kE4M3);
  EXPECT_EQ(a.scales.size(), 9u);
  EXPECT_EQ(a.scales, b.scales);
  EXPECT_EQ(a.codes, b.codes);
}

TEST_F(BlockQuant, PartialLastBlockHasItsOwnScale) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  // Axis of 70 with B = 64: blocks [0, 64) and [64, 70). A large value in the
  // first block must not coarsen the 6-element tail block.
  std::vector<float> x = random_tensor(70, rng_, 0);
  for (auto& v : x) v = std::fabs(v) * 1e-3f + 1e-4f;
  x[3] = 1000.f;
  const std::vector<int64_t> shape = {1, 70};
  const Quantized q = run(x, shape, 1, 64, Fp8Format::kE4M3);
  ASSERT_EQ(q.scales.size(), 2u);
  EXPECT_EQ(q.scales[0], block_scale(1000.f, Fp8Format::kE4M3));
  float tail_amax = 0;
  for (int i = 64; i < 70; ++i) tail_amax = std::max(tail_amax, x[i]);
  EXPECT_EQ(q.scales[1], block_scale(tail_amax, Fp8Format::kE4M3));
  for (int i = 64; i < 70; ++i) EXPECT_LE(std::fabs(q.deq[i] - x[i]), 0x1p-4f * x[i]);
  check_case(x, shape, 1, 64, Fp8Format::kE4M3);
}

// ---- zero, subnormal and non-finite blocks -----------------------------------

TEST_F(BlockQuant, AllZeroBlockGivesScaleOneAndZeroCodes) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<int64_t> shape = {4, 96};  // B = 32: 3 blocks per row
  auto x = random_tensor(numel_of(shape), rng_);
  for (int i = 32; i < 64; ++i) x[1 * 96 + i] = 0.f;        // row 1, block 1: +0
  for (int i = 64; i < 96; ++i) x[2 * 96 + i] = -0.f;       // row 2, block 2: -0
  const Quantized q = run(x, shape, 1, 32, Fp8Format::kE4M3);
  EXPECT_EQ(q.scales[1 * 3 + 1], 1.f);
  EXPECT_EQ(q.scales[2 * 3 + 2], 1.f);
  for (int i = 32; i < 64; ++i) {
    EXPECT_EQ(q.codes[1 * 96 + i], 0x00);
    EXPECT_EQ(q.deq[1 * 96 + i], 0.f);
  }
  for (int i = 64; i < 96; ++i) {
    EXPECT_EQ(q.codes[2 * 96 + i], 0x80);  // -0 keeps its sign
    EXPECT_EQ(q.deq[2 * 96 + i], 0.f);
  }
  for (float v : q.deq) EXPECT_TRUE(std::isfinite(v));
  check_case(x, shape, 1, 32, Fp8Format::kE4M3);
}

TEST_F(BlockQuant, SubnormalAmaxBlockUsesClampedScale) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  // FP32-subnormal inputs: 2^-126 is the smallest allowed scale, 1/s = 2^126
  // is finite, and x / s is exact.
  const std::vector<int64_t> shape = {3, 64};
  auto x = random_tensor(numel_of(shape), rng_, 0);
  for (int i = 0; i < 64; ++i) x[64 + i] *= 1e-39f;  // row 1: |x| ~ 1e-39, FP32 subnormal
  const Quantized q = run(x, shape, 1, 64, Fp8Format::kE4M3);
  EXPECT_EQ(q.scales[1], 0x1p-126f);
  int nonzero = 0;
  for (int i = 0; i < 64; ++i) nonzero += q.deq[64 + i] != 0.f;
  EXPECT_GT(nonzero, 32);  // not flushed to zero
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) check_case(x, shape, 1, 64, fmt);
}

TEST_F(BlockQuant, NonFiniteBlockIsNaNAndIsolated) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<int64_t> shape = {2, 4, 96, 8};
  const int dim = 2, B = 32;  // blocks along the seqlen axis, stride 8
  for (Fp8Format fmt : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const auto clean = random_tensor(numel_of(shape), rng_);
    auto x = clean;
    auto at = [&](int64_t b, int64_t h, int64_t s, int64_t d) { return ((b * 4 + h) * 96 + s) * 8 + d; };
    x[at(0, 1, 40, 3)] = NAN;        // block (0,1,1,3)
    x[at(1, 2, 95, 0)] = INFINITY;   // block (1,2,2,0), last row of the axis
    x[at(1, 3, 0, 7)] = -INFINITY;   // block (1,3,0,7)
    const Quantized qc = run(clean, shape, dim, B, fmt);
    const Quantized q = run(x, shape, dim, B, fmt);
    auto sidx = [&](int64_t b, int64_t h, int64_t blk, int64_t d) { return ((b * 4 + h) * 3 + blk) * 8 + d; };
    const int64_t bad[] = {sidx(0, 1, 1, 3), sidx(1, 2, 2, 0), sidx(1, 3, 0, 7)};
    int nan_scales = 0;
    for (size_t s = 0; s < q.scales.size(); ++s) {
      const bool is_bad = s == size_t(bad[0]) || s == size_t(bad[1]) || s == size_t(bad[2]);
      if (is_bad) {
        EXPECT_TRUE(std::isnan(q.scales[s])) << s;
      } else {
        EXPECT_EQ(q.scales[s], qc.scales[s]) << s;
      }
      nan_scales += std::isnan(q.scales[s]);
    }
    EXPECT_EQ(nan_scales, 3);
    // Every element of a bad block decodes to NaN (never saturated to +-max);
    // every other element is bit-identical to the clean run.
    const Oracle o = oracle(x, shape, dim, B, fmt);
    int nan_elems = 0;
    for (size_t e = 0; e < x.size(); ++e) {
      if (std::isnan(o.scales[o.block_of[e]])) {
        ++nan_elems;
        EXPECT_TRUE(std::isnan(q.deq[e])) << e;
        EXPECT_TRUE(std::isnan(fp8_decode(q.codes[e], fmt))) << e;
      } else {
        EXPECT_EQ(q.codes[e], qc.codes[e]) << e;
        EXPECT_EQ(q.deq[e], qc.deq[e]) << e;
      }
    }
    EXPECT_EQ(nan_elems, 3 * B);
  }
}

TEST_F(BlockQuant, QuantizeBlockMatchesBlockwiseAndDecodesExactly) {
  SCOPED_TRACE(::testing::Message() << "seed " << seed_);
  const std::vector<int64_t> shape = {1, 128};
  const auto x = random_tensor(128, rng_);
  const Quantized q = run(x, shape, 1, 128, Fp8Format::kE5M2);
  std::vector<uint8_t> codes(128);
  std::vector<float> dec(128);
  const float s = quantize_block(x.data(), 128, 1, Fp8Format::kE5M2, codes.data(), dec.data());
  EXPECT_EQ(s, q.scales[0]);
  EXPECT_EQ(codes, q.codes);
  EXPECT_EQ(dec, q.deq);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(dec[i], fp8_decode_e5m2(codes[i]) * s);
}

TEST_F(BlockQuant, EmptyTensorIsANoOp) {
  const int64_t shape[] = {0, 128};
  EXPECT_NO_THROW(quantize_blockwise(nullptr, shape, 2, 1, 128, Fp8Format::kE4M3, nullptr, nullptr));
  EXPECT_NO_THROW(dequantize_blockwise(nullptr, nullptr, shape, 2, 1, 128, Fp8Format::kE4M3, nullptr));
}

// ---- argument errors name the argument --------------------------------------

void expect_arg_error(const std::function<void()>& f, const std::string& arg) {
  try {
    f();
    ADD_FAILURE() << "no ArgumentError for '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + arg + "'"), std::string::npos) << e.what();
  }
}

TEST(BlockQuantArgs, BadArgumentsThrowArgumentErrorNamingTheArgument) {
  std::vector<float> x(4 * 64, 1.f), out(4 * 64);
  std::vector<uint8_t> codes(4 * 64);
  std::vector<float> scales(8);
  const int64_t s2[] = {4, 64};
  const int64_t s4[] = {1, 1, 4, 64};
  const int64_t sneg[] = {4, -64};
  const auto E4 = Fp8Format::kE4M3;
  auto q = [&](const float* xp, const int64_t* sh, int rank, int dim, int B, Fp8Format f, uint8_t* c,
               float* s) { return [=] { quantize_blockwise(xp, sh, rank, dim, B, f, c, s); }; };
  expect_arg_error(q(x.data(), s4, 3, 0, 32, E4, codes.data(), scales.data()), "rank");
  expect_arg_error(q(x.data(), s4, 1, 0, 32, E4, codes.data(), scales.data()), "rank");
  expect_arg_error(q(x.data(), s2, 2, 2, 32, E4, codes.data(), scales.data()), "dim");
  expect_arg_error(q(x.data(), s2, 2, -3, 32, E4, codes.data(), scales.data()), "dim");
  expect_arg_error(q(x.data(), s4, 4, 4, 32, E4, codes.data(), scales.data()), "dim");
  for (int B : {0, -32, 16, 48, 96, 256})
    expect_arg_error(q(x.data(), s2, 2, 1, B, E4, codes.data(), scales.data()), "block_size");
  expect_arg_error(q(x.data(), s2, 2, 1, 32, static_cast<Fp8Format>(7), codes.data(), scales.data()), "fmt");
  expect_arg_error(q(x.data(), sneg, 2, 1, 32, E4, codes.data(), scales.data()), "shape");
  expect_arg_error(q(x.data(), nullptr, 2, 1, 32, E4, codes.data(), scales.data()), "shape");
  expect_arg_error(q(nullptr, s2, 2, 1, 32, E4, codes.data(), scales.data()), "x");
  expect_arg_error(q(x.data(), s2, 2, 1, 32, E4, nullptr, scales.data()), "codes");
  expect_arg_error(q(x.data(), s2, 2, 1, 32, E4, codes.data(), nullptr), "scales");
  auto d = [&](const uint8_t* c, const float* s, int rank, int dim, int B, float* o) {
    return [=] { dequantize_blockwise(c, s, s2, rank, dim, B, E4, o); };
  };
  expect_arg_error(d(codes.data(), scales.data(), 3, 1, 32, out.data()), "rank");
  expect_arg_error(d(codes.data(), scales.data(), 2, 5, 32, out.data()), "dim");
  expect_arg_error(d(codes.data(), scales.data(), 2, 1, 100, out.data()), "block_size");
  expect_arg_error(d(nullptr, scales.data(), 2, 1, 32, out.data()), "codes");
  expect_arg_error(d(codes.data(), nullptr, 2, 1, 32, out.data()), "scales");
  expect_arg_error(d(codes.data(), scales.data(), 2, 1, 32, nullptr), "out");
  // The error is an ArgumentError, which is a std::invalid_argument.
  EXPECT_THROW(quantize_blockwise(x.data(), s2, 2, 9, 32, E4, codes.data(), scales.data()),
               std::invalid_argument);
}

}  // namespace
}  // namespace fp8attn
