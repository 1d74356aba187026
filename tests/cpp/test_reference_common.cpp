// Tests of the CPU reference's behaviour shared by the exact and fp8 paths:
// fully masked rows, empty sequences, GQA, NaN containment under causal masks
// and padding, dtypes, strided layouts and thread-count independence
// (numerics.md sections 1-2; the fp8 tests run for both scaling recipes, section 9).
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

// Every path of the reference: exact, and fp8 with each scaling recipe.
struct Recipe {
  Precision prec;
  Scaling scaling;
};
constexpr Recipe kAllRecipes[] = {
    {Precision::kExact, Scaling::kRow}, {Precision::kFP8, Scaling::kRow}, {Precision::kFP8, Scaling::kTile}};

TEST(Reference, FullyMaskedRowsAreZeroWithoutNaN) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 9;
  pr.Sk = 5;  // rows 0..3 see no key
  pr.Hq = 2;
  pr.Hkv = 1;
  pr.d = 8;
  pr.dv = 8;
  pr.causal = true;
  std::mt19937 rng(41);
  const Inputs in = random_inputs(pr, rng);
  for (const Recipe rc : kAllRecipes) {
    const Precision prec = rc.prec;
    pr.scaling = rc.scaling;
    const RefOutputs r = run_reference(pr, in, pr.params(prec));
    EXPECT_TRUE(all_finite(r.o) && all_finite(r.dq) && all_finite(r.dk) && all_finite(r.dv));
    for (int64_t b = 0; b < pr.B; ++b)
      for (int64_t h = 0; h < pr.Hq; ++h)
        for (int64_t i = 0; i < pr.Sq; ++i) {
          const bool masked = i < pr.Sq - pr.Sk;
          const int64_t row = (b * pr.Hq + h) * pr.Sq + i;
          double on = 0, dqn = 0;
          for (int64_t c = 0; c < pr.dv; ++c)
            on += std::fabs(r.o[((b * pr.Sq + i) * pr.Hq + h) * pr.dv + c]);
          for (int64_t c = 0; c < pr.d; ++c)
            dqn += std::fabs(r.dq[((b * pr.Sq + i) * pr.Hq + h) * pr.d + c]);
          if (masked) {
            EXPECT_EQ(on, 0.0);
            EXPECT_EQ(dqn, 0.0);
            EXPECT_TRUE(std::isinf(r.lse[row]) && r.lse[row] < 0);
            EXPECT_EQ(r.diag_delta[row], 0.f);
            EXPECT_EQ(r.rowsum_pre[row], 0.f);
            EXPECT_EQ(r.rowsum_post[row], 0.f);
          } else {
            EXPECT_GT(on, 0.0);
            EXPECT_TRUE(std::isfinite(r.lse[row]));
          }
        }
  }
}

// seqlen_k = 0: every row sees nothing; seqlen_q = 0: dK = dV = 0.
TEST(Reference, EmptySequences) {
  for (const Recipe rc : kAllRecipes) {
    const Precision prec = rc.prec;
    Problem pr;
    pr.scaling = rc.scaling;
    pr.Sq = 4;
    pr.Sk = 0;
    std::mt19937 rng(42);
    const RefOutputs r = run_reference(pr, random_inputs(pr, rng), pr.params(prec));
    for (double x : r.o) EXPECT_EQ(x, 0.0);
    for (double x : r.dq) EXPECT_EQ(x, 0.0);
    for (double x : r.lse) EXPECT_TRUE(std::isinf(x) && x < 0);
    pr.Sq = 0;
    pr.Sk = 4;
    HostTensor q(1, 0, 2, 16), o(1, 0, 2, 16), dq(1, 0, 2, 16);
    HostTensor k(1, 4, 2, 16, DType::kFloat64, Layout::kBSHD, 0, 0, 1.0), v = k;
    HostTensor dk(1, 4, 2, 16, DType::kFloat64, Layout::kBSHD, 0, 0, 7.0), dv = dk;
    attention_backward_ref(pr.params(prec), q.view(), k.view(), v.view(), o.view(), o.view(),
                           nullptr, dq.view(), dk.view(), dv.view(), nullptr);
    for (double x : dk.values()) EXPECT_EQ(x, 0.0);
    for (double x : dv.values()) EXPECT_EQ(x, 0.0);
  }
}

