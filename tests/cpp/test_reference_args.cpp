// Tests of the CPU reference's argument checking: every bad argument throws
// ArgumentError whose message names the argument.
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

AttnParams exact_params(const Problem& pr) { return pr.params(Precision::kExact); }

// ---- Argument errors name the argument -------------------------------------

TEST(ReferenceArgs, BadParametersThrowNamingTheArgument) {
  Problem pr;
  const AttnParams good = exact_params(pr);
  EXPECT_NO_THROW(check_attention_params(good));
  auto with = [&](auto mutate) {
    AttnParams p = good;
    mutate(p);
    return [p]() { check_attention_params(p); };
  };
  expect_argument_error(with([](AttnParams& p) { p.head_dim_qk = 0; }), "head_dim_qk");
  expect_argument_error(with([](AttnParams& p) { p.head_dim_qk = 257; }), "head_dim_qk");
  expect_argument_error(with([](AttnParams& p) { p.head_dim_v = 0; }), "head_dim_v");
  expect_argument_error(with([](AttnParams& p) { p.head_dim_v = 300; }), "head_dim_v");
  expect_argument_error(with([](AttnParams& p) {
                          p.num_heads_q = 6;
                          p.num_heads_kv = 4;
                        }),
                        "num_heads_q");
  expect_argument_error(with([](AttnParams& p) { p.num_heads_kv = 0; }), "num_heads_kv");
  expect_argument_error(with([](AttnParams& p) { p.delta_mode = static_cast<DeltaMode>(7); }),
                        "delta_mode");
  expect_argument_error(with([](AttnParams& p) { p.precision = static_cast<Precision>(-1); }),
                        "precision");
  expect_argument_error(with([](AttnParams& p) { p.grad_format = static_cast<Fp8Format>(2); }),
                        "grad_format");
  for (int bs : {0, 16, 96, 256})
    expect_argument_error(with([bs](AttnParams& p) { p.block_size = bs; }), "block_size");
  for (float s : {0.f, -1.f, NAN, INFINITY})
    expect_argument_error(with([s](AttnParams& p) { p.softmax_scale = s; }), "softmax_scale");
  expect_argument_error(with([](AttnParams& p) { p.seqlen_q = -1; }), "seqlen_q");
  expect_argument_error(with([](AttnParams& p) { p.batch = -2; }), "batch");
  expect_argument_error(with([](AttnParams& p) { p.num_threads = -1; }), "num_threads");
  expect_argument_error(with([](AttnParams& p) { p.scaling = static_cast<Scaling>(2); }),
                        "scaling");
  EXPECT_NO_THROW(with([](AttnParams& p) { p.scaling = Scaling::kTile; })());
}

TEST(ReferenceArgs, ShapeMismatchThrowsNamingTheArgument) {
  Problem pr;
  pr.B = 2;
  pr.Sq = 8;
  pr.Sk = 12;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 64;
  pr.dv = 32;
  const AttnParams p = exact_params(pr);
  const int64_t q[4] = {2, 8, 4, 64}, k[4] = {2, 12, 2, 64}, v[4] = {2, 12, 2, 32},
                o[4] = {2, 8, 4, 32};
  EXPECT_NO_THROW(check_attention_shapes(p, q, k, v, o, o, q, k, v));
  const int64_t k_bad_d[4] = {2, 12, 2, 48};  // head_dim of k != head_dim of q
  expect_argument_error([&] { check_attention_shapes(p, q, k_bad_d, v); }, "k");
  const int64_t v_bad_s[4] = {2, 11, 2, 32};
  expect_argument_error([&] { check_attention_shapes(p, q, k, v_bad_s); }, "v");
  const int64_t dv_bad[4] = {2, 12, 2, 64};
  expect_argument_error([&] { check_attention_shapes(p, q, k, v, o, o, q, k, dv_bad); }, "dv");
  const int64_t o_bad_b[4] = {1, 8, 4, 32};
  expect_argument_error([&] { check_attention_shapes(p, q, k, v, o_bad_b); }, "o");
}

TEST(ReferenceArgs, EntryPointsValidateParamsAndPointers) {
  Problem pr;
  HostTensor q(1, 8, 2, 16), k(1, 8, 2, 16), v(1, 8, 2, 16), o(1, 8, 2, 16);
  std::vector<float> lse(16);
  AttnParams p = exact_params(pr);
  p.block_size = 48;
  expect_argument_error(
      [&] { attention_forward_ref(p, q.view(), k.view(), v.view(), o.view(), lse.data()); },
      "block_size");
  p = exact_params(pr);
  expect_argument_error(
      [&] { attention_forward_ref(p, q.view(), k.view(), v.view(), o.view(), nullptr); }, "lse");
  TensorView null_k = k.view();
  null_k.data = nullptr;
  expect_argument_error(
      [&] { attention_forward_ref(p, q.view(), null_k, v.view(), o.view(), lse.data()); }, "k");
  TensorView bad_dtype = v.view();
  bad_dtype.dtype = static_cast<DType>(9);
  expect_argument_error(
      [&] { attention_forward_ref(p, q.view(), k.view(), bad_dtype, o.view(), lse.data()); }, "v");
  TensorView null_dq = q.view();
  null_dq.data = nullptr;
  p.delta_mode = static_cast<DeltaMode>(3);
  expect_argument_error(
      [&] {
        attention_backward_ref(p, q.view(), k.view(), v.view(), o.view(), o.view(), lse.data(),
                               q.view(), k.view(), v.view(), nullptr);
      },
      "delta_mode");
  p = exact_params(pr);
  expect_argument_error(
      [&] {
        attention_backward_ref(p, q.view(), k.view(), v.view(), o.view(), o.view(), lse.data(),
                               null_dq, k.view(), v.view(), nullptr);
      },
      "dq");
}

}  // namespace
}  // namespace fp8attn
