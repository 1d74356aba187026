// fp8attn: the per-tile-pair pieces of the sm_90a `tile`-recipe FP8 backward
// (numerics.md section 9), shared by its Delta-Matching pre-pass
// (bwd_prepass_tilescale_e4m3_sm90.cu) and its main kernel
// (bwd_tilescale_e4m3_sm90.cu). Design: docs/kernels/bwd_tilescale_e4m3_sm90.md.
//
// WHERE EACH BLOCK SCALE IS FOLDED IN (the one place to read it):
//   S   (#3)  one FP32 wgmma sum over all of head_dim; s_Q(i) s_K(kt) tau log2(e)
//             is the per-column (query) coefficient of the exp2 argument (p_coef).
//   dP  (#4)  one FP32 wgmma sum over all of dv; s_dO(i) s_V(kt) is the
//             per-column coefficient of the dS FMA (dp_coef).
//   dV  (#5)  P^T block-quantized per (qs, kh, kt): a 64-query sub-tile qs of
//             the query tile qt times the 64-key half kh of the key tile (one
//             consumer warpgroup's keys: its 4 warps' amaxes combined through
//             shared memory), codes as RS A fragments (codes_block);
//             s_P(qs,kh,kt) s_dO(qt) is ONE scalar per step: the accumulator is
//             kept in units of 2^e (rescale_to) and rescaled only when e changes.
//   dK  (#7)  dS^T per (qs, kh, kt) block, s_dS(qs,kh,kt) s_Q(qt): as dV.
//   dQ  (#6)  dS per (row, kh, kt) over the 64 keys of a half; the FP32 wgmma
//             partial of each half times s_dS(i,kh,kt) s_K(kt) per row at
//             write-out (main kernel); the halves' partials add in dq_accum.
// No scale varies along a reduction dimension, so no partial product is
// promoted element by element.
// Softcap (numerics.md section 12, kSoftcap instantiations; softcap_sm90.cuh):
//   P   = exp2(y - p_l2), y = C - 2 C r the capped logit in log2 units, r =
//         1 / (1 + exp2(acc p_c2)), p_c2 = s_Q(q) kc2, kc2 = __fmul_rn(kc, 2 / c)
//         (p_softcap: the same function in the pre-pass and the main kernel, so
//         P stays bitwise shared);
//   dS  (#6, #7) = dX' (1 - tanh^2) = dX' 4 r (1 - r), dX' = P (dP_hat - delta)
//         as without softcap (the mask and the pre-cast diagnostics see dX').
//
// Fragment conventions are those of the row wgmma backward (wgmma_sm90.cuh):
// accumulator x[j][e] of this warp = (row 16 warp + g + 8 (e >> 1), column
// 8j + 2t + (e & 1)), rows are keys via k_of_row, columns queries via q_of_col
// (the shared-memory Q / dO rows are stored in that order), so the quantized
// P^T / dS^T registers are the A fragments of natural query order.
//
// Bitwise contract with the pre-pass: S^T and dP^T are issued as one
// m64n64k32 chain per 64 query columns in both kernels (same instruction per
// element, same k order: head-dim block 0 then 1), and P, dP_hat are formed by the same
// functions below with explicit roundings (__fmul_rn, fmaf), so P and dP_hat
// are bitwise equal and the Delta-Matching pre-cast row sums of dS are
// delta (1 - sum_j P_ij) up to FP32 rounding (numerics.md sections 4, 7).
// Pre-pass v2 (128 queries per CTA) keeps this per element: its warpgroup wg
// issues the chain of main-kernel warpgroup h (A = key rows [64 h, 64 h + 64))
// for both h against query sub-tile wg (B = query rows [64 wg, 64 wg + 64) of
// a 128-row tile, QROWS = kTile as in the main kernel), each half its own
// accumulator, so key row 64 h + 16 w + r and query column c land in the same
// (warp-row, column) fragment slot as in the main kernel's warp 4 h + w.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "hopper/prepass_delta_sm90.cuh"
#include "hopper/config_sm90.h"
#include "hopper/kernel_params_sm90.h"
#include "hopper/scheduler_sm90.cuh"
#include "hopper/softcap_sm90.cuh"
#include "hopper/wgmma_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {

namespace ts {

// ---- sequence bounds ---------------------------------------------------------------
//
// Where a sequence lies comes from SeqInfo (scheduler_sm90.cuh, the one place
// for the forward and the backward): seq_info(p, b) for a dense batch (every
// entry seqlen_q x seqlen_k at offset 0), varlen_seq_info for a packed one
// (kVarlen instantiations, varlen_sm90.h). Lengths, masks, windows and tile
// ranges are the sequence's own; a packed batch's arrays are addressed with
// its offsets: token rows (tok_q, tok_k) in the token-indexed arrays (LSE,
// delta, the diagnostics rows, the BF16 outputs, token-major), padded rows
// (row_q, row_k: multiples of 128) in the codes, their scales and dq_accum.

// x through a volatile move: values derived from it cannot be hoisted out of
// the loop that makes the copy (register pressure, see the main kernel).
__device__ __forceinline__ uint32_t opaque_u32(uint32_t x) {
  uint32_t r;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// ---- S^T and dP^T (#3, #4): one FP32 sum over all of head_dim -------------------------

// Issues chains of NC columns (m64nNCk32) over [col0, col0 + NCOLS) of
// A (64 rows) x B^T (B rows = columns), every k32 step of every head-dim
// block of D: one FP32 sum over all of head_dim per element. a_lo: descriptor
// of the warpgroup's 64 A rows (tile blocks kTileBytes apart); b_lo: of the
// [QROWS]-row B tile (blocks QROWS * 128 bytes apart).
template <int D, int NC, int NCOLS, int QROWS, int FA, int FB>
__device__ __forceinline__ void issue_rows_dot(uint32_t a_lo, uint32_t b_lo, int col0, float* acc) {
  constexpr int W0 = bw_of<D, 0>();
  static_assert(W0 % 32 == 0 && NCOLS % NC == 0, "whole k32 steps and chains");
#pragma unroll
  for (int h = 0; h < NCOLS / NC; ++h) {
    const uint32_t b = b_lo + (col0 + NC * h) * (128 / 16);
#pragma unroll
    for (int k = 0; k < W0 / 32; ++k)
      gmma_ss<FA, FB, NC>(desc_of(a_lo + kDescK32 * k), desc_of(b + kDescK32 * k), acc + (NC / 2) * h, k > 0);
    if constexpr (nb_of<D>() > 1) {
      constexpr int W1 = bw_of<D, 1>();
      static_assert(W1 % 32 == 0, "whole k32 steps");
#pragma unroll
      for (int k = 0; k < W1 / 32; ++k)
        gmma_ss<FA, FB, NC>(desc_of(a_lo + kTileBytes / 16 + kDescK32 * k),
                            desc_of(b + QROWS * 128 / 16 + kDescK32 * k), acc + (NC / 2) * h, true);
    }
  }
}
// S^T = K Q^T for this warpgroup's 64 key rows x NQ query columns, one
// m64n64k32 chain per 64 columns (one commit group).
template <int DQK, int NQ, int QROWS>
__device__ __forceinline__ void issue_s(uint32_t k_lo, uint32_t q_lo, float (&s)[NQ / 8][4]) {
  fence_regs<NQ / 2>(&s[0][0]);
  wg_arrive();
  issue_rows_dot<DQK, 64, NQ, QROWS, kFmtE4M3, kFmtE4M3>(k_lo, q_lo, 0, &s[0][0]);
  wg_commit();
}
// dP^T = V dO^T for NQ query columns (one m64n64k32 chain per 64 columns, one
// commit group): the same instruction per element as S^T, in the pre-pass and
// the main kernel (P and dP_hat bitwise shared).
template <int DV, int FMT, int NQ, int QROWS>
__device__ __forceinline__ void issue_dp(uint32_t v_lo, uint32_t do_lo, float (&dp)[NQ / 8][4]) {
  fence_regs<NQ / 2>(&dp[0][0]);
  wg_arrive();
  issue_rows_dot<DV, 64, NQ, QROWS, kFmtE4M3, FMT>(v_lo, do_lo, 0, &dp[0][0]);
  wg_commit();
}

// The per-column (query) coefficients of P and dP_hat, the one place they are
// formed (the pre-pass per use, the main kernel's producer once per stage):
//   P  = exp2(fmaf(acc, p_c, -p_l2)), p_c = s_Q(q) kc, kc = __fmul_rn(s_K(kt), c2),
//        c2 = __fmul_rn(tau, log2(e)); p_l2 = LSE(q) log2(e), +inf for LSE = -inf
//        (a row that sees no key: exp2(-inf) = 0 for every finite S);
//   dP_hat = acc dp_c, dp_c = s_dO(q) s_V(kt).
// NOTE: with power-of-two scales p_c is exact, so P is exp2 of the promoted S
// (numerics.md section 9) times tau log2(e), rounded once by the FMA; the same
// values wherever they are formed, so P and dP_hat are bitwise shared.
__device__ __forceinline__ float p_coef(float qs, float kc) { return __fmul_rn(qs, kc); }
__device__ __forceinline__ float p_lse2(float lse) { return lse == -INFINITY ? INFINITY : __fmul_rn(lse, kLog2e); }
__device__ __forceinline__ float dp_coef(float dos, float sv) { return __fmul_rn(dos, sv); }
// Softcap: the per-tile factor kc2 = kc 2 / c of p_c2 = p_coef(s_Q, kc2) (the
// main kernel's producer and the pre-pass form it the same way: 2 / c from
// softcap_consts).
__device__ __forceinline__ float softcap_kc(float kc, const Softcap& sc) { return __fmul_rn(kc, sc.k2); }
// Softcap: P of one element from its raw S accumulator acc and the column's
// p_c2, p_l2; r (softcap_sm90.cuh) for the cap's derivative. The one place P
// is formed with softcap (pre-pass and main kernel: P bitwise shared).
__device__ __forceinline__ float p_softcap(float acc, float c2, float l2, const Softcap& sc, float& r) {
  r = softcap_r(__fmul_rn(acc, c2));
  return ex2(__fsub_rn(softcap_y(r, sc), l2));
}

// P in place (unmasked) from the per-column coefficients sC = p_c, sL2 = p_l2
// (q_of_col order), columns [0, NQ).
template <int NQ>
__device__ __forceinline__ void p_from_coefs(float (&s)[NQ / 8][4], const float* sC, const float* sL2, int lane) {
  const int t = lane & 3;
  fence_regs<NQ / 2>(&s[0][0]);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 c = *reinterpret_cast<const float2*>(sC + 8 * j + 2 * t);
    const float2 l = *reinterpret_cast<const float2*>(sL2 + 8 * j + 2 * t);
    s[j][0] = ex2(fmaf(s[j][0], c.x, -l.x));
    s[j][1] = ex2(fmaf(s[j][1], c.y, -l.y));
    s[j][2] = ex2(fmaf(s[j][2], c.x, -l.x));
    s[j][3] = ex2(fmaf(s[j][3], c.y, -l.y));
  }
}
// Softcap: P in place (unmasked) as p_from_coefs, sC = p_c2 per column, and
// the cap's derivative 4 r (1 - r) per element into dcap (for cap_grad).
template <int NQ>
__device__ __forceinline__ void p_from_coefs_softcap(float (&s)[NQ / 8][4], float (&dcap)[NQ / 8][4], const float* sC,
                                                     const float* sL2, const Softcap& sc, int lane) {
  const int t = lane & 3;
  fence_regs<NQ / 2>(&s[0][0]);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 c = *reinterpret_cast<const float2*>(sC + 8 * j + 2 * t);
    const float2 l = *reinterpret_cast<const float2*>(sL2 + 8 * j + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float r;
      s[j][e] = p_softcap(s[j][e], (e & 1) ? c.y : c.x, (e & 1) ? l.y : l.x, sc, r);
      dcap[j][e] = softcap_grad(r);
    }
  }
}
// P in place from the raw per-column s_Q (sQs) and LSE (sLse): p_from_coefs with
// the coefficients formed here (the pre-pass). kSoftcap: kc is softcap_kc's kc2
// and P is p_softcap's.
template <int NQ, bool kSoftcap = false>
__device__ __forceinline__ void p_from_s(float (&s)[NQ / 8][4], float kc, const float* sQs, const float* sLse,
                                         int lane, const Softcap& sc = Softcap{}) {
  const int t = lane & 3;
  fence_regs<NQ / 2>(&s[0][0]);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 qs = *reinterpret_cast<const float2*>(sQs + 8 * j + 2 * t);
    const float2 l = *reinterpret_cast<const float2*>(sLse + 8 * j + 2 * t);
    const float cx = p_coef(qs.x, kc), cy = p_coef(qs.y, kc);
    const float lx = p_lse2(l.x), ly = p_lse2(l.y);
    if constexpr (kSoftcap) {
      float r;
      s[j][0] = p_softcap(s[j][0], cx, lx, sc, r);
      s[j][1] = p_softcap(s[j][1], cy, ly, sc, r);
      s[j][2] = p_softcap(s[j][2], cx, lx, sc, r);
      s[j][3] = p_softcap(s[j][3], cy, ly, sc, r);
    } else {
      s[j][0] = ex2(fmaf(s[j][0], cx, -lx));
      s[j][1] = ex2(fmaf(s[j][1], cy, -ly));
      s[j][2] = ex2(fmaf(s[j][2], cx, -lx));
      s[j][3] = ex2(fmaf(s[j][3], cy, -ly));
    }
  }
}

