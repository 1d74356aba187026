// fp8attn: the sm_90a forward of the `tile` scaling recipe, assembled from
// its parts (../shared/design/kernel-layout.md):
//   pipeline_sm90.cuh                 mbarriers, TMA, named barriers, wgmma atoms
//   scheduler_sm90.cuh                work tile of a CTA, sequence lengths
//   mainloop_fwd_tilescale_sm90.cuh   producer (TMA, V^T permutation) and consumer loops
//   softmax_tilescale_sm90.cuh        the online softmax with the folded per-row scales
//   epilogue_fwd_sm90.cuh             O / l -> BF16, LSE
// This file: the kernel (register split, producer / consumer branch), tensor
// maps, launch, instantiations. Contract: fwd_tilescale_e4m3_sm90.h; math:
// numerics.md section 9; notes: docs/kernels/fwd_tilescale_e4m3_sm90.md.
#include "hopper/fwd_tilescale_e4m3_sm90.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/env_choice.h"
#include "common/error.h"
#include "hopper/config_sm90.h"
#include "hopper/launch_sm90.h"
#include "hopper/mainloop_fwd_tilescale_sm90.cuh"
#include "hopper/tma_map_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace {

// kPersistent: the CTA computes the work tiles blockIdx.x, + gridDim.x, ... of
// the n_m x n_h x n_b tiles of its launch (scheduler_sm90.cuh); otherwise one
// work tile per CTA from blockIdx (n_m, n_h, n_b unused). kVarlen: a packed
// batch (varlen_sm90.h): the query tiles are the padded tiles of all
// sequences (n_m = q_tiles_max, n_b = 1), each tile's sequence from the
// metadata; a tile no sequence owns is an empty work tile (no rows, no keys).
// kSoftcap: logit softcapping, p.softcap > 0 (numerics.md section 12;
// instantiated for the dense default order only, launch_schedule).
template <int kD, int kDv, bool kPingpong, bool kPersistent, bool kVarlen, bool kSoftcap = false>
__global__ void __launch_bounds__(fwdt::kThreads, 1)
    fwd_tilescale_kernel(const __grid_constant__ KernelParams p, const __grid_constant__ CUtensorMap tm_q0,
                         const __grid_constant__ CUtensorMap tm_q1, const __grid_constant__ CUtensorMap tm_k0,
                         const __grid_constant__ CUtensorMap tm_k1, const __grid_constant__ CUtensorMap tm_v, int n_m,
                         int n_h, int n_b) {
  using T = FwdTileTraits<kD, kDv>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024u - (pipe::smem_u32(smem_raw) & 1023u)) & 1023u);
  const uint32_t sbase = pipe::smem_u32(smem);
  const uint32_t bar = sbase + T::kOffBar;

  // A padded query tile no sequence owns (one CTA per tile): the whole CTA
  // leaves at once (the persistent order runs such tiles as empty work tiles).
  if constexpr (kVarlen && !kPersistent) {
    if (varlen_qtile_seq(p, tile_of().m_tile) < 0) return;
  }
  if (threadIdx.x == 0) tile_init_bars<T::kStages>(bar);
  __syncthreads();

  const int64_t n_work = kPersistent ? static_cast<int64_t>(n_m) * n_h * n_b : 1;
  const int64_t step = kPersistent ? gridDim.x : 1;
  // One work tile: where its rows and keys are, which key tiles it streams
  // ([kt0, kt1): those any of its rows' windows touch).
  struct Work {
    SeqInfo si;
    int q0, kt0, kt1;
    int64_t bhq, bhk;
  };
  auto work_at = [&](int64_t L) {
    WorkTile w = kPersistent ? work_tile_at(L, n_m, n_h, n_b) : tile_of();
    Work r;
    if constexpr (kVarlen) {
      const int s = varlen_qtile_seq(p, w.m_tile);
      r.si = varlen_seq_info(p, s);
      w.m_tile -= static_cast<int>(r.si.row_q / T::kBlockM);  // the sequence's own tile index
    } else {
      r.si = seq_info(p, w.batch);
    }
    const int hk = w.head_q / (p.num_heads_q / p.num_heads_kv);
    r.q0 = w.m_tile * T::kBlockM;
    r.bhq = static_cast<int64_t>(w.batch) * p.num_heads_q + w.head_q;
    r.bhk = static_cast<int64_t>(w.batch) * p.num_heads_kv + hk;
    const IndexRange kt = key_tiles_seen(r.q0, r.q0 + T::kBlockM, r.si, p, T::kBlockN);
    r.kt0 = kt.begin;
    r.kt1 = kt.end;
    return r;
  };
  const int64_t L0 = kPersistent ? blockIdx.x : 0;

  if (threadIdx.x < 128) {
    // ================= producer warpgroup =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(fwdt::kProducerRegs));
    int kb = 0, it = 0;
    for (int64_t L = L0; L < n_work; L += step, ++it) {
      const Work wk = work_at(L);
      fwd_tile_producer<T>(sbase, bar, static_cast<int>(wk.si.row_q) + wk.q0, static_cast<int>(wk.si.row_k), wk.kt0,
                           wk.kt1, static_cast<int>(wk.bhq), static_cast<int>(wk.bhk), &tm_q0, &tm_q1, &tm_k0, &tm_k1,
                           &tm_v, kb, it);
      kb += wk.kt1 - wk.kt0;
    }
    return;
  }
  // ================= consumer warpgroups =================
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(fwdt::kConsumerRegs));
  int kb = 0, it = 0;
  for (int64_t L = L0; L < n_work; L += step, ++it) {
    const Work wk = work_at(L);
    fwd_tile_consumer<T, kPingpong, kVarlen, kSoftcap>(p, wk.si, sbase, bar, wk.q0, wk.kt0, wk.kt1, wk.bhq, wk.bhk, kb, it, it == 0,
                                    L + step >= n_work);
    kb += wk.kt1 - wk.kt0;
  }
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("fp8attn: run_fwd_tile: " + what); }

