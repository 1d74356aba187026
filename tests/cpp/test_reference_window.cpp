// Tests of sliding windows in the CPU reference (AttnParams::window_left /
// window_right, FlashAttention's window_size; numerics.md section 14, with the
// masking rules of sections 3, 7 and 9):
//   - the exact path against a brute-force masked FP64 attention (test_util.h's
//     naive_attention over Problem::sees, written from the definition), for
//     bounds in {-1, 0, 1, small, crossing tile edges}, seqlen_q != seqlen_k both
//     ways, rows that see no key, keys no row sees, GQA;
//   - the fp8 path (both recipes, every delta mode) against the exact path within
//     the FP8 error budget; rows / keys outside every window exactly zero;
//   - identities that must hold bit for bit: (-1, -1) is no window, (-1, 0) is
//     causal, a window reaching every key is no window, causal with a window
//     (L, R) is the window (L, 0);
//   - a row's outputs do not depend on the keys outside its window, nor a key's
//     gradients on the rows that do not see it (NaN and huge values there);
//   - the Delta-Matching row-sum invariant over the keys the window lets a row
//     see, with `stale` shown to fail on the same inputs.
// The bit-level agreement with the literal emulations of both recipes under
// windows is in test_reference_fp8.cpp / test_reference_tile.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "reference/attention_ref.h"
#include "test_util.h"

namespace fp8attn {
namespace {

using namespace testutil;

std::string describe(const Problem& pr) {
  return "Sq=" + std::to_string(pr.Sq) + " Sk=" + std::to_string(pr.Sk) + " causal=" +
         std::to_string(pr.causal) + " window=(" + std::to_string(pr.window_left) + ", " +
         std::to_string(pr.window_right) + ") scaling=" + std::to_string(static_cast<int>(pr.scaling));
}

// Every element of a against b: |a - b| <= tol * (|b| + max |b|) (NaN fails).
void expect_close_everywhere(const std::vector<double>& a, const std::vector<double>& b, double tol,
                             const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double bmax = 0;
  for (double x : b) bmax = std::max(bmax, std::fabs(x));
  int64_t bad = 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= tol * (std::fabs(b[i]) + bmax))) {
      if (bad++ < 3) ADD_FAILURE() << what << "[" << i << "] = " << a[i] << ", expected " << b[i];
    }
  EXPECT_EQ(bad, 0) << what;
}

// Rows / keys with no visible partner: their outputs are exact zeros (O, dQ / dK,
// dV), LSE -inf, and every element of the outputs is finite.
void expect_unseen_are_zero(const Problem& pr, const RefOutputs& r) {
  EXPECT_TRUE(all_finite(r.o) && all_finite(r.dq) && all_finite(r.dk) && all_finite(r.dv));
  for (int64_t b = 0; b < pr.B; ++b) {
    for (int64_t i = 0; i < pr.Sq; ++i) {
      bool any = false;
      for (int64_t j = 0; j < pr.Sk; ++j) any |= pr.sees(i, j);
      for (int64_t h = 0; h < pr.Hq; ++h) {
        const double lse = r.lse[(b * pr.Hq + h) * pr.Sq + i];
        EXPECT_EQ(any, std::isfinite(lse)) << "row " << i;
        if (any) continue;
        EXPECT_TRUE(lse < 0) << "row " << i;
        for (int64_t c = 0; c < pr.dv; ++c) EXPECT_EQ(r.o[((b * pr.Sq + i) * pr.Hq + h) * pr.dv + c], 0.0);
        for (int64_t c = 0; c < pr.d; ++c) EXPECT_EQ(r.dq[((b * pr.Sq + i) * pr.Hq + h) * pr.d + c], 0.0);
      }
    }
    for (int64_t j = 0; j < pr.Sk; ++j) {
      bool any = false;
      for (int64_t i = 0; i < pr.Sq; ++i) any |= pr.sees(i, j);
      if (any) continue;
      for (int64_t h = 0; h < pr.Hkv; ++h) {
        for (int64_t c = 0; c < pr.d; ++c) EXPECT_EQ(r.dk[((b * pr.Sk + j) * pr.Hkv + h) * pr.d + c], 0.0);
        for (int64_t c = 0; c < pr.dv; ++c) EXPECT_EQ(r.dv[((b * pr.Sk + j) * pr.Hkv + h) * pr.dv + c], 0.0);
      }
    }
  }
}

