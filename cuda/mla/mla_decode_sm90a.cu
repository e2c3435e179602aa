// MLA decode (absorbed form) for Hopper, sm_90a only: wgmma, TMA and warp specialisation. The same
// op, params, page-walk bounds rules, split-KV partials and combine pass as the portable kernel
// (mla_decode_portable.cu); the dispatcher sends it calls with page sizes that are multiples of 16,
// except those of 16 heads or fewer where the portable kernel is faster (mla_decode_declines), and the
// rest to the portable family. Fewer heads than 64 leave rows of its wgmma tiles as padding (Q's box
// reads other requests' rows or zeros there; their results are never written).
//
// One CTA = (KV split, 64 heads, request) and three warpgroups, walking the cache in 32-token tiles
// through a ring of four. Shared memory holds the CTA's Q (64 heads x 576 dims) and the ring, as
// 64-column blocks in the TMA's 128-byte swizzle (attention/wgmma.cuh).
//   producer    one thread: Q's two boxes (issued before the sequence length is read), then each
//               tile's boxes (box = gcd(page size, 32) rows, so a box never crosses a page: with pages
//               of a multiple of 32 tokens a tile is two boxes, its eight latent blocks in one, else
//               9 x 32 / box; a missing page or tokens past the sequence are boxes outside the
//               tensor, which arrive as zeros), on the tile buffer's "full" mbarrier, after its
//               "empty" one says both consumers are done.
//   consumers   a seesaw: consumer c (0, 1) computes S = Q K^T (wgmma m64n32k16, 36 k-steps, fp32;
//               Q of the last 14 from registers) and the online softmax of the tiles i with
//               i % 2 == c, writing P (rounded to the input dtype) into the tile's rope block,
//               dead once S is done (64 x 32 in the 64-byte swizzle), and the tile's rescale
//               factors and running max into shared memory; it then arrives on named barrier
//               4 + stage. Both consumers run O[:, 256c .. 256c + 256) = alpha O + P V (wgmma
//               m64n256k16) for every tile in order, the other's tiles after that barrier. While
//               one consumer does a softmax, the tensor cores run the other's S or P V.
// The running max is one chain over the tiles (a tile's softmax starts from the max after the tile
// before it, the other consumer's) and the portable kernel's lazy one (attention/softmax.cuh): on
// most tiles alpha = 1 and O is not rescaled. Each consumer keeps the row sums of its own tiles'
// P, rescaled by every tile's factor; the output adds the two. O (64 x 256 fp32 per consumer)
// stays in registers; at the end the 16-bit output goes through the idle ring to global memory in
// 16-byte rows (attention/row_stage.cuh). KV splits write fp32 partials for the combine pass, but
// two splits run as a cluster of two CTAs (the pair kernel) and merge here, through distributed
// shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention/mma.cuh"
#include "attention/row_stage.cuh"
#include "attention/softmax.cuh"
#include "attention/wgmma.cuh"
#include "common/cuda_util.h"
#include "common/dtype.h"
#include "common/tma_host.h"
#include "mla/mla_combine.h"
#include "mla/mla_decode.h"
#include "mla/mla_splits.h"

