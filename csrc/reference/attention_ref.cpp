// fp8attn: CPU reference attention (numerics.md sections 1-5). See
// attention_ref.h for the contract; this file is organized as
//   1. element access (dtype conversion, strided rows),
//   2. argument checks,
//   3. FP8 operand blockings and the block-scaled matmul kernels,
//   4. exact path (FP64) forward / backward,
//   5. fp8 path forward / backward,
//   6. outlier transforms of Q and K (numerics.md section 10) around 4-5,
//   7. public entry points.
//
// Work split: the forward runs tasks (batch, query head, chunk of rows); the
// backward runs tasks (batch, kv head) so each task owns its dK/dV rows (no
// races; GQA group sums stay in one FP32/FP64 accumulator). Every task is
// serial inside, so results do not depend on the thread count.
#include "reference/attention_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/error.h"
#include "common/fp8_codec.h"
#include "quant/block_quant.h"
#include "reference/parallel.h"
#include "reference/qk_transform.h"

// NOTE: the hot kernels are also compiled for AVX2 and picked at load time
// (GCC function multi-versioning). AVX2 without FMA performs the very same
// IEEE operations in the same order as the baseline SSE2 code (no sum is
// reassociated and there is no fused multiply-add to contract into), so
// results are bitwise identical on every x86-64 machine.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FP8ATTN_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FP8ATTN_KERNEL_CLONES
#endif

namespace fp8attn {
namespace {

constexpr int64_t kMaxBlock = 128;    // largest supported block_size
// Matmul #6 (dQ = dS K) blocks its dS operand per query row along keys in
// sub-blocks of min(B, kDsRowBlock) keys (numerics.md section 3).
constexpr int64_t kDsRowBlock = 64;
constexpr int64_t ds_row_block(int64_t B) { return B < kDsRowBlock ? B : kDsRowBlock; }
static_assert(32 % ds_row_block(32) == 0 && 64 % ds_row_block(64) == 0 &&
                  128 % ds_row_block(128) == 0,
              "each B-block of K splits into whole dS sub-blocks, so they start at multiples of "
              "Bds from key 0");
constexpr int64_t kFwdRowChunk = 32;  // rows per forward task
constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr double kInfD = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------
// 1. Element access
// ---------------------------------------------------------------------------

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// FP32 -> BF16 bits, round to nearest even; NaN stays NaN (quiet).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// FP64 -> BF16 bits with a single RNE rounding. NOTE: rounding to FP32 first
// and then to BF16 could double-round; rounding to FP32 "to odd" (an inexact
// result gets an odd last bit) makes the second RNE step exact-equivalent
// because FP32 keeps more than 2 extra bits.
inline uint16_t double_to_bf16(double x) {
  float f = static_cast<float>(x);
  if (std::isfinite(x) && static_cast<double>(f) != x) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    if ((u & 1u) == 0u) f = std::nextafter(f, x > static_cast<double>(f) ? kInfF : -kInfF);
  }
  return float_to_bf16(f);
}

inline uint16_t to_bf16(float x) { return float_to_bf16(x); }
inline uint16_t to_bf16(double x) { return double_to_bf16(x); }

inline int64_t view_offset(const TensorView& t, int64_t b, int64_t s, int64_t h) {
  return b * t.stride_batch + s * t.stride_seq + h * t.stride_head;
}

// Reads n contiguous head_dim elements of position (b, s, h) as T.
template <class T>
void load_row(const TensorView& t, int64_t b, int64_t s, int64_t h, int64_t n, T* dst) {
  const int64_t off = view_offset(t, b, s, h);
  switch (t.dtype) {
    case DType::kFloat32: {
      const float* x = static_cast<const float*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(x[i]);
      break;
    }
    case DType::kFloat64: {
      const double* x = static_cast<const double*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(x[i]);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* x = static_cast<const uint16_t*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(bf16_to_float(x[i]));
      break;
    }
  }
}

// Loads the whole (b, h) sequence [0, seqlen) x [0, n) into dst[s * n + i].
template <class T>
void load_seq(const TensorView& t, int64_t b, int64_t h, int64_t seqlen, int64_t n, T* dst) {
  for (int64_t s = 0; s < seqlen; ++s) load_row(t, b, s, h, n, dst + s * n);
}

// Writes n values to position (b, s, h), rounding to the view's dtype (RNE).
template <class T>
void store_row(const TensorView& t, int64_t b, int64_t s, int64_t h, int64_t n, const T* src) {
  const int64_t off = view_offset(t, b, s, h);
  switch (t.dtype) {
    case DType::kFloat32: {
      float* x = static_cast<float*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::kFloat64: {
      double* x = static_cast<double*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) x[i] = static_cast<double>(src[i]);
      break;
    }
    case DType::kBFloat16: {
      uint16_t* x = static_cast<uint16_t*>(t.data) + off;
      for (int64_t i = 0; i < n; ++i) x[i] = to_bf16(src[i]);
      break;
    }
  }
}

template <class T>
void store_zero_row(const TensorView& t, int64_t b, int64_t s, int64_t h, int64_t n) {
  std::vector<T> z(static_cast<size_t>(n), T(0));
  store_row(t, b, s, h, n, z.data());
}

// NaN-propagating max (std::max drops a NaN in its second argument).
template <class T>
inline T nan_max(T a, T b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

// ---------------------------------------------------------------------------
// 2. Argument checks
// ---------------------------------------------------------------------------

void check_view(const TensorView& t, const char* name, bool nonempty) {
  const int dt = static_cast<int>(t.dtype);
  FP8ATTN_CHECK_ARG(dt >= 0 && dt <= 2, name,
                    "dtype must be float32, float64 or bfloat16, got enum value ", dt);
  FP8ATTN_CHECK_ARG(!nonempty || t.data != nullptr, name, "data pointer is null");
}

// Shared geometry of one problem. The mask (numerics.md sections 1 and 14: causal, sliding
// window) as effective window bounds: row i sees the contiguous keys
// [key_begin(i), key_end(i)) (empty when equal) and key j is seen by the contiguous
// rows [query_begin(j), query_end(j)). All four are non-decreasing in their argument,
// so the keys a run of rows sees (and the rows a run of keys is seen by) are the
// range from its first member's begin to its last member's end.
struct Geometry {
  int64_t B, Sq, Sk, Hq, Hkv, group, d, dv;
  int64_t offset;  // bottom-right alignment: the diagonal of row i is key i + offset
  WindowBounds win;  // effective bounds (params.h): -1 = unbounded; causal = (-1, 0)

  explicit Geometry(const AttnParams& p)
      : B(p.batch),
        Sq(p.seqlen_q),
        Sk(p.seqlen_k),
        Hq(p.num_heads_q),
        Hkv(p.num_heads_kv),
        group(p.num_heads_q / p.num_heads_kv),
        d(p.head_dim_qk),
        dv(p.head_dim_v),
        offset(p.seqlen_k - p.seqlen_q),
        win(effective_window(p)) {}

  // A bound on the key side cuts a key tile (prefix: right bound; suffix: left bound).
  bool has_left() const { return win.left >= 0; }
  bool has_right() const { return win.right >= 0; }
  bool masked() const { return win.masked(); }

  static int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return std::max(lo, std::min(hi, x)); }
  // Keys row i sees: [key_begin(i), key_end(i)).
  int64_t key_end(int64_t i) const {
    return has_right() ? clamp(i + offset + win.right + 1, 0, Sk) : Sk;
  }
  int64_t key_begin(int64_t i) const {
    const int64_t lo = has_left() ? clamp(i + offset - win.left, 0, Sk) : 0;
    return std::min(lo, key_end(i));
  }
  int64_t visible_keys(int64_t i) const { return key_end(i) - key_begin(i); }
  // Rows that see key j: [query_begin(j), query_end(j)).
  int64_t query_end(int64_t j) const {
    return has_left() ? clamp(j - offset + win.left + 1, 0, Sq) : Sq;
  }
  int64_t query_begin(int64_t j) const {
    const int64_t lo = has_right() ? clamp(j - offset - win.right, 0, Sq) : 0;
    return std::min(lo, query_end(j));
  }
  int64_t lse_index(int64_t b, int64_t hq, int64_t i) const { return (b * Hq + hq) * Sq + i; }
};

// ---------------------------------------------------------------------------
// 3. FP8 operand blockings and block-scaled matmul kernels
// ---------------------------------------------------------------------------

// Decoded value of each FP8 code (unscaled), built from the shared codec.
const float* fp8_values(Fp8Format fmt) {
  struct Table {
    float v[2][256];
    Table() {
      for (int c = 0; c < 256; ++c) {
        v[0][c] = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE4M3);
        v[1][c] = fp8_decode(static_cast<uint8_t>(c), Fp8Format::kE5M2);
      }
    }
  };
  static const Table table;
  return table.v[fmt == Fp8Format::kE5M2 ? 1 : 0];
}

// Quantizes one block of n <= kMaxBlock values x[0], x[stride], ... with
// quantize_block (numerics.md section 2) and writes the unscaled FP8 values
// x_hat (as floats) to hat[0], hat[hat_stride], ...; returns the block scale s
// (decoded value = x_hat * s; NaN scale and NaN x_hat for a non-finite block).
float quant_hat(const float* x, int64_t n, int64_t stride, Fp8Format fmt, float* hat,
                int64_t hat_stride) {
  uint8_t codes[kMaxBlock];
  float s;
  if (stride == 1) {
    s = quantize_block(x, n, 1, fmt, codes, nullptr);
  } else {
    float gathered[kMaxBlock];
    for (int64_t i = 0; i < n; ++i) gathered[i] = x[i * stride];
    s = quantize_block(gathered, n, 1, fmt, codes, nullptr);
  }
  const float* values = fp8_values(fmt);
  for (int64_t i = 0; i < n; ++i) hat[i * hat_stride] = values[codes[i]];
  return s;
}

// Scale of a block with the given running amax (quantize_block's rule).
// One step of the forward's online softmax over a key tile (numerics.md section 3,
// "Forward P"; both scaling recipes): scales the tile's L logits by tau, folds their
// max into the running max m, rescales the running sum l and the O accumulator acc
// (dvd channels) by exp(m - m_new), and leaves the unnormalized exp(S - m_new) in pexp.
// Logit softcapping (numerics.md section 12) of the scaled logits x[0, L) in place:
// x = c tanh(x / c); the tanh values go to t (if not null) for the backward's chain
// factor 1 - t^2. c = 0: nothing. FP64 (exact path) and FP32 (fp8 path) alike.
template <class T>
inline void softcap_logits(T* x, int64_t L, T c, T* t) {
  if (!(c > T(0))) return;
  for (int64_t j = 0; j < L; ++j) {
    const T th = std::tanh(x[j] / c);
    if (t) t[j] = th;
    x[j] = c * th;
  }
}

inline void online_softmax_tile(float* s, int64_t L, float tau, float cap, float& m, float& l, float* acc,
                                int64_t dvd, float* pexp) {
  float tile_max = -kInfF;
  for (int64_t j = 0; j < L; ++j) s[j] *= tau;
  softcap_logits<float>(s, L, cap, nullptr);  // numerics.md section 12 (cap = 0: off)
  for (int64_t j = 0; j < L; ++j) tile_max = nan_max(tile_max, s[j]);
  const float m_new = nan_max(m, tile_max);
  const float alpha = std::exp(m - m_new);
  float tile_sum = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    pexp[j] = std::exp(s[j] - m_new);
    tile_sum += pexp[j];
  }
  l = l * alpha + tile_sum;
  if (!(m_new == m))
    for (int64_t c = 0; c < dvd; ++c) acc[c] *= alpha;
  m = m_new;
}