// The bounds the sweeps use: unbounded, 0, 1, small, and across the 32- / 64- /
// 128-key tile edges.
constexpr int64_t kBounds[] = {-1, 0, 1, 5, 100, 129, 200};

// ---- Exact path against the brute-force mask --------------------------------

// The exact path's O, dQ, dK, dV against the naive attention's, elementwise.
void expect_exact_matches_naive(const RefOutputs& r, const Outputs& n) {
  expect_close_everywhere(r.o, n.o, 1e-12, "O");
  expect_close_everywhere(r.dq, n.dq, 1e-12, "dQ");
  expect_close_everywhere(r.dk, n.dk, 1e-12, "dK");
  expect_close_everywhere(r.dv, n.dv, 1e-12, "dV");
}

TEST(ReferenceWindow, ExactMatchesBruteForceMaskedAttention) {
  const int64_t shapes[][2] = {{150, 150}, {90, 260}, {260, 90}};
  int64_t n_empty_rows = 0, n_empty_keys = 0;
  for (const auto& sh : shapes)
    for (int64_t left : kBounds)
      for (int64_t right : kBounds) {
        const Problem pr{.B = 1, .Sq = sh[0], .Sk = sh[1], .Hq = 4, .Hkv = 2 /* GQA */, .d = 12, .dv = 8,
                         .window_left = left, .window_right = right};
        SCOPED_TRACE(describe(pr));
        std::mt19937 rng(static_cast<uint32_t>(1000 + 7 * left + 131 * right + sh[0]));
        const Inputs in = random_inputs(pr, rng, false);
        const Outputs n = naive_attention(pr, in);
        const RefOutputs r = run_reference(pr, in, pr.params(Precision::kExact));
        expect_exact_matches_naive(r, n);
        for (size_t i = 0; i < n.lse.size(); ++i) {
          if (std::isinf(n.lse[i]))
            EXPECT_TRUE(std::isinf(r.lse[i]) && r.lse[i] < 0) << i;
          else
            EXPECT_NEAR(r.lse[i], n.lse[i], 1e-6 * std::fabs(n.lse[i]) + 1e-7) << i;  // FP32 LSE
          EXPECT_NEAR(r.delta[i], n.delta[i], 1e-6 * std::fabs(n.delta[i]) + 1e-7) << i;
        }
        expect_unseen_are_zero(pr, r);
        for (int64_t i = 0; i < pr.Sq; ++i) {
          bool any = false;
          for (int64_t j = 0; j < pr.Sk; ++j) any |= pr.sees(i, j);
          n_empty_rows += !any;
        }
        for (int64_t j = 0; j < pr.Sk; ++j) {
          bool any = false;
          for (int64_t i = 0; i < pr.Sq; ++i) any |= pr.sees(i, j);
          n_empty_keys += !any;
        }
      }
  // The sweep has rows that see no key and keys that no row sees.
  EXPECT_GT(n_empty_rows, 0);
  EXPECT_GT(n_empty_keys, 0);
}

// causal=True forces the right bound to 0 (FlashAttention's rule).
TEST(ReferenceWindow, ExactCausalWithAWindowIsTheWindowWithRightBoundZero) {
  const Problem pr{.B = 2, .Sq = 70, .Sk = 110, .Hq = 2, .Hkv = 1, .d = 16, .dv = 16, .causal = true,
                   .window_left = 9, .window_right = 17};
  std::mt19937 rng(5);
  const Inputs in = random_inputs(pr, rng, false);
  Problem ref = pr;
  ref.causal = false;
  ref.window_right = 0;
  const Outputs n = naive_attention(ref, in);
  const RefOutputs r = run_reference(pr, in, pr.params(Precision::kExact));
  expect_exact_matches_naive(r, n);
}