namespace hmoe {
namespace {

using namespace attn::sm90;
using attn::exp2_ftz;
using attn::kLn2;
using attn::kLog2e;

constexpr int kHeads = 64;                      // heads per CTA: wgmma's M
constexpr int kTile = 32;                       // KV tokens per ring buffer
constexpr int kBlocks = 9;                      // 64-column blocks of a 576-dim row: 8 latent, 1 rope
constexpr int kLatentBlocks = kMlaDimCkv / 64;  // 8
constexpr int kBlockBytes = kTile * 128;        // a block of a tile
constexpr int kQBlockBytes = kHeads * 128;      // a block of Q
constexpr int kTileBytes = kBlocks * kBlockBytes;
constexpr int kStages = 4;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
// Registers a thread after setmaxnreg: the producer's fewest, so that the consumers get the most the
// pool allows (168 x 384 from the launch = 24 x 128 + 240 x 256).
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
static_assert(regs_split_fits(kThreads, kProducerRegs, 2, kConsumerRegs), "the register split exceeds the CTA's pool");
// 16 heads or fewer: served from kFewHeadsMinTokens cached tokens (batch x page-table capacity) up, where
// the grid fits one wave and each CTA walks at most kFewHeadsTiles tiles, or the splits are at their
// most (mla_decode_declines).
constexpr int kFewHeads = 16;
constexpr int kFewHeadsTiles = 32;
constexpr int64_t kFewHeadsMinTokens = 16384;
// S's k-steps (16 dims each), of which the last kRegSteps take Q from registers (wgmma with A in
// registers): S reads all of Q for every tile, and this cuts those shared-memory reads by 14 / 36.
// 14 is the most the consumers' 240 registers hold without spills (next to O's 128 and S's 16; 16
// spills). Measured counts: docs/perf/mla_decode.md, The sm90a kernel.
constexpr int kSteps = 4 * kBlocks;
constexpr int kRegSteps = 14;
static_assert(kRegSteps > 0 && kRegSteps <= kSteps, "the register k-steps are a tail of S's");
static_assert(kMlaDimPe == 64, "the rope dims are one block");

// Shared memory, offsets from a 1024-byte aligned base (the launcher adds 1024 bytes of slack).
struct Smem {
  static constexpr int q = 0;
  static constexpr int kv = q + kBlocks * kQBlockBytes;
  static constexpr int bars = kv + kStages * kTileBytes;  // full[kStages], empty[kStages], q
  // [kStages][kHeads] pairs: a tile's rescale factor and the running max after it, per row
  static constexpr int rows = bars + 8 * (2 * kStages + 1);
  static constexpr int lsum = rows + kStages * kHeads * 8;  // [2][kHeads]: each consumer's row sums
  static constexpr int end = lsum + 2 * kHeads * 4;
  static constexpr int bytes = end + 1024;
};
// The epilogue, in the ring once every tile is consumed: the CTA's 16-bit output rows (the stage),
// then, for a pair of splits, the peer's O half (128 threads x 128 floats) and its rows' (max, sum).
template <typename T>
constexpr int kRowBytes = kMlaDimCkv * int(sizeof(T));
constexpr int kStageBytes = kHeads * kRowBytes<__half>;  // the output is 16-bit
constexpr int kPeerOBytes = 128 * 128 * 4;               // one consumer's O: 128 threads x 128 floats
static_assert(kStageBytes + kPeerOBytes + kHeads * 8 <= kStages * kTileBytes, "the epilogue's buffers fit the ring");
// Named barriers (0 is __syncthreads): the consumers' end, each consumer alone (2 + c), P of a ring
// stage (kBarP + stage: its owner arrives, the other consumer waits).
constexpr int kBarEnd = 1, kBarOwn = 2, kBarP = 4;

// The tensor maps: q_nope [B * H, 512] in boxes of its eight 64-column blocks x 64 rows and q_pe
// [B * H, 64] in boxes of 64 x 64; ckv [rows, 512] in boxes of its eight blocks x box rows where box is
// the tile's 32 rows (tensor_map_blocks: the latent blocks of a tile in one copy), else 64 x box, and
// kpe [rows, 64] in boxes of 64 x box; all with the 128-byte swizzle. A box of blocks lands as its 2-d
// boxes side by side would.
struct Maps {
  CUtensorMap q_nope, q_pe, ckv, kpe;
};

__device__ __forceinline__ void grid_dependents_may_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Q's two boxes (its latent blocks, its rope block), on its mbarrier: issued by thread 0 before
// anything else, since they need no sequence length (the other copies wait for the length and then
// the page table).
__device__ __forceinline__ void load_q(const MlaDecodeParams& p, const Maps& maps, uint32_t smem, uint32_t qbar, int b,
                                       int head0) {
  mbar_expect_tx(qbar, kBlocks * kQBlockBytes);
  const int qrow = b * p.heads + head0;
  tma_load_3d(smem + Smem::q, &maps.q_nope, 0, qrow, 0, qbar);
  tma_load_2d(smem + Smem::q + kLatentBlocks * kQBlockBytes, &maps.q_pe, 0, qrow, qbar);
}

// The producer: every tile of the split into the ring.
__device__ __forceinline__ void produce(const MlaDecodeParams& p, const Maps& maps, uint32_t smem, int box, int b,
                                        int len, int t0, int t1) {
  const uint32_t full = smem + Smem::bars, empty = full + 8 * kStages, qbar = empty + 8 * kStages;
  if (t0 >= t1) {  // an empty split: the consumers wait for nothing; Q must land before the CTA ends
    mbar_wait(qbar, 0);
    return;
  }
  const int32_t* table = p.page_table + int64_t(b) * p.max_pages;
  // The cache row of the box at token `tok`, or -box (outside the tensor: zeros).
  auto box_row = [&](int tok) {
    if (tok >= len) return -box;
    const int pg = tok / p.page_size;
    const int id = table[pg];
    return id >= 0 && id < p.num_pages ? id * p.page_size + (tok - pg * p.page_size) : -box;
  };
  for (int t = t0; t < t1; ++t) {
    const int i = t - t0, stage = i % kStages;
    if (i >= kStages) mbar_wait(empty + 8 * stage, ((i / kStages) - 1) & 1);
    const uint32_t buf = smem + Smem::kv + stage * kTileBytes;
    mbar_expect_tx(full + 8 * stage, kTileBytes);
    if (box == kTile) {  // the latent blocks in one box (maps.ckv from tensor_map_blocks), the rope block
      const int row = box_row(t * kTile);
      tma_load_3d(buf, &maps.ckv, 0, row, 0, full + 8 * stage);
      tma_load_2d(buf + kLatentBlocks * kBlockBytes, &maps.kpe, 0, row, full + 8 * stage);
      continue;
    }
    for (int g = 0; g < kTile; g += box) {
      const int row = box_row(t * kTile + g);
      for (int blk = 0; blk < kBlocks; ++blk)
        tma_load_2d(buf + blk * kBlockBytes + g * 128, blk < kLatentBlocks ? &maps.ckv : &maps.kpe,
                    blk < kLatentBlocks ? 64 * blk : 0, row, full + 8 * stage);
    }
  }
}

// Zeroes rows [valid, kTile) of latent blocks [blk0, blk0 + 4) of the tile at `buf`: rows past the
// sequence hold whatever the cache holds there, and 0 * NaN in P V would poison O (the masked
// scores ignore them otherwise). `tid`: 0..127 within the consumer.
__device__ __forceinline__ void zero_tail(uint32_t buf, int valid, int blk0, int tid) {
  const int rows = kTile - valid;
  for (int idx = tid; idx < rows * 4 * 8; idx += 128) {
    const int row = valid + idx / 32, blk = blk0 + (idx / 8) % 4, chunk = idx % 8;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(buf + blk * kBlockBytes + row * 128 + chunk * 16),
                 "r"(0u)
                 : "memory");
  }
}

// O[:, 256 c .. 256 c + 256) += P V for the tile at `buf` (P in its rope block, K-major in the
// 64-byte swizzle; V's four latent blocks of this half N-major). Issued and committed; the caller
// waits.
template <typename T>
__device__ __forceinline__ void issue_pv(float* o, uint32_t buf, int c) {
  const uint64_t p_desc = k_major64(buf + kLatentBlocks * kBlockBytes);
  const uint64_t v_desc = n_major(buf + 4 * c * kBlockBytes, kBlockBytes);
  wgmma_fence();
  fence_regs<128>(o);
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk)
    wgmma<Wgmma64x256<1>, T>(o, desc_add(p_desc, kk * 32), desc_add(v_desc, kk * 16 * 128), 1);
  wgmma_commit();
}

