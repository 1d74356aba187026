// fp8attn: the one parameter struct shared by the CPU reference, the CUDA
// kernels and the PyTorch binding. Math contract: ../shared/design/numerics.md
// (mirrored in docs/numerics.md).
#pragma once

#include <cstdint>

namespace fp8attn {

// numerics.md section 2. E4M3 is the "fn" variant (no inf, max 448).
enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

// numerics.md section 1 (kExact, FP64 accumulation) vs section 3 (kFP8).
enum class Precision : int { kExact = 0, kFP8 = 1 };

// numerics.md section 4.
enum class DeltaMode : int { kStale = 0, kMatchedDO = 1, kDeltaMatching = 2 };

// numerics.md section 9: how the FP8 operands of the seven attention-core
// matmuls are blocked. kRow: 1x128 blocks along each matmul's reduction
// dimension (sections 2-3); kTile: one scale per query row or per tile of
// block_size keys / queries, always over all of head_dim, so every scale folds
// into a per-row coefficient or one scalar per loop step (section 9).
enum class Scaling : int { kRow = 0, kTile = 1 };

// numerics.md section 10: the outlier transforms applied to Q and K before
// quantization. kHadamard rotates every Q and K row by the same fixed
// orthogonal matrix (block-diagonal normalized Hadamard with a fixed sign
// pattern), so S is unchanged in exact arithmetic.
enum class QkRotation : int { kNone = 0, kHadamard = 1 };

// Element type of a tensor at the API boundary. The reference computes in
// FP32 (fp8 path) or FP64 (exact path) internally whatever the input type.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kBFloat16 = 2 };

// A strided 4-D view [batch, seqlen, heads, head_dim] (or any permutation of
// the first three: only the strides matter). The head_dim stride must be 1.
// Strides are in elements, not bytes.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t stride_batch = 0;
  int64_t stride_seq = 0;
  int64_t stride_head = 0;
};

// Problem description. Shapes follow numerics.md section 1:
// Q[b, seqlen_q, num_heads_q, head_dim_qk], K[b, seqlen_k, num_heads_kv,
// head_dim_qk], V[b, seqlen_k, num_heads_kv, head_dim_v],
// O/dO[b, seqlen_q, num_heads_q, head_dim_v]. GQA: query head h uses
// key/value head h / (num_heads_q / num_heads_kv).
struct ShardedDelta;

struct AttnParams {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t num_heads_q = 0;
  int64_t num_heads_kv = 0;
  int64_t head_dim_qk = 0;
  int64_t head_dim_v = 0;

  double softmax_scale = 0.0;  // tau; callers pass 1/sqrt(head_dim_qk) for the default.
                               // NOTE: double so the exact path is FP64-exact; the fp8 path rounds it to FP32.
  bool causal = false;         // bottom-right aligned: j <= i + (seqlen_k - seqlen_q)
  // Sliding window (numerics.md section 14, FlashAttention's window_size): query i sees key j
  // iff j >= i + (seqlen_k - seqlen_q) - window_left (window_left >= 0) and
  // j <= i + (seqlen_k - seqlen_q) + window_right (window_right >= 0); a negative bound is
  // unbounded. causal forces window_right = 0 (FlashAttention's rule); causal = (-1, 0).
  // effective_window() gives the bounds every implementation uses.
  int64_t window_left = -1;
  int64_t window_right = -1;

  Precision precision = Precision::kFP8;
  DeltaMode delta_mode = DeltaMode::kDeltaMatching;
  int block_size = 128;                       // B in {32, 64, 128}
  Fp8Format grad_format = Fp8Format::kE4M3;   // format of dO and dS (E4M3 or E5M2)
  Scaling scaling = Scaling::kRow;            // FP8 recipe (numerics.md section 9); kTile: block_size = tile edge
  QkRotation qk_rotation = QkRotation::kNone; // rotate Q and K before quantization (numerics.md section 10)
  bool smooth_k = false;                      // subtract the mean key per (batch, kv head) (section 10)
  double softcap = 0.0;  // logit softcapping (numerics.md section 12): x' = c tanh(x / c) on the scaled
                         // logits x = tau S before the softmax; 0 = off (FlashAttention's softcap)

  int num_threads = 0;  // CPU reference: 0 = std::thread::hardware_concurrency()

  // Context parallelism (numerics.md section 11): the key axis is one shard of the
  // sequence. Null = the ordinary backward. Only the fp8 path without outlier
  // transforms and without diagnostics takes it.
  const ShardedDelta* sharded = nullptr;
};

// The mask of a problem as window bounds (numerics.md section 14):
// left / right >= 0 bound the keys a row sees on that side, -1 = unbounded. Normalized
// as FlashAttention-3 does (hopper/flash_api.cpp), which changes no row's key set: a
// negative bound is -1; causal sets right = 0; left >= seqlen_k - 1 or right >=
// seqlen_q - 1 reaches past every key of every row, so it is -1. So (-1, -1) is no mask,
// (-1, 0) exactly the causal mask, anything else a sliding window (local()).
struct WindowBounds {
  int64_t left = -1, right = -1;
  bool masked() const { return left >= 0 || right >= 0; }
  bool causal() const { return left < 0 && right == 0; }
  bool local() const { return masked() && !causal(); }
};

inline WindowBounds effective_window(bool causal, int64_t window_left, int64_t window_right,
                                     int64_t seqlen_q, int64_t seqlen_k) {
  WindowBounds w;
  w.left = window_left < 0 || window_left >= seqlen_k - 1 ? -1 : window_left;
  w.right = causal ? 0 : window_right < 0 || window_right >= seqlen_q - 1 ? -1 : window_right;
  return w;
}

inline WindowBounds effective_window(const AttnParams& p) {
  return effective_window(p.causal, p.window_left, p.window_right, p.seqlen_q, p.seqlen_k);
}

// The Delta-Matching delta over a sharded key axis (numerics.md section 11).
// Every pointer is a contiguous FP32 array [batch, num_heads_q, seqlen_q].
// - sum_pdp / sum_p set (the pre-pass of one key shard): the backward computes
//   only the partial row sums sum_j P_ij dP_hat_ij and sum_j P_ij over this
//   call's keys, P = exp(S - lse) from the lse given (the forward's global LSE),
//   in the same FP32 key order as the unsharded pre-pass; no gradients.
// - delta set (the main pass of one key shard): delta_i is taken as given for
//   every row and P = exp(S - lse) from the lse given (the global
//   backward-consistent LSE'), with no renormalization over this shard's keys.
struct ShardedDelta {
  const float* delta = nullptr;
  float* sum_pdp = nullptr;
  float* sum_p = nullptr;
};

// Optional per-row backward diagnostics (numerics.md section 5). Each non-null
// pointer is a contiguous FP32 array [batch, num_heads_q, seqlen_q].
struct BackwardDiagnostics {
  float* delta = nullptr;         // delta_i actually used by the selected mode
  float* eps = nullptr;           // delta_i(mode) - delta_i(delta_matching)
  float* rowsum_pre = nullptr;    // |sum_j dS_ij| / sum_j |dS_ij|, FP32 dS
  float* rowsum_post = nullptr;   // same on the decoded row-blocked FP8 dS (matmul #6 operand)
};

}  // namespace fp8attn
