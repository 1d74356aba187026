// fp8attn: tile sizes and supported shapes of the sm_90a kernels, in one place.
// Math: docs/numerics.md. Operand layouts: kernel_params_sm90.h.
//
// Sections: shared (block grid), quantization, forward, backward.
#pragma once

namespace fp8attn {
namespace sm90 {

// ---- shared: the block grid (numerics.md section 2) -------------------------

// Sequence block of the CUDA kernels: the only block_size they support. It is
// also the key tile of the forward online softmax (numerics.md section 3: the
// tile is exactly the reference's block of matmul #2).
constexpr int kSeqBlock = 128;
// Head-dim blocks have min(kMaxDimBlock, D) elements (the last may be shorter,
// e.g. D = 192 -> 128 + 64).
constexpr int kMaxDimBlock = 128;
// Quantized sequence rows are padded to a multiple of this many tokens
// (16-byte rows of FP8 codes; kernel_params_sm90.h's *_pad).
constexpr int kSeqPad = 16;

constexpr int dim_block(int d) { return d < kMaxDimBlock ? d : kMaxDimBlock; }
constexpr int num_dim_blocks(int d) { return (d + kMaxDimBlock - 1) / kMaxDimBlock; }
constexpr bool supported_head_dims(int d_qk, int d_v) {
  return (d_qk == 64 && d_v == 64) || (d_qk == 128 && d_v == 128) || (d_qk == 256 && d_v == 256) ||
         (d_qk == 192 && d_v == 128);
}

// ---- head dims served by zero padding (csrc/torch/ops_cuda.cpp) --------------
//
// Every (head_dim_qk, head_dim_v) in [1, kMaxHeadDim]^2 runs on CUDA: the op pads
// Q and K (and V, dO, O) with zero channels to the first instantiated pair, in
// the order below, that covers both dims, and slices O, dQ, dK, dV back. The
// order is by padded work (head_dim_qk + head_dim_v: 128, 256, 320, 512), so
// the first covering pair is also the cheapest. Exact under the FP8 recipe
// (numerics.md section 7, "Zero-padded head dims"): head_dim blocks start at
// channel 0 and are 128 channels wide (or the whole head_dim when it is
// shorter), so zero channels change no block's amax, scale or codes of the
// real channels; a padded block that holds only zeros gets scale 1 and codes
// 0, adding exactly 0 to S and dP; every column-blocked operand (V, dO, Q, K
// along the sequence) is per channel, so the padded channels only produce the
// padded columns of O, dV, dQ, dK, which are sliced off.
constexpr int kMaxHeadDim = 256;
struct HeadDims {
  int qk, v;
};
constexpr HeadDims kKernelHeadDims[] = {{64, 64}, {128, 128}, {192, 128}, {256, 256}};
// The kernel pair serving (d_qk, d_v), or {0, 0} when a dim is outside [1, 256].
constexpr HeadDims kernel_head_dims(int d_qk, int d_v) {
  if (d_qk < 1 || d_v < 1 || d_qk > kMaxHeadDim || d_v > kMaxHeadDim) return {0, 0};
  for (const HeadDims& k : kKernelHeadDims)
    if (d_qk <= k.qk && d_v <= k.v) return k;
  return {0, 0};
}

static_assert(kSeqBlock % kSeqPad == 0, "sequence blocks must be whole padded rows");
static_assert(supported_head_dims(kKernelHeadDims[0].qk, kKernelHeadDims[0].v) &&
                  supported_head_dims(kKernelHeadDims[1].qk, kKernelHeadDims[1].v) &&
                  supported_head_dims(kKernelHeadDims[2].qk, kKernelHeadDims[2].v) &&
                  supported_head_dims(kKernelHeadDims[3].qk, kKernelHeadDims[3].v),
              "padding targets are instantiated pairs");
static_assert(kernel_head_dims(kMaxHeadDim, kMaxHeadDim).qk == kMaxHeadDim, "every pair up to 256 is covered");
static_assert(kSeqBlock == 128, "the kernels' fragment maps assume 128-token blocks");
static_assert(dim_block(64) == 64 && dim_block(192) == 128 && num_dim_blocks(192) == 2,
              "head_dim block rule of numerics.md section 2");

// ---- quantization kernels (quant_e4m3_blockscale_sm90.cu) -----------------

// One CTA quantizes a tile of kSeqBlock tokens x one head_dim block (<= 128
// channels) of one (batch, head): both blockings from one read of the BF16 tile.
constexpr int kQuantThreads = 256;
constexpr int kQuantVec = 8;  // BF16 elements per 16-byte global access

static_assert(kQuantThreads % (kMaxDimBlock / kQuantVec) == 0, "whole rows per pass");
static_assert(kQuantThreads % kMaxDimBlock == 0 && kQuantThreads % 64 == 0,
              "column pass: whole channel groups");

// ---- wgmma forward, `row` recipe (fwd_wgmma_e4m3_blockscale_sm90.cu) -----------
namespace fwdw {

// One producer warpgroup (TMA issue, K/V scale loads, the in-place V^T key
// permutation) and kConsumerWGs consumer warpgroups of 64 query rows each.
constexpr int kConsumerWGs = 2;
constexpr int kBlockM = 64 * kConsumerWGs;           // query rows per CTA
constexpr int kBlockN = kSeqBlock;                   // keys per tile = one sequence block
constexpr int kThreads = 128 * (1 + kConsumerWGs);
constexpr int kStages = 2;                           // K/V pipeline depth
// setmaxnreg budgets (the register file is 64K 32-bit registers per SM; one CTA per SM).
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
// Head dims the wgmma kernel instantiates (every supported_head_dims pair).
// NOTE: d_qk >= 192 (two head_dim blocks) runs its own kernel,
// fwd_wgmma_d2_kernel: O is up to 64x256 FP32 per warpgroup (128 registers),
// so the consumers get 240 registers (the producer 24, FA3's split) and the
// second head_dim block's S partial runs in n32 chunks (16 registers) next to
// S (64): peak O + S + chunk = 208 in arrays (kernel doc, "head_dim 192 / 256").
constexpr bool supported(int d_qk, int d_v) { return supported_head_dims(d_qk, d_v); }
// v11 (schedule kSerial3): three consumer warpgroups (kBlockM 192) on the
// serial schedule, so each SM sub-partition holds three consumer warps
// instead of two (kernel doc, "v11"). 512 threads launch with 128 registers
// each; the producer drops to 32 and the consumers rise to 160.
constexpr int k3ConsumerWGs = 3;
constexpr int k3BlockM = 64 * k3ConsumerWGs;
constexpr int k3Threads = 128 * (1 + k3ConsumerWGs);
constexpr int k3ProducerRegs = 32;
constexpr int k3ConsumerRegs = 160;
static_assert(k3BlockM <= 256, "TMA box dims are at most 256");
static_assert(k3ProducerRegs % 8 == 0 && k3ConsumerRegs % 8 == 0 && k3ProducerRegs >= 24,
              "setmaxnreg takes multiples of 8 in [24, 256]");
static_assert(k3ProducerRegs + k3ConsumerWGs * k3ConsumerRegs <= (1 + k3ConsumerWGs) * (65536 / k3Threads / 8 * 8),
              "setmaxnreg pool: the registers allocated at launch (three consumer warpgroups)");
constexpr int kD2ProducerRegs = 24;
constexpr int kD2ConsumerRegs = 240;
constexpr int kD2S1ChunkN = 32;  // keys per wgmma chain of head_dim block 1's S partial
constexpr int kD2PvN = 64;       // output channels per P V wgmma chain (partial: 32 registers)

static_assert(kBlockN == 128, "P block scale per (row, 128-key tile); V^T tile rows are 128 bytes");
static_assert(kBlockM <= 256 && kBlockN <= 256, "TMA box dims are at most 256");
static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
              "setmaxnreg takes multiples of 8 in [24, 256]");
static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= 65536, "register file of one SM");
static_assert(kStages >= 2, "double buffering at least");
// NOTE: setmaxnreg moves registers inside what the CTA got at launch: 384
// threads at __launch_bounds__(384, 1) get 168 each (65536 / 384 rounded down
// to 8), so producer + consumers must stay within 3 * 168 = 504 per thread
// slot (40 + 2 * 232 and 24 + 2 * 240 both are exactly that).
static_assert(kProducerRegs + kConsumerWGs * kConsumerRegs <= (1 + kConsumerWGs) * (65536 / kThreads / 8 * 8),
              "setmaxnreg pool: the registers allocated at launch");
static_assert(kD2ProducerRegs + kConsumerWGs * kD2ConsumerRegs <= (1 + kConsumerWGs) * (65536 / kThreads / 8 * 8),
              "setmaxnreg pool: the registers allocated at launch (d >= 192)");
static_assert(kD2ProducerRegs % 8 == 0 && kD2ConsumerRegs % 8 == 0 && kD2ProducerRegs >= 24 && kD2ConsumerRegs <= 256,
              "setmaxnreg takes multiples of 8 in [24, 256]");
static_assert(kBlockN % kD2S1ChunkN == 0 && kD2S1ChunkN % 8 == 0, "S chunks: whole n8 tiles (GmmaAtom<kD2S1ChunkN> in the kernel)");
static_assert(kD2PvN == 64 || kD2PvN == 128, "P V chains: m64n64 or m64n128");

}  // namespace fwdw

