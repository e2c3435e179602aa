// The portable prefill attention kernel (FlashAttention-2 style, mma.sync m16n8k16; sm_80 and
// newer), one body for both KV sources: a loader policy (RaggedRows, PagedRows) says which row of k
// and v holds a request's key j. Instantiated per head dims by prefill_portable_d<Dqk>.cu.
//
// One CTA = one q tile (32 rows a warp, 4 or 8 warps; one request, one head). Q stays in
// shared memory (it is re-read for every key tile: registers hold O and S), keys and values come
// in tiles of kBN rows through cp.async, or on sm_90 and newer through the TMA (one 3-d box a
// matrix issued by warp 0, or for pages smaller than the tile a box a page and block spread over the
// warps, completing on an mbarrier) wherever the tile lies whole inside the request (RaggedTma;
// PagedTma where pages hold whole tiles, PagedTmaParts where pages of 8 keys or more make one; a
// request's last, partial tile takes cp.async). Per tile:
//   S = Q K^T    each warp its 32 rows x kBN keys, fp32 accumulators (K fragments feed 2 mma)
//   softmax      online, log2 domain, attention/softmax.cuh's rules (lazy max, skipped rescale);
//                the mask only on tiles that cross the causal diagonal or the sequence's end
//   O += P V     P rounded to the input dtype in registers (the mma A layout), fp32 O
// The output is rounded once, staged in the warp's own Q rows and written in 16-byte rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/mbarrier.cuh"
#include "attention/mma.cuh"
#include "attention/page_walk.cuh"
#include "attention/softmax.cuh"
#include "common/cuda_util.h"
#include "hmoe/prefill.h"
#include "prefill/prefill_portable.h"
#include "prefill/prefill_schedule.cuh"

