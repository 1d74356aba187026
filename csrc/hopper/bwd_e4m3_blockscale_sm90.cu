// fp8attn: sm_90a FP8 backward: run_bwd (the entry point of both recipes)
// and the small row kernels around the main kernels (numerics.md sections
// 3-5): the row delta (stale, matched_do), dq_accum -> BF16 for the `row`
// recipe, and the diagnostics' finish.
//
// The kernels run_bwd launches: `row` recipe: the wgmma pre-pass and main
// kernel (bwd_wgmma_e4m3_blockscale_sm90.cu); `tile` recipe: its own pair
// (bwd_tilescale_sm90.h). NOTE: the mma.sync backward (main kernel in this
// file, pre-pass in bwd_prepass_e4m3_blockscale_sm90.cu) and its knob
// FP8ATTN_BWD_KERNEL were removed on 2026-12-07: the wgmma kernels serve every
// head-dim pair they did (docs/kernels/bwd_sm90.md; code at f7729f9).
#include "hopper/bwd_sm90.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/error.h"
#include "hopper/bwd_tile_sm90.cuh"
#include "hopper/bwd_tilescale_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/scheduler_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {
namespace {

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("fp8attn: ") + what + " launch failed: " + cudaGetErrorString(err));
}

// delta for stale (<dO_i, O_i>, BF16 operands) or matched_do (<dO_hat_i, O_i>,
// decoded row-blocked dO), FP32 sums; one warp per row. kVarlen (a packed
// batch, `tile` only, varlen_sm90.h): one warp per padded row of
// [Hq, seqlen_q_pad] (the dO codes' and scales' row), its token row
// (h total_q + token) for O, dO and delta; padding rows have no warp's work.
template <bool kMatched, bool kVarlen>
__global__ void bwd_delta_kernel(const KernelParams p) {
  const int64_t n_rows = static_cast<int64_t>(p.batch) * p.num_heads_q * (kVarlen ? p.seqlen_q_pad : p.seqlen_q);
  int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= n_rows) return;
  int64_t code_row = row;  // the row of do_row / do_row_s
  int s, h, b;
  if constexpr (kVarlen) {
    h = static_cast<int>(row / p.seqlen_q_pad);
    b = 0;
    SeqInfo si;
    int local;
    if (!varlen_q_row(p, row - int64_t{h} * p.seqlen_q_pad, si, local)) return;  // warp-uniform
    s = static_cast<int>(si.tok_q) + local;
    row = int64_t{h} * p.seqlen_q + s;
  } else {
    s = static_cast<int>(row % p.seqlen_q);
    const int64_t bh = row / p.seqlen_q;
    h = static_cast<int>(bh % p.num_heads_q), b = static_cast<int>(bh / p.num_heads_q);
  }
  const int dv = p.head_dim_v, nb = num_dim_blocks(dv);
  const __nv_bfloat16* o = static_cast<const __nv_bfloat16*>(p.o) + b * p.o_sb + s * p.o_ss + h * p.o_sh;
  const __nv_bfloat16* d = static_cast<const __nv_bfloat16*>(p.dout) + b * p.do_sb + s * p.do_ss + h * p.do_sh;
  const Fp8Format fmt = static_cast<Fp8Format>(p.grad_format);
  float sum = 0.f;
  for (int c = lane; c < dv; c += 32) {
    float x;
    if constexpr (kMatched) {
      // `tile` (numerics.md section 9): one dO scale per row over all of dv.
      const int64_t si =
          p.scaling == static_cast<int>(Scaling::kTile) ? code_row : code_row * nb + c / dim_block(dv);
      x = fp8_decode(p.do_row[code_row * dv + c], fmt) * p.do_row_s[si];
    } else {
      x = __bfloat162float(d[c]);
    }
    sum += x * __bfloat162float(o[c]);
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (lane == 0) p.delta[row] = sum;
}

