// fp8attn: CUDA implementations of the ops `fwd`, `bwd`, `fwd_varlen`, `bwd_varlen` and the quantizations
// (schemas in ops.cpp, semantics in docs/architecture.md and docs/numerics.md).
// Built only with FP8ATTN_BUILD_CUDA=1 (sm_90a kernels in csrc/hopper/).
//
// What the CUDA path supports (anything else raises a clear error naming the
// argument):
//   - q, k, v (and dout, out for bwd) bfloat16 or float32 CUDA tensors on one
//     device, q, k, v of one dtype, [batch, heads, seqlen, head_dim], any
//     strides (copied to a contiguous tensor when the head_dim stride is not 1
//     or rows are not 16-byte aligned). float32 inputs are rounded to bfloat16
//     first (the kernels read BF16; one extra rounding of at most 2^-9
//     relative before the FP8 quantization, whose step is 2^-4 in E4M3), and
//     the outputs come back as float32 (out, dq, dk, dv in the dtype of q, k,
//     v; their values are BF16 numbers). float64 / float16 raise TypeError;
//   - every head_dim_qk, head_dim_v in [1, 256]: the kernels are instantiated
//     for (64,64), (128,128), (192,128), (256,256); any other pair is padded
//     with zero channels to the first of those that covers it
//     (kernel_head_dims, config_sm90.h; exact under the FP8 recipe, the
//     comment there and numerics.md section 7), and O, dQ, dK, dV are sliced
//     back (a copy of each). softmax_scale is the caller's (the Python layer's
//     default is 1/sqrt of the true head_dim_qk);
//   - block_size == 128 (other block sizes: the CPU reference only; ValueError);
//     num_heads_q a multiple of num_heads_kv (GQA);
//   - any batch x heads (< 2^31 (b, h) pairs; more than 65535 run as several
//     launches, hopper/launch_sm90.h) and seqlen < 2^30 (element offsets are
//     64-bit: tensors of 2^31 and more elements work);
//   - precision == "fp8". precision == "exact" raises NotImplementedError: the
//     exact path (FP64 accumulation, numerics.md section 1) is the CPU
//     reference's job; call the op on CPU tensors for it. NOTE: a silent
//     device->host fallback was rejected because it would hide a large
//     slowdown (host FP64 attention) inside a training step.
// Errors: ValueError (TORCH_CHECK_VALUE) for a bad argument or a bad
// FP8ATTN_* environment knob, TypeError for a wrong dtype, NotImplementedError
// for precision "exact" or a missing backward kernel, RuntimeError for a GPU
// that is not compute capability 9.0 (device_check.h: checked before any
// launch) and for a CUDA launch failure. fp8_encode, fp8_decode and
// dequantize_blockwise have CPU kernels only: ValueError on CUDA tensors.
//
// Work per call (stream = the current torch CUDA stream of q's device):
//   fwd: [pad / convert Q, K, V] -> quantize Q (row), K (row), V (column) ->
//        run_fwd -> [slice / convert O]. scaling="tile": quantize Q (per row),
//        K (per tile), V (per tile, transposed) -> run_fwd_tile (numerics.md s.9).
//        The CUDA backward of "tile" (same quantizations plus Q, dO per tile
//        transposed, K transposed, V per tile -> run_bwd with scaling = tile)
//        runs by default; FP8ATTN_TILE_BWD=0 makes it raise NotImplementedError
//        naming `scaling`.
//   fwd_varlen / bwd_varlen (packed batches, scaling "tile"): metadata from
//        cu_seqlens on the device -> the same quantizations into the padded
//        layout -> run_fwd_tile / run_bwd with num_seqs > 0 -> clear the tokens
//        outside every sequence (hopper/varlen_sm90.h).
//   bwd: [pad / convert Q, K, V, O, dO] -> quantize Q, K, dO (row and column), V (row) -> allocate the backward
//        workspace (delta, delta_dm, lse_bwd for delta_matching, zeroed dq_accum, zeroed rowsum_ws when
//        diagnostics) -> run_bwd (csrc/hopper/bwd_sm90.h) -> [slice / convert dQ, dK, dV].
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>

#include "common/env_choice.h"
#include "common/params.h"
#include "device_check.h"
#include "op_args.h"
#include "op_stubs.h"
#include "hopper/config_sm90.h"
#include "hopper/fwd_e4m3_blockscale_sm90.h"
#include "hopper/fwd_tilescale_e4m3_sm90.h"
#include "hopper/hadamard_rows_bf16_sm90.h"
#include "hopper/kernel_params_sm90.h"
#include "hopper/quant_e4m3_blockscale_sm90.h"
#include "hopper/quant_tilescale_e4m3_sm90.h"
#include "hopper/varlen_sm90.h"
#if __has_include("hopper/bwd_sm90.h")
#include "hopper/bwd_sm90.h"
#endif

namespace fp8attn {
namespace sm90 {
// NOTE: weak, so the library links (and fwd works) before the backward
// kernels exist; bwd_cuda checks the address and raises NotImplementedError.
__attribute__((weak)) void run_bwd(const KernelParams& p, cudaStream_t stream);
}  // namespace sm90

namespace {

using namespace sm90;

// ---- argument checks ------------------------------------------------------------

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined(), "fp8attn: argument '", name, "': tensor is undefined");
  TORCH_CHECK_VALUE(t.is_cuda(), "fp8attn: argument '", name, "': expected a CUDA tensor, got device ",
                    t.device());
  TORCH_CHECK_VALUE(t.device() == device, "fp8attn: argument '", name,
                    "': must be on the same device as 'q' (", device, "), got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 4, "fp8attn: argument '", name,
                    "': expected a 4-D tensor [batch, heads, seqlen, head_dim], got ", t.dim(),
                    "-D with shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, "fp8attn: argument '", name,
                   "': dtype must be bfloat16 or float32 (rounded to bfloat16) on CUDA, got ", t.scalar_type());
}

void check_size(const at::Tensor& t, int dim, int64_t expected, const char* name, const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, "fp8attn: argument '", name, "': ", what, " (dim ", dim,
                    ") must be ", expected, ", got ", t.size(dim), " (shape ", t.sizes(), ")");
}

// Stride of dim i as the kernels use it: 0 for a size-1 dim (index always 0).
int64_t eff_stride(const at::Tensor& t, int i) { return t.size(i) == 1 ? 0 : t.stride(i); }

// Whether t's head_dim is contiguous and its rows start on 16-byte boundaries
// (the quantization kernels' 16-byte loads; strides checked in multiples of 8
// elements, which covers BF16 and float32 rows).
bool rows_aligned(const at::Tensor& t) {
  return (t.size(3) == 1 || t.stride(3) == 1) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
         eff_stride(t, 0) % 8 == 0 && eff_stride(t, 1) % 8 == 0 && eff_stride(t, 2) % 8 == 0;
}