// dP_hat in place: acc (s_dO(q) s_V(kt)) for NQ columns. sDOs per column.
template <int NQ>
__device__ __forceinline__ void dp_scale(float (&dp)[NQ / 8][4], float sv, const float* sDOs, int lane) {
  const int t = lane & 3;
  fence_regs<NQ / 2>(&dp[0][0]);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 os = *reinterpret_cast<const float2*>(sDOs + 8 * j + 2 * t);
    const float cx = dp_coef(os.x, sv), cy = dp_coef(os.y, sv);
    dp[j][0] = __fmul_rn(dp[j][0], cx);
    dp[j][1] = __fmul_rn(dp[j][1], cy);
    dp[j][2] = __fmul_rn(dp[j][2], cx);
    dp[j][3] = __fmul_rn(dp[j][3], cy);
  }
}
// dS = P (dP_hat - delta) in place over the dP accumulator: dP_hat - delta as
// fmaf(acc, dp_c, -delta), the value __fsub_rn(dp_scale's dP_hat, delta) (the
// coefficient is a power of two: the product is exact). sCdo: dp_c per column.
// P stays (#5).
template <int NQ>
__device__ __forceinline__ void ds_from_dp(const float (&pt)[NQ / 8][4], float (&dp)[NQ / 8][4], const float* sCdo,
                                           const float* sDelta, int lane) {
  const int t = lane & 3;
  fence_regs<NQ / 2>(&dp[0][0]);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 c = *reinterpret_cast<const float2*>(sCdo + 8 * j + 2 * t);
    const float2 dl = *reinterpret_cast<const float2*>(sDelta + 8 * j + 2 * t);
    dp[j][0] = __fmul_rn(pt[j][0], fmaf(dp[j][0], c.x, -dl.x));
    dp[j][1] = __fmul_rn(pt[j][1], fmaf(dp[j][1], c.y, -dl.y));
    dp[j][2] = __fmul_rn(pt[j][2], fmaf(dp[j][2], c.x, -dl.x));
    dp[j][3] = __fmul_rn(pt[j][3], fmaf(dp[j][3], c.y, -dl.y));
  }
}