__device__ __forceinline__ void scale_rows(float* o, const float* alpha) {
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j] *= alpha[0], o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1], o[4 * j + 3] *= alpha[1];
    }
  }
}

__device__ __forceinline__ void st_shared2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ void ld_shared2(uint32_t addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
}

// Consumer c (0 or 1) of the tiles [t0, t1): S and the softmax of the tiles i = t - t0 with
// i % 2 == c, and P V over its 256 columns of O for every tile, in tile order (the seesaw: while one
// consumer does a softmax, the tensor cores run the other's S or P V). The running max is one chain
// over all tiles: tile i's softmax starts from the max after tile i - 1 (the other consumer's),
// which comes with that tile's P. Every wgmma group is waited for in the iteration that issues it
// (ptxas serialises wgmma whose accumulators stay in flight across a loop's back edge: C7514).
// l_run: this consumer's share of the row sums (its tiles' P), in the frame of the final max.
template <typename T>
__device__ __forceinline__ void consume(const MlaDecodeParams& p, uint32_t smem, int c, int len, int t0, int t1,
                                        float* o, float* l_run) {
  uint32_t qa[kRegSteps][4];  // Q's A fragments of the last kRegSteps k-steps
  const uint32_t full = smem + Smem::bars, empty = full + 8 * kStages, qbar = empty + 8 * kStages;
  const int tid = threadIdx.x - 128 * (c + 1), warp = tid / 32, lane = tid % 32;
  const int r0 = warp * 16 + lane / 4, q4 = lane % 4;  // this thread's rows: r0 and r0 + 8
  const float scale = p.sm_scale * kLog2e;
  const uint64_t q_desc = k_major(smem + Smem::q);
  const int n = t1 - t0;
  auto buffer = [&](int i) { return smem + Smem::kv + (i % kStages) * kTileBytes; };
  auto row_addr = [&](int i, int h) { return smem + Smem::rows + ((i % kStages) * kHeads + r0 + 8 * h) * 8; };
  // S = Q K^T over tile i's 32 tokens (asynchronous). s[4j + e] is row r0 (e < 2) or r0 + 8,
  // token 8j + 2 q4 + e % 2.
  float s[16];
  auto issue_s = [&](int i) {
    mbar_wait(full + 8 * (i % kStages), (i / kStages) & 1);
    const uint64_t k_desc = k_major(buffer(i));
    wgmma_fence();
    wgmma<Wgmma64x32<0>, T>(s, q_desc, k_desc);  // d = A B: s written only
#pragma unroll
    for (int step = 1; step < kSteps; ++step) {
      const uint32_t col = (step % 4) * 32;
      const uint64_t kd = desc_add(k_desc, (step / 4) * kBlockBytes + col);
      if (step < kSteps - kRegSteps)
        wgmma<Wgmma64x32<0>, T>(s, desc_add(q_desc, (step / 4) * kQBlockBytes + col), kd, 1);
      else
        wgmma<WgmmaRs64x32<0>, T>(s, qa[step - (kSteps - kRegSteps)], kd, 1);
    }
    wgmma_commit();
  };
  // The other consumer's tile i: wait for its P, rescale by its factors, issue its P V. The running
  // max after it, which our next softmax starts from, is read here too (off that softmax's path).
  float m_prev[2] = {-INFINITY, -INFINITY};
  auto issue_pv_of = [&](int i) {
    named_sync(kBarP + i % kStages, 256);
    float a[2];
    ld_shared2(row_addr(i, 0), a[0], m_prev[0]);
    ld_shared2(row_addr(i, 1), a[1], m_prev[1]);
    scale_rows(o, a);
    l_run[0] *= a[0], l_run[1] *= a[1];
    issue_pv<T>(o, buffer(i), c);
  };
  // The softmax of our tile i (its S done; m_prev the running max after tile i - 1): P into the
  // tile's rope block, the rescale factors and the running max after it into shared memory; alpha
  // and the row sums of P returned.
  auto softmax = [&](int i, float* alpha, float* sum) {
    const uint32_t buf = buffer(i);
    const int valid = len - (t0 + i) * kTile;  // tokens of this tile inside the sequence
    if (valid < kTile) {                       // V rows past the sequence: zeros for both consumers' P V
      zero_tail(buf, valid, 0, tid);
      zero_tail(buf, valid, 4, tid);
    }
    float mx[2] = {-INFINITY, -INFINITY};
    const int lim = valid - 2 * q4;  // token 8 j + 2 q4 + e is inside when 8 j + e < lim (immediates)
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = 8 * j + (e & 1) < lim ? s[4 * j + e] * scale : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
      }
    // The row maxima (over the row's four lanes) matter only where the running max moves, which a
    // thread's own scores show (attn::max_moves); on most tiles no row of the warp moves and the
    // shuffles, which queue behind the wgmma's shared-memory traffic, are skipped.
    float m[2] = {m_prev[0], m_prev[1]};
    if (__any_sync(0xffffffffu, attn::max_moves(m_prev[0], mx[0]) || attn::max_moves(m_prev[1], mx[1]))) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        if (attn::max_moves(m_prev[h], mx[h])) m[h] = attn::next_max(m_prev[h], mx[h]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      alpha[h] = attn::rescale(m_prev[h], m[h]);
      sum[h] = 0.f;
    }
    uint32_t pk[kTile / 8][2];  // P rounded, in the accumulator layout: rows r0 + 8 h, tokens 8 j + 2 q4
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float e0 = exp2_ftz(s[4 * j + 2 * h] - m[h]), e1 = exp2_ftz(s[4 * j + 2 * h + 1] - m[h]);
        sum[h] += e0 + e1;
        pk[j][h] = pack2<T>(e0, e1);
      }
    // P (64 x 32, 64-byte swizzle) by stmatrix: 8 x 8 pieces (h, j), lane l giving row l % 8 of
    // piece l / 8 of each group of four: (0, 2x), (1, 2x), (0, 2x + 1), (1, 2x + 1).
    const uint32_t pblock = buf + kLatentBlocks * kBlockBytes;