// t itself when rows_aligned, else a contiguous copy.
at::Tensor aligned_rows_copy(const at::Tensor& t) {
  return rows_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

void check_precision(c10::string_view precision) {
  TORCH_CHECK_NOT_IMPLEMENTED(precision != "exact",
                              "fp8attn: argument 'precision': \"exact\" has no CUDA implementation; "
                              "call the op on CPU tensors for the exact (FP64) reference, or use \"fp8\"");
  TORCH_CHECK_VALUE(precision == "fp8", "fp8attn: argument 'precision': expected \"fp8\" (or \"exact\" on CPU), got \"",
                    std::string(precision), "\"");
}

// A 0/1 knob that is on unless set to 0 (unset or empty: on); any other value is a
// ValueError naming the variable (common/env_choice.h).
bool env_flag_on(const char* name) {
  int v = -1;
  try {
    v = env_choice(name, {"0", "1"});
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return v != 0;
}

// numerics.md section 9: the `tile` recipe's CUDA kernels are gated until their
// GPU tests pass (FP8ATTN_TILE_FWD here, FP8ATTN_TILE_BWD below; a refused
// `tile` backward fails at backward time: autograd's forward runs the tile
// forward, its backward calls bwd); `tile` is never served by the row kernels.
// NOTE: FP8ATTN_TILE_FWD (docs/architecture.md, "Environment variables"): the
// `tile` forward kernels passed their GPU tests on the H200 (2026-12-02, native
// build: tests/python/test_tile_cuda.py with test_cuda.py, 481 passed), so they
// run by default; FP8ATTN_TILE_FWD=0 refuses a CUDA `tile` forward (a switch
// for bisecting; compute-sanitizer has not run on them yet).
bool tile_fwd_enabled() { return env_flag_on("FP8ATTN_TILE_FWD"); }

// numerics.md section 10.3: the raw CUDA ops rotate Q and K in the `tile`
// quantization (qk_rotation="hadamard", TileQuantJob::rotate) where the kernel
// head dims need no padding (head_dim_qk 64, 128, 192 or 256); K smoothing and
// the `row` recipe's rotation run around the raw ops (fp8attn.ops,
// python/fp8attn/qk_transform.py). Returns whether to rotate; raises
// NotImplementedError naming the argument for what the raw op cannot do.
// FP8ATTN_FUSED_ROTATION=0 refuses the fused rotation too (fp8attn.ops then
// rotates around the op, the A/B of docs/architecture.md "Environment variables").
bool fused_rotation_enabled() { return env_flag_on("FP8ATTN_FUSED_ROTATION"); }
bool cuda_qk_rotation(c10::string_view qk_rotation, bool smooth_k, Scaling recipe, int64_t head_dim_qk,
                      int64_t kernel_head_dim_qk) {
  TORCH_CHECK_NOT_IMPLEMENTED(!smooth_k,
                              "fp8attn: argument 'smooth_k': the raw CUDA op has no fused K smoothing; call "
                              "fp8attn.attention (it smooths around the kernels), or pass smooth_k=False");
  if (parse_qk_rotation(qk_rotation) == QkRotation::kNone) return false;
  TORCH_CHECK_NOT_IMPLEMENTED(recipe == Scaling::kTile && head_dim_qk == kernel_head_dim_qk &&
                                  fused_rotation_enabled(),
                              "fp8attn: argument 'qk_rotation': the raw CUDA op rotates in its quantization only "
                              "with scaling='tile' and head_dim_qk 64, 128, 192 or 256 (got scaling='",
                              recipe == Scaling::kTile ? "tile" : "row", "', head_dim_qk ", head_dim_qk,
                              fused_rotation_enabled() ? "" : ", FP8ATTN_FUSED_ROTATION=0",
                              "); call fp8attn.attention (it rotates around the kernels otherwise), or pass "
                              "qk_rotation='none'");
  return true;
}

// NOTE: FP8ATTN_TILE_BWD (docs/architecture.md, "Environment variables"): the
// `tile` backward kernels (hopper/bwd_tilescale_sm90.h) run by default since they
// passed their GPU tests and compute-sanitizer and measured faster than the `row`
// backward (docs/benchmarks.md 2026-12-07: 0.55-0.60x cuDNN BF16 against row's
// 0.52-0.55x); FP8ATTN_TILE_BWD=0 switches them off, and a `tile` backward on CUDA
// is then refused (never served by the row kernels).
bool tile_bwd_enabled() { return env_flag_on("FP8ATTN_TILE_BWD"); }

// The recipe of a backward call: `row`, or `tile` unless FP8ATTN_TILE_BWD=0.
Scaling check_bwd_scaling(c10::string_view scaling) {
  const Scaling recipe = parse_scaling(scaling);
  TORCH_CHECK_NOT_IMPLEMENTED(recipe == Scaling::kRow || tile_bwd_enabled(),
                              "fp8attn: argument 'scaling': the CUDA backward of scaling='tile' is switched off by "
                              "FP8ATTN_TILE_BWD=0; unset it (or set FP8ATTN_TILE_BWD=1) to run it, or use "
                              "scaling='row' or CPU tensors");
  return recipe;
}

// Problem sizes from q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv], checked;
// kqk, kv: the head dims of the kernel that runs it (kernel_head_dims: D, Dv
// padded with zero channels).
struct Problem {
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_k, dqk, dv, kqk, kv;
  bool empty() const { return batch == 0 || heads_q == 0 || seqlen_q == 0; }
};

Problem check_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale,
                      c10::string_view precision, int64_t block_size) {
  check_precision(precision);
  const at::Device device = q.device();
  check_cuda_tensor(q, "q", device);
  check_cuda_device(device);  // RuntimeError on a GPU that is not sm_90 (before any launch)
  check_cuda_tensor(k, "k", device);
  check_cuda_tensor(v, "v", device);
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), "fp8attn: argument 'k': must have q's dtype ",
                   q.scalar_type(), ", got ", k.scalar_type());
  TORCH_CHECK_TYPE(v.scalar_type() == q.scalar_type(), "fp8attn: argument 'v': must have q's dtype ",
                   q.scalar_type(), ", got ", v.scalar_type());
  Problem pr{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), 0, 0};
  check_size(k, 0, pr.batch, "k", "batch");
  check_size(v, 0, pr.batch, "v", "batch");
  check_size(k, 3, pr.dqk, "k", "head_dim (must equal q's)");
  check_size(v, 1, pr.heads_kv, "v", "num_heads (must equal k's)");
  check_size(v, 2, pr.seqlen_k, "v", "seqlen (must equal k's)");
  TORCH_CHECK_VALUE(pr.heads_kv >= 1 && pr.heads_q % pr.heads_kv == 0, "fp8attn: argument 'k': num_heads_kv (",
                    pr.heads_kv, ") must be >= 1 and divide num_heads_q (", pr.heads_q, ")");
  TORCH_CHECK_VALUE(pr.dqk >= 1 && pr.dqk <= kMaxHeadDim, "fp8attn: argument 'q': head_dim must be in [1, ",
                    kMaxHeadDim, "] on CUDA, got ", pr.dqk);
  TORCH_CHECK_VALUE(pr.dv >= 1 && pr.dv <= kMaxHeadDim, "fp8attn: argument 'v': head_dim must be in [1, ",
                    kMaxHeadDim, "] on CUDA, got ", pr.dv);
  const HeadDims kd = kernel_head_dims(static_cast<int>(pr.dqk), static_cast<int>(pr.dv));
  pr.kqk = kd.qk;
  pr.kv = kd.v;
  TORCH_CHECK_VALUE(block_size == kSeqBlock, "fp8attn: argument 'block_size': the CUDA kernels support 128 only, got ",
                    block_size, " (block sizes 32 and 64 run on the CPU reference: pass CPU tensors)");
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale > 0.0,
                    "fp8attn: argument 'softmax_scale': must be finite and > 0, got ", softmax_scale);
  constexpr int64_t kMaxSeq = (int64_t{1} << 30);
  TORCH_CHECK_VALUE(pr.seqlen_q < kMaxSeq && pr.seqlen_k < kMaxSeq,
                    "fp8attn: argument 'q': seqlen_q and seqlen_k must be < 2^30 on CUDA, got ", pr.seqlen_q, " and ",
                    pr.seqlen_k);
  // NOTE: (b, h) indices are int and TMA coordinates int32 (hopper/launch_sm90.h
  // splits grids past 65535); 2^31 (b, h) rows exceed any GPU's memory anyway.
  TORCH_CHECK_VALUE(pr.batch * pr.heads_q < (int64_t{1} << 31),
                    "fp8attn: argument 'q': batch * num_heads_q must be < 2^31 on CUDA, got ", pr.batch * pr.heads_q);
  return pr;
}

// x as the kernels read it: BF16 with head_dim d (x's channels, then zero
// channels up to d). x itself when it already is that (aligned_rows_copy: a copy
// only for a misaligned layout); else one copy, which also converts float32.
at::Tensor kernel_input(const at::Tensor& x, int64_t d) {
  if (x.scalar_type() == at::kBFloat16 && x.size(3) == d) return aligned_rows_copy(x);
  at::Tensor y = at::empty({x.size(0), x.size(1), x.size(2), d}, x.options().dtype(at::kBFloat16));
  if (d > x.size(3)) y.narrow(3, x.size(3), d - x.size(3)).zero_();
  y.narrow(3, 0, x.size(3)).copy_(x);
  return y;
}

// x as the fused rotation's quantization reads it (TileQuantJob::x_fp32): BF16
// as kernel_input gives it, any other dtype as float32 (exact for float16), so
// the rotation works on the values the unfused path reads (numerics.md 10.1).
at::Tensor rotation_input(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) return aligned_rows_copy(x);
  return aligned_rows_copy(x.to(at::kFloat));  // rows_aligned holds for float32 rows too
}

// The op's output from a kernel output y [B, H, S, kd] (BF16, contiguous): its
// first d channels in `dtype`, contiguous; y itself when that is the same.
at::Tensor op_output(const at::Tensor& y, int64_t d, at::ScalarType dtype) {
  if (y.size(3) == d && dtype == at::kBFloat16) return y;
  at::Tensor r = at::empty({y.size(0), y.size(1), y.size(2), d}, y.options().dtype(dtype));
  r.copy_(y.narrow(3, 0, d));
  return r;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Maps the launchers' exceptions to torch errors.
template <class Fn>
void launch(Fn&& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

// dQ / dK of the rotated problem mapped back (numerics.md 10.1 "Gradients"): g R^T
// row by row in FP32 from the kernel's BF16 g ([B, H, S, d] or [total, H, d]), rounded once to
// `dtype` (BF16 directly; else through float32, exact for float32).
at::Tensor rotate_back(const at::Tensor& g, at::ScalarType dtype, cudaStream_t stream) {
  const bool fp32 = dtype != at::kBFloat16;
  at::Tensor y = at::empty(g.sizes(), g.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  const at::Tensor gc = g.contiguous();
  const int64_t d = gc.size(-1);  // [B, H, S, d] or a packed [total, H, d]
  launch([&] {
    sm90::hadamard_rows_transposed_bf16_sm90(gc.data_ptr(), gc.numel() / d, static_cast<int>(d), y.data_ptr(), fp32,
                                             stream);
  });
  return y.scalar_type() == dtype ? y : y.to(dtype);
}

// Quantizes x [B, H, S, D] (BF16, aligned; B * H < 2^31, S < 2^30) on `stream`; outputs that are
// undefined tensors are not produced.
void quantize(const at::Tensor& x, Fp8Format fmt, const at::Tensor& row, const at::Tensor& row_s,
              const at::Tensor& colT, const at::Tensor& col_s, int64_t seqlen_pad, cudaStream_t stream) {
  QuantJob j;
  j.x = x.data_ptr();
  j.stride_batch = eff_stride(x, 0);
  j.stride_head = eff_stride(x, 1);
  j.stride_seq = eff_stride(x, 2);
  j.batch = static_cast<int>(x.size(0));
  j.heads = static_cast<int>(x.size(1));
  j.seqlen = static_cast<int>(x.size(2));
  j.dim = static_cast<int>(x.size(3));
  j.fmt = fmt;
  if (row.defined()) {
    j.row = row.data_ptr<uint8_t>();
    j.row_s = row_s.data_ptr<float>();
  }
  if (colT.defined()) {
    j.colT = colT.data_ptr<uint8_t>();
    j.col_s = col_s.data_ptr<float>();
    j.seqlen_pad = static_cast<int>(seqlen_pad);
  }
  launch([&] { quantize_bf16_sm90(j, stream); });
}

// `tile` recipe (numerics.md section 9): the quantization job of x [B, H, S, D]
// (BF16, aligned) into the TileQuantJob outputs (quant_tilescale_e4m3_sm90.h):
// per-token codes + scales [B, H, S]; per-128-token-tile codes row-major and /
// or transposed [B, H, D, S_pad] + scales [B, H, nblk]. Undefined tensors are
// not produced. Run with quantize_tilescale_bf16_sm90 (several jobs: one launch).
TileQuantJob tile_job(const at::Tensor& x, Fp8Format fmt, const at::Tensor& row, const at::Tensor& row_s,
                      const at::Tensor& tile, const at::Tensor& tileT, const at::Tensor& tile_s) {
  TileQuantJob j;
  j.x = x.data_ptr();
  j.stride_batch = eff_stride(x, 0);
  j.stride_head = eff_stride(x, 1);
  j.stride_seq = eff_stride(x, 2);
  j.batch = static_cast<int>(x.size(0));
  j.heads = static_cast<int>(x.size(1));
  j.seqlen = static_cast<int>(x.size(2));
  j.dim = static_cast<int>(x.size(3));
  j.fmt = fmt;
  j.recipe = Scaling::kTile;
  j.x_fp32 = x.scalar_type() == at::kFloat;  // rotation_input's float32 (the fused rotation only)
  if (row.defined()) {
    j.row = row.data_ptr<uint8_t>();
    j.row_s = row_s.data_ptr<float>();
  }
  if (tile.defined()) j.tile = tile.data_ptr<uint8_t>();
  if (tileT.defined()) {
    j.tileT = tileT.data_ptr<uint8_t>();
    j.seqlen_pad = static_cast<int>(tileT.size(3));
  }
  if (tile_s.defined()) j.tile_s = tile_s.data_ptr<float>();
  return j;
}

void quantize_tile(const at::Tensor& x, Fp8Format fmt, const at::Tensor& row, const at::Tensor& row_s,
                   const at::Tensor& tile, const at::Tensor& tileT, const at::Tensor& tile_s, cudaStream_t stream) {
  const TileQuantJob j = tile_job(x, fmt, row, row_s, tile, tileT, tile_s);
  launch([&] { quantize_tilescale_bf16_sm90(j, stream); });
}

// `tile` recipe buffers: codes [B,H,S,D]; per-token scales [B,H,S]; transposed
// codes [B,H,D,S_pad]; per-tile scales [B,H,ceil(S/128)].
at::Tensor alloc_codes(const at::Tensor& x) { return at::empty(x.sizes(), x.options().dtype(at::kByte)); }
at::Tensor alloc_token_scales(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(1), x.size(2)}, x.options().dtype(at::kFloat));
}
at::Tensor alloc_codesT(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(1), x.size(3), round_up(x.size(2), kSeqPad)}, x.options().dtype(at::kByte));
}
at::Tensor alloc_tile_scales(const at::Tensor& x) {
  return at::empty({x.size(0), x.size(1), ceil_div(x.size(2), kSeqBlock)}, x.options().dtype(at::kFloat));
}