// Softcap: dS = dX' (1 - tanh^2) in place over dX' (ds_from_dp's, masked, after
// the pre-cast diagnostics), dcap from p_from_coefs_softcap. A masked dX' (an
// exact 0) stays 0 (softcap_grad is never NaN).
template <int NQ>
__device__ __forceinline__ void cap_grad(float (&dp)[NQ / 8][4], const float (&dcap)[NQ / 8][4]) {
  fence_regs<NQ / 2>(&dp[0][0]);
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[j][e] = __fmul_rn(dp[j][e], dcap[j][e]);
}

// ---- masks of a tile pair that is not interior (TileGeom::interior) ------------------
//
// The predicate of TileGeom::visible with per-thread bounds and the window
// (L, R) = (win_left, win_right) of KernelParams (numerics.md section 14: query
// i sees key j iff j - off - R <= i <= j - off + L; causal is (-1, 0)) in
// place of `causal` (the row kernel's wg_mask_main, for any NQ and raw LSE):
// this thread's column 8j + 2t + e is query ql = 4t + C, C = 16 (j >> 1) + 2
// (j & 1) + e (q_of_col), so with kl_r = k_of_row(row r), key_r = n0 + kl_r:
//   visible <=> C < Sq - m0 - 4t && C >= lo_r && (L < 0 || C < hi_r),
//   lo_r = key_r - off - R - m0 - 4t (R >= 0), INT_MIN (R < 0), INT_MAX (key_r >= Sk),
//   hi_r = key_r - off + L + 1 - m0 - 4t.
// Applied to P (after p_from_s) and to dS (P = 0 there, but dP_hat may be NaN).
// NOTE: no LSE read here: a second read of the column LSE next to p_from_s's
// was merged with it by the compiler and kept 32 values live (spills).
template <int NQ>
__device__ __forceinline__ void mask_tile(float (&s)[NQ / 8][4], const TileGeom& tg, int warp, int lane, int win_left,
                                          int win_right) {
  const int g = lane >> 2, t = lane & 3;
  const int qlim = tg.seqlen_q - tg.m0 - 4 * t;
  int lo[2], hi[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = tg.n0 + k_of_row(warp * 16 + g + 8 * r);
    const int rel = key - tg.causal_off - tg.m0 - 4 * t;  // C of query key_r - off (the diagonal)
    lo[r] = key >= tg.seqlen_k ? 0x7fffffff : (win_right >= 0 ? rel - win_right : -0x7fffffff - 1);
    hi[r] = rel + win_left + 1;
  }
  // NOTE: two copies of the loop, the one without a left bound the causal
  // mask's (qlim and lo live, not hi too): with one loop for both the pre-pass
  // v1 at d = 256 (128 registers) spilled.
  auto apply = [&](auto left_bounded) {
#pragma unroll
    for (int j = 0; j < NQ / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int c = 16 * (j >> 1) + 2 * (j & 1) + e;
        const bool col = c < qlim;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          bool vis = col && c >= lo[r];
          if constexpr (decltype(left_bounded)::value) vis = vis && c < hi[r];
          if (!vis) s[j][e + 2 * r] = 0.f;
        }
      }
  };
  if (win_left < 0)
    apply(std::false_type{});
  else
    apply(std::true_type{});
}

