// fp8attn: CPU implementations of the attention ops `fwd` and `bwd` (schemas in
// ops.cpp, semantics in docs/architecture.md and docs/numerics.md sections
// 1 and 3-5). They wrap the CPU reference (reference/attention_ref.h).
//
// Tensors are [batch, heads, seqlen, head_dim] at the op level. Any strides are
// accepted as long as the head_dim stride is 1 (otherwise the tensor is made
// contiguous first); outputs are allocated contiguous. Supported dtypes:
// float32, float64, bfloat16. A bad argument raises ValueError (TypeError for a
// wrong dtype) naming the argument; the reference's ArgumentError is mapped to
// ValueError too.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>
#include <string>

#include "common/error.h"
#include "common/params.h"
#include "op_args.h"
#include "reference/attention_ref.h"

namespace fp8attn {
namespace {

// ---- argument parsing -------------------------------------------------------

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "fp8attn: argument '", name,
                       "': dtype must be bfloat16, float32 or float64, got ", t.scalar_type());
  }
}




// Checks device/rank/dtype and returns a tensor whose head_dim stride is 1.
at::Tensor prepare(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "fp8attn: argument '", name, "': tensor is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "fp8attn: argument '", name,
                    "': the CPU implementation needs a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == 4, "fp8attn: argument '", name,
                    "': expected a 4-D tensor [batch, heads, seqlen, head_dim], got ", t.dim(),
                    "-D with shape ", t.sizes());
  to_dtype(t, name);
  // NOTE: a size-1 head_dim may carry any stride (only index 0 is read);
  // stride 0 with size > 1 (expanded) or a transposed head_dim is copied.
  if (t.size(3) > 1 && t.stride(3) != 1) return t.contiguous();
  return t;
}

// [b, h, s, d] tensor -> the reference's strided view (strides in elements).
TensorView view_of(const at::Tensor& t, const char* name) {
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t, name);
  v.stride_batch = t.stride(0);
  v.stride_head = t.stride(1);
  v.stride_seq = t.stride(2);
  return v;
}

void check_dim(const at::Tensor& t, int dim, int64_t expected, const char* name, const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, "fp8attn: argument '", name, "': ", what, " (dim ", dim,
                    ") must be ", expected, ", got ", t.size(dim), " (shape ", t.sizes(), ")");
}

// Fills the problem sizes from q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv]
// and checks that they agree.
void check_softcap(double softcap) {
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0,
                    "fp8attn: argument 'softcap': must be finite and >= 0 (0 = off), got ", softcap);
}

AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double softmax_scale, bool causal, c10::string_view precision,
                       int64_t block_size) {
  AttnParams p;
  p.batch = q.size(0);
  p.num_heads_q = q.size(1);
  p.seqlen_q = q.size(2);
  p.head_dim_qk = q.size(3);
  p.num_heads_kv = k.size(1);
  p.seqlen_k = k.size(2);
  p.head_dim_v = v.size(3);
  check_dim(k, 0, p.batch, "k", "batch");
  check_dim(v, 0, p.batch, "v", "batch");
  check_dim(k, 3, p.head_dim_qk, "k", "head_dim (must equal q's)");
  check_dim(v, 1, p.num_heads_kv, "v", "num_heads (must equal k's)");
  check_dim(v, 2, p.seqlen_k, "v", "seqlen (must equal k's)");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "fp8attn: arguments 'q', 'k', 'v' must share one dtype, got ", q.scalar_type(),
                    ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale > 0.0,
                    "fp8attn: argument 'softmax_scale': must be finite and > 0, got ", softmax_scale);
  p.softmax_scale = softmax_scale;
  p.causal = causal;
  p.precision = parse_precision(precision);
  p.block_size = static_cast<int>(block_size);
  TORCH_CHECK_VALUE(block_size == 32 || block_size == 64 || block_size == 128,
                    "fp8attn: argument 'block_size': must be 32, 64 or 128, got ", block_size);
  p.num_threads = at::get_num_threads();
  return p;
}

bool is_empty_problem(const AttnParams& p) {
  return p.batch == 0 || p.num_heads_q == 0 || p.seqlen_q == 0 || p.seqlen_k == 0;
}

// Runs `fn` and maps the reference's ArgumentError to ValueError.
template <class Fn>
void call_reference(Fn&& fn) {
  try {
    fn();
  } catch (const ArgumentError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// A per-row FP32 tensor [B, Hq, Sq] argument (the given delta), contiguous.
at::Tensor row_vector(const at::Tensor& t, const char* name, const AttnParams& p) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 3 && t.size(0) == p.batch && t.size(1) == p.num_heads_q &&
                        t.size(2) == p.seqlen_q,
                    "fp8attn: argument '", name, "': expected a CPU tensor of shape [", p.batch, ", ", p.num_heads_q,
                    ", ", p.seqlen_q, "], got ", t.device(), " ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "fp8attn: argument '", name, "': expected float32, got ",
                   t.scalar_type());
  return t.contiguous();
}

