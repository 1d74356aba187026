// fp8attn test helpers shared by the C++ reference tests: host tensors in any
// dtype/layout, BF16 rounding written independently of the library, a naive
// FP64 attention (numerics.md section 1, written from the formulas with no
// tiling), a one-call runner for the CPU reference, the FP8 error budget, the
// Delta-Matching row-sum residuals, and what the literal emulations of the FP8
// recipes share (the comparison, the sliding-window cases).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <string>

#include "common/error.h"
#include "common/params.h"
#include "reference/attention_ref.h"

namespace fp8attn {
namespace testutil {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- BF16 (independent of the library's converter) -----------------------

inline double bf16_bits_to_double(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Nearest BF16 to x (ties to even mantissa), by comparing the two BF16
// neighbours of x in FP64. Finite x within the BF16 range only.
inline uint16_t double_to_bf16_bits(double x) {
  if (std::isnan(x)) return 0x7FC0;
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // Truncation toward zero of f to BF16, then the next BF16 away from zero.
  uint16_t lo = static_cast<uint16_t>(u >> 16);
  // If f rounded past x in magnitude, the truncation of f may be above |x|:
  // step down one BF16 if so.
  if (std::fabs(bf16_bits_to_double(lo)) > std::fabs(x)) lo = static_cast<uint16_t>(lo - 1);
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double dlo = std::fabs(x - bf16_bits_to_double(lo));
  const double dhi = std::fabs(bf16_bits_to_double(hi) - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) ? hi : lo;
}

inline double round_to_bf16(double x) { return bf16_bits_to_double(double_to_bf16_bits(x)); }

// ---- Host tensors ---------------------------------------------------------

enum class Layout { kBSHD, kBHSD };

// A logical [B, S, H, D] tensor stored in `dtype` with layout BSHD or BHSD.
// pad_seq extra sequence positions (past S) and a gap of pad_head elements
// after each head row are allocated and filled with pad_value: memory that the
// reference must never read.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(int64_t B, int64_t S, int64_t H, int64_t D, DType dtype = DType::kFloat64,
             Layout layout = Layout::kBSHD, int64_t pad_seq = 0, int64_t pad_head = 0,
             double pad_value = 0.0)
      : B_(B), S_(S), H_(H), D_(D), dtype_(dtype) {
    const int64_t Sa = S + pad_seq, Dr = D + pad_head;  // allocated seq / row pitch
    if (layout == Layout::kBSHD) {
      sh_ = Dr;
      ss_ = H * Dr;
      sb_ = Sa * H * Dr;
    } else {
      ss_ = Dr;
      sh_ = Sa * Dr;
      sb_ = H * Sa * Dr;
    }
    const int64_t n = std::max<int64_t>(B * sb_, 1);
    switch (dtype_) {
      case DType::kFloat32:
        f32_.assign(n, static_cast<float>(pad_value));
        break;
      case DType::kFloat64:
        f64_.assign(n, pad_value);
        break;
      case DType::kBFloat16:
        bf16_.assign(n, double_to_bf16_bits(pad_value));
        break;
    }
  }

  int64_t numel() const { return B_ * S_ * H_ * D_; }
  DType dtype() const { return dtype_; }

  TensorView view() {
    TensorView t;
    t.dtype = dtype_;
    t.data = dtype_ == DType::kFloat32   ? static_cast<void*>(f32_.data())
             : dtype_ == DType::kFloat64 ? static_cast<void*>(f64_.data())
                                         : static_cast<void*>(bf16_.data());
    t.stride_batch = sb_;
    t.stride_seq = ss_;
    t.stride_head = sh_;
    return t;
  }

  double get(int64_t b, int64_t s, int64_t h, int64_t c) const {
    const int64_t i = b * sb_ + s * ss_ + h * sh_ + c;
    switch (dtype_) {
      case DType::kFloat32:
        return f32_[i];
      case DType::kFloat64:
        return f64_[i];
      default:
        return bf16_bits_to_double(bf16_[i]);
    }
  }
  // Stores x rounded to the dtype (FP32: RNE cast; BF16: RNE).
  void set(int64_t b, int64_t s, int64_t h, int64_t c, double x) {
    const int64_t i = b * sb_ + s * ss_ + h * sh_ + c;
    switch (dtype_) {
      case DType::kFloat32:
        f32_[i] = static_cast<float>(x);
        break;
      case DType::kFloat64:
        f64_[i] = x;
        break;
      default:
        bf16_[i] = double_to_bf16_bits(x);
        break;
    }
  }

  // Logical contents, index ((b * S + s) * H + h) * D + c.
  std::vector<double> values() const {
    std::vector<double> out(static_cast<size_t>(numel()));
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t s = 0; s < S_; ++s)
        for (int64_t h = 0; h < H_; ++h)
          for (int64_t c = 0; c < D_; ++c) out[idx(b, s, h, c)] = get(b, s, h, c);
    return out;
  }
  void set_values(const std::vector<double>& x) {
    for (int64_t b = 0; b < B_; ++b)
      for (int64_t s = 0; s < S_; ++s)
        for (int64_t h = 0; h < H_; ++h)
          for (int64_t c = 0; c < D_; ++c) set(b, s, h, c, x[idx(b, s, h, c)]);
  }
  int64_t idx(int64_t b, int64_t s, int64_t h, int64_t c) const {
    return ((b * S_ + s) * H_ + h) * D_ + c;
  }

