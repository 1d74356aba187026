// Host tests of the CUDA path's shape rules, which are plain C++:
//   - kernel_head_dims (hopper/config_sm90.h): the instantiated kernel pair a
//     (head_dim_qk, head_dim_v) is zero-padded to, for every pair in [1, 256]^2;
//   - for_each_row_chunk, for_each_attn_chunk, at_chunk (hopper/launch_sm90.h):
//     the launches a grid of any batch x heads size is split into (y, z <=
//     65535), and the pointers each launch's kernel gets;
//   - query_tiles_of_key_tile, last_key_tile_of (hopper/kernel_params_sm90.h): the
//     `tile` backward's query tiles per key tile and the deterministic dQ's first
//     turn, against a brute-force scan for every small shape and window.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#include "hopper/config_sm90.h"
#include "hopper/launch_sm90.h"

namespace fp8attn {
namespace sm90 {
namespace {

// The instantiated pairs, written out independently of kKernelHeadDims.
const std::vector<std::pair<int, int>> kPairs = {{64, 64}, {128, 128}, {192, 128}, {256, 256}};

TEST(KernelHeadDims, EveryPairGetsTheCheapestCoveringKernel) {
  for (int dqk = 1; dqk <= 256; ++dqk) {
    for (int dv = 1; dv <= 256; ++dv) {
      const HeadDims k = kernel_head_dims(dqk, dv);
      ASSERT_TRUE(supported_head_dims(k.qk, k.v)) << dqk << "," << dv;
      ASSERT_GE(k.qk, dqk) << dqk << "," << dv;
      ASSERT_GE(k.v, dv) << dqk << "," << dv;
      // No instantiated pair that covers (dqk, dv) has less padded work.
      for (const auto& [pq, pv] : kPairs)
        if (pq >= dqk && pv >= dv) {
          ASSERT_LE(k.qk + k.v, pq + pv) << dqk << "," << dv;
        }
      // Padding keeps the head_dim blocks (numerics.md section 7): every true
      // channel is in the block of the same index (blocks of min(128, D)
      // channels from channel 0), so zero channels change no block's amax.
      for (int c = 0; c < dqk; ++c) ASSERT_EQ(c / dim_block(dqk), c / dim_block(k.qk)) << dqk << " " << c;
      for (int c = 0; c < dv; ++c) ASSERT_EQ(c / dim_block(dv), c / dim_block(k.v)) << dv << " " << c;
      if (supported_head_dims(dqk, dv)) {
        ASSERT_EQ(k.qk, dqk);  // no copy where a kernel exists
        ASSERT_EQ(k.v, dv);
      }
    }
  }
}

TEST(KernelHeadDims, Examples) {
  struct Case {
    int dqk, dv, kqk, kv;
  };
  const Case cases[] = {
      {8, 8, 64, 64},       {33, 33, 64, 64},     {64, 64, 64, 64},     {72, 72, 128, 128},
      {96, 64, 128, 128},   {64, 128, 128, 128},  {128, 64, 128, 128},  {100, 100, 128, 128},
      {136, 136, 256, 256}, {136, 128, 192, 128}, {160, 64, 192, 128},  {192, 128, 192, 128},
      {192, 192, 256, 256}, {128, 200, 256, 256}, {248, 248, 256, 256}, {256, 1, 256, 256},
  };
  for (const Case& c : cases) {
    const HeadDims k = kernel_head_dims(c.dqk, c.dv);
    EXPECT_EQ(k.qk, c.kqk) << c.dqk << "," << c.dv;
    EXPECT_EQ(k.v, c.kv) << c.dqk << "," << c.dv;
  }
}

TEST(KernelHeadDims, OutOfRangeHasNoKernel) {
  for (const auto& [dqk, dv] : std::vector<std::pair<int, int>>{{0, 64}, {64, 0}, {257, 64}, {64, 257}, {-1, 8}}) {
    const HeadDims k = kernel_head_dims(dqk, dv);
    EXPECT_EQ(k.qk, 0) << dqk << "," << dv;
    EXPECT_EQ(k.v, 0) << dqk << "," << dv;
  }
}

// ---- (b, h) row chunks of the quantization kernel ------------------------------

std::vector<RowChunk> row_chunks(int64_t batch, int64_t heads) {
  std::vector<RowChunk> out;
  for_each_row_chunk(batch, heads, [&](const RowChunk& c) { out.push_back(c); });
  return out;
}

TEST(RowChunks, OneLaunchWithinTheLimit) {
  for (const auto& [b, h] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {16, 8}, {65535, 1}, {1, 65535}, {3, 21845}}) {
    const auto c = row_chunks(b, h);
    ASSERT_EQ(c.size(), 1u) << b << "x" << h;
    EXPECT_EQ(c[0].b0, 0);
    EXPECT_EQ(c[0].h0, 0);
    EXPECT_EQ(c[0].nb, b);
    EXPECT_EQ(c[0].nh, h);
  }
}

TEST(RowChunks, LargeProblemsAreCoveredExactlyOnce) {
  for (const auto& [b, h] : std::vector<std::pair<int64_t, int64_t>>{
           {65536, 1}, {1, 65536}, {2, 35000}, {70000, 3}, {3, 131071}, {200000, 2}}) {
    const auto chunks = row_chunks(b, h);
    int64_t rows = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      const RowChunk& c = chunks[i];
      ASSERT_GE(c.nb, 1);
      ASSERT_GE(c.nh, 1);
      ASSERT_LE(c.nb * c.nh, 65535) << "gridDim.z";
      ASSERT_LE(c.b0 + c.nb, b);
      ASSERT_LE(c.h0 + c.nh, h);
      // The kernel maps z to (b, h) = divmod(z, nh) on chunk-local rows: a
      // chunk of several batch entries must hold all their heads.
      if (c.nb > 1) {
        ASSERT_EQ(c.nh, h);
        ASSERT_EQ(c.h0, 0);
      }
      for (size_t j = i + 1; j < chunks.size(); ++j) {
        const RowChunk& d = chunks[j];
        ASSERT_FALSE(c.b0 < d.b0 + d.nb && d.b0 < c.b0 + c.nb && c.h0 < d.h0 + d.nh && d.h0 < c.h0 + c.nh);
      }
      rows += c.nb * c.nh;
    }
    EXPECT_EQ(rows, b * h) << b << "x" << h;
  }
  EXPECT_TRUE(row_chunks(0, 5).empty());
  EXPECT_TRUE(row_chunks(5, 0).empty());
}

// ---- attention chunks ---------------------------------------------------------

KernelParams problem(int batch, int hq, int hkv, int sq, int sk, int dqk, int dv) {
  KernelParams p{};
  p.batch = batch;
  p.num_heads_q = hq;
  p.num_heads_kv = hkv;
  p.seqlen_q = sq;
  p.seqlen_k = sk;
  p.head_dim_qk = dqk;
  p.head_dim_v = dv;
  p.block_size = 128;
  p.seqlen_q_pad = (sq + 15) / 16 * 16;
  p.seqlen_k_pad = (sk + 15) / 16 * 16;
  return p;
}

std::vector<AttnChunk> attn_chunks(const KernelParams& p, GridHeads heads, int64_t per_head) {
  std::vector<AttnChunk> out;
  for_each_attn_chunk(p, heads, per_head, [&](const AttnChunk& c) { out.push_back(c); });
  return out;
}

struct Shape {
  int b, hq, hkv;
};
const Shape kShapes[] = {{1, 1, 1},      {2, 16, 4},     {70000, 2, 1}, {1, 70000, 70000}, {1, 70000, 7000},
                         {1, 70000, 1},  {3, 131072, 2}, {2, 65536, 1}, {65536, 65535, 65535}, {1, 131070, 65535}};

TEST(AttnChunks, QueryGridCoversEveryRowOnceWithTheKernelsGqaMap) {
  for (const Shape& sh : kShapes) {
    const KernelParams p = problem(sh.b, sh.hq, sh.hkv, 10, 10, 64, 64);
    const int64_t group = sh.hq / sh.hkv;
    const auto chunks = attn_chunks(p, GridHeads::kQuery, 1);
    int64_t rows = 0;
    std::map<std::pair<int64_t, int64_t>, int> starts;
    for (const AttnChunk& c : chunks) {
      ASSERT_GE(c.nb, 1);
      ASSERT_LE(c.nb, 65535);
      ASSERT_GE(c.nhq, 1);
      ASSERT_LE(c.nhq, 65535) << "gridDim.y";
      ASSERT_LE(c.b0 + c.nb, sh.b);
      ASSERT_LE(c.hq0 + c.nhq, sh.hq);
      // The kernel maps chunk-local query head h to kv head h / group; with the
      // kv pointers at hk0 that must be the global map.
      for (int64_t h : {int64_t{0}, c.nhq / 2, c.nhq - 1}) ASSERT_EQ(c.hk0 + h / group, (c.hq0 + h) / group);
      ASSERT_TRUE(starts.emplace(std::make_pair(c.b0, c.hq0), 1).second);
      rows += c.nb * c.nhq;
    }
    // Pairwise disjoint boxes inside the problem whose sizes add up to it:
    // every (b, hq) row exactly once.
    for (size_t i = 0; i < chunks.size(); ++i)
      for (size_t j = i + 1; j < chunks.size(); ++j) {
        const AttnChunk &x = chunks[i], &y = chunks[j];
        const bool overlap = x.b0 < y.b0 + y.nb && y.b0 < x.b0 + x.nb && x.hq0 < y.hq0 + y.nhq && y.hq0 < x.hq0 + x.nhq;
        ASSERT_FALSE(overlap) << i << " " << j;
      }
    EXPECT_EQ(rows, int64_t{sh.b} * sh.hq) << sh.b << "x" << sh.hq;
    if (sh.b <= 65535 && sh.hq <= 65535) {
      EXPECT_EQ(chunks.size(), 1u) << "a problem that fits is one launch";
    }
  }
}

TEST(AttnChunks, KvGridHoldsWholeGroups) {
  for (const Shape& sh : kShapes) {
    for (int64_t slices : {1, 2, 4}) {
      const KernelParams p = problem(sh.b, sh.hq, sh.hkv, 10, 10, 64, 64);
      const int64_t group = sh.hq / sh.hkv;
      int64_t kv_rows = 0;
      const auto chunks = attn_chunks(p, GridHeads::kKv, slices);
      for (size_t i = 0; i < chunks.size(); ++i)
        for (size_t j = i + 1; j < chunks.size(); ++j) {
          const AttnChunk &x = chunks[i], &y = chunks[j];
          ASSERT_FALSE(x.b0 < y.b0 + y.nb && y.b0 < x.b0 + x.nb && x.hk0 < y.hk0 + y.nhk && y.hk0 < x.hk0 + x.nhk);
        }
      for (const AttnChunk& c : chunks) {
        ASSERT_LE(c.nb, 65535);
        ASSERT_LE(c.nhk * slices, 65535) << "gridDim.y";
        ASSERT_EQ(c.hq0, c.hk0 * group);  // the main kernel loops over its kv heads' groups
        ASSERT_EQ(c.nhq, c.nhk * group);
        ASSERT_LE(c.hk0 + c.nhk, sh.hkv);
        kv_rows += c.nb * c.nhk;
      }
      EXPECT_EQ(kv_rows, int64_t{sh.b} * sh.hkv);
    }
  }
}

// Fake device addresses: only the arithmetic at_chunk does on them is checked.
template <class T>
T* fake(uint64_t base) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(base));
}

