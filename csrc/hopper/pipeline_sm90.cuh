// fp8attn: the sm_90a pipeline primitives of the `tile` kernels: mbarriers,
// TMA tile loads, named barriers, wgmma shared-memory descriptors and the
// E4M3 wgmma atoms (CuTe's sm90 GMMA structs, called with our registers),
// shared by the `tile` kernels and the `row` wgmma forward. No math here.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#if !__has_include(<cute/arch/mma_sm90_gmma.hpp>)
#error "fp8attn: CUTLASS/CuTe headers not found: run scripts/get_cutlass.sh (third_party/cutlass/include) or set FP8ATTN_CUTLASS_INCLUDE"
#endif
#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdint>
#include <utility>

namespace fp8attn {
namespace sm90 {
namespace pipe {

namespace gmma = cute::SM90::GMMA;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// ---- mbarriers ----------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "TS_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra TS_DONE;\n"
      "bra TS_WAIT;\n"
      "TS_DONE:\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// Generic-proxy shared-memory writes read next by wgmma / TMA (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- named barriers (id 0 is __syncthreads) -------------------------------------
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- TMA ---------------------------------------------------------------------------
// 3-D tile load global -> shared, completion counted on `bar` (bytes).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// ---- 32-bit shared-memory accesses (producer warps at 24 registers) -------------
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 x;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(addr) : "memory");
  return x;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 x) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w) : "memory");
}

// ---- wgmma ---------------------------------------------------------------------------
// Descriptor of a K-major shared tile whose rows are kRowBytes (= the swizzle
// span: 128 or 64) long, 8-row groups kRowBytes * 8 apart; `addr` may be
// advanced by 32 bytes per k32 step inside the row.
template <int kRowBytes>
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "128B or 64B swizzle");
  constexpr uint64_t kLayout = kRowBytes == 128 ? 1 : 2;  // B128 / B64
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
         (static_cast<uint64_t>((8 * kRowBytes) >> 4) << 32) | (kLayout << 62);
}

// The descriptor of addr + off: the start-address field advanced by off / 16
// (addr and off multiples of 16, addr + off inside shared memory, so no carry
// leaves the 14-bit field). NOTE: the base descriptor is encoded once and each
// k32 step adds a constant; re-encoding addr + off per wgmma (mask, shift, or,
// then R2UR of both words) cost ~8 instructions per wgmma in the tile forward's
// issue block (SASS, nvcc 13.0: 133 instructions for 8 wgmmas).
template <int kRowBytes>
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t off) {
  const uint64_t d = gmma_desc<kRowBytes>(addr);
  // 32-bit add on the low word (the high word, a constant, stays as it is).
  return (d & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(static_cast<uint32_t>(d) + (off >> 4));
}

template <int N>
struct E4m3Atom;
template <>
struct E4m3Atom<32> {  // S in n32 chunks (the `row` kernel's second head_dim block at d >= 192)
  using SS = gmma::MMA_64x32x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct E4m3Atom<64> {
  using SS = gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
  using RS = gmma::MMA_64x64x32_F32E4M3E4M3_RS_TN<>;
};
template <>
struct E4m3Atom<128> {
  using SS = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
  using RS = gmma::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;
};
template <>
struct E4m3Atom<256> {
  using RS = gmma::MMA_64x256x32_F32E4M3E4M3_RS_TN<>;
};

// d (+)= A * B over one k32 step, m64 x N, FP32 accumulators d[N / 2].
template <int N, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float (&d)[N / 2], bool acc, std::index_sequence<I...>) {
  E4m3Atom<N>::SS::fma(da, db, d[I]..., acc ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
template <int N, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float (&d)[N / 2], bool acc,
                                        std::index_sequence<I...>) {
  E4m3Atom<N>::RS::fma(a[0], a[1], a[2], a[3], db, d[I]..., acc ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}
__device__ __forceinline__ void wg_arrive() { cute::warpgroup_arrive(); }
__device__ __forceinline__ void wg_commit() { cute::warpgroup_commit_batch(); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  cute::warpgroup_wait<N>();
}

}  // namespace pipe
}  // namespace sm90
}  // namespace fp8attn