#pragma unroll
    for (int x = 0; x < kTile / 16; ++x) {
      const int piece = lane / 8, row = warp * 16 + 8 * (piece % 2) + lane % 8;
      stmatrix_x4(pblock + swizzled64(row, 8 * (2 * x + piece / 2)), pk[2 * x][0], pk[2 * x][1], pk[2 * x + 1][0],
                  pk[2 * x + 1][1]);
    }
    if (q4 == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        st_shared2(row_addr(i, h), alpha[h], m[h]);
      }
    }
  };
  // Our tile i after its softmax: O and l rescaled, P published, our P V issued and waited for.
  auto own_pv = [&](int i, const float* alpha, const float* sum) {
    scale_rows(o, alpha);
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + sum[h];
    fence_async_smem();                      // P and the zeroed rows visible to the wgmma of
    named_sync(kBarOwn + c, 128);            // this consumer
    named_arrive(kBarP + i % kStages, 256);  // and of the other
    issue_pv<T>(o, buffer(i), c);
    wgmma_wait<0>();
    fence_regs<128>(o);
    if (tid == 0) mbar_arrive(empty + 8 * (i % kStages));
  };

  fence_regs<128>(o);  // O's zeros in place before the first wgmma is in flight
  if (n <= 0) return;
  mbar_wait(qbar, 0);
  // This warp's 16 rows of Q for the register k-steps (the A layout of an m16n8k16 mma.sync per
  // warp: ldmatrix's four 8 x 8 pieces, rows then the k halves).