inline float scale_of_amax(float amax, Fp8Format fmt) {
  return std::isfinite(amax) ? block_scale(amax, fmt) : NAN;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// An operand x[n][w] blocked along w (one set of blocks per row), stored
// transposed for the kernels that sweep many rows: hat_t[k * n + r] is the
// FP8 value of x[r][k], scale_t[kb * n + r] the scale of row r's block kb.
// Used for K (#1/#3, along d) and V (#4, along dv).
struct RowBlockedT {
  int64_t n = 0, w = 0;
  std::vector<float> hat_t, scale_t;
};

void make_row_blocked_t(const float* x, int64_t n, int64_t w, int64_t B, Fp8Format fmt,
                        RowBlockedT& out) {
  const int64_t nb = ceil_div(w, B);
  out.n = n;
  out.w = w;
  out.hat_t.assign(static_cast<size_t>(n * w), 0.f);
  out.scale_t.assign(static_cast<size_t>(nb * n), 0.f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t kb = 0; kb < nb; ++kb) {
      const int64_t k0 = kb * B, len = std::min(B, w - k0);
      out.scale_t[kb * n + r] =
          quant_hat(x + r * w + k0, len, 1, fmt, out.hat_t.data() + k0 * n + r, n);
    }
}

// The same blocking stored row-major: hat[r * w + k], scale[r * nb + kb].
// Used for the query-side operands Q (#1/#3, along d) and dO (#4, along dv).
struct RowBlocked {
  int64_t nb = 0;
  std::vector<float> hat, scale;
};

void make_row_blocked(const float* x, int64_t n, int64_t w, int64_t B, Fp8Format fmt,
                      RowBlocked& out) {
  out.nb = ceil_div(w, B);
  out.hat.assign(static_cast<size_t>(n * w), 0.f);
  out.scale.assign(static_cast<size_t>(n * out.nb), 0.f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t kb = 0; kb < out.nb; ++kb) {
      const int64_t k0 = kb * B, len = std::min(B, w - k0);
      out.scale[r * out.nb + kb] =
          quant_hat(x + r * w + k0, len, 1, fmt, out.hat.data() + r * w + k0, 1);
    }
}

// An operand x[n][w] blocked along n (per column, tiles of B rows starting at
// row 0): hat[r * w + c], scale[t * w + c] for tile t. Used for V (#2) and K
// (#6) along keys, and Q (#7) and dO (#5) along queries.
//
// Masking before quantization: a row (query) that sees only part of a key tile
// (a prefix under a right bound, a suffix under a left one, a middle range when
// a sliding window is narrower than the tile), or a key column seen by only part
// of a query tile (a suffix under a right bound, a prefix under a left one),
// must get a block quantized from its visible part alone. prefix[r * w + c] is
// the scale of column c over rows [tile start, r]; suffix[r * w + c] over [r,
// tile end); a middle range's scales are computed when it is read.
// When the visible scale equals the tile's scale the FP8 codes are identical,
// so the shared block is reused; otherwise that column is requantized.
// NOTE: with finite data the two blockings give the same products unless a
// visible element is FP8-subnormal under one scale and not the other (a
// power-of-two scale does not change the rounding of normal values); the
// difference that matters is a NaN/inf in a masked position, which must not
// poison the block of a row that does not see it.
struct ColBlocked {
  int64_t n = 0, w = 0, B = 0;
  Fp8Format fmt = Fp8Format::kE4M3;
  std::vector<float> raw, hat, scale, prefix, suffix;
};

void make_col_blocked(std::vector<float> x, int64_t n, int64_t w, int64_t B, Fp8Format fmt,
                      bool want_prefix, bool want_suffix, ColBlocked& out) {
  out.n = n;
  out.w = w;
  out.B = B;
  out.fmt = fmt;
  out.raw = std::move(x);
  const float* raw = out.raw.data();
  const int64_t nt = ceil_div(n, B);
  out.hat.assign(static_cast<size_t>(n * w), 0.f);
  out.scale.assign(static_cast<size_t>(nt * w), 0.f);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t r0 = t * B, len = std::min(B, n - r0);
    for (int64_t c = 0; c < w; ++c)
      out.scale[t * w + c] =
          quant_hat(raw + r0 * w + c, len, w, fmt, out.hat.data() + r0 * w + c, w);
  }
  // Running amax per column; the scale is recomputed only when it changes
  // (a handful of times per tile column). NaN sticks (nan_max).
  std::vector<float> run(static_cast<size_t>(w)), run_scale(static_cast<size_t>(w));
  auto scan = [&](int64_t r, float* table) {
    for (int64_t c = 0; c < w; ++c) {
      const float a = nan_max(run[c], std::fabs(raw[r * w + c]));
      if (!(a == run[c])) {  // changed (or NaN)
        run[c] = a;
        run_scale[c] = scale_of_amax(a, fmt);
      }
      table[r * w + c] = run_scale[c];
    }
  };
  auto reset = [&] {
    std::fill(run.begin(), run.end(), 0.f);
    std::fill(run_scale.begin(), run_scale.end(), scale_of_amax(0.f, fmt));
  };
  if (want_prefix) {
    out.prefix.assign(static_cast<size_t>(n * w), 0.f);
    for (int64_t t = 0; t < nt; ++t) {
      reset();
      for (int64_t r = t * B; r < std::min((t + 1) * B, n); ++r) scan(r, out.prefix.data());
    }
  }
  if (want_suffix) {
    out.suffix.assign(static_cast<size_t>(n * w), 0.f);
    for (int64_t t = 0; t < nt; ++t) {
      reset();
      for (int64_t r = std::min((t + 1) * B, n) - 1; r >= t * B; --r) scan(r, out.suffix.data());
    }
  }
}

// The block of tile t of `op` restricted to the visible rows [v0, v1): all of the
// tile, a prefix (the prefix table), a suffix (the suffix table) or, for a window
// narrower than the tile, a middle range (scales computed here). Returns the FP8
// values of row v0 (row stride w; rows up to v1) and sets *scale to the w column
// scales. mix_hat [kMaxBlock * w] and mix_scale [w] are scratch for requantized columns.
const float* visible_block(const ColBlocked& op, int64_t t, int64_t v0, int64_t v1, float* mix_hat,
                           float* mix_scale, const float** scale) {
  const int64_t w = op.w, r0 = t * op.B, r1 = std::min(r0 + op.B, op.n);
  const float* shared_scale = op.scale.data() + t * w;
  const float* shared_hat = op.hat.data() + v0 * w;
  *scale = shared_scale;
  if (v0 == r0 && v1 == r1) return shared_hat;
  // A partial block. Masks make them, and then the tables they need exist (a prefix
  // needs a bound that ends the range inside the tile, a suffix one that starts it there).
  const int64_t len = v1 - v0;
  const float* vis;
  if (v0 == r0) {
    vis = op.prefix.data() + (v1 - 1) * w;
  } else if (v1 == r1) {
    vis = op.suffix.data() + v0 * w;
  } else {
    for (int64_t c = 0; c < w; ++c) {
      float a = 0.f;
      for (int64_t r = v0; r < v1; ++r) a = nan_max(a, std::fabs(op.raw[r * w + c]));
      mix_scale[c] = scale_of_amax(a, op.fmt);
    }
    vis = mix_scale;
  }
  bool same = true;
  for (int64_t c = 0; c < w; ++c) same &= (vis[c] == shared_scale[c]);
  if (same) return shared_hat;
  std::memcpy(mix_hat, shared_hat, static_cast<size_t>(len * w) * sizeof(float));
  for (int64_t c = 0; c < w; ++c) {
    // NOTE: vis may alias mix_scale; each column reads its own entry before writing it.
    if (vis[c] == shared_scale[c]) {
      mix_scale[c] = shared_scale[c];
    } else {
      mix_scale[c] = quant_hat(op.raw.data() + v0 * w + c, len, w, op.fmt, mix_hat + c, w);
    }
  }
  *scale = mix_scale;
  return mix_hat;
}

// ---- Dense kernels ----------------------------------------------------------
//
// Both FP8 matmul shapes and the exact path's products reduce to one
// primitive, a transposed matrix-vector product over a column range:
//   sum[x] = sum_{r < R} a[r] * m[r * ldm + x]        for x in [0, n),
// with each sum[x] accumulated in r order from 0 (so it is the plain
// sequential FP sum; vectorization runs across x, never reassociates) and then
//   out[x] = sum[x]                        (sv == nullptr), or
//   out[x] += sum[x] * s * sv[x]           (block-scaled: s, sv[x] the scales).
// GCC vector extensions keep kVecs vectors of partial sums in registers.

// NOTE: the helpers below are always inlined, so passing 32-byte vectors by
// value never crosses an ABI boundary; silence GCC's note about it.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float f32x8 __attribute__((vector_size(32)));
typedef double f64x4 __attribute__((vector_size(32)));

template <class V, class T>
inline __attribute__((always_inline)) V vload(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V, class T>
inline __attribute__((always_inline)) void vstore(T* p, V v) {
  std::memcpy(p, &v, sizeof(V));
}
template <class V, class T>
inline __attribute__((always_inline)) V vbroadcast(T x) {
  V v;
  for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(T)); ++i) v[i] = x;
  return v;
}

template <class T, class V>
inline __attribute__((always_inline)) void gemv_t_impl(const T* __restrict a, int64_t R,
                                                       const T* __restrict m, int64_t ldm,
                                                       int64_t n, T s, const T* __restrict sv,
                                                       T* __restrict out) {
  constexpr int64_t kLanes = sizeof(V) / sizeof(T), kVecs = 4, kWide = kLanes * kVecs;
  const V s_v = vbroadcast<V>(s);
  int64_t x = 0;
  for (; x + kWide <= n; x += kWide) {
    V part[kVecs] = {};
    for (int64_t r = 0; r < R; ++r) {
      const V av = vbroadcast<V>(a[r]);
      const T* row = m + r * ldm + x;
      for (int64_t u = 0; u < kVecs; ++u) part[u] += av * vload<V>(row + u * kLanes);
    }
    for (int64_t u = 0; u < kVecs; ++u) {
      T* o = out + x + u * kLanes;
      if (sv)
        vstore(o, vload<V>(o) + part[u] * (s_v * vload<V>(sv + x + u * kLanes)));
      else
        vstore(o, part[u]);
    }
  }
  for (; x + kLanes <= n; x += kLanes) {
    V part = {};
    for (int64_t r = 0; r < R; ++r) part += vbroadcast<V>(a[r]) * vload<V>(m + r * ldm + x);
    if (sv)
      vstore(out + x, vload<V>(out + x) + part * (s_v * vload<V>(sv + x)));
    else
      vstore(out + x, part);
  }
  for (; x < n; ++x) {
    T part = 0;
    for (int64_t r = 0; r < R; ++r) part += a[r] * m[r * ldm + x];
    if (sv)
      out[x] += part * (s * sv[x]);
    else
      out[x] = part;
  }
}

FP8ATTN_KERNEL_CLONES
void gemv_t(const float* a, int64_t R, const float* m, int64_t ldm, int64_t n, float s,
            const float* sv, float* out) {
  gemv_t_impl<float, f32x8>(a, R, m, ldm, n, s, sv, out);
}

FP8ATTN_KERNEL_CLONES
void gemv_t(const double* a, int64_t R, const double* m, int64_t ldm, int64_t n, double* out) {
  gemv_t_impl<double, f64x4>(a, R, m, ldm, n, 0.0, nullptr, out);
}

// Matmul "row-blocked dots" (#1, #3, #4): for j in [0, L)
//   out[j] = sum_kb (sum_{k in block kb} a[k] * b_t[k * ldb + j]) * sa[kb] * sb_t[kb * ldb + j]
// a: one row of the left operand (w FP8 values, blocks of B along w, scales
// sa); b_t: the right operand transposed (FP8 values, row stride ldb; scales
// sb_t). Each block's partial sum is FP32 over FP8 values, then scaled.
void rowblock_dots(const float* a, const float* sa, const float* b_t, const float* sb_t,
                   int64_t ldb, int64_t w, int64_t B, int64_t L, float* out) {
  std::fill(out, out + L, 0.f);
  for (int64_t k0 = 0, kb = 0; k0 < w; k0 += B, ++kb)
    gemv_t(a + k0, std::min(B, w - k0), b_t + k0 * ldb, ldb, L, sa[kb], sb_t + kb * ldb, out);
}

// Matmul "column-blocked axpy" (#2, #5, #6, #7): one block of the reduction
// dimension (L FP8 values a with scale sa; L rows of b with row stride ldb and
// column scales sb):  acc[c] += (sum_{j < L} a[j] * b[j * ldb + c]) * sa * sb[c].
inline void colblock_axpy(const float* a, float sa, const float* b, int64_t ldb, const float* sb,
                          int64_t L, int64_t w, float* acc) {
  gemv_t(a, L, b, ldb, w, sa, sb, acc);
}

// ---- `tile` recipe operands (numerics.md section 9) --------------------------

