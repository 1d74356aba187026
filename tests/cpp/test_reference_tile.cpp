// Tests of the CPU reference's `tile` FP8 recipe (Scaling::kTile,
// numerics.md section 9):
//   - bit-level agreement with a slow, literal emulation of the recipe written
//     here from the contract (every block decoded with quantize_block, masked
//     entries zeroed before quantizing, no tiling tricks);
//   - error against the exact path within the FP8 budget and within 1.05x of
//     the `row` recipe's, on Gaussian and on training-shaped inputs;
//   - the P (#5) and dS (#7) blocks of T/2 queries, shown against whole
//     query tiles, and the P / dS blocks of #5 / #7 and the dS (#6) blocks
//     of T/2 keys, shown against whole key tiles, on inputs where they differ;
//   - the Delta-Matching row-sum invariant, shown against the stale delta.
// GQA, fully masked rows and the NaN rules run for both recipes in
// test_reference_common.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_codec.h"
#include "quant/block_quant.h"
#include "reference/attention_ref.h"
#include "test_util.h"

namespace fp8attn {
namespace {

using namespace testutil;

constexpr float kInfF = INFINITY;

// Decoded values (x_hat * s) of one block, any length.
std::vector<float> decoded(const std::vector<float>& block, Fp8Format fmt) {
  std::vector<float> out(block.size());
  if (!block.empty())
    quantize_block(block.data(), static_cast<int64_t>(block.size()), 1, fmt, nullptr, out.data());
  return out;
}

// Over x in [0, n), by brute force: the first x with seen(x) (n if none), and one
// past the last (the first if none).
template <class Seen>
int64_t first_seen(int64_t n, Seen seen) {
  for (int64_t x = 0; x < n; ++x)
    if (seen(x)) return x;
  return n;
}
template <class Seen>
int64_t end_seen(int64_t n, Seen seen) {
  for (int64_t x = n; x > 0; --x)
    if (seen(x - 1)) return x;
  return first_seen(n, seen);
}

AttnParams tile_params(const Problem& pr, DeltaMode mode, int B, Fp8Format gf) {
  AttnParams p = pr.params(Precision::kFP8, mode, B, gf);
  p.scaling = Scaling::kTile;
  return p;
}

// The `tile` recipe of numerics.md section 9, literally: Q and dO (#3, #4)
// one block per query row (all of head_dim); K and V one block per tile of T
// keys (all of head_dim), restricted to the keys the row sees; P (forward)
// one block per (row, key tile); dS (#6) one block per (row, key half of T/2
// keys), one dQ partial per half in key order; P (#5) and dS (#7) one block
// per (query sub-tile of T/2 queries, key half of T/2 keys) over the rows of
// the sub-tile that see the key column, one partial per sub-tile in
// increasing order; Q (#7) and dO (#5) one block per tile of T queries over
// the rows of the tile that see the key column (all of head_dim). Sub-tiles
// and halves start at the tile's first query / key.
// pds_rows: the query rows of the #5 / #7 P and dS blocks, T/2 by the
// contract; pds_rows = T gives whole query tiles (one sub-tile per query
// tile), the blocking the sub-tile test shows the reference does not use.
// pds_keys: the keys of the #5 / #7 P and dS blocks and of the #6 dS blocks,
// T/2 by the contract; pds_keys = T gives whole key tiles (the blocking
// before the key halves), which the key-half test shows the reference does
// not use.
Emulated emulate_tile(const Problem& pr, const Inputs& in, int64_t T, Fp8Format gf,
                      DeltaMode mode, int64_t pds_rows = 0, int64_t pds_keys = 0) {
  const int64_t Sq = pr.Sq, Sk = pr.Sk, Hq = pr.Hq, Hkv = pr.Hkv, d = pr.d, dv = pr.dv,
                G = Hq / Hkv;
  const int64_t H = pds_rows > 0 ? pds_rows : T / 2;   // query sub-tile
  const int64_t KH = pds_keys > 0 ? pds_keys : T / 2;  // key half
  const float tau = static_cast<float>(pr.tau());
  const Fp8Format e4 = Fp8Format::kE4M3;
  auto qb = [&](int64_t b, int64_t i, int64_t h) { return ((b * Sq + i) * Hq + h) * d; };
  auto kb = [&](int64_t b, int64_t j, int64_t h) { return ((b * Sk + j) * Hkv + h) * d; };
  auto vb = [&](int64_t b, int64_t j, int64_t h) { return ((b * Sk + j) * Hkv + h) * dv; };
  auto ob = [&](int64_t b, int64_t i, int64_t h) { return ((b * Sq + i) * Hq + h) * dv; };
  // The keys row i sees, [kfirst(i), kend(i)) (a contiguous range by the mask's
  // definition; the test checks it), and the rows that see key j, [qfirst(j), qend(j)).
  auto kfirst = [&](int64_t i) { return first_seen(Sk, [&](int64_t j) { return pr.sees(i, j); }); };
  auto kend = [&](int64_t i) { return end_seen(Sk, [&](int64_t j) { return pr.sees(i, j); }); };
  auto nvis = [&](int64_t i) {
    int64_t n = 0;
    for (int64_t j = 0; j < Sk; ++j) n += pr.sees(i, j);
    EXPECT_EQ(n, kend(i) - kfirst(i)) << "row " << i << " sees a non-contiguous key set";
    return n;
  };
  auto qfirst = [&](int64_t j) { return first_seen(Sq, [&](int64_t i) { return pr.sees(i, j); }); };
  auto qend = [&](int64_t j) { return end_seen(Sq, [&](int64_t i) { return pr.sees(i, j); }); };
  // Rows [r0, r1) x w of x (base(r) = index of row r), decoded as one block.
  auto block = [](const std::vector<double>& x, auto base, int64_t r0, int64_t r1, int64_t w,
                  Fp8Format fmt) {
    std::vector<float> v;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < w; ++c) v.push_back(static_cast<float>(x[base(r) + c]));
    return decoded(v, fmt);
  };
  Emulated e;
  e.o.assign(pr.B * Sq * Hq * dv, 0.0);
  e.dq.assign(pr.B * Sq * Hq * d, 0.0);
  e.dk.assign(pr.B * Sk * Hkv * d, 0.0);
  e.dv.assign(pr.B * Sk * Hkv * dv, 0.0);
  e.delta.assign(pr.B * Hq * Sq, 0.f);
  e.eps = e.pre = e.post = e.delta;
  std::vector<float> o32(e.o.size(), 0.f), lse32(pr.B * Hq * Sq, -kInfF);

  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      auto kbase = [&](int64_t j) { return kb(b, j, hk); };
      auto vbase = [&](int64_t j) { return vb(b, j, hk); };
      // The K / V block of the key tile starting at t0 that row i reads: its visible
      // keys [max(t0, kfirst), min(t0 + T, kend)).
      auto kv_block = [&](int64_t i, int64_t t0, bool is_k) {
        const int64_t j0 = std::max(t0, kfirst(i)), j1 = std::min(t0 + T, kend(i));
        return is_k ? block(in.k, kbase, j0, j1, d, e4) : block(in.v, vbase, j0, j1, dv, e4);
      };
      std::vector<float> dk_acc(Sk * d, 0.f), dv_acc(Sk * dv, 0.f);
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        const int64_t lrow = (b * Hq + h) * Sq;
        auto qbase = [&](int64_t i) { return qb(b, i, h); };
        auto obase = [&](int64_t i) { return ob(b, i, h); };
        std::vector<std::vector<float>> qrow(Sq), dorow(Sq);
        for (int64_t i = 0; i < Sq; ++i) {
          qrow[i] = block(in.q, qbase, i, i + 1, d, e4);
          dorow[i] = block(in.dout, obase, i, i + 1, dv, gf);
        }
        // S of row i for the visible keys of the tile starting at t0 (the first of them
        // is key max(t0, kfirst(i))): one FP32 sum over head_dim.
        auto logits = [&](int64_t i, int64_t t0) {
          const std::vector<float> kd = kv_block(i, t0, true);
          const int64_t L = static_cast<int64_t>(kd.size()) / d;
          std::vector<float> s(L);
          for (int64_t j = 0; j < L; ++j) {
            float acc = 0.f;
            for (int64_t c = 0; c < d; ++c) acc += qrow[i][c] * kd[j * d + c];
            s[j] = acc * tau;
          }
          return s;
        };
        // Forward: online softmax over key tiles of T.
        for (int64_t i = 0; i < Sq; ++i) {
          const int64_t n = nvis(i);
          if (n == 0) continue;
          float m = -kInfF, l = 0.f;
          std::vector<float> acc(dv, 0.f);
          for (int64_t j0 = kfirst(i) / T * T; j0 < kend(i); j0 += T) {
            const std::vector<float> s = logits(i, j0);
            const int64_t L = static_cast<int64_t>(s.size());
            float tmax = -kInfF;
            for (float x : s) tmax = std::max(tmax, x);
            const float m_new = std::max(m, tmax), alpha = std::exp(m - m_new);
            std::vector<float> p(L);
            float tsum = 0.f;
            for (int64_t j = 0; j < L; ++j) {
              p[j] = std::exp(s[j] - m_new);
              tsum += p[j];
            }
            l = l * alpha + tsum;
            if (m_new != m)
              for (float& a : acc) a *= alpha;
            m = m_new;
            const std::vector<float> pd = decoded(p, e4), vd = kv_block(i, j0, false);
            for (int64_t c = 0; c < dv; ++c) {
              float part = 0.f;
              for (int64_t j = 0; j < L; ++j) part += pd[j] * vd[j * dv + c];
              acc[c] += part;
            }
          }
          for (int64_t c = 0; c < dv; ++c) o32[ob(b, i, h) + c] = acc[c] / l;
          lse32[lrow + i] = m + std::log(l);
        }
        // Backward rows: P, dP_hat, delta, dS, dQ (#3, #4, #6).
        std::vector<std::vector<float>> P(Sq, std::vector<float>(Sk, 0.f)), dS = P;
        for (int64_t i = 0; i < Sq; ++i) {
          const int64_t n = nvis(i);
          if (n == 0) continue;
          const int64_t kf = kfirst(i), ke = kend(i), tf = kf / T * T;
          std::vector<float> dP(Sk, 0.f);
          float dm = 0.f;
          for (int64_t t0 = tf; t0 < ke; t0 += T) {
            const int64_t j0 = std::max(t0, kf);  // the tile's first visible key
            const std::vector<float> s = logits(i, t0), vd = kv_block(i, t0, false);
            for (int64_t j = 0; j < static_cast<int64_t>(s.size()); ++j) {
              P[i][j0 + j] = std::exp(s[j] - lse32[lrow + i]);
              float acc = 0.f;
              for (int64_t c = 0; c < dv; ++c) acc += dorow[i][c] * vd[j * dv + c];
              dP[j0 + j] = acc;
            }
          }
          float l = 0.f;
          for (int64_t j = kf; j < ke; ++j) {
            l += P[i][j];
            dm += P[i][j] * dP[j];
          }
          // numerics.md section 4, backward-consistent LSE: delta over the row
          // sum of P; Delta-Matching's P from LSE + ln l.
          if (l > 0.f) {
            dm /= l;
            if (mode == DeltaMode::kDeltaMatching) {
              const float lse_b = lse32[lrow + i] + std::log(l);
              for (int64_t t0 = tf; t0 < ke; t0 += T) {
                const int64_t j0 = std::max(t0, kf);
                const std::vector<float> s = logits(i, t0);
                for (int64_t j = 0; j < static_cast<int64_t>(s.size()); ++j) P[i][j0 + j] = std::exp(s[j] - lse_b);
              }
            }
          }
          float delta = dm;
          if (mode != DeltaMode::kDeltaMatching) {
            delta = 0.f;
            for (int64_t c = 0; c < dv; ++c) {
              const float dO = mode == DeltaMode::kStale
                                   ? static_cast<float>(in.dout[ob(b, i, h) + c])
                                   : dorow[i][c];
              delta += dO * o32[ob(b, i, h) + c];
            }
          }
          double ps = 0, pa = 0, qs = 0, qa = 0;
          for (int64_t j = kf; j < ke; ++j) {
            dS[i][j] = P[i][j] * (dP[j] - delta);
            ps += dS[i][j];
            pa += std::fabs(dS[i][j]);
          }
          std::vector<float> acc(d, 0.f);
          for (int64_t t0 = tf; t0 < ke; t0 += T) {
            const int64_t j0 = std::max(t0, kf);  // kd's first key
            const std::vector<float> kd = kv_block(i, t0, true);
            // key halves [t0, t0 + KH), [t0 + KH, t0 + T): their visible keys [h0, h1)
            for (int64_t u0 = t0; u0 < std::min(Sk, t0 + T); u0 += KH) {
              const int64_t h0 = std::max(u0, kf), h1 = std::min(std::min(Sk, u0 + KH), ke);
              if (h0 >= h1) continue;
              const std::vector<float> dsd =
                  decoded(std::vector<float>(dS[i].begin() + h0, dS[i].begin() + h1), gf);
              for (float x : dsd) {
                qs += x;
                qa += std::fabs(x);
              }
              for (int64_t c = 0; c < d; ++c) {
                float part = 0.f;
                for (int64_t j = h0; j < h1; ++j) part += dsd[j - h0] * kd[(j - j0) * d + c];
                acc[c] += part;
              }
            }
          }
          for (int64_t c = 0; c < d; ++c) e.dq[qb(b, i, h) + c] = acc[c] * tau;
          e.delta[lrow + i] = delta;
          e.eps[lrow + i] = delta - dm;
          e.pre[lrow + i] = n >= 2 && pa > 0 ? static_cast<float>(std::fabs(ps) / pa) : 0.f;
          e.post[lrow + i] = n >= 2 && qa > 0 ? static_cast<float>(std::fabs(qs) / qa) : 0.f;
        }
        // Backward columns: dV (#5), dK (#7), per (query sub-tile, key half).
        for (int64_t i0 = 0; i0 < Sq; i0 += T) {
          const int64_t i1 = std::min(Sq, i0 + T);
          for (int64_t t0 = 0; t0 < Sk; t0 += T) {
            const int64_t t1 = std::min(Sk, t0 + T);
            for (int64_t j0 = t0; j0 < t1; j0 += KH) {  // key halves [j0, j1) of tile [t0, t1)
              const int64_t j1 = std::min(t1, j0 + KH);
              for (int64_t j = j0; j < j1; ++j) {
                const int64_t vq = std::max(i0, qfirst(j)), vq1 = std::min(i1, qend(j));
                if (vq >= vq1) continue;
                // The dO and Q blocks: rows [vq, vq1) of the query tile, all of head_dim.
                const std::vector<float> dod = block(in.dout, obase, vq, vq1, dv, gf),
                                         qd = block(in.q, qbase, vq, vq1, d, e4);
                for (int64_t s0 = i0; s0 < i1; s0 += H) {  // query sub-tiles [s0, s1)
                  const int64_t s1 = std::min(std::min(i1, s0 + H), vq1), v0 = std::max(s0, vq);
                  if (v0 >= s1) continue;
                  // The P and dS blocks: rows [v0, s1) (those of the sub-tile that see
                  // key j) x keys [j0, j1), masked entries 0.
                  std::vector<float> pb, sb;
                  for (int64_t i = v0; i < s1; ++i)
                    for (int64_t jj = j0; jj < j1; ++jj) {
                      pb.push_back(P[i][jj]);
                      sb.push_back(dS[i][jj]);
                    }
                  const std::vector<float> pd = decoded(pb, e4), sd = decoded(sb, gf);
                  const int64_t w = j1 - j0;
                  for (int64_t c = 0; c < dv; ++c) {
                    float part = 0.f;
                    for (int64_t i = v0; i < s1; ++i)
                      part += pd[(i - v0) * w + j - j0] * dod[(i - vq) * dv + c];
                    dv_acc[j * dv + c] += part;
                  }
                  for (int64_t c = 0; c < d; ++c) {
                    float part = 0.f;
                    for (int64_t i = v0; i < s1; ++i)
                      part += sd[(i - v0) * w + j - j0] * qd[(i - vq) * d + c];
                    dk_acc[j * d + c] += part;
                  }
                }
              }
            }
          }
        }
      }
      for (int64_t j = 0; j < Sk; ++j) {
        for (int64_t c = 0; c < d; ++c) e.dk[kb(b, j, hk) + c] = dk_acc[j * d + c] * tau;
        for (int64_t c = 0; c < dv; ++c) e.dv[vb(b, j, hk) + c] = dv_acc[j * dv + c];
      }
    }
  e.o.assign(o32.begin(), o32.end());
  e.lse.assign(lse32.begin(), lse32.end());
  return e;
}

