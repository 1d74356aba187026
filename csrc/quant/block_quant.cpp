// fp8attn: block-scaled quantize / dequantize of a whole tensor along any
// axis (numerics.md section 2). Declarations and contract: block_quant.h.
#include "quant/block_quant.h"

#include "common/error.h"

namespace fp8attn {
namespace {

// The tensor seen as [outer, n, inner] with the blocked axis in the middle.
struct AxisLayout {
  int64_t outer = 1;
  int64_t n = 0;       // length of the blocked axis
  int64_t inner = 1;   // element stride of the blocked axis
  int64_t nb = 0;      // blocks along the axis: ceil(n / B)
  int64_t numel = 0;
};

AxisLayout check_and_layout(const int64_t* shape, int rank, int dim, int block_size, Fp8Format fmt) {
  FP8ATTN_CHECK_ARG(shape != nullptr, "shape", "must not be null");
  FP8ATTN_CHECK_ARG(rank == 2 || rank == 4, "rank", "must be 2 or 4, got ", rank);
  FP8ATTN_CHECK_ARG(dim >= -rank && dim < rank, "dim", "must be in [", -rank, ", ", rank - 1,
                    "] for a rank-", rank, " tensor, got ", dim);
  FP8ATTN_CHECK_ARG(block_size == 32 || block_size == 64 || block_size == 128, "block_size",
                    "must be 32, 64 or 128, got ", block_size);
  FP8ATTN_CHECK_ARG(fmt == Fp8Format::kE4M3 || fmt == Fp8Format::kE5M2, "fmt",
                    "must be E4M3 or E5M2, got enum value ", static_cast<int>(fmt));
  if (dim < 0) dim += rank;
  AxisLayout l;
  l.numel = 1;
  for (int a = 0; a < rank; ++a) {
    FP8ATTN_CHECK_ARG(shape[a] >= 0, "shape", "extent ", a, " must be >= 0, got ", shape[a]);
    if (a < dim) l.outer *= shape[a];
    if (a > dim) l.inner *= shape[a];
    l.numel *= shape[a];
  }
  l.n = shape[dim];
  l.nb = num_blocks(l.n, block_size);
  return l;
}

}  // namespace

void quantize_blockwise(const float* x, const int64_t* shape, int rank, int dim, int block_size,
                        Fp8Format fmt, uint8_t* codes, float* scales) {
  const AxisLayout l = check_and_layout(shape, rank, dim, block_size, fmt);
  if (l.numel == 0) return;
  FP8ATTN_CHECK_ARG(x != nullptr, "x", "must not be null");
  FP8ATTN_CHECK_ARG(codes != nullptr, "codes", "must not be null");
  FP8ATTN_CHECK_ARG(scales != nullptr, "scales", "must not be null");
  // NOTE: one strided quantize_block per (outer, block, inner) triple; with
  // inner > 1 a block's B rows of `inner` floats stay in cache between the
  // amax pass and the encode pass, so no transpose is needed.
  for (int64_t o = 0; o < l.outer; ++o) {
    for (int64_t b = 0; b < l.nb; ++b) {
      const int64_t i0 = b * block_size;
      const int64_t len = (l.n - i0) < block_size ? (l.n - i0) : block_size;
      const int64_t base = (o * l.n + i0) * l.inner;
      float* srow = scales + (o * l.nb + b) * l.inner;
      for (int64_t j = 0; j < l.inner; ++j) {
        srow[j] = quantize_block(x + base + j, len, l.inner, fmt, codes + base + j, nullptr);
      }
    }
  }
}

void dequantize_blockwise(const uint8_t* codes, const float* scales, const int64_t* shape, int rank,
                          int dim, int block_size, Fp8Format fmt, float* out) {
  const AxisLayout l = check_and_layout(shape, rank, dim, block_size, fmt);
  if (l.numel == 0) return;
  FP8ATTN_CHECK_ARG(codes != nullptr, "codes", "must not be null");
  FP8ATTN_CHECK_ARG(scales != nullptr, "scales", "must not be null");
  FP8ATTN_CHECK_ARG(out != nullptr, "out", "must not be null");
  const float* table = fp8_decode_table(fmt);
  for (int64_t o = 0; o < l.outer; ++o) {
    for (int64_t i = 0; i < l.n; ++i) {
      const int64_t base = (o * l.n + i) * l.inner;
      const float* srow = scales + (o * l.nb + i / block_size) * l.inner;
      for (int64_t j = 0; j < l.inner; ++j) out[base + j] = table[codes[base + j]] * srow[j];
    }
  }
}

}  // namespace fp8attn