// Unscaled FP8 values of n strided elements encoded with a given block scale
// s (quantize_block's encoding: x * (1/s), RNE, saturating); a NaN scale gives
// NaN values.
void quant_with_scale(const float* x, int64_t n, int64_t stride, float s, Fp8Format fmt,
                      float* hat, int64_t hat_stride) {
  const float inv_s = 1.f / s;
  const float* values = fp8_values(fmt);
  for (int64_t i = 0; i < n; ++i) hat[i * hat_stride] = values[fp8_encode(x[i * stride] * inv_s, fmt)];
}

// amax of n contiguous elements with NaN sticking (inf gives inf).
inline float amax_of(const float* x, int64_t n) {
  float a = 0.f;
  for (int64_t i = 0; i < n; ++i) a = nan_max(a, std::fabs(x[i]));
  return a;
}

// One block of n contiguous elements of any length (quant_hat is limited to
// kMaxBlock): returns the scale, writes the unscaled FP8 values.
float quant_hat_n(const float* x, int64_t n, Fp8Format fmt, float* hat) {
  const float s = scale_of_amax(amax_of(x, n), fmt);
  quant_with_scale(x, n, 1, s, fmt, hat, 1);
  return s;
}

// An operand x[n][w] (n along the sequence, w = head_dim) blocked in tiles of
// B rows times all w columns: one scale per tile. hat[r * w + c] (row-major)
// and, with want_t, hat_t[c * n + r] (transposed, for the row-dot kernels).
// Masking before quantization as for ColBlocked: a row (column) that sees only
// the rows [v0, v1) of a tile (a prefix, a suffix, or a middle range under a
// sliding window) reads a block requantized with the scale of those rows when it
// differs from the tile's; row_amax[r] (amax of row r over all w columns, NaN
// sticking) gives that scale.
struct TileBlocked {
  int64_t n = 0, w = 0, B = 0;
  Fp8Format fmt = Fp8Format::kE4M3;
  bool has_t = false;
  std::vector<float> raw, hat, hat_t, scale, row_amax;
};

void make_tile_blocked(std::vector<float> x, int64_t n, int64_t w, int64_t B, Fp8Format fmt,
                       bool want_t, TileBlocked& out) {
  out.n = n;
  out.w = w;
  out.B = B;
  out.fmt = fmt;
  out.has_t = want_t;
  out.raw = std::move(x);
  const float* raw = out.raw.data();
  const int64_t nt = ceil_div(n, B);
  out.row_amax.assign(static_cast<size_t>(n), 0.f);
  for (int64_t r = 0; r < n; ++r) out.row_amax[r] = amax_of(raw + r * w, w);
  out.hat.assign(static_cast<size_t>(n * w), 0.f);
  out.scale.assign(static_cast<size_t>(nt), 0.f);
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t r0 = t * B, r1 = std::min(n, r0 + B);
    float a = 0.f;
    for (int64_t r = r0; r < r1; ++r) a = nan_max(a, out.row_amax[r]);
    out.scale[t] = scale_of_amax(a, fmt);
    quant_with_scale(raw + r0 * w, (r1 - r0) * w, 1, out.scale[t], fmt, out.hat.data() + r0 * w, 1);
  }
  if (want_t) {
    out.hat_t.assign(static_cast<size_t>(n * w), 0.f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < w; ++c) out.hat_t[c * n + r] = out.hat[r * w + c];
  }
}

// Rows [v0, v1) of tile t of `op` as the block a row / column that sees only
// them reads (the whole tile, a prefix, a suffix or a middle range): FP8 values
// row-major (hat, row stride ld), transposed (hat_t, row stride ld_t; only if
// op.has_t) and the one scale. mix / mix_t are scratch for a requantized block.
struct TileView {
  const float* hat;
  int64_t ld;
  const float* hat_t;
  int64_t ld_t;
  float scale;
};

TileView visible_tile(const TileBlocked& op, int64_t t, int64_t v0, int64_t v1,
                      std::vector<float>& mix, std::vector<float>& mix_t) {
  const int64_t w = op.w, r0 = t * op.B, r1 = std::min(r0 + op.B, op.n);
  TileView tv{op.hat.data() + v0 * w, w, op.has_t ? op.hat_t.data() + v0 : nullptr, op.n,
              op.scale[t]};
  if (v0 == r0 && v1 == r1) return tv;
  float a = 0.f;
  for (int64_t r = v0; r < v1; ++r) a = nan_max(a, op.row_amax[r]);
  const float vis = scale_of_amax(a, op.fmt);
  if (vis == tv.scale) return tv;
  const int64_t len = v1 - v0;
  mix.resize(static_cast<size_t>(len * w));
  quant_with_scale(op.raw.data() + v0 * w, len * w, 1, vis, op.fmt, mix.data(), 1);
  tv.hat = mix.data();
  if (op.has_t) {
    mix_t.resize(static_cast<size_t>(len * w));
    for (int64_t r = 0; r < len; ++r)
      for (int64_t c = 0; c < w; ++c) mix_t[c * len + r] = mix[r * w + c];
    tv.hat_t = mix_t.data();
    tv.ld_t = len;
  }
  tv.scale = vis;
  return tv;
}

// S-type product of the `tile` recipe (#1, #3, #4): for j in [0, L)
//   out[j] = (sum_{k < w} a[k] * b_t[k * ldb + j]) * (sa * sb),
// one FP32 sum over all of head_dim, then the row scale sa times the tile
// scale sb (the per-row coefficient of numerics.md section 9).
void tile_dots(const float* a, float sa, const float* b_t, int64_t ldb, int64_t w, float sb,
               int64_t L, float* out) {
  gemv_t(a, w, b_t, ldb, L, 0.f, nullptr, out);
  const float s = sa * sb;
  for (int64_t j = 0; j < L; ++j) out[j] *= s;
}

// Accumulating product of the `tile` recipe (#2, #5, #6, #7): one block of the
// reduction dimension, L FP8 values a with scale sa times L rows of b (row
// stride ldb) with the one tile scale sb:
//   acc[c] += (sum_{j < L} a[j] * b[j * ldb + c]) * (sa * sb).
// sbv is scratch of w floats.
void tile_axpy(const float* a, float sa, const float* b, int64_t ldb, float sb, int64_t L,
               int64_t w, float* sbv, float* acc) {
  std::fill(sbv, sbv + w, sb);
  gemv_t(a, L, b, ldb, w, sa, sbv, acc);
}

// Row-sum residual r = |sum dS| / sum |dS| (numerics.md section 5): 0 for an
// all-zero row or a row that sees < 2 keys (section 7), NaN for a non-finite row.
inline float rowsum_ratio(double sum, double sum_abs, bool has_freedom) {
  if (!std::isfinite(sum) || !std::isfinite(sum_abs)) return NAN;
  if (!has_freedom || !(sum_abs > 0.0)) return 0.f;
  return static_cast<float>(std::fabs(sum) / sum_abs);
}

// The fp8 backward's P and Delta-Matching delta of one query row, both scaling
// recipes (numerics.md section 4, "Backward-consistent LSE"). On entry P[j] holds
// the tau-scaled logits x_j = tau S_j of the row's n visible keys and dP the
// dP_hat row; x_keep is scratch for n floats. P_j = exp(x_j - lse) from the given
// (forward's) LSE, l = sum_j P_j (FP32, in key order) and the returned
// delta_dm = (sum_j P_j dP_j) / l (FP32; delta_dm = 0 where l = 0). With
// renormalize (delta_matching) P is then recomputed from the backward-consistent
// LSE lse + ln l, so that it sums to 1 to FP32 rounding (the CUDA pre-pass
// writes that LSE for its main kernel: csrc/hopper/prepass_delta_sm90.cuh).
// The two FP32 row sums of that P, l and sum_j P_j dP_j, in key order; x_keep gets
// the logits, P their exponentials. The sharded pre-pass (numerics.md section 11)
// writes the same two sums for its keys.
inline void backward_row_sums(float* P, float* x_keep, const float* dP, int64_t n, float lse, float& l,
                              float& pdp) {
  l = 0.f;
  pdp = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    x_keep[j] = P[j];
    P[j] = std::exp(P[j] - lse);
    l += P[j];
    pdp += P[j] * dP[j];
  }
}

inline float backward_probs(float* P, float* x_keep, const float* dP, int64_t n, float lse, bool renormalize) {
  float l, pdp;
  backward_row_sums(P, x_keep, dP, n, lse, l, pdp);
  if (!(l > 0.f)) return pdp;
  if (renormalize) {
    const float lse_b = lse + std::log(l);
    for (int64_t j = 0; j < n; ++j) P[j] = std::exp(x_keep[j] - lse_b);
  }
  return pdp / l;
}

// backward_probs with a sharded key axis (numerics.md section 11), both recipes: with
// sd->sum_pdp set, writes the row's partial sums (sd->sum_p/sum_pdp[idx]) and returns
// false (the row is done); with sd->delta, P = exp(x - lse) as given and delta_dm =
// sd->delta[idx]; without sd, backward_probs. Returns true when the row goes on.
inline bool row_probs(const ShardedDelta* sd, int64_t idx, float* P, float* x_keep, const float* dP, int64_t n,
                      float lse, bool renormalize, float& delta_dm) {
  if (sd != nullptr && sd->sum_pdp != nullptr) {
    backward_row_sums(P, x_keep, dP, n, lse, sd->sum_p[idx], sd->sum_pdp[idx]);
    return false;
  }
  if (sd != nullptr) {
    for (int64_t j = 0; j < n; ++j) P[j] = std::exp(P[j] - lse);
    delta_dm = sd->delta[idx];
    return true;
  }
  delta_dm = backward_probs(P, x_keep, dP, n, lse, renormalize);
  return true;
}

// Row i of the fp8 backward's row pass, both recipes: P and dS are its full rows in the
// query tile's buffers (exact zeros outside the keys [kb0, kb1) it sees, set here);
// Pv, dSv and dPv (its dP_hat row) point at key kb0.
struct BackwardRow {
  int64_t kb0, nvis, kb1;
  float *P, *dS, *Pv, *dSv;
  const float* dPv;
};

inline BackwardRow backward_row(const Geometry& g, int64_t i, float* P, float* dS, const float* dP) {
  const int64_t kb0 = g.key_begin(i), kb1 = g.key_end(i);
  std::fill(P, P + kb0, 0.f);
  std::fill(P + kb1, P + g.Sk, 0.f);
  std::fill(dS, dS + kb0, 0.f);
  std::fill(dS + kb1, dS + g.Sk, 0.f);
  return {kb0, kb1 - kb0, kb1, P, dS, P + kb0, dS + kb0, dP + kb0};
}

// dS = P o (dP_hat - delta) over a row's n visible keys, both recipes; adds its pre-cast
// row sums to pre_sum / pre_abs (want_pre); then softcap's factor 1 - t^2 (tcap: the
// row's tanh, numerics.md section 12): dS is then the gradient of the uncapped logits,
// what matmuls #6 and #7 quantize.
inline void backward_ds(const float* P, const float* dP, float delta, float cap, const float* tcap, int64_t n,
                        bool want_pre, double& pre_sum, double& pre_abs, float* dS) {
  for (int64_t j = 0; j < n; ++j) dS[j] = P[j] * (dP[j] - delta);
  if (want_pre)
    for (int64_t j = 0; j < n; ++j) {
      pre_sum += dS[j];
      pre_abs += std::fabs(dS[j]);
    }
  if (cap > 0.f)
    for (int64_t j = 0; j < n; ++j) dS[j] *= 1.f - tcap[j] * tcap[j];
}

// One #6 block of a row's dS, dS[0, n), quantized in grad format gf to hat; returns its
// scale and adds the decoded values' row sums to post_sum / post_abs (want_post). Both
// recipes.
inline float quant_ds6_block(const float* dS, int64_t n, Fp8Format gf, bool want_post, double& post_sum,
                             double& post_abs, float* hat) {
  const float sds = quant_hat(dS, n, 1, gf, hat, 1);
  if (want_post)
    for (int64_t j = 0; j < n; ++j) {
      const float dec = hat[j] * sds;
      post_sum += dec;
      post_abs += std::fabs(dec);
    }
  return sds;
}

