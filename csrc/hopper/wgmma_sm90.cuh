// fp8attn: sm_90a warpgroup-MMA plumbing shared by the wgmma backward kernels
// of both scaling recipes (the `row` kernels in bwd_wgmma_e4m3_blockscale_sm90.cu,
// the `tile` kernels in bwd_*tilescale*_sm90.cu): wgmma wrappers and shared-memory
// descriptors, cp.async / mbarrier / named-barrier primitives, the row orders
// sigma / tau that make accumulator fragments A fragments, the cp.async tile
// fills, and the masks of partial tile pairs. Moved here unchanged from the
// `row` kernel file (the fills gained a thread count / thread index so a
// 128-thread producer warpgroup can issue them). Design notes: the top of
// bwd_wgmma_e4m3_blockscale_sm90.cu and docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "hopper/bwd_tile_sm90.cuh"

namespace fp8attn {
namespace sm90 {
namespace bwd {

namespace GM = cute::SM90::GMMA;

// ---- wgmma plumbing ---------------------------------------------------------------

template <int FA, int FB, int N, bool kRS>
struct GmmaOp;
#define FP8ATTN_GMMA_OPS(FA, FB, TA, TB, N)                                                 \
  template <>                                                                              \
  struct GmmaOp<FA, FB, N, false> {                                                        \
    using T = GM::MMA_64x##N##x32_F32##TA##TB##_SS_TN<>;                                   \
  };                                                                                       \
  template <>                                                                              \
  struct GmmaOp<FA, FB, N, true> {                                                         \
    using T = GM::MMA_64x##N##x32_F32##TA##TB##_RS_TN<>;                                   \
  };
FP8ATTN_GMMA_OPS(kFmtE4M3, kFmtE4M3, E4M3, E4M3, 64)
FP8ATTN_GMMA_OPS(kFmtE4M3, kFmtE5M2, E4M3, E5M2, 64)
FP8ATTN_GMMA_OPS(kFmtE5M2, kFmtE4M3, E5M2, E4M3, 64)
FP8ATTN_GMMA_OPS(kFmtE4M3, kFmtE4M3, E4M3, E4M3, 128)
FP8ATTN_GMMA_OPS(kFmtE4M3, kFmtE4M3, E4M3, E4M3, 32)
FP8ATTN_GMMA_OPS(kFmtE4M3, kFmtE5M2, E4M3, E5M2, 32)
FP8ATTN_GMMA_OPS(kFmtE5M2, kFmtE4M3, E5M2, E4M3, 32)
#undef FP8ATTN_GMMA_OPS

template <class Op, size_t... I>
__device__ __forceinline__ void gmma_ss_impl(uint64_t da, uint64_t db, float* d, bool acc,
                                             std::index_sequence<I...>) {
  Op::fma(da, db, d[I]..., acc ? GM::ScaleOut::One : GM::ScaleOut::Zero);
}
template <class Op, size_t... I>
__device__ __forceinline__ void gmma_rs_impl(const uint32_t (&a)[4], uint64_t db, float* d, bool acc,
                                             std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, d[I]..., acc ? GM::ScaleOut::One : GM::ScaleOut::Zero);
}
// D (m64 x N, FP32, N/2 registers per thread) = A * B (+ D if acc).
template <int FA, int FB, int N>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float* d, bool acc) {
  gmma_ss_impl<typename GmmaOp<FA, FB, N, false>::T>(da, db, d, acc, std::make_index_sequence<N / 2>{});
}
template <int FA, int FB, int N>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float* d, bool acc) {
  gmma_rs_impl<typename GmmaOp<FA, FB, N, true>::T>(a, db, d, acc, std::make_index_sequence<N / 2>{});
}