 private:
  int64_t B_ = 0, S_ = 0, H_ = 0, D_ = 0, sb_ = 0, ss_ = 0, sh_ = 0;
  DType dtype_ = DType::kFloat64;
  std::vector<float> f32_;
  std::vector<double> f64_;
  std::vector<uint16_t> bf16_;
};

// Fresh standard-normal values, already rounded to BF16 when `bf16_exact`
// (so FP32/FP64/BF16 views of them hold the same numbers).
inline std::vector<double> random_normal(int64_t n, std::mt19937& rng, bool bf16_exact = false,
                                         double scale = 1.0) {
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> x(static_cast<size_t>(n));
  for (auto& e : x) e = bf16_exact ? round_to_bf16(nd(rng)) : nd(rng);
  return x;
}

// ---- Problem + naive FP64 attention --------------------------------------

struct Problem {
  int64_t B = 1, Sq = 8, Sk = 8, Hq = 2, Hkv = 2, d = 16, dv = 16;
  bool causal = false;
  // Sliding window (numerics.md section 14): -1 = unbounded; causal forces right = 0.
  int64_t window_left = -1, window_right = -1;
  double scale = 0.0;  // 0 = 1/sqrt(d)
  Scaling scaling = Scaling::kRow;  // FP8 recipe (numerics.md section 9)
  // softmax_scale as the reference receives it (AttnParams holds an FP32).
  double tau() const {
    return static_cast<float>(scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)));
  }

  AttnParams params(Precision prec, DeltaMode mode = DeltaMode::kDeltaMatching,
                    int block_size = 128, Fp8Format grad_format = Fp8Format::kE4M3,
                    int num_threads = 0) const {
    AttnParams p;
    p.batch = B;
    p.seqlen_q = Sq;
    p.seqlen_k = Sk;
    p.num_heads_q = Hq;
    p.num_heads_kv = Hkv;
    p.head_dim_qk = d;
    p.head_dim_v = dv;
    p.softmax_scale = static_cast<float>(tau());
    p.causal = causal;
    p.window_left = window_left;
    p.window_right = window_right;
    p.precision = prec;
    p.delta_mode = mode;
    p.block_size = block_size;
    p.grad_format = grad_format;
    p.num_threads = num_threads;
    p.scaling = scaling;
    return p;
  }
  // The mask, straight from its definition (bottom-right: the diagonal of row i is key
  // i + Sk - Sq); written independently of the library's normalization.
  bool sees(int64_t i, int64_t j) const {
    const int64_t diag = i + (Sk - Sq);
    const int64_t right = causal ? 0 : window_right;
    if (right >= 0 && j > diag + right) return false;
    if (window_left >= 0 && j < diag - window_left) return false;
    return true;
  }
};

// Inputs in logical order: q [B,Sq,Hq,d], k [B,Sk,Hkv,d], v [B,Sk,Hkv,dv], dout [B,Sq,Hq,dv].
struct Inputs {
  std::vector<double> q, k, v, dout;
};