// The reference against emulate_tile (test_util.h's expect_reference_matches).
void expect_matches_emulation(const Problem& pr, int64_t T, Fp8Format gf, DeltaMode mode,
                              uint32_t seed, int spread = 0) {
  expect_reference_matches(pr, tile_params(pr, mode, static_cast<int>(T), gf), seed, spread,
                           [&](const Inputs& in) { return emulate_tile(pr, in, T, gf, mode); });
}

TEST(ReferenceFp8Tile, MatchesLiteralEmulationOfTheRecipe) {
  Problem pr = emulation_problem();  // GQA: two query heads per kv head
  // Causal with seqlen_q > seqlen_k (fully masked rows) and < seqlen_k,
  // lengths not multiples of the tile.
  pr.causal = true;
  pr.Sq = 100;
  pr.Sk = 75;
  expect_matches_emulation(pr, 32, Fp8Format::kE4M3, DeltaMode::kDeltaMatching, 1);
  // Wide dynamic range: blocks quantized from the visible part differ from
  // whole tiles here (FP8-subnormal elements).
  expect_matches_emulation(pr, 32, Fp8Format::kE4M3, DeltaMode::kDeltaMatching, 6, 12);
  pr.Sq = 70;
  pr.Sk = 133;
  expect_matches_emulation(pr, 64, Fp8Format::kE5M2, DeltaMode::kStale, 2);
  expect_matches_emulation(pr, 64, Fp8Format::kE4M3, DeltaMode::kMatchedDO, 7, 12);
  expect_matches_emulation(pr, 128, Fp8Format::kE4M3, DeltaMode::kDeltaMatching, 8, 12);
  // Non-causal; head_dim 192 and 130 (one block over all of head_dim).
  pr.causal = false;
  pr.Sq = 40;
  pr.Sk = 150;
  pr.d = 192;
  pr.dv = 130;
  expect_matches_emulation(pr, 128, Fp8Format::kE4M3, DeltaMode::kDeltaMatching, 4);
  pr.d = 3;  // tiny head dims
  pr.dv = 1;
  pr.causal = true;
  expect_matches_emulation(pr, 32, Fp8Format::kE4M3, DeltaMode::kStale, 5);
}