// (b, h) rows of the query / kv side from a chunk's first row to the end: the
// TMA maps' outermost extent (the kernel's bhq / bhk are chunk-local).
uint64_t rows_q(const KernelParams& p, const AttnChunk& c) {
  return static_cast<uint64_t>(p.batch * static_cast<int64_t>(p.num_heads_q) - (c.b0 * p.num_heads_q + c.hq0));
}
uint64_t rows_kv(const KernelParams& p, const AttnChunk& c) {
  return static_cast<uint64_t>(p.batch * static_cast<int64_t>(p.num_heads_kv) - (c.b0 * p.num_heads_kv + c.hk0));
}

// SMs of the current device (the persistent grid).
int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    fail("cannot read the device's multiprocessor count");
  return n;
}

template <int kD, int kDv, bool kPingpong, bool kPersistent, bool kVarlen, bool kSoftcap = false>
void launch(const KernelParams& p, cudaStream_t stream) {
  using T = FwdTileTraits<kD, kDv>;
  auto kernel = fwd_tilescale_kernel<kD, kDv, kPingpong, kPersistent, kVarlen, kSoftcap>;
  const int64_t sms = kPersistent ? sm_count() : 0;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) fail(std::string("cudaFuncSetAttribute failed: ") + cudaGetErrorString(err));
  // NOTE: one launch unless batch or num_heads_q exceed 65535 (launch_sm90.h;
  // a packed batch is one launch: its heads are checked <= 65535). Varlen: one
  // query tile per padded tile of all sequences (varlen_sm90.h).
  const int64_t n_m = kVarlen ? p.q_tiles_max : (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  launch_attn_chunks(
      p, n_m, GridHeads::kQuery, 1, "run_fwd_tile",
      [&](const KernelParams& pc, unsigned gx, unsigned gy, unsigned gz, const AttnChunk& c) {
        using tma::make_map_u8;
        using tma::swizzle_of;
        const uint64_t bhq = rows_q(p, c), bhk = rows_kv(p, c);
        // NOTE: one map per head_dim chunk: a box row must be one swizzle span
        // (128 bytes; the second chunk of d = 192 is 64). The maps of chunk 1
        // are unused (a copy of chunk 0's) when there is one chunk.
        const CUtensorMap tm_q0 =
            make_map_u8(pc.q_row, kD, code_rows_q(p), bhq, T::kW0, T::kBlockM, swizzle_of(T::kW0), "q_row");
        const CUtensorMap tm_k0 =
            make_map_u8(pc.k_row, kD, code_rows_k(p), bhk, T::kW0, T::kBlockN, swizzle_of(T::kW0), "k_row");
        CUtensorMap tm_q1 = tm_q0, tm_k1 = tm_k0;
        if (T::kChunks == 2) {
          tm_q1 = make_map_u8(pc.q_row, kD, code_rows_q(p), bhq, T::kW1, T::kBlockM, swizzle_of(T::kW1), "q_row (chunk 1)");
          tm_k1 = make_map_u8(pc.k_row, kD, code_rows_k(p), bhk, T::kW1, T::kBlockN, swizzle_of(T::kW1), "k_row (chunk 1)");
        }
        const CUtensorMap tm_v =
            make_map_u8(pc.v_colT, p.seqlen_k_pad, kDv, bhk, T::kBlockN, kDv, CU_TENSOR_MAP_SWIZZLE_128B, "v_colT");
        // NOTE: persistent: one CTA per SM (the register split allows one),
        // fewer when the launch has fewer work tiles.
        const dim3 grid = kPersistent ? dim3(static_cast<unsigned>(std::min<int64_t>(
                                                 sms, static_cast<int64_t>(gx) * gy * gz)))
                                      : dim3(gx, gy, gz);
        kernel<<<grid, fwdt::kThreads, T::kSmemBytes, stream>>>(pc, tm_q0, tm_q1, tm_k0, tm_k1, tm_v,
                                                                static_cast<int>(gx), static_cast<int>(gy),
                                                                static_cast<int>(gz));
        const cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) fail(std::string("launch failed: ") + cudaGetErrorString(e));
      });
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <int kD, int kDv>
void launch_schedule(const KernelParams& p, cudaStream_t stream) {
  // NOTE: FP8ATTN_TILE_PINGPONG=0|1 picks the order at dv <= 128 (default: the
  // kernel notes' measured choice, kTilePingpongDefault; a bad value throws
  // std::invalid_argument, ValueError in Python); dv = 256 is serial.
  // FP8ATTN_TILE_PERSISTENT=0|1 likewise picks the scheduler (default
  // fwdt::kTilePersistentDefault, off until measured; scheduler_sm90.cuh).
  const int pp_env = env_choice("FP8ATTN_TILE_PINGPONG", {"0", "1"});
  const int ps_env = env_choice("FP8ATTN_TILE_PERSISTENT", {"0", "1"});
  const bool pp = pp_env < 0 ? fwdt::kTilePingpongDefault : pp_env == 1;
  const bool ps = ps_env < 0 ? fwdt::kTilePersistentDefault : ps_env == 1;
  // Softcap (numerics.md section 12): one instantiation per head_dim, the
  // dense default order (the knobs above are read, so a bad value still
  // throws, but a softcap call ignores them; run_fwd_tile refuses a packed
  // batch with softcap).
  if (p.softcap > 0.f) {
    constexpr bool kPp = fwdt::kTilePingpongDefault && FwdTileTraits<kD, kDv>::kOverlap;
    return launch<kD, kDv, kPp, fwdt::kTilePersistentDefault, false, true>(p, stream);
  }
  // A packed batch (varlen_sm90.h): the same choices, kVarlen instantiations
  // (the dense kernels stay free of the metadata reads).
  if (p.num_seqs > 0) {
    if constexpr (FwdTileTraits<kD, kDv>::kOverlap) {
      if (pp) return ps ? launch<kD, kDv, true, true, true>(p, stream) : launch<kD, kDv, true, false, true>(p, stream);
    }
    return ps ? launch<kD, kDv, false, true, true>(p, stream) : launch<kD, kDv, false, false, true>(p, stream);
  }
  if constexpr (FwdTileTraits<kD, kDv>::kOverlap) {
    if (pp) return ps ? launch<kD, kDv, true, true, false>(p, stream) : launch<kD, kDv, true, false, false>(p, stream);
  }
  return ps ? launch<kD, kDv, false, true, false>(p, stream) : launch<kD, kDv, false, false, false>(p, stream);
}

}  // namespace