inline Inputs random_inputs(const Problem& pr, std::mt19937& rng, bool bf16_exact = true) {
  Inputs in;
  in.q = random_normal(pr.B * pr.Sq * pr.Hq * pr.d, rng, bf16_exact);
  in.k = random_normal(pr.B * pr.Sk * pr.Hkv * pr.d, rng, bf16_exact);
  in.v = random_normal(pr.B * pr.Sk * pr.Hkv * pr.dv, rng, bf16_exact);
  in.dout = random_normal(pr.B * pr.Sq * pr.Hq * pr.dv, rng, bf16_exact);
  return in;
}

// Outputs in logical order; lse/delta [B, Hq, Sq].
struct Outputs {
  std::vector<double> o, dq, dk, dv, lse, delta;
};

// Naive FP64 attention straight from numerics.md section 1: per (b, h, i)
// explicit masked softmax, then dV = P^T dO, dP = dO V^T, delta = sum P dP,
// dS = P (dP - delta), dQ = tau dS K, dK = tau dS^T Q (GQA: summed per group).
inline Outputs naive_attention(const Problem& pr, const Inputs& in) {
  const int64_t B = pr.B, Sq = pr.Sq, Sk = pr.Sk, Hq = pr.Hq, Hkv = pr.Hkv, d = pr.d, dv = pr.dv,
                G = Hq / Hkv;
  const double tau = pr.tau();
  auto qi = [&](int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * Sq + s) * Hq + h) * d + c;
  };
  auto ki = [&](int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * Sk + s) * Hkv + h) * d + c;
  };
  auto vi = [&](int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * Sk + s) * Hkv + h) * dv + c;
  };
  auto oi = [&](int64_t b, int64_t s, int64_t h, int64_t c) {
    return ((b * Sq + s) * Hq + h) * dv + c;
  };
  Outputs out;
  out.o.assign(B * Sq * Hq * dv, 0.0);
  out.dq.assign(B * Sq * Hq * d, 0.0);
  out.dk.assign(B * Sk * Hkv * d, 0.0);
  out.dv.assign(B * Sk * Hkv * dv, 0.0);
  out.lse.assign(B * Hq * Sq, -kInf);
  out.delta.assign(B * Hq * Sq, 0.0);
  std::vector<double> S(Sk), P(Sk), dP(Sk);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / G;
      for (int64_t i = 0; i < Sq; ++i) {
        double m = -kInf;
        bool any = false;
        for (int64_t j = 0; j < Sk; ++j) {
          if (!pr.sees(i, j)) continue;
          double s = 0;
          for (int64_t c = 0; c < d; ++c) s += in.q[qi(b, i, h, c)] * in.k[ki(b, j, hk, c)];
          S[j] = tau * s;
          m = std::max(m, S[j]);
          any = true;
        }
        if (!any) continue;  // O = 0, LSE = -inf, zero gradients
        double l = 0;
        for (int64_t j = 0; j < Sk; ++j)
          if (pr.sees(i, j)) l += std::exp(S[j] - m);
        out.lse[(b * Hq + h) * Sq + i] = m + std::log(l);
        double delta = 0;
        for (int64_t j = 0; j < Sk; ++j) {
          P[j] = pr.sees(i, j) ? std::exp(S[j] - m) / l : 0.0;
          dP[j] = 0;
          for (int64_t c = 0; c < dv; ++c) {
            out.o[oi(b, i, h, c)] += P[j] * in.v[vi(b, j, hk, c)];
            dP[j] += in.dout[oi(b, i, h, c)] * in.v[vi(b, j, hk, c)];
          }
          delta += P[j] * dP[j];
        }
        out.delta[(b * Hq + h) * Sq + i] = delta;
        for (int64_t j = 0; j < Sk; ++j) {
          const double ds = P[j] * (dP[j] - delta);
          for (int64_t c = 0; c < d; ++c) {
            out.dq[qi(b, i, h, c)] += tau * ds * in.k[ki(b, j, hk, c)];
            out.dk[ki(b, j, hk, c)] += tau * ds * in.q[qi(b, i, h, c)];
          }
          for (int64_t c = 0; c < dv; ++c)
            out.dv[vi(b, j, hk, c)] += P[j] * in.dout[oi(b, i, h, c)];
        }
      }
    }
  return out;
}

// ---- Running the reference ----------------------------------------------

