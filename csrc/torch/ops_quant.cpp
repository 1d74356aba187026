// fp8attn: CPU implementations of the quantization ops (schemas in ops.cpp,
// semantics in docs/architecture.md, math in numerics.md section 2):
//   fp8_encode(x, fmt)                                   float -> uint8 codes
//   fp8_decode(codes, fmt)                               uint8 -> float32
//   quantize_blockwise(x, dim, block_size, fmt)          -> (codes, scales)
//   dequantize_blockwise(codes, scales, dim, block_size, fmt) -> float32
//   quantize_tilescale(x, dim, block_size, fmt, transposed) -> (codes, scales)
//        the `tile` recipe's blockings (numerics.md section 9)
// Bad arguments raise ValueError (TORCH_CHECK_VALUE) naming the argument.
// Inputs of any strides are accepted (made contiguous); outputs are contiguous.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "common/fp8_codec.h"
#include "quant/block_quant.h"

namespace fp8attn {
namespace {

Fp8Format parse_fmt(const std::string& s) {
  if (s == "e4m3") return Fp8Format::kE4M3;
  if (s == "e5m2") return Fp8Format::kE5M2;
  TORCH_CHECK_VALUE(false, "fp8attn: argument 'fmt': expected \"e4m3\" or \"e5m2\", got \"", s, "\"");
  return Fp8Format::kE4M3;  // unreachable
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.defined(), "fp8attn: argument '", name, "': tensor is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "fp8attn: argument '", name,
                    "': expected a CPU tensor, got device ", t.device());
}

// Float input as contiguous FP32. BF16 / FP16 upcast exactly; FP64 is refused
// (its cast to FP32 would be a second rounding before the FP8 one).
at::Tensor float_input(const at::Tensor& x, const char* name) {
  check_cpu(x, name);
  const auto st = x.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "fp8attn: argument '",
                    name, "': expected dtype float32 (or bfloat16 / float16), got ", st);
  return x.to(at::kFloat).contiguous();
}

at::Tensor codes_input(const at::Tensor& codes) {
  check_cpu(codes, "codes");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte,
                    "fp8attn: argument 'codes': expected dtype uint8, got ", codes.scalar_type());
  return codes.contiguous();
}

// Checks rank / dim / block_size; returns dim in [0, rank).
int64_t check_blocking(const at::Tensor& t, const char* name, int64_t dim, int64_t block_size) {
  const int64_t rank = t.dim();
  TORCH_CHECK_VALUE(rank == 2 || rank == 4, "fp8attn: argument '", name,
                    "': expected a rank-2 or rank-4 tensor, got rank ", rank, " (shape ", t.sizes(), ")");
  TORCH_CHECK_VALUE(dim >= -rank && dim < rank, "fp8attn: argument 'dim': expected a value in [", -rank,
                    ", ", rank - 1, "] for a rank-", rank, " tensor, got ", dim);
  TORCH_CHECK_VALUE(block_size == 32 || block_size == 64 || block_size == 128,
                    "fp8attn: argument 'block_size': expected 32, 64 or 128, got ", block_size);
  return dim < 0 ? dim + rank : dim;
}

std::vector<int64_t> scales_shape(const at::Tensor& t, int64_t dim, int64_t block_size) {
  std::vector<int64_t> s(t.sizes().begin(), t.sizes().end());
  s[dim] = num_blocks(s[dim], block_size);
  return s;
}

