// Tests of the reference's sharded-key backward (context parallelism, numerics.md
// section 11): attention_dm_sums_ref (the pre-pass partial sums of one key shard)
// and attention_backward_ref with p.sharded->delta (a given delta, lse as given).
//   - one shard holding every key reproduces the unsharded Delta-Matching
//     backward bit for bit (same sums, same order, same LSE'), both recipes;
//   - two key shards: the partial sums add up to the unsharded ones (FP32
//     reduction order only), each shard's dK/dV rows and the summed dQ are the
//     unsharded gradients up to that rounding; a shard-local delta is not;
//   - what the sharded path refuses, named.
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

struct ShardRun {
  Problem pr;
  HostTensor q, k, v, o, dout;
  std::vector<float> lse;
};

ShardRun make_run(bool causal, Scaling scaling, int64_t Sk = 256, uint32_t seed = 11) {
  ShardRun r;
  r.pr.B = 1;
  r.pr.Sq = Sk;
  r.pr.Sk = Sk;
  r.pr.Hq = 4;
  r.pr.Hkv = 2;
  r.pr.d = 32;
  r.pr.dv = 32;
  r.pr.causal = causal;
  r.pr.scaling = scaling;
  std::mt19937 rng(seed);
  const Inputs in = random_inputs(r.pr, rng);
  auto make = [&](int64_t S, int64_t H, int64_t D, const std::vector<double>* x) {
    HostTensor t(r.pr.B, S, H, D, DType::kFloat32);
    if (x) t.set_values(*x);
    return t;
  };
  r.q = make(Sk, r.pr.Hq, r.pr.d, &in.q);
  r.k = make(Sk, r.pr.Hkv, r.pr.d, &in.k);
  r.v = make(Sk, r.pr.Hkv, r.pr.dv, &in.v);
  r.dout = make(Sk, r.pr.Hq, r.pr.dv, &in.dout);
  r.o = make(Sk, r.pr.Hq, r.pr.dv, nullptr);
  r.lse.assign(r.pr.B * r.pr.Hq * r.pr.Sq, 0.f);
  attention_forward_ref(r.pr.params(Precision::kFP8), r.q.view(), r.k.view(), r.v.view(), r.o.view(),
                        r.lse.data());
  return r;
}

// Keys [j0, j0 + n) of a [B, S, H, D] float32 tensor as a view.
TensorView key_slice(HostTensor& t, int64_t j0) {
  TensorView v = t.view();
  v.data = static_cast<float*>(v.data) + j0 * v.stride_seq;
  return v;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

Grads backward(ShardRun& r, const AttnParams& p, const TensorView& k, const TensorView& v, int64_t Sk,
               const float* lse) {
  HostTensor dq(r.pr.B, r.pr.Sq, r.pr.Hq, r.pr.d, DType::kFloat32), dk(r.pr.B, Sk, r.pr.Hkv, r.pr.d, DType::kFloat32),
      dv(r.pr.B, Sk, r.pr.Hkv, r.pr.dv, DType::kFloat32);
  attention_backward_ref(p, r.q.view(), k, v, r.o.view(), r.dout.view(), lse, dq.view(), dk.view(), dv.view(),
                         nullptr);
  return {dq.values(), dk.values(), dv.values()};
}

double rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

class ShardedOneShard : public ::testing::TestWithParam<std::tuple<bool, Scaling>> {};

TEST_P(ShardedOneShard, ReproducesTheUnshardedDeltaMatchingBackward) {
  const auto [causal, scaling] = GetParam();
  ShardRun r = make_run(causal, scaling, 300);
  const AttnParams p = r.pr.params(Precision::kFP8);
  const Grads ref = backward(r, p, r.k.view(), r.v.view(), r.pr.Sk, r.lse.data());
  const size_t n = r.lse.size();
  std::vector<float> pdp(n), psum(n), delta(n), lse_b(n);
  attention_dm_sums_ref(p, r.q.view(), r.k.view(), r.v.view(), r.dout.view(), r.lse.data(), pdp.data(), psum.data());
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(psum[i], 1.f, 1e-5f);  // l = sum_j P_ij with the reference's own LSE
    delta[i] = psum[i] > 0.f ? pdp[i] / psum[i] : pdp[i];
    lse_b[i] = psum[i] > 0.f ? r.lse[i] + std::log(psum[i]) : r.lse[i];
  }
  ShardedDelta sd;
  sd.delta = delta.data();
  AttnParams ps = p;
  ps.sharded = &sd;
  const Grads got = backward(r, ps, r.k.view(), r.v.view(), r.pr.Sk, lse_b.data());
  EXPECT_EQ(got.dq, ref.dq);
  EXPECT_EQ(got.dk, ref.dk);
  EXPECT_EQ(got.dv, ref.dv);
}

INSTANTIATE_TEST_SUITE_P(Recipes, ShardedOneShard,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(Scaling::kRow, Scaling::kTile)));