#pragma unroll
  for (int k = 0; k < kRegSteps; ++k) {
    const int step = kSteps - kRegSteps + k, row = warp * 16 + lane % 16;
    attn::ldmatrix_x4(qa[k],
                      smem + Smem::q + (step / 4) * kQBlockBytes + swizzled(row, (step % 4) * 16 + 8 * (lane / 16)));
  }
  float alpha[2], sum[2];
  int i = c;
  if (c == 0) {  // tile 0: nothing before it
    issue_s(0);
    wgmma_wait<0>();
    fence_regs<16>(s);
    softmax(0, alpha, sum);
    own_pv(0, alpha, sum);
    i = 2;
  }
  for (; i < n; i += 2) {
    issue_s(i);
    issue_pv_of(i - 1);
    wgmma_wait<1>();  // S(i); the other's P V still running
    fence_regs<16>(s);
    softmax(i, alpha, sum);
    wgmma_wait<0>();  // the other's P V
    fence_regs<128>(o);
    if (tid == 0) mbar_arrive(empty + 8 * ((i - 1) % kStages));
    own_pv(i, alpha, sum);
  }
  if (i == n) {  // the last tile is the other consumer's
    issue_pv_of(n - 1);
    wgmma_wait<0>();
    fence_regs<128>(o);
  }
}