// Sliding windows: test_util.h's cases (every partially visible tile shape, rows
// that see no key, every delta mode, a wide dynamic range).
TEST(ReferenceFp8Tile, MatchesLiteralEmulationWithSlidingWindows) {
  for_each_window_emulation_case(expect_matches_emulation);
}

// The block tests' problem: T = 128, one query tile of 128 queries, two key tiles,
// d = dv = 16, one head, non-causal.
Problem block_test_problem() {
  return Problem{.B = 1, .Sq = 128, .Sk = 256, .Hq = 1, .Hkv = 1, .d = 16, .dv = 16};
}

// The runs of the block tests on BF16 inputs (Delta-Matching, E4M3 gradients, tile
// T): the exact path (FP64 outputs), the reference's `tile` recipe (FP32 outputs),
// emulate_tile with the contract's blocks and with larger ones (pds_rows / pds_keys).
// Checks the reference's outputs equal the contract's emulation.
struct BlockRuns {
  RefOutputs ex, r;
  Emulated contract, larger;
};
BlockRuns run_block_test(const Problem& pr, const Inputs& in, int64_t T, int64_t pds_rows,
                         int64_t pds_keys) {
  const Fp8Format gf = Fp8Format::kE4M3;
  const DeltaMode mode = DeltaMode::kDeltaMatching;
  BlockRuns b{run_bf16(pr, in, pr.params(Precision::kExact), DType::kFloat64),
              run_bf16(pr, in, tile_params(pr, mode, static_cast<int>(T), gf), DType::kFloat32),
              emulate_tile(pr, in, T, gf, mode),
              emulate_tile(pr, in, T, gf, mode, pds_rows, pds_keys)};
  expect_outputs_match(b.r, b.contract);
  return b;
}