__device__ __forceinline__ void wg_arrive() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across arrive/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
__device__ __forceinline__ void fence_regs_u(uint32_t* r, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups
// 1024 bytes apart (SBO); LBO unused for swizzled K-major layouts. The high
// word is constant (SBO = 1024 >> 4, layout type 1 = 128-byte swizzle); the
// low word is the start address >> 4 (bits 0-13) | LBO = 1 (bit 16).
// NOTE: descriptors are built as desc_lo(tile base) + (byte offset >> 4) with
// compile-time offsets (every shared address is < 2^18, so the start-address
// field never carries), from warp-uniform bases: a few uniform adds per wgmma
// instead of the cvta / mask / shift / or chain per descriptor (~370
// instructions per warp and tile pair before, ncu 2026-11-29).
constexpr uint32_t kDescHi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t desc_lo(uint32_t smem_addr) { return (smem_addr >> 4) | (1u << 16); }
__device__ __forceinline__ uint32_t desc_lo(const void* p) { return desc_lo(smem_u32(p)); }
__device__ __forceinline__ uint64_t desc_of(uint32_t lo) { return (static_cast<uint64_t>(kDescHi) << 32) | lo; }
constexpr uint32_t kDesc64Rows = 64 * 128 / 16;  // descriptor step of 64 rows of a swizzled tile
constexpr uint32_t kDescK32 = 32 / 16;           // descriptor step of 32 bytes (one k32 slice) along K
// Warpgroup index as a warp-uniform value (a shuffle from lane 0), so that
// descriptor arithmetic stays in uniform registers.
__device__ __forceinline__ int warpgroup_uniform() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) >> 7, 0);
}
// The same value, re-derived where it is used (volatile: not hoisted or CSE'd).
// NOTE (v5): the main kernel's loop takes wg from this once per tile pair; kept
// live across the loop, ptxas spilled it at d = 128 and its reload (LDL, L2
// latency: shared memory leaves ~20 KB of L1) stalled the first S^T
// WARPGROUP.ARRIVE / R2UR: 4.7% of the stall samples (ncu 2026-11-29, per-SASS
// profile of the v4 kernel; docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md, v5).
__device__ __forceinline__ int warpgroup_uniform_fresh() {
  int r;
  asm volatile("shfl.sync.idx.b32 %0, %1, 0, 0x1f, 0xffffffff;\n" : "=r"(r) : "r"(static_cast<int>(threadIdx.x) >> 7));
  return r;
}
// Dynamic shared memory rounded up to 1024 bytes (swizzle atoms). NOTE: by
// pointer arithmetic on the __shared__ array (not through uintptr_t), so the
// compiler keeps the shared address space: LDS / STS instead of generic LD / ST.
__device__ __forceinline__ uint8_t* smem_aligned_1024(uint8_t* raw) {
  return raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
}

// Byte offset of (row, 16-byte chunk) in a 128-byte-swizzled tile.
__device__ __forceinline__ int sw128(int row, int chunk) { return row * 128 + ((chunk ^ (row & 7)) << 4); }