// The fp8 backward's per-row diagnostics (numerics.md section 7), both scaling
// recipes: delta, eps = delta - delta_dm, and the pre-/post-cast dS row-sum ratios.
// NOTE: a row that sees < 2 keys has dS == 0 in exact arithmetic; its ratio would
// only measure rounding noise, so it reports 0. A non-finite dS row reports NaN so
// monitoring sees it.
inline void write_row_diagnostics(const BackwardDiagnostics& diag, int64_t idx, float delta, float delta_dm,
                                  double pre_sum, double pre_abs, double post_sum, double post_abs,
                                  int64_t nvis) {
  if (diag.delta) diag.delta[idx] = delta;
  if (diag.eps) diag.eps[idx] = delta - delta_dm;
  const bool has_freedom = nvis >= 2;
  if (diag.rowsum_pre) diag.rowsum_pre[idx] = rowsum_ratio(pre_sum, pre_abs, has_freedom);
  if (diag.rowsum_post) diag.rowsum_post[idx] = rowsum_ratio(post_sum, post_abs, has_freedom);
}


// ---------------------------------------------------------------------------
// 4. Exact path (numerics.md section 1, FP64)
// ---------------------------------------------------------------------------

// One row of logits S_j = tau * q . k_j for j < L, with k_t = K^T [d][Sk] (offset by
// the first key: columns j of k_t are keys first + j).
void exact_logits(const double* q, const double* k_t, int64_t Sk, int64_t d, int64_t L, double tau,
                  double* s) {
  gemv_t(q, d, k_t, Sk, L, s);
  for (int64_t j = 0; j < L; ++j) s[j] *= tau;
}

// Softmax of s[0, L) in place (P_j), returns LSE.
double exact_softmax(double* s, int64_t L) {
  double m = -kInfD;
  for (int64_t j = 0; j < L; ++j) m = nan_max(m, s[j]);
  double l = 0.0;
  for (int64_t j = 0; j < L; ++j) {
    s[j] = std::exp(s[j] - m);
    l += s[j];
  }
  for (int64_t j = 0; j < L; ++j) s[j] /= l;
  return m + std::log(l);
}

void transpose(const double* x, int64_t n, int64_t w, double* x_t) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < w; ++c) x_t[c * n + r] = x[r * w + c];
}

void exact_forward(const AttnParams& p, const Geometry& g, const TensorView& q, const TensorView& k,
                   const TensorView& v, const TensorView& o, float* lse) {
  const double tau = static_cast<double>(p.softmax_scale);
  const int64_t chunks = ceil_div(g.Sq, kFwdRowChunk);
  parallel_for(g.B * g.Hq * chunks, p.num_threads, [&](int64_t task) {
    const int64_t chunk = task % chunks, bh = task / chunks, b = bh / g.Hq, hq = bh % g.Hq;
    const int64_t hkv = hq / g.group;
    const int64_t i0 = chunk * kFwdRowChunk, i1 = std::min(g.Sq, i0 + kFwdRowChunk);
    std::vector<double> kf(g.Sk * g.d), k_t(g.Sk * g.d), vf(g.Sk * g.dv), qrow(g.d),
        s(std::max<int64_t>(g.Sk, 1)), orow(g.dv);
    load_seq(k, b, hkv, g.Sk, g.d, kf.data());
    load_seq(v, b, hkv, g.Sk, g.dv, vf.data());
    transpose(kf.data(), g.Sk, g.d, k_t.data());
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t j0 = g.key_begin(i), L = g.visible_keys(i);  // keys [j0, j0 + L)
      std::fill(orow.begin(), orow.end(), 0.0);
      if (L == 0) {
        lse[g.lse_index(b, hq, i)] = -kInfF;
        store_row(o, b, i, hq, g.dv, orow.data());
        continue;
      }
      load_row(q, b, i, hq, g.d, qrow.data());
      exact_logits(qrow.data(), k_t.data() + j0, g.Sk, g.d, L, tau, s.data());
      softcap_logits<double>(s.data(), L, p.softcap, nullptr);
      const double lse_i = exact_softmax(s.data(), L);
      gemv_t(s.data(), L, vf.data() + j0 * g.dv, g.dv, g.dv, orow.data());  // O = P V
      lse[g.lse_index(b, hq, i)] = static_cast<float>(lse_i);
      store_row(o, b, i, hq, g.dv, orow.data());
    }
  });
}

void exact_backward(const AttnParams& p, const Geometry& g, const TensorView& q,
                    const TensorView& k, const TensorView& v, const TensorView& dout,
                    const TensorView& dq, const TensorView& dk, const TensorView& dv,
                    const BackwardDiagnostics* diag) {
  const double tau = static_cast<double>(p.softmax_scale);
  parallel_for(g.B * g.Hkv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, hkv = task % g.Hkv;
    const int64_t Sk = g.Sk, d = g.d, dvd = g.dv;
    std::vector<double> kf(Sk * d), k_t(Sk * d), vf(Sk * dvd), v_t(Sk * dvd);
    load_seq(k, b, hkv, Sk, d, kf.data());
    load_seq(v, b, hkv, Sk, dvd, vf.data());
    transpose(kf.data(), Sk, d, k_t.data());
    transpose(vf.data(), Sk, dvd, v_t.data());
    std::vector<double> dk_acc(Sk * d, 0.0), dv_acc(Sk * dvd, 0.0);
    std::vector<double> qrow(d), dorow(dvd), dqrow(d), P(std::max<int64_t>(Sk, 1)),
        dP(std::max<int64_t>(Sk, 1)), tcap(p.softcap > 0.0 ? std::max<int64_t>(Sk, 1) : 0);
    for (int64_t hq = hkv * g.group; hq < (hkv + 1) * g.group; ++hq) {
      for (int64_t i = 0; i < g.Sq; ++i) {
        const int64_t j0 = g.key_begin(i), L = g.visible_keys(i);  // keys [j0, j0 + L)
        std::fill(dqrow.begin(), dqrow.end(), 0.0);
        double delta = 0.0, sum_ds = 0.0, sum_abs_ds = 0.0;
        if (L > 0) {
          load_row(q, b, i, hq, d, qrow.data());
          load_row(dout, b, i, hq, dvd, dorow.data());
          // S, P (LSE recomputed in FP64), dP = dO V^T; index j is key j0 + j.
          exact_logits(qrow.data(), k_t.data() + j0, Sk, d, L, tau, P.data());
          softcap_logits<double>(P.data(), L, p.softcap, tcap.data());
          exact_softmax(P.data(), L);
          gemv_t(dorow.data(), dvd, v_t.data() + j0, Sk, L, dP.data());
          for (int64_t j = 0; j < L; ++j) delta += P[j] * dP[j];
          // dS = P o (dP - delta) (stored in dP); dQ = tau dS K, dK += dS^T q, dV += P^T dO.
          for (int64_t j = 0; j < L; ++j) {
            const double ds = P[j] * (dP[j] - delta);
            // Row sums of the softmax-input gradient (the invariant); softcap's chain
            // factor 1 - t^2 then maps it to the gradient of the uncapped logits.
            sum_ds += ds;
            sum_abs_ds += std::fabs(ds);
            dP[j] = p.softcap > 0.0 ? ds * (1.0 - tcap[j] * tcap[j]) : ds;
          }
          gemv_t(dP.data(), L, kf.data() + j0 * d, d, d, dqrow.data());
          for (int64_t c = 0; c < d; ++c) dqrow[c] *= tau;
          for (int64_t j = 0; j < L; ++j) {
            const double ds = dP[j], pj = P[j];
            double* __restrict dkr = dk_acc.data() + (j0 + j) * d;
            double* __restrict dvr = dv_acc.data() + (j0 + j) * dvd;
            for (int64_t c = 0; c < d; ++c) dkr[c] += ds * qrow[c];
            for (int64_t c = 0; c < dvd; ++c) dvr[c] += pj * dorow[c];
          }
        }
        store_row(dq, b, i, hq, d, dqrow.data());
        if (diag) {
          const int64_t idx = g.lse_index(b, hq, i);
          // NOTE: rows that see < 2 keys report 0 (numerics.md section 7).
          const float r = rowsum_ratio(sum_ds, sum_abs_ds, L >= 2);
          if (diag->delta) diag->delta[idx] = static_cast<float>(delta);
          if (diag->eps) diag->eps[idx] = 0.f;
          if (diag->rowsum_pre) diag->rowsum_pre[idx] = static_cast<float>(r);
          if (diag->rowsum_post) diag->rowsum_post[idx] = static_cast<float>(r);
        }
      }
    }
    for (int64_t j = 0; j < Sk; ++j) {
      double* dkr = dk_acc.data() + j * d;
      for (int64_t c = 0; c < d; ++c) dkr[c] *= tau;
      store_row(dk, b, j, hkv, d, dkr);
      store_row(dv, b, j, hkv, dvd, dv_acc.data() + j * dvd);
    }
  });
}

// ---------------------------------------------------------------------------
// 5. FP8 path (numerics.md sections 2-5)
// ---------------------------------------------------------------------------

// K and V of one (batch, kv head) in the blockings the forward needs:
// K per key row along d (#1), V per channel along keys (#2).
struct FwdKV {
  RowBlockedT k_rows;
  ColBlocked v_cols;
};

void fp8_forward(const AttnParams& p, const Geometry& g, const TensorView& q, const TensorView& k,
                 const TensorView& v, const TensorView& o, float* lse) {
  const int64_t B = p.block_size, Sk = g.Sk, d = g.d, dvd = g.dv;
  const float tau = static_cast<float>(p.softmax_scale);
  const float cap = static_cast<float>(p.softcap);  // numerics.md section 12
  const Fp8Format e4m3 = Fp8Format::kE4M3;

  // Pre-quantize K and V once per (batch, kv head).
  std::vector<FwdKV> kv(static_cast<size_t>(g.B * g.Hkv));
  parallel_for(g.B * g.Hkv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, hkv = task % g.Hkv;
    std::vector<float> kf(Sk * d), vf(Sk * dvd);
    load_seq(k, b, hkv, Sk, d, kf.data());
    load_seq(v, b, hkv, Sk, dvd, vf.data());
    make_row_blocked_t(kf.data(), Sk, d, B, e4m3, kv[task].k_rows);
    // Visible parts of V's key tiles: prefixes under a right bound, suffixes under a left one.
    make_col_blocked(std::move(vf), Sk, dvd, B, e4m3, g.has_right(), g.has_left(), kv[task].v_cols);
  });

  const int64_t chunks = ceil_div(g.Sq, kFwdRowChunk);
  const int64_t nbd = ceil_div(d, B);
  parallel_for(g.B * g.Hq * chunks, p.num_threads, [&](int64_t task) {
    const int64_t chunk = task % chunks, bh = task / chunks, b = bh / g.Hq, hq = bh % g.Hq;
    const FwdKV& kvh = kv[static_cast<size_t>(b * g.Hkv + hq / g.group)];
    const int64_t i0 = chunk * kFwdRowChunk, i1 = std::min(g.Sq, i0 + kFwdRowChunk);
    std::vector<float> qrow(d), qhat(d), qscale(nbd), s(B), pexp(B), phat(B), acc(dvd),
        mix_hat(B * dvd), mix_scale(dvd);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kb0 = g.key_begin(i), kb1 = g.key_end(i);  // the keys row i sees
      std::fill(acc.begin(), acc.end(), 0.f);
      if (kb0 == kb1) {
        lse[g.lse_index(b, hq, i)] = -kInfF;
        store_row(o, b, i, hq, dvd, acc.data());
        continue;
      }
      // Q row-blocked along d (#1).
      load_row(q, b, i, hq, d, qrow.data());
      for (int64_t kb = 0; kb < nbd; ++kb) {
        const int64_t k0 = kb * B;
        qscale[kb] = quant_hat(qrow.data() + k0, std::min(B, d - k0), 1, e4m3, qhat.data() + k0, 1);
      }
      // Online softmax over the key tiles of B the row sees, in increasing order;
      // each tile's visible keys [j0, j0 + L).
      float m = -kInfF, l = 0.f;
      for (int64_t t = kb0 / B; t * B < kb1; ++t) {
        const int64_t j0 = std::max(t * B, kb0), L = std::min(t * B + B, kb1) - j0;
        rowblock_dots(qhat.data(), qscale.data(), kvh.k_rows.hat_t.data() + j0,
                      kvh.k_rows.scale_t.data() + j0, Sk, d, B, L, s.data());
        online_softmax_tile(s.data(), L, tau, cap, m, l, acc.data(), dvd, pexp.data());
        // P tile: one block of #2's P operand (masked keys are zeros, which
        // do not change the block); V per channel along keys (#2).
        const float sp = quant_hat(pexp.data(), L, 1, e4m3, phat.data(), 1);
        const float* vscale = nullptr;
        const float* vblk =
            visible_block(kvh.v_cols, t, j0, j0 + L, mix_hat.data(), mix_scale.data(), &vscale);
        colblock_axpy(phat.data(), sp, vblk, dvd, vscale, L, dvd, acc.data());
      }
      for (int64_t c = 0; c < dvd; ++c) acc[c] /= l;
      lse[g.lse_index(b, hq, i)] = m + std::log(l);
      store_row(o, b, i, hq, dvd, acc.data());
    }
  });
}