// Runs `fn` and maps the core's ArgumentError to ValueError.
template <class F>
void map_errors(F&& fn) {
  try {
    fn();
  } catch (const ArgumentError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// ---- ops ------------------------------------------------------------------

at::Tensor fp8_encode_cpu(const at::Tensor& x_in, c10::string_view fmt_s) {
  const Fp8Format fmt = parse_fmt(std::string(fmt_s));
  const at::Tensor x = float_input(x_in, "x");
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const int64_t n = x.numel();
  if (fmt == Fp8Format::kE4M3) {
    for (int64_t i = 0; i < n; ++i) cp[i] = fp8_encode_e4m3(xp[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) cp[i] = fp8_encode_e5m2(xp[i]);
  }
  return codes;
}

at::Tensor fp8_decode_cpu(const at::Tensor& codes_in, c10::string_view fmt_s) {
  const Fp8Format fmt = parse_fmt(std::string(fmt_s));
  const at::Tensor codes = codes_input(codes_in);
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const float* table = fp8_decode_table(fmt);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t n = codes.numel();
  for (int64_t i = 0; i < n; ++i) op[i] = table[cp[i]];
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x_in, int64_t dim,
                                                          int64_t block_size, c10::string_view fmt_s) {
  const Fp8Format fmt = parse_fmt(std::string(fmt_s));
  const at::Tensor x = float_input(x_in, "x");
  dim = check_blocking(x, "x", dim, block_size);
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor scales = at::empty(scales_shape(x, dim, block_size), x.options().dtype(at::kFloat));
  map_errors([&] {
    quantize_blockwise(x.data_ptr<float>(), x.sizes().data(), static_cast<int>(x.dim()),
                       static_cast<int>(dim), static_cast<int>(block_size), fmt, codes.data_ptr<uint8_t>(),
                       scales.data_ptr<float>());
  });
  return {codes, scales};
}

at::Tensor dequantize_blockwise_cpu(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t dim,
                                    int64_t block_size, c10::string_view fmt_s) {
  const Fp8Format fmt = parse_fmt(std::string(fmt_s));
  const at::Tensor codes = codes_input(codes_in);
  dim = check_blocking(codes, "codes", dim, block_size);
  check_cpu(scales_in, "scales");
  TORCH_CHECK_VALUE(scales_in.scalar_type() == at::kFloat,
                    "fp8attn: argument 'scales': expected dtype float32, got ", scales_in.scalar_type());
  const auto want = scales_shape(codes, dim, block_size);
  TORCH_CHECK_VALUE(scales_in.sizes().vec() == want, "fp8attn: argument 'scales': expected shape ",
                    at::IntArrayRef(want), " (codes shape ", codes.sizes(), " with dim ", dim,
                    " cut into blocks of ", block_size, "), got ", scales_in.sizes());
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  map_errors([&] {
    dequantize_blockwise(codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), codes.sizes().data(),
                         static_cast<int>(codes.dim()), static_cast<int>(dim), static_cast<int>(block_size),
                         fmt, out.data_ptr<float>());
  });
  return out;
}

// quantize_tilescale: x rank 4 [B, H, S, D]. dim 3 (-1): one block per token
// over all of D, scales [B, H, S]; dim 2 (-2): one block per block_size tokens
// (from token 0, the last one shorter) over all of D, scales [B, H,
// ceil(S / block_size)]. Codes have x's shape. `transposed` only selects a
// CUDA output layout (same values): ignored here. Each block is
// quantize_block (numerics.md section 2) on its values, which is what the CPU
// reference's `tile` path does on whole blocks.
std::tuple<at::Tensor, at::Tensor> quantize_tilescale_cpu(const at::Tensor& x_in, int64_t dim, int64_t block_size,
                                                          c10::string_view fmt_s, bool /*transposed*/) {
  const Fp8Format fmt = parse_fmt(std::string(fmt_s));
  const at::Tensor x = float_input(x_in, "x");
  TORCH_CHECK_VALUE(x.dim() == 4, "fp8attn: argument 'x': quantize_tilescale takes a rank-4 tensor [batch, heads, "
                    "seqlen, head_dim], got rank ", x.dim());
  TORCH_CHECK_VALUE(dim == 2 || dim == 3 || dim == -1 || dim == -2,
                    "fp8attn: argument 'dim': quantize_tilescale blocks dim 2 (tiles of tokens) or 3 (per token), "
                    "or -2 / -1, got ", dim);
  TORCH_CHECK_VALUE(block_size == 32 || block_size == 64 || block_size == 128,
                    "fp8attn: argument 'block_size': expected 32, 64 or 128, got ", block_size);
  const int64_t d = dim < 0 ? dim + 4 : dim;
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  const int64_t rows = d == 3 ? S : num_blocks(S, block_size);  // blocks per (b, h)
  const int64_t span = d == 3 ? 1 : block_size;                 // tokens per block
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({B, H, rows}, x.options().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t0 = r * span, n = std::min(span, S - t0) * D, off = (bh * S + t0) * D;
      sp[bh * rows + r] = quantize_block(xp + off, n, 1, fmt, cp + off, nullptr);
    }
  return {codes, scales};
}

// quantize_tilescale_fwd: the `tile` forward's Q (dim 3), K and V (dim 2), block 128.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_tilescale_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::string_view fmt) {
  auto [qc, qs] = quantize_tilescale_cpu(q, 3, 128, fmt, false);
  auto [kc, ks] = quantize_tilescale_cpu(k, 2, 128, fmt, false);
  auto [vc, vs] = quantize_tilescale_cpu(v, 2, 128, fmt, false);
  return {qc, qs, kc, ks, vc, vs};
}

}  // namespace
}  // namespace fp8attn

TORCH_LIBRARY_IMPL(fp8attn, CPU, m) {
  m.impl("fp8_encode", &fp8attn::fp8_encode_cpu);
  m.impl("fp8_decode", &fp8attn::fp8_decode_cpu);
  m.impl("quantize_blockwise", &fp8attn::quantize_blockwise_cpu);
  m.impl("dequantize_blockwise", &fp8attn::dequantize_blockwise_cpu);
  m.impl("quantize_tilescale", &fp8attn::quantize_tilescale_cpu);
  m.impl("quantize_tilescale_fwd", &fp8attn::quantize_tilescale_fwd_cpu);
}