struct RunOptions {
  DType in_dtype = DType::kFloat64;
  DType out_dtype = DType::kFloat64;
  Layout layout = Layout::kBSHD;
  int64_t pad_seq = 0, pad_head = 0;
  double pad_value = 0.0;
  bool backward = true;
};

// Reference outputs plus the diagnostics, logical order.
struct RefOutputs : Outputs {
  std::vector<float> lse_f, diag_delta, diag_eps, rowsum_pre, rowsum_post;
};

// Runs attention_forward_ref (and attention_backward_ref when opt.backward,
// feeding it the forward's O and LSE) on tensors built from `in`.
inline RefOutputs run_reference(const Problem& pr, const Inputs& in, const AttnParams& p,
                                const RunOptions& opt = RunOptions()) {
  auto make = [&](int64_t S, int64_t H, int64_t D, DType dt) {
    return HostTensor(pr.B, S, H, D, dt, opt.layout, opt.pad_seq, opt.pad_head, opt.pad_value);
  };
  HostTensor q = make(pr.Sq, pr.Hq, pr.d, opt.in_dtype),
             k = make(pr.Sk, pr.Hkv, pr.d, opt.in_dtype),
             v = make(pr.Sk, pr.Hkv, pr.dv, opt.in_dtype),
             dout = make(pr.Sq, pr.Hq, pr.dv, opt.in_dtype),
             o = make(pr.Sq, pr.Hq, pr.dv, opt.out_dtype),
             dq = make(pr.Sq, pr.Hq, pr.d, opt.out_dtype),
             dk = make(pr.Sk, pr.Hkv, pr.d, opt.out_dtype),
             dv = make(pr.Sk, pr.Hkv, pr.dv, opt.out_dtype);
  q.set_values(in.q);
  k.set_values(in.k);
  v.set_values(in.v);
  dout.set_values(in.dout);
  RefOutputs r;
  const int64_t nrow = pr.B * pr.Hq * pr.Sq;
  r.lse_f.assign(std::max<int64_t>(nrow, 1), 0.f);
  attention_forward_ref(p, q.view(), k.view(), v.view(), o.view(), r.lse_f.data());
  r.o = o.values();
  r.lse.assign(r.lse_f.begin(), r.lse_f.begin() + nrow);
  if (opt.backward) {
    r.diag_delta.assign(std::max<int64_t>(nrow, 1), 0.f);
    r.diag_eps = r.rowsum_pre = r.rowsum_post = r.diag_delta;
    BackwardDiagnostics diag;
    diag.delta = r.diag_delta.data();
    diag.eps = r.diag_eps.data();
    diag.rowsum_pre = r.rowsum_pre.data();
    diag.rowsum_post = r.rowsum_post.data();
    attention_backward_ref(p, q.view(), k.view(), v.view(), o.view(), dout.view(), r.lse_f.data(),
                           dq.view(), dk.view(), dv.view(), &diag);
    r.dq = dq.values();
    r.dk = dk.values();
    r.dv = dv.values();
    r.diag_delta.resize(nrow);
    r.diag_eps.resize(nrow);
    r.rowsum_pre.resize(nrow);
    r.rowsum_post.resize(nrow);
    r.delta.assign(r.diag_delta.begin(), r.diag_delta.end());
  }
  return r;
}

// run_reference on BF16 inputs (as at the op boundary), outputs in out_dtype.
inline RefOutputs run_bf16(const Problem& pr, const Inputs& in, const AttnParams& p,
                           DType out_dtype) {
  RunOptions opt;
  opt.in_dtype = DType::kBFloat16;
  opt.out_dtype = out_dtype;
  return run_reference(pr, in, p, opt);
}

// ---- Metrics --------------------------------------------------------------

inline double frobenius(const std::vector<double>& a) {
  double s = 0;
  for (double x : a) s += x * x;
  return std::sqrt(s);
}

// ||a - b|| / ||b|| (NaN if any NaN appears, so it can never pass a bound).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(a[i] - b[i]);
    if (!(e <= m)) m = e;  // NaN sticks
  }
  return m;
}

inline double mean(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += v;
  return s / static_cast<double>(x.size());
}