// ---- `tile`-recipe forward (fwd_tilescale_e4m3_sm90.cu, mainloop_fwd_tilescale_sm90.cuh) ----
namespace fwdt {

// One producer warpgroup (warp 0: TMA of Q, K, V^T; warps 1-3: the V^T key
// permutation of the P fragment, mainloop_fwd_tilescale_sm90.cuh) and
// kConsumerWGs consumer warpgroups of 64 query rows each.
constexpr int kConsumerWGs = 2;
constexpr int kBlockM = 64 * kConsumerWGs;  // query rows per CTA
constexpr int kBlockN = kSeqBlock;          // keys per tile = the recipe's tile T
constexpr int kThreads = 128 * (1 + kConsumerWGs);
constexpr int kStages = 2;                  // K / V^T pipeline depth
// setmaxnreg budgets (FA3's split at 384 threads): 24 + 2 * 240 = 3 * 168.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
// Q / K rows are stored in chunks of kQKChunk channels (one 128-byte swizzle
// span); the last chunk of head_dim 192 is 64 channels (64-byte swizzle).
constexpr int kQKChunk = 128;
constexpr int qk_chunks(int d) { return (d + kQKChunk - 1) / kQKChunk; }
constexpr int qk_chunk_width(int d, int c) { return d - c * kQKChunk < kQKChunk ? d - c * kQKChunk : kQKChunk; }
// The in-warpgroup overlap (QK^T (t + 1) issued before the softmax of t, P V (t)
// after it) needs O + S (t + 1) + two P fragments in registers: at dv = 256
// (O = 128 registers) it does not fit 240, so dv = 256 runs the serial order.
constexpr bool overlap_fits(int dv) { return dv <= 128; }
// NOTE: a row whose P tile has a block scale below kPFlushScale (its largest
// P is < 2^-56 of the running max's) adds exactly nothing: its codes are
// flushed to 0 and O keeps its unit (numerics.md section 9, "Implementations":
// O is accumulated in units of s_P s_V, and such a unit would overflow FP32).
constexpr float kPFlushScale = 5.421010862427522e-20f;  // 2^-64
// Named barrier ids of the pingpong between the two consumer warpgroups.
constexpr int kBarPingpong = 1;  // ids kBarPingpong + 0 / + 1
// Default order at dv <= 128 (FP8ATTN_TILE_PINGPONG overrides): the
// in-warpgroup overlap alone until the pingpong is measured on the device
// (docs/kernels/fwd_tilescale_e4m3_sm90.md).
constexpr bool kTilePingpongDefault = false;
// Default scheduler (FP8ATTN_TILE_PERSISTENT overrides): one CTA per work
// tile; the persistent longest-first one (scheduler_sm90.cuh) is off until
// it has passed the GPU tests and been measured.
constexpr bool kTilePersistentDefault = false;
// The quantization writes V^T with the keys of every 16-key group in the
// order the P fragments of the S accumulator need (0 1 8 9 2 3 10 11 4 5 12
// 13 6 7 14 15; TileQuantJob::tileT_perm16), so the consumers read V^T as TMA
// left it. false: the producer's warps 1-3 permute every V^T tile in shared
// memory (v_raw -> v_full), as in v1.
constexpr bool kVPermutedInQuant = true;

static_assert(kBlockN == 128, "P fragment permutation covers 16-key groups of a 128-key tile; V^T rows 128 bytes");
static_assert(kBlockM <= 256 && kBlockN <= 256, "TMA box dims are at most 256");
static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
              "setmaxnreg takes multiples of 8 in [24, 256]");