// One CTA of the kernel; kPair: the grid's two KV splits of a (request, head group) are a cluster
// of two CTAs and merge here (see the epilogue), else a split's fp32 partial goes to the combine
// pass.
template <typename T, bool kPair>
__device__ __forceinline__ void decode_cta(const MlaDecodeParams& p, const int box, const Maps& maps) {
  extern __shared__ __align__(1024) unsigned char smem_window[];
  const uint32_t window = attn::smem_addr(smem_window);
  const uint32_t smem = (window + 1023) & ~1023u;
  unsigned char* base = smem_window + (smem - window);
  const uint32_t full = smem + Smem::bars, empty = full + 8 * kStages, qbar = empty + 8 * kStages;

  const int split = blockIdx.x, head0 = blockIdx.y * kHeads, b = blockIdx.z;
  // Warp-uniform, and so said to the compiler (warp_uniform): the tile loop's buffer addresses and
  // wgmma descriptors then stay in uniform registers.
  const int wg = warp_uniform(threadIdx.x / 128);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 2);  // one arrival per consumer warpgroup
    }
    mbar_init(qbar, 1);
    mbar_init_fence();
    tma_prefetch_map(&maps.ckv);
    tma_prefetch_map(&maps.kpe);
    load_q(p, maps, smem, qbar, b, head0);
  }
  const int len = warp_uniform(min(max(p.seq_lens[b], 0), p.max_pages * p.page_size));
  const int n_tiles = (len + kTile - 1) / kTile;
  const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t0 = min(n_tiles, split * per_split), t1 = min(n_tiles, t0 + per_split);
  __syncthreads();

  if (wg == 0) {  // producer: the fewest registers (kProducerRegs)
    regs_shrink<kProducerRegs>();
    if (threadIdx.x == 0) produce(p, maps, smem, box, b, len, t0, t1);
    if constexpr (kPair) {  // the epilogue's two cluster barriers
      cluster_sync();
      cluster_sync();
    }
    return;
  }
  regs_grow<kConsumerRegs>();
  const int c = wg - 1, tid = threadIdx.x - 128 * wg, lane = tid % 32;
  const int r0 = (tid / 32) * 16 + lane / 4, q4 = lane % 4;  // this thread's rows: r0 and r0 + 8
  float l_run[2] = {0.f, 0.f};
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  consume<T>(p, smem, c, len, t0, t1, o, l_run);
  // Both consumers' shares of the row sums (over the row's four threads, then the two consumers);
  // the row's max is the one after the last tile.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  float* lsum = reinterpret_cast<float*>(base + Smem::lsum);              // [2][kHeads]
  const float* rows = reinterpret_cast<const float*>(base + Smem::rows);  // [kStages][kHeads][alpha, max]
  if (q4 == 0) lsum[c * kHeads + r0] = l_run[0], lsum[c * kHeads + r0 + 8] = l_run[1];
  named_sync(kBarEnd, kConsumerThreads);
  grid_dependents_may_launch();
  float m_fin[2], l_fin[2];  // the rows' max and sum (an empty split: -inf, 0)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h;
    l_fin[h] = lsum[row] + lsum[kHeads + row];
    m_fin[h] = t1 > t0 ? rows[(((t1 - t0 - 1) % kStages) * kHeads + row) * 2 + 1] : -INFINITY;
  }
  // A pair of splits: CTA `rank` writes the output columns of its consumer c = rank (O's columns
  // 256 rank .. + 256). Its other consumer sends its O (fp32, unnormalised) and its rows' max and
  // sum into the ring of the peer CTA, where the consumer with the same c (the same rows and
  // columns in the same registers) weighs the two halves by their maxima, as the combine pass does.
  const int rank = kPair ? int(cluster_rank()) : 0;
  const bool writes = !kPair || c == rank;  // this consumer's columns are this CTA's output
  if constexpr (kPair) {
    const uint32_t xo = smem + Smem::kv + kStageBytes, xml = xo + kPeerOBytes;
    cluster_sync();  // both CTAs are past their tile loops: their rings are free
    if (!writes) {
      const uint32_t po = cluster_peer(xo, rank ^ 1), pml = cluster_peer(xml, rank ^ 1);
#pragma unroll
      for (int k = 0; k < 32; ++k)
        st_cluster4(po + (k * 128 + tid) * 16, o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
      if (q4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) st_cluster2(pml + (r0 + 8 * h) * 8, m_fin[h], l_fin[h]);
      }
    }
    cluster_sync();  // the peer's half is here
    if (writes) {
      float a[2], w[2];  // this split's and the peer's weights
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mp, lp;
        ld_shared2(xml + (r0 + 8 * h) * 8, mp, lp);
        const float m = fmaxf(m_fin[h], mp);
        a[h] = attn::rescale(m_fin[h], m), w[h] = attn::rescale(mp, m);
        m_fin[h] = m, l_fin[h] = a[h] * l_fin[h] + w[h] * lp;
      }
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        float4 v;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                     : "r"(xo + (k * 128 + tid) * 16));
        o[4 * k] = a[0] * o[4 * k] + w[0] * v.x, o[4 * k + 1] = a[0] * o[4 * k + 1] + w[0] * v.y;
        o[4 * k + 2] = a[1] * o[4 * k + 2] + w[1] * v.z, o[4 * k + 3] = a[1] * o[4 * k + 3] + w[1] * v.w;
      }
    }
  }
  // Normalised rows: the output (q's dtype) goes through the ring (idle now: every tile is consumed,
  // every wgmma done) and leaves in 16-byte rows (attention/row_stage.cuh), stored there from the
  // accumulator layout by stmatrix: 8 x 8 pieces (h, j), lane l giving row l % 8 of piece l / 8 of
  // each group of four, (0, 2x), (1, 2x), (0, 2x + 1), (1, 2x + 1), as P's. A split's fp32 partial
  // is stored directly: 8 rows x 32 bytes, whole sectors (staging it was slower: see
  // docs/perf/mla_decode.md).
  const bool partial = !kPair && p.num_splits > 1;
  const uint32_t stage = smem + Smem::kv;
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h, head = head0 + row;
    inv[h] = l_fin[h] > 0.f ? 1.f / l_fin[h] : 0.f;
    const int64_t bh = int64_t(b) * p.heads + min(head, p.heads - 1);
    if (partial && head < p.heads) {
      float* out = p.partial_o + (int64_t(split) * p.batch * p.heads + bh) * kMlaDimCkv + 256 * c + 2 * q4;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(out + 8 * j) = make_float2(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
    }
    if (c == rank && q4 == 0 && head < p.heads) {
      const float lse2 = attn::lse2(m_fin[h], l_fin[h]);
      if (partial)
        p.partial_lse[int64_t(split) * p.batch * p.heads + bh] = lse2;
      else if (p.lse != nullptr)
        p.lse[bh] = lse2 * kLn2;
    }
  }
  if (!partial) {
    if (writes) {
      const int piece = lane / 8, row = (tid / 32) * 16 + 8 * (piece % 2) + lane % 8;
#pragma unroll
      for (int x = 0; x < 16; ++x) {
        const float* f = o + 8 * x;  // (h 0, j 2x), (1, 2x), (0, 2x + 1), (1, 2x + 1): two values each
        stmatrix_x4(attn::stage_addr(stage, kRowBytes<T>, row, 2 * (256 * c + 8 * (2 * x + piece / 2))),
                    pack2<T>(f[0] * inv[0], f[1] * inv[0]), pack2<T>(f[2] * inv[1], f[3] * inv[1]),
                    pack2<T>(f[4] * inv[0], f[5] * inv[0]), pack2<T>(f[6] * inv[1], f[7] * inv[1]));
      }
    }
    named_sync(kBarEnd, kConsumerThreads);
    attn::copy_out(stage, kRowBytes<T>, min(kHeads, p.heads - head0),
                   static_cast<T*>(p.out) + (int64_t(b) * p.heads + head0) * kMlaDimCkv, threadIdx.x - 128,
                   kConsumerThreads, kPair ? rank * kRowBytes<T> / 2 : 0, kPair ? kRowBytes<T> / 2 : kRowBytes<T>);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_sm90a_kernel(const MlaDecodeParams p, const int box, const __grid_constant__ Maps maps) {
  decode_cta<T, false>(p, box, maps);
}

// Two KV splits, merged in the kernel: the grid's x dimension (the splits) in clusters of two.
template <typename T>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
    mla_decode_sm90a_pair_kernel(const MlaDecodeParams p, const int box, const __grid_constant__ Maps maps) {
  decode_cta<T, true>(p, box, maps);
}

void check(cudaError_t e, const char* what) { check_cuda(e, "mla_decode (sm90a)", what); }

// The kernel for a dtype, and for a plan's cluster (1, or 2: a pair of splits merged in the kernel).
template <typename F>
void with_kernel(int dtype, int cluster, F&& f) {
  if (cluster == 2)
    f(dtype == kBF16 ? mla_decode_sm90a_pair_kernel<__nv_bfloat16> : mla_decode_sm90a_pair_kernel<__half>);
  else
    f(dtype == kBF16 ? mla_decode_sm90a_kernel<__nv_bfloat16> : mla_decode_sm90a_kernel<__half>);
}

// Lets `kernel` take the CTA's shared memory (Smem::bytes, above the default limit).
template <typename K>
void allow_smem(K kernel) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem::bytes), "smem attribute");
}