// Row-blocked codes [B,H,S,D] + scales [B,H,S,nblk(D)].
std::pair<at::Tensor, at::Tensor> alloc_row(const at::Tensor& x) {
  const auto o = x.options();
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  return {at::empty({B, H, S, D}, o.dtype(at::kByte)),
          at::empty({B, H, S, num_dim_blocks(static_cast<int>(D))}, o.dtype(at::kFloat))};
}
// Column-blocked transposed codes [B,H,D,S_pad] + scales [B,H,D,ceil(S/128)].
std::pair<at::Tensor, at::Tensor> alloc_col(const at::Tensor& x) {
  const auto o = x.options();
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  return {at::empty({B, H, D, round_up(S, kSeqPad)}, o.dtype(at::kByte)),
          at::empty({B, H, D, ceil_div(S, kSeqBlock)}, o.dtype(at::kFloat))};
}

// The `tile` forward's quantized operands (numerics.md section 9): Q one scale
// per row, K and V one per 128-key tile (K row-major, V transposed), all of
// head_dim, in one launch (two when head_dim_qk != head_dim_v). Only what the
// forward reads: the backward's copies (V row-major, Q / dO transposed) are the
// backward's to make.
struct TileFwdCodes {
  at::Tensor q, q_s, k, k_s, vT, v_s;
};
// rotate: Q and K rotated in the quantization (cuda_qk_rotation; q / k from rotation_input).
TileFwdCodes quantize_tile_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Fp8Format fmt,
                               cudaStream_t stream, bool rotate = false) {
  const at::Tensor none;
  TileFwdCodes c{alloc_codes(q), alloc_token_scales(q), alloc_codes(k), alloc_tile_scales(k), alloc_codesT(v),
                 alloc_tile_scales(v)};
  TileQuantJob jobs[3] = {tile_job(q, fmt, c.q, c.q_s, none, none, none),
                                tile_job(k, fmt, none, none, c.k, none, c.k_s),
                                tile_job(v, fmt, none, none, none, c.vT, c.v_s)};
  jobs[2].tileT_perm16 = fwdt::kVPermutedInQuant;  // the order the forward's P V reads
  jobs[0].rotate = jobs[1].rotate = rotate;
  launch([&] { quantize_tilescale_bf16_sm90(jobs, 3, stream); });
  return c;
}

// win: the effective window (cuda_window): causal is (-1, 0).
void set_sizes(KernelParams& kp, const Problem& pr, double softmax_scale, const WindowBounds& win) {
  kp.batch = static_cast<int>(pr.batch);
  kp.seqlen_q = static_cast<int>(pr.seqlen_q);
  kp.seqlen_k = static_cast<int>(pr.seqlen_k);
  kp.num_heads_q = static_cast<int>(pr.heads_q);
  kp.num_heads_kv = static_cast<int>(pr.heads_kv);
  kp.head_dim_qk = static_cast<int>(pr.kqk);  // the kernel's (padded) head dims
  kp.head_dim_v = static_cast<int>(pr.kv);
  kp.block_size = kSeqBlock;
  kp.softmax_scale = static_cast<float>(softmax_scale);
  kp.causal = win.causal();
  kp.window_left = static_cast<int>(win.left);
  kp.window_right = static_cast<int>(win.right);
  kp.seqlen_q_pad = static_cast<int>(round_up(pr.seqlen_q, kSeqPad));
  kp.seqlen_k_pad = static_cast<int>(round_up(pr.seqlen_k, kSeqPad));
}

// KernelParams names strides (batch, seq, head) of [b, s, h, d] views; the op
// tensors are [b, h, s, d].
void set_input(const at::Tensor& t, const void*& ptr, int64_t& sb, int64_t& ss, int64_t& sh) {
  ptr = t.data_ptr();
  sb = eff_stride(t, 0);
  sh = eff_stride(t, 1);
  ss = eff_stride(t, 2);
}

// The `tile` forward's tensors into kp (scaling, inputs, O, LSE, quantized operands).
void set_tile_fwd_tensors(KernelParams& kp, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const TileFwdCodes& c) {
  kp.scaling = static_cast<int>(Scaling::kTile);
  set_input(q, kp.q, kp.q_sb, kp.q_ss, kp.q_sh);
  set_input(k, kp.k, kp.k_sb, kp.k_ss, kp.k_sh);
  set_input(v, kp.v, kp.v_sb, kp.v_ss, kp.v_sh);
  kp.out = out.data_ptr();
  kp.lse = lse.data_ptr<float>();
  kp.q_row = c.q.data_ptr<uint8_t>();
  kp.q_row_s = c.q_s.data_ptr<float>();
  kp.k_row = c.k.data_ptr<uint8_t>();
  kp.k_row_s = c.k_s.data_ptr<float>();
  kp.v_colT = c.vT.data_ptr<uint8_t>();
  kp.v_col_s = c.v_s.data_ptr<float>();
}

// ---- ops ------------------------------------------------------------------------

// fwd: out [B,Hq,Sq,Dv] contiguous in q's dtype, lse float32 [B,Hq,Sq]
// (numerics.md s.1-3; padded head dims: s.7).
// Logit softcapping (numerics.md section 12): the `tile` recipe's kernels take it
// (KernelParams::softcap, their kSoftcap instantiations); with scaling='row' a
// softcap > 0 raises NotImplementedError naming softcap. Returns c as the
// kernels' FP32 value (0 = off), within [1e-6, 1e4]: the kernels' capped logit
// has an absolute error of ~3e-7 c log2(e) (hopper/softcap_sm90.cuh: C - 2 C r
// cancels where |x| << c), a relative error of P of ~2e-7 c (2e-3 at c = 1e4;
// past that it would grow towards FP8's own error); 1e-6 keeps 2 / c times the
// kernels' score coefficients far from FP32 overflow.
float cuda_softcap(double softcap, Scaling recipe) {
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0,
                    "fp8attn: argument 'softcap': must be finite and >= 0 (0 = off), got ", softcap);
  if (softcap == 0.0) return 0.f;
  TORCH_CHECK_NOT_IMPLEMENTED(recipe == Scaling::kTile, "fp8attn: argument 'softcap': the CUDA kernels of "
                              "scaling='row' do not take logit softcapping (softcap=", softcap, "); scaling='tile' "
                              "runs it on CUDA, and the CPU reference runs both recipes: pass CPU tensors");
  TORCH_CHECK_VALUE(softcap >= 1e-6 && softcap <= 1e4, "fp8attn: argument 'softcap': must be 0 or in [1e-6, 1e4] "
                    "on CUDA (the kernels' cap has a relative error of ~2e-7 c in P; the CPU reference takes any "
                    "c >= 0), got ", softcap);
  return static_cast<float>(softcap);
}