namespace hmoe {
namespace prefill {

using attn::cp_async16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::exp2_ftz;
using attn::ldmatrix_x4;
using attn::ldmatrix_x4_trans;
using attn::mma16816;
using attn::smem_addr;

// A tile configuration: head dims, keys per step, K's shared-memory buffers (1: K(t+1) loads
// while S(t) is consumed, two barriers a tile; 2: K and V of tile t+1 load during all of tile t,
// one barrier a tile; V always has two) and warps (32 query rows each: 4 warps, two CTAs an SM; 8
// warps, one CTA an SM sharing each K/V tile between twice the rows).
template <int DQK, int DV, int BN, int KSTAGES, int WARPS>
struct Config {
  static constexpr int kDqk = DQK, kDv = DV, kBN = BN, kKStages = KSTAGES;
  static constexpr int kWarps = WARPS, kThreads = 32 * kWarps, kBM = 32 * kWarps;
  static constexpr int kMinBlocks = kWarps == 4 ? 2 : 1;   // CTAs an SM holds (registers <= 255 either way)
  static constexpr int kQRow = 2 * kDqk, kVRow = 2 * kDv;  // bytes of a row of Q, K, V
  static constexpr int kBlock = kBN * 128;                 // a K or V tile's block of 64 columns
  // Offsets from the base (kPortableAlign-aligned where the TMA copies: the launcher adds that much
  // slack): Q, the K buffers, the two V buffers, the TMA's mbarriers (K's, then V's).
  static constexpr int q_s = 0;
  static constexpr int k_s = q_s + kBM * kQRow;
  static constexpr int v_s = k_s + kKStages * kBN * kQRow;
  static constexpr int bars = v_s + 2 * kBN * kVRow;
  static constexpr int kSmem = portable_smem(PortableConfig{DQK, DV, BN, KSTAGES, WARPS});
  static_assert(bars + 8 * (kKStages + 2) + kPortableAlign == kSmem, "portable_smem spells out this layout");
  static_assert(k_s % kPortableAlign == 0 && kBN * kQRow % kPortableAlign == 0 && kBN * kVRow % kPortableAlign == 0 &&
                    kBlock % kPortableAlign == 0,
                "K and V blocks start on the 128-byte swizzle's period");
  static_assert(kDqk % 64 == 0 && kDv % 64 == 0 && kDv <= kDqk, "rows of whole 128-byte lines; O fits in Q's rows");
  static_assert((kBN & (kBN - 1)) == 0 && kBN / 8 * (kDqk / 64) <= 32,
                "PagedTma: the pages that divide a tile are powers of two, their boxes one a lane of a warp");
  static_assert(kBN % (kThreads / 8) == 0 && (KSTAGES == 1 || KSTAGES == 2) && (kWarps == 4 || kWarps == 8),
                "tile shape: whole copy passes of kThreads / 8 rows");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows start kRow bytes apart and
// whose 128-byte lines of a row (8 chunks each) lie kLine bytes apart: chunks are XOR-swizzled by
// the row's low 3 bits inside each line, so the 8 rows of an ldmatrix hit 8 distinct bank groups
// and 8 threads copying a line write it whole. Q is row by row (kRow = its row, kLine = 128); K and
// V are blocks of 64 columns (kRow = 128, kLine = the block), the layout of the TMA's 3-d box with
// the 128-byte swizzle.
template <int kRow, int kLine>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return row * kRow + (chunk >> 3) * kLine + (((chunk ^ row) & 7) << 4);
}

// Key j of a ragged request: row kv0 + j of k and v.
struct RaggedRows {
  static constexpr bool kTma = false;
  int kv0, lk;
  __device__ __forceinline__ RaggedRows(const PrefillParams&, int, const Request& r) : kv0(r.kv0), lk(r.lk) {}
  __device__ __forceinline__ int row(const PrefillParams&, int j) const { return j < lk ? kv0 + j : -1; }
};

// The same keys, with the tiles that lie whole inside the request copied by the TMA on sm_90 and
// newer (PortableMaps; compiled as RaggedRows below sm_90, where the launcher never picks it).
// tma_tile: the TMA policies' copy of one matrix (D columns: the head's D / 64 blocks of 64, kBlock
// bytes apart in the tile) of the BN-key tile from key j (j + BN <= lk) into `dst`, completing on the
// mbarrier at `bar` (one arrival, with the tile's bytes); called by every warp of the CTA (`warp` of
// NW), converged.
struct RaggedTma : RaggedRows {
  static constexpr bool kTma = true;
  using RaggedRows::RaggedRows;
  template <int BN, int D, int kBlock, int NW>
  __device__ __forceinline__ void tma_tile(const PrefillParams&, const CUtensorMap* map, uint32_t dst, int j, int kvh,
                                           uint32_t bar, int warp) const {
    if (warp == 0) attn::sm90::tma_load_3d_elected(dst, map, 0, kv0 + j, kvh * (D / 64), bar, BN * 2 * D);
  }
};

// Key j of a paged request: the cache row the page table names (attention/page_walk.cuh's rules).
struct PagedRows {
  static constexpr bool kTma = false;
  attn::PageLookup pages;
  __device__ __forceinline__ PagedRows(const PrefillParams& p, int b, const Request& r)
      : pages{p.page_table + int64_t(b) * p.max_pages, r.lk, p.page_size, p.num_pages, attn::PageDivisor(p.page_size)} {
  }
  __device__ __forceinline__ int row(const PrefillParams&, int j) const { return pages.row(j); }
};

// The same keys for page sizes that are powers of two and multiples of the tile (paged_tma_rows),
// the tiles that lie whole inside the request copied by the TMA (as RaggedTma). It keeps only the
// request and its length: the page lookup's fields come from the params at each use (holding them
// across the loop, as PagedRows does, made ptxas spill 184 bytes at 192 x 128), the page-table entry
// from L1 (a line holds 32 tiles' entries). A bad page id gives a box before the tensor, which the
// TMA fills with zeros.
struct PagedTma {
  static constexpr bool kTma = true;
  int b, lk;
  __device__ __forceinline__ PagedTma(const PrefillParams&, int b_, const Request& r) : b(b_), lk(r.lk) {}
  // The page size is a power of two (paged_tma_rows), so the page and the offset are a shift and a
  // mask: a division's latency would hold up the warp that issues the TMA copy.
  __device__ __forceinline__ int row(const PrefillParams& p, int j) const {
    if (j >= lk) return -1;
    const int page = p.page_size;
    return attn::cache_row(p.page_table[int64_t(b) * p.max_pages + (j >> (__ffs(page) - 1))], j & (page - 1), page,
                           p.num_pages);
  }
  template <int BN, int D, int kBlock, int NW>
  __device__ __forceinline__ void tma_tile(const PrefillParams& p, const CUtensorMap* map, uint32_t dst, int j, int kvh,
                                           uint32_t bar, int warp) const {
    if (warp == 0) {
      const int row = this->row(p, j);
      attn::sm90::tma_load_3d_elected(dst, map, 0, row < 0 ? -BN : row, kvh * (D / 64), bar, BN * 2 * D);
    }
  }
};

// The same keys for pages of 8 keys or more that make a tile (paged_tma_rows: a power of two below
// it): the tile's BN / page pages come by TMA a box a page and 64-column block (page k lands at rows k
// * page of each block, a multiple of the swizzle's 8-row period), the boxes spread over the warps
// (box i = lane * NW + warp), so that no warp alone pays for issuing them (192 x 128 on an H200:
// warp 0 issuing them all took 9% and 3% fewer cycles than cp.async at pages 32 and 16, spread 15%
// and 13%). The launcher takes it for the configurations with one K buffer only (kTmaParts,
// prefill_portable_kernels.cuh).
struct PagedTmaParts : PagedTma {
  using PagedTma::PagedTma;
  template <int BN, int D, int kBlock, int NW>
  __device__ __forceinline__ void tma_tile(const PrefillParams& p, const CUtensorMap* map, uint32_t dst, int j, int kvh,
                                           uint32_t bar, int warp) const {
    constexpr int kBlocks = D / 64;
    const int rows = p.page_size, lane = threadIdx.x % 32, i = lane * NW + warp;
    const bool mine = i * rows < BN * kBlocks;  // i below the tile's pages x blocks
    // Every lane reads an entry before the branch (a lane without a box page 0's), so that the
    // compiler may issue the reads early.
    const int k = mine ? i / kBlocks : 0, blk = i - k * kBlocks;
    const int row = this->row(p, j + k * rows), y = row < 0 ? -rows : row;
    // The phase's one arrival; copies that complete before it leave it waiting for it.
    if (i == 0) attn::sm90::mbar_expect_tx(bar, BN * 2 * D);
    if (mine) attn::sm90::tma_load_3d(dst + blk * kBlock + k * rows * 128, map, 0, y, kvh * kBlocks + blk, bar);
  }
};

// Copies ROWS rows of D 16-bit elements into a swizzled tile at `dst` (swz<kRow, kLine>): row r of
// the tile from row row_of(r) of the matrix at `base` (rows `stride` bytes apart), or zeros where
// row_of(r) < 0 (the copy then names row 0 and reads nothing). 8 threads a row (each D / 64
// chunks), NT / 8 rows a pass. Rows and strides are int32 (the launchers check that every row index
// fits), so each row's address is one 32 x 32 -> 64-bit multiply-add.
template <int D, int ROWS, int NT, int kRow, int kLine, typename RowOf>
__device__ __forceinline__ void copy_rows(uint32_t dst, const char* base, int stride, RowOf row_of) {
  constexpr int kRowsPerPass = NT / 8;
  static_assert(ROWS % kRowsPerPass == 0, "whole passes");
  const int c0 = threadIdx.x % 8, r0 = threadIdx.x / 8;
#pragma unroll
  for (int pass = 0; pass < ROWS / kRowsPerPass; ++pass) {
    const int r = r0 + pass * kRowsPerPass;
    const int row = row_of(r);
    const char* src = base + int64_t(max(row, 0)) * stride + c0 * 16;
    const uint32_t d = dst + swz<kRow, kLine>(r, c0);
#pragma unroll
    for (int i = 0; i < D / 64; ++i) cp_async16(d + i * kLine, src + i * 128, row < 0);  // chunk c0 + 8 i
  }
}

// maps: the TMA's views of k and v (RaggedTma on sm_90+ only; unused otherwise).
template <typename T, typename C, typename Kv>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    prefill_kernel(const PrefillParams p, const __grid_constant__ PortableMaps maps) {
  constexpr int BM = C::kBM, BN = C::kBN, DQK = C::kDqk, DV = C::kDv, NT = C::kThreads;
  constexpr int kN8 = BN / 8;    // n8 tiles of S
  constexpr int kO8 = DV / 8;    // n8 tiles of O
  constexpr int kKs = DQK / 16;  // k16 steps of S
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kTma = Kv::kTma;
#else
  constexpr bool kTma = false;
#endif
  extern __shared__ __align__(128) unsigned char smem_window[];

  const int slot = blockIdx.x % p.max_items, h = blockIdx.x / p.max_items;
  const int2 item = reinterpret_cast<const int2*>(p.workspace)[slot];
  if (item.x < 0) return;  // an unused slot of the work list
  const int b = item.x;
  const Request r = request(p, b);
  const QTile tile = q_tile(r, item.y, BM, kPortableQOrder);
  const int q_first = tile.first, q_rows = tile.rows;
  const int kvh = h / (p.heads / p.kv_heads);
  const int n_keys = visible_keys(r, p.causal, q_first + q_rows - 1);  // what the last row sees
  const int n_tiles = (n_keys + BN - 1) / BN;
  const float c = p.sm_scale * attn::kLog2e;
  // Tiles every row sees whole need no mask (the fast softmax also needs c > 0: see below).
  const int n_full = c > 0.f ? visible_keys(r, p.causal, q_first) / BN : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
  T* out = static_cast<T*>(p.out) + (int64_t(r.q0 + q_first) * p.heads + h) * DV;

  if (n_tiles == 0) {  // no key for any row: out = 0, lse = -inf
    for (int i = threadIdx.x; i < q_rows * (DV / 8); i += NT)
      st_global16(out + int64_t(i / (DV / 8)) * p.heads * DV + (i % (DV / 8)) * 8, make_uint4(0, 0, 0, 0));
    if (p.lse != nullptr)
      for (int i = threadIdx.x; i < q_rows; i += NT) p.lse[int64_t(r.q0 + q_first + i) * p.heads + h] = -INFINITY;
    return;
  }

  // The TMA's boxes need the swizzle's period (the launcher's slack); the cp.async layout does not,
  // and there the window's own address (folded into immediates) saves registers (sm_80: 24 bytes
  // spilled against 112).
  const uint32_t smem =
      kTma ? (smem_addr(smem_window) + kPortableAlign - 1) & ~uint32_t(kPortableAlign - 1) : smem_addr(smem_window);
  const uint32_t q_s = smem + C::q_s, k_s = smem + C::k_s, v_s = smem + C::v_s;
  const Kv kv(p, b, r);
  // The TMA's tiles: those that lie whole inside the request (the others, and every tile without
  // RaggedTma, go by cp.async). A buffer's mbarrier completes a phase per TMA tile it receives, and
  // every tile before a TMA tile is one too, so its parity is the buffer's use count mod 2.
  auto by_tma = [&](int t) {
    if constexpr (kTma)
      return t < n_tiles && (t + 1) * BN <= r.lk;
    else
      return false;
  };
  auto k_bar = [&](int t) { return smem + C::bars + (C::kKStages == 2 ? (t & 1) * 8 : 0); };
  auto v_bar = [&](int t) { return smem + C::bars + 8 * C::kKStages + (t & 1) * 8; };
  // Tile t of K or V into `dst`; a tile past the last (t == n_tiles) is zeros and reads nothing, so
  // that the next tile's copies need no branch (see the tile loop). The bases are rebuilt from the
  // params (constant memory) at each use: registers are scarce next to O and S.
  auto tile_rows = [&](int t) { return [&, t](int i) { return t < n_tiles ? kv.row(p, t * BN + i) : -1; }; };
  // One matrix of tile t (d: its columns, the head's d / 64 blocks; base: k or v) into `dst`: warp
  // 0's elected lane issues the TMA's box, on its buffer's mbarrier bar(t), where it may; every
  // thread its cp.async rows else.
  auto load = [&](auto d, int t, uint32_t dst, const CUtensorMap* map, const void* base, auto bar) {
    constexpr int D = decltype(d)::value;
    if constexpr (kTma) {
      if (by_tma(t)) {
        kv.template tma_tile<BN, D, C::kBlock, C::kWarps>(p, map, dst, t * BN, kvh, bar(t), warp);
        return;
      }
    }
    const char* g = static_cast<const char*>(base) + int64_t(kvh) * D * 2;
    copy_rows<D, BN, NT, 128, C::kBlock>(dst, g, p.kv_heads * D * 2, tile_rows(t));
  };
  auto load_k = [&](int t, uint32_t dst) { load(std::integral_constant<int, DQK>{}, t, dst, &maps.k, p.k, k_bar); };
  auto load_v = [&](int t, uint32_t dst) { load(std::integral_constant<int, DV>{}, t, dst, &maps.v, p.v, v_bar); };
  const char* qg = static_cast<const char*>(p.q) + (int64_t(r.q0 + q_first) * p.heads + h) * DQK * 2;
  copy_rows<DQK, BM, NT, C::kQRow, 128>(q_s, qg, p.heads * DQK * 2, [&](int i) { return i < q_rows ? i : -1; });
  if constexpr (kTma) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < C::kKStages + 2; ++i) attn::sm90::mbar_init(smem + C::bars + 8 * i, 1);
      attn::sm90::mbar_init_fence();
    }
    __syncthreads();  // the mbarriers are initialised before any copy completes on them or waits
  }
  // This thread's rows of S and O: 16 mi + g + 8 hf of the warp's 32.
  float o[2][kO8][4], m_run[2][2], l_run[2][2];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int j = 0; j < kO8; ++j) o[mi][j][0] = o[mi][j][1] = o[mi][j][2] = o[mi][j][3] = 0.f;
    m_run[mi][0] = m_run[mi][1] = -INFINITY;
    l_run[mi][0] = l_run[mi][1] = 0.f;
  }
  // ldmatrix rows of this lane and the XOR its chunks take (swz with the row's low bits = lane's).
  const uint32_t q_lane = q_s + (32 * warp + (lane & 15)) * C::kQRow;
  const uint32_t k_lane = ((lane & 7) + ((lane >> 4) << 3)) * 128;
  const uint32_t v_lane = (lane & 15) * 128;
  const int xq = (lane >> 4) ^ (lane & 7), xk = ((lane >> 3) & 1) ^ (lane & 7);
  auto k_buf = [&](int t) { return k_s + (C::kKStages == 2 ? (t & 1) * BN * C::kQRow : 0); };
  auto v_buf = [&](int t) { return v_s + (t & 1) * BN * C::kVRow; };

  // S = Q K^T for tile t: each K fragment feeds both of the warp's 16-row halves. With one K
  // buffer, tile t + 1's V is issued after the first k step, among the products.
  auto scores = [&](float (&s)[2][kN8][4], int t) {
    const uint32_t kbuf = k_buf(t);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int j = 0; j < kN8; ++j) s[mi][j][0] = s[mi][j][1] = s[mi][j][2] = s[mi][j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKs; ++ks) {
      const uint32_t col_q = ((ks >> 2) << 7) + ((((ks & 3) << 1) ^ xq) << 4);
      const uint32_t col_k = (ks >> 2) * C::kBlock + ((((ks & 3) << 1) ^ xk) << 4);
      uint32_t qa[2][4];
      ldmatrix_x4(qa[0], q_lane + col_q);
      ldmatrix_x4(qa[1], q_lane + 16 * C::kQRow + col_q);
#pragma unroll
      for (int j = 0; j < kN8; j += 2) {
        uint32_t kb[4];
        ldmatrix_x4(kb, kbuf + j * 8 * 128 + k_lane + col_k);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma16816<T>(s[mi][j], qa[mi], kb);
          mma16816<T>(s[mi][j + 1], qa[mi], kb + 2);
        }
      }
      if constexpr (C::kKStages == 1) {
        if (ks == 0) {
          load_v(t + 1, v_buf(t + 1));
          cp_async_commit();
        }
      }
    }
  };

  // Online softmax of tile t, one of this thread's rows (mi, hf) at a time: S into P in place, the
  // row's rescale factor into alpha. Fast path (no mask, c > 0): the row max of the raw scores
  // times c, and p = 2^(s c - m) in one FFMA and one ex2. Masked path: scores scaled first (any
  // sign of c), keys the row does not see set to -inf. The running max moves lazily
  // (softmax.cuh), so on most tiles alpha is 1 in every row of the warp and O is not rescaled
  // (rescale_o). Every call passes `masked` as a literal: inlined, the path holds no branch.
  //
  // With two K buffers the fast path first guesses that the running max stays: p = 2^(s c - m)
  // with m as it stands, a row at a time. Where every p of the row stays at most 2^kLazy in all of
  // its threads (each thread's partial sum shows it; NaN and inf, as on a row's first tile, fail
  // the test), the lazy rule keeps m and these are its p, so the row max, its shuffles and the
  // rescale are skipped; a row that fails takes the full rule. With one K buffer (192 x 128) it
  // gained nothing and made ptxas spill (docs/perf/prefill.md).
  constexpr bool kGuess = C::kKStages == 2;
  float alpha[2][2];
  bool rescaled = false;  // warp-uniform: some row of the tile took the full rule
  // Row (mi, hf)'s p = 2^(s c - m) (masked: s scaled already, 2^(s - m)), rounded to T (the
  // precision contract) and packed for P V into pk; returns their sum.
  auto row_p = [&](const float (&s)[2][kN8][4], uint32_t (&pk)[2][kN8][2], const bool masked, int mi, int hf, float m) {
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kN8; ++j) {
      const float* x = &s[mi][j][2 * hf];
      const float p0 = exp2_ftz(masked ? x[0] - m : fmaf(x[0], c, -m));
      const float p1 = exp2_ftz(masked ? x[1] - m : fmaf(x[1], c, -m));
      sum += p0 + p1;
      pk[mi][j][hf] = pack2<T>(p0, p1);
    }
    return sum;
  };
  auto softmax_row = [&](float (&s)[2][kN8][4], uint32_t (&pk)[2][kN8][2], int t, const bool masked, int mi, int hf) {
    if (kGuess && !masked) {
      const float sum = row_p(s, pk, false, mi, hf, m_run[mi][hf]);
      if (!__any_sync(0xffffffffu, !(sum <= attn::kLazyP))) {
        alpha[mi][hf] = 1.f;
        l_run[mi][hf] += sum;
        return;
      }
      rescaled = true;
    }
    float mx = -INFINITY;
    if (masked) {
      const int lim = visible_keys(r, p.causal, q_first + 32 * warp + 16 * mi + g + 8 * hf) - t * BN;
#pragma unroll
      for (int j = 0; j < kN8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[mi][j][2 * hf + e];
          x = 8 * j + 2 * tq + e < lim ? x * c : -INFINITY;
          mx = fmaxf(mx, x);
        }
    } else {
#pragma unroll
      for (int j = 0; j < kN8; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * hf], s[mi][j][2 * hf + 1]));
      mx *= c;
    }
    mx = warp_max<4>(mx);  // the row's 4 threads
    const float m_new = attn::next_max(m_run[mi][hf], mx);
    alpha[mi][hf] = attn::rescale(m_run[mi][hf], m_new);
    m_run[mi][hf] = m_new;
    l_run[mi][hf] = l_run[mi][hf] * alpha[mi][hf] + row_p(s, pk, masked, mi, hf, m_new);
  };
  auto rescale_o = [&]() {
    const bool moved = alpha[0][0] != 1.f || alpha[0][1] != 1.f || alpha[1][0] != 1.f || alpha[1][1] != 1.f;
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < kO8; ++j) {
          o[mi][j][0] *= alpha[mi][0];
          o[mi][j][1] *= alpha[mi][0];
          o[mi][j][2] *= alpha[mi][1];
          o[mi][j][3] *= alpha[mi][1];
        }
    }
  };
  auto softmax = [&](float (&s)[2][kN8][4], uint32_t (&pk)[2][kN8][2], int t, const bool masked) {
    rescaled = !kGuess || masked;
#pragma unroll
    for (int row = 0; row < 4; ++row) softmax_row(s, pk, t, masked, row / 2, row % 2);
    if (rescaled) rescale_o();
  };

  // O += P V for tile t: P's C fragments of two n8 tiles (packed by softmax_row) are the A
  // fragment of one k16 step. With one K buffer, tile t + 1's K is issued after the first k16 step,
  // or before it where the TMA may copy it.
  auto accumulate = [&](const uint32_t (&pk)[2][kN8][2], int t) {
    const uint32_t vbuf = v_buf(t);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      if constexpr (C::kKStages == 1) {
        if (kk == (kTma ? 0 : 1)) {
          load_k(t + 1, k_s);
          cp_async_commit();
        }
      }
      uint32_t pa[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        pa[mi][0] = pk[mi][2 * kk][0];
        pa[mi][1] = pk[mi][2 * kk][1];
        pa[mi][2] = pk[mi][2 * kk + 1][0];
        pa[mi][3] = pk[mi][2 * kk + 1][1];
      }
#pragma unroll
      for (int j = 0; j < kO8; j += 2) {  // n8 tiles j, j + 1: 16-byte chunks j, j + 1 (lane's: j + (lane >> 4))
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vbuf + kk * 16 * 128 + v_lane + (j >> 3) * C::kBlock + (((j & 7) ^ xq) << 4));
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma16816<T>(o[mi][j], pa[mi], vb);
          mma16816<T>(o[mi][j + 1], pa[mi], vb + 2);
        }
      }
    }
  };
  constexpr bool kMask = true, kWhole = false;  // softmax's literal flags

  load_k(0, k_s);
  load_v(0, v_s);
  cp_async_commit();
  // With one K buffer, the next tile's cp.async copies go out among the products, V's in S and K's
  // in P V (once every warp is done with K(t): the barrier after S), where their address arithmetic
  // fills issue slots, rather than between a barrier and the products or ahead of the softmax; past
  // the last tile they are zeros (load_k, load_v), so that no branch splits those blocks. Where the
  // TMA may copy K(t + 1), it goes out before P V's first k16 step (before the softmax or after P
  // V's first step took more cycles: docs/perf/prefill.md). With two K buffers, the copies go out
  // at the top as before: there the branch-free copies made ptxas spill (88 bytes at 128 x 128,
  // against none).
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<0>();
    __syncthreads();  // tile t visible; every warp is done with tile t - 1's buffers
    if constexpr (kTma) {
      if (by_tma(t)) {  // or its TMA copies have landed (each buffer's parity: its use count mod 2)
        attn::sm90::mbar_wait(k_bar(t), (C::kKStages == 2 ? t >> 1 : t) & 1);
        attn::sm90::mbar_wait(v_bar(t), (t >> 1) & 1);
      }
    }
    if constexpr (C::kKStages == 2) {
      if (t + 1 < n_tiles) {
        load_k(t + 1, k_buf(t + 1));
        load_v(t + 1, v_buf(t + 1));
        cp_async_commit();
      }
    }
    float s[2][kN8][4];
    scores(s, t);
    if constexpr (C::kKStages == 1) __syncthreads();  // every warp is done with K(t): its one buffer takes K(t + 1)
    uint32_t pk[2][kN8][2];
    if (t >= n_full)
      softmax(s, pk, t, kMask);
    else
      softmax(s, pk, t, kWhole);
    accumulate(pk, t);
  }
  cp_async_wait<0>();  // the last tile's copies (zeros) have landed before the CTA ends

  // Normalise, round once, stage in this warp's own Q rows (only this warp read them), write.
  const uint32_t stage = q_s + 32 * warp * C::kQRow;
  __syncwarp();  // every lane's last ldmatrix of those rows is done (racecheck: the lanes are independent)
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float l = warp_sum<4>(l_run[mi][hf]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = 16 * mi + g + 8 * hf;
      if (p.lse != nullptr && tq == 0 && 32 * warp + row < q_rows)
        p.lse[int64_t(r.q0 + q_first + 32 * warp + row) * p.heads + h] = attn::lse2(m_run[mi][hf], l) * attn::kLn2;
#pragma unroll
      for (int j = 0; j < kO8; ++j) {
        const uint32_t v = pack2<T>(o[mi][j][2 * hf] * inv, o[mi][j][2 * hf + 1] * inv);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(stage + swz<C::kQRow, 128>(row, j) + 4 * tq), "r"(v) : "memory");
      }
    }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 32 * kO8; i += 32) {
    const int row = i / kO8, chunk = i % kO8;
    if (32 * warp + row >= q_rows) continue;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage + swz<C::kQRow, 128>(row, chunk))
                 : "memory");
    st_global16(out + int64_t(32 * warp + row) * p.heads * DV + chunk * 8, v);
  }
}

}  // namespace prefill
}  // namespace hmoe