TEST(AttnChunks, AtChunkPointsEveryOperandAtTheChunksFirstRow) {
  for (const auto& [dqk, dv] : std::vector<std::pair<int, int>>{{64, 64}, {192, 128}, {256, 256}}) {
    KernelParams p = problem(5, 12, 3, 300, 200, dqk, dv);
    const int64_t Hq = 12, Hk = 3, Sq = 300, Sk = 200, Sqp = p.seqlen_q_pad, Skp = p.seqlen_k_pad;
    const int64_t nbd_qk = (dqk + 127) / 128, nbd_v = (dv + 127) / 128, nbq = 3, nbk = 2;
    uint64_t next = uint64_t{1} << 40;
    auto base = [&] { return next += uint64_t{1} << 36; };
    p.q = fake<const void>(base());
    p.k = fake<const void>(base());
    p.v = fake<const void>(base());
    p.o = fake<const void>(base());
    p.dout = fake<const void>(base());
    // strided [b, s, h, d] BF16 inputs (flash layout for q, SDPA layout for k)
    p.q_sb = Sq * Hq * dqk, p.q_ss = Hq * dqk, p.q_sh = dqk;
    p.k_sb = Hk * Sk * dqk, p.k_ss = dqk, p.k_sh = Sk * dqk;
    p.v_sb = Hk * Sk * dv, p.v_ss = dv, p.v_sh = Sk * dv;
    p.o_sb = Hq * Sq * dv, p.o_ss = dv, p.o_sh = Sq * dv;
    p.do_sb = Sq * Hq * dv, p.do_ss = Hq * dv, p.do_sh = dv;
    p.out = fake<void>(base());
    p.dq = fake<void>(base());
    p.dk = fake<void>(base());
    p.dv = fake<void>(base());
    p.lse = fake<float>(base());
    p.q_row = fake<uint8_t>(base());
    p.k_row = fake<uint8_t>(base());
    p.v_row = fake<uint8_t>(base());
    p.do_row = fake<uint8_t>(base());
    p.v_colT = fake<uint8_t>(base());
    p.k_colT = fake<uint8_t>(base());
    p.q_colT = fake<uint8_t>(base());
    p.do_colT = fake<uint8_t>(base());
    p.q_row_s = fake<float>(base());
    p.k_row_s = fake<float>(base());
    p.v_row_s = fake<float>(base());
    p.do_row_s = fake<float>(base());
    p.v_col_s = fake<float>(base());
    p.k_col_s = fake<float>(base());
    p.q_col_s = fake<float>(base());
    p.do_col_s = fake<float>(base());
    p.delta = fake<float>(base());
    p.delta_dm = fake<float>(base());
    p.dq_accum = fake<float>(base());
    p.diag = fake<float>(base());
    p.rowsum_ws = fake<float>(base());

    const AttnChunk c{2, 3, 4, 8, 1, 2};  // batch 2..4, query heads 4..11 = kv heads 1..2 (group 4)
    const KernelParams r = at_chunk(p, c);
    auto addr = [](const void* ptr) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)); };
    const int64_t n_rows = 5 * Hq * Sq;
    // The kernels' index formulas (kernel_params_sm90.h) at chunk-local (b, h)
    // on the chunk's pointers == at global (b0 + b, hq0 + h) on the problem's.
    for (int64_t b = 0; b < c.nb; ++b) {
      for (int64_t h = 0; h < c.nhq; ++h) {
        const int64_t hk = h / 4, gb = c.b0 + b, gh = c.hq0 + h, ghk = c.hk0 + hk;
        const int64_t lq = b * Hq + h, gq = gb * Hq + gh, lk = b * Hk + hk, gk = gb * Hk + ghk;
        EXPECT_EQ(addr(r.q) + 2 * (b * p.q_sb + h * p.q_sh), addr(p.q) + 2 * (gb * p.q_sb + gh * p.q_sh));
        EXPECT_EQ(addr(r.o) + 2 * (b * p.o_sb + h * p.o_sh), addr(p.o) + 2 * (gb * p.o_sb + gh * p.o_sh));
        EXPECT_EQ(addr(r.dout) + 2 * (b * p.do_sb + h * p.do_sh), addr(p.dout) + 2 * (gb * p.do_sb + gh * p.do_sh));
        EXPECT_EQ(addr(r.k) + 2 * (b * p.k_sb + hk * p.k_sh), addr(p.k) + 2 * (gb * p.k_sb + ghk * p.k_sh));
        EXPECT_EQ(addr(r.v) + 2 * (b * p.v_sb + hk * p.v_sh), addr(p.v) + 2 * (gb * p.v_sb + ghk * p.v_sh));
        EXPECT_EQ(addr(r.out) + 2 * lq * Sq * dv, addr(p.out) + 2 * gq * Sq * dv);
        EXPECT_EQ(addr(r.dq) + 2 * lq * Sq * dqk, addr(p.dq) + 2 * gq * Sq * dqk);
        EXPECT_EQ(addr(r.dk) + 2 * lk * Sk * dqk, addr(p.dk) + 2 * gk * Sk * dqk);
        EXPECT_EQ(addr(r.dv) + 2 * lk * Sk * dv, addr(p.dv) + 2 * gk * Sk * dv);
        EXPECT_EQ(addr(r.lse + lq * Sq), addr(p.lse + gq * Sq));
        EXPECT_EQ(addr(r.delta + lq * Sq), addr(p.delta + gq * Sq));
        EXPECT_EQ(addr(r.delta_dm + lq * Sq), addr(p.delta_dm + gq * Sq));
        EXPECT_EQ(addr(r.dq_accum + lq * Sq * dqk), addr(p.dq_accum + gq * Sq * dqk));
        for (int plane = 0; plane < 4; ++plane) {
          EXPECT_EQ(addr(r.diag + plane * n_rows + lq * Sq), addr(p.diag + plane * n_rows + gq * Sq));
          EXPECT_EQ(addr(r.rowsum_ws + plane * n_rows + lq * Sq), addr(p.rowsum_ws + plane * n_rows + gq * Sq));
        }
        EXPECT_EQ(addr(r.q_row + lq * Sq * dqk), addr(p.q_row + gq * Sq * dqk));
        EXPECT_EQ(addr(r.q_row_s + lq * Sq * nbd_qk), addr(p.q_row_s + gq * Sq * nbd_qk));
        EXPECT_EQ(addr(r.do_row + lq * Sq * dv), addr(p.do_row + gq * Sq * dv));
        EXPECT_EQ(addr(r.do_row_s + lq * Sq * nbd_v), addr(p.do_row_s + gq * Sq * nbd_v));
        EXPECT_EQ(addr(r.k_row + lk * Sk * dqk), addr(p.k_row + gk * Sk * dqk));
        EXPECT_EQ(addr(r.k_row_s + lk * Sk * nbd_qk), addr(p.k_row_s + gk * Sk * nbd_qk));
        EXPECT_EQ(addr(r.v_row + lk * Sk * dv), addr(p.v_row + gk * Sk * dv));
        EXPECT_EQ(addr(r.v_row_s + lk * Sk * nbd_v), addr(p.v_row_s + gk * Sk * nbd_v));
        EXPECT_EQ(addr(r.q_colT + lq * dqk * Sqp), addr(p.q_colT + gq * dqk * Sqp));
        EXPECT_EQ(addr(r.q_col_s + lq * dqk * nbq), addr(p.q_col_s + gq * dqk * nbq));
        EXPECT_EQ(addr(r.do_colT + lq * dv * Sqp), addr(p.do_colT + gq * dv * Sqp));
        EXPECT_EQ(addr(r.do_col_s + lq * dv * nbq), addr(p.do_col_s + gq * dv * nbq));
        EXPECT_EQ(addr(r.k_colT + lk * dqk * Skp), addr(p.k_colT + gk * dqk * Skp));
        EXPECT_EQ(addr(r.k_col_s + lk * dqk * nbk), addr(p.k_col_s + gk * dqk * nbk));
        EXPECT_EQ(addr(r.v_colT + lk * dv * Skp), addr(p.v_colT + gk * dv * Skp));
        EXPECT_EQ(addr(r.v_col_s + lk * dv * nbk), addr(p.v_col_s + gk * dv * nbk));
      }
    }
    // Sizes and strides are the problem's (they are the kernels' strides).
    EXPECT_EQ(r.batch, p.batch);
    EXPECT_EQ(r.num_heads_q, p.num_heads_q);
    EXPECT_EQ(r.num_heads_kv, p.num_heads_kv);
    // The first chunk of a problem is the problem itself, pointer for pointer.
    const KernelParams z = at_chunk(p, AttnChunk{0, 5, 0, 12, 0, 3});
    EXPECT_EQ(z.q_row, p.q_row);
    EXPECT_EQ(z.q, p.q);
    EXPECT_EQ(z.diag, p.diag);
  }
}