// Sliding windows (numerics.md section 14): the effective window of a call
// (effective_window, common/params.h, FlashAttention-3's normalization: a window
// whose bounds reach every key of every row is no window, (-1, 0) the causal
// mask). The `tile` kernels take any window (KernelParams::window_left); the
// `row` kernels no mask and causal only, so a sliding window with scaling='row'
// raises NotImplementedError naming window_size.
WindowBounds cuda_window(const at::Tensor& q, const at::Tensor& k, bool causal, int64_t window_left,
                         int64_t window_right, Scaling recipe) {
  const int64_t sq = q.dim() == 4 ? q.size(2) : 0, sk = k.dim() == 4 ? k.size(2) : 0;
  const WindowBounds w = effective_window(causal, window_left, window_right, sq, sk);
  TORCH_CHECK_NOT_IMPLEMENTED(!w.local() || recipe == Scaling::kTile,
                              "fp8attn: argument 'window_size': the CUDA kernels of scaling='row' do not take "
                              "sliding windows (window_left=", window_left, ", window_right=", window_right,
                              ", causal=", causal, ", seqlen_q=", sq, ", seqlen_k=", sk,
                              "); scaling='tile' runs them on CUDA, and the CPU reference runs both recipes: "
                              "pass CPU tensors");
  return w;
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                            double softmax_scale, bool causal, c10::string_view precision,
                                            int64_t block_size, c10::string_view scaling,
                                            c10::string_view qk_rotation, bool smooth_k, double softcap,
                                            int64_t window_left, int64_t window_right) {
  const Scaling recipe = parse_scaling(scaling);
  const float cap = cuda_softcap(softcap, recipe);
  const WindowBounds win = cuda_window(q_in, k_in, causal, window_left, window_right, recipe);
  const Problem pr = check_problem(q_in, k_in, v_in, softmax_scale, precision, block_size);
  const bool rotate = cuda_qk_rotation(qk_rotation, smooth_k, recipe, pr.dqk, pr.kqk);
  TORCH_CHECK_NOT_IMPLEMENTED(recipe != Scaling::kTile || tile_fwd_enabled(),
                              "fp8attn: argument 'scaling': the CUDA forward of scaling='tile' is switched off by "
                              "FP8ATTN_TILE_FWD=0; unset it (or set FP8ATTN_TILE_FWD=1) to run it, or use "
                              "scaling='row' or CPU tensors");
  const c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor lse = at::empty({pr.batch, pr.heads_q, pr.seqlen_q}, q_in.options().dtype(at::kFloat));
  if (pr.empty() || pr.seqlen_k == 0) {  // nothing to compute, or no key at all: every row sees no key
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {at::zeros({pr.batch, pr.heads_q, pr.seqlen_q, pr.dv}, q_in.options()), lse};
  }
  // The quantization's inputs: BF16 (kernel_input), or with the fused rotation
  // Q and K as rotation_input gives them (BF16 or float32).
  const at::Tensor q = rotate ? rotation_input(q_in) : kernel_input(q_in, pr.kqk);
  const at::Tensor k = rotate ? rotation_input(k_in) : kernel_input(k_in, pr.kqk), v = kernel_input(v_in, pr.kv);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  // The kernel's O (BF16, the kernel's head_dim_v); the op's out is it unless
  // the head dims are padded or q is float32 (op_output).
  at::Tensor out_k = at::empty({pr.batch, pr.heads_q, pr.seqlen_q, pr.kv}, q_in.options().dtype(at::kBFloat16));

  if (recipe == Scaling::kTile) {
    // numerics.md section 9: Q one scale per row, K and V one per 128-key tile
    // (K row-major, V transposed), all of head_dim (quant_tilescale_e4m3_sm90.h);
    // section 10.1: Q R and K R there with the fused rotation.
    const TileFwdCodes c = quantize_tile_fwd(q, k, v, Fp8Format::kE4M3, stream, rotate);
    KernelParams kp{};
    set_sizes(kp, pr, softmax_scale, win);
    set_tile_fwd_tensors(kp, q, k, v, out_k, lse, c);
    kp.softcap = cap;
    launch([&] { run_fwd_tile(kp, stream); });
    return {op_output(out_k, pr.dv, q_in.scalar_type()), lse};
  }

  auto [q_row, q_row_s] = alloc_row(q);
  auto [k_row, k_row_s] = alloc_row(k);
  auto [v_colT, v_col_s] = alloc_col(v);
  const at::Tensor none;
  quantize(q, Fp8Format::kE4M3, q_row, q_row_s, none, none, 0, stream);
  quantize(k, Fp8Format::kE4M3, k_row, k_row_s, none, none, 0, stream);
  quantize(v, Fp8Format::kE4M3, none, none, v_colT, v_col_s, v_colT.size(3), stream);

  KernelParams kp{};
  set_sizes(kp, pr, softmax_scale, win);
  set_input(q, kp.q, kp.q_sb, kp.q_ss, kp.q_sh);
  set_input(k, kp.k, kp.k_sb, kp.k_ss, kp.k_sh);
  set_input(v, kp.v, kp.v_sb, kp.v_ss, kp.v_sh);
  kp.out = out_k.data_ptr();
  kp.lse = lse.data_ptr<float>();
  kp.q_row = q_row.data_ptr<uint8_t>();
  kp.q_row_s = q_row_s.data_ptr<float>();
  kp.k_row = k_row.data_ptr<uint8_t>();
  kp.k_row_s = k_row_s.data_ptr<float>();
  kp.v_colT = v_colT.data_ptr<uint8_t>();
  kp.v_col_s = v_col_s.data_ptr<float>();
  launch([&] { run_fwd(kp, stream); });
  return {op_output(out_k, pr.dv, q_in.scalar_type()), lse};
}

// dout and out of a backward: CUDA tensors on `device` of O's shape [batch, Hq, Sq, Dv]
// (a packed batch's [1, Hq, total_q, Dv] views).
void check_dout_out(const at::Tensor& dout, const at::Tensor& out, int64_t batch, const Problem& pr,
                    const at::Device& device) {
  check_cuda_tensor(dout, "dout", device);
  check_cuda_tensor(out, "out", device);
  const int64_t want_o[4] = {batch, pr.heads_q, pr.seqlen_q, pr.dv};
  for (int d = 0; d < 4; ++d) {
    check_size(dout, d, want_o[d], "dout", "size");
    check_size(out, d, want_o[d], "out", "size");
  }
}

// The tensors of a backward call, by KernelParams field (undefined: nullptr).
struct BwdTensors {
  at::Tensor q, k, v, out, dout, lse, dq, dk, dv;
  at::Tensor q_row, q_row_s, k_row, k_row_s, v_row, v_row_s, do_row, do_row_s;
  at::Tensor q_colT, q_col_s, k_colT, k_col_s, do_colT, do_col_s;
  at::Tensor delta, delta_dm, lse_bwd, dq_accum, diag, rowsum_ws;
};
void set_bwd_tensors(KernelParams& kp, const BwdTensors& t) {
  const auto f32 = [](const at::Tensor& x) { return x.defined() ? x.data_ptr<float>() : nullptr; };
  const auto u8 = [](const at::Tensor& x) { return x.defined() ? x.data_ptr<uint8_t>() : nullptr; };
  set_input(t.q, kp.q, kp.q_sb, kp.q_ss, kp.q_sh);
  set_input(t.k, kp.k, kp.k_sb, kp.k_ss, kp.k_sh);
  set_input(t.v, kp.v, kp.v_sb, kp.v_ss, kp.v_sh);
  set_input(t.out, kp.o, kp.o_sb, kp.o_ss, kp.o_sh);
  set_input(t.dout, kp.dout, kp.do_sb, kp.do_ss, kp.do_sh);
  kp.lse = f32(t.lse);
  kp.dq = t.dq.defined() ? t.dq.data_ptr() : nullptr;  // undefined: allocated after the main kernel
  kp.dk = t.dk.data_ptr();
  kp.dv = t.dv.data_ptr();
  kp.q_row = u8(t.q_row);
  kp.q_row_s = f32(t.q_row_s);
  kp.k_row = u8(t.k_row);
  kp.k_row_s = f32(t.k_row_s);
  kp.v_row = u8(t.v_row);
  kp.v_row_s = f32(t.v_row_s);
  kp.do_row = u8(t.do_row);
  kp.do_row_s = f32(t.do_row_s);
  kp.q_colT = u8(t.q_colT);
  kp.q_col_s = f32(t.q_col_s);
  kp.k_colT = u8(t.k_colT);
  kp.k_col_s = f32(t.k_col_s);
  kp.do_colT = u8(t.do_colT);
  kp.do_col_s = f32(t.do_col_s);
  kp.delta = f32(t.delta);
  kp.delta_dm = f32(t.delta_dm);
  kp.lse_bwd = f32(t.lse_bwd);
  kp.dq_accum = f32(t.dq_accum);
  kp.diag = f32(t.diag);
  kp.rowsum_ws = f32(t.rowsum_ws);
}

