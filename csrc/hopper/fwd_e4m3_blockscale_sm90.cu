// fp8attn: entry point of the sm_90a FP8 forward of the `row` recipe
// (numerics.md sections 2-3, matmuls #1 and #2): run_fwd checks the arguments
// and the FP8ATTN_FWD_KERNEL knob, then runs the wgmma kernel
// (fwd_wgmma_e4m3_blockscale_sm90.cu). Contract: fwd_e4m3_blockscale_sm90.h.
//
// NOTE: the mma.sync m16n8k32 forward kernel that this file held (the first
// CUDA forward, 2026-11-29) and its FP8ATTN_FWD_KERNEL=mma / FP8ATTN_FWD_WARPS
// knobs were removed on 2026-12-07: the wgmma kernel serves every head-dim
// pair it did (docs/kernels/fwd_e4m3_blockscale_sm90.md; code at f7729f9).
#include "hopper/fwd_e4m3_blockscale_sm90.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/env_choice.h"
#include "hopper/config_sm90.h"
#include "hopper/fwd_wgmma_e4m3_blockscale_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace {

[[noreturn]] void bad(const char* field, const std::string& what) {
  throw std::invalid_argument(std::string("fp8attn: run_fwd: '") + field + "': " + what);
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

}  // namespace

void run_fwd(const KernelParams& p, cudaStream_t stream) {
  if (p.block_size != kSeqBlock) bad("block_size", "must be 128, got " + std::to_string(p.block_size));
  if (p.seqlen_q < 1 || p.seqlen_k < 1) bad("seqlen", "seqlen_q and seqlen_k must be >= 1");
  if (p.num_heads_kv < 1 || p.num_heads_q % p.num_heads_kv != 0)
    bad("num_heads_kv", "num_heads_q must be a multiple of num_heads_kv");
  if (p.batch < 1 || p.num_heads_q < 1 || static_cast<int64_t>(p.batch) * p.num_heads_q > 2147483647)
    bad("batch", "batch and num_heads_q must be >= 1 with batch * num_heads_q < 2^31");
  if (p.seqlen_k_pad < p.seqlen_k || p.seqlen_k_pad % kSeqPad != 0)
    bad("seqlen_k_pad", "must be a multiple of 16 and >= seqlen_k");
  // NOTE: FP8ATTN_FWD_KERNEL picks the wgmma kernel's consumer schedule at
  // head_dim_qk <= 128 (run_fwd_wgmma; read on every call, so one process can
  // benchmark several). A misspelt value would silently benchmark / test the
  // default schedule, so it is checked here, before the kernel runs.
  env_choice("FP8ATTN_FWD_KERNEL", {"wgmma", "wgmma_serial", "wgmma_overlap", "wgmma_pingpong", "wgmma_serial3"});
  const int d = p.head_dim_qk, dv = p.head_dim_v;
  if (!supported_head_dims(d, dv))
    bad("head_dim", "(head_dim_qk, head_dim_v) must be (64,64), (128,128), (256,256) or (192,128), got (" +
                        std::to_string(d) + "," + std::to_string(dv) + ")");
  // The wgmma kernel reads Q, K and V^T codes through TMA: 16-byte aligned
  // bases (the op's own allocations always are, csrc/torch/ops_cuda.cpp).
  if (!aligned16(p.q_row)) bad("q_row", "must be 16-byte aligned");
  if (!aligned16(p.k_row)) bad("k_row", "must be 16-byte aligned");
  if (!aligned16(p.v_colT)) bad("v_colT", "must be 16-byte aligned");
  run_fwd_wgmma(p, stream);
}

}  // namespace sm90
}  // namespace fp8attn
