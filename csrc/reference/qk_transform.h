// fp8attn: the outlier transforms applied to Q and K before quantization
// (numerics.md section 10): a block-diagonal normalized Hadamard rotation with
// a fixed sign pattern (qk_rotation = hadamard) and the subtraction of the
// mean key (smooth_k). Header-only so the C++ tests can check the rules
// directly; the reference (attention_ref.cpp) applies them, and the op's CUDA
// path (python/fp8attn/qk_transform.py) implements the same rules with torch
// ops (same operations in the same order, so the same FP32 values).
//
// Row convention: a Q or K row x (head_dim d values) is rotated as x' = x R,
// R = blockdiag(D_b H_b c_b) over the blocks b of hadamard_blocks(d), with
// D_b = diag(signs of the block's channels), H_b the Sylvester Hadamard
// matrix of the block's size n (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]),
// and c_b = 1/sqrt(n). R is orthogonal: R R^T = I. Gradients map back with
// R^T = blockdiag(c_b H_b D_b) (H_b is symmetric).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace fp8attn {

// The Hadamard block sizes of head_dim d (1 <= d): the powers of two of d's
// binary representation, largest first, so blocks start at channel 0 and
// follow each other (e.g. 128 -> {128}; 192 -> {128, 64}; 80 -> {64, 16};
// 100 -> {64, 32, 4}). For 128 < d < 256 the first block is channels
// [0, 128) and the others lie inside [128, d): no block straddles a 128-channel
// quantization block of the `row` recipe (numerics.md section 10 says why).
inline std::vector<int64_t> hadamard_blocks(int64_t d) {
  std::vector<int64_t> blocks;
  for (int bit = 62; bit >= 0; --bit) {
    const int64_t n = int64_t{1} << bit;
    if (d & n) blocks.push_back(n);
  }
  return blocks;
}

// The fixed sign of channel c (0-based index within head_dim, the same for
// every head, batch and call): the top bit of the c-th output of SplitMix64
// (Steele, Lea, Flood 2014) seeded with 0: z = (c + 1) * 0x9E3779B97F4A7C15,
// z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9, z = (z ^ z >> 27) * 0x94D049BB133111EB,
// z ^= z >> 31 (all mod 2^64); sign = -1 if z >> 63 else +1.
inline int hadamard_sign(int64_t c) {
  uint64_t z = (static_cast<uint64_t>(c) + 1u) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 63) ? -1 : 1;
}

// The normalization of a block of n channels in working precision T:
// 1/sqrt(n) computed in FP64 and rounded to T (exact for n a power of 4).
template <class T>
inline T hadamard_norm(int64_t n) {
  return static_cast<T>(1.0 / std::sqrt(static_cast<double>(n)));
}

// In-place unnormalized Sylvester Hadamard transform of x[0, n), n a power
// of two, in T arithmetic: for h = 1, 2, 4, ..., n/2 (in this order), for
// every pair (i, i + h) with i & h == 0, (a, b) -> (a + b, a - b).
template <class T>
inline void fwht(T* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i0 = 0; i0 < n; i0 += 2 * h)
      for (int64_t i = i0; i < i0 + h; ++i) {
        const T a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
}

// x[0, d) <- x R (forward rotation of one Q or K row), in T arithmetic:
// per block, multiply by the signs (exact), fwht, multiply by hadamard_norm.
template <class T>
inline void hadamard_rotate_row(T* x, int64_t d) {
  int64_t o = 0;
  for (const int64_t n : hadamard_blocks(d)) {
    T* xb = x + o;
    for (int64_t c = 0; c < n; ++c)
      if (hadamard_sign(o + c) < 0) xb[c] = -xb[c];
    fwht(xb, n);
    const T s = hadamard_norm<T>(n);
    for (int64_t c = 0; c < n; ++c) xb[c] *= s;
    o += n;
  }
}

// g[0, d) <- g R^T (a gradient row mapped back to the unrotated channels):
// per block, fwht, multiply by hadamard_norm, then by the signs (exact).
template <class T>
inline void hadamard_rotate_row_transposed(T* g, int64_t d) {
  int64_t o = 0;
  for (const int64_t n : hadamard_blocks(d)) {
    T* gb = g + o;
    fwht(gb, n);
    const T s = hadamard_norm<T>(n);
    for (int64_t c = 0; c < n; ++c) {
      gb[c] *= s;
      if (hadamard_sign(o + c) < 0) gb[c] = -gb[c];
    }
    o += n;
  }
}

}  // namespace fp8attn