// bwd: dq/dk/dv contiguous in the shapes and dtype of q/k/v; diag float32
// [4,B,Hq,Sq] = (delta, eps, rowsum_pre, rowsum_post) when `diagnostics`,
// else empty [0] (numerics.md sections 3-5).
// The backward and, for context parallelism (numerics.md section 11), its two
// sharded-key variants: `delta_in` given (main pass: that delta, lse = the global
// LSE'; delta_matching, no diagnostics) or `sums_only` (bwd_dm_sums: only the
// pre-pass, returning (sum_pdp, sum_p, undefined, undefined)). win: the
// effective window (cuda_window; a sliding one only with scaling='tile'); cap:
// the softcap (cuda_softcap; > 0 only with scaling='tile').
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda_impl(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, double softmax_scale, const WindowBounds& win, float cap,
    c10::string_view precision, c10::string_view delta_mode, int64_t block_size, c10::string_view grad_format,
    bool diagnostics, c10::string_view scaling, c10::string_view qk_rotation, bool smooth_k,
    const c10::optional<at::Tensor>& delta_in, bool sums_only, bool deterministic = false) {
  const Scaling recipe = check_bwd_scaling(scaling);
  const Problem pr = check_problem(q_in, k_in, v_in, softmax_scale, precision, block_size);
  const bool rotate = cuda_qk_rotation(qk_rotation, smooth_k, recipe, pr.dqk, pr.kqk);
  const DeltaMode mode = parse_delta_mode(delta_mode);
  const bool delta_given = delta_in.has_value() && delta_in->defined();
  if (delta_given || sums_only) {
    TORCH_CHECK_VALUE(precision == "fp8", "fp8attn: argument 'precision': an explicit delta needs precision \"fp8\"");
    TORCH_CHECK_VALUE(mode == DeltaMode::kDeltaMatching, "fp8attn: argument 'delta_mode': an explicit delta is the "
                      "Delta-Matching delta: delta_mode must be \"delta_matching\"");
    TORCH_CHECK_VALUE(!diagnostics, "fp8attn: argument 'diagnostics': a backward with an explicit delta has no "
                      "per-call diagnostics (its delta is global); pass diagnostics=False");
    TORCH_CHECK_VALUE(qk_rotation == "none" && !smooth_k, "fp8attn: argument 'qk_rotation': an explicit delta is "
                      "not implemented with qk_rotation or smooth_k");
  }
  const Fp8Format gfmt = parse_grad_format(grad_format);
  const at::Device device = q_in.device();
  check_dout_out(dout_in, out_in, pr.batch, pr, device);
  TORCH_CHECK_VALUE(lse_in.defined() && lse_in.device() == device, "fp8attn: argument 'lse': expected a tensor on ",
                    device);
  TORCH_CHECK_TYPE(lse_in.scalar_type() == at::kFloat, "fp8attn: argument 'lse': expected float32, got ",
                   lse_in.scalar_type());
  TORCH_CHECK_VALUE(lse_in.dim() == 3 && lse_in.size(0) == pr.batch && lse_in.size(1) == pr.heads_q &&
                        lse_in.size(2) == pr.seqlen_q,
                    "fp8attn: argument 'lse': expected shape [", pr.batch, ", ", pr.heads_q, ", ", pr.seqlen_q,
                    "], got ", lse_in.sizes());

  at::Tensor delta_arg;
  if (delta_given) {
    const at::Tensor& t = *delta_in;
    TORCH_CHECK_VALUE(t.device() == device, "fp8attn: argument 'delta': expected a tensor on ", device, ", got ",
                      t.device());
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "fp8attn: argument 'delta': expected float32, got ",
                     t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == pr.batch && t.size(1) == pr.heads_q && t.size(2) == pr.seqlen_q,
                      "fp8attn: argument 'delta': expected shape [", pr.batch, ", ", pr.heads_q, ", ", pr.seqlen_q,
                      "], got ", t.sizes());
    delta_arg = t.contiguous();
  }

  TORCH_CHECK_NOT_IMPLEMENTED(&sm90::run_bwd != nullptr,
                              "fp8attn: the CUDA backward kernels are not built into this library "
                              "(csrc/hopper/bwd_*.cu missing); use CPU tensors for the backward");

  const c10::cuda::CUDAGuard guard(device);
  const auto opts = q_in.options();
  const auto fopts = opts.dtype(at::kFloat);
  at::Tensor diag = diagnostics ? at::empty({4, pr.batch, pr.heads_q, pr.seqlen_q}, fopts) : at::empty({0}, fopts);
  if (sums_only && (pr.empty() || pr.seqlen_k == 0))
    return {at::zeros({pr.batch, pr.heads_q, pr.seqlen_q}, fopts), at::zeros({pr.batch, pr.heads_q, pr.seqlen_q}, fopts),
            at::Tensor(), at::Tensor()};
  if (pr.empty() || pr.seqlen_k == 0) {
    diag.zero_();
    return {at::zeros({pr.batch, pr.heads_q, pr.seqlen_q, pr.dqk}, opts),
            at::zeros({pr.batch, pr.heads_kv, pr.seqlen_k, pr.dqk}, opts),
            at::zeros({pr.batch, pr.heads_kv, pr.seqlen_k, pr.dv}, opts), diag};
  }

  // The kernels' operands: BF16, head dims padded to the kernel's (kernel_input);
  // with the fused rotation Q and K as rotation_input gives them.
  const at::Tensor q = rotate ? rotation_input(q_in) : kernel_input(q_in, pr.kqk);
  const at::Tensor k = rotate ? rotation_input(k_in) : kernel_input(k_in, pr.kqk), v = kernel_input(v_in, pr.kv);
  const at::Tensor dout = kernel_input(dout_in, pr.kv), out = kernel_input(out_in, pr.kv);
  const at::Tensor lse = lse_in.contiguous();
  // The kernels' gradients (BF16, padded head dims); op_output slices / converts.
  // dQ is allocated after the main kernel, when the quantized operands are freed
  // (below): the backward's peak holds the codes or dQ, not both.
  const auto bopts = opts.dtype(at::kBFloat16);
  at::Tensor dq;
  at::Tensor dk = at::empty({pr.batch, pr.heads_kv, pr.seqlen_k, pr.kqk}, bopts);
  at::Tensor dv = at::empty({pr.batch, pr.heads_kv, pr.seqlen_k, pr.kv}, bopts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  // Quantized operands (kernel_params_sm90.h). V's column blocking feeds only
  // the forward's matmul #2, so the backward does not build it.
  // `tile` (numerics.md section 9; the layouts of kernel_params_sm90.h for
  // scaling == 1): Q and dO one scale per token (#3, #4) and per 128-token tile
  // transposed (#7, #5); K per tile row-major (#3) and transposed (#6), one
  // scale array for both; V per tile row-major (#4).
  at::Tensor q_row, q_row_s, k_row, k_row_s, v_row, v_row_s, do_row, do_row_s;
  at::Tensor q_colT, q_col_s, k_colT, k_col_s, do_colT, do_col_s;
  const at::Tensor none;
  if (recipe == Scaling::kTile) {
    q_row = alloc_codes(q);
    q_row_s = alloc_token_scales(q);
    q_colT = alloc_codesT(q);
    q_col_s = alloc_tile_scales(q);
    k_row = alloc_codes(k);
    k_colT = alloc_codesT(k);
    k_row_s = alloc_tile_scales(k);
    k_col_s = k_row_s;  // one K_hat: the same codes and scales for #3 and #6
    v_row = alloc_codes(v);
    v_row_s = alloc_tile_scales(v);
    do_row = alloc_codes(dout);
    do_row_s = alloc_token_scales(dout);
    do_colT = alloc_codesT(dout);
    do_col_s = alloc_tile_scales(dout);
    // NOTE: one launch for the four operands (two when head_dim_qk != head_dim_v):
    // outputs bit-identical to one launch per operand (quant_tilescale_e4m3_sm90.h).
    TileQuantJob jobs[4] = {tile_job(q, Fp8Format::kE4M3, q_row, q_row_s, none, q_colT, q_col_s),
                            tile_job(k, Fp8Format::kE4M3, none, none, k_row, k_colT, k_row_s),
                            tile_job(v, Fp8Format::kE4M3, none, none, v_row, none, v_row_s),
                            tile_job(dout, gfmt, do_row, do_row_s, none, do_colT, do_col_s)};
    jobs[0].rotate = jobs[1].rotate = rotate;  // numerics.md 10.1: the codes of Q R and K R
    static_assert(sm90::kMaxTileQuantJobs >= 4, "the backward's four operands in one launch");
    launch([&] { quantize_tilescale_bf16_sm90(jobs, 4, stream); });
  } else {
    std::tie(q_row, q_row_s) = alloc_row(q);
    std::tie(k_row, k_row_s) = alloc_row(k);
    std::tie(v_row, v_row_s) = alloc_row(v);
    std::tie(do_row, do_row_s) = alloc_row(dout);
    std::tie(q_colT, q_col_s) = alloc_col(q);
    std::tie(k_colT, k_col_s) = alloc_col(k);
    std::tie(do_colT, do_col_s) = alloc_col(dout);
    quantize(q, Fp8Format::kE4M3, q_row, q_row_s, q_colT, q_col_s, q_colT.size(3), stream);
    quantize(k, Fp8Format::kE4M3, k_row, k_row_s, k_colT, k_col_s, k_colT.size(3), stream);
    quantize(v, Fp8Format::kE4M3, v_row, v_row_s, none, none, 0, stream);
    quantize(dout, gfmt, do_row, do_row_s, do_colT, do_col_s, do_colT.size(3), stream);
  }

  // Workspace.
  at::Tensor delta = at::empty({pr.batch, pr.heads_q, pr.seqlen_q}, fopts);
  at::Tensor delta_dm = at::empty({pr.batch, pr.heads_q, pr.seqlen_q}, fopts);
  // Delta-Matching: the LSE its main kernel uses, written by the pre-pass
  // (numerics.md section 4, "Backward-consistent LSE"); the saved LSE is not touched.
  const bool dm = mode == DeltaMode::kDeltaMatching;
  at::Tensor lse_bwd = dm ? at::empty({pr.batch, pr.heads_q, pr.seqlen_q}, fopts) : at::Tensor();
  // dQ partials (FP32; layout of each recipe: kernel_params_sm90.h, dq_accum_rows).
  at::Tensor dq_accum =
      at::zeros({pr.batch, pr.heads_q, sm90::dq_accum_rows(static_cast<int>(recipe), pr.seqlen_q), pr.kqk}, fopts);
  at::Tensor rowsum_ws = diagnostics ? at::zeros({4, pr.batch, pr.heads_q, pr.seqlen_q}, fopts) : at::Tensor();
  // Deterministic dQ (kernel_params_sm90.h dq_sem): one zeroed turn counter per 64-query
  // sub-tile and head-dim slice of every (batch, query head).
  at::Tensor dq_sem = deterministic ? at::zeros({pr.batch, pr.heads_q, (pr.seqlen_q + 63) / 64,
                                                 sm90::bwdts::slices(static_cast<int>(pr.kqk), static_cast<int>(pr.kv))},
                                                opts.dtype(at::kInt))
                                    : at::Tensor();

  KernelParams kp{};
  set_sizes(kp, pr, softmax_scale, win);
  kp.delta_mode = static_cast<int>(mode);
  kp.grad_format = static_cast<int>(gfmt);
  kp.scaling = static_cast<int>(recipe);
  kp.softcap = cap;
  set_bwd_tensors(kp, {q, k, v, out, dout, lse, dq, dk, dv, q_row, q_row_s, k_row, k_row_s, v_row, v_row_s, do_row,
                       do_row_s, q_colT, q_col_s, k_colT, k_col_s, do_colT, do_col_s, delta, delta_dm, lse_bwd,
                       dq_accum, diagnostics ? diag : at::Tensor(), rowsum_ws});
  if (delta_given) {
    kp.delta = delta_arg.data_ptr<float>();
    kp.delta_given = 1;
  }
  kp.prepass_sums = sums_only ? 1 : 0;
  kp.dq_sem = deterministic ? dq_sem.data_ptr<int>() : nullptr;
  launch([&] { sm90::run_bwd(kp, stream); });  // kp.dq null: no dQ conversion yet (bwd_sm90.h)
  if (sums_only) return {delta_dm, lse_bwd, at::Tensor(), at::Tensor()};
  // The codes are dead once the main kernel is enqueued: the caching allocator
  // hands their blocks to dQ on this stream, after the kernels that read them.
  for (at::Tensor* t : {&q_row, &q_row_s, &k_row, &k_row_s, &v_row, &v_row_s, &do_row, &do_row_s, &q_colT, &q_col_s,
                        &k_colT, &k_col_s, &do_colT, &do_col_s})
    *t = at::Tensor();
  dq = at::empty({pr.batch, pr.heads_q, pr.seqlen_q, pr.kqk}, bopts);
  kp.dq = dq.data_ptr();
  launch([&] { sm90::run_bwd_dq_convert(kp, stream); });
  const at::ScalarType dt = q_in.scalar_type();
  // The fused rotation's dQ' = dQ R, dK' = dK R mapped back (no padded head dims there).
  if (rotate) return {rotate_back(dq, dt, stream), rotate_back(dk, dt, stream), op_output(dv, pr.dv, dt), diag};
  return {op_output(dq, pr.dqk, dt), op_output(dk, pr.dqk, dt), op_output(dv, pr.dv, dt), diag};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, double softmax_scale, bool causal, c10::string_view precision, c10::string_view delta_mode,
    int64_t block_size, c10::string_view grad_format, bool diagnostics, c10::string_view scaling,
    c10::string_view qk_rotation, bool smooth_k, const c10::optional<at::Tensor>& delta, double softcap,
    int64_t window_left, int64_t window_right, bool deterministic) {
  const Scaling recipe = parse_scaling(scaling);
  const float cap = cuda_softcap(softcap, recipe);
  const WindowBounds win = cuda_window(q, k, causal, window_left, window_right, recipe);
  TORCH_CHECK_NOT_IMPLEMENTED(!deterministic || recipe == Scaling::kTile,
                              "fp8attn: argument 'deterministic': the CUDA backward of scaling='row' adds its dQ "
                              "partials with atomics (not bitwise reproducible); scaling='tile' runs "
                              "deterministic=True on CUDA, and CPU tensors are always deterministic");
  return bwd_cuda_impl(dout, q, k, v, out, lse, softmax_scale, win, cap, precision, delta_mode, block_size,
                       grad_format, diagnostics, scaling, qk_rotation, smooth_k, delta, false, deterministic);
}