int64_t addr_of(const void* ptr) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)); }

// scaling = 1 (`tile`): the scale arrays are one per row ([B, H, S]) or per
// 128-token tile ([B, H, nblk]) over all of head_dim, and dq_accum has
// dq_accum_rows(1, S) rows per (b, h) (kernel_params_sm90.h).
TEST(AttnChunks, AtChunkTileScaleLayouts) {
  for (const auto& [dqk, dv] : std::vector<std::pair<int, int>>{{64, 64}, {192, 128}, {256, 256}}) {
    KernelParams p = problem(5, 12, 3, 300, 200, dqk, dv);
    p.scaling = 1;
    const int64_t Hq = 12, Hk = 3, Sq = 300, nbq = 3, nbk = 2, Skp = p.seqlen_k_pad;
    uint64_t next = uint64_t{1} << 40;
    auto base = [&] { return next += uint64_t{1} << 36; };
    float** scales[] = {&p.q_row_s, &p.do_row_s, &p.k_row_s, &p.v_row_s, &p.q_col_s, &p.do_col_s, &p.k_col_s, &p.v_col_s};
    for (float** s : scales) *s = fake<float>(base());
    p.k_row = fake<uint8_t>(base());
    p.v_colT = fake<uint8_t>(base());
    p.dq_accum = fake<float>(base());
    // dq_accum: 64-query chunks, seqlen_q 300 padded to 320 rows per (b, h).
    const int64_t dq_rows = dq_accum_rows(1, Sq);
    EXPECT_EQ(dq_rows, 320);
    EXPECT_EQ(dq_accum_rows(0, Sq), Sq);
    const AttnChunk c{2, 3, 4, 8, 1, 2};
    const KernelParams r = at_chunk(p, c);
    for (int64_t b = 0; b < c.nb; ++b)
      for (int64_t h = 0; h < c.nhq; ++h) {
        const int64_t hk = h / 4, gb = c.b0 + b, gh = c.hq0 + h, ghk = c.hk0 + hk;
        const int64_t lq = b * Hq + h, gq = gb * Hq + gh, lk = b * Hk + hk, gk = gb * Hk + ghk;
        EXPECT_EQ(addr_of(r.q_row_s + lq * Sq), addr_of(p.q_row_s + gq * Sq));
        EXPECT_EQ(addr_of(r.do_row_s + lq * Sq), addr_of(p.do_row_s + gq * Sq));
        EXPECT_EQ(addr_of(r.q_col_s + lq * nbq), addr_of(p.q_col_s + gq * nbq));
        EXPECT_EQ(addr_of(r.do_col_s + lq * nbq), addr_of(p.do_col_s + gq * nbq));
        EXPECT_EQ(addr_of(r.k_row_s + lk * nbk), addr_of(p.k_row_s + gk * nbk));
        EXPECT_EQ(addr_of(r.v_row_s + lk * nbk), addr_of(p.v_row_s + gk * nbk));
        EXPECT_EQ(addr_of(r.k_col_s + lk * nbk), addr_of(p.k_col_s + gk * nbk));
        EXPECT_EQ(addr_of(r.v_col_s + lk * nbk), addr_of(p.v_col_s + gk * nbk));
        EXPECT_EQ(addr_of(r.k_row + lk * 200 * dqk), addr_of(p.k_row + gk * 200 * dqk));  // codes unchanged
        EXPECT_EQ(addr_of(r.dq_accum + lq * dq_rows * dqk), addr_of(p.dq_accum + gq * dq_rows * dqk));
        EXPECT_EQ(addr_of(r.v_colT + lk * dv * Skp), addr_of(p.v_colT + gk * dv * Skp));
      }
  }
}