// ---- block quantization of P^T (#5) and dS^T (#7): one scale per 128 x 128 block -----

// max.NaN of |x| over this thread's 4 NJ values, then over the warp.
// NOTE: four independent chains (one per e), then combined: max is exact and
// order-free, so this is the serial chain's value with a quarter of its
// dependent latency (a 32-deep FMNMX chain stalled on short scoreboard in the
// v5 profile, docs/kernels/ncu-2026-12-07).
template <int NJ>
__device__ __forceinline__ float warp_amax(const float (&x)[NJ][4]) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] = max_nan(c[e], fabsf(x[j][e]));
  float m = max_nan(max_nan(c[0], c[1]), max_nan(c[2], c[3]));
#pragma unroll
  for (int o = 1; o <= 16; o <<= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}
// The FP8 codes of x * inv as the k32 A fragments of an RS wgmma (rows g,
// g + 8 of this warp; K = the 8 NJ query columns in natural order, see q_of_col):
// a[2u] row g, a[2u + 1] row g + 8, of k16 step 2c + u of k32 step c.
template <int F, int NJ>
__device__ __forceinline__ void codes_step(const float (&x)[NJ][4], float inv, int c, uint32_t (&a)[4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int j = 2 * (2 * c + u);
    a[2 * u] = cvt2<F>(x[j][0] * inv, x[j][1] * inv) | (cvt2<F>(x[j + 1][0] * inv, x[j + 1][1] * inv) << 16);
    a[2 * u + 1] = cvt2<F>(x[j][2] * inv, x[j][3] * inv) | (cvt2<F>(x[j + 1][2] * inv, x[j + 1][3] * inv) << 16);
  }
}
// All NJ / 4 k32 steps.
template <int F, int NJ>
__device__ __forceinline__ void codes_block(const float (&x)[NJ][4], float inv, uint32_t (&a)[NJ / 4][4]) {
#pragma unroll
  for (int c = 0; c < NJ / 4; ++c) codes_step<F, NJ>(x, inv, c, a[c]);
}