// bwd_dm_sums: the Delta-Matching pre-pass of one key shard (numerics.md section 11),
// the same pre-pass kernel as the backward's (softcap too, scaling='tile'); `dout`
// stands in for the O the delta_matching path does not read.
std::tuple<at::Tensor, at::Tensor> bwd_dm_sums_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& lse, double softmax_scale,
                                                    bool causal, int64_t block_size, c10::string_view grad_format,
                                                    c10::string_view scaling, double softcap,
                                                    int64_t window_left, int64_t window_right) {
  const Scaling recipe = parse_scaling(scaling);
  const float cap = cuda_softcap(softcap, recipe);
  const WindowBounds win = cuda_window(q, k, causal, window_left, window_right, recipe);
  auto r = bwd_cuda_impl(dout, q, k, v, dout, lse, softmax_scale, win, cap, "fp8", "delta_matching", block_size,
                         grad_format, false, scaling, "none", false, c10::nullopt, true);
  return {std::get<0>(r), std::get<1>(r)};
}

// The checks the CUDA quantize ops share: x (argument `name`) a bfloat16 rank-4
// CUDA tensor [B, H, S, D] the kernels take (D in {64, 128, 192, 256}, B * H <
// 2^31, S < 2^30), and fmt "e4m3" | "e5m2" (returned parsed). `op` names the op.
void check_quant_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "fp8attn: argument '", name, "': the CUDA ", op,
                   " takes bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 4, "fp8attn: argument '", name, "': the CUDA ", op, " takes a rank-4 tensor, got rank ",
                    t.dim());
  const int64_t D = t.size(3);
  TORCH_CHECK_VALUE(D == 64 || D == 128 || D == 192 || D == 256, "fp8attn: argument '", name,
                    "': size of dim 3 must be 64, 128, 192 or 256 on CUDA, got ", D);
  TORCH_CHECK_VALUE(t.size(0) * t.size(1) < (int64_t{1} << 31) && t.size(2) < (int64_t{1} << 30), "fp8attn: argument '",
                    name, "': size(0) * size(1) must be < 2^31 and size(2) < 2^30 on CUDA, got shape ", t.sizes());
}

Fp8Format parse_quant_fmt(c10::string_view fmt_s) {
  TORCH_CHECK_VALUE(fmt_s == "e4m3" || fmt_s == "e5m2", "fp8attn: argument 'fmt': expected \"e4m3\" or \"e5m2\", got \"",
                    std::string(fmt_s), "\"");
  return fmt_s == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

// quantize_blockwise on CUDA (used to check the quantization kernels bit for
// bit against the CPU op): x bfloat16 [B, H, S, D] on CUDA with D in {64, 128,
// 192, 256}, block_size 128, dim = 3 / -1 (row blocking, blocks of min(128, D)
// channels) or dim = 2 / -2 (blocks of 128 tokens). Returns codes with x's
// shape (for dim 2 a transposed view of the kernel's [B, H, D, S_pad] layout)
// and scales with x's shape where dim is replaced by its number of blocks
// (for dim 2 a transposed view of [B, H, D, nblk]). Same values as the CPU op.
std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cuda(const at::Tensor& x_in, int64_t dim, int64_t block_size,
                                                           c10::string_view fmt_s) {
  TORCH_CHECK_VALUE(x_in.defined() && x_in.is_cuda(), "fp8attn: argument 'x': expected a CUDA tensor");
  check_cuda_device(x_in.device());
  check_quant_tensor("quantize_blockwise", "x", x_in);
  const int64_t d = dim < 0 ? dim + 4 : dim;
  TORCH_CHECK_VALUE(d == 2 || d == 3, "fp8attn: argument 'dim': the CUDA quantize_blockwise blocks dim 2 or 3 (or -2, -1), got ",
                    dim);
  TORCH_CHECK_VALUE(block_size == kSeqBlock, "fp8attn: argument 'block_size': the CUDA quantize_blockwise supports 128 only, got ",
                    block_size);
  const Fp8Format fmt = parse_quant_fmt(fmt_s);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = aligned_rows_copy(x_in);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const at::Tensor none;
  if (d == 3) {
    auto [row, row_s] = alloc_row(x);
    quantize(x, fmt, row, row_s, none, none, 0, stream);
    return {row, row_s};
  }
  auto [colT, col_s] = alloc_col(x);
  quantize(x, fmt, none, none, colT, col_s, colT.size(3), stream);
  return {colT.narrow(3, 0, x.size(2)).transpose(2, 3), col_s.transpose(2, 3)};
}

// quantize_tilescale on CUDA (checks the `tile` quantization kernel bit for bit
// against the CPU op): x bfloat16 [B, H, S, D] on CUDA, D in {64, 128, 192,
// 256}, block_size 128; dim 3 / -1: per-token codes and scales [B, H, S];
// dim 2 / -2: per-tile codes (row-major, or with `transposed` a transposed
// view of the kernel's [B, H, D, S_pad] layout) and scales [B, H, nblk]. Same
// values as the CPU op.
std::tuple<at::Tensor, at::Tensor> quantize_tilescale_cuda(const at::Tensor& x_in, int64_t dim, int64_t block_size,
                                                           c10::string_view fmt_s, bool transposed) {
  TORCH_CHECK_VALUE(x_in.defined() && x_in.is_cuda(), "fp8attn: argument 'x': expected a CUDA tensor");
  check_cuda_device(x_in.device());
  check_quant_tensor("quantize_tilescale", "x", x_in);
  const int64_t d = dim < 0 ? dim + 4 : dim;
  TORCH_CHECK_VALUE(d == 2 || d == 3, "fp8attn: argument 'dim': quantize_tilescale blocks dim 2 (tiles of tokens) or 3 "
                    "(per token), or -2 / -1, got ", dim);
  TORCH_CHECK_VALUE(block_size == kSeqBlock,
                    "fp8attn: argument 'block_size': the CUDA quantize_tilescale supports 128 only, got ", block_size);
  const Fp8Format fmt = parse_quant_fmt(fmt_s);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = aligned_rows_copy(x_in);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const at::Tensor none;
  if (d == 3) {
    at::Tensor row = alloc_codes(x), row_s = alloc_token_scales(x);
    quantize_tile(x, fmt, row, row_s, none, none, none, stream);
    return {row, row_s};
  }
  at::Tensor tile_s = alloc_tile_scales(x);
  if (!transposed) {
    at::Tensor tile = alloc_codes(x);
    quantize_tile(x, fmt, none, none, tile, none, tile_s, stream);
    return {tile, tile_s};
  }
  at::Tensor tileT = alloc_codesT(x);
  quantize_tile(x, fmt, none, none, none, tileT, tile_s, stream);
  return {tileT.narrow(3, 0, x.size(2)).transpose(2, 3), tile_s};
}

// quantize_tilescale_fwd on CUDA: the forward's fused Q / K / V quantization
// (quantize_tile_fwd) exposed for the bitwise test against the CPU op. q, k, v
// bfloat16 [B, H, S, D] on one CUDA device (q: Hq, Sq, Dqk; k: Hkv, Sk, Dqk;
// v: Hkv, Sk, Dv), D in {64, 128, 192, 256}; v_codes a transposed view of the
// kernel's [B, Hkv, Dv, Sk_pad] buffer.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_tilescale_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, c10::string_view fmt_s) {
  const std::pair<const char*, const at::Tensor*> args[3] = {{"q", &q_in}, {"k", &k_in}, {"v", &v_in}};
  for (const auto& [name, t] : args) {
    TORCH_CHECK_VALUE(t->defined() && t->is_cuda() && t->device() == q_in.device(), "fp8attn: argument '", name,
                      "': expected a CUDA tensor on q's device");
    check_quant_tensor("quantize_tilescale_fwd", name, *t);
  }
  check_cuda_device(q_in.device());
  const Fp8Format fmt = parse_quant_fmt(fmt_s);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = aligned_rows_copy(q_in), k = aligned_rows_copy(k_in), v = aligned_rows_copy(v_in);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const TileFwdCodes c = quantize_tile_fwd(q, k, v, fmt, stream);
  at::Tensor vT = c.vT;
  if (fwdt::kVPermutedInQuant) {
    // Undo the 16-token group order (TileQuantJob::tileT_perm16) with a gather, so
    // the test compares plain codes: key t of a group sits at byte kPos[t].
    static constexpr int64_t kPos[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
    const at::Tensor pos = at::tensor(c10::ArrayRef<int64_t>(kPos, 16), vT.options().dtype(at::kLong));
    const auto sz = vT.sizes();
    vT = vT.view({sz[0], sz[1], sz[2], sz[3] / 16, 16}).index_select(4, pos).reshape(sz);
  }
  return {c.q, c.q_s, c.k, c.k_s, vT.narrow(3, 0, v.size(2)).transpose(2, 3), c.v_s};
}

// ---- packed variable-length batches, one launch per kernel (varlen_sm90.h) --------------

// The sequence description of a packed batch on the device: int32 copies of
// cu_seqlens / seqused (never read on the host) and the metadata
// (varlen_meta_sm90), with the padded tile bounds of each side.
struct PackedBatch {
  int64_t n = 0, total_q = 0, total_k = 0, q_tiles = 0, k_tiles = 0;
  at::Tensor cu_q, cu_k, used_q, used_k, meta;
  VarlenMetaLayout layout() const {
    return {static_cast<int>(n), static_cast<int>(q_tiles), static_cast<int>(k_tiles)};
  }
  const int* at(int64_t off) const { return meta.data_ptr<int>() + off; }
};

// t as int32 on the device (a device-side cast of int64: no host read; values
// past int32 are invalid anyway and stay inside the tensors after the
// metadata kernel's clamps).
at::Tensor device_int32(const at::Tensor& t, const char* name, int64_t len, const at::Device& device) {
  TORCH_CHECK_VALUE(t.defined() && t.device() == device, "fp8attn: argument '", name, "': expected a tensor on ",
                    device, ", got ", t.defined() ? t.device().str() : std::string("an undefined tensor"));
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "fp8attn: argument '", name,
                   "': dtype must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == len, "fp8attn: argument '", name, "': expected shape [", len,
                    "], got ", t.sizes());
  return t.to(at::kInt).contiguous();
}

PackedBatch packed_batch(const at::Tensor& cu_q, const at::Tensor& cu_k, const c10::optional<at::Tensor>& used_q,
                         const c10::optional<at::Tensor>& used_k, int64_t total_q, int64_t total_k,
                         const at::Device& device, cudaStream_t stream) {
  PackedBatch pb;
  TORCH_CHECK_VALUE(cu_q.defined() && cu_q.dim() == 1 && cu_q.size(0) >= 1, "fp8attn: argument 'cu_seqlens_q': must "
                    "be 1-D of length batch + 1 >= 1, got ", cu_q.defined() ? cu_q.sizes() : at::IntArrayRef{});
  pb.n = cu_q.size(0) - 1;
  pb.cu_q = device_int32(cu_q, "cu_seqlens_q", pb.n + 1, device);
  pb.cu_k = device_int32(cu_k, "cu_seqlens_k", pb.n + 1, device);
  if (used_q.has_value() && used_q->defined()) pb.used_q = device_int32(*used_q, "seqused_q", pb.n, device);
  if (used_k.has_value() && used_k->defined()) pb.used_k = device_int32(*used_k, "seqused_k", pb.n, device);
  pb.total_q = total_q;
  pb.total_k = total_k;
  pb.q_tiles = varlen_tiles_max(total_q, pb.n);
  pb.k_tiles = varlen_tiles_max(total_k, pb.n);
  // NOTE: padded rows are int in the kernels (< 2^31); the totals are < 2^30 (check_problem).
  TORCH_CHECK_VALUE(pb.q_tiles * kSeqBlock < (int64_t{1} << 31) && pb.k_tiles * kSeqBlock < (int64_t{1} << 31),
                    "fp8attn: argument 'cu_seqlens_q': ", pb.n, " sequences of ", total_q, " / ", total_k,
                    " tokens need more than 2^31 padded rows (128-token tiles per sequence); split the batch");
  if (pb.n == 0) return pb;
  pb.meta = at::empty({pb.layout().ints()}, pb.cu_q.options());
  const auto ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<int>() : nullptr; };
  launch([&] {
    varlen_meta_sm90(pb.cu_q.data_ptr<int>(), pb.cu_k.data_ptr<int>(), ptr(pb.used_q), ptr(pb.used_k),
                     static_cast<int>(pb.n), static_cast<int>(total_q), static_cast<int>(total_k),
                     static_cast<int>(pb.q_tiles), static_cast<int>(pb.k_tiles), pb.meta.data_ptr<int>(), stream);
  });
  return pb;
}