// ---- fp8 path: error budget, zeros outside every window -----------------------

TEST(ReferenceWindow, Fp8WithinBudgetForBothRecipesAndEveryDeltaMode) {
  // Windows whose rows see >= 100 keys (the budget is a statement about rows of
  // many keys), with edges inside tiles, both bounds and one; seqlen_q != seqlen_k.
  const int64_t windows[][2] = {{100, 0}, {129, 129}, {200, -1}, {-1, 129}, {150, 40}};
  const int64_t shapes[][2] = {{384, 384}, {200, 330}};
  const DeltaMode modes[] = {DeltaMode::kStale, DeltaMode::kMatchedDO, DeltaMode::kDeltaMatching};
  const Errors bud = fp8_budget(Fp8Format::kE4M3);  // test_util.h's rms rounding model
  for (const auto& sh : shapes)
    for (const auto& w : windows)
      for (Scaling sc : {Scaling::kRow, Scaling::kTile}) {
        const Problem pr{.B = 1, .Sq = sh[0], .Sk = sh[1], .Hq = 2, .Hkv = 1, .d = 64, .dv = 64,
                         .window_left = w[0], .window_right = w[1], .scaling = sc};
        SCOPED_TRACE(describe(pr));
        std::mt19937 rng(static_cast<uint32_t>(77 + w[0] + 3 * w[1] + sh[1]));
        const Inputs in = random_inputs(pr, rng);
        const RefOutputs ex = run_bf16(pr, in, pr.params(Precision::kExact), DType::kFloat32);
        for (DeltaMode mode : modes) {
          const RefOutputs f8 = run_bf16(pr, in, pr.params(Precision::kFP8, mode, 64), DType::kFloat32);
          expect_unseen_are_zero(pr, f8);
          expect_within_budget(errors_vs_exact(f8, ex), bud);  // O, dQ, dK, dV; not a copy of exact
        }
      }
}

// Narrow windows (rows of 1-11 keys, windows inside one tile, rows that see no key):
// every output finite, zeros where nothing is seen, and close to the exact result.
TEST(ReferenceWindow, Fp8NarrowWindowsAndEmptyRows) {
  const int64_t windows[][2] = {{0, 0}, {1, 0}, {0, 1}, {5, 5}, {5, -1}, {-1, 5}, {1, 1}};
  for (const auto& w : windows)
    for (Scaling sc : {Scaling::kRow, Scaling::kTile})
      for (int64_t sk : {int64_t(60), int64_t(140)}) {
        const Problem pr{.B = 2, .Sq = 100, .Sk = sk, .Hq = 2, .Hkv = 2, .d = 32, .dv = 16,
                         .window_left = w[0], .window_right = w[1], .scaling = sc};
        SCOPED_TRACE(describe(pr));
        std::mt19937 rng(static_cast<uint32_t>(9 + w[0] + 5 * w[1] + sk));
        const Inputs in = random_inputs(pr, rng);
        const RefOutputs ex = run_bf16(pr, in, pr.params(Precision::kExact), DType::kFloat32);
        for (DeltaMode mode : {DeltaMode::kStale, DeltaMode::kMatchedDO, DeltaMode::kDeltaMatching}) {
          const RefOutputs f8 = run_bf16(pr, in, pr.params(Precision::kFP8, mode, 32), DType::kFloat32);
          expect_unseen_are_zero(pr, f8);
          // Rows of few keys: FP8's error is that of a few products, not averaged.
          EXPECT_LT(rel_error(f8.o, ex.o), 0.1);
          EXPECT_LT(rel_error(f8.dv, ex.dv), 0.1);
          if (frobenius(ex.dq) > 0) {
            EXPECT_LT(rel_error(f8.dq, ex.dq), 0.25);
            EXPECT_LT(rel_error(f8.dk, ex.dk), 0.25);
          } else if (mode == DeltaMode::kDeltaMatching) {
            // One key per row: dS = 0 in exact arithmetic, and Delta-Matching's delta
            // (over that one key) gives exactly 0 (stale / matched_do leave dP's FP8
            // rounding, the residual of section 4).
            EXPECT_EQ(frobenius(f8.dq), 0.0);
            EXPECT_EQ(frobenius(f8.dk), 0.0);
          }
        }
      }
}