// ---- accumulators in units of a running power of two ---------------------------------
//
// The true accumulator is acc * 2^e. A step whose scalar factor is 2^ef first
// rescales acc by 2^(e - ef) (pow2_scale: exact, except at the ends of the
// FP32 range) and sets e = ef, then adds its FP8 product straight into acc
// (wgmma, scale-d = 1). With power-of-two factors this is the reference's
// promoted form acc_true += partial * 2^ef in FP32 (rounding commutes with
// power-of-two scaling), up to how the wgmma itself sums.
// A NaN factor leaves e alone: its codes are NaN (0x7F), so acc turns NaN
// through the wgmma and stays NaN.
__device__ __forceinline__ int pow2_exp(float s) { return static_cast<int>((__float_as_uint(s) >> 23) & 0xffu) - 127; }
// 2^n as a float, n in [-126, 127].
__device__ __forceinline__ float pow2f(int n) { return __uint_as_float(static_cast<uint32_t>(n + 127) << 23); }
// The factors (f0, f1, f2) with f0 f1 f2 = 2^d (each a normal power of two),
// for any d (|d| <= 3 * 126: larger shifts saturate to 0 / inf anyway).
struct Pow2 {
  float f0, f1, f2;
};
__device__ __forceinline__ Pow2 pow2_split(int d) {
  d = max(-378, min(378, d));
  const int a = max(-126, min(127, d)), r = d - a;
  const int b = max(-126, min(127, r)), c = r - b;
  return {pow2f(a), pow2f(b), pow2f(max(-126, min(127, c)))};
}
// x 2^d: one FMUL when d fits one normal power of two (warp-uniform branch),
// else three (positive d: exact or overflow; negative d: exact until the
// value goes FP32-subnormal).
template <int N>
__device__ __forceinline__ void pow2_scale(float* acc, int d) {
  const Pow2 f = pow2_split(d);
  if (d >= -126 && d <= 127) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = __fmul_rn(acc[i], f.f0);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = __fmul_rn(__fmul_rn(__fmul_rn(acc[i], f.f0), f.f1), f.f2);
  }
}
// ef of a step with factor sa * sb (both block scales, powers of two in
// [2^-126, 2^127], or NaN); false when a factor is not finite.
__device__ __forceinline__ bool step_exp(float sa, float sb, int& ef) {
  if (!(isfinite(sa) && isfinite(sb))) return false;
  ef = pow2_exp(sa) + pow2_exp(sb);
  return true;
}
template <int N>
__device__ __forceinline__ void rescale_to(float* acc, int& e, float sa, float sb) {
  int ef;
  if (!step_exp(sa, sb, ef) || ef == e) return;  // warp-uniform (CTA-wide scales)
  fence_regs<N>(acc);
  pow2_scale<N>(acc, e - ef);
  e = ef;
}