// j (from tile_job on a [1, H, total, D] view) in the packed layout of one side.
void packed_job(TileQuantJob& j, const PackedBatch& pb, bool q_side) {
  const VarlenMetaLayout L = pb.layout();
  const int64_t tiles = q_side ? pb.q_tiles : pb.k_tiles;
  j.batch = 1;
  j.seqlen = static_cast<int>(tiles * kSeqBlock);
  if (j.tileT != nullptr) j.seqlen_pad = j.seqlen;
  j.tile_seq = pb.at(q_side ? L.qtile_seq() : L.ktile_seq());
  j.tiles = pb.at(q_side ? L.tiles_q() : L.tiles_k());
  j.tok = pb.at(q_side ? L.tok_q() : L.tok_k());
  j.len = pb.at(q_side ? L.len_q() : L.len_k());
}

// KernelParams of a packed batch on top of set_sizes (batch 1, the totals).
void set_packed(KernelParams& kp, const PackedBatch& pb) {
  kp.num_seqs = static_cast<int>(pb.n);
  kp.q_tiles_max = static_cast<int>(pb.q_tiles);
  kp.k_tiles_max = static_cast<int>(pb.k_tiles);
  kp.seqlen_q_pad = static_cast<int>(pb.q_tiles * kSeqBlock);
  kp.seqlen_k_pad = static_cast<int>(pb.k_tiles * kSeqBlock);
  kp.varlen_meta = pb.meta.data_ptr<int>();
}

// [total, H, D] -> [1, H, total, D] (a view), after checking the rank.
at::Tensor packed_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() == 3, "fp8attn: argument '", name,
                    "': must be 3-D [total_tokens, heads, head_dim], got ", t.defined() ? t.sizes() : at::IntArrayRef{});
  return t.transpose(0, 1).unsqueeze(0);
}

void check_packed_scaling(c10::string_view scaling) {
  TORCH_CHECK_NOT_IMPLEMENTED(parse_scaling(scaling) == Scaling::kTile,
                              "fp8attn: argument 'scaling': the single-launch varlen kernels are those of "
                              "scaling='tile'; varlen_attention runs scaling='row' per sequence");
}

// A kernel output y [total, H, kd] (BF16, token-major) as the op's output: its
// first d channels in `dtype` (y itself when that is the same).
at::Tensor packed_output(const at::Tensor& y, int64_t d, at::ScalarType dtype) {
  if (y.size(2) == d && dtype == at::kBFloat16) return y;
  return y.narrow(2, 0, d).to(dtype).contiguous();
}

// fwd_varlen (schema: ops.cpp): the `tile` forward of a packed batch, one launch
// per kernel (metadata, quantization, forward, gap clearing); O [total_q, Hq, Dv]
// in q's dtype (contiguous), LSE float32 [Hq, total_q]; tokens outside every
// sequence O = 0, LSE = -inf. Sequence s equals the dense `fwd` on its slices
// (numerics.md sections 7, 9, 14: bottom-right masks per sequence).
std::tuple<at::Tensor, at::Tensor> fwd_varlen_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                   const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
                                                   const at::Tensor& cu_seqlens_k,
                                                   const c10::optional<at::Tensor>& seqused_q,
                                                   const c10::optional<at::Tensor>& seqused_k, double softmax_scale,
                                                   bool causal, int64_t block_size, c10::string_view scaling,
                                                   int64_t window_left, int64_t window_right,
                                                   c10::string_view qk_rotation) {
  check_packed_scaling(scaling);
  const at::Tensor q4 = packed_view(q_in, "q"), k4 = packed_view(k_in, "k"), v4 = packed_view(v_in, "v");
  const Problem pr = check_problem(q4, k4, v4, softmax_scale, "fp8", block_size);
  const bool rotate = cuda_qk_rotation(qk_rotation, false, Scaling::kTile, pr.dqk, pr.kqk);
  TORCH_CHECK_NOT_IMPLEMENTED(pr.heads_q <= 65535, "fp8attn: argument 'q': the single-launch varlen kernels take "
                              "num_heads_q <= 65535, got ", pr.heads_q, "; varlen_attention runs it per sequence");
  TORCH_CHECK_NOT_IMPLEMENTED(tile_fwd_enabled(), "fp8attn: argument 'scaling': the CUDA forward of scaling='tile' "
                              "is switched off by FP8ATTN_TILE_FWD=0");
  // NOTE: normalized on the totals: a bound reaching past every key of the
  // longest possible sequence changes no row of any sequence.
  const WindowBounds win = effective_window(causal, window_left, window_right, pr.seqlen_q, pr.seqlen_k);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q_in.device().index()).stream();
  const PackedBatch pb = packed_batch(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, pr.seqlen_q, pr.seqlen_k,
                                      q_in.device(), stream);
  at::Tensor lse = at::empty({pr.heads_q, pr.seqlen_q}, q_in.options().dtype(at::kFloat));
  if (pb.n == 0 || pr.empty() || pr.seqlen_k == 0) {
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {at::zeros({pr.seqlen_q, pr.heads_q, pr.dv}, q_in.options()), lse};
  }
  const at::Tensor q = rotate ? rotation_input(q4) : kernel_input(q4, pr.kqk);
  const at::Tensor k = rotate ? rotation_input(k4) : kernel_input(k4, pr.kqk), v = kernel_input(v4, pr.kv);
  const auto u8 = q.options().dtype(at::kByte);
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t rq = pb.q_tiles * kSeqBlock, rk = pb.k_tiles * kSeqBlock;
  const at::Tensor q_row = at::empty({1, pr.heads_q, rq, pr.kqk}, u8), q_s = at::empty({1, pr.heads_q, rq}, f32);
  const at::Tensor k_row = at::empty({1, pr.heads_kv, rk, pr.kqk}, u8);
  const at::Tensor k_s = at::empty({1, pr.heads_kv, pb.k_tiles}, f32);
  const at::Tensor vT = at::empty({1, pr.heads_kv, pr.kv, rk}, u8), v_s = at::empty({1, pr.heads_kv, pb.k_tiles}, f32);
  const at::Tensor none;
  TileQuantJob jobs[3] = {tile_job(q, Fp8Format::kE4M3, q_row, q_s, none, none, none),
                          tile_job(k, Fp8Format::kE4M3, none, none, k_row, none, k_s),
                          tile_job(v, Fp8Format::kE4M3, none, none, none, vT, v_s)};
  jobs[2].tileT_perm16 = fwdt::kVPermutedInQuant;
  jobs[0].rotate = jobs[1].rotate = rotate;  // numerics.md 10.1: the codes of Q R and K R
  packed_job(jobs[0], pb, true);
  packed_job(jobs[1], pb, false);
  packed_job(jobs[2], pb, false);
  launch([&] { quantize_tilescale_bf16_sm90(jobs, 3, stream); });

  at::Tensor out_k = at::empty({pr.seqlen_q, pr.heads_q, pr.kv}, q.options().dtype(at::kBFloat16));
  KernelParams kp{};
  set_sizes(kp, pr, softmax_scale, win);
  set_packed(kp, pb);
  set_tile_fwd_tensors(kp, q, k, v, out_k, lse, {q_row, q_s, k_row, k_s, vT, v_s});
  launch([&] { run_fwd_tile(kp, stream); });
  // Tokens outside every sequence: O = 0, LSE = -inf (the kernel writes only sequences' rows).
  launch([&] {
    varlen_clear_gaps_sm90(kp.varlen_meta, 0, kp.num_seqs, kp.q_tiles_max, kp.k_tiles_max,
                           static_cast<int>(pr.seqlen_q), out_k.data_ptr(), pr.heads_q * pr.kv * 2, nullptr, 0,
                           lse.data_ptr<float>(), 1, static_cast<int>(pr.heads_q),
                           -std::numeric_limits<float>::infinity(), stream);
  });
  return {packed_output(out_k, pr.dv, q_in.scalar_type()), lse};
}