// What a backward over a shard of the key axis takes (numerics.md section 11); the
// reference checks the same, these fire before the empty-problem shortcut too.
void check_sharded_args(const AttnParams& p, bool diagnostics) {
  TORCH_CHECK_VALUE(p.precision == Precision::kFP8, "fp8attn: argument 'precision': an explicit delta needs "
                    "precision \"fp8\"");
  TORCH_CHECK_VALUE(p.delta_mode == DeltaMode::kDeltaMatching, "fp8attn: argument 'delta_mode': an explicit "
                    "delta is the Delta-Matching delta: delta_mode must be \"delta_matching\"");
  TORCH_CHECK_VALUE(!diagnostics, "fp8attn: argument 'diagnostics': a backward with an explicit delta has no "
                    "per-call diagnostics (its delta is global); pass diagnostics=False");
  TORCH_CHECK_VALUE(p.qk_rotation == QkRotation::kNone && !p.smooth_k, "fp8attn: argument 'qk_rotation': an "
                    "explicit delta is not implemented with qk_rotation or smooth_k");
}

// ---- ops ----------------------------------------------------------------------

// fwd: out [B,Hq,Sq,Dv] in q's dtype, lse float32 [B,Hq,Sq] (numerics.md s.1/3;
// scaling "row" or "tile": s.9; qk_rotation / smooth_k: s.10, applied by the reference;
// softcap: s.12; window_left / window_right: the sliding window of s.1, any int, a
// negative bound unbounded, causal forcing window_right = 0). Every op below takes them.
std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                           const at::Tensor& v_in, double softmax_scale,
                                           bool causal, c10::string_view precision,
                                           int64_t block_size, c10::string_view scaling,
                                           c10::string_view qk_rotation, bool smooth_k, double softcap,
                                           int64_t window_left, int64_t window_right) {
  const at::Tensor q = prepare(q_in, "q");
  const at::Tensor k = prepare(k_in, "k");
  const at::Tensor v = prepare(v_in, "v");
  AttnParams p = make_params(q, k, v, softmax_scale, causal, precision, block_size);
  p.scaling = parse_scaling(scaling);
  p.qk_rotation = parse_qk_rotation(qk_rotation);
  p.smooth_k = smooth_k;
  check_softcap(softcap);
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;

  at::Tensor out = at::empty({p.batch, p.num_heads_q, p.seqlen_q, p.head_dim_v}, q.options());
  at::Tensor lse = at::empty({p.batch, p.num_heads_q, p.seqlen_q}, q.options().dtype(at::kFloat));
  if (is_empty_problem(p)) {
    // No key at all (or nothing to compute): every row sees no key.
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  call_reference([&] {
    check_attention_params(p);
    attention_forward_ref(p, view_of(q, "q"), view_of(k, "k"), view_of(v, "v"),
                          view_of(out, "out"), lse.data_ptr<float>());
  });
  return {out, lse};
}

// bwd: dq/dk/dv in the dtypes and shapes of q/k/v; diag float32 [4,B,Hq,Sq]
// = (delta, eps, rowsum_pre, rowsum_post) when `diagnostics`, else empty [0].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    double softmax_scale, bool causal, c10::string_view precision, c10::string_view delta_mode,
    int64_t block_size, c10::string_view grad_format, bool diagnostics, c10::string_view scaling,
    c10::string_view qk_rotation, bool smooth_k, const c10::optional<at::Tensor>& delta_in, double softcap,
    int64_t window_left, int64_t window_right, bool /*deterministic: the reference always is*/) {
  const at::Tensor q = prepare(q_in, "q");
  const at::Tensor k = prepare(k_in, "k");
  const at::Tensor v = prepare(v_in, "v");
  AttnParams p = make_params(q, k, v, softmax_scale, causal, precision, block_size);
  p.scaling = parse_scaling(scaling);
  p.qk_rotation = parse_qk_rotation(qk_rotation);
  p.smooth_k = smooth_k;
  p.delta_mode = parse_delta_mode(delta_mode);
  check_softcap(softcap);
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  at::Tensor delta_given;
  ShardedDelta sharded;
  if (delta_in.has_value() && delta_in->defined()) {
    delta_given = row_vector(*delta_in, "delta", p);
    sharded.delta = delta_given.data_ptr<float>();
    p.sharded = &sharded;
  }
  if (p.sharded != nullptr) check_sharded_args(p, diagnostics);
  p.grad_format = parse_grad_format(grad_format);

  // dO and O come in q's dtype (the op boundary dtype; what autograd hands back): another
  // dtype is the caller's mistake (as on CUDA), not something to convert silently.
  const at::Tensor dout = prepare(dout_in, "dout");
  const at::Tensor out = prepare(out_in, "out");
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type(), "fp8attn: argument 'dout': expected q's dtype ",
                   q.scalar_type(), ", got ", dout.scalar_type());
  TORCH_CHECK_TYPE(out.scalar_type() == q.scalar_type(), "fp8attn: argument 'out': expected q's dtype ",
                   q.scalar_type(), ", got ", out.scalar_type());
  for (int d = 0; d < 4; ++d) {
    const int64_t want[4] = {p.batch, p.num_heads_q, p.seqlen_q, p.head_dim_v};
    check_dim(dout, d, want[d], "dout", "size");
    check_dim(out, d, want[d], "out", "size");
  }
  TORCH_CHECK_VALUE(lse_in.defined() && lse_in.device().is_cpu() && lse_in.dim() == 3 &&
                        lse_in.size(0) == p.batch && lse_in.size(1) == p.num_heads_q &&
                        lse_in.size(2) == p.seqlen_q,
                    "fp8attn: argument 'lse': expected a CPU tensor of shape [", p.batch, ", ",
                    p.num_heads_q, ", ", p.seqlen_q, "], got ",
                    lse_in.defined() ? lse_in.device().str() : std::string("undefined"), " ",
                    lse_in.defined() ? lse_in.sizes() : at::IntArrayRef{});
  // NOTE: float32 as fwd returns it (and as the CUDA op requires): a bf16 LSE would be
  // silently widened here and shift every P = exp(S - LSE) by its rounding error.
  TORCH_CHECK_TYPE(lse_in.scalar_type() == at::kFloat, "fp8attn: argument 'lse': expected float32, got ",
                   lse_in.scalar_type());
  const at::Tensor lse = lse_in.contiguous();

  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor diag = diagnostics
                        ? at::empty({4, p.batch, p.num_heads_q, p.seqlen_q}, lse.options())
                        : at::empty({0}, lse.options());
  if (is_empty_problem(p)) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    diag.zero_();
    return {dq, dk, dv, diag};
  }

  BackwardDiagnostics bd;
  if (diagnostics) {
    const int64_t n = p.batch * p.num_heads_q * p.seqlen_q;
    float* base = diag.data_ptr<float>();
    bd.delta = base;
    bd.eps = base + n;
    bd.rowsum_pre = base + 2 * n;
    bd.rowsum_post = base + 3 * n;
  }
  call_reference([&] {
    check_attention_params(p);
    attention_backward_ref(p, view_of(q, "q"), view_of(k, "k"), view_of(v, "v"),
                           view_of(out, "out"), view_of(dout, "dout"), lse.data_ptr<float>(),
                           view_of(dq, "dq"), view_of(dk, "dk"), view_of(dv, "dv"),
                           diagnostics ? &bd : nullptr);
  });
  return {dq, dk, dv, diag};
}