void fp8_backward(const AttnParams& p, const Geometry& g, const TensorView& q, const TensorView& k,
                  const TensorView& v, const TensorView& o, const TensorView& dout,
                  const float* lse, const TensorView& dq, const TensorView& dk,
                  const TensorView& dv, const BackwardDiagnostics* diag) {
  const int64_t B = p.block_size, Sq = g.Sq, Sk = g.Sk, d = g.d, dvd = g.dv;
  const int64_t Bds = ds_row_block(B);
  const float tau = static_cast<float>(p.softmax_scale);
  const float cap = static_cast<float>(p.softcap);  // numerics.md section 12
  const Fp8Format e4m3 = Fp8Format::kE4M3, gf = p.grad_format;
  const DeltaMode mode = p.delta_mode;
  const bool need_o = mode != DeltaMode::kDeltaMatching;
  const int64_t nbd = ceil_div(d, B), nbv = ceil_div(dvd, B), nqt = ceil_div(Sq, B);
  const ShardedDelta* sd = p.sharded;
  const bool sums_only = sd != nullptr && sd->sum_pdp != nullptr;
  const bool want_pre = diag && diag->rowsum_pre, want_post = diag && diag->rowsum_post;

  parallel_for(g.B * g.Hkv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, hkv = task % g.Hkv;
    // K: per key row along d (#3) and per channel along keys (#6);
    // V: per key row along dv (#4).
    RowBlockedT k_rows, v_rows;
    ColBlocked k_cols;
    {
      std::vector<float> kf(Sk * d), vf(Sk * dvd);
      load_seq(k, b, hkv, Sk, d, kf.data());
      load_seq(v, b, hkv, Sk, dvd, vf.data());
      make_row_blocked_t(kf.data(), Sk, d, B, e4m3, k_rows);
      make_row_blocked_t(vf.data(), Sk, dvd, B, e4m3, v_rows);
      make_col_blocked(std::move(kf), Sk, d, B, e4m3, g.has_right(), g.has_left(), k_cols);
    }
    std::vector<float> dk_acc(Sk * d, 0.f), dv_acc(Sk * dvd, 0.f);
    // Per-head and per-tile scratch.
    std::vector<float> qf(Sq * d), dof(Sq * dvd), of(need_o ? Sq * dvd : 0);
    std::vector<float> tcap(cap > 0.f ? std::max<int64_t>(Sk, 1) : 0);  // tanh of one row (softcap)
    std::vector<float> Pt(B * Sk), dSt(B * Sk), dProw(std::max<int64_t>(Sk, 1)), dq_acc(d), hat(B),
        mix_hat(B * std::max(d, dvd)), mix_scale(std::max(d, dvd));
    RowBlocked q_rows, do_rows;
    ColBlocked q_cols, do_cols;

    for (int64_t hq = hkv * g.group; hq < (hkv + 1) * g.group; ++hq) {
      load_seq(q, b, hq, Sq, d, qf.data());
      load_seq(dout, b, hq, Sq, dvd, dof.data());
      if (need_o) load_seq(o, b, hq, Sq, dvd, of.data());
      // Q: per query row along d (#3), per channel along queries (#7);
      // dO: per query row along dv (#4), per channel along queries (#5).
      make_row_blocked(qf.data(), Sq, d, B, e4m3, q_rows);
      make_row_blocked(dof.data(), Sq, dvd, B, gf, do_rows);
      // The rows that see a key column: a suffix of a query tile under a right bound,
      // a prefix under a left one.
      make_col_blocked(qf, Sq, d, B, e4m3, g.has_left(), g.has_right(), q_cols);
      make_col_blocked(dof, Sq, dvd, B, gf, g.has_left(), g.has_right(), do_cols);
      const float* lse_h = lse + g.lse_index(b, hq, 0);

      for (int64_t qt = 0; qt < nqt; ++qt) {
        const int64_t i0 = qt * B, i1 = std::min(Sq, i0 + B);
        // Row pass: S, P, dP_hat, delta, dS, diagnostics, dQ (#3, #4, #6).
        for (int64_t i = i0; i < i1; ++i) {
          // P, dS: row i's full rows (zeros outside its keys [kb0, kb1)); Pv, dSv, dPv at kb0.
          const auto [kb0, nvis, kb1, P, dS, Pv, dSv, dPv] =
              backward_row(g, i, Pt.data() + (i - i0) * Sk, dSt.data() + (i - i0) * Sk, dProw.data());
          std::fill(dq_acc.begin(), dq_acc.end(), 0.f);
          float delta = 0.f, delta_dm = 0.f;
          double pre_sum = 0.0, pre_abs = 0.0, post_sum = 0.0, post_abs = 0.0;
          if (sums_only) sd->sum_p[g.lse_index(b, hq, i)] = sd->sum_pdp[g.lse_index(b, hq, i)] = 0.f;
          if (nvis > 0) {
            rowblock_dots(q_rows.hat.data() + i * d, q_rows.scale.data() + i * nbd,
                          k_rows.hat_t.data() + kb0, k_rows.scale_t.data() + kb0, Sk, d, B, nvis, Pv);
            for (int64_t j = 0; j < nvis; ++j) Pv[j] *= tau;
            softcap_logits<float>(Pv, nvis, cap, tcap.data());  // numerics.md section 12
            rowblock_dots(do_rows.hat.data() + i * dvd, do_rows.scale.data() + i * nbv,
                          v_rows.hat_t.data() + kb0, v_rows.scale_t.data() + kb0, Sk, dvd, B, nvis,
                          dProw.data() + kb0);
            // P and delta (numerics.md sections 4 and 11), all FP32 sums over the keys the
            // row sees; dS's row is scratch.
            if (!row_probs(sd, g.lse_index(b, hq, i), Pv, dSv, dPv, nvis, lse_h[i],
                           mode == DeltaMode::kDeltaMatching, delta_dm))
              continue;
            if (sd != nullptr || mode == DeltaMode::kDeltaMatching) {
              delta = delta_dm;
            } else if (mode == DeltaMode::kStale) {
              for (int64_t c = 0; c < dvd; ++c) delta += dof[i * dvd + c] * of[i * dvd + c];
            } else {  // kMatchedDO: decoded row-blocked dO_hat (the #4 operand)
              for (int64_t c = 0; c < dvd; ++c)
                delta +=
                    do_rows.hat[i * dvd + c] * do_rows.scale[i * nbv + c / B] * of[i * dvd + c];
            }
            // dS (pre-cast row sums; softcap's 1 - t^2, section 12: what #6 and #7 quantize)
            backward_ds(Pv, dPv, delta, cap, tcap.data(), nvis, want_pre, pre_sum, pre_abs, dSv);
            // #6 dQ = dS K: K per channel along keys in B-blocks (the visible part
            // [j0, j1) of each); dS per query row along keys in sub-blocks of Bds =
            // min(B, 64) keys aligned at multiples of Bds from key 0 (grad_format), each
            // over its visible keys [u0, u1) and promoted with its own scale times the K
            // block's (numerics.md section 3).
            for (int64_t t = kb0 / B; t * B < kb1; ++t) {
              const int64_t j0 = std::max(t * B, kb0), j1 = std::min(t * B + B, kb1);
              const float* kscale = nullptr;
              const float* kblk =
                  visible_block(k_cols, t, j0, j1, mix_hat.data(), mix_scale.data(), &kscale);
              for (int64_t u0 = j0; u0 < j1;) {
                const int64_t u1 = std::min(j1, (u0 / Bds + 1) * Bds), Lu = u1 - u0;
                const float sds = quant_ds6_block(dS + u0, Lu, gf, want_post, post_sum, post_abs, hat.data());
                colblock_axpy(hat.data(), sds, kblk + (u0 - j0) * d, d, kscale, Lu, d, dq_acc.data());
                u0 = u1;
              }
            }
            for (int64_t c = 0; c < d; ++c) dq_acc[c] *= tau;
          }
          if (sums_only) continue;
          store_row(dq, b, i, hq, d, dq_acc.data());
          if (diag)
            write_row_diagnostics(*diag, g.lse_index(b, hq, i), delta, delta_dm, pre_sum, pre_abs, post_sum,
                                  post_abs, nvis);
        }
        if (sums_only) continue;
        // Column pass over the keys this query tile sees: dV (#5), dK (#7); key j is
        // seen by the tile's rows [v0, v1).
        for (int64_t j = g.key_begin(i0); j < g.key_end(i1 - 1); ++j) {
          const int64_t v0 = std::max(i0, g.query_begin(j)), v1 = std::min(i1, g.query_end(j));
          if (v0 >= v1) continue;
          const int64_t L = v1 - v0;
          const float* Pcol = Pt.data() + (v0 - i0) * Sk + j;
          const float* dScol = dSt.data() + (v0 - i0) * Sk + j;
          // #5 dV = P^T dO: P per key column along queries (E4M3), dO per
          // channel along queries (grad_format).
          const float sp = quant_hat(Pcol, L, Sk, e4m3, hat.data(), 1);
          const float* dscale = nullptr;
          const float* dblk =
              visible_block(do_cols, qt, v0, v1, mix_hat.data(), mix_scale.data(), &dscale);
          colblock_axpy(hat.data(), sp, dblk, dvd, dscale, L, dvd, dv_acc.data() + j * dvd);
          // #7 dK = dS^T Q: dS per key column along queries (grad_format), Q
          // per channel along queries (E4M3).
          const float sds = quant_hat(dScol, L, Sk, gf, hat.data(), 1);
          const float* qscale = nullptr;
          const float* qblk =
              visible_block(q_cols, qt, v0, v1, mix_hat.data(), mix_scale.data(), &qscale);
          colblock_axpy(hat.data(), sds, qblk, d, qscale, L, d, dk_acc.data() + j * d);
        }
      }
    }
    if (sums_only) return;
    for (int64_t j = 0; j < Sk; ++j) {
      float* dkr = dk_acc.data() + j * d;
      for (int64_t c = 0; c < d; ++c) dkr[c] *= tau;
      store_row(dk, b, j, hkv, d, dkr);
      store_row(dv, b, j, hkv, dvd, dv_acc.data() + j * dvd);
    }
  });
}

// ---- `tile` recipe (numerics.md section 9) -----------------------------------