bool fwd_tile_supported(const KernelParams& p) {
  return p.block_size == kSeqBlock && supported_head_dims(p.head_dim_qk, p.head_dim_v) && aligned16(p.q_row) &&
         aligned16(p.k_row) && aligned16(p.v_colT) && p.seqlen_k_pad % kSeqPad == 0 && p.scaling == 1 && p.q_row_s != nullptr &&
         p.k_row_s != nullptr && p.v_col_s != nullptr;
}

void run_fwd_tile(const KernelParams& p, cudaStream_t stream) {
  if (!fwd_tile_supported(p)) fail("unsupported configuration (see fwd_tile_supported)");
  if (p.num_seqs > 0 && (p.batch != 1 || p.varlen_meta == nullptr || p.num_heads_q > 65535 || p.q_tiles_max <= 0 ||
                         p.seqlen_q_pad != int64_t{p.q_tiles_max} * kSeqBlock ||
                         p.seqlen_k_pad != int64_t{p.k_tiles_max} * kSeqBlock))
    fail("a packed batch needs batch 1, its metadata, heads <= 65535 and seqlen_*_pad = *_tiles_max * 128");
  // Softcap: dense batches only (varlen_attention runs a packed batch with
  // softcap per sequence, python/fp8attn/varlen.py); c finite and > 0.
  if (p.softcap != 0.f && (p.num_seqs > 0 || !(p.softcap > 0.f) || !(p.softcap <= 3.4e38f)))
    fail("softcap needs a dense batch and a finite c > 0 (got " + format_float(p.softcap) + ")");
  if (p.batch == 0 || p.num_heads_q == 0 || p.seqlen_q == 0) return;
  if (p.head_dim_qk == 64) return launch_schedule<64, 64>(p, stream);
  if (p.head_dim_qk == 128) return launch_schedule<128, 128>(p, stream);
  if (p.head_dim_qk == 192) return launch_schedule<192, 128>(p, stream);
  return launch_schedule<256, 256>(p, stream);
}

}  // namespace sm90
}  // namespace fp8attn
