// Tests of the outlier transforms of the CPU reference (AttnParams::qk_rotation,
// smooth_k; contract: numerics.md section 10): the Hadamard blocks and the
// rotation's orthogonality; the exact path with the transforms equals the naive
// FP64 attention of the untransformed inputs (the transforms change nothing but
// rounding, and the gradients are mapped back exactly, through the mean too);
// the fp8 path with the transforms is bit for bit the fp8 path without them on
// inputs transformed by the section 10 rules (written out here), for both
// scaling recipes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "reference/attention_ref.h"
#include "reference/qk_transform.h"
#include "test_util.h"

namespace fp8attn {
namespace {

using namespace testutil;

TEST(QkTransform, HadamardBlocksAreTheBinaryDigitsLargestFirst) {
  for (int64_t d = 1; d <= 256; ++d) {
    const std::vector<int64_t> blocks = hadamard_blocks(d);
    int64_t sum = 0, prev = 1 << 30;
    for (int64_t n : blocks) {
      EXPECT_EQ(n & (n - 1), 0) << d;
      EXPECT_LT(n, prev) << d;
      prev = n;
      // For 128 < d < 256 no block crosses channel 128 (the row recipe's block edge).
      if (d > 128 && d < 256) EXPECT_FALSE(sum < 128 && sum + n > 128) << d;
      sum += n;
    }
    EXPECT_EQ(sum, d);
  }
  EXPECT_EQ(hadamard_blocks(192), (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(hadamard_blocks(80), (std::vector<int64_t>{64, 16}));
}

TEST(QkTransform, RotationIsOrthogonalAndTheTransposeInvertsIt) {
  for (int64_t d : {1, 3, 16, 37, 64, 80, 128, 192, 256}) {
    // Rows of R: e_i R.
    std::vector<double> R(d * d, 0.0);
    for (int64_t i = 0; i < d; ++i) {
      R[i * d + i] = 1.0;
      hadamard_rotate_row(R.data() + i * d, d);
    }
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < d; ++j) {
        double s = 0;
        for (int64_t c = 0; c < d; ++c) s += R[i * d + c] * R[j * d + c];
        EXPECT_NEAR(s, i == j ? 1.0 : 0.0, 1e-14) << d << " " << i << " " << j;
      }
    std::mt19937 rng(static_cast<uint32_t>(d));
    std::vector<double> x = random_normal(d, rng), y = x;
    hadamard_rotate_row(y.data(), d);
    hadamard_rotate_row_transposed(y.data(), d);
    for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(y[c], x[c], 1e-13);
  }
}

struct Option {
  QkRotation rot;
  bool smooth;
};
const Option kOptions[] = {{QkRotation::kHadamard, false}, {QkRotation::kNone, true},
                           {QkRotation::kHadamard, true}};

// Inputs with a large common key component per (batch, kv head).
Inputs common_key_inputs(const Problem& pr, std::mt19937& rng, bool bf16_exact) {
  Inputs in = random_inputs(pr, rng, bf16_exact);
  std::vector<double> c = random_normal(pr.B * pr.Hkv * pr.d, rng, false, 3.0);
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t j = 0; j < pr.Sk; ++j)
      for (int64_t h = 0; h < pr.Hkv; ++h)
        for (int64_t e = 0; e < pr.d; ++e) {
          double& x = in.k[((b * pr.Sk + j) * pr.Hkv + h) * pr.d + e];
          x += c[(b * pr.Hkv + h) * pr.d + e];
          if (bf16_exact) x = round_to_bf16(x);
        }
  return in;
}

TEST(QkTransform, ExactPathEqualsNaiveAttentionOfTheUntransformedInputs) {
  for (bool causal : {false, true}) {
    Problem pr;
    pr.B = 2, pr.Sq = 23, pr.Sk = 31, pr.Hq = 4, pr.Hkv = 2, pr.d = 80, pr.dv = 12;
    pr.causal = causal;
    std::mt19937 rng(7);
    const Inputs in = common_key_inputs(pr, rng, false);
    const Outputs want = naive_attention(pr, in);
    for (const Option& opt : kOptions) {
      AttnParams p = pr.params(Precision::kExact);
      p.qk_rotation = opt.rot;
      p.smooth_k = opt.smooth;
      const RefOutputs got = run_reference(pr, in, p);
      EXPECT_LT(rel_error(got.o, want.o), 1e-12);
      EXPECT_LT(rel_error(got.dq, want.dq), 1e-12);
      EXPECT_LT(rel_error(got.dk, want.dk), 1e-12);
      EXPECT_LT(rel_error(got.dv, want.dv), 1e-12);
      for (size_t i = 0; i < want.lse.size(); ++i) {
        if (std::isinf(want.lse[i])) {
          EXPECT_EQ(got.lse[i], want.lse[i]);
        } else {
          EXPECT_NEAR(got.lse[i], want.lse[i], 4e-7 * std::max(1.0, std::fabs(want.lse[i])));
        }
      }
    }
  }
}

// The section 10 rules on FP32 inputs, written out: m = FP64 sum / Sk rounded
// to FP32, K - m in FP32, then the rotation in FP32.
void transform_inputs(const Problem& pr, const Option& opt, const Inputs& in, Inputs& out,
                      std::vector<float>& mean) {
  out = in;
  mean.assign(pr.B * pr.Hkv * pr.d, 0.f);
  std::vector<float> row(pr.d);
  auto rot = [&](std::vector<double>& x, int64_t n_rows) {
    for (int64_t r = 0; r < n_rows; ++r) {
      for (int64_t c = 0; c < pr.d; ++c) row[c] = static_cast<float>(x[r * pr.d + c]);
      if (opt.rot == QkRotation::kHadamard) hadamard_rotate_row(row.data(), pr.d);
      for (int64_t c = 0; c < pr.d; ++c) x[r * pr.d + c] = row[c];
    }
  };
  if (opt.smooth) {
    for (int64_t b = 0; b < pr.B; ++b)
      for (int64_t h = 0; h < pr.Hkv; ++h)
        for (int64_t c = 0; c < pr.d; ++c) {
          double s = 0;
          for (int64_t j = 0; j < pr.Sk; ++j)
            s += static_cast<float>(in.k[((b * pr.Sk + j) * pr.Hkv + h) * pr.d + c]);
          const float m = static_cast<float>(s / static_cast<double>(pr.Sk));
          mean[(b * pr.Hkv + h) * pr.d + c] = m;
          for (int64_t j = 0; j < pr.Sk; ++j) {
            double& x = out.k[((b * pr.Sk + j) * pr.Hkv + h) * pr.d + c];
            x = static_cast<float>(static_cast<float>(x) - m);
          }
        }
  }
  rot(out.q, pr.B * pr.Sq * pr.Hq);
  rot(out.k, pr.B * pr.Sk * pr.Hkv);
}

TEST(QkTransform, Fp8PathIsThePlainPathOnTransformedInputsBitForBit) {
  for (Scaling scaling : {Scaling::kRow, Scaling::kTile})
    for (bool causal : {false, true})
      for (const Option& opt : kOptions) {
        Problem pr;
        pr.B = 1, pr.Sq = 70, pr.Sk = 90, pr.Hq = 4, pr.Hkv = 2, pr.d = 80, pr.dv = 24;
        pr.causal = causal;
        pr.scaling = scaling;
        std::mt19937 rng(11);
        const Inputs in = common_key_inputs(pr, rng, true);
        Inputs tin;
        std::vector<float> mean;
        transform_inputs(pr, opt, in, tin, mean);
        RunOptions ro;
        ro.in_dtype = ro.out_dtype = DType::kFloat32;
        ro.backward = false;
        AttnParams p = pr.params(Precision::kFP8, DeltaMode::kDeltaMatching, 32);
        const RefOutputs plain = run_reference(pr, tin, p, ro);
        p.qk_rotation = opt.rot;
        p.smooth_k = opt.smooth;
        const RefOutputs fused = run_reference(pr, in, p, ro);
        EXPECT_TRUE(bitwise_equal(fused.o, plain.o));
        // LSE: that of the smoothed logits plus shift_i = tau <q_i, m> (FP32 add).
        const int64_t G = pr.Hq / pr.Hkv;
        for (int64_t h = 0; h < pr.Hq; ++h)
          for (int64_t i = 0; i < pr.Sq; ++i) {
            const size_t idx = static_cast<size_t>(h * pr.Sq + i);
            float want = plain.lse_f[idx];
            if (opt.smooth && std::isfinite(want)) {
              double u = 0;
              for (int64_t c = 0; c < pr.d; ++c)
                u += static_cast<double>(static_cast<float>(in.q[(i * pr.Hq + h) * pr.d + c])) *
                     mean[(h / G) * pr.d + c];
              want = want + static_cast<float>(static_cast<double>(static_cast<float>(pr.tau())) * u);
            }
            EXPECT_EQ(fused.lse_f[idx], want) << h << " " << i;
          }
      }
}

// dK = dK_s - mean_j dK_s: the key gradients of a (batch, kv head) sum to zero
// over the keys. Exact and Delta-Matching backwards already nearly have that
// (zero row sums of dS), so the test uses `stale`, whose rows sum to eps_i.
TEST(QkTransform, GradientThroughTheMeanIsApplied) {
  for (Scaling scaling : {Scaling::kRow, Scaling::kTile}) {
    Problem pr;
    pr.B = 1, pr.Sq = 64, pr.Sk = 96, pr.Hq = 2, pr.Hkv = 1, pr.d = 64, pr.dv = 32;
    pr.causal = true;
    pr.scaling = scaling;
    std::mt19937 rng(5);
    const Inputs in = common_key_inputs(pr, rng, true);
    RunOptions ro;
    ro.in_dtype = ro.out_dtype = DType::kFloat32;
    for (bool smooth : {false, true}) {
      AttnParams p = pr.params(Precision::kFP8, DeltaMode::kStale, 32);
      p.smooth_k = smooth;
      const RefOutputs r = run_reference(pr, in, p, ro);
      double worst = 0, scale = 0;
      for (int64_t c = 0; c < pr.d; ++c) {
        double s = 0, a = 0;
        for (int64_t j = 0; j < pr.Sk; ++j) {
          s += r.dk[j * pr.d + c];
          a += std::fabs(r.dk[j * pr.d + c]);
        }
        worst = std::max(worst, std::fabs(s));
        scale = std::max(scale, a);
      }
      if (smooth)
        EXPECT_LT(worst, 1e-5 * scale);
      else
        EXPECT_GT(worst, 1e-3 * scale);  // the control: stale's column sums are not small
    }
  }
}

}  // namespace
}  // namespace fp8attn