TEST(AttnChunks, NullPointersStayNull) {
  KernelParams p = problem(70000, 1, 1, 10, 10, 64, 64);  // e.g. the forward: no backward operands
  p.q_row = fake<uint8_t>(uint64_t{1} << 40);
  const KernelParams r = at_chunk(p, AttnChunk{65535, 4465, 0, 1, 0, 1});
  EXPECT_EQ(addr_of(r.q_row) - addr_of(p.q_row), int64_t{65535} * 10 * 64);
  EXPECT_EQ(r.dq_accum, nullptr);
  EXPECT_EQ(r.diag, nullptr);
  EXPECT_EQ(r.dout, nullptr);
}

TEST(AttnChunks, LaunchAttnChunksGrids) {
  const KernelParams p = problem(3, 70000, 7000, 10, 10, 64, 64);
  std::vector<std::vector<unsigned>> grids;
  launch_attn_chunks(p, 9, GridHeads::kQuery, 1, "test",
                     [&](const KernelParams&, unsigned x, unsigned y, unsigned z, const AttnChunk&) {
                       grids.push_back({x, y, z});
                     });
  // 70000 query heads in whole groups of 10: 65530 + 4470, batch 3.
  ASSERT_EQ(grids.size(), 2u);
  EXPECT_EQ(grids[0], (std::vector<unsigned>{9, 65530, 3}));
  EXPECT_EQ(grids[1], (std::vector<unsigned>{9, 4470, 3}));
  EXPECT_THROW(launch_attn_chunks(p, int64_t{1} << 31, GridHeads::kQuery, 1, "test",
                                  [](const KernelParams&, unsigned, unsigned, unsigned, const AttnChunk&) {}),
               std::invalid_argument);
}