// The P (#5) and dS (#7) blocks are (query sub-tile of T/2 queries, key
// half): rows of one half of a query tile whose P / dS are small next to the
// other half's keep their own scale. T = 128: one query tile of 128 queries,
// two key tiles, d = dv = 16. Sub-tile 0 (queries 0-63) has Q = 0: P = 1/256
// at every key, and no dK contribution. Sub-tile 1 (queries 64-127) puts its
// mass on a sink key 0 (logit 22, FP8-exact: q_0 = 8, k_0 = 11, tau = 1/4),
// so its P at the keys of tile 1 is ~e^-22 ~ 2^-32 and its dS ~2^-30. Under
// one scale per block of the whole 128-query tile (x 64 keys) those codes
// are set by sub-tile 0's amax (P 2^-8, dS ~2^-4) and flush to zero; under
// the sub-tile block they are normal. with_do0: dO of sub-tile 0 kept (its
// dS is large; dK of tile 1's keys comes from sub-tile 1 alone) or zeroed
// (dS of sub-tile 0 is zero; dV of tile 1's keys comes from sub-tile 1
// alone). The reference equals the sub-tile emulation bit for bit, differs
// from the whole-query-tile one, and its dV / dK on tile 1's keys are
// FP8-accurate (~0.06) where the whole-query-tile blocks give zero
// (relative error 1).
void check_subtile_blocks(bool with_do0) {
  SCOPED_TRACE(with_do0 ? "dS (#7): dO of sub-tile 0 kept" : "P (#5): dO of sub-tile 0 zero");
  const Problem pr = block_test_problem();
  const int64_t T = 128, H = T / 2, d = pr.d, dv = pr.dv;
  std::mt19937 rng(631 + with_do0);
  Inputs in = random_inputs(pr, rng);
  // Sub-tile 0: Q = 0 (and dO = 0 without with_do0); sub-tile 1: q_0 = 8.
  for (int64_t i = 0; i < pr.Sq; ++i) {
    double* q = in.q.data() + i * d;
    if (i < H) {
      std::fill(q, q + d, 0.0);
      if (!with_do0) std::fill(in.dout.begin() + i * dv, in.dout.begin() + (i + 1) * dv, 0.0);
    } else {
      q[0] = 8.0;
    }
  }
  // Key 0 = 11 e_0 (the sink); the other keys Gaussian with k_0 = 0.
  for (int64_t j = 0; j < pr.Sk; ++j) {
    double* k = in.k.data() + j * d;
    if (j == 0) std::fill(k, k + d, 0.0);
    k[0] = j == 0 ? 11.0 : 0.0;
  }
  // sub: the contract (T/2 x T/2 blocks); whole: T x T/2 blocks.
  const auto [ex, r, sub, whole] = run_block_test(pr, in, T, T, 0);
  // dV (without dO of sub-tile 0) or dK (with it) of key tile 1, keys 128-255.
  const int64_t w = with_do0 ? d : dv;
  auto tile1 = [&](const std::vector<double>& x) {
    return std::vector<double>(x.begin() + T * w, x.begin() + pr.Sk * w);
  };
  const std::vector<double>& r_out = with_do0 ? r.dk : r.dv;
  const std::vector<double>& ex_out = with_do0 ? ex.dk : ex.dv;
  const std::vector<double>& whole_out = with_do0 ? whole.dk : whole.dv;
  EXPECT_GT(max_abs_diff(r_out, whole_out), 0.0);
  const double err_sub = rel_error(tile1(r_out), tile1(ex_out)),
               err_whole = rel_error(tile1(whole_out), tile1(ex_out));
  std::printf("[tile sub-tile blocks] %s of key tile 1: rel err vs exact, reference %.4f, "
              "whole-query-tile blocks %.4f\n",
              with_do0 ? "dK" : "dV", err_sub, err_whole);
  EXPECT_LT(err_sub, 0.1);
  EXPECT_GT(err_whole, 0.9);
}