// ---- GQA equals repeated K/V heads ---------------------------------------

// Repeats each kv head G times: [B, S, Hkv, D] -> [B, S, Hkv * G, D].
std::vector<double> repeat_heads(const std::vector<double>& x, int64_t B, int64_t S, int64_t H,
                                 int64_t D, int64_t G) {
  std::vector<double> y(x.size() * G);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H * G; ++h)
        for (int64_t c = 0; c < D; ++c)
          y[((b * S + s) * H * G + h) * D + c] = x[((b * S + s) * H + h / G) * D + c];
  return y;
}
// Sums groups of G heads: [B, S, H * G, D] -> [B, S, H, D].
std::vector<double> sum_groups(const std::vector<double>& y, int64_t B, int64_t S, int64_t H,
                               int64_t D, int64_t G) {
  std::vector<double> x(y.size() / G, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H * G; ++h)
        for (int64_t c = 0; c < D; ++c)
          x[((b * S + s) * H + h / G) * D + c] += y[((b * S + s) * H * G + h) * D + c];
  return x;
}

void check_gqa_equals_repeated(Precision prec, double grad_tol, Scaling sc = Scaling::kRow) {
  Problem pr;
  pr.scaling = sc;
  pr.B = 2;
  pr.Sq = 37;
  pr.Sk = 45;
  pr.Hq = 6;
  pr.Hkv = 2;
  pr.d = 32;
  pr.dv = 24;
  pr.causal = true;
  const int64_t G = pr.Hq / pr.Hkv;
  std::mt19937 rng(51);
  const Inputs in = random_inputs(pr, rng);
  Problem rep = pr;
  rep.Hkv = pr.Hq;
  Inputs rin = in;
  rin.k = repeat_heads(in.k, pr.B, pr.Sk, pr.Hkv, pr.d, G);
  rin.v = repeat_heads(in.v, pr.B, pr.Sk, pr.Hkv, pr.dv, G);
  RunOptions opt;
  opt.in_dtype = DType::kFloat32;
  opt.out_dtype = DType::kFloat32;
  const RefOutputs a = run_reference(pr, in, pr.params(prec), opt);
  const RefOutputs b = run_reference(rep, rin, rep.params(prec), opt);
  // Per query head the computation is the same: bitwise-equal O, LSE, dQ.
  EXPECT_TRUE(bitwise_equal(a.o, b.o));
  EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
  EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
  // dK/dV of a kv head = sum over its group (summed in a different order).
  EXPECT_LT(rel_error(a.dk, sum_groups(b.dk, pr.B, pr.Sk, pr.Hkv, pr.d, G)), grad_tol);
  EXPECT_LT(rel_error(a.dv, sum_groups(b.dv, pr.B, pr.Sk, pr.Hkv, pr.dv, G)), grad_tol);
  EXPECT_TRUE(all_finite(a.dk) && all_finite(a.dv));
}

TEST(ReferenceExact, GqaEqualsRepeatedKvHeads) {
  check_gqa_equals_repeated(Precision::kExact, 1e-6);
}
// FP32 accumulators in the fp8 path: the group sum differs by FP32 rounding.
TEST(ReferenceFp8, GqaEqualsRepeatedKvHeads) { check_gqa_equals_repeated(Precision::kFP8, 1e-5); }
TEST(ReferenceFp8Tile, GqaEqualsRepeatedKvHeads) {
  check_gqa_equals_repeated(Precision::kFP8, 1e-5, Scaling::kTile);
}

// ---- NaN only where nobody may read it -------------------------------------