TEST(ShardedKeys, TwoShardsAddUpToTheUnshardedBackward) {
  ShardRun r = make_run(false, Scaling::kRow, 256);
  const AttnParams p = r.pr.params(Precision::kFP8);
  const Grads ref = backward(r, p, r.k.view(), r.v.view(), 256, r.lse.data());
  const size_t n = r.lse.size();
  std::vector<float> all_pdp(n), all_psum(n);
  attention_dm_sums_ref(p, r.q.view(), r.k.view(), r.v.view(), r.dout.view(), r.lse.data(), all_pdp.data(),
                        all_psum.data());
  AttnParams half = p;
  half.seqlen_k = 128;
  std::vector<float> pdp(n, 0.f), psum(n, 0.f), a(n), b(n), local_delta[2];
  for (int s = 0; s < 2; ++s) {
    attention_dm_sums_ref(half, r.q.view(), key_slice(r.k, 128 * s), key_slice(r.v, 128 * s), r.dout.view(),
                          r.lse.data(), a.data(), b.data());
    local_delta[s].resize(n);
    for (size_t i = 0; i < n; ++i) {
      pdp[i] += a[i];
      psum[i] += b[i];
      local_delta[s][i] = a[i] / b[i];
    }
  }
  std::vector<float> delta(n), lse_b(n);
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(psum[i], all_psum[i], 2e-6f);
    EXPECT_NEAR(pdp[i], all_pdp[i], 1e-5f * (std::fabs(all_pdp[i]) + 1.f));
    delta[i] = pdp[i] / psum[i];
    lse_b[i] = r.lse[i] + std::log(psum[i]);
  }
  auto run_shards = [&](const std::vector<float>* deltas) {
    Grads g;
    g.dq.assign(ref.dq.size(), 0.0);
    for (int s = 0; s < 2; ++s) {
      ShardedDelta sd;
      sd.delta = deltas[s].data();
      AttnParams ps = half;
      ps.sharded = &sd;
      const Grads part = backward(r, ps, key_slice(r.k, 128 * s), key_slice(r.v, 128 * s), 128, lse_b.data());
      for (size_t i = 0; i < g.dq.size(); ++i) g.dq[i] += part.dq[i];
      g.dk.insert(g.dk.end(), part.dk.begin(), part.dk.end());  // B = 1: shard rows in key order
      g.dv.insert(g.dv.end(), part.dv.begin(), part.dv.end());
    }
    return g;
  };
  const std::vector<float> global[2] = {delta, delta};
  const Grads got = run_shards(global);
  // FP32 reduction order only (a dS code at an FP8 rounding boundary may flip).
  EXPECT_LT(rel_diff(got.dq, ref.dq), 2e-3);
  EXPECT_LT(rel_diff(got.dk, ref.dk), 2e-3);
  EXPECT_LT(rel_diff(got.dv, ref.dv), 2e-3);  // dV reads P' only (LSE' to FP32 rounding)
  // The failure the global delta guards against: each shard's own delta.
  const Grads local = run_shards(local_delta);
  EXPECT_GT(rel_diff(local.dq, ref.dq), 50 * rel_diff(got.dq, ref.dq) + 1e-2);
  EXPECT_GT(rel_diff(local.dk, ref.dk), 50 * rel_diff(got.dk, ref.dk) + 1e-2);
}

TEST(ShardedKeys, RefusesWhatItDoesNotDefine) {
  ShardRun r = make_run(true, Scaling::kRow, 64);
  std::vector<float> delta(r.lse.size(), 0.f), buf(r.lse.size());
  ShardedDelta sd;
  sd.delta = delta.data();
  auto bwd_with = [&](AttnParams p, const BackwardDiagnostics* diag) {
    return [&, p, diag]() {
      HostTensor dq(1, 64, 4, 32, DType::kFloat32), dk(1, 64, 2, 32, DType::kFloat32), dv(1, 64, 2, 32, DType::kFloat32);
      attention_backward_ref(p, r.q.view(), r.k.view(), r.v.view(), r.o.view(), r.dout.view(), r.lse.data(),
                             dq.view(), dk.view(), dv.view(), diag);
    };
  };
  AttnParams p = r.pr.params(Precision::kFP8);
  p.sharded = &sd;
  AttnParams stale = p;
  stale.delta_mode = DeltaMode::kStale;
  expect_argument_error(bwd_with(stale, nullptr), "delta_mode");
  AttnParams exact = p;
  exact.precision = Precision::kExact;
  expect_argument_error(bwd_with(exact, nullptr), "precision");
  AttnParams rot = p;
  rot.qk_rotation = QkRotation::kHadamard;
  expect_argument_error(bwd_with(rot, nullptr), "qk_rotation");
  BackwardDiagnostics diag;
  diag.delta = buf.data();
  expect_argument_error(bwd_with(p, &diag), "diagnostics");
  AttnParams ex2 = r.pr.params(Precision::kExact);
  expect_argument_error(
      [&]() {
        attention_dm_sums_ref(ex2, r.q.view(), r.k.view(), r.v.view(), r.dout.view(), r.lse.data(), buf.data(),
                              buf.data());
      },
      "precision");
}

}  // namespace
}  // namespace fp8attn