TEST(ReferenceFp8Tile, PdsBlocksAreQuerySubTiles) {
  check_subtile_blocks(false);
  check_subtile_blocks(true);
}

// The P (#5) / dS (#7) blocks are (query sub-tile, key half of T/2 keys) and
// the dS (#6) blocks (row, key half): a key half whose P / dS are small next
// to the other half's keeps its own scale (the CUDA backward's two consumer
// warpgroups each own one half). T = 128: one query tile of 128 queries, two
// key tiles, d = dv = 16, non-causal. Every query has q_0 = 8; the near half
// of each key tile (keys j % 128 < 64) has k_0 = 11 (logit 22 + N(0, ~1),
// FP8-exact as in check_subtile_blocks) and k_1 = 0; the far half (j % 128
// >= 64) has k_0 = 0. So P of the far halves is ~e^-22 ~ 2^-32 of the near
// halves' (~2^-7) and their dS likewise; under one scale per 64 x 128 block
// (#5 / #7) or per (row, 128 keys) (#6) the far codes are set by the near
// half's amax and flush to zero. dV / dK of the far keys come from the far
// halves' P / dS alone, and dQ channel 1 from the far halves' #6 dS alone
// (k_1 = 0 on the near halves). The reference equals the key-half emulation
// bit for bit (diagnostics included: the post-cast row sums use the #6
// codes), differs from the whole-key-tile one, and is FP8-accurate (~0.06)
// on those outputs where whole key tiles give zero (relative error 1).
TEST(ReferenceFp8Tile, PdsBlocksAreKeyHalves) {
  const Problem pr = block_test_problem();
  const int64_t T = 128, KH = T / 2, d = pr.d, dv = pr.dv;
  std::mt19937 rng(641);
  Inputs in = random_inputs(pr, rng);
  for (int64_t i = 0; i < pr.Sq; ++i) in.q[i * d] = 8.0;
  for (int64_t j = 0; j < pr.Sk; ++j) {
    double* k = in.k.data() + j * d;
    const bool near = j % T < KH;
    k[0] = near ? 11.0 : 0.0;
    if (near) k[1] = 0.0;
  }
  // half: the contract (64 x 64 blocks); whole: 64 x 128, #6 per 128 keys.
  const auto [ex, r, half, whole] = run_block_test(pr, in, T, T / 2, T);
  for (size_t i = 0; i < half.lse.size(); ++i) {
    EXPECT_EQ(r.lse[i], half.lse[i]) << i;
    EXPECT_EQ(r.rowsum_post[i], half.post[i]) << i;
  }
  EXPECT_GT(max_abs_diff(r.dq, whole.dq), 0.0);
  EXPECT_GT(max_abs_diff(r.dk, whole.dk), 0.0);
  EXPECT_GT(max_abs_diff(r.dv, whole.dv), 0.0);
  // The outputs the far halves alone make: dV / dK rows of the far keys,
  // dQ channel 1 of every query.
  auto far_keys = [&](const std::vector<double>& x, int64_t w) {
    std::vector<double> out;
    for (int64_t j = 0; j < pr.Sk; ++j)
      if (j % T >= KH) out.insert(out.end(), x.begin() + j * w, x.begin() + (j + 1) * w);
    return out;
  };
  auto channel1 = [&](const std::vector<double>& x) {
    std::vector<double> out;
    for (int64_t i = 0; i < pr.Sq; ++i) out.push_back(x[i * d + 1]);
    return out;
  };
  struct Case {
    const char* name;
    std::vector<double> ref, whole, exact;
  };
  const Case cases[] = {
      {"dV (#5) of the far keys", far_keys(r.dv, dv), far_keys(whole.dv, dv), far_keys(ex.dv, dv)},
      {"dK (#7) of the far keys", far_keys(r.dk, d), far_keys(whole.dk, d), far_keys(ex.dk, d)},
      {"dQ (#6) channel 1", channel1(r.dq), channel1(whole.dq), channel1(ex.dq)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const double err_half = rel_error(c.ref, c.exact), err_whole = rel_error(c.whole, c.exact);
    std::printf("[tile key-half blocks] %s: rel err vs exact, reference %.4f, whole-key-tile "
                "blocks %.4f\n",
                c.name, err_half, err_whole);
    EXPECT_LT(err_half, 0.1);
    EXPECT_GT(err_whole, 0.9);
  }
}

// ---- Error against exact, tile vs row ----------------------------------------

// Training-shaped inputs (numerics.md section 9): channel outliers shared by Q
// and K (4 channels with gain 4, as grown QK-norm gains give), a sink key
// (key 0 aligned with a component common to every query: logit ~ +8), and a
// token-magnitude spread (each token's q, k, v, dO row times 2^(N(0,1)/2));
// dO at 1e-4 (gradient magnitudes). BF16-exact.
Inputs training_inputs(const Problem& pr, std::mt19937& rng) {
  Inputs in = random_inputs(pr, rng, false);
  const int64_t d = pr.d;
  std::normal_distribution<double> nd;
  std::vector<double> u(d);
  double un = 0;
  for (double& x : u) {
    x = nd(rng);
    un += x * x;
  }
  for (double& x : u) x /= std::sqrt(un);
  const double a = 0.5 * std::sqrt(static_cast<double>(d));  // q's common component
  auto shape_rows = [&](std::vector<double>& x, int64_t w, bool qk, bool is_k) {
    const int64_t rows = static_cast<int64_t>(x.size()) / w;
    for (int64_t r = 0; r < rows; ++r) {
      double* row = x.data() + r * w;
      if (qk) {
        for (int64_t c = 0; c < 4; ++c) row[c] *= 4.0;
        const bool sink = is_k && (r / pr.Hkv) % pr.Sk == 0;  // key 0 of every (b, h)
        for (int64_t c = 0; c < w; ++c) {
          if (!is_k) row[c] += a * u[c];
          if (sink) row[c] = u[c] * 8.0 * std::sqrt(static_cast<double>(d)) / a;
        }
      }
      const double g = std::exp2(0.5 * nd(rng));
      for (int64_t c = 0; c < w; ++c) row[c] *= g;
    }
  };
  shape_rows(in.q, d, true, false);
  shape_rows(in.k, d, true, true);
  shape_rows(in.v, pr.dv, false, false);
  shape_rows(in.dout, pr.dv, false, false);
  for (double& x : in.dout) x *= 1e-4;
  for (auto* x : {&in.q, &in.k, &in.v, &in.dout})
    for (double& e : *x) e = round_to_bf16(e);
  return in;
}

// The `row` and `tile` recipes (Delta-Matching, B = 128, E4M3; FP32 outputs) on BF16
// inputs: their errors against the exact path (FP64 outputs), and tile's outputs.
struct RowVsTile {
  Errors row, tile;
  RefOutputs tile_out;
};
RowVsTile row_vs_tile(const Problem& pr, const Inputs& in) {
  const RefOutputs ex = run_bf16(pr, in, pr.params(Precision::kExact), DType::kFloat64);
  const RefOutputs row = run_bf16(pr, in, pr.params(Precision::kFP8), DType::kFloat32);
  RefOutputs tile = run_bf16(
      pr, in, tile_params(pr, DeltaMode::kDeltaMatching, 128, Fp8Format::kE4M3), DType::kFloat32);
  return {errors_vs_exact(row, ex), errors_vs_exact(tile, ex), std::move(tile)};
}

void check_tile_vs_row(bool training, bool causal) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 384;
  pr.Sk = 384;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 64;
  pr.dv = 64;
  pr.causal = causal;
  std::mt19937 rng(601 + 2 * training + causal);
  const Inputs in = training ? training_inputs(pr, rng) : random_inputs(pr, rng);
  const auto [er, et, tile] = row_vs_tile(pr, in);
  std::printf(
      "[tile vs row] %s causal=%d  rel err row / tile: O %.4f / %.4f  dQ %.4f / %.4f  "
      "dK %.4f / %.4f  dV %.4f / %.4f; LSE rms abs %.4f / %.4f\n",
      training ? "training-shaped" : "gaussian", causal, er.o, et.o, er.dq, et.dq, er.dk, et.dk,
      er.dv, et.dv, er.lse, et.lse);
  const double kRatio = 1.05;  // issue #17: tile within 1.05x of row on every output
  EXPECT_LE(et.o, kRatio * er.o);
  EXPECT_LE(et.dq, kRatio * er.dq);
  EXPECT_LE(et.dk, kRatio * er.dk);
  EXPECT_LE(et.dv, kRatio * er.dv);
  EXPECT_LE(et.lse, kRatio * er.lse);
  EXPECT_TRUE(all_finite(tile.o) && all_finite(tile.dq) && all_finite(tile.dk) &&
              all_finite(tile.dv));
  if (!training) {  // the derived budget (test_util.h, the same for both recipes) is for unit-normal inputs
    const Errors bud = fp8_budget(Fp8Format::kE4M3);
    expect_within_budget(et, bud);
    EXPECT_LT(et.lse, bud.lse);
  }
}