__device__ __forceinline__ void cp_async16(uint8_t* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes (cp.async, st.shared) -> visible to wgmma (async proxy).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// TMA bulk reduce-add (one thread): `bytes` of FP32 at shared address src added
// element-wise into global dst (both 16-byte aligned, bytes a multiple of 16),
// tracked in this thread's bulk groups: commit, then wait_read before src is
// rewritten and wait before the CTA exits.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// mbarriers (d <= 128 main kernel, v6) and named barriers. bar: shared address.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {  // release (default .release.cta)
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Waits for the completion of the phase of parity `parity` (acquire).
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nV6_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra V6_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The arrive-on of this thread's prior cp.async copies: counts one of the
// barrier's expected arrivals when they all completed (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Row orders (per 16 rows; see the NOTE at the top).
__device__ __forceinline__ int q_of_col(int n) {  // sigma: S^T column -> query
  return (n & ~15) + 4 * ((n >> 1) & 3) + 2 * ((n >> 3) & 1) + (n & 1);
}
__device__ __forceinline__ int k_of_row(int m) {  // tau: accumulator row -> key
  return (m & ~15) + 2 * (m & 7) + ((m >> 3) & 1);
}

// Fragment order of a per-column float array (v7, main kernel at d <= 128):
// column c = 16 J + 8 jb + 2 t + e is stored at 16 J + 4 t + 2 jb + e, so
// the two float2 a thread reads for accumulator columns 8 j + 2t + {0, 1} of
// j = 2J and 2J + 1 are one float4 (one LDS.128 instead of two LDS.64; the
// 8 lanes of a quad column broadcast, the 4 t read 64 distinct bytes).
// A permutation within each 16 columns: only where the floats are stored
// changes, every value and operation stays the same.
__device__ __forceinline__ int frag_pos(int c) { return (c & ~15) | ((c & 6) << 1) | ((c >> 2) & 2) | (c & 1); }
// The float4 of columns 8j + 2t + {0, 1} (.x, .y) and 8 (j + 1) + 2t + {0, 1}
// (.z, .w), j even, from a fragment-ordered array.
__device__ __forceinline__ float4 frag_ld4(const float* a, int j, int t) {
  return *reinterpret_cast<const float4*>(a + 8 * j + 4 * t);
}

constexpr int kTileBytes = kTile * kWgRowBytes;  // one swizzled [128][128 B] tile (config_sm90.h)

// ---- cp.async tile fills -------------------------------------------------------------

// Head-dim blocks (numerics.md section 2): D <= 128 is one block, 192 and 256
// two (128 + 64, 128 + 128). A row tile of ROWS rows keeps block b in its own
// [ROWS][128 B] swizzled tile at b * ROWS * 128 bytes.
template <int D>
constexpr int nb_of() { return D > 128 ? 2 : 1; }
template <int D, int B>
constexpr int bw_of() { return B == 0 ? (D < 128 ? D : 128) : D - 128; }

// Columns [C0, C0 + W) (one block) of rows [s0, s0 + ROWS) of a [S][LD] FP8
// matrix, row n of the tile <- source row s0 + perm(n) (perm = q_of_col or
// k_of_row); rows >= S zero-filled.
// NOTE: written as one base address per thread plus constant steps (the row
// step is a multiple of 16, which both permutations preserve); a generic loop
// made the compiler hoist every address out of the main loop (spills).
//   NT threads (tid in [0, NT)) share the copies (NOTE: tid unsigned, as
//   threadIdx.x: the row kernels' address arithmetic and registers unchanged): the 256 threads of the row
//   kernels (default), or a 128-thread producer warpgroup (tile kernels).
template <int LD, int C0, int W, bool kQueryOrder, int ROWS, int NT = kWgThreads>
__device__ __forceinline__ void cp_rows_blk(uint8_t* dst, const uint8_t* src, int s0, int S,
                                            unsigned tid = threadIdx.x) {
  constexpr int kChunks = W / 16, kStep = NT / kChunks;
  static_assert(kStep % 16 == 0 && ROWS % kStep == 0, "row steps keep the 16-row permutation");
  const int n = tid / kChunks, c = tid % kChunks;
  const int r0 = s0 + (kQueryOrder ? q_of_col(n) : k_of_row(n));
  uint8_t* d0 = dst + sw128(n, c);
  const uint8_t* g0 = src + C0 + 16 * c;
  if constexpr (NT == kWgThreads) {
#pragma unroll
    for (int k = 0; k < ROWS / kStep; ++k) {
      const int r = r0 + k * kStep;
      const bool ok = r < S;
      cp_async16(d0 + k * kStep * 128, g0 + static_cast<int64_t>(ok ? r : 0) * LD, ok);
    }
  } else {
    // NOTE: a rolled loop for the producer warpgroup of the `tile` kernels
    // (setmaxnreg: 24 registers; the unrolled addresses spilled there).
#pragma unroll 1
    for (int k = 0; k < ROWS / kStep; ++k) {
      const int r = r0 + k * kStep;
      const bool ok = r < S;
      cp_async16(d0 + k * kStep * 128, g0 + static_cast<int64_t>(ok ? r : 0) * LD, ok);
    }
  }
}
// All head-dim blocks of rows [s0, s0 + ROWS) of a [S][D] FP8 matrix.
template <int D, bool kQueryOrder, int ROWS, int NT = kWgThreads>
__device__ __forceinline__ void cp_rows(uint8_t* dst, const uint8_t* src, int s0, int S, unsigned tid = threadIdx.x) {
  cp_rows_blk<D, 0, bw_of<D, 0>(), kQueryOrder, ROWS, NT>(dst, src, s0, S, tid);
  if constexpr (nb_of<D>() > 1)
    cp_rows_blk<D, 128, bw_of<D, 1>(), kQueryOrder, ROWS, NT>(dst + ROWS * 128, src, s0, S, tid);
}
// Positions [s0, s0 + 128) of ROWS sequence-contiguous rows (stride ld): tile
// row = channel, natural position order. Chunks past S are zero-filled; a
// partial chunk reads the padding codes (0, kernel_params_sm90.h).
template <int ROWS, int NT = kWgThreads>
__device__ __forceinline__ void cp_cols(uint8_t* dst, const uint8_t* src, int64_t ld, int s0, int S,
                                        unsigned tid = threadIdx.x) {
  constexpr int kStep = NT / 8;
  static_assert(ROWS % kStep == 0 && kStep % 8 == 0, "whole row steps");
  const int r = tid / 8, c = tid % 8;
  const bool ok = s0 + 16 * c < S;
  uint8_t* d0 = dst + sw128(r, c);
  const uint8_t* g0 = src + r * ld + (ok ? s0 + 16 * c : 0);
  if constexpr (NT == kWgThreads) {
#pragma unroll
    for (int k = 0; k < ROWS / kStep; ++k) cp_async16(d0 + k * kStep * 128, g0 + k * kStep * ld, ok);
  } else {
#pragma unroll 1
    for (int k = 0; k < ROWS / kStep; ++k) cp_async16(d0 + k * kStep * 128, g0 + k * kStep * ld, ok);
  }
}
// n floats: dst[i] <- src[idx(i)] if valid(i) else 0.
template <class Idx, int NT = kWgThreads>
__device__ __forceinline__ void cp_floats(float* dst, const float* src, int n, Idx idx, int tid = threadIdx.x) {
  for (int i = tid; i < n; i += NT) {
    const int64_t j = idx(i);
    cp_async4(dst + i, src + (j >= 0 ? j : 0), j >= 0);
  }
}

// ---- masks of partial tile pairs -------------------------------------------------

// Masks of a tile pair that is not interior (TileGeom::interior), applied as a
// pass of their own after the unmasked element work (interior tiles, most of
// them, skip it; no per-element branches in the hot code):
//   P: 0 where the key is not visible or the query is past the sequence or
//   has LSE = -inf. sLse2 holds LSE * log2(e) (lse2_in_place; callers: the
//   pre-pass and the sliced main kernel, the d <= 128 main kernel uses
//   wg_mask_main); queries past the sequence are caught by tg.visible;
//   dS: 0 where the key is not visible (P = 0 there, but dP_hat may be NaN).
template <int NQ>
__device__ __forceinline__ void wg_mask_p(float (&s)[NQ / 8][4], const float* sLse2, const TileGeom& tg, int warp,
                                          int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j) {
    const float2 l = *reinterpret_cast<const float2*>(sLse2 + 8 * j + 2 * t);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = q_of_col(8 * j + 2 * t + (e & 1)), kl = k_of_row(warp * 16 + g + 8 * (e >> 1));
      const float lse2 = (e & 1) ? l.y : l.x;
      if (!(tg.visible(kl, ql) && lse2 != -INFINITY)) s[j][e] = 0.f;
    }
  }
}
template <int NQ>
__device__ __forceinline__ void wg_mask_vis(float (&s)[NQ / 8][4], const TileGeom& tg, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = q_of_col(8 * j + 2 * t + (e & 1)), kl = k_of_row(warp * 16 + g + 8 * (e >> 1));
      if (!tg.visible(kl, ql)) s[j][e] = 0.f;
    }
}

// After this thread's cp.async of LSE column i (< n) completed: LSE * log2(e)
// in place, -inf for queries past seqlen_q (the thread that copied it converts it).
__device__ __forceinline__ void lse2_in_place(float* sLse, int n, int m0, int Sq) {
  const int i = threadIdx.x;
  if (i < n) sLse[i] = m0 + q_of_col(i) < Sq ? __fmul_rn(sLse[i], kLog2e) : -INFINITY;
}

}  // namespace bwd
}  // namespace sm90
}  // namespace fp8attn