static_assert(kProducerRegs + kConsumerWGs * kConsumerRegs <= (1 + kConsumerWGs) * (65536 / kThreads / 8 * 8),
              "setmaxnreg pool: the registers allocated at launch");
static_assert(kStages >= 2, "double buffering at least");
static_assert(kQKChunk == 128 && qk_chunks(192) == 2 && qk_chunk_width(192, 1) == 64 && qk_chunk_width(64, 0) == 64,
              "Q / K chunks: one 128B (or 64B) swizzle span per row");
static_assert(kConsumerWGs == 2 && kBarPingpong > 0 && kBarPingpong + 1 < 16, "pingpong pairs two warpgroups");

}  // namespace fwdt

// ---- backward (bwd_*_sm90.cu, bwd_tile_sm90.cuh) -------------------------------
namespace bwd {

constexpr int kTile = 128;             // query tile = key tile = sequence block
constexpr int kWarps = 8;              // warp w owns keys [16w, 16w+16) of the key tile
constexpr float kLog2e = 1.4426950408889634f;
// Matmul #6 (dQ = dS K) blocks dS per query along keys in kDsBlock keys
// (numerics.md section 3; K stays in kTile-key blocks). NOTE: a dS block is the
// keys of kDsWarps consecutive warps (one warpgroup), so its amax is reduced
// inside that group; the FP32 partial of each block is promoted with its own
// scale.
constexpr int kDsBlock = 64;
constexpr int kDsWarps = kDsBlock / 16;      // warps (16 keys each) per dS block

// wgmma backward (bwd_wgmma_e4m3_blockscale_sm90.cu, every head_dim; d > 128
// in 128-column output slices per main-kernel CTA): two
// consumer warpgroups, warp w owning key rows [16w, 16w+16) as above; shared
// operand tiles are rows of kWgRowBytes (one 128-byte swizzle atom, K-major);
// the Delta-Matching pre-pass takes kWgPreQ queries per CTA (<= 128 registers,
// two CTAs per SM; docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md).
constexpr int kWgThreads = 256;
constexpr int kWgRowBytes = 128;
constexpr int kWgPreQ = 64;
// Matmul #6 (dQ = dS K): dS is block-scaled per query row along keys in blocks
// of kWgDsBlock = min(kTile, 64) keys (numerics.md sections 2, 3, 7), so each
// warpgroup (64 key rows) owns exactly one block: its per-query amax is
// warpgroup-local. The d <= 128 main kernel double-buffers the dS codes
// (kWgDsBufs), its dQ runs one tile pair late (v6, kernel note).
constexpr int kWgDsBlock = kDsBlock;  // the one #6 dS block (above)
constexpr int kWgDsBufs = 2;
// Named barrier ids of the d <= 128 main kernel (0 is __syncthreads):
// kWgBarWarpgroup + wg syncs warpgroup wg's 128 threads (#6 amax, LSE array);
// kWgBarPingpong holds warpgroup 1 back half a tile pair at the start.
constexpr int kWgBarWarpgroup = 1;
constexpr int kWgBarPingpong = 3;
static_assert(kWgBarWarpgroup > 0 && kWgBarPingpong > 0 && kWgBarPingpong != kWgBarWarpgroup &&
                  kWgBarPingpong != kWgBarWarpgroup + 1 && kWgBarPingpong < 16 && kWgBarWarpgroup + 1 < 16,
              "distinct hardware named barriers 1..15 (two per-warpgroup ids and the pingpong id)");
// v6 tuning knobs (d <= 128 main kernel; docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md, v6):
//  kWgStageIssue: where a thread issues the next tile pair's query-side copies
//  (after waiting for the stage to be free): 0 top of the pair, 1 after dV,
//  2 after the dS stores.
//  kWgPingpong: warpgroup 1 starts after warpgroup 0's first dV (half a pair late).
//  kWgStageReaderFence: fence.proxy.async after each wait for a query-side
//  stage (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in the SASS, right behind the
//  previous pair's dQ atomics); false follows CUTLASS's sm90 cp.async GMMA
//  mainloop (mbarrier only). NOTE at the wait in the kernel.
//  Each other value was measured once on the H200 (19:59 UTC): equal or slower.
constexpr int kWgStageIssue = 1;
constexpr bool kWgPingpong = true;
constexpr bool kWgStageReaderFence = true;

static_assert(kTile == kSeqBlock, "backward tiles are the 128-token sequence blocks");
static_assert(kWgThreads == 32 * kWarps, "warp w of the wgmma kernels owns key rows [16w, 16w+16)");
static_assert(kWgRowBytes == kTile, "one swizzled row holds a 128-element FP8 block");
static_assert(kWgPreQ % 16 == 0 && kTile % kWgPreQ == 0 && kWgPreQ % 64 == 0,
              "pre-pass query tile: whole m64n64 column blocks and 16-row permutation groups");
static_assert(kTile == 16 * kWarps, "one m16 row block of keys per warp");
static_assert(kWgDsBlock == 64 && kTile == 2 * kWgDsBlock && kWgThreads == 2 * 128,
              "one #6 dS key block per warpgroup (64 key rows each)");
static_assert(kWgDsBufs == 2, "dQ of tile pair it - 1 reads one buffer while pair it writes the other");
static_assert(kWgStageIssue >= 0 && kWgStageIssue <= 2, "stage issue point: top, after dV, after the dS stores");
static_assert(kDsBlock == (kSeqBlock < 64 ? kSeqBlock : 64), "numerics.md: dS of #6 in min(B, 64)-key blocks");
static_assert(kTile % kDsBlock == 0 && kDsBlock % 16 == 0 && kDsWarps * (kTile / kDsBlock) == kWarps,
              "dS blocks of #6: whole warps (16 keys) and whole k16 steps, tiling the key tile");

}  // namespace bwd