TEST(ReferenceFp8Tile, ErrorAgainstExactLikeRowGaussian) {
  check_tile_vs_row(false, false);
  check_tile_vs_row(false, true);
}
TEST(ReferenceFp8Tile, ErrorAgainstExactLikeRowTrainingShaped) {
  check_tile_vs_row(true, false);
  check_tile_vs_row(true, true);
}

// Long rows (numerics.md section 9, P of #5): at many keys the normalized P
// is ~1/seqlen_k, below the E4M3 normal range under a fixed scale 2^-8; the
// per-block dynamic scale keeps dV as accurate as `row`. 32K keys, 128
// queries. (Mutation check, 2026-12-02: a fixed P scale 2^-8 in #5 gives dV
// 0.0750 against row's 0.0636 here, 1.18x, and fails.)
TEST(ReferenceFp8Tile, LongRowsDvLikeRow) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 128;
  pr.Sk = 32768;
  pr.Hq = 1;
  pr.Hkv = 1;
  pr.d = 16;
  pr.dv = 16;
  std::mt19937 rng(611);
  const Inputs in = random_inputs(pr, rng);
  const auto [er, et, tile] = row_vs_tile(pr, in);
  std::printf("[tile long rows] Sk=%lld dV rel err row %.4f tile %.4f; dK %.4f / %.4f\n",
              static_cast<long long>(pr.Sk), er.dv, et.dv, er.dk, et.dk);
  EXPECT_LE(et.dv, 1.05 * er.dv);
  EXPECT_LE(et.dk, 1.05 * er.dk);
  EXPECT_LE(et.o, 1.05 * er.o);
}

