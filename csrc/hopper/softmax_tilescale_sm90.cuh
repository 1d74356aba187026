// fp8attn: the online softmax of the `tile` recipe's forward, with every block
// scale folded into per-row coefficients (numerics.md section 9). The one
// file that says where each scale of the forward goes:
//   S      = tau * s_Q(i) * s_K(kt) * (Q_hat K_hat^T): the raw wgmma sum times
//            coef = rq(i) * s_K(kt), rq = s_Q tau log2(e) (log2 domain), in
//            the exp2's FMA; no per-element multiply.
//   P      per (row, key tile), dynamic: s_P = block_scale(exp2(tile max -
//            m_new)), the codes E4M3(exp2(S - m_new - log2 s_P)): the exponent
//            offset rides in the same FMA (softmax_row_step, fwd_softmax_sm90.cuh,
//            shared with the `row` kernels so both round the same values).
//   O      accumulates P_hat V_hat straight in the wgmma accumulator, kept in
//            units of u = s_P(i, kt) s_V(kt) (a power of two per row, tracked
//            as its exponent): before P V (kt) is added, O is multiplied by
//            alpha * u(kt - 1) / u(kt), the online-softmax rescale with the
//            scale ratio folded in (one FMUL per element per tile, as FA3's
//            rescale). The epilogue multiplies by u / l.
//   l      the FP32 sum of the unquantized exp values (l = l alpha + sum s_P).
// Softcap (kSoftcap, numerics.md section 12; softcap_sm90.cuh): softcap_tile
// first replaces S by the capped logit y = C tanh(u / C) in log2 units, u =
// S coef, in place (before the mask); softmax_tile then runs on y with
// coefficient 1 (P = exp2(y - m), m the running max of y), so l, m, the P
// scales and LSE = (m + log2 l) ln 2 are those of the capped logits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "hopper/config_sm90.h"
#include "hopper/fwd_softmax_sm90.cuh"
#include "hopper/softcap_sm90.cuh"

namespace fp8attn {
namespace sm90 {

// 2^e for an integer e, clamped to the normal range [-126, 127].
__device__ __forceinline__ float pow2i(int e) {
  e = max(-126, min(127, e));
  return __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
}
// Exponent of a power-of-two scale (normal; NaN gives 128: its row is NaN anyway).
__device__ __forceinline__ int pow2_exponent(float s) {
  return static_cast<int>((__float_as_uint(s) >> 23) & 0xffu) - 127;
}

// Per-thread online-softmax state of its two rows (g and g + 8 of the warp's
// 16): running max (log2 domain), this thread's share of l, O's unit exponent,
// and the row coefficient rq = s_Q tau log2(e) (with softcap rq 2 / c, the
// coefficient of softcap_tile's exp2 argument; softmax_tile then uses 1).
struct TileSoftmaxState {
  float m[2], l[2], rq[2];
  int e[2];
};

__device__ __forceinline__ void softmax_state_init(TileSoftmaxState& st, float rq0, float rq1) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
    st.e[r] = 0;
  }
  st.rq[0] = rq0;
  st.rq[1] = rq1;
}

// a[0] op= a[kW], ..., then halves the width down to one value: a balanced
// tree over a[0 .. 2 kW) (the levels written out: a runtime width left the
// array in local memory).
template <int kW, int kN, class Op>
__device__ __forceinline__ float tree_fold(float (&a)[kN], Op op) {
#pragma unroll
  for (int j = 0; j < kW; ++j) a[j] = op(a[j], a[j + kW]);
  if constexpr (kW > 1) {
    return tree_fold<kW / 2>(a, op);
  } else {
    return a[0];
  }
}