// Whether the device holds `ctas` clusters of the pair kernel at once (a cluster's CTAs share a GPC,
// so fewer may fit than SMs allow). Then two splits merge in the kernel (no partials, no combine
// pass); else the combine pass merges them. Clusters of 3 to 8 splits, merged the same way, did
// not fit one wave where the split rule asks for them (H200: docs/perf/mla_decode.md).
bool pairs_fit(int device, int ctas) {
  const DeviceGuard guard(device, "mla_decode");
  const auto kernel = mla_decode_sm90a_pair_kernel<__nv_bfloat16>;  // the fp16 one's resources are the same
  allow_smem(kernel);                                               // the plan may come before the prewarm
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2, 1, unsigned(ctas)), cfg.blockDim = kThreads, cfg.dynamicSmemBytes = Smem::bytes;
  int fit = 0;
  check(cudaOccupancyMaxActiveClusters(&fit, kernel, &cfg), "cluster occupancy");
  return fit >= ctas;
}

// Rows a TMA box of the cache covers: the largest power of two <= 32 that divides the page size.
int box_rows(int page_size) { return std::gcd(page_size, kTile); }

// This family's grid on a device of `sms` SMs (one CTA an SM): the KV splits, the CTAs (requests x head
// groups x splits) and the tiles each CTA walks.
struct Grid {
  int splits;
  int64_t ctas;
  int tiles_per_cta;
};
Grid plan_grid(int sms, int batch, int heads, int max_pages, int page_size) {
  const int ctas = batch * ((heads + kHeads - 1) / kHeads);
  const int tiles = std::max(1, int((int64_t(max_pages) * page_size + kTile - 1) / kTile));
  const int splits = mla_num_splits(sms, ctas, tiles);
  return {splits, int64_t(ctas) * splits, (tiles + splits - 1) / splits};
}

}  // namespace

// With 16 heads or fewer the call is memory-bound and three quarters of each wgmma tile are padding.
// This kernel (one CTA an SM, a ring of four tiles) against the portable one (16-head CTAs, two an SM),
// H200 (docs/perf/mla_decode.md, Shapes it declines): 3-15% faster where its grid fits one wave and
// its CTAs walk 32 tiles or fewer, and 15-38% faster where the splits are at their most (both
// kernels then run as many CTAs, one an SM); 4-8% slower on longer walks, 8-16% on grids of two waves;
// level on calls of less cache than kFewHeadsMinTokens, whose eager launch costs the host more here.
const char* mla_decode_declines(int sms, int batch, int heads, int max_pages, int page_size) {
  if (page_size % 16 != 0) return "page size not a multiple of 16: its TMA boxes need 16-row steps";
  if (heads > kFewHeads) return nullptr;
  if (int64_t(batch) * max_pages * page_size < kFewHeadsMinTokens)
    return "16 heads or fewer on a cache of fewer than 16384 tokens (batch x page-table capacity): both kernels "
           "take as long there, and the portable one's launch costs the host less";
  const Grid g = plan_grid(sms, batch, heads, max_pages, page_size);
  if (g.ctas > sms)
    return "16 heads or fewer on more requests than the device has SMs: the portable kernel's 16-head CTAs, two "
           "an SM, run them in one wave";
  if (g.tiles_per_cta > kFewHeadsTiles && g.splits < kMlaMaxSplits)
    return "16 heads or fewer, with more than 32 KV tiles (1024 tokens) a CTA: there the portable kernel's 16-head "
           "CTAs, two an SM, read the cache faster";
  return nullptr;
}