// bwd_dm_sums: (sum_pdp, sum_p) float32 [B, Hq, Sq], the Delta-Matching
// pre-pass over this call's keys (numerics.md section 11; precision fp8).
std::tuple<at::Tensor, at::Tensor> bwd_dm_sums_cpu(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                   const at::Tensor& k_in, const at::Tensor& v_in,
                                                   const at::Tensor& lse_in, double softmax_scale, bool causal,
                                                   int64_t block_size, c10::string_view grad_format,
                                                   c10::string_view scaling, double softcap,
                                                   int64_t window_left, int64_t window_right) {
  const at::Tensor q = prepare(q_in, "q");
  const at::Tensor k = prepare(k_in, "k");
  const at::Tensor v = prepare(v_in, "v");
  AttnParams p = make_params(q, k, v, softmax_scale, causal, "fp8", block_size);
  p.scaling = parse_scaling(scaling);
  p.grad_format = parse_grad_format(grad_format);
  check_softcap(softcap);
  p.softcap = softcap;
  p.window_left = window_left;
  p.window_right = window_right;
  const at::Tensor dout = prepare(dout_in, "dout");
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type(), "fp8attn: argument 'dout': expected q's dtype ",
                   q.scalar_type(), ", got ", dout.scalar_type());
  for (int d = 0; d < 4; ++d) {
    const int64_t want[4] = {p.batch, p.num_heads_q, p.seqlen_q, p.head_dim_v};
    check_dim(dout, d, want[d], "dout", "size");
  }
  const at::Tensor lse = row_vector(lse_in, "lse", p);
  at::Tensor sum_pdp = at::zeros({p.batch, p.num_heads_q, p.seqlen_q}, lse.options());
  at::Tensor sum_p = at::zeros({p.batch, p.num_heads_q, p.seqlen_q}, lse.options());
  if (is_empty_problem(p)) return {sum_pdp, sum_p};
  call_reference([&] {
    check_attention_params(p);
    attention_dm_sums_ref(p, view_of(q, "q"), view_of(k, "k"), view_of(v, "v"), view_of(dout, "dout"),
                          lse.data_ptr<float>(), sum_pdp.data_ptr<float>(), sum_p.data_ptr<float>());
  });
  return {sum_pdp, sum_p};
}

}  // namespace
}  // namespace fp8attn

TORCH_LIBRARY_IMPL(fp8attn, CPU, m) {
  m.impl("fwd", &fp8attn::fwd_cpu);
  m.impl("bwd", &fp8attn::bwd_cpu);
  m.impl("bwd_dm_sums", &fp8attn::bwd_dm_sums_cpu);
}
