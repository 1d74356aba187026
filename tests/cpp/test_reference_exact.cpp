// Tests of the CPU reference's exact path (Precision::kExact, FP64; contract:
// numerics.md sections 1 and 6). The oracles are central finite differences
// and the naive FP64 attention of test_util.h (written from the formulas, no
// tiling).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "reference/attention_ref.h"
#include "test_util.h"

namespace fp8attn {
namespace {

using namespace testutil;

AttnParams exact_params(const Problem& pr, DeltaMode mode = DeltaMode::kDeltaMatching,
                        int threads = 0) {
  return pr.params(Precision::kExact, mode, 128, Fp8Format::kE4M3, threads);
}

// ---- Gradients vs central finite differences (FP64, rel < 1e-6) ----------

// Loss L = sum(O * G) with G the incoming gradient dout; its gradient is what
// the backward returns for dout = G.
double loss_of(const Problem& pr, const Inputs& in) {
  RunOptions opt;
  opt.backward = false;
  const RefOutputs r = run_reference(pr, in, exact_params(pr, DeltaMode::kDeltaMatching, 1), opt);
  double s = 0;
  for (size_t i = 0; i < r.o.size(); ++i) s += r.o[i] * in.dout[i];
  return s;
}

void check_finite_differences(const Problem& pr, uint32_t seed) {
  std::mt19937 rng(seed);
  Inputs in = random_inputs(pr, rng, false);
  const RefOutputs r = run_reference(pr, in, exact_params(pr));
  const double h = 1e-5;
  auto fd = [&](std::vector<double>& x) {
    std::vector<double> g(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i];
      x[i] = x0 + h;
      const double lp = loss_of(pr, in);
      x[i] = x0 - h;
      const double lm = loss_of(pr, in);
      x[i] = x0;
      g[i] = (lp - lm) / (2 * h);
    }
    return g;
  };
  const std::vector<double> gq = fd(in.q), gk = fd(in.k), gv = fd(in.v);
  EXPECT_LT(rel_error(r.dq, gq), 1e-6) << "dQ";
  EXPECT_LT(rel_error(r.dk, gk), 1e-6) << "dK";
  EXPECT_LT(rel_error(r.dv, gv), 1e-6) << "dV";
  // Not a trivially small gradient.
  EXPECT_GT(frobenius(gq), 1e-3);
  EXPECT_GT(frobenius(gk), 1e-3);
}

TEST(ReferenceExact, GradientsMatchFiniteDifferences) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 5;
  pr.Sk = 7;
  pr.Hq = 4;
  pr.Hkv = 2;  // GQA
  pr.d = 6;
  pr.dv = 4;  // head_dim_qk != head_dim_v
  check_finite_differences(pr, 11);
}

TEST(ReferenceExact, GradientsMatchFiniteDifferencesCausal) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 7;
  pr.Sk = 5;  // rows 0, 1 see no key
  pr.Hq = 3;
  pr.Hkv = 1;
  pr.d = 5;
  pr.dv = 3;
  pr.causal = true;
  check_finite_differences(pr, 12);
  pr.Sq = 4;
  pr.Sk = 9;
  check_finite_differences(pr, 13);
}

// ---- delta: all modes equal sum_j P dP = <dO, O> ------------------------

TEST(ReferenceExact, DeltaModesCoincideWithOutputInnerProduct) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 33;
  pr.Sk = 40;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 24;
  pr.dv = 20;
  pr.causal = true;
  std::mt19937 rng(21);
  const Inputs in = random_inputs(pr, rng, false);
  const Outputs naive = naive_attention(pr, in);
  std::vector<RefOutputs> runs;
  for (DeltaMode m : {DeltaMode::kStale, DeltaMode::kMatchedDO, DeltaMode::kDeltaMatching})
    runs.push_back(run_reference(pr, in, exact_params(pr, m)));
  // <dO_i, O_i> with the reference's FP64 O equals sum_j P_ij dP_ij (naive).
  const int64_t dv = pr.dv;
  double worst = 0;
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t h = 0; h < pr.Hq; ++h)
      for (int64_t i = 0; i < pr.Sq; ++i) {
        double dot = 0, scale = 0;
        for (int64_t c = 0; c < dv; ++c) {
          const int64_t x = ((b * pr.Sq + i) * pr.Hq + h) * dv + c;
          dot += in.dout[x] * runs[0].o[x];
          scale += std::fabs(in.dout[x] * runs[0].o[x]);
        }
        const double dm = naive.delta[(b * pr.Hq + h) * pr.Sq + i];
        if (scale > 0) worst = std::max(worst, std::fabs(dot - dm) / scale);
      }
  EXPECT_LT(worst, 1e-12);
  for (const RefOutputs& r : runs) {
    // Same delta in every mode (FP32 diagnostic of the FP64 value), eps = 0.
    for (size_t i = 0; i < r.diag_delta.size(); ++i) {
      EXPECT_EQ(r.diag_delta[i], runs[0].diag_delta[i]);
      EXPECT_EQ(r.diag_eps[i], 0.f);
      EXPECT_NEAR(r.diag_delta[i], naive.delta[i], 1e-6 * (1 + std::fabs(naive.delta[i])));
    }
    EXPECT_TRUE(bitwise_equal(r.dq, runs[0].dq));
    EXPECT_TRUE(bitwise_equal(r.dk, runs[0].dk));
  }
  // Exact dS rows sum to zero (pre = post in the exact path).
  for (size_t i = 0; i < runs[0].rowsum_pre.size(); ++i) {
    EXPECT_LT(runs[0].rowsum_pre[i], 1e-12);
    EXPECT_EQ(runs[0].rowsum_pre[i], runs[0].rowsum_post[i]);
  }
}

