// fp8attn: CPU reference attention, the oracle for every test and the path
// that runs where there is no GPU. Math: numerics.md sections 1 (exact path)
// and 3-5 (fp8 path, delta modes, diagnostics).
#pragma once

#include "common/params.h"

namespace fp8attn {

// Validates params against the views (shapes, head dims 1..256, GQA ratio,
// block size, dtypes) and throws ArgumentError naming the argument.
void check_attention_params(const AttnParams& p);

// Forward. q,k,v,o: strided views (see TensorView); o has the dtype the caller
// wants (rounded to it with RNE). lse: contiguous FP32 [batch, num_heads_q,
// seqlen_q], natural log; -inf for a row that sees no key (then O row = 0).
void attention_forward_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& o, float* lse);

// Backward. o: the saved forward output (used by the stale / matched_do
// deltas); lse from the forward. dq/dk/dv: strided outputs, fully written
// (GQA: dk/dv summed over the query heads of the group). diag: optional
// per-row diagnostics (numerics.md section 5); nullptr or null members = off.
void attention_backward_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& dout,
                            const float* lse, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv, const BackwardDiagnostics* diag);

}  // namespace fp8attn