// ---- Delta-Matching invariant ---------------------------------------------

void check_invariant(bool causal) {
  Problem pr;
  pr.B = 1;
  pr.Sq = 256;
  pr.Sk = 256;
  pr.Hq = 4;
  pr.Hkv = 2;
  pr.d = 64;
  pr.dv = 64;
  pr.causal = causal;
  pr.scaling = Scaling::kTile;  // B = 128, E4M3 gradients
  std::mt19937 rng(621 + causal);
  const Inputs in = random_inputs(pr, rng);
  const RowSumResiduals res = rowsum_residuals(pr, in);  // the saved O is BF16, as at the op boundary
  const double *pre = res.pre, *post = res.post;
  std::printf(
      "[tile invariant] causal=%d mean row-sum residual pre/post: stale %.3e/%.3e matched_do "
      "%.3e/%.3e delta_matching %.3e/%.3e\n",
      causal, pre[0], post[0], pre[1], post[1], pre[2], post[2]);
  EXPECT_LT(pre[2], 1e-5);
  EXPECT_GE(pre[0], 10 * pre[2]);
  EXPECT_GT(pre[0], 1e-4);
  EXPECT_GT(post[0], post[2]);
}

TEST(ReferenceFp8Tile, DeltaMatchingRowSumInvariant) { check_invariant(false); }
TEST(ReferenceFp8Tile, DeltaMatchingRowSumInvariantCausal) { check_invariant(true); }

}  // namespace
}  // namespace fp8attn