// NaN in K and V at key jn (causal, seqlen_q == seqlen_k): rows i < jn do not
// see it, so their O, LSE and dQ stay finite; rows i >= jn are NaN (non-finite
// input propagates). jn sits inside a key tile so that the tile is partially
// visible to rows below jn (the fp8 path must quantize that tile's K/V blocks
// from the visible keys only). The same inputs without the NaN give the same
// finite rows bit for bit.
void check_nan_in_masked_kv(Precision prec, int block_size, Scaling sc = Scaling::kRow) {
  Problem pr;
  pr.scaling = sc;
  pr.B = 1;
  pr.Sq = 150;
  pr.Sk = 150;
  pr.Hq = 2;
  pr.Hkv = 1;
  pr.d = 32;
  pr.dv = 32;
  pr.causal = true;
  const int64_t jn = 100;
  std::mt19937 rng(71);
  const Inputs clean = random_inputs(pr, rng);
  Inputs dirty = clean;
  for (int64_t c = 0; c < pr.d; ++c) dirty.k[jn * pr.d + c] = NAN;
  for (int64_t c = 0; c < pr.dv; ++c) dirty.v[jn * pr.dv + c] = NAN;
  const AttnParams p = pr.params(prec, DeltaMode::kDeltaMatching, block_size);
  RunOptions opt;
  opt.in_dtype = DType::kBFloat16;
  opt.out_dtype = DType::kFloat32;
  const RefOutputs a = run_reference(pr, clean, p, opt), r = run_reference(pr, dirty, p, opt);
  for (int64_t h = 0; h < pr.Hq; ++h)
    for (int64_t i = 0; i < pr.Sq; ++i) {
      bool o_finite = true, dq_finite = true, same = true;
      for (int64_t c = 0; c < pr.dv; ++c) {
        const int64_t x = (i * pr.Hq + h) * pr.dv + c;
        o_finite &= std::isfinite(r.o[x]);
        same &= r.o[x] == a.o[x];
      }
      for (int64_t c = 0; c < pr.d; ++c) {
        const int64_t x = (i * pr.Hq + h) * pr.d + c;
        dq_finite &= std::isfinite(r.dq[x]);
        same &= r.dq[x] == a.dq[x];
      }
      const double lse = r.lse[h * pr.Sq + i];
      if (i < jn) {
        EXPECT_TRUE(o_finite && dq_finite && std::isfinite(lse)) << "row " << i << " head " << h;
        EXPECT_TRUE(same) << "row " << i << " head " << h;
      } else {
        EXPECT_FALSE(o_finite) << "NaN must propagate to row " << i;
        EXPECT_TRUE(std::isnan(lse));
      }
    }
}

TEST(ReferenceExact, NaNInMaskedKeysDoesNotReachOutputs) {
  check_nan_in_masked_kv(Precision::kExact, 128);
}
TEST(ReferenceFp8, NaNInMaskedKeysDoesNotReachOutputs) {
  check_nan_in_masked_kv(Precision::kFP8, 128);
  check_nan_in_masked_kv(Precision::kFP8, 32);
}
TEST(ReferenceFp8Tile, NaNInMaskedKeysDoesNotReachOutputs) {
  check_nan_in_masked_kv(Precision::kFP8, 128, Scaling::kTile);
  check_nan_in_masked_kv(Precision::kFP8, 32, Scaling::kTile);
}