// Every (seqlen_q, seqlen_k) in [1, 40]^2 with tiles of 4 (and of 128 at a few
// lengths), every window of {-1, 0, 1, 2, 5, 17}^2: the key tiles whose query tiles
// hold query tile m are contiguous, end at last_key_tile_of(m), and their query
// tiles move forward with the key tile (the deterministic dQ turns rely on all three;
// a wrong last tile leaves turn 0 to no CTA: a hang).
void check_key_tiles(int tile, int sq, int sk, int left, int right) {
  const int nq = (sq + tile - 1) / tile, nk = (sk + tile - 1) / tile;
  // Brute force from the rows: key tile n holds query tile m iff a query of m sees a key of n.
  auto holds = [&](int n, int m) {
    for (int i = m * tile; i < std::min(sq, m * tile + tile); ++i)
      for (int j = n * tile; j < std::min(sk, n * tile + tile); ++j) {
        const int off = sk - sq;
        if ((right < 0 || j <= i + off + right) && (left < 0 || j >= i + off - left)) return true;
      }
    return false;
  };
  int prev_first = -1, prev_end = -1;
  bool seen_nonempty = false;
  for (int n = 0; n < nk; ++n) {
    const IndexRange r = query_tiles_of_key_tile(n, tile, sq, sk, left, right);
    for (int m = 0; m < nq; ++m)
      ASSERT_EQ(r.begin <= m && m < r.end, holds(n, m)) << tile << " " << sq << " " << sk << " " << left << " "
                                                        << right << " n=" << n << " m=" << m;
    if (r.end > r.begin) {
      ASSERT_GE(r.begin, prev_first);
      ASSERT_GE(r.end, prev_end);
      prev_first = r.begin, prev_end = r.end;
      seen_nonempty = true;
    } else {
      ASSERT_FALSE(seen_nonempty) << "an empty key tile after a non-empty one: " << sq << " " << sk << " " << left
                                  << " " << right << " n=" << n;
    }
  }
  for (int m = 0; m < nq; ++m) {
    int lo = -1, hi = -1;
    for (int n = 0; n < nk; ++n)
      if (holds(n, m)) {
        if (lo < 0) lo = n;
        ASSERT_TRUE(hi < 0 || hi == n - 1) << "key tiles of query tile " << m << " not contiguous";
        hi = n;
      }
    if (lo >= 0) {
      ASSERT_EQ(last_key_tile_of(m, tile, nk, sq, sk, left, right), hi)
          << tile << " " << sq << " " << sk << " " << left << " " << right << " m=" << m;
    }
  }
}

TEST(DeterministicTurns, KeyTilesOfAQueryTileAreContiguousAndEndAtLastKeyTile) {
  const int windows[] = {-1, 0, 1, 2, 5, 17};
  for (int sq = 1; sq <= 40; ++sq)
    for (int sk = 1; sk <= 40; ++sk)
      for (int left : windows)
        for (int right : windows) check_key_tiles(4, sq, sk, left, right);
  const int lens[] = {1, 64, 127, 128, 129, 300, 700, 900};
  const int wins[] = {-1, 0, 5, 30, 100, 128, 300};
  for (int sq : lens)
    for (int sk : lens)
      for (int left : wins)
        for (int right : wins) check_key_tiles(128, sq, sk, left, right);
}

}  // namespace
}  // namespace sm90
}  // namespace fp8attn