void fp8_forward_tile(const AttnParams& p, const Geometry& g, const TensorView& q,
                      const TensorView& k, const TensorView& v, const TensorView& o, float* lse) {
  const int64_t B = p.block_size, Sk = g.Sk, d = g.d, dvd = g.dv;
  const float tau = static_cast<float>(p.softmax_scale);
  const float cap = static_cast<float>(p.softcap);  // numerics.md section 12
  const Fp8Format e4m3 = Fp8Format::kE4M3;

  // K (#1) and V (#2): one scale per tile of B keys, all of head_dim.
  struct KV {
    TileBlocked k, v;
  };
  std::vector<KV> kv(static_cast<size_t>(g.B * g.Hkv));
  parallel_for(g.B * g.Hkv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, hkv = task % g.Hkv;
    std::vector<float> kf(Sk * d), vf(Sk * dvd);
    load_seq(k, b, hkv, Sk, d, kf.data());
    load_seq(v, b, hkv, Sk, dvd, vf.data());
    make_tile_blocked(std::move(kf), Sk, d, B, e4m3, true, kv[task].k);
    make_tile_blocked(std::move(vf), Sk, dvd, B, e4m3, false, kv[task].v);
  });

  const int64_t chunks = ceil_div(g.Sq, kFwdRowChunk);
  parallel_for(g.B * g.Hq * chunks, p.num_threads, [&](int64_t task) {
    const int64_t chunk = task % chunks, bh = task / chunks, b = bh / g.Hq, hq = bh % g.Hq;
    const KV& kvh = kv[static_cast<size_t>(b * g.Hkv + hq / g.group)];
    const int64_t i0 = chunk * kFwdRowChunk, i1 = std::min(g.Sq, i0 + kFwdRowChunk);
    std::vector<float> qrow(d), qhat(d), s(B), pexp(B), phat(B), acc(dvd), sbv(dvd), mix, mix_t;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t kb0 = g.key_begin(i), kb1 = g.key_end(i);  // the keys row i sees
      std::fill(acc.begin(), acc.end(), 0.f);
      if (kb0 == kb1) {
        lse[g.lse_index(b, hq, i)] = -kInfF;
        store_row(o, b, i, hq, dvd, acc.data());
        continue;
      }
      // Q: one scale per query row, all of head_dim (#1).
      load_row(q, b, i, hq, d, qrow.data());
      const float sq = quant_hat_n(qrow.data(), d, e4m3, qhat.data());
      float m = -kInfF, l = 0.f;
      for (int64_t t = kb0 / B; t * B < kb1; ++t) {  // visible keys [j0, j0 + L) of tile t
        const int64_t j0 = std::max(t * B, kb0), L = std::min(t * B + B, kb1) - j0;
        const TileView kt = visible_tile(kvh.k, t, j0, j0 + L, mix, mix_t);
        tile_dots(qhat.data(), sq, kt.hat_t, kt.ld_t, d, kt.scale, L, s.data());
        online_softmax_tile(s.data(), L, tau, cap, m, l, acc.data(), dvd, pexp.data());
        // P per (row, key tile), dynamic (its amax is exp(tile_max - m_new));
        // V one scale per key tile.
        const float sp = quant_hat(pexp.data(), L, 1, e4m3, phat.data(), 1);
        const TileView vt = visible_tile(kvh.v, t, j0, j0 + L, mix, mix_t);
        tile_axpy(phat.data(), sp, vt.hat, vt.ld, vt.scale, L, dvd, sbv.data(), acc.data());
      }
      for (int64_t c = 0; c < dvd; ++c) acc[c] /= l;
      lse[g.lse_index(b, hq, i)] = m + std::log(l);
      store_row(o, b, i, hq, dvd, acc.data());
    }
  });
}

void fp8_backward_tile(const AttnParams& p, const Geometry& g, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& dout, const float* lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv,
                       const BackwardDiagnostics* diag) {
  const int64_t B = p.block_size, Sq = g.Sq, Sk = g.Sk, d = g.d, dvd = g.dv;
  const float tau = static_cast<float>(p.softmax_scale);
  const float cap = static_cast<float>(p.softcap);  // numerics.md section 12
  const Fp8Format e4m3 = Fp8Format::kE4M3, gf = p.grad_format;
  const DeltaMode mode = p.delta_mode;
  const bool need_o = mode != DeltaMode::kDeltaMatching;
  const int64_t nqt = ceil_div(Sq, B), nkt = ceil_div(Sk, B);
  const int64_t H = B / 2;   // query sub-tile of the P / dS blocks of #5 / #7
  const int64_t KH = B / 2;  // key half of a key tile: the P / dS blocks of #5 / #7, dS of #6
  const ShardedDelta* sd = p.sharded;
  const bool sums_only = sd != nullptr && sd->sum_pdp != nullptr;
  const bool want_pre = diag && diag->rowsum_pre, want_post = diag && diag->rowsum_post;

  parallel_for(g.B * g.Hkv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, hkv = task % g.Hkv;
    // One K_hat for #3 and #6, one V_hat for #4: a scale per tile of B keys.
    TileBlocked k_t, v_t;
    {
      std::vector<float> kf(Sk * d), vf(Sk * dvd);
      load_seq(k, b, hkv, Sk, d, kf.data());
      load_seq(v, b, hkv, Sk, dvd, vf.data());
      make_tile_blocked(std::move(kf), Sk, d, B, e4m3, true, k_t);
      make_tile_blocked(std::move(vf), Sk, dvd, B, e4m3, true, v_t);
    }
    std::vector<float> dk_acc(Sk * d, 0.f), dv_acc(Sk * dvd, 0.f);
    std::vector<float> qf(Sq * d), dof(Sq * dvd), of(need_o ? Sq * dvd : 0);
    std::vector<float> qhat(Sq * d), sq(Sq), dohat(Sq * dvd), sdo(Sq);
    std::vector<float> tcap(cap > 0.f ? std::max<int64_t>(Sk, 1) : 0);  // tanh of one row (softcap)
    std::vector<float> Pt(B * Sk), dSt(B * Sk), dProw(std::max<int64_t>(Sk, 1)), dq_acc(d),
        hat(B), sbv(std::max(d, dvd)), rmP(B), rmS(B), mix, mix_q, mix_t;
    TileBlocked q_t, do_t;

    for (int64_t hq = hkv * g.group; hq < (hkv + 1) * g.group; ++hq) {
      load_seq(q, b, hq, Sq, d, qf.data());
      load_seq(dout, b, hq, Sq, dvd, dof.data());
      if (need_o) load_seq(o, b, hq, Sq, dvd, of.data());
      // Q (#3) and dO (#4): one scale per query row, all of head_dim;
      // Q (#7) and dO (#5): one scale per tile of B queries.
      for (int64_t i = 0; i < Sq; ++i) {
        sq[i] = quant_hat_n(qf.data() + i * d, d, e4m3, qhat.data() + i * d);
        sdo[i] = quant_hat_n(dof.data() + i * dvd, dvd, gf, dohat.data() + i * dvd);
      }
      make_tile_blocked(qf, Sq, d, B, e4m3, false, q_t);
      make_tile_blocked(dof, Sq, dvd, B, gf, false, do_t);
      const float* lse_h = lse + g.lse_index(b, hq, 0);

      for (int64_t qt = 0; qt < nqt; ++qt) {
        const int64_t i0 = qt * B, i1 = std::min(Sq, i0 + B);
        // Row pass: S, P, dP_hat, delta, dS, diagnostics, dQ (#3, #4, #6).
        for (int64_t i = i0; i < i1; ++i) {
          // P, dS: row i's full rows (zeros outside its keys [kb0, kb1)); Pv, dSv, dPv at kb0.
          const auto [kb0, nvis, kb1, P, dS, Pv, dSv, dPv] =
              backward_row(g, i, Pt.data() + (i - i0) * Sk, dSt.data() + (i - i0) * Sk, dProw.data());
          std::fill(dq_acc.begin(), dq_acc.end(), 0.f);
          float delta = 0.f, delta_dm = 0.f;
          double pre_sum = 0.0, pre_abs = 0.0, post_sum = 0.0, post_abs = 0.0;
          if (sums_only) sd->sum_p[g.lse_index(b, hq, i)] = sd->sum_pdp[g.lse_index(b, hq, i)] = 0.f;
          if (nvis > 0) {
            for (int64_t t = kb0 / B; t * B < kb1; ++t) {  // visible keys [j0, j0 + L) of tile t
              const int64_t j0 = std::max(t * B, kb0), L = std::min(t * B + B, kb1) - j0;
              const TileView kt = visible_tile(k_t, t, j0, j0 + L, mix, mix_t);
              tile_dots(qhat.data() + i * d, sq[i], kt.hat_t, kt.ld_t, d, kt.scale, L, P + j0);
              for (int64_t j = j0; j < j0 + L; ++j) P[j] *= tau;
              const TileView vt = visible_tile(v_t, t, j0, j0 + L, mix, mix_t);
              tile_dots(dohat.data() + i * dvd, sdo[i], vt.hat_t, vt.ld_t, dvd, vt.scale, L,
                        dProw.data() + j0);
            }
            softcap_logits<float>(Pv, nvis, cap, tcap.data());  // numerics.md section 12
            // P and delta (numerics.md sections 4 and 11) over the keys the row sees;
            // dS's row is scratch.
            if (!row_probs(sd, g.lse_index(b, hq, i), Pv, dSv, dPv, nvis, lse_h[i],
                           mode == DeltaMode::kDeltaMatching, delta_dm))
              continue;
            if (sd != nullptr || mode == DeltaMode::kDeltaMatching) {
              delta = delta_dm;
            } else if (mode == DeltaMode::kStale) {
              for (int64_t c = 0; c < dvd; ++c) delta += dof[i * dvd + c] * of[i * dvd + c];
            } else {  // kMatchedDO: decoded dO_hat of #4 (one scale per row)
              for (int64_t c = 0; c < dvd; ++c)
                delta += dohat[i * dvd + c] * sdo[i] * of[i * dvd + c];
            }
            // dS (pre-cast row sums; softcap's 1 - t^2, section 12: what #6 and #7 quantize)
            backward_ds(Pv, dPv, delta, cap, tcap.data(), nvis, want_pre, pre_sum, pre_abs, dSv);
            // #6 dQ = dS K: dS one scale per (row, key half of KH keys), over the half's
            // visible keys [h0, h1); K per key tile (its visible part [j0, j1)); each
            // half's partial is added to dQ on its own, in key order.
            for (int64_t t = kb0 / B; t * B < kb1; ++t) {
              const int64_t j0 = std::max(t * B, kb0), j1 = std::min(t * B + B, kb1);
              const TileView kt = visible_tile(k_t, t, j0, j1, mix, mix_t);
              for (int64_t h0 = j0; h0 < j1;) {  // key halves start at t * B and t * B + KH
                const int64_t h1 = std::min(j1, t * B + ((h0 - t * B) / KH + 1) * KH), Lh = h1 - h0;
                const float sds = quant_ds6_block(dS + h0, Lh, gf, want_post, post_sum, post_abs, hat.data());
                tile_axpy(hat.data(), sds, kt.hat + (h0 - j0) * kt.ld, kt.ld, kt.scale, Lh, d, sbv.data(),
                          dq_acc.data());
                h0 = h1;
              }
            }
            for (int64_t c = 0; c < d; ++c) dq_acc[c] *= tau;
          }
          if (sums_only) continue;
          store_row(dq, b, i, hq, d, dq_acc.data());
          if (diag)
            write_row_diagnostics(*diag, g.lse_index(b, hq, i), delta, delta_dm, pre_sum, pre_abs, post_sum,
                                  post_abs, nvis);
        }
        if (sums_only) continue;
        // Column pass, per key half this query tile sees: dV (#5), dK (#7).
        // P and dS: one scale per (query sub-tile of H rows, key half of KH
        // keys) block, over the rows of the sub-tile that see the key column
        // (a range of it: a suffix under a right bound, a prefix under a left
        // one); dO and Q: one scale per query tile, over the rows of the tile
        // that see the key column. rmP / rmS: per row, the amax over the key
        // half (masked entries are exact zeros), maximized over those rows.
        const int64_t kc0 = g.key_begin(i0), kc1 = g.key_end(i1 - 1);  // keys the tile sees
        for (int64_t kt = kc0 / B; kt < nkt && kt * B < kc1; ++kt) {
          const int64_t j0 = kt * B, j1 = std::min(Sk, j0 + B);
          for (int64_t h0 = j0; h0 < j1; h0 += KH) {  // key halves [h0, h1) of tile kt
            const int64_t h1 = std::min(j1, h0 + KH);
            if (h1 <= kc0 || h0 >= kc1) continue;  // no row of the query tile sees this half
            for (int64_t i = i0; i < i1; ++i) {
              const float* P = Pt.data() + (i - i0) * Sk;
              const float* dS = dSt.data() + (i - i0) * Sk;
              float ap = 0.f, as = 0.f;
              for (int64_t j = h0; j < h1; ++j) {
                ap = nan_max(ap, std::fabs(P[j]));
                as = nan_max(as, std::fabs(dS[j]));
              }
              rmP[i - i0] = ap;
              rmS[i - i0] = as;
            }
            for (int64_t j = std::max(h0, kc0); j < std::min(h1, kc1); ++j) {
              // rows [vq, vq1) of the query tile see j
              const int64_t vq = std::max(i0, g.query_begin(j)), vq1 = std::min(i1, g.query_end(j));
              if (vq >= vq1) continue;
              const TileView dot = visible_tile(do_t, qt, vq, vq1, mix, mix_t);
              const TileView qv = visible_tile(q_t, qt, vq, vq1, mix_q, mix_t);
              for (int64_t s0 = i0; s0 < i1; s0 += H) {  // sub-tiles in increasing order
                const int64_t v0 = std::max(s0, vq), v1 = std::min(std::min(i1, s0 + H), vq1);
                if (v0 >= v1) continue;  // no row of this sub-tile sees j
                const int64_t L = v1 - v0;
                float ap = 0.f, as = 0.f;
                for (int64_t r = v0; r < v1; ++r) {
                  ap = nan_max(ap, rmP[r - i0]);
                  as = nan_max(as, rmS[r - i0]);
                }
                const float* Pcol = Pt.data() + (v0 - i0) * Sk + j;
                const float* dScol = dSt.data() + (v0 - i0) * Sk + j;
                // #5 dV = P^T dO: P per (sub-tile, key half) block (E4M3), dO per query tile
                // (grad_format).
                const float sp = scale_of_amax(ap, e4m3);
                quant_with_scale(Pcol, L, Sk, sp, e4m3, hat.data(), 1);
                tile_axpy(hat.data(), sp, dot.hat + (v0 - vq) * dot.ld, dot.ld, dot.scale, L, dvd,
                          sbv.data(), dv_acc.data() + j * dvd);
                // #7 dK = dS^T Q: dS per (sub-tile, key half) block (grad_format), Q per query
                // tile (E4M3).
                const float sds = scale_of_amax(as, gf);
                quant_with_scale(dScol, L, Sk, sds, gf, hat.data(), 1);
                tile_axpy(hat.data(), sds, qv.hat + (v0 - vq) * qv.ld, qv.ld, qv.scale, L, d,
                          sbv.data(), dk_acc.data() + j * d);
              }
            }
          }
        }
      }
    }
    if (sums_only) return;
    for (int64_t j = 0; j < Sk; ++j) {
      float* dkr = dk_acc.data() + j * d;
      for (int64_t c = 0; c < d; ++c) dkr[c] *= tau;
      store_row(dk, b, j, hkv, d, dkr);
      store_row(dv, b, j, hkv, dvd, dv_acc.data() + j * dvd);
    }
  });
}