// ---- diagnostics -----------------------------------------------------------------------

// Pre-cast row sums of dS over this CTA's keys for every query column (sum,
// then sum of |.|), atomically added into rowsum_ws planes 0 and 1 (numerics.md
// section 5). Columns c_of(n) -> query m0 + q_of_col(n).
template <int NQ>
__device__ __forceinline__ void diag_pre(const float (&x)[NQ / 8][4], float* ws, int64_t n_rows, int64_t row0,
                                         int m0, int Sq, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass)
#pragma unroll
    for (int hf = 0; hf < NQ / 64; ++hf) {
      float v[16], rs[2];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float* y = x[8 * hf + j];
          v[2 * j + e] = pass == 0 ? y[e] + y[e + 2] : fabsf(y[e]) + fabsf(y[e + 2]);
        }
      reduce_cols(v, rs, lane, OpAdd());  // N = 16: one 64-column half, out[e] = column 8g + 2t + e
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = m0 + q_of_col(64 * hf + 8 * g + 2 * t + e);
        if (q < Sq) atomicAdd(ws + pass * n_rows + row0 + q, rs[e]);
      }
    }
}

// ---- producer fills (main kernel; one producer warp per operand) ----------------------
//
// NOTE: rolled loops with the row permutation computed per row (the row
// kernels' fills step rows by multiples of 16 to keep it: not possible with
// 32 threads), so a producer thread holds one operand's addresses at a time
// (setmaxnreg leaves it 24 registers).

// Columns [C0, C0 + W) (one head-dim block) of rows [s0, s0 + 128) of a [S][LD]
// FP8 matrix into a [128][128 B] swizzled tile, row n <- s0 + perm(n)
// (q_of_col or k_of_row); rows >= S zero-filled. NT threads, tid in [0, NT).
template <int LD, int C0, int W, bool kQueryOrder, int NT>
__device__ __forceinline__ void fill_rows_blk(uint8_t* dst, const uint8_t* src, int s0, int S, int tid) {
  constexpr int kChunks = W / 16;
  static_assert(kChunks == 4 || kChunks == 8, "64- or 128-channel blocks");
#pragma unroll 1
  for (int i = tid; i < kTile * kChunks; i += NT) {
    const int n = i / kChunks, c = i % kChunks;
    const int r = s0 + (kQueryOrder ? q_of_col(n) : k_of_row(n));
    const bool ok = r < S;
    cp_async16(dst + sw128(n, c), src + C0 + 16 * c + static_cast<int64_t>(ok ? r : 0) * LD, ok);
  }
}
// Every head-dim block of rows [s0, s0 + 128) of a [S][D] FP8 matrix (block b
// at dst + b * kTileBytes, as cp_rows lays them out).
template <int D, bool kQueryOrder, int NT>
__device__ __forceinline__ void fill_rows(uint8_t* dst, const uint8_t* src, int s0, int S, int tid) {
  fill_rows_blk<D, 0, bw_of<D, 0>(), kQueryOrder, NT>(dst, src, s0, S, tid);
  if constexpr (nb_of<D>() > 1) fill_rows_blk<D, 128, bw_of<D, 1>(), kQueryOrder, NT>(dst + kTileBytes, src, s0, S, tid);
}
// Positions [s0, s0 + 128) of `rows` sequence-contiguous rows (stride ld) into
// a swizzled tile (tile row = channel). Chunks past S are zero-filled; a
// partial chunk reads the padding codes (0, kernel_params_sm90.h), as cp_cols.
template <int NT>
__device__ __forceinline__ void fill_cols(uint8_t* dst, const uint8_t* src, int64_t ld, int rows, int s0, int S,
                                          int tid) {
#pragma unroll 1
  for (int i = tid; i < rows * 8; i += NT) {
    const int r = i >> 3, c = i & 7;
    const bool ok = s0 + 16 * c < S;
    cp_async16(dst + sw128(r, c), src + r * ld + (ok ? s0 + 16 * c : 0), ok);
  }
}