// ---- Bitwise identities ------------------------------------------------------

void expect_bitwise_same(const RefOutputs& a, const RefOutputs& b) {
  EXPECT_TRUE(bitwise_equal(a.o, b.o));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
  EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
  EXPECT_TRUE(a.diag_delta == b.diag_delta && a.diag_eps == b.diag_eps && a.rowsum_pre == b.rowsum_pre &&
              a.rowsum_post == b.rowsum_post);
}

TEST(ReferenceWindow, WindowsThatMeanNoWindowOrCausalAreBitwiseTheSame) {
  struct Case {
    int64_t left, right;
    bool causal;
    int64_t same_left, same_right;  // the mask it must equal
    bool same_causal;
  };
  const int64_t shapes[][2] = {{150, 150}, {90, 170}, {170, 90}};
  for (const auto& sh : shapes) {
    const int64_t Sq = sh[0], Sk = sh[1];
    const Case cases[] = {
        {-1, -1, false, -1, -1, false},          // (-1, -1): no window
        {-7, -100, false, -1, -1, false},        // any negative bound is unbounded
        {-1, 0, false, -1, -1, true},            // (-1, 0): causal
        {-3, 0, false, -1, -1, true},
        {Sk - 1, Sq - 1, false, -1, -1, false},  // bounds reaching every key of every row
        {Sk + 50, 1 << 20, false, -1, -1, false},
        {Sk - 1, 0, false, -1, -1, true},        // ... with the causal right bound
        {Sk - 1, 37, true, -1, -1, true},        // causal forces right = 0
        {-1, -1, true, -1, -1, true},
        {23, 9, true, 23, 0, false},             // causal + window (L, R) = window (L, 0)
        {23, -1, true, 23, 0, false},
    };
    for (const Case& c : cases)
      for (int rc = 0; rc < 3; ++rc) {
        const Problem pr{.B = 1, .Sq = Sq, .Sk = Sk, .Hq = 2, .Hkv = 1, .d = 24, .dv = 24, .causal = c.causal,
                         .window_left = c.left, .window_right = c.right,
                         .scaling = rc == 2 ? Scaling::kTile : Scaling::kRow};
        const Precision prec = rc == 0 ? Precision::kExact : Precision::kFP8;
        Problem same = pr;
        same.window_left = c.same_left;
        same.window_right = c.same_right;
        same.causal = c.same_causal;
        SCOPED_TRACE(describe(pr) + " vs " + describe(same) + " prec=" + std::to_string(static_cast<int>(prec)));
        std::mt19937 rng(static_cast<uint32_t>(31 + Sq + Sk));
        const Inputs in = random_inputs(pr, rng);
        for (DeltaMode mode : {DeltaMode::kStale, DeltaMode::kDeltaMatching}) {
          const RefOutputs a = run_bf16(pr, in, pr.params(prec, mode, 32), DType::kFloat32);
          const RefOutputs b = run_bf16(same, in, same.params(prec, mode, 32), DType::kFloat32);
          expect_bitwise_same(a, b);
          EXPECT_TRUE(all_finite(a.o) && all_finite(a.dq) && all_finite(a.dk) && all_finite(a.dv));
        }
      }
  }
}