// ---------------------------------------------------------------------------
// 6. Outlier transforms (numerics.md section 10)
// ---------------------------------------------------------------------------
// The transforms run on copies of Q and K before either path sees them: the
// paths of sections 4-5 are called unchanged on Q' = Q R and
// K' = (K - 1 m^T) R, and the gradients they return are mapped back
// (dQ = dQ' R^T, dK = C (dK' R^T) with C the centering over keys). Working
// precision W: FP32 on the fp8 path (inputs read as FP32, as that path reads
// them), FP64 on the exact path.

void dispatch_forward(const AttnParams& p, const Geometry& g, const TensorView& q,
                      const TensorView& k, const TensorView& v, const TensorView& o, float* lse) {
  if (p.precision == Precision::kExact)
    exact_forward(p, g, q, k, v, o, lse);
  else if (p.scaling == Scaling::kTile)
    fp8_forward_tile(p, g, q, k, v, o, lse);
  else
    fp8_forward(p, g, q, k, v, o, lse);
}

void dispatch_backward(const AttnParams& p, const Geometry& g, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& o,
                       const TensorView& dout, const float* lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv,
                       const BackwardDiagnostics* diag) {
  if (p.precision == Precision::kExact)
    exact_backward(p, g, q, k, v, dout, dq, dk, dv, diag);
  else if (p.scaling == Scaling::kTile)
    fp8_backward_tile(p, g, q, k, v, o, dout, lse, dq, dk, dv, diag);
  else
    fp8_backward(p, g, q, k, v, o, dout, lse, dq, dk, dv, diag);
}

bool has_qk_transform(const AttnParams& p) {
  return p.qk_rotation != QkRotation::kNone || p.smooth_k;
}

// A contiguous [batch, seqlen, heads, w] tensor of one dtype and its view.
struct Buffer {
  std::vector<double> storage;  // double: aligned for every dtype
  TensorView view;
  Buffer(DType dt, int64_t B, int64_t S, int64_t H, int64_t w) {
    const int64_t n = B * S * H * w;
    const int64_t elem = dt == DType::kFloat64 ? 8 : dt == DType::kFloat32 ? 4 : 2;
    storage.resize(static_cast<size_t>((n * elem + 7) / 8 + 1));
    view.data = storage.data();
    view.dtype = dt;
    view.stride_head = w;
    view.stride_seq = H * w;
    view.stride_batch = S * H * w;
  }
};

// The dtype Q' and K' are stored in (so rounded to) before quantization: the
// input's for bfloat16 inputs on the fp8 path (what a kernel reading BF16
// gets), else the working precision.
DType transformed_dtype(const AttnParams& p, DType in) {
  if (p.precision == Precision::kExact) return DType::kFloat64;
  return in == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

// m[(b * Hkv + h) * d + c] = (FP64 sum over keys j = 0, 1, ... of K[b, j, h, c]
// read in W) / seqlen_k, rounded to W. All zeros when seqlen_k = 0.
template <class W>
std::vector<W> key_means(const Geometry& g, const TensorView& k, int num_threads) {
  std::vector<W> mean(static_cast<size_t>(g.B * g.Hkv * g.d), W(0));
  if (g.Sk == 0) return mean;
  parallel_for(g.B * g.Hkv, num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, h = task % g.Hkv;
    std::vector<W> row(g.d);
    std::vector<double> sum(g.d, 0.0);
    for (int64_t j = 0; j < g.Sk; ++j) {
      load_row(k, b, j, h, g.d, row.data());
      for (int64_t c = 0; c < g.d; ++c) sum[c] += static_cast<double>(row[c]);
    }
    for (int64_t c = 0; c < g.d; ++c)
      mean[task * g.d + c] = static_cast<W>(sum[c] / static_cast<double>(g.Sk));
  });
  return mean;
}

// dst row (b, s, h) = rotate(src row - mean[(b, h)]) in W, stored with
// dst's rounding; mean null = no subtraction.
template <class W>
void transform_rows(const TensorView& src, const TensorView& dst, int64_t B, int64_t S, int64_t H,
                    int64_t d, const W* mean, bool rotate, int num_threads) {
  parallel_for(B * H, num_threads, [&](int64_t task) {
    const int64_t b = task / H, h = task % H;
    std::vector<W> row(d);
    for (int64_t s = 0; s < S; ++s) {
      load_row(src, b, s, h, d, row.data());
      if (mean)
        for (int64_t c = 0; c < d; ++c) row[c] -= mean[task * d + c];
      if (rotate) hadamard_rotate_row(row.data(), d);
      store_row(dst, b, s, h, d, row.data());
    }
  });
}

// lse[b, hq, i] += sign * shift_i with shift_i = tau * <q_i, m_(b, hkv)>
// (q the untransformed row read in W, the dot product summed in FP64 over
// c = 0, 1, ...): the LSE of the smoothed logits S' = S - shift_i to that of
// S (sign +1) and back (sign -1). FP32 add on the fp8 path (tau rounded to
// FP32, shift rounded to FP32 first); on the exact path FP64 then rounded to
// FP32. A -inf LSE (row that sees no key) stays -inf.
template <class W>
void shift_lse(const AttnParams& p, const Geometry& g, const TensorView& q,
               const std::vector<W>& mean, float* lse, int sign) {
  const bool exact = p.precision == Precision::kExact;
  const double tau = exact ? static_cast<double>(p.softmax_scale)
                           : static_cast<double>(static_cast<float>(p.softmax_scale));
  parallel_for(g.B * g.Hq, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hq, hq = task % g.Hq;
    const W* m = mean.data() + (b * g.Hkv + hq / g.group) * g.d;
    std::vector<W> row(g.d);
    for (int64_t i = 0; i < g.Sq; ++i) {
      float& l = lse[g.lse_index(b, hq, i)];
      if (l == -kInfF) continue;
      load_row(q, b, i, hq, g.d, row.data());
      double u = 0.0;
      for (int64_t c = 0; c < g.d; ++c) u += static_cast<double>(row[c]) * static_cast<double>(m[c]);
      if (exact) {
        l = static_cast<float>(static_cast<double>(l) + sign * (tau * u));
      } else {
        const float sh = static_cast<float>(tau * u);
        l = sign > 0 ? l + sh : l - sh;
      }
    }
  });
}

struct TransformedQK {
  Buffer q, k;
};

template <class W>
TransformedQK transform_qk(const AttnParams& p, const Geometry& g, const TensorView& q,
                           const TensorView& k, const std::vector<W>& mean) {
  const bool rotate = p.qk_rotation == QkRotation::kHadamard;
  TransformedQK t{Buffer(transformed_dtype(p, q.dtype), g.B, g.Sq, g.Hq, g.d),
                  Buffer(transformed_dtype(p, k.dtype), g.B, g.Sk, g.Hkv, g.d)};
  transform_rows<W>(q, t.q.view, g.B, g.Sq, g.Hq, g.d, nullptr, rotate, p.num_threads);
  transform_rows<W>(k, t.k.view, g.B, g.Sk, g.Hkv, g.d, p.smooth_k ? mean.data() : nullptr, rotate,
                    p.num_threads);
  return t;
}

AttnParams without_transform(const AttnParams& p) {
  AttnParams p2 = p;
  p2.qk_rotation = QkRotation::kNone;
  p2.smooth_k = false;
  return p2;
}

template <class W>
void transformed_forward(const AttnParams& p, const Geometry& g, const TensorView& q,
                         const TensorView& k, const TensorView& v, const TensorView& o, float* lse) {
  const std::vector<W> mean = p.smooth_k ? key_means<W>(g, k, p.num_threads) : std::vector<W>();
  const TransformedQK t = transform_qk<W>(p, g, q, k, mean);
  dispatch_forward(without_transform(p), g, t.q.view, t.k.view, v, o, lse);
  if (p.smooth_k) shift_lse<W>(p, g, q, mean, lse, +1);
}