// bwd_varlen (schema: ops.cpp): the `tile` backward of a packed batch, one launch
// per kernel; dq, dk, dv like q, k, v (contiguous), diag float32 [4, Hq, total_q]
// (delta, eps, rowsum_pre, rowsum_post) with diagnostics, else [0]; tokens outside
// every sequence get zero gradients (and zero diagnostics).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_varlen_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const c10::optional<at::Tensor>& seqused_q,
    const c10::optional<at::Tensor>& seqused_k, double softmax_scale, bool causal, c10::string_view delta_mode,
    int64_t block_size, c10::string_view grad_format, bool diagnostics, c10::string_view scaling,
    int64_t window_left, int64_t window_right, c10::string_view qk_rotation) {
  check_packed_scaling(scaling);
  const Scaling recipe = check_bwd_scaling(scaling);
  const at::Tensor q4 = packed_view(q_in, "q"), k4 = packed_view(k_in, "k"), v4 = packed_view(v_in, "v");
  const at::Tensor do4 = packed_view(dout_in, "dout"), o4 = packed_view(out_in, "out");
  const Problem pr = check_problem(q4, k4, v4, softmax_scale, "fp8", block_size);
  const bool rotate = cuda_qk_rotation(qk_rotation, false, Scaling::kTile, pr.dqk, pr.kqk);
  TORCH_CHECK_NOT_IMPLEMENTED(pr.heads_q <= 65535, "fp8attn: argument 'q': the single-launch varlen kernels take "
                              "num_heads_q <= 65535, got ", pr.heads_q, "; varlen_attention runs it per sequence");
  const DeltaMode mode = parse_delta_mode(delta_mode);
  const Fp8Format gfmt = parse_grad_format(grad_format);
  const at::Device device = q_in.device();
  check_dout_out(do4, o4, 1, pr, device);
  TORCH_CHECK_VALUE(lse_in.defined() && lse_in.device() == device, "fp8attn: argument 'lse': expected a tensor on ",
                    device);
  TORCH_CHECK_TYPE(lse_in.scalar_type() == at::kFloat, "fp8attn: argument 'lse': expected float32, got ",
                   lse_in.scalar_type());
  TORCH_CHECK_VALUE(lse_in.dim() == 2 && lse_in.size(0) == pr.heads_q && lse_in.size(1) == pr.seqlen_q,
                    "fp8attn: argument 'lse': expected shape [", pr.heads_q, ", ", pr.seqlen_q, "], got ",
                    lse_in.sizes());
  const WindowBounds win = effective_window(causal, window_left, window_right, pr.seqlen_q, pr.seqlen_k);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const auto opts = q_in.options();
  const auto fopts = opts.dtype(at::kFloat);
  const PackedBatch pb = packed_batch(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, pr.seqlen_q, pr.seqlen_k,
                                      device, stream);
  at::Tensor diag = diagnostics ? at::empty({4, pr.heads_q, pr.seqlen_q}, fopts) : at::empty({0}, fopts);
  if (pb.n == 0 || pr.empty() || pr.seqlen_k == 0)
    return {at::zeros_like(q_in, at::MemoryFormat::Contiguous), at::zeros_like(k_in, at::MemoryFormat::Contiguous),
            at::zeros_like(v_in, at::MemoryFormat::Contiguous), diag.zero_()};

  const at::Tensor q = rotate ? rotation_input(q4) : kernel_input(q4, pr.kqk);
  const at::Tensor k = rotate ? rotation_input(k4) : kernel_input(k4, pr.kqk), v = kernel_input(v4, pr.kv);
  const at::Tensor dout = kernel_input(do4, pr.kv), out = kernel_input(o4, pr.kv);
  const at::Tensor lse = lse_in.contiguous();
  const auto u8 = q.options().dtype(at::kByte);
  const auto bopts = opts.dtype(at::kBFloat16);
  const int64_t rq = pb.q_tiles * kSeqBlock, rk = pb.k_tiles * kSeqBlock;
  const int64_t Hq = pr.heads_q, Hk = pr.heads_kv;
  // Codes and scales in the padded layout (kernel_params_sm90.h, scaling == 1).
  const at::Tensor q_row = at::empty({1, Hq, rq, pr.kqk}, u8), q_row_s = at::empty({1, Hq, rq}, fopts);
  const at::Tensor q_colT = at::empty({1, Hq, pr.kqk, rq}, u8), q_col_s = at::empty({1, Hq, pb.q_tiles}, fopts);
  const at::Tensor k_row = at::empty({1, Hk, rk, pr.kqk}, u8), k_colT = at::empty({1, Hk, pr.kqk, rk}, u8);
  const at::Tensor k_row_s = at::empty({1, Hk, pb.k_tiles}, fopts);
  const at::Tensor v_row = at::empty({1, Hk, rk, pr.kv}, u8), v_row_s = at::empty({1, Hk, pb.k_tiles}, fopts);
  const at::Tensor do_row = at::empty({1, Hq, rq, pr.kv}, u8), do_row_s = at::empty({1, Hq, rq}, fopts);
  const at::Tensor do_colT = at::empty({1, Hq, pr.kv, rq}, u8), do_col_s = at::empty({1, Hq, pb.q_tiles}, fopts);
  const at::Tensor none;
  TileQuantJob jobs[4] = {tile_job(q, Fp8Format::kE4M3, q_row, q_row_s, none, q_colT, q_col_s),
                          tile_job(k, Fp8Format::kE4M3, none, none, k_row, k_colT, k_row_s),
                          tile_job(v, Fp8Format::kE4M3, none, none, v_row, none, v_row_s),
                          tile_job(dout, gfmt, do_row, do_row_s, none, do_colT, do_col_s)};
  jobs[0].rotate = jobs[1].rotate = rotate;  // numerics.md 10.1: the codes of Q R and K R
  packed_job(jobs[0], pb, true);
  packed_job(jobs[1], pb, false);
  packed_job(jobs[2], pb, false);
  packed_job(jobs[3], pb, true);
  launch([&] { quantize_tilescale_bf16_sm90(jobs, 4, stream); });

  // Workspace: per-row floats token-indexed [Hq, total_q]; dq_accum in padded rows.
  const bool dm = mode == DeltaMode::kDeltaMatching;
  at::Tensor delta = at::empty({1, Hq, pr.seqlen_q}, fopts), delta_dm = at::empty({1, Hq, pr.seqlen_q}, fopts);
  at::Tensor lse_bwd = dm ? at::empty({1, Hq, pr.seqlen_q}, fopts) : at::Tensor();
  at::Tensor dq_accum = at::zeros({1, Hq, sm90::dq_accum_rows(1, rq), pr.kqk}, fopts);
  at::Tensor rowsum_ws = diagnostics ? at::zeros({4, 1, Hq, pr.seqlen_q}, fopts) : at::Tensor();
  at::Tensor dq = at::empty({pr.seqlen_q, Hq, pr.kqk}, bopts);
  at::Tensor dk = at::empty({pr.seqlen_k, Hk, pr.kqk}, bopts);
  at::Tensor dv = at::empty({pr.seqlen_k, Hk, pr.kv}, bopts);

  KernelParams kp{};
  set_sizes(kp, pr, softmax_scale, win);
  set_packed(kp, pb);
  kp.delta_mode = static_cast<int>(mode);
  kp.grad_format = static_cast<int>(gfmt);
  kp.scaling = static_cast<int>(recipe);
  // One K_hat for #3 and #6: k_row_s is also #6's scale array.
  set_bwd_tensors(kp, {q, k, v, out, dout, lse, dq, dk, dv, q_row, q_row_s, k_row, k_row_s, v_row, v_row_s, do_row,
                       do_row_s, q_colT, q_col_s, k_colT, k_row_s, do_colT, do_col_s, delta, delta_dm, lse_bwd,
                       dq_accum, diagnostics ? diag : at::Tensor(), rowsum_ws});
  launch([&] { sm90::run_bwd(kp, stream); });
  // Tokens outside every sequence: zero gradients and diagnostics.
  launch([&] {
    varlen_clear_gaps_sm90(kp.varlen_meta, 0, kp.num_seqs, kp.q_tiles_max, kp.k_tiles_max,
                           static_cast<int>(pr.seqlen_q), dq.data_ptr(), Hq * pr.kqk * 2, nullptr, 0,
                           diagnostics ? diag.data_ptr<float>() : nullptr, 4, static_cast<int>(Hq), 0.f, stream);
    varlen_clear_gaps_sm90(kp.varlen_meta, 1, kp.num_seqs, kp.q_tiles_max, kp.k_tiles_max,
                           static_cast<int>(pr.seqlen_k), dk.data_ptr(), Hk * pr.kqk * 2, dv.data_ptr(),
                           Hk * pr.kv * 2, nullptr, 0, static_cast<int>(Hk), 0.f, stream);
  });
  const at::ScalarType dt = q_in.scalar_type();
  // The fused rotation's dQ' = dQ R, dK' = dK R mapped back (zero rows stay zero).
  if (rotate) return {rotate_back(dq, dt, stream), rotate_back(dk, dt, stream), packed_output(dv, pr.dv, dt), diag};
  return {packed_output(dq, pr.dqk, dt), packed_output(dk, pr.dqk, dt), packed_output(dv, pr.dv, dt), diag};
}

}  // namespace
}  // namespace fp8attn

TORCH_LIBRARY_IMPL(fp8attn, CUDA, m) {
  m.impl("fwd", &fp8attn::fwd_cuda);
  m.impl("bwd", &fp8attn::bwd_cuda);
  m.impl("bwd_dm_sums", &fp8attn::bwd_dm_sums_cuda);
  m.impl("quantize_blockwise", &fp8attn::quantize_blockwise_cuda);
  m.impl("quantize_tilescale", &fp8attn::quantize_tilescale_cuda);
  m.impl("quantize_tilescale_fwd", &fp8attn::quantize_tilescale_fwd_cuda);
  m.impl("fwd_varlen", &fp8attn::fwd_varlen_cuda);
  m.impl("bwd_varlen", &fp8attn::bwd_varlen_cuda);
  // CPU-only ops: a ValueError naming the argument (op_stubs.h), not torch's "Could not run".
  for (const char* name : {"fp8_encode", "fp8_decode", "dequantize_blockwise"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fp8attn::cpu_only_op>());
}