// dq = BF16(tau * dq_accum), contiguous [B, Hq, Sq, Dqk].
__global__ void bwd_dq_convert_kernel(const float* __restrict__ acc, __nv_bfloat16* __restrict__ dq,
                                      int64_t n, float tau) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= n) return;  // n is a multiple of 4 (head_dim >= 64)
  const float4 v = *reinterpret_cast<const float4*>(acc + i);
  __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(dq + i);
  out[0] = __floats2bfloat162_rn(__fmul_rn(v.x, tau), __fmul_rn(v.y, tau));
  out[1] = __floats2bfloat162_rn(__fmul_rn(v.z, tau), __fmul_rn(v.w, tau));
}

// diag [4, B, Hq, Sq] = (delta, eps, rowsum_pre, rowsum_post) from delta,
// delta_dm and the row-sum workspace; rows that see no key get zeros.
// kVarlen (a packed batch, varlen_sm90.h): diag [4, Hq, total_q]; one thread
// per padded row of [Hq, seqlen_q_pad], the rows of a sequence at its token
// rows with its own lengths (window); padding rows write nothing.
template <bool kVarlen>
__global__ void bwd_diag_finish_kernel(const KernelParams p) {
  const int64_t n = static_cast<int64_t>(p.batch) * p.num_heads_q * p.seqlen_q;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int qi = 0, seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k;  // the query within its sequence, its lengths
  if constexpr (kVarlen) {
    if (i >= int64_t{p.num_heads_q} * p.seqlen_q_pad) return;
    const int h = static_cast<int>(i / p.seqlen_q_pad);
    SeqInfo si;
    if (!varlen_q_row(p, i - int64_t{h} * p.seqlen_q_pad, si, qi)) return;
    seqlen_q = si.seqlen_q;
    seqlen_k = si.seqlen_k;
    i = int64_t{h} * p.seqlen_q + si.tok_q + qi;
  } else {
    if (i >= n) return;
  }
  const float* ws = p.rowsum_ws;
  const bool empty = p.lse[i] == -INFINITY;
  const float delta = p.delta[i];
  // NOTE: a row that sees < 2 keys has dS == 0 in exact arithmetic; its ratio
  // would only measure rounding noise, so it reports 0 (numerics.md section 7).
  // The keys it sees: its window (numerics.md section 14; causal: (-1, 0)).
  if constexpr (!kVarlen) qi = static_cast<int>(i % p.seqlen_q);
  const IndexRange keys = window_keys(qi, qi + 1, seqlen_q, seqlen_k, p.window_left, p.window_right);
  const int nvis = keys.end - keys.begin;
  const bool no_ratio = empty || nvis < 2;
  p.diag[i] = empty ? 0.f : delta;
  p.diag[n + i] = empty ? 0.f : delta - p.delta_dm[i];
  // A non-finite dS row reports NaN so monitoring sees it (like the reference).
  auto ratio = [no_ratio](float sum, float sum_abs) {
    if (!isfinite(sum) || !isfinite(sum_abs)) return NAN;
    return (no_ratio || !(sum_abs > 0.f)) ? 0.f : fabsf(sum) / sum_abs;
  };
  p.diag[2 * n + i] = ratio(ws[i], ws[n + i]);
  p.diag[3 * n + i] = ratio(ws[2 * n + i], ws[3 * n + i]);
}

}  // namespace

}  // namespace bwd

void run_bwd_dq_convert(const KernelParams& p, cudaStream_t stream) {
  using namespace bwd;
  if (p.dq == nullptr || p.dq_accum == nullptr)
    throw std::invalid_argument("fp8attn: run_bwd_dq_convert: needs dq and dq_accum");
  if (p.batch == 0 || p.num_heads_q == 0 || p.seqlen_q == 0) return;
  // (`tile`: dq_accum in 64-query chunks, kernel_params_sm90.h dq_accum_rows.)
  if (p.scaling == static_cast<int>(Scaling::kTile)) {
    ts::launch_tilescale_dq_convert(p, stream);
  } else {
    const int64_t n_dq = static_cast<int64_t>(p.batch) * p.num_heads_q * p.seqlen_q * p.head_dim_qk;
    bwd_dq_convert_kernel<<<static_cast<unsigned>((n_dq / 4 + 255) / 256), 256, 0, stream>>>(
        p.dq_accum, static_cast<__nv_bfloat16*>(p.dq), n_dq, p.softmax_scale);
    check_launch("bwd dq convert kernel");
  }
}