template <class W>
void transformed_backward(const AttnParams& p, const Geometry& g, const TensorView& q,
                          const TensorView& k, const TensorView& v, const TensorView& o,
                          const TensorView& dout, const float* lse, const TensorView& dq,
                          const TensorView& dk, const TensorView& dv,
                          const BackwardDiagnostics* diag) {
  const bool rotate = p.qk_rotation == QkRotation::kHadamard;
  const std::vector<W> mean = p.smooth_k ? key_means<W>(g, k, p.num_threads) : std::vector<W>();
  const TransformedQK t = transform_qk<W>(p, g, q, k, mean);
  // The LSE of the transformed logits (the fp8 path reads it; the exact path recomputes).
  const int64_t n_lse = g.B * g.Hq * g.Sq;
  std::vector<float> lse_t(lse ? lse : static_cast<const float*>(nullptr),
                           lse ? lse + n_lse : static_cast<const float*>(nullptr));
  if (p.smooth_k && p.precision == Precision::kFP8) shift_lse<W>(p, g, q, mean, lse_t.data(), -1);
  const DType wt = std::is_same<W, double>::value ? DType::kFloat64 : DType::kFloat32;
  Buffer dq_t(wt, g.B, g.Sq, g.Hq, g.d), dk_t(wt, g.B, g.Sk, g.Hkv, g.d);
  dispatch_backward(without_transform(p), g, t.q.view, t.k.view, v, o, dout, lse_t.data(),
                    dq_t.view, dk_t.view, dv, diag);
  // dQ = dQ' R^T.
  parallel_for(g.B * g.Hq, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hq, h = task % g.Hq;
    std::vector<W> row(g.d);
    for (int64_t i = 0; i < g.Sq; ++i) {
      load_row(dq_t.view, b, i, h, g.d, row.data());
      if (rotate) hadamard_rotate_row_transposed(row.data(), g.d);
      store_row(dq, b, i, h, g.d, row.data());
    }
  });
  // dK = dK' R^T minus its mean over the keys (the gradient through m).
  parallel_for(g.B * g.Hkv, p.num_threads, [&](int64_t task) {
    const int64_t b = task / g.Hkv, h = task % g.Hkv;
    std::vector<W> rows(static_cast<size_t>(g.Sk * g.d));
    std::vector<double> sum(g.d, 0.0);
    for (int64_t j = 0; j < g.Sk; ++j) {
      W* r = rows.data() + j * g.d;
      load_row(dk_t.view, b, j, h, g.d, r);
      if (rotate) hadamard_rotate_row_transposed(r, g.d);
      for (int64_t c = 0; c < g.d; ++c) sum[c] += static_cast<double>(r[c]);
    }
    std::vector<W> gmean(g.d, W(0));
    if (p.smooth_k && g.Sk > 0)
      for (int64_t c = 0; c < g.d; ++c) gmean[c] = static_cast<W>(sum[c] / static_cast<double>(g.Sk));
    for (int64_t j = 0; j < g.Sk; ++j) {
      W* r = rows.data() + j * g.d;
      if (p.smooth_k)
        for (int64_t c = 0; c < g.d; ++c) r[c] -= gmean[c];
      store_row(dk, b, j, h, g.d, r);
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------
// 7. Public entry points
// ---------------------------------------------------------------------------

void check_attention_params(const AttnParams& p) {
  FP8ATTN_CHECK_ARG(p.batch >= 0, "batch", "must be >= 0, got ", p.batch);
  FP8ATTN_CHECK_ARG(p.seqlen_q >= 0, "seqlen_q", "must be >= 0, got ", p.seqlen_q);
  FP8ATTN_CHECK_ARG(p.seqlen_k >= 0, "seqlen_k", "must be >= 0, got ", p.seqlen_k);
  FP8ATTN_CHECK_ARG(p.num_heads_q >= 1, "num_heads_q", "must be >= 1, got ", p.num_heads_q);
  FP8ATTN_CHECK_ARG(p.num_heads_kv >= 1, "num_heads_kv", "must be >= 1, got ", p.num_heads_kv);
  FP8ATTN_CHECK_ARG(p.num_heads_q % p.num_heads_kv == 0, "num_heads_q",
                    "must be a multiple of num_heads_kv (GQA), got num_heads_q=", p.num_heads_q,
                    ", num_heads_kv=", p.num_heads_kv);
  FP8ATTN_CHECK_ARG(p.head_dim_qk >= 1 && p.head_dim_qk <= 256, "head_dim_qk",
                    "must be in [1, 256], got ", p.head_dim_qk);
  FP8ATTN_CHECK_ARG(p.head_dim_v >= 1 && p.head_dim_v <= 256, "head_dim_v",
                    "must be in [1, 256], got ", p.head_dim_v);
  FP8ATTN_CHECK_ARG(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.0, "softmax_scale",
                    "must be positive and finite, got ", p.softmax_scale);
  const int prec = static_cast<int>(p.precision), mode = static_cast<int>(p.delta_mode),
            fmt = static_cast<int>(p.grad_format);
  FP8ATTN_CHECK_ARG(prec == 0 || prec == 1, "precision",
                    "must be Precision::kExact or kFP8, got enum value ", prec);
  FP8ATTN_CHECK_ARG(mode >= 0 && mode <= 2, "delta_mode",
                    "must be kStale, kMatchedDO or kDeltaMatching, got enum value ", mode);
  FP8ATTN_CHECK_ARG(fmt == 0 || fmt == 1, "grad_format",
                    "must be Fp8Format::kE4M3 or kE5M2, got enum value ", fmt);
  FP8ATTN_CHECK_ARG(p.block_size == 32 || p.block_size == 64 || p.block_size == 128, "block_size",
                    "must be 32, 64 or 128, got ", p.block_size);
  const int sc = static_cast<int>(p.scaling);
  FP8ATTN_CHECK_ARG(sc == 0 || sc == 1, "scaling",
                    "must be Scaling::kRow or kTile, got enum value ", sc);
  const int rot = static_cast<int>(p.qk_rotation);
  FP8ATTN_CHECK_ARG(rot == 0 || rot == 1, "qk_rotation",
                    "must be QkRotation::kNone or kHadamard, got enum value ", rot);
  FP8ATTN_CHECK_ARG(std::isfinite(p.softcap) && p.softcap >= 0.0, "softcap",
                    "must be finite and >= 0 (0 = off), got ", p.softcap);
  // The fp8 path holds c in FP32 (cap below): past FLT_MAX it would be inf (every P NaN),
  // below ~7e-46 it would round to 0 (the cap silently off).
  FP8ATTN_CHECK_ARG(p.precision != Precision::kFP8 || p.softcap == 0.0 ||
                        (p.softcap >= static_cast<double>(std::numeric_limits<float>::min()) &&
                         p.softcap <= static_cast<double>(std::numeric_limits<float>::max())),
                    "softcap", "must be 0 or a normal float32 (in [1.175494e-38, 3.402823e+38]) with precision "
                    "fp8 (the cap is held in float32), got ", p.softcap);
  FP8ATTN_CHECK_ARG(!(p.softcap > 0.0 && p.smooth_k), "softcap",
                    "cannot be combined with smooth_k (softcapping is not invariant to the mean-key shift)");
  FP8ATTN_CHECK_ARG(p.num_threads >= 0, "num_threads", "must be >= 0 (0 = all cores), got ",
                    p.num_threads);
}

void check_attention_shapes(const AttnParams& p, const int64_t* q_sizes, const int64_t* k_sizes,
                            const int64_t* v_sizes, const int64_t* o_sizes,
                            const int64_t* dout_sizes, const int64_t* dq_sizes,
                            const int64_t* dk_sizes, const int64_t* dv_sizes) {
  auto check = [&](const int64_t* sz, const char* name, int64_t seqlen, const char* seq_name,
                   int64_t heads, const char* heads_name, int64_t hd, const char* hd_name) {
    if (!sz) return;
    FP8ATTN_CHECK_ARG(sz[0] == p.batch, name, "batch size ", sz[0],
                      " does not match batch = ", p.batch);
    FP8ATTN_CHECK_ARG(sz[1] == seqlen, name, "sequence length ", sz[1], " does not match ",
                      seq_name, " = ", seqlen);
    FP8ATTN_CHECK_ARG(sz[2] == heads, name, "number of heads ", sz[2], " does not match ",
                      heads_name, " = ", heads);
    FP8ATTN_CHECK_ARG(sz[3] == hd, name, "head_dim ", sz[3], " does not match ", hd_name, " = ",
                      hd);
  };
  check(q_sizes, "q", p.seqlen_q, "seqlen_q", p.num_heads_q, "num_heads_q", p.head_dim_qk,
        "head_dim_qk");
  check(k_sizes, "k", p.seqlen_k, "seqlen_k", p.num_heads_kv, "num_heads_kv", p.head_dim_qk,
        "head_dim_qk");
  check(v_sizes, "v", p.seqlen_k, "seqlen_k", p.num_heads_kv, "num_heads_kv", p.head_dim_v,
        "head_dim_v");
  check(o_sizes, "o", p.seqlen_q, "seqlen_q", p.num_heads_q, "num_heads_q", p.head_dim_v,
        "head_dim_v");
  check(dout_sizes, "dout", p.seqlen_q, "seqlen_q", p.num_heads_q, "num_heads_q", p.head_dim_v,
        "head_dim_v");
  check(dq_sizes, "dq", p.seqlen_q, "seqlen_q", p.num_heads_q, "num_heads_q", p.head_dim_qk,
        "head_dim_qk");
  check(dk_sizes, "dk", p.seqlen_k, "seqlen_k", p.num_heads_kv, "num_heads_kv", p.head_dim_qk,
        "head_dim_qk");
  check(dv_sizes, "dv", p.seqlen_k, "seqlen_k", p.num_heads_kv, "num_heads_kv", p.head_dim_v,
        "head_dim_v");
}

void attention_forward_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& o, float* lse) {
  check_attention_params(p);
  const bool any_q = p.batch * p.num_heads_q * p.seqlen_q > 0;
  const bool any_k = any_q && p.seqlen_k > 0;
  check_view(q, "q", any_q);
  check_view(k, "k", any_k);
  check_view(v, "v", any_k);
  check_view(o, "o", any_q);
  FP8ATTN_CHECK_ARG(!any_q || lse != nullptr, "lse", "pointer is null");
  if (!any_q) return;
  const Geometry g(p);
  if (!has_qk_transform(p))
    dispatch_forward(p, g, q, k, v, o, lse);
  else if (p.precision == Precision::kExact)
    transformed_forward<double>(p, g, q, k, v, o, lse);
  else
    transformed_forward<float>(p, g, q, k, v, o, lse);
}

namespace {

// What the sharded-key backward (numerics.md section 11) takes: the fp8 path
// without outlier transforms or diagnostics, and either the partial sums
// (sums = true) or a given Delta-Matching delta.
void check_sharded(const AttnParams& p, const BackwardDiagnostics* diag, bool sums) {
  const ShardedDelta& sd = *p.sharded;
  FP8ATTN_CHECK_ARG(p.precision == Precision::kFP8, "precision",
                    "a sharded key axis (explicit delta or partial sums) needs precision fp8");
  FP8ATTN_CHECK_ARG(!has_qk_transform(p), "qk_rotation",
                    "a sharded key axis is not implemented with qk_rotation or smooth_k");
  FP8ATTN_CHECK_ARG(diag == nullptr, "diagnostics",
                    "a sharded key axis has no per-call diagnostics (its delta is global)");
  if (sums) {
    FP8ATTN_CHECK_ARG(sd.delta == nullptr && sd.sum_pdp != nullptr && sd.sum_p != nullptr, "sharded",
                      "the partial sums need sum_pdp and sum_p, and no delta");
  } else {
    FP8ATTN_CHECK_ARG(sd.delta != nullptr && sd.sum_pdp == nullptr && sd.sum_p == nullptr, "delta",
                      "an explicit delta needs delta set and no partial-sum outputs");
    FP8ATTN_CHECK_ARG(p.delta_mode == DeltaMode::kDeltaMatching, "delta_mode",
                      "an explicit delta is the Delta-Matching delta: delta_mode must be delta_matching");
  }
}

}  // namespace

void attention_dm_sums_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& dout, const float* lse,
                           float* sum_pdp, float* sum_p) {
  check_attention_params(p);
  AttnParams p2 = p;
  p2.delta_mode = DeltaMode::kDeltaMatching;
  ShardedDelta sd;
  sd.sum_pdp = sum_pdp;
  sd.sum_p = sum_p;
  p2.sharded = &sd;
  check_sharded(p2, nullptr, true);
  const bool any_q = p.batch * p.num_heads_q * p.seqlen_q > 0;
  const bool any_k = p.batch * p.num_heads_kv * p.seqlen_k > 0;
  check_view(q, "q", any_q);
  check_view(k, "k", any_k);
  check_view(v, "v", any_k);
  check_view(dout, "dout", any_q);
  FP8ATTN_CHECK_ARG(!any_q || lse != nullptr, "lse", "pointer is null");
  FP8ATTN_CHECK_ARG(!any_q || (sum_pdp != nullptr && sum_p != nullptr), "sum_pdp", "pointer is null");
  if (!any_q) return;
  const Geometry g(p2);
  const TensorView none{};
  dispatch_backward(p2, g, q, k, v, none, dout, lse, none, none, none, nullptr);
}

void attention_backward_ref(const AttnParams& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& dout,
                            const float* lse, const TensorView& dq, const TensorView& dk,
                            const TensorView& dv, const BackwardDiagnostics* diag) {
  check_attention_params(p);
  const bool any_q = p.batch * p.num_heads_q * p.seqlen_q > 0;
  const bool any_k = p.batch * p.num_heads_kv * p.seqlen_k > 0;
  check_view(q, "q", any_q);
  check_view(k, "k", any_k);
  check_view(v, "v", any_k);
  check_view(o, "o", any_q);
  check_view(dout, "dout", any_q);
  check_view(dq, "dq", any_q);
  check_view(dk, "dk", any_k);
  check_view(dv, "dv", any_k);
  FP8ATTN_CHECK_ARG(!any_q || lse != nullptr, "lse", "pointer is null");
  if (p.sharded != nullptr) check_sharded(p, diag, false);
  if (!any_q && !any_k) return;
  const Geometry g(p);
  if (!has_qk_transform(p))
    dispatch_backward(p, g, q, k, v, o, dout, lse, dq, dk, dv, diag);
  else if (p.precision == Precision::kExact)
    transformed_backward<double>(p, g, q, k, v, o, dout, lse, dq, dk, dv, diag);
  else
    transformed_backward<float>(p, g, q, k, v, o, dout, lse, dq, dk, dv, diag);
}

}  // namespace fp8attn