// ---- What a row's result does not depend on ------------------------------------

// Keys outside a row's window (NaN in some, values 2^60 times larger in others)
// leave that row's O, LSE and dQ bit for bit unchanged, and NaN / huge query rows
// leave the dK / dV of the keys they do not see unchanged: every block a row or a
// key column reads is quantized from what it sees (numerics.md sections 3, 7, 9).
// Whole-tile quantization of K / V / Q / dO would fail this (the poisoned keys sit
// inside tiles that rows outside them read partially).
TEST(ReferenceWindow, OutsideTheWindowReachesNothing) {
  const int64_t windows[][2] = {{37, 11}, {5, 0}, {-1, 3}, {20, -1}};
  for (int rc = 0; rc < 3; ++rc)
    for (const auto& w : windows) {
      const Problem pr{.B = 1, .Sq = 150, .Sk = 170, .Hq = 2, .Hkv = 1, .d = 24, .dv = 20,
                       .window_left = w[0], .window_right = w[1],
                       .scaling = rc == 2 ? Scaling::kTile : Scaling::kRow};
      const Precision prec = rc == 0 ? Precision::kExact : Precision::kFP8;
      SCOPED_TRACE(describe(pr) + " prec=" + std::to_string(static_cast<int>(prec)));
      std::mt19937 rng(static_cast<uint32_t>(401 + w[0] + w[1]));
      const Inputs clean = random_inputs(pr, rng);
      RunOptions opt;
      opt.in_dtype = DType::kFloat32;
      opt.out_dtype = DType::kFloat32;
      const AttnParams p = pr.params(prec, DeltaMode::kDeltaMatching, 32);
      const RefOutputs r0 = run_reference(pr, clean, p, opt);
      // Poison keys [77, 81) with NaN and scale key 120 by 2^60, in K and V.
      Inputs kv = clean;
      auto poisoned_key = [](int64_t j) { return (j >= 77 && j < 81) || j == 120; };
      for (int64_t j = 0; j < pr.Sk; ++j)
        if (poisoned_key(j)) {
          for (int64_t c = 0; c < pr.d; ++c) kv.k[j * pr.d + c] = j == 120 ? std::ldexp(kv.k[j * pr.d + c], 60) : NAN;
          for (int64_t c = 0; c < pr.dv; ++c) kv.v[j * pr.dv + c] = j == 120 ? std::ldexp(kv.v[j * pr.dv + c], 60) : NAN;
        }
      const RefOutputs r1 = run_reference(pr, kv, p, opt);
      int64_t rows_checked = 0, rows_reached = 0;
      for (int64_t i = 0; i < pr.Sq; ++i) {
        bool sees_poison = false;
        for (int64_t j = 0; j < pr.Sk; ++j) sees_poison |= pr.sees(i, j) && poisoned_key(j);
        for (int64_t h = 0; h < pr.Hq; ++h) {
          const int64_t o0 = (i * pr.Hq + h) * pr.dv, q0 = (i * pr.Hq + h) * pr.d, l = h * pr.Sq + i;
          bool same = std::memcmp(&r0.lse[l], &r1.lse[l], sizeof(double)) == 0;
          same &= std::memcmp(r0.o.data() + o0, r1.o.data() + o0, pr.dv * sizeof(double)) == 0;
          same &= std::memcmp(r0.dq.data() + q0, r1.dq.data() + q0, pr.d * sizeof(double)) == 0;
          if (!sees_poison) {
            EXPECT_TRUE(same) << "row " << i << " head " << h << " does not see the poisoned keys";
            ++rows_checked;
          } else {
            rows_reached += !same;
          }
        }
      }
      EXPECT_GT(rows_checked, 0);
      EXPECT_GT(rows_reached, 0);  // the poison is real: rows that see it change
      // Poison query rows [60, 63) with NaN and scale row 100 by 2^60, in Q and dO.
      Inputs qd = clean;
      auto poisoned_row = [](int64_t i) { return (i >= 60 && i < 63) || i == 100; };
      for (int64_t i = 0; i < pr.Sq; ++i)
        if (poisoned_row(i))
          for (int64_t h = 0; h < pr.Hq; ++h) {
            for (int64_t c = 0; c < pr.d; ++c) {
              double& x = qd.q[(i * pr.Hq + h) * pr.d + c];
              x = i == 100 ? std::ldexp(x, 60) : NAN;
            }
            for (int64_t c = 0; c < pr.dv; ++c) {
              double& x = qd.dout[(i * pr.Hq + h) * pr.dv + c];
              x = i == 100 ? std::ldexp(x, 60) : NAN;
            }
          }
      const RefOutputs r2 = run_reference(pr, qd, p, opt);
      int64_t keys_checked = 0, keys_reached = 0;
      for (int64_t j = 0; j < pr.Sk; ++j) {
        bool seen_by_poison = false;
        for (int64_t i = 0; i < pr.Sq; ++i) seen_by_poison |= pr.sees(i, j) && poisoned_row(i);
        const int64_t k0 = j * pr.d, v0 = j * pr.dv;
        bool same = std::memcmp(r0.dk.data() + k0, r2.dk.data() + k0, pr.d * sizeof(double)) == 0;
        same &= std::memcmp(r0.dv.data() + v0, r2.dv.data() + v0, pr.dv * sizeof(double)) == 0;
        if (!seen_by_poison) {
          EXPECT_TRUE(same) << "key " << j << " is not seen by the poisoned rows";
          ++keys_checked;
        } else {
          keys_reached += !same;
        }
      }
      EXPECT_GT(keys_checked, 0);
      EXPECT_GT(keys_reached, 0);
    }
}

