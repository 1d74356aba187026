// fp8attn: what the sm_90a `tile` forward writes: O = acc * u / l as BF16
// ([B, Hq, Sq, Dv] contiguous; a packed batch token-major [total_q, Hq, Dv]) and LSE = (m + log2 l) ln 2 (FP32 [B, Hq, Sq]);
// numerics.md sections 1 and 9. A row that sees no key (l == 0) gets O = 0
// and LSE = -inf; a NaN l (non-finite input it sees) propagates into both.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "hopper/softmax_tilescale_sm90.cuh"

namespace fp8attn {
namespace sm90 {

// o: this thread's m64 x kDv accumulator fragment (rows row0, row0 + 8 of its
// warp; columns 8t + 2 tig, + 1), in units 2^st.e of its row. Row r of the
// work tile's sequence: O at out + o_base + r o_row_stride (BF16 elements),
// LSE at lse[lse_base + r]; rows >= seqlen_q are not written.
template <int kDv>
__device__ __forceinline__ void store_o_lse(const float (&o)[kDv / 2], const TileSoftmaxState& st, void* out,
                                            float* lse, int64_t o_base, int64_t o_row_stride, int64_t lse_base,
                                            int seqlen_q, int row0, int tig) {
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = st.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = row0 + 8 * r;
    if (row >= seqlen_q) continue;
    const float inv_l = l == 0.f ? 0.f : 1.f / l;
    // NOTE: u = 2^e may lie outside the normal range (e in [-190, 119]): two
    // exact power-of-two factors, each within it.
    const int e1 = st.e[r] / 2, e2 = st.e[r] - e1;
    // NOTE: a row that sees no key writes exact zeros (not o * 0: its P = 0
    // times a NaN V code of a tile its warpgroup computes would give NaN).
    const float f1 = l == 0.f ? 0.f : pow2i(e1), f2 = pow2i(e2) * inv_l;
    __nv_bfloat16* out_row = static_cast<__nv_bfloat16*>(out) + o_base + row * o_row_stride;
#pragma unroll
    for (int t = 0; t < kDv / 8; ++t) {
      const __nv_bfloat162 v2 =
          l == 0.f ? __floats2bfloat162_rn(0.f, 0.f)
                   : __floats2bfloat162_rn((o[4 * t + 2 * r] * f1) * f2, (o[4 * t + 2 * r + 1] * f1) * f2);
      *reinterpret_cast<__nv_bfloat162*>(out_row + 8 * t + 2 * tig) = v2;
    }
    if (tig == 0) lse[lse_base + row] = l == 0.f ? -INFINITY : (st.m[r] + __log2f(l)) * kLn2;
  }
}

}  // namespace sm90
}  // namespace fp8attn