inline bool all_finite(const std::vector<double>& a) {
  for (double x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

inline bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  return std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// Multiplies each element by 2^k, k uniform in [-spread, spread]: blocks then
// span many binades, so a block's scale decides which elements fall into the
// FP8 subnormal range. (Power-of-two scales leave the rounding of normal FP8
// values unchanged, so only such data tells a block quantized from the visible
// entries from one quantized over the whole tile.)
inline void spread_binades(std::vector<double>& x, int spread, std::mt19937& rng) {
  std::uniform_int_distribution<int> k(-spread, spread);
  for (double& e : x) e = std::ldexp(e, k(rng));
}

// The spread the emulation tests use: Q and K over spread / 4 binades (S stays in
// range), V and dO over spread. spread = 0 leaves the inputs alone.
inline void spread_inputs(Inputs& in, int spread, std::mt19937& rng) {
  if (spread <= 0) return;
  spread_binades(in.q, spread / 4, rng);
  spread_binades(in.k, spread / 4, rng);
  spread_binades(in.v, spread, rng);
  spread_binades(in.dout, spread, rng);
}

// ---- FP8 error budget against the exact path -------------------------------
//
// Model: RNE to a format with M mantissa bits leaves a relative error that is
// uniform on [-u, u] with u = 2^-(M+1) m^-1 for a value with mantissa m in
// [1, 2); its rms is 2^-M / sqrt(12) / m <= rho = 2^-(M+1) / sqrt(3) (the
// worst case m = 1): E4M3 rho4 = 0.0361, E5M2 rho5 = 0.0722. Block scaling
// keeps every element but those ~2^15 below its block's max in the normal
// range, so the model holds elementwise. Errors of distinct elements are
// independent and zero-mean, so in a product C = A B (random-sign operands,
// as here) each rounded operand adds rho^2 to (rel. Frobenius error of C)^2:
//   S   = tau Q K^T (#1): Q, K rounded -> abs. logit error sigma_S = sqrt(2) rho4
//         (tau^2 sum_k q_k^2 k_k^2 ~ 1 for unit-normal q, k);
//   P   = softmax(S): rel. error sigma_S (dP = P (dS - <P, dS>));
//   O   = P V (#2): P error, P rounded, V rounded: err_O^2 = sigma_S^2 + 2 rho4^2 = 4 rho4^2;
//   LSE: dLSE = <P, dS> -> abs. error <= sigma_S;
//   dV  = P^T dO (#5): P error, P rounded, dO rounded: sigma_S^2 + rho4^2 + rho_g^2;
//   dP  = dO V^T (#4): rel. error sqrt(rho_g^2 + rho4^2);
//   dS  = P (dP - delta): sigma_S^2 + rho_g^2 + rho4^2;
//   dQ  = tau dS K (#6), dK = tau dS^T Q (#7): dS error, dS rounded (rho_g),
//         K or Q rounded (rho4): err^2 = sigma_S^2 + 2 rho_g^2 + 2 rho4^2.
// The bound is this estimate itself (no extra factor): rho is already the
// worst case over mantissas, while real data has E[1/m^2] ~ 0.54 (Benford), so
// the typical error is ~0.74x the bound. A floor of 0.25x the bound checks the
// fp8 path really quantizes. Both recipes have the same budget: with
// power-of-two scales they round the same mantissas unless a value is
// FP8-subnormal under one scale and not the other.

// Errors of an fp8 run against the exact path (relative Frobenius for O, dQ, dK,
// dV; rms absolute over the rows that see a key for the LSE), or their budget.
struct Errors {
  double o, lse, dq, dk, dv;
};

// The budget for unit-normal inputs, gradients in grad format gf.
inline Errors fp8_budget(Fp8Format gf) {
  const double r4 = std::ldexp(1.0, -4) / std::sqrt(3.0);
  const double rg = gf == Fp8Format::kE4M3 ? r4 : std::ldexp(1.0, -3) / std::sqrt(3.0);
  const double sS2 = 2 * r4 * r4;
  Errors b;
  b.o = std::sqrt(sS2 + 2 * r4 * r4);
  b.lse = std::sqrt(sS2);
  b.dv = std::sqrt(sS2 + r4 * r4 + rg * rg);
  b.dq = b.dk = std::sqrt(sS2 + 2 * rg * rg + 2 * r4 * r4);
  return b;
}

inline Errors errors_vs_exact(const RefOutputs& f8, const RefOutputs& ex) {
  double lse_sq = 0;
  int64_t n = 0;
  for (size_t i = 0; i < ex.lse.size(); ++i)
    if (std::isfinite(ex.lse[i])) {
      lse_sq += (f8.lse[i] - ex.lse[i]) * (f8.lse[i] - ex.lse[i]);
      ++n;
    }
  return {rel_error(f8.o, ex.o), std::sqrt(lse_sq / n), rel_error(f8.dq, ex.dq),
          rel_error(f8.dk, ex.dk), rel_error(f8.dv, ex.dv)};
}

// O, dQ, dK, dV within the budget, and O and dQ above 0.25x of it: FP8's error,
// not a copy of the exact result.
inline void expect_within_budget(const Errors& e, const Errors& bud) {
  EXPECT_LT(e.o, bud.o);
  EXPECT_LT(e.dq, bud.dq);
  EXPECT_LT(e.dk, bud.dk);
  EXPECT_LT(e.dv, bud.dv);
  EXPECT_GT(e.o, 0.25 * bud.o);
  EXPECT_GT(e.dq, 0.25 * bud.dq);
}

// ---- Delta-Matching row-sum invariant --------------------------------------

// The delta modes in the order of RowSumResiduals' entries.
constexpr DeltaMode kResidualModes[3] = {DeltaMode::kStale, DeltaMode::kMatchedDO,
                                         DeltaMode::kDeltaMatching};

// Per delta mode (kResidualModes' order): the mean dS row-sum residuals before and
// after the FP8 cast (numerics.md section 6) and the rms of eps.
struct RowSumResiduals {
  double pre[3], post[3], eps_rms[3];
};

// The fp8 path (pr.params(Precision::kFP8, mode): pr's recipe, B = 128, E4M3) in each
// delta mode on BF16 inputs with a BF16 saved O, as at the op boundary; checks every
// gradient is finite.
inline RowSumResiduals rowsum_residuals(const Problem& pr, const Inputs& in) {
  RowSumResiduals res;
  for (int m = 0; m < 3; ++m) {
    const RefOutputs r =
        run_bf16(pr, in, pr.params(Precision::kFP8, kResidualModes[m]), DType::kBFloat16);
    res.pre[m] = mean(r.rowsum_pre);
    res.post[m] = mean(r.rowsum_post);
    double e2 = 0;
    for (float x : r.diag_eps) e2 += static_cast<double>(x) * x;
    res.eps_rms[m] = std::sqrt(e2 / r.diag_eps.size());
    EXPECT_TRUE(all_finite(r.dq) && all_finite(r.dk) && all_finite(r.dv));
  }
  return res;
}

// ---- Literal emulations of the FP8 recipes ----------------------------------
// (test_reference_fp8.cpp: `row`; test_reference_tile.cpp: `tile`)

// What an emulation computes: the outputs in logical order and the backward's
// per-row diagnostics.
struct Emulated {
  std::vector<double> o, lse, dq, dk, dv;
  std::vector<float> delta, eps, pre, post;
};

// The reference's O, dQ, dK, dV equal the emulation's (same operations in the same
// order: equal up to the sign of zero).
inline void expect_outputs_match(const RefOutputs& r, const Emulated& e) {
  EXPECT_EQ(max_abs_diff(r.o, e.o), 0.0);
  EXPECT_EQ(max_abs_diff(r.dq, e.dq), 0.0);
  EXPECT_EQ(max_abs_diff(r.dk, e.dk), 0.0);
  EXPECT_EQ(max_abs_diff(r.dv, e.dv), 0.0);
}

// The reference equals a literal emulation (emulate(in) -> Emulated) bit for bit on
// random BF16-exact inputs from `seed`, spread over `spread` binades (spread_inputs),
// with params p and FP32 outputs: O, dQ, dK, dV (up to the sign of zero), LSE and
// every diagnostic; the outputs are finite.
template <class Emulate>
void expect_reference_matches(const Problem& pr, const AttnParams& p, uint32_t seed, int spread,
                              Emulate emulate) {
  SCOPED_TRACE("Sq=" + std::to_string(pr.Sq) + " Sk=" + std::to_string(pr.Sk) +
               " causal=" + std::to_string(pr.causal) + " window=(" + std::to_string(pr.window_left) +
               ", " + std::to_string(pr.window_right) + ") block=" + std::to_string(p.block_size) +
               " d=" + std::to_string(pr.d) + " dv=" + std::to_string(pr.dv) + " mode=" +
               std::to_string(static_cast<int>(p.delta_mode)) + " spread=" + std::to_string(spread));
  std::mt19937 rng(seed);
  Inputs in = random_inputs(pr, rng);
  spread_inputs(in, spread, rng);
  const RefOutputs r = run_bf16(pr, in, p, DType::kFloat32);
  const Emulated e = emulate(in);
  expect_outputs_match(r, e);
  for (size_t i = 0; i < e.lse.size(); ++i) {
    EXPECT_EQ(r.lse[i], e.lse[i]) << i;
    EXPECT_EQ(r.diag_delta[i], e.delta[i]) << i;
    EXPECT_EQ(r.diag_eps[i], e.eps[i]) << i;
    EXPECT_EQ(r.rowsum_pre[i], e.pre[i]) << i;
    EXPECT_EQ(r.rowsum_post[i], e.post[i]) << i;
  }
  EXPECT_TRUE(all_finite(r.o) && all_finite(r.dq) && all_finite(r.dk) && all_finite(r.dv));
}

// The problem the emulation tests start from: one batch, two query heads on one kv
// head (GQA), head dims 40 and 24.
inline Problem emulation_problem() { return Problem{.B = 1, .Hq = 2, .Hkv = 1, .d = 40, .dv = 24}; }

// The sliding-window cases of the emulation tests (numerics.md section 14): the
// visible keys of a row are a range [i + Sk - Sq - left, i + Sk - Sq + right], so
// the partially visible tiles are prefixes, suffixes and (windows narrower than a
// tile) middle ranges, quantized from their visible part; edges inside and across
// tiles, seqlen_q != seqlen_k both ways, rows that see no key, every delta mode, a
// wide dynamic range (spread 12: visible-part blocks differ from whole-tile blocks
// there). Calls check(pr, block size, grad format, delta mode, seed, spread) on each.
template <class Check>
void for_each_window_emulation_case(Check check) {
  Problem pr = emulation_problem();
  struct Case {
    int64_t Sq, Sk, left, right, block;
    Fp8Format gf;
    DeltaMode mode;
    uint32_t seed;
    int spread;
  };
  const Fp8Format e4 = Fp8Format::kE4M3, e5 = Fp8Format::kE5M2;
  const DeltaMode dm = DeltaMode::kDeltaMatching, st = DeltaMode::kStale, md = DeltaMode::kMatchedDO;
  const Case cases[] = {
      {100, 75, 40, 0, 32, e4, dm, 11, 0},     // left bound across tiles, rows that see no key
      {100, 75, 40, 0, 32, e4, dm, 12, 12},
      {90, 90, 5, 3, 32, e4, st, 13, 12},      // a window narrower than a tile: middle ranges
      {90, 90, 0, 0, 32, e5, md, 14, 0},       // one key per row
      {70, 133, 37, 20, 64, e4, md, 15, 12},   // both bounds inside 64-key tiles, Sq < Sk
      {133, 70, 20, 37, 64, e5, st, 16, 12},   // Sq > Sk: rows that see no key at the top
      {60, 300, 129, -1, 128, e4, dm, 17, 12}, // left bound only, crossing a 128-key tile
      {60, 300, -1, 100, 128, e4, st, 18, 0},  // right bound only (not causal)
      {60, 300, 200, 129, 128, e4, md, 19, 12},
  };
  for (const Case& c : cases) {
    pr.Sq = c.Sq;
    pr.Sk = c.Sk;
    pr.window_left = c.left;
    pr.window_right = c.right;
    check(pr, c.block, c.gf, c.mode, c.seed, c.spread);
  }
  // causal with a window: right bound 0
  pr.Sq = 80;
  pr.Sk = 100;
  pr.causal = true;
  pr.window_left = 45;
  pr.window_right = 17;
  check(pr, 32, e4, dm, 20, 12);
}

// Runs fn and checks it throws ArgumentError whose message names `arg`.
template <class Fn>
void expect_argument_error(Fn fn, const std::string& arg) {
  try {
    fn();
    ADD_FAILURE() << "expected ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + arg + "'"), std::string::npos) << e.what();
  }
}

}  // namespace testutil
}  // namespace fp8attn