// ---- Delta-Matching invariant over the window's keys ----------------------------

// numerics.md sections 4 and 6 with windows: the Delta-Matching delta sums over the
// keys the window lets a row see, so its pre-cast dS row sums (over those keys)
// vanish to FP32 rounding (mean residual < 1e-5); stale and matched_do on the same
// inputs stay >= 10x larger and above 1e-3 in absolute terms.
TEST(ReferenceWindow, DeltaMatchingRowSumInvariant) {
  const int64_t windows[][2] = {{64, 0}, {100, 100}, {0, 129}, {129, 5}};
  for (const auto& w : windows)
    for (Scaling sc : {Scaling::kRow, Scaling::kTile}) {
      const Problem pr{.B = 2, .Sq = 256, .Sk = 300, .Hq = 4, .Hkv = 2, .d = 64, .dv = 64,
                       .window_left = w[0], .window_right = w[1], .scaling = sc};
      SCOPED_TRACE(describe(pr));
      std::mt19937 rng(static_cast<uint32_t>(501 + w[0] + w[1]));
      const Inputs in = random_inputs(pr, rng);
      const RowSumResiduals res = rowsum_residuals(pr, in);  // the saved O is BF16, as at the op boundary
      const double *pre = res.pre, *post = res.post;
      std::printf("[window invariant] (%lld, %lld) scaling=%d pre: stale %.3e matched_do %.3e DM %.3e; post: "
                  "stale %.3e DM %.3e\n",
                  static_cast<long long>(w[0]), static_cast<long long>(w[1]), static_cast<int>(sc), pre[0], pre[1],
                  pre[2], post[0], post[2]);
      EXPECT_LT(pre[2], 1e-5);
      EXPECT_GE(pre[0], 10 * pre[2]);
      EXPECT_GE(pre[1], 10 * pre[2]);
      EXPECT_GT(pre[0], 1e-3);
      EXPECT_GT(pre[1], 1e-3);
      EXPECT_GT(post[0], post[2]);
    }
}

}  // namespace
}  // namespace fp8attn
