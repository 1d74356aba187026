// fp8attn: logit softcapping on the sm_90a `tile` kernels (numerics.md section
// 12): the scaled logits x = tau S become x' = c tanh(x / c) before the softmax
// (the mask after the cap), and the backward's softmax-input gradient dX' is
// multiplied by the cap's derivative 1 - tanh^2(x / c) before matmuls #6 / #7
// quantize it. The one place the kernels' cap arithmetic is written (forward:
// softmax_tilescale_sm90.cuh softcap_tile; backward and its pre-pass:
// mainloop_bwd_tilescale_sm90.cuh p_softcap).
//
// The kernels work in log2 units: u = x log2(e) (the S accumulator times the
// row / column coefficient they already form). With C = c log2(e) the capped
// logit in log2 units is y = x' log2(e) = C tanh(u / C), and with
//   r = 1 / (1 + 2^(u 2 / c))        (= 1 / (1 + e^(2 x / c)))
//   tanh(x / c) = 1 - 2 r,  y = C - 2 C r,  1 - tanh^2(x / c) = 4 r (1 - r)
// (4 r (1 - r): no cancellation where |tanh| is near 1). 2 / c is folded into
// the coefficient (per row and key tile in the forward, per query column in the
// backward), so per element: one FMUL, ex2.approx, one FADD, rcp.approx, one
// FFMA. Accuracy: with ex2.approx and rcp.approx (~2 and 1 ulp) and the
// roundings, r is within ~2e-7 relative and y within ~5e-7 C of C tanh(u / C)
// (with IEEE exp2 and division, float32, 3.1e-7 C measured on a dense grid:
// tests/python/test_softcap.py test_kernel_formula_is_the_cap): ~4e-5 in log2
// units at c = 50, a relative error of ~3e-5 in P (tanh.approx.f32, 2^-11
// relative, would give up to ~0.035); 4 r (1 - r) within ~1e-6 absolute. The
// error is absolute in units of C (C - 2 C r cancels where |u| << C): for a c far
// above the logits it outgrows the logits' own rounding, so the op takes c in
// [1e-6, 1e4] on CUDA (csrc/torch/ops_cuda.cpp cuda_softcap).
// Both approximations take +-inf and NaN as needed: u2 -> +inf gives 2^u2 =
// inf, r = 0, y = C; u2 -> -inf gives 2^u2 = 0, r = 1, y = -C; NaN stays NaN.
#pragma once

#include <cuda_runtime.h>

namespace fp8attn {
namespace sm90 {

// The per-call constants of a softcap c > 0 (KernelParams::softcap), formed
// the same way in every kernel (the pre-pass and the main kernel of the
// backward must form bitwise the same P): k2 = 2 / c (folded into the
// coefficients), C = c log2(e), m2C = -2 C.
struct Softcap {
  float k2, C, m2C;
};
__device__ __forceinline__ Softcap softcap_consts(float c) {
  const float C = __fmul_rn(c, 1.4426950408889634f);
  return {__fdiv_rn(2.f, c), C, __fmul_rn(-2.f, C)};
}

__device__ __forceinline__ float softcap_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float softcap_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// r = 1 / (1 + 2^u2) of u2 = u (2 / c) (the coefficient already holds 2 / c).
__device__ __forceinline__ float softcap_r(float u2) { return softcap_rcp(__fadd_rn(1.f, softcap_ex2(u2))); }
// The capped logit in log2 units, y = C - 2 C r.
__device__ __forceinline__ float softcap_y(float r, const Softcap& sc) { return fmaf(r, sc.m2C, sc.C); }
// The cap's derivative 1 - tanh^2 = 4 r (1 - r), in [0, 1]; 0 for a NaN r.
// NOTE: a NaN r (a NaN S) has a NaN P wherever the element is visible, so dX'
// and dX are NaN there anyway; where it is masked, dX' is an exact 0 and the
// derivative must not turn it into 0 * NaN (fmaxf drops the NaN).
__device__ __forceinline__ float softcap_grad(float r) { return fmaxf(__fmul_rn(4.f, fmaf(-r, r, r)), 0.f); }

}  // namespace sm90
}  // namespace fp8attn
