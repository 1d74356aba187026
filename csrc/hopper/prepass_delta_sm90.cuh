// fp8attn: the per-row finish every Delta-Matching pre-pass shares (`row`
// wgmma and `tile`): the delta and the backward-consistent LSE
// (numerics.md section 4, "Backward-consistent LSE").
//
// The pre-pass recomputes S with the main kernel's instructions and forms
// P = exp(S - LSE) from the forward's LSE. Where the backward's S differs from
// the forward's (wgmma accumulation order, FP32 online-softmax rounding), P's
// row sum l = sum_j P_ij is 1 + O(S error), not 1, and dS = P o (dP_hat - delta)
// then sums to delta (1 - l) instead of 0. The pre-pass therefore also sums P
// and writes
//   delta_dm_i = (sum_j P_ij dP_hat_ij) / l_i  and  lse_bwd_i = LSE_i + ln l_i,
// and the main kernel of a delta_matching backward reads lse_bwd: its P =
// exp(S - lse_bwd) = P / l sums to 1 to FP32 rounding, and sum_j dS_ij = 0 to
// rounding at any logit scale (the common factor of the lse_bwd rounding cancels
// between sum_j P dP_hat and delta sum_j P).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace bwd {

// s = sum_j P_ij dP_hat_ij, l = sum_j P_ij of query row `row` ([B, Hq, Sq] index;
// a packed batch's [Hq, total_q], varlen_sm90.h),
// P from the forward's LSE. A row that sees no key (l = 0, LSE = -inf) keeps
// delta = s = 0 and its LSE.
__device__ __forceinline__ void prepass_finish_row(const KernelParams& p, int64_t row, float s, float l) {
  if (p.prepass_sums) {  // one key shard of a sharded pre-pass (numerics.md section 11)
    p.delta_dm[row] = s;
    p.lse_bwd[row] = l;
    return;
  }
  const bool norm = l > 0.f;
  const float delta = norm ? __fdiv_rn(s, l) : s;
  p.delta_dm[row] = delta;
  if (p.delta_mode == static_cast<int>(DeltaMode::kDeltaMatching)) p.delta[row] = delta;
  if (p.lse_bwd != nullptr) p.lse_bwd[row] = norm ? __fadd_rn(p.lse[row], logf(l)) : p.lse[row];
}

}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