// The query-side counterpart: NaN in Q and dO of query row in_ (causal) makes
// that row's O and dQ NaN and, through its dS row, dK of the keys it sees;
// keys it does not see (j > in_) keep dK/dV bit-identical to the clean run
// (the fp8 path quantizes the Q/dO blocks of a key column from the rows that
// see it), and so do all other rows' O and dQ.
void check_nan_in_masked_queries(Precision prec, Scaling sc = Scaling::kRow) {
  Problem pr;
  pr.scaling = sc;
  pr.B = 1;
  pr.Sq = 150;
  pr.Sk = 150;
  pr.Hq = 1;
  pr.Hkv = 1;
  pr.d = 32;
  pr.dv = 16;
  pr.causal = true;
  const int64_t in_ = 40;  // inside query tile [0, 64) for block size 64
  std::mt19937 rng(75);
  const Inputs clean = random_inputs(pr, rng);
  Inputs dirty = clean;
  for (int64_t c = 0; c < pr.d; ++c) dirty.q[in_ * pr.d + c] = NAN;
  for (int64_t c = 0; c < pr.dv; ++c) dirty.dout[in_ * pr.dv + c] = NAN;
  const AttnParams p = pr.params(prec, DeltaMode::kStale, 64);
  RunOptions opt;
  opt.in_dtype = DType::kFloat32;
  opt.out_dtype = DType::kFloat32;
  const RefOutputs a = run_reference(pr, clean, p, opt), r = run_reference(pr, dirty, p, opt);
  for (int64_t i = 0; i < pr.Sq; ++i) {
    bool same = true, nan = false;
    for (int64_t c = 0; c < pr.dv; ++c) {
      same &= r.o[i * pr.dv + c] == a.o[i * pr.dv + c];
      nan |= std::isnan(r.o[i * pr.dv + c]);
    }
    for (int64_t c = 0; c < pr.d; ++c) same &= r.dq[i * pr.d + c] == a.dq[i * pr.d + c];
    if (i == in_)
      EXPECT_TRUE(nan);
    else
      EXPECT_TRUE(same) << "query row " << i;
  }
  for (int64_t j = 0; j < pr.Sk; ++j) {
    bool same = true, dk_nan = false;
    for (int64_t c = 0; c < pr.d; ++c) {
      same &= r.dk[j * pr.d + c] == a.dk[j * pr.d + c];
      dk_nan |= std::isnan(r.dk[j * pr.d + c]);
    }
    for (int64_t c = 0; c < pr.dv; ++c) same &= r.dv[j * pr.dv + c] == a.dv[j * pr.dv + c];
    if (j <= in_)
      EXPECT_TRUE(dk_nan) << "key " << j << " is seen by the NaN row";
    else
      EXPECT_TRUE(same) << "key " << j;
  }
}

TEST(ReferenceExact, NaNInMaskedQueriesDoesNotReachOtherKeys) {
  check_nan_in_masked_queries(Precision::kExact);
}
TEST(ReferenceFp8, NaNInMaskedQueriesDoesNotReachOtherKeys) {
  check_nan_in_masked_queries(Precision::kFP8);
}
TEST(ReferenceFp8Tile, NaNInMaskedQueriesDoesNotReachOtherKeys) {
  check_nan_in_masked_queries(Precision::kFP8, Scaling::kTile);
}

// NaN in memory outside the sequences (padding past seqlen, gaps between
// heads) is never read: results equal the unpadded run bit for bit.
TEST(Reference, PaddingOutsideSequencesIsNeverRead) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 40;
  pr.Sk = 70;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 16;
  pr.dv = 24;
  pr.causal = true;
  std::mt19937 rng(81);
  const Inputs in = random_inputs(pr, rng);
  for (const Recipe rc : kAllRecipes) {
    const Precision prec = rc.prec;
    pr.scaling = rc.scaling;
    RunOptions opt;
    opt.in_dtype = DType::kFloat32;
    opt.out_dtype = DType::kFloat32;
    const RefOutputs a = run_reference(pr, in, pr.params(prec), opt);
    opt.pad_seq = 9;
    opt.pad_head = 3;
    opt.pad_value = NAN;
    const RefOutputs b = run_reference(pr, in, pr.params(prec), opt);
    EXPECT_TRUE(all_finite(b.o) && all_finite(b.dq) && all_finite(b.dk) && all_finite(b.dv));
    EXPECT_TRUE(bitwise_equal(a.o, b.o));
    EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
    EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
    EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
  }
}

// ---- dtypes, layouts, threads ---------------------------------------------