// ---- `tile`-recipe backward (bwd_*tilescale*_sm90.cu, mainloop_bwd_tilescale_sm90.cuh) ----
// numerics.md section 9; design: docs/kernels/bwd_tilescale_e4m3_sm90.md.
namespace bwdts {

constexpr int kTile = kSeqBlock;  // key tile = query tile = the recipe's T (one scale per tile)
// Main kernel: two consumer warpgroups (warp w of 0..7 owns key rows [16w, 16w + 16)
// of the key tile, the row kernels' map) and one producer warpgroup (cp.async
// fills into an mbarrier ring), kThreads in all.
constexpr int kConsumerWGs = 2;
constexpr int kConsumerThreads = 128 * kConsumerWGs;
constexpr int kProducerThreads = 128;
constexpr int kThreads = kConsumerThreads + kProducerThreads;
// setmaxnreg budgets: 384 threads launch with 168 registers each (65536 / 384
// rounded down to 8); the producer gives back all but 24, the consumers take 240.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
// Queries per main-kernel iteration: a stage holds one 128-query tile, the
// consumers walk it in two sub-tiles of kSubQ queries (FlashAttention-3's
// 64 x 128 iteration); the P (#5) and dS (#7) blocks are kSubQ x kKeyHalf,
// the #6 dS scale one per (query, kKeyHalf keys) (numerics.md section 9).
constexpr int kKeyHalf = kTile / kConsumerWGs;  // keys of one consumer warpgroup
constexpr int kSubQ = 64;
// Query-side stages of the ring: 2 at head_dim <= 128, 1 above (shared memory).
constexpr int stages(int d_qk, int d_v) { return d_qk > 128 || d_v > 128 ? 1 : 2; }
// Output columns of dK / dQ (and dV) per main-kernel CTA: head_dim > 128 runs in
// 128-column slices, each recomputing S, P, dP, dS (accumulators stay 64 + 64
// registers per thread).
constexpr int kSliceCols = 128;
constexpr int slices(int d_qk, int d_v) {
  return d_qk > kSliceCols || d_v > kSliceCols ? ((d_qk > d_v ? d_qk : d_v) + kSliceCols - 1) / kSliceCols : 1;
}
// Named barrier of each consumer warpgroup (kBarWg + wg, 128 threads; 0 is
// __syncthreads, the row kernels' ids are private to them). NOTE (v5): the two
// consumer warpgroups never sync with each other: every exchange of the main
// kernel (block amaxes, #6 row scales, dS codes, dQ panel) stays inside one
// warpgroup, which the contract's 64 x 64 P / dS blocks and #6 scales per
// 64-key half allow (numerics.md section 9).
constexpr int kBarWg = 1;
// Named barriers of the pingpong turns (kBarPingpong + wg, 256 threads), and
// whether the turns are on by default (FP8ATTN_TILE_BWD_PINGPONG overrides;
// off until measured).
constexpr int kBarPingpong = kBarWg + kConsumerWGs;
constexpr bool kBwdPingpongDefault = false;
// Pre-pass: queries per CTA (both warpgroups see them, each 64 keys of a key tile).
constexpr int kPreQ = 64;
constexpr int kPreThreads = 256;
// Pre-pass v2 (FP8ATTN_TILE_PREPASS_Q=128): kPreQ2 queries per CTA, warpgroup wg
// = query sub-tile wg (kSubQ queries, the main kernel's sub-tile), walking both
// 64-key halves of every key tile, so K / V rows are read from L2 once per 128
// queries (v1: per 64). kPreThreads threads (two warpgroups).
constexpr int kPreQ2 = 2 * kSubQ;
// Its shared memory in [128][128 B] tiles of 16 KB: the Q + dO rows of the 128
// queries are pre2_tiles tiles, one K / V stage as many again. Stages and CTAs
// per SM (two CTAs: <= 113 KB each, the v1 budget): head_dim <= 128: 2 tiles,
// 2 stages, 96 KB, 2 CTAs; (192, 128): 3 tiles, 1 stage, 96 KB, 2 CTAs; 256: 4
// tiles, 128 KB with one stage already, so 1 CTA per SM and then 2 stages (192 KB).
constexpr int pre2_tiles(int d_qk, int d_v) { return num_dim_blocks(d_qk) + num_dim_blocks(d_v); }
constexpr int pre2_ctas_per_sm(int d_qk, int d_v) { return pre2_tiles(d_qk, d_v) <= 3 ? 2 : 1; }
constexpr int pre2_stages(int d_qk, int d_v) { return pre2_tiles(d_qk, d_v) == 3 ? 1 : 2; }
// Default pre-pass (FP8ATTN_TILE_PREPASS_Q=64|128 overrides): v2. NOTE: compiled,
// not yet run on a GPU (docs/kernels/bwd_tilescale_e4m3_sm90.md, "Pre-pass v2");
// FP8ATTN_TILE_PREPASS_Q=64 is v1, as validated.
constexpr bool kPreQ2Default = true;

static_assert(kTile == 128, "fragment maps: 8 warps x 16 key rows, one 128-byte swizzle row per 128 codes");
static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
              "setmaxnreg takes multiples of 8 in [24, 256]");
