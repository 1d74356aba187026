// fp8attn: launch grids of any batch x heads size for the sm_90a kernels.
//
// gridDim.y and gridDim.z are limited to 65535 (gridDim.x to 2^31 - 1). The
// attention kernels' grids are (tiles along the sequence, heads, batch): the
// forward and the pre-passes put query heads on y, the backward main kernels
// kv heads x output slices. A problem with more than 65535 batch entries or
// heads runs as several launches ("chunks"), each on a KernelParams whose
// pointers start at the chunk's first (batch, head) (at_chunk): the kernels
// themselves are unchanged, index (batch, head) from blockIdx as always, and
// the common case (everything <= 65535) is one launch on the caller's
// KernelParams, CTA for CTA what it always was.
//
// The quantization kernel's grid is (sequence blocks, head_dim blocks,
// batch * heads): its (b, h) rows are chunked the same way, whole batch
// entries (or pieces of one entry's heads) per launch (for_each_row_chunk).
//
// Plain C++ (no CUDA types), so tests/cpp checks the chunking on the host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "hopper/config_sm90.h"
#include "hopper/kernel_params_sm90.h"

namespace fp8attn {
namespace sm90 {

constexpr int64_t kMaxGridX = 2147483647;  // gridDim.x
constexpr int64_t kMaxGridYZ = 65535;      // gridDim.y, gridDim.z

// ---- chunks of the (b, h) rows of one operand (the quantization kernel) --------

// Batch entries [b0, b0 + nb) x heads [h0, h0 + nh) of one launch whose grid
// has nb * nh <= 65535 on z: whole batch entries (h0 = 0, nh = heads) when
// heads <= 65535, else pieces of one batch entry's heads (nb = 1).
struct RowChunk {
  int64_t b0, nb, h0, nh;
};

// Calls f(chunk) for launches covering batch x heads exactly once; one call
// with the whole (batch, heads) when batch * heads <= 65535.
template <class F>
void for_each_row_chunk(int64_t batch, int64_t heads, F&& f) {
  if (batch <= 0 || heads <= 0) return;
  if (heads <= kMaxGridYZ) {
    const int64_t step = kMaxGridYZ / heads;
    for (int64_t b0 = 0; b0 < batch; b0 += step) f(RowChunk{b0, std::min(step, batch - b0), 0, heads});
  } else {
    for (int64_t b0 = 0; b0 < batch; ++b0)
      for (int64_t h0 = 0; h0 < heads; h0 += kMaxGridYZ) f(RowChunk{b0, 1, h0, std::min(kMaxGridYZ, heads - h0)});
  }
}

// ---- chunks of an attention problem (forward, pre-passes, backward main) ------

// Batch entries [b0, b0 + nb), query heads [hq0, hq0 + nhq), kv heads
// [hk0, hk0 + nhk) of one launch. Either the chunk holds whole GQA groups
// (hq0 = hk0 * group, nhq = nhk * group) or it is part of one group's query
// heads (nhk = 1, hq0 in [hk0 * group, (hk0 + 1) * group)): in both cases the
// kernels' own GQA map hk = hq / group on chunk-local indices is the global
// one minus hk0.
struct AttnChunk {
  int64_t b0, nb, hq0, nhq, hk0, nhk;
};

// Which heads a kernel puts on gridDim.y: query heads (forward, pre-passes) or
// kv heads times `y_per_head` output slices (backward main kernels).
enum class GridHeads { kQuery, kKv };

// Calls f(chunk) for launches that cover batch x heads of p exactly once, each
// with nb <= 65535 and a y extent (nhq, or nhk * y_per_head) <= 65535; one
// call with the whole problem when it fits. Throws std::invalid_argument when
// y_per_head > 65535.
template <class F>
void for_each_attn_chunk(const KernelParams& p, GridHeads heads, int64_t y_per_head, F&& f) {
  const int64_t B = p.batch, Hq = p.num_heads_q, Hk = p.num_heads_kv;
  if (B <= 0 || Hq <= 0 || Hk <= 0) return;
  const int64_t group = Hq / Hk;
  if (y_per_head < 1 || y_per_head > kMaxGridYZ)
    throw std::invalid_argument("fp8attn: for_each_attn_chunk: y_per_head must be in [1, 65535]");
  for (int64_t b0 = 0; b0 < B; b0 += kMaxGridYZ) {
    const int64_t nb = std::min(kMaxGridYZ, B - b0);
    if (heads == GridHeads::kKv) {
      const int64_t step = kMaxGridYZ / y_per_head;  // kv heads per launch
      for (int64_t hk0 = 0; hk0 < Hk; hk0 += step) {
        const int64_t nhk = std::min(step, Hk - hk0);
        f(AttnChunk{b0, nb, hk0 * group, nhk * group, hk0, nhk});
      }
    } else if (group <= kMaxGridYZ) {
      const int64_t step = kMaxGridYZ / group;  // whole groups per launch
      for (int64_t hk0 = 0; hk0 < Hk; hk0 += step) {
        const int64_t nhk = std::min(step, Hk - hk0);
        f(AttnChunk{b0, nb, hk0 * group, nhk * group, hk0, nhk});
      }
    } else {
      // A group of more than 65535 query heads: its query heads in pieces.
      for (int64_t hk0 = 0; hk0 < Hk; ++hk0)
        for (int64_t j = 0; j < group; j += kMaxGridYZ)
          f(AttnChunk{b0, nb, hk0 * group + j, std::min(kMaxGridYZ, group - j), hk0, 1});
    }
  }
}

namespace detail {
template <class T>
void adv(T*& ptr, int64_t n) {
  if (ptr != nullptr) ptr += n;
}
// n BF16 elements past a void pointer.
inline void adv_bf16(const void*& ptr, int64_t n) {
  if (ptr != nullptr) ptr = static_cast<const uint16_t*>(ptr) + n;
}
inline void adv_bf16(void*& ptr, int64_t n) {
  if (ptr != nullptr) ptr = static_cast<uint16_t*>(ptr) + n;
}
}  // namespace detail

// p with every pointer advanced to the chunk's first (batch, head). The
// kernels index (b, h) rows as b * num_heads + h with chunk-local b, h, so the
// head counts stay the full ones (they are the strides), and p.batch stays
// the full batch (the [4, B, Hq, Sq] diagnostics planes are B * Hq * Sq
// apart). Layouts: kernel_params_sm90.h (p.scaling picks the scale layouts of
// the `row` or `tile` recipe); head_dim_qk / head_dim_v are the kernel's.
// NOTE: every per-(batch, head) pointer of KernelParams must be advanced here. A
// pointer added without it reads / writes the first chunk's rows from every chunk
// (lse_bwd, 2026-12-02: the tile split-launch test's dQ off by 23x). The size check
// makes adding a field stop here: update the list, then the size. (delta_given /
// prepass_sums, 2026-12-03: flags, no pointers; a given delta lives in `delta`.
// window_left / window_right, 2026-12-07: ints, no pointers. num_seqs ..
// varlen_meta, 2026-12-07: a packed batch is never chunked, below. softcap,
// 2026-12-07: a float in the padding after `scaling`, the size unchanged.
// tile_pds_rows, 2026-12-07: 480 -> 488, gone with the tile v6 kernel: 480.
// dq_sem, 2026-12-07: 480 -> 488, advanced below.)
static_assert(sizeof(KernelParams) == 488 || sizeof(void*) != 8,
              "KernelParams changed: advance its new per-(batch, head) pointers in at_chunk, then update this size");
inline KernelParams at_chunk(const KernelParams& p, const AttnChunk& c) {
  if (c.b0 == 0 && c.hq0 == 0 && c.hk0 == 0) return p;
  // NOTE: a packed batch's layouts are not [B, H, ...] per (batch, head) in every
  // array (token-major outputs); its launcher keeps the heads <= 65535 (one chunk).
  if (p.num_seqs > 0)
    throw std::invalid_argument("fp8attn: at_chunk: a packed (varlen) batch runs as one launch (heads <= 65535)");
  KernelParams r = p;
  const int64_t Hq = p.num_heads_q, Hk = p.num_heads_kv, Sq = p.seqlen_q, Sk = p.seqlen_k;
  const int64_t Dqk = p.head_dim_qk, Dv = p.head_dim_v;
  const int64_t nbd_qk = (Dqk + 127) / 128, nbd_v = (Dv + 127) / 128;  // head_dim blocks (config_sm90.h)
  const int64_t nbq = (Sq + p.block_size - 1) / p.block_size, nbk = (Sk + p.block_size - 1) / p.block_size;
  const int64_t rq = c.b0 * Hq + c.hq0, rk = c.b0 * Hk + c.hk0;  // first (b, h) row, query / kv side
  using detail::adv;
  using detail::adv_bf16;
  // BF16 inputs, strided [b, s, h, d] (a size-1 dim has stride 0, and then its offset is 0).
  adv_bf16(r.q, c.b0 * p.q_sb + c.hq0 * p.q_sh);
  adv_bf16(r.o, c.b0 * p.o_sb + c.hq0 * p.o_sh);
  adv_bf16(r.dout, c.b0 * p.do_sb + c.hq0 * p.do_sh);
  adv_bf16(r.k, c.b0 * p.k_sb + c.hk0 * p.k_sh);
  adv_bf16(r.v, c.b0 * p.v_sb + c.hk0 * p.v_sh);
  // BF16 outputs, contiguous [B, H, S, D].
  adv_bf16(r.out, rq * Sq * Dv);
  adv_bf16(r.dq, rq * Sq * Dqk);
  adv_bf16(r.dk, rk * Sk * Dqk);
  adv_bf16(r.dv, rk * Sk * Dv);
  // Per-row FP32 [B, Hq, Sq] (the planes of diag / rowsum_ws are B * Hq * Sq apart).
  adv(r.lse, rq * Sq);
  adv(r.delta, rq * Sq);
  adv(r.delta_dm, rq * Sq);
  adv(r.lse_bwd, rq * Sq);
  adv(r.diag, rq * Sq);
  adv(r.rowsum_ws, rq * Sq);
  adv(r.dq_accum, rq * dq_accum_rows(p.scaling, Sq) * Dqk);
  // Deterministic turns [B, Hq, ceil(Sq / 64), slices] (kernel_params_sm90.h dq_sem).
  adv(r.dq_sem, rq * ((Sq + 63) / 64) * bwdts::slices(p.head_dim_qk, p.head_dim_v));
  // Row-blocked codes [B, H, S, D] and scales [B, H, S, nblk(D)] (`tile`: [B, H, S] per
  // token for Q / dO, [B, H, nblk_k] per tile for K / V).
  const bool tile = p.scaling == 1;
  adv(r.q_row, rq * Sq * Dqk);
  adv(r.q_row_s, tile ? rq * Sq : rq * Sq * nbd_qk);
  adv(r.do_row, rq * Sq * Dv);
  adv(r.do_row_s, tile ? rq * Sq : rq * Sq * nbd_v);
  adv(r.k_row, rk * Sk * Dqk);
  adv(r.k_row_s, tile ? rk * nbk : rk * Sk * nbd_qk);
  adv(r.v_row, rk * Sk * Dv);
  adv(r.v_row_s, tile ? rk * nbk : rk * Sk * nbd_v);
  // Column-blocked transposed codes [B, H, D, S_pad] and scales [B, H, D, nblk_s]
  // (`tile`: [B, H, nblk_s], one per tile).
  adv(r.q_colT, rq * Dqk * p.seqlen_q_pad);
  adv(r.q_col_s, tile ? rq * nbq : rq * Dqk * nbq);
  adv(r.do_colT, rq * Dv * p.seqlen_q_pad);
  adv(r.do_col_s, tile ? rq * nbq : rq * Dv * nbq);
  adv(r.k_colT, rk * Dqk * p.seqlen_k_pad);
  adv(r.k_col_s, tile ? rk * nbk : rk * Dqk * nbk);
  adv(r.v_colT, rk * Dv * p.seqlen_k_pad);
  adv(r.v_col_s, tile ? rk * nbk : rk * Dv * nbk);
  return r;
}

// The grid extents (y, z) of a chunk: y = query heads or kv heads x y_per_head.
inline unsigned chunk_grid_y(const AttnChunk& c, GridHeads heads, int64_t y_per_head) {
  return static_cast<unsigned>(heads == GridHeads::kQuery ? c.nhq : c.nhk * y_per_head);
}

// Runs launch(params, x, y, z) once per chunk of p (for_each_attn_chunk),
// params = at_chunk(p, chunk), x = gx tiles along the sequence. Throws
// std::invalid_argument (naming `what`) when gx exceeds 2^31 - 1.
template <class F>
void launch_attn_chunks(const KernelParams& p, int64_t gx, GridHeads heads, int64_t y_per_head, const char* what,
                        F&& launch) {
  if (gx <= 0) return;
  if (gx > kMaxGridX)
    throw std::invalid_argument(std::string("fp8attn: ") + what + ": " + std::to_string(gx) +
                                " sequence tiles exceed the launch grid's x limit (2^31 - 1)");
  for_each_attn_chunk(p, heads, y_per_head, [&](const AttnChunk& c) {
    launch(at_chunk(p, c), static_cast<unsigned>(gx), chunk_grid_y(c, heads, y_per_head),
           static_cast<unsigned>(c.nb), c);
  });
}

}  // namespace sm90
}  // namespace fp8attn