// ---- the pre-pass tail -----------------------------------------------------------------

// cs[2j + e]: this thread's sum over its keys of P dP_hat for column 8j + 2t + e
// of its warp's 64 query columns, cp[2j + e] the same of P. The 8 warps form
// kGroups groups of kWarps / kGroups consecutive warps; group G's columns are
// columns [64 G, 64 G + 64) of the NQ = 64 kGroups columns (column n is query
// m0 + q_of_col(n)). v1 (kGroups = 1): all 8 warps see the same 64 queries (16
// keys each); v2 (kGroups = 2): warpgroup G = query sub-tile G, whose 4 warps
// (16 keys of each 64-key half each) hold every key of its queries. Sums over
// the 8 lanes g of a warp, then over the warps of the group (sRed, sRedP: 8 x 64
// floats of shared memory each), and finishes the queries < Sq
// (prepass_finish_row: delta_dm = sum P dP_hat / sum P, delta for
// delta_matching, the backward-consistent LSE) at rows bhq head_rows + tok0 + q
// of the per-row arrays (dense: head_rows = Sq, tok0 = 0; a packed batch:
// total_q and the sequence's first token tok_q). Contains a __syncthreads (NT threads).
// NOTE: the row wgmma pre-pass has the same tail inline; calling this from it
// changed its SASS (more spills at d >= 192 under nvcc 13.0), so it keeps its copy.
template <int NQ, int NT, int kGroups = 1>
__device__ __forceinline__ void prepass_store_delta(float (&cs)[16], float (&cp)[16], float* sRed, float* sRedP,
                                                    int warp, int lane, int m0, int Sq, int64_t bhq,
                                                    int64_t head_rows, int tok0, const KernelParams& p) {
  static_assert(NQ == 64 * kGroups && kWarps % kGroups == 0, "16 sums per thread: 8 n8 tiles of 64 columns per group");
  constexpr int kGroupWarps = kWarps / kGroups;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 16; ++i)
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) {
      cs[i] += __shfl_xor_sync(0xffffffffu, cs[i], o);
      cp[i] += __shfl_xor_sync(0xffffffffu, cp[i], o);
    }
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sRed[warp * 64 + 8 * j + 2 * t + e] = cs[2 * j + e];
        sRedP[warp * 64 + 8 * j + 2 * t + e] = cp[2 * j + e];
      }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NQ; i += NT) {
    const int q = m0 + q_of_col(i);  // q_of_col permutes within 16 columns: group i / 64's column i % 64
    if (q >= Sq) continue;
    const float* r = sRed + (i / 64) * kGroupWarps * 64 + i % 64;
    const float* rp = sRedP + (i / 64) * kGroupWarps * 64 + i % 64;
    float s = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < kGroupWarps; ++w) {
      s += r[w * 64];
      l += rp[w * 64];
    }
    prepass_finish_row(p, bhq * head_rows + (tok0 + q), s, l);
  }
}

}  // namespace ts
}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