// BF16 inputs give the same numbers as FP32 inputs holding the same values;
// a BF16 output is the RNE rounding of the FP32/FP64 output.
TEST(Reference, Bf16AndFp32ViewsAgree) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 50;
  pr.Sk = 64;
  pr.Hq = 2;
  pr.Hkv = 1;
  pr.d = 32;
  pr.dv = 16;
  pr.causal = true;
  std::mt19937 rng(91);
  const Inputs in = random_inputs(pr, rng, true);
  for (const Recipe rc : kAllRecipes) {
    const Precision prec = rc.prec;
    pr.scaling = rc.scaling;
    RunOptions f;
    // Exact path: FP64 outputs are the unrounded result; fp8 path: FP32 outputs.
    f.in_dtype = DType::kFloat32;
    f.out_dtype = prec == Precision::kExact ? DType::kFloat64 : DType::kFloat32;
    RunOptions h;
    h.in_dtype = DType::kBFloat16;
    h.out_dtype = DType::kBFloat16;
    const RefOutputs a = run_reference(pr, in, pr.params(prec), f);
    RunOptions h2 = h;
    h2.out_dtype = f.out_dtype;
    const RefOutputs b2 = run_reference(pr, in, pr.params(prec), h2);
    // Same inputs, same unrounded outputs.
    EXPECT_TRUE(bitwise_equal(a.o, b2.o));
    EXPECT_TRUE(bitwise_equal(a.dq, b2.dq));
    EXPECT_TRUE(bitwise_equal(a.dk, b2.dk));
    EXPECT_TRUE(bitwise_equal(a.dv, b2.dv));
    // BF16 outputs = RNE of the unrounded ones. (The backward of run h reads
    // the BF16 O; only the stale/matched_do deltas use it, so with the default
    // delta_matching its gradients are those of run f, rounded.)
    const RefOutputs b = run_reference(pr, in, pr.params(prec), h);
    auto rounded = [](std::vector<double> x) {
      for (double& e : x) e = round_to_bf16(e);
      return x;
    };
    EXPECT_TRUE(bitwise_equal(b.o, rounded(a.o)));
    EXPECT_TRUE(bitwise_equal(b.dq, rounded(a.dq)));
    EXPECT_TRUE(bitwise_equal(b.dk, rounded(a.dk)));
    EXPECT_TRUE(bitwise_equal(b.dv, rounded(a.dv)));
  }
}

// [B, S, H, D] and [B, H, S, D] views (and padded ones) give identical results.
TEST(Reference, StridedLayoutsGiveIdenticalResults) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 33;
  pr.Sk = 47;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 16;
  pr.dv = 8;
  pr.causal = true;
  std::mt19937 rng(101);
  const Inputs in = random_inputs(pr, rng);
  for (const Recipe rc : kAllRecipes) {
    const Precision prec = rc.prec;
    pr.scaling = rc.scaling;
    RunOptions a_opt;
    a_opt.in_dtype = a_opt.out_dtype = DType::kBFloat16;
    RunOptions b_opt = a_opt;
    b_opt.layout = Layout::kBHSD;
    const RefOutputs a = run_reference(pr, in, pr.params(prec), a_opt);
    const RefOutputs b = run_reference(pr, in, pr.params(prec), b_opt);
    EXPECT_TRUE(bitwise_equal(a.o, b.o));
    EXPECT_TRUE(bitwise_equal(a.lse, b.lse));
    EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
    EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
    EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
  }
}

// Results do not depend on the number of threads.
TEST(Reference, ThreadCountDoesNotChangeResults) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 70;
  pr.Sk = 90;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 16;
  pr.dv = 16;
  pr.causal = true;
  std::mt19937 rng(111);
  const Inputs in = random_inputs(pr, rng);
  for (const Recipe rc : kAllRecipes) {
    const Precision prec = rc.prec;
    pr.scaling = rc.scaling;
    const RefOutputs a =
        run_reference(pr, in, pr.params(prec, DeltaMode::kStale, 64, Fp8Format::kE4M3, 1));
    for (int t : {2, 5}) {
      const RefOutputs b =
          run_reference(pr, in, pr.params(prec, DeltaMode::kStale, 64, Fp8Format::kE4M3, t));
      EXPECT_TRUE(bitwise_equal(a.o, b.o));
      EXPECT_TRUE(bitwise_equal(a.dq, b.dq));
      EXPECT_TRUE(bitwise_equal(a.dk, b.dk));
      EXPECT_TRUE(bitwise_equal(a.dv, b.dv));
      EXPECT_EQ(a.rowsum_post, b.rowsum_post);
    }
  }
}

}  // namespace
}  // namespace fp8attn