MlaDecodePlan mla_decode_plan(int device, int batch, int heads, int max_pages, int page_size, int config, bool) {
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount, "mla_decode (sm90a)");
  if (const char* why = mla_decode_declines(sms, batch, heads, max_pages, page_size))
    throw std::invalid_argument(std::string("mla_decode (sm90a) does not serve this shape: ") + why);
  if (config > 0)
    throw std::invalid_argument("mla_decode (sm90a): configuration " + std::to_string(config) +
                                " does not exist (there is one, 0)");
  if (device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "mla_decode (sm90a)") < Smem::bytes)
    throw std::runtime_error("mla_decode (sm90a): the device's shared memory per block is below " +
                             std::to_string(Smem::bytes) + " bytes");
  MlaDecodePlan plan{};
  plan.config = 0;
  plan.loader = kMlaLoadTma;
  plan.heads_per_cta = kHeads;
  plan.tile_tokens = kTile;
  plan.smem_bytes = Smem::bytes;
  const Grid g = plan_grid(sms, batch, heads, max_pages, page_size);
  plan.num_splits = g.splits;
  plan.cluster = g.splits == 2 && pairs_fit(device, int(g.ctas / g.splits)) ? 2 : 1;  // a cluster per split pair
  return plan;
}

void mla_decode_prewarm(int device) {
  const DeviceGuard guard(device, "mla_decode");
  if (device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "mla_decode (sm90a)") >= Smem::bytes)
    for (int dtype : {kBF16, kF16})
      for (int cluster : {1, 2}) with_kernel(dtype, cluster, [](auto kernel) { allow_smem(kernel); });
  encode_tiled("mla_decode");
  mla_combine_prewarm();
}

void mla_decode_launch(const MlaDecodeParams& p, const MlaDecodePlan& plan, int device, uintptr_t stream_handle,
                       EagerGraph* graph) {
  if (p.dtype != kBF16 && p.dtype != kF16) throw std::invalid_argument("mla_decode: dtype must be bf16 or fp16");
  if (int64_t(p.num_pages) * p.page_size > INT32_MAX)
    throw std::invalid_argument("mla_decode: the cache has more than 2^31 - 1 token rows (num_pages * page_size)");
  if (p.page_size % 16 != 0 || plan.config != 0 || plan.loader != kMlaLoadTma || plan.num_splits != p.num_splits ||
      p.num_splits < 1 || p.num_splits > kMlaMaxSplits ||
      (plan.cluster != 1 && !(plan.cluster == 2 && p.num_splits == 2)))
    throw std::invalid_argument("mla_decode: the plan does not fit this call (compute it with mla_decode_plan)");
  const DeviceGuard guard(device, "mla_decode");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int box = box_rows(p.page_size);
  const int64_t rows = int64_t(p.num_pages) * p.page_size, qrows = int64_t(p.batch) * p.heads;
  Maps maps;
  maps.q_nope = tensor_map_blocks(p.q_nope, qrows, kMlaDimCkv, 64, kHeads, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  maps.q_pe = tensor_map_2d(p.q_pe, qrows, kMlaDimPe, 64, kHeads, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  maps.ckv = box == kTile
                 ? tensor_map_blocks(p.ckv, rows, kMlaDimCkv, 64, box, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode")
                 : tensor_map_2d(p.ckv, rows, kMlaDimCkv, 64, box, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  maps.kpe = tensor_map_2d(p.kpe, rows, kMlaDimPe, 64, box, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  const dim3 grid(p.num_splits, (p.heads + kHeads - 1) / kHeads, p.batch);
  Launches launches;
  launches.op = "mla_decode (sm90a)";
  with_kernel(p.dtype, plan.cluster,
              [&](auto kernel) { launches.add(kernel, grid, kThreads, Smem::bytes, false, p, box, maps); });
  if (p.num_splits > 1 && plan.cluster == 1) mla_combine(p, true, launches);
  run_launches(launches, stream, graph);
}

}  // namespace hmoe