// ---- Against the naive implementation: masks, GQA, head dims ------------

void expect_matches_naive(const Problem& pr, uint32_t seed, double tol = 1e-12) {
  std::mt19937 rng(seed);
  const Inputs in = random_inputs(pr, rng, false);
  const Outputs n = naive_attention(pr, in);
  const RefOutputs r = run_reference(pr, in, exact_params(pr));
  EXPECT_LT(rel_error(r.o, n.o), tol);
  EXPECT_LT(rel_error(r.dq, n.dq), tol);
  EXPECT_LT(rel_error(r.dk, n.dk), tol);
  EXPECT_LT(rel_error(r.dv, n.dv), tol);
  ASSERT_EQ(r.lse.size(), n.lse.size());
  for (size_t i = 0; i < n.lse.size(); ++i) {
    if (std::isinf(n.lse[i]))
      EXPECT_TRUE(std::isinf(r.lse[i]) && r.lse[i] < 0) << i;
    else
      EXPECT_NEAR(r.lse[i], n.lse[i], 1e-6 * std::fabs(n.lse[i]) + 1e-7) << i;  // FP32 LSE
  }
}

TEST(ReferenceExact, CausalSeqlenQLongerThanSeqlenK) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 19;
  pr.Sk = 11;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 16;
  pr.dv = 8;
  pr.causal = true;
  expect_matches_naive(pr, 31);
}

TEST(ReferenceExact, CausalSeqlenQShorterThanSeqlenK) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 9;
  pr.Sk = 23;
  pr.Hq = 6;
  pr.Hkv = 3;
  pr.d = 12;
  pr.dv = 20;
  pr.causal = true;
  expect_matches_naive(pr, 32);
}

TEST(ReferenceExact, NonCausalAndLargeHeadDims) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 7;
  pr.Sk = 13;
  pr.Hq = 2;
  pr.Hkv = 1;
  pr.d = 192;
  pr.dv = 128;  // MLA-style
  expect_matches_naive(pr, 33);
  pr.d = 256;
  pr.dv = 1;
  pr.causal = true;
  expect_matches_naive(pr, 34);
}

// ---- Single key ------------------------------------------------------------

TEST(ReferenceExact, SingleKeyOutputIsValueAndGradientsVanish) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 3;
  pr.Sk = 1;
  pr.Hq = 2;
  pr.Hkv = 2;
  pr.d = 16;
  pr.dv = 12;
  std::mt19937 rng(61);
  const Inputs in = random_inputs(pr, rng, false);
  const RefOutputs r = run_reference(pr, in, exact_params(pr));
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t i = 0; i < pr.Sq; ++i)
      for (int64_t h = 0; h < pr.Hq; ++h)
        for (int64_t c = 0; c < pr.dv; ++c)
          EXPECT_EQ(r.o[((b * pr.Sq + i) * pr.Hq + h) * pr.dv + c],
                    in.v[(b * pr.Hkv + h) * pr.dv + c]);
  for (double x : r.dq) EXPECT_EQ(x, 0.0);
  for (double x : r.dk) EXPECT_EQ(x, 0.0);
  // dV = sum over the query rows of dO (P = 1).
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t h = 0; h < pr.Hkv; ++h)
      for (int64_t c = 0; c < pr.dv; ++c) {
        double s = 0;
        for (int64_t i = 0; i < pr.Sq; ++i) s += in.dout[((b * pr.Sq + i) * pr.Hq + h) * pr.dv + c];
        EXPECT_NEAR(r.dv[(b * pr.Hkv + h) * pr.dv + c], s, 1e-14);
      }
}

}  // namespace
}  // namespace fp8attn