static_assert(kProducerRegs + kConsumerWGs * kConsumerRegs <= (1 + kConsumerWGs) * (65536 / kThreads / 8 * 8),
              "setmaxnreg pool: the registers allocated at launch");
static_assert(kKeyHalf == 64 && kSubQ == 64 && kTile % kSubQ == 0,
              "one m64 chain per sub-tile; one query column per thread in the row-scale pass");
static_assert(kPreQ == 64 && kPreThreads == 256, "pre-pass: one m64n64 chain per warpgroup, as the main kernel's halves");
static_assert(kPreQ2 == kTile && kPreQ2 == 2 * kSubQ && kPreThreads == 2 * 128,
              "pre-pass v2: one query sub-tile of the main kernel per warpgroup, both key halves");
static_assert(pre2_stages(64, 64) == 2 && pre2_stages(128, 128) == 2 && pre2_stages(192, 128) == 1 &&
                  pre2_stages(256, 256) == 2 && pre2_ctas_per_sm(128, 128) == 2 && pre2_ctas_per_sm(192, 128) == 2 &&
                  pre2_ctas_per_sm(256, 256) == 1,
              "pre-pass v2 stages / CTAs per SM of the instantiated head dims (sizes asserted in its layout)");
static_assert(slices(64, 64) == 1 && slices(128, 128) == 1 && slices(192, 128) == 2 && slices(256, 256) == 2,
              "slices of the instantiated head dims");
static_assert(kBarWg > 0 && kBarPingpong >= kBarWg + kConsumerWGs && kBarPingpong + kConsumerWGs <= 16,
              "hardware named barriers 1..15, distinct");

}  // namespace bwdts

}  // namespace sm90
}  // namespace fp8attn