// One key tile: s = the raw m64n128 S accumulator of this thread (masked
// entries already -inf), sk / sv the tile's K / V scales. Writes the P codes
// as the A fragments of the four k32 steps of P V (pa; the key order the V^T
// permutation of the producer matches, mainloop_fwd_tilescale_sm90.cuh) and
// the factor that moves O from the previous tile's unit to this one's.
// kSoftcap: s holds softcap_tile's capped logits y (log2 units), coefficient 1.
template <int kNT, bool kSoftcap = false>
__device__ __forceinline__ void softmax_tile(float (&s)[kNT * 4], float sk, float sv, TileSoftmaxState& st,
                                             uint32_t (&pa)[kNT / 4][4], float (&factor)[2]) {
  const int e_sv = pow2_exponent(sv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // NOTE: s_Q s_K tau log2(e) can underflow to 0 (inputs with amax_q amax_k
    // below ~1e-40 / tau); a masked -inf times 0 would then be NaN for a finite
    // input. The smallest normal float instead gives the same P (every S coef
    // is then below 2^-100: exp2 = 1, as the reference's S of ~0); a NaN
    // coefficient stays NaN. (Softcap: the scales are in y already.)
    float coef = 1.f;
    if constexpr (!kSoftcap) {
      coef = st.rq[r] * sk;
      if (coef == 0.f) coef = 1.17549435e-38f;
    }
    // NOTE: the row's max as a balanced tree (depth 6, was a chain of 17):
    // fmaxf is exact and drops a NaN operand, so any order gives the same
    // value; the -inf seed stays (a thread whose 32 values are all NaN still
    // gets -inf, not NaN, as with the chain).
    float mt[kNT];
#pragma unroll
    for (int j = 0; j < kNT; ++j) mt[j] = fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]);
    mt[0] = fmaxf(mt[0], -INFINITY);
    const float mx = tree_fold<kNT / 2>(mt, [](float a, float b) { return fmaxf(a, b); });
    const SoftmaxRowStep step = softmax_row_step<true>(mx, coef, st.m[r]);
    // NOTE: flush (config_sm90.h, kPFlushScale): then the running max did not
    // move (alpha = 1) and O keeps its unit. A NaN s_P is never flushed.
    const bool flush = step.sp < fwdt::kPFlushScale;
    const float nbias = flush ? -INFINITY : step.nbias;
    float ps[kNT];
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const float p0 = fast_exp2(fmaf(s[4 * j + 2 * r], coef, nbias));  // P / s_P
      const float p1 = fast_exp2(fmaf(s[4 * j + 2 * r + 1], coef, nbias));
      s[4 * j + 2 * r] = p0;
      s[4 * j + 2 * r + 1] = p1;
      ps[j] = p0 + p1;
    }
    // NOTE: this thread's share of the row sum as a balanced tree (depth 5,
    // was a chain of 32 dependent FADDs). Only l's FP32 rounding order
    // changes (numerics.md section 9 fixes the codes and scales, not the
    // order of l's sum; the kernel's order never was the reference's key
    // order, csrc/reference/attention_ref.cpp: each thread sums its 32 keys
    // of the tile, the quad's four shares meet in the epilogue); P >= 0, so
    // a NaN / inf reaches l in any order.
    const float sum = tree_fold<kNT / 2>(ps, [](float a, float b) { return a + b; });
    st.l[r] = st.l[r] * step.alpha + sum * step.sp;
    const int e_new = flush ? st.e[r] : step.esp + e_sv;
    factor[r] = step.alpha * pow2i(st.e[r] - e_new);
    st.e[r] = e_new;
  }
#pragma unroll
  for (int q = 0; q < kNT / 4; ++q) {
    const float* x = &s[16 * q];  // n8 tiles 4q .. 4q + 3
    pa[q][0] = pack_e4m3x4(x[0], x[1], x[4], x[5]);
    pa[q][1] = pack_e4m3x4(x[2], x[3], x[6], x[7]);
    pa[q][2] = pack_e4m3x4(x[8], x[9], x[12], x[13]);
    pa[q][3] = pack_e4m3x4(x[10], x[11], x[14], x[15]);
  }
}

// Softcap (numerics.md section 12): the raw S accumulator of one key tile
// (s, as softmax_tile's) -> the capped logits y = C - 2 C r in log2 units,
// r = 1 / (1 + 2^(S rq2 s_K)), rq2 = st.rq = s_Q tau log2(e) 2 / c
// (softcap_sm90.cuh). Before the mask (a masked entry becomes -inf after the
// cap). NOTE: no guard for a coefficient that underflows to 0: u2 = 0 gives
// y = 0, the reference's capped S of ~0, and the masked entries are set after.
template <int kNT>
__device__ __forceinline__ void softcap_tile(float (&s)[kNT * 4], float sk, const TileSoftmaxState& st,
                                             const Softcap& sc) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float coef2 = st.rq[r] * sk;  // sk a power of two: exact but at the ends of the range
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * r + e];
        x = softcap_y(softcap_r(__fmul_rn(x, coef2)), sc);
      }
  }
}

// O (m64 x kDv accumulator of this thread) *= factor of its row.
template <int kN>
__device__ __forceinline__ void rescale_o(float (&o)[kN], const float (&factor)[2]) {
#pragma unroll
  for (int t = 0; t < kN / 4; ++t) {
    o[4 * t + 0] *= factor[0];
    o[4 * t + 1] *= factor[0];
    o[4 * t + 2] *= factor[1];
    o[4 * t + 3] *= factor[1];
  }
}

}  // namespace sm90
}  // namespace fp8attn