void run_bwd(const KernelParams& p, cudaStream_t stream) {
  using namespace bwd;
  if (p.block_size != kTile)
    throw std::runtime_error("fp8attn: argument 'block_size': the CUDA backward supports 128 only, got " +
                             std::to_string(p.block_size));
  if (!supported_head_dims(p.head_dim_qk, p.head_dim_v))
    throw std::runtime_error("fp8attn: argument 'head_dim': the CUDA backward supports (64, 64), (128, 128), "
                             "(256, 256) and (192, 128) for (head_dim_qk, head_dim_v), got (" +
                             std::to_string(p.head_dim_qk) + ", " + std::to_string(p.head_dim_v) + ")");
  if (p.grad_format != kFmtE4M3 && p.grad_format != kFmtE5M2)
    throw std::runtime_error("fp8attn: argument 'grad_format': expected E4M3 (0) or E5M2 (1), got " +
                             std::to_string(p.grad_format));
  if (p.delta_mode < 0 || p.delta_mode > 2)
    throw std::runtime_error("fp8attn: argument 'delta_mode': expected 0, 1 or 2, got " +
                             std::to_string(p.delta_mode));
  if (p.num_heads_kv < 1 || p.num_heads_q % p.num_heads_kv != 0)
    throw std::runtime_error("fp8attn: argument 'num_heads_q': must be a multiple of num_heads_kv");
  if ((p.diag == nullptr) != (p.rowsum_ws == nullptr))
    throw std::runtime_error("fp8attn: argument 'diag': diag and rowsum_ws must both be set or both null");
  // Softcap (numerics.md section 12): the `tile` kernels' kSoftcap
  // instantiations, dense batches only (varlen_attention runs a packed batch
  // with softcap per sequence).
  if (p.softcap != 0.f) {
    if (!(p.softcap > 0.f) || !(p.softcap <= 3.4e38f))
      throw std::invalid_argument("fp8attn: argument 'softcap': must be finite and > 0 (0 = off), got " +
                                  format_float(p.softcap));
    if (p.scaling != static_cast<int>(Scaling::kTile) || p.num_seqs > 0)
      throw std::invalid_argument("fp8attn: argument 'softcap': the CUDA backward takes it with the `tile` recipe "
                                  "(scaling 1) on dense batches only");
  }
  // A packed batch (varlen_sm90.h): the `tile` kernels' kVarlen instantiations,
  // one launch each (heads and kv heads x slices <= 65535: never chunked,
  // launch_sm90.h at_chunk); the padded rows are whole tiles per head.
  const bool varlen = p.num_seqs > 0;
  if (varlen) {
    if (p.scaling != static_cast<int>(Scaling::kTile))
      throw std::invalid_argument("fp8attn: run_bwd: a packed (varlen) batch needs the `tile` recipe (scaling 1); "
                                  "the `row` backward is dense-only");
    if (p.prepass_sums)
      throw std::invalid_argument("fp8attn: run_bwd: 'prepass_sums' (the sharded pre-pass) is dense-only");
    if (p.batch != 1 || p.varlen_meta == nullptr || p.num_heads_q > kMaxGridYZ ||
        int64_t{p.num_heads_kv} * bwdts::slices(p.head_dim_qk, p.head_dim_v) > kMaxGridYZ || p.q_tiles_max <= 0 ||
        p.k_tiles_max <= 0 || p.seqlen_q_pad != int64_t{p.q_tiles_max} * kTile ||
        p.seqlen_k_pad != int64_t{p.k_tiles_max} * kTile)
      throw std::runtime_error(
          "fp8attn: run_bwd: a packed batch needs batch 1, its metadata, heads (and kv heads x slices) <= 65535 and "
          "seqlen_*_pad = *_tiles_max * 128");
  }
  // Deterministic dQ (KernelParams::dq_sem): the `tile` main kernel's turns, dense batches.
  if (p.dq_sem != nullptr && (p.scaling != static_cast<int>(Scaling::kTile) || varlen))
    throw std::invalid_argument("fp8attn: argument 'deterministic': the deterministic CUDA backward runs with the "
                                "`tile` recipe (scaling 1) on dense batches only");
  if (p.batch == 0 || p.num_heads_q == 0 || p.seqlen_q == 0) return;  // nothing to compute
  if (p.seqlen_k == 0)
    throw std::runtime_error("fp8attn: argument 'seqlen_k': the CUDA backward needs seqlen_k >= 1");

  if (p.scaling != static_cast<int>(Scaling::kRow) && p.scaling != static_cast<int>(Scaling::kTile))
    throw std::runtime_error("fp8attn: argument 'scaling': expected Scaling::kRow (0) or kTile (1), got " +
                             std::to_string(p.scaling));
  const bool dm = p.delta_mode == static_cast<int>(DeltaMode::kDeltaMatching);
  const bool tile = p.scaling == static_cast<int>(Scaling::kTile);
  const int64_t n_rows = static_cast<int64_t>(p.batch) * p.num_heads_q * p.seqlen_q;
  // The row kernels below (delta, diagnostics) of a packed batch walk the padded rows.
  const int64_t n_rows_k = varlen ? static_cast<int64_t>(p.num_heads_q) * p.seqlen_q_pad : n_rows;

  // 1. delta: Delta-Matching pre-pass (also for eps diagnostics) and/or the row delta.
  // NOTE: the pre-pass and the main kernel must be one pair (`row`: the wgmma
  // kernels; `tile`, numerics.md section 9: its own, bwd_tilescale_sm90.h):
  // Delta-Matching needs their dP_hat bitwise equal.
  const auto prepass = tile ? ts::launch_tilescale_prepass : launch_wgmma_prepass;
  if (p.prepass_sums) {  // the partial sums of one key shard only (numerics.md section 11)
    if (!dm || p.lse_bwd == nullptr || p.diag != nullptr)
      throw std::runtime_error("fp8attn: argument 'prepass_sums': needs delta_matching, lse_bwd and no diag");
    prepass(p, stream);
    return;
  }
  if (p.delta_given && (!dm || p.diag != nullptr))
    throw std::runtime_error("fp8attn: argument 'delta': a given delta needs delta_matching and no diag");
  if ((dm && !p.delta_given) || p.diag != nullptr) prepass(p, stream);
  if (!dm) {
    const int rows_per_block = 8;
    const dim3 grid(static_cast<unsigned>((n_rows_k + rows_per_block - 1) / rows_per_block));
    const bool matched = p.delta_mode == static_cast<int>(DeltaMode::kMatchedDO);
    auto delta_kernel = varlen ? (matched ? bwd_delta_kernel<true, true> : bwd_delta_kernel<false, true>)
                               : (matched ? bwd_delta_kernel<true, false> : bwd_delta_kernel<false, false>);
    delta_kernel<<<grid, 32 * rows_per_block, 0, stream>>>(p);
    check_launch("bwd delta kernel");
  }
  // 2. main backward: dK, dV, dq_accum (+ row-sum workspace). Delta-Matching
  // reads the pre-pass's backward-consistent LSE (prepass_delta_sm90.cuh,
  // numerics.md section 4): its P sums to 1 to FP32 rounding.
  KernelParams pm = p;
  if (dm && p.lse_bwd != nullptr && !p.delta_given) pm.lse = p.lse_bwd;
  (tile ? ts::launch_tilescale_main : launch_wgmma_main)(pm, stream);
  // 3. dQ to BF16 (p.dq null: the caller runs run_bwd_dq_convert later, once the
  // quantized operands are freed and dQ can take their memory).
  if (p.dq != nullptr) run_bwd_dq_convert(p, stream);
  // 4. diagnostics.
  if (p.diag != nullptr) {
    auto diag_kernel = varlen ? bwd_diag_finish_kernel<true> : bwd_diag_finish_kernel<false>;
    diag_kernel<<<static_cast<unsigned>((n_rows_k + 255) / 256), 256, 0, stream>>>(p);
    check_launch("bwd diagnostics kernel");
  }
}

}  // namespace sm90
}  // namespace fp8attn
