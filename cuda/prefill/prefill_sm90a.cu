// Prefill (ragged_prefill) for Hopper, sm_90a only: wgmma, TMA and warp specialisation. The same
// op, params, request bounds, schedule (prefill_schedule.cuh), online-softmax rules and precision
// contract as the portable kernel (prefill_kernel.cuh); paged_prefill stays with the portable family.
//
// Persistent: one CTA an SM takes work items (a q tile of 128 rows of one request and head, from
// the schedule's work list, through a counter) until none is left. Three warpgroups; keys and
// values come in tiles of 128 rows through a ring of K and V buffers (two each at 192 x 128, three
// at 128 x 128 and 64 x 64). Shared memory holds Q and the ring as 64-column blocks of 128 rows in
// the TMA's 128-byte swizzle (attention/wgmma.cuh).
//   producer    warp 0, one thread: fetches the items and passes them on whole (ItemRing); per
//               item the K and V boxes of each tile on the buffer's "full" mbarriers once its
//               "empty" ones say both consumers are done with it, and after the first tile's K
//               each consumer's 64 Q rows once it is done with its last ones. A tile that ends
//               inside the request's keys (its last) is copied in 8-row boxes that stay inside
//               them; warp 1 copies the last 1 to 7 rows itself and zeroes the V rows past them,
//               so no row outside [kv_indptr[b], kv_indptr[b+1]) is read and stale rows never
//               meet P.
//   consumer c  (c = 0, 1; 128 threads each) owns query rows [64c, 64c + 64) of the item:
//               S = Q K^T     wgmma m64n128k16, both operands in shared memory, fp32
//               softmax       online, in registers (attention/softmax.cuh's lazy max; the mask
//                             only on tiles that cross the causal diagonal or the keys' end)
//               O += P V      wgmma m64n<Dv>k16 with P from registers (rounded to the input
//                             dtype), V N-major from shared memory, fp32 O in registers; over
//                             the first 64 keys only on a last tile whose later keys none of
//                             the consumer's rows sees (the causal diagonal's upper half)
//               S of tile t is issued before P V of tile t - 1, so the softmax of tile t runs
//               while the tensor cores do P V; and the consumers issue their products in
//               alternating turns (named barriers), so one's softmax runs beside the other's.
// The output is rounded once and written from registers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention/mma.cuh"
#include "attention/softmax.cuh"
#include "attention/wgmma.cuh"
#include "common/cuda_util.h"
#include "common/dtype.h"
#include "common/tma_host.h"
#include "prefill/prefill.h"
#include "prefill/prefill_schedule.cuh"

namespace hmoe {
namespace {

using namespace attn::sm90;
using attn::exp2_ftz;
using prefill::Request;

constexpr int kBM = 128;           // query rows per CTA: two consumers of 64 (wgmma's M)
constexpr int kRows = 64;          // query rows per consumer
constexpr int kBN = 128;           // keys per tile
constexpr int kBlock = 128 * 128;  // a 64-column block of 128 rows (Q or a K/V tile)
constexpr int kThreads = 384;      // producer warpgroup + 2 consumer warpgroups
constexpr int kLast = 8;           // rows of the boxes of a tile's last part
// Registers a thread after setmaxnreg (the pool from the launch: 168 x 384 = 56 x 128 + 2 x 224 x 128;
// at 40 the producer's warps spill: docs/perf/prefill.md, The sm90a kernel).
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(regs_split_fits(kThreads, kProducerRegs, 2, kConsumerRegs), "the register split exceeds the CTA's pool");

constexpr int kTailHeads = 4;  // the last heads, whose items are taken in turns (Work::fetch)
// A request's q tiles from its start (prefill::q_tile): from its end, each tile's causal diagonal
// spans two key tiles (no gain at 192 x 128, 1.5% more cycles at 128 x 128: docs/perf/prefill.md).
constexpr prefill::QOrder kQOrder = prefill::QOrder::kFromStart;

// One work item: q tile item.y of request r (prefill::q_tile: rows [q_first, q_first + q_rows)),
// query head h. The TMA thread reads item i of the `total` from the work list and passes it on to
// every role of the CTA (ItemRing). Items go head by head (the CTAs at work share a head's K/V in
// L2), each head's heaviest first, except that the last kTailHeads heads take turns, item by item:
// the run then ends on the lightest items of several heads, not on one head's whole range from
// heaviest to lightest, which left SMs idle while others finished a heavy item.
struct Work {
  Request r;
  int h, kvh, q_first, q_rows, n_tiles;
  int state;  // 1: an item; 0: an unused slot of the work list; -1: no more items
  __device__ __forceinline__ static Work fetch(const PrefillParams& p, int i, int total) {
    Work w{};
    w.state = -1;
    if (i >= total) return w;
    const int tail = min(p.heads, kTailHeads), tail0 = (p.heads - tail) * p.max_items;
    const int slot = i < tail0 ? i % p.max_items : (i - tail0) / tail;
    w.h = i < tail0 ? i / p.max_items : p.heads - tail + (i - tail0) % tail;
    const int2 item = reinterpret_cast<const int2*>(p.workspace)[slot];
    w.state = item.x >= 0 ? 1 : 0;
    w.r = prefill::request(p, w.state ? item.x : 0);
    w.kvh = w.h / (p.heads / p.kv_heads);
    const prefill::QTile tile = prefill::q_tile(w.r, item.y, kBM, kQOrder);
    w.q_first = tile.first;
    w.q_rows = tile.rows;
    w.n_tiles = w.state ? (prefill::visible_keys(w.r, p.causal, w.q_first + w.q_rows - 1) + kBN - 1) / kBN : 0;
    return w;
  }
};

// Shared memory, offsets from a 1024-byte aligned base (the launcher adds 1024 bytes of slack).
// K and V buffers: as many as fit in 227 KB (192 x 128: two each; 128 x 128 and 64 x 64: three).
template <int DQK, int DV>
struct Layout {
  static constexpr int kQBlocks = DQK / 64, kVBlocks = DV / 64;
  static constexpr int kStages = DQK == 192 ? 2 : 3;
  static constexpr int q = 0;
  static constexpr int k = q + kQBlocks * kBlock;               // [stage][block]
  static constexpr int v = k + kStages * kQBlocks * kBlock;     // [stage][block]
  static constexpr int bars = v + kStages * kVBlocks * kBlock;  // see Bars
  static constexpr int items = bars + 8 * (4 * kStages + 8);    // the item ring: 2 Work
  static constexpr int end = items + 2 * int(sizeof(Work));
  static constexpr int bytes = end + 1024;
  static_assert(DQK % 64 == 0 && DV % 64 == 0 && DV <= DQK && (DV == 64 || DV == 128),
                "whole 64-column blocks; O (<= 128 columns) is staged in Q's rows");
};

// q [total_q, H * Dqk] in boxes of 64 x 64; k [total_kv, Hkv * Dqk] and v [total_kv, Hkv * Dv] in
// boxes of 64 x kBN (a whole tile) and 64 x kLast (a tile's last part); all 128-byte swizzled.
struct Maps {
  CUtensorMap q, k, k_last, v, v_last;
};

template <int DV, typename T>
__device__ __forceinline__ void mma_pv(float* o, const uint32_t* p, uint64_t v) {
  if constexpr (DV == 128)
    wgmma<WgmmaRs64x128<1>, T>(o, p, v, 1);
  else
    wgmma<WgmmaRs64x64<1>, T>(o, p, v, 1);
}

__device__ __forceinline__ void st_shared16(uint32_t dst, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_global16(const void* src) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  return v;
}

// Row `row` (0..127) of a tile, 16-byte chunk `chunk` (8 a block), in the 128-byte swizzle.
__device__ __forceinline__ uint32_t tile_chunk(int row, int chunk) {
  return (chunk / 8) * kBlock + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// Where tile t of a request lies: rows [row0, row0 + rows) of k and v; `whole` of them (a multiple
// of 8, all when the tile is full) come by TMA.
struct TileRows {
  int row0, rows, whole;
  __device__ __forceinline__ TileRows(const Request& r, int t)
      : row0(r.kv0 + t * kBN), rows(min(kBN, r.lk - t * kBN)), whole(rows == kBN ? kBN : rows / kLast * kLast) {}
};

// The barriers (8 bytes each): per ring stage, K and V full (the TMA thread's arrival with the
// bytes and warp 1's) and empty (one arrival per consumer); per consumer, its Q rows full (the
// bytes) and empty (the consumer's last S is done); per slot of the item ring, full (the TMA
// thread wrote the next item's index) and empty (every consumer thread and warp 1 read it).
template <int DQK, int DV>
struct Bars {
  uint32_t full_k, full_v, empty_k, empty_v, q_full, q_empty, item_full, item_empty;
  __device__ __forceinline__ explicit Bars(uint32_t smem) {
    constexpr int kStages = Layout<DQK, DV>::kStages;
    full_k = smem + Layout<DQK, DV>::bars;
    full_v = full_k + 8 * kStages;
    empty_k = full_v + 8 * kStages;
    empty_v = empty_k + 8 * kStages;
    q_full = empty_v + 8 * kStages;
    q_empty = q_full + 16;
    item_full = q_empty + 16;
    item_empty = item_full + 16;
  }
};
constexpr int kItemReaders = 2 * 128 + 32;  // arrivals on item_empty

// The work items of a CTA: blockIdx.x first, then whatever the call's counter hands out (items
// in head-major order, heaviest q tiles of a head first, so the CTAs at work share a head's K/V
// in L2 and the light tiles come last). The TMA thread fetches them (the work list's and the
// request bounds' global loads are its alone) and passes each on through a ring of two slots in
// shared memory; everyone else reads them there.
struct ItemRing {
  uint32_t full, empty;
  Work* slot;
  int k = 0;  // items passed so far
  __device__ __forceinline__ ItemRing(uint32_t f, uint32_t e, unsigned char* s)
      : full(f), empty(e), slot(reinterpret_cast<Work*>(s)) {}
  __device__ __forceinline__ void put(const Work& w) {
    if (k >= 2) mbar_wait(empty + 8 * (k % 2), ((k / 2) - 1) & 1);
    slot[k % 2] = w;
    mbar_arrive(full + 8 * (k % 2));  // release: the item is visible to whoever waits on it
    ++k;
  }
  __device__ __forceinline__ Work get() {
    mbar_wait(full + 8 * (k % 2), (k / 2) & 1);
    const Work w = slot[k % 2];
    mbar_arrive(empty + 8 * (k % 2));
    ++k;
    return w;
  }
};

// Slot of the CTA's g-th tile (counted over all its items) in a ring of S, and its phase's parity.
template <int S>
__device__ __forceinline__ uint32_t slot_bar(uint32_t bars, int g) {
  return bars + 8 * (g % S);
}
template <int S>
__device__ __forceinline__ uint32_t slot_parity(int g) {
  return (g / S) & 1;
}

// The producer's TMA thread: for each item, tile by tile K and V of the request's keys into the
// ring, and after the first tile's K each consumer's Q rows once it is done with its last ones.
template <int DQK, int DV>
__device__ __forceinline__ void produce(const PrefillParams& p, const Maps& maps, uint32_t smem, ItemRing& ring) {
  using L = Layout<DQK, DV>;
  constexpr int kStages = L::kStages;
  const Bars<DQK, DV> bar(smem);
  const int total = p.max_items * p.heads;
  int* counter = p.workspace + prefill::ScheduleLayout(p.batch, p.max_items).counter;
  // One matrix (K or V: `blocks` 64-column blocks from column col0) of a tile into `buf`.
  auto load = [&](const CUtensorMap* whole_map, const CUtensorMap* last_map, int blocks, int col0, uint32_t buf,
                  uint32_t full, const TileRows& tr) {
    mbar_expect_tx(full, blocks * tr.whole * 128);
    if (tr.whole == kBN) {
      for (int blk = 0; blk < blocks; ++blk) tma_load_2d(buf + blk * kBlock, whole_map, col0 + 64 * blk, tr.row0, full);
    } else {
      for (int g = 0; g < tr.whole; g += kLast)
        for (int blk = 0; blk < blocks; ++blk)
          tma_load_2d(buf + blk * kBlock + g * 128, last_map, col0 + 64 * blk, tr.row0 + g, full);
    }
  };
  int g = 0, nq = 0;  // tiles and Q loads so far
  for (int i = blockIdx.x;; i = gridDim.x + atomicAdd(counter, 1)) {
    const Work w = Work::fetch(p, i, total);
    ring.put(w);
    if (w.state < 0) break;
#pragma unroll 1
    for (int t = 0; t < w.n_tiles; ++t, ++g) {
      const TileRows tr(w.r, t);
      if (g >= kStages) mbar_wait(slot_bar<kStages>(bar.empty_k, g), slot_parity<kStages>(g) ^ 1);
      load(&maps.k, &maps.k_last, L::kQBlocks, w.kvh * DQK, smem + L::k + (g % kStages) * L::kQBlocks * kBlock,
           slot_bar<kStages>(bar.full_k, g), tr);
      if (t == 0) {  // each consumer's Q rows, behind the first K: its first S waits for both
        for (int c = 0; c < 2; ++c) {
          if (nq > 0) mbar_wait(bar.q_empty + 8 * c, (nq - 1) & 1);
          mbar_expect_tx(bar.q_full + 8 * c, L::kQBlocks * kRows * 128);
          for (int blk = 0; blk < L::kQBlocks; ++blk)
            tma_load_2d(smem + L::q + blk * kBlock + kRows * c * 128, &maps.q, w.h * DQK + 64 * blk,
                        w.r.q0 + w.q_first + kRows * c, bar.q_full + 8 * c);
        }
        ++nq;
      }
      if (g >= kStages) mbar_wait(slot_bar<kStages>(bar.empty_v, g), slot_parity<kStages>(g) ^ 1);
      load(&maps.v, &maps.v_last, L::kVBlocks, w.kvh * DV, smem + L::v + (g % kStages) * L::kVBlocks * kBlock,
           slot_bar<kStages>(bar.full_v, g), tr);
    }
  }
}

// The producer's warp 1: of each tile that ends inside the keys, the rows past its last 8-row box
// (copied) and, in V, the rows past the keys (zeros); then its arrival on the tile's full barriers.
template <int DQK, int DV>
__device__ __forceinline__ void produce_last_rows(const PrefillParams& p, uint32_t smem, ItemRing& ring) {
  using L = Layout<DQK, DV>;
  constexpr int kStages = L::kStages;
  const Bars<DQK, DV> bar(smem);
  const int lane = threadIdx.x % 32;
  int g = 0;
  for (Work w = ring.get(); w.state >= 0; w = ring.get()) {
#pragma unroll 1
    for (int t = 0; t < w.n_tiles; ++t, ++g) {
      const TileRows tr(w.r, t);
      if (g >= kStages) mbar_wait(slot_bar<kStages>(bar.empty_k, g), slot_parity<kStages>(g) ^ 1);
      if (tr.whole < kBN) {
        constexpr int kChunks = DQK / 8;
        const uint32_t buf = smem + L::k + (g % kStages) * L::kQBlocks * kBlock;
        const char* src = static_cast<const char*>(p.k) + (int64_t(tr.row0) * p.kv_heads + w.kvh) * DQK * 2;
        for (int j = lane; j < (tr.rows - tr.whole) * kChunks; j += 32) {
          const int row = tr.whole + j / kChunks, chunk = j % kChunks;
          st_shared16(buf + tile_chunk(row, chunk),
                      ld_global16(src + int64_t(row) * p.kv_heads * DQK * 2 + chunk * 16));
        }
        fence_async_smem();  // generic-proxy writes visible to the consumers' wgmma
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(slot_bar<kStages>(bar.full_k, g));
      if (g >= kStages) mbar_wait(slot_bar<kStages>(bar.empty_v, g), slot_parity<kStages>(g) ^ 1);
      if (tr.whole < kBN) {
        constexpr int kChunks = DV / 8;
        const uint32_t buf = smem + L::v + (g % kStages) * L::kVBlocks * kBlock;
        const char* src = static_cast<const char*>(p.v) + (int64_t(tr.row0) * p.kv_heads + w.kvh) * DV * 2;
        for (int j = lane; j < (kBN - tr.whole) * kChunks; j += 32) {
          const int row = tr.whole + j / kChunks, chunk = j % kChunks;
          st_shared16(buf + tile_chunk(row, chunk),
                      row < tr.rows ? ld_global16(src + int64_t(row) * p.kv_heads * DV * 2 + chunk * 16)
                                    : make_uint4(0, 0, 0, 0));
        }
        fence_async_smem();
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(slot_bar<kStages>(bar.full_v, g));
    }
  }
}

// Persistent: one CTA an SM takes work items (ItemRing) until none is left, the producer loading
// the next item's Q and first tiles while the consumers finish the last one.
template <typename T, int DQK, int DV>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_sm90a_kernel(const PrefillParams p, const __grid_constant__ Maps maps) {
  using L = Layout<DQK, DV>;
  constexpr int kStages = L::kStages;
  extern __shared__ __align__(1024) unsigned char smem_window[];
  const uint32_t smem = (attn::smem_addr(smem_window) + 1023) & ~1023u;
  const Bars<DQK, DV> bar(smem);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar.full_k + 8 * s, 2);
      mbar_init(bar.full_v + 8 * s, 2);
      mbar_init(bar.empty_k + 8 * s, 2);
      mbar_init(bar.empty_v + 8 * s, 2);
    }
    for (int c = 0; c < 2; ++c) {
      mbar_init(bar.q_full + 8 * c, 1);
      mbar_init(bar.q_empty + 8 * c, 1);
      mbar_init(bar.item_full + 8 * c, 1);
      mbar_init(bar.item_empty + 8 * c, kItemReaders);
    }
    mbar_init_fence();
  }
  __syncthreads();
  ItemRing ring(bar.item_full, bar.item_empty, smem_window + (smem - attn::smem_addr(smem_window)) + L::items);

  const int wg = warp_uniform(threadIdx.x / 128);
  if (wg == 0) {  // producer
    regs_shrink<kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) produce<DQK, DV>(p, maps, smem, ring);
    if (warp == 1) produce_last_rows<DQK, DV>(p, smem, ring);
    return;
  }
  regs_grow<kConsumerRegs>();
  const int c = wg - 1, tid = threadIdx.x - 128 * wg, warp = tid / 32, lane = tid % 32;
  const int r0 = 16 * warp + lane / 4;  // this thread's rows of the consumer's 64: r0 and r0 + 8
  const int q4 = lane % 4;
  const float scale = p.sm_scale * attn::kLog2e;
  float s[64], o[DV / 2], m_run[2], l_run[2];
  uint32_t pk[8][4];   // P of the last tile, rounded to T: the A fragments of P V's 8 k16 steps
  int g0 = 0, nq = 0;  // the CTA's tiles before this item, Q loads so far

  auto k_buf = [&](int g) { return smem + L::k + (g % kStages) * L::kQBlocks * kBlock; };
  auto v_buf = [&](int g) { return smem + L::v + (g % kStages) * L::kVBlocks * kBlock; };
  auto wait_full = [&](uint32_t bars, int g) { mbar_wait(slot_bar<kStages>(bars, g), slot_parity<kStages>(g)); };
  auto release = [&](uint32_t bars, int g) {
    if (tid == 0) mbar_arrive(slot_bar<kStages>(bars, g));
  };
  // The wgmma descriptor of this consumer's Q rows (those of a K/V slot are made per tile).
  const uint64_t q_desc = k_major(smem + L::q + kRows * c * 128);
  auto issue_s = [&](int g) {  // S = Q K^T for the tile in slot g (asynchronous)
    const uint64_t k_desc = k_major(k_buf(g));
    wgmma_fence();
#pragma unroll
    for (int blk = 0; blk < L::kQBlocks; ++blk)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t step = blk * kBlock + kk * 32;
        wgmma<Wgmma64x128<0>, T>(s, desc_add(q_desc, step), desc_add(k_desc, step), blk + kk > 0);
      }
    wgmma_commit();
  };
  // half: over the tile's first 64 keys only (P's first 4 k16 steps), for a last tile whose keys
  // past them no row of this consumer sees (the causal diagonal's upper half, or the keys' end):
  // their P is zero.
  auto issue_pv = [&](int g, bool half) {  // O += P V for the tile in slot g (asynchronous)
    const uint64_t v_desc = n_major(v_buf(g), kBlock);
    wgmma_fence();
    fence_regs<DV / 2>(o);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) mma_pv<DV, T>(o, pk[kk], desc_add(v_desc, kk * 16 * 128));
    if (!half) {
#pragma unroll
      for (int kk = 4; kk < 8; ++kk) mma_pv<DV, T>(o, pk[kk], desc_add(v_desc, kk * 16 * 128));
    }
    wgmma_commit();
  };
  auto round_p = [&]() {  // P rounded to T (the precision contract), packed as P V's A fragments
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) pk[kk][i] = pack2<T>(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
    if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
      for (int j = 0; j < DV / 8; ++j) {
        o[4 * j] *= alpha[0], o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1], o[4 * j + 3] *= alpha[1];
      }
    }
  };
  // Turns: the consumers issue their products in alternation, consumer 0 first: in turn t of an
  // item, S of tile t and P V of tile t - 1, so that the tensor cores run one consumer's products
  // while the other does its softmax. Both take turns 0 .. n_tiles of every item (empty ones past
  // their rows' keys, in which the tiles are let go), so the named barriers (3: consumer 0's
  // turn, 4: consumer 1's) pair up; consumer 0 takes consumer 1's last hand-over at the end.
  auto turn = [&](auto&& issue) {
    named_sync(3 + c, 256);
    issue();
    named_arrive(4 - c, 256);
  };
  if (c == 1) named_arrive(3, 256);
  constexpr bool kMask = true, kWhole = false;  // softmax's literal flags

  for (Work w = ring.get(); w.state >= 0; w = ring.get()) {
    if (w.state == 0) continue;
    const Request& r = w.r;
    const int rows = min(kRows, w.q_rows - kRows * c);  // <= 0: this consumer has no query row
    const int first = w.q_first + kRows * c;            // its first row within the request
    T* out = static_cast<T*>(p.out) + (int64_t(r.q0 + first) * p.heads + w.h) * DV;
    if (w.n_tiles == 0) {  // no key for any row: out = 0, lse = -inf
      for (int j = tid; j < max(rows, 0) * (DV / 8); j += 128)
        st_global16(out + int64_t(j / (DV / 8)) * p.heads * DV + (j % (DV / 8)) * 8, make_uint4(0, 0, 0, 0));
      if (p.lse != nullptr)
        for (int j = tid; j < rows; j += 128) p.lse[int64_t(r.q0 + first + j) * p.heads + w.h] = -INFINITY;
      continue;
    }
    // The tile counts are warp-uniform, and so said to the compiler: then the buffer addresses and
    // the wgmma descriptors derived from them stay in uniform registers.
    const int n_tiles = warp_uniform(w.n_tiles);
    // The keys this consumer's last row sees.
    const int last_keys = rows > 0 ? prefill::visible_keys(r, p.causal, first + rows - 1) : 0;
    const int n_own = warp_uniform((last_keys + kBN - 1) / kBN);
    // Tiles every row of this consumer sees whole need no mask (the fast softmax also needs scale > 0).
    const int n_full = warp_uniform(rows > 0 && scale > 0.f ? prefill::visible_keys(r, p.causal, first) / kBN : 0);
    // P V of the last own tile in half (issue_pv): its last row sees at most its first 64 keys.
    const bool half = warp_uniform(n_own > 0 && last_keys - (n_own - 1) * kBN <= kBN / 2);
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.f;
#pragma unroll
    for (int j = 0; j < DV / 2; ++j) o[j] = 0.f;

    // Online softmax of tile t in place: s becomes P (fp32); alpha: the rows' rescale factors.
    // s[4j + e] is row r0 + 8 (e / 2), key 8j + 2 q4 + e % 2 of the tile. Fast path (no mask):
    // the row max of the raw scores times scale, p = 2^(s scale - m) in one FFMA and one ex2.
    // Masked path: scores scaled first (any sign of scale), keys the row does not see set to -inf.
    auto softmax = [&](int t, const bool masked, float (&alpha)[2]) {
      float mx[2] = {-INFINITY, -INFINITY};
      if (masked) {
        int lim[2];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) lim[hf] = prefill::visible_keys(r, p.causal, first + r0 + 8 * hf) - t * kBN;
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float& x = s[4 * j + e];
            x = 8 * j + 2 * q4 + (e & 1) < lim[e >> 1] ? x * scale : -INFINITY;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
          }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
        mx[0] *= scale, mx[1] *= scale;
      }
      float m_new[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = warp_max<4>(mx[hf]);  // the row's 4 threads
        m_new[hf] = attn::next_max(m_run[hf], mx[hf]);
        alpha[hf] = attn::rescale(m_run[hf], m_new[hf]);
        m_run[hf] = m_new[hf];
      }
      float sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float& x = s[4 * j + e];
          x = exp2_ftz(masked ? x - m_new[e >> 1] : fmaf(x, scale, -m_new[e >> 1]));
          sum[e >> 1] += x;
        }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) l_run[hf] = l_run[hf] * alpha[hf] + sum[hf];
    };

    mbar_wait(bar.q_full + 8 * c, nq & 1);  // also with no row or no key: the copy must land first
    ++nq;
    int t = 0;
    if (n_own > 0) {
      float alpha[2];
      wait_full(bar.full_k, g0);
      turn([&] { issue_s(g0); });
      wgmma_wait<0>();
      fence_regs<64>(s);
      release(bar.empty_k, g0);
      if (n_own == 1 && tid == 0) mbar_arrive(bar.q_empty + 8 * c);  // the last S is done: Q may go
      if (0 >= n_full)
        softmax(0, kMask, alpha);
      else
        softmax(0, kWhole, alpha);
      round_p();
      for (t = 1; t < n_own; ++t) {
        wait_full(bar.full_k, g0 + t);
        wait_full(bar.full_v, g0 + t - 1);
        turn([&] {
          issue_s(g0 + t);
          issue_pv(g0 + t - 1, false);
        });
        wgmma_wait<1>();  // S of tile t (P V of tile t - 1 still runs)
        fence_regs<64>(s);
        release(bar.empty_k, g0 + t);
        if (t == n_own - 1 && tid == 0) mbar_arrive(bar.q_empty + 8 * c);
        if (t >= n_full)
          softmax(t, kMask, alpha);
        else
          softmax(t, kWhole, alpha);
        wgmma_wait<0>();
        fence_regs<DV / 2>(o);
        release(bar.empty_v, g0 + t - 1);
        rescale_o(alpha);
        round_p();
      }
      wait_full(bar.full_v, g0 + n_own - 1);
      turn([&] { issue_pv(g0 + n_own - 1, half); });
      wgmma_wait<0>();
      fence_regs<DV / 2>(o);
      release(bar.empty_v, g0 + n_own - 1);
      if (n_own < n_tiles) {  // tile n_own is past this consumer's rows' keys
        wait_full(bar.full_k, g0 + n_own);
        release(bar.empty_k, g0 + n_own);
      }
      t = n_own + 1;
    } else if (tid == 0) {
      mbar_arrive(bar.q_empty + 8 * c);
    }
    for (; t <= n_tiles; ++t) {  // turns past this consumer's rows' keys: nothing to issue, tiles let go
      turn([] {});
      if (t < n_tiles) {
        wait_full(bar.full_k, g0 + t);
        release(bar.empty_k, g0 + t);
      }
      if (t >= 1) {
        wait_full(bar.full_v, g0 + t - 1);
        release(bar.empty_v, g0 + t - 1);
      }
    }
    g0 += n_tiles;
    if (rows <= 0) continue;

    // Normalise, round once, write: row r0 + 8 hf, 16-bit pairs (Q's rows may already hold the
    // next item's queries).
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float l = warp_sum<4>(l_run[hf]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = r0 + 8 * hf;
      if (row >= rows) continue;
      if (p.lse != nullptr && q4 == 0)
        p.lse[int64_t(r.q0 + first + row) * p.heads + w.h] = attn::lse2(m_run[hf], l) * attn::kLn2;
      T* dst = out + int64_t(row) * p.heads * DV + 2 * q4;
#pragma unroll
      for (int j = 0; j < DV / 8; ++j)
        *reinterpret_cast<uint32_t*>(dst + 8 * j) = pack2<T>(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
    }
  }
  if (c == 0) named_sync(3, 256);  // consumer 1's last hand-over
}

void check(cudaError_t e, const char* what) { check_cuda(e, "ragged_prefill (sm90a)", what); }

// f(kernel, layout) for the kernel of (dtype, head dims); layout: a Layout<DQK, DV>.
template <typename F>
void with_kernel(int dtype, int dqk, int dv, F&& f) {
  auto dims = [&](auto kbf16, auto kf16, auto layout) { dtype == kBF16 ? f(kbf16, layout) : f(kf16, layout); };
  if (dqk == 192 && dv == 128)
    dims(prefill_sm90a_kernel<__nv_bfloat16, 192, 128>, prefill_sm90a_kernel<__half, 192, 128>, Layout<192, 128>{});
  else if (dqk == 128 && dv == 128)
    dims(prefill_sm90a_kernel<__nv_bfloat16, 128, 128>, prefill_sm90a_kernel<__half, 128, 128>, Layout<128, 128>{});
  else if (dqk == 64 && dv == 64)
    dims(prefill_sm90a_kernel<__nv_bfloat16, 64, 64>, prefill_sm90a_kernel<__half, 64, 64>, Layout<64, 64>{});
  else
    throw std::invalid_argument("ragged_prefill (sm90a): head dims (" + std::to_string(dqk) + ", " +
                                std::to_string(dv) + ") are not built");
}

}  // namespace

PrefillPlan prefill_plan(int device, int64_t total_q, int batch, int heads, int kv_heads, int head_dim_qk,
                         int head_dim_v, int config) {
  if (config > 0)
    throw std::invalid_argument("ragged_prefill (sm90a): configuration " + std::to_string(config) +
                                " does not exist (there is one, 0)");
  int smem = 0, stages = 0;
  with_kernel(kBF16, head_dim_qk, head_dim_v, [&](auto, auto layout) {
    smem = decltype(layout)::bytes;
    stages = decltype(layout)::kStages;
  });
  if (device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "ragged_prefill (sm90a)") < smem)
    throw std::runtime_error("ragged_prefill (sm90a): the device's shared memory per block is below " +
                             std::to_string(smem) + " bytes");
  PrefillPlan plan{};
  plan.config = 0;
  plan.tile_q = kBM;
  plan.tile_kv = kBN;
  plan.kv_stages = stages;
  plan.smem_bytes = smem;
  plan.ctas_per_sm = 1;
  prefill::size_work_list(plan, total_q, batch, heads);
  (void)kv_heads;  // the plan is the same for every GQA ratio
  return plan;
}

void prefill_launch(const PrefillParams& p0, const PrefillPlan& plan, int device, uintptr_t stream_handle) {
  if (p0.dtype != kBF16 && p0.dtype != kF16) throw std::invalid_argument("prefill: dtype must be bf16 or fp16");
  if (p0.kv != kPrefillRagged)
    throw std::invalid_argument(
        "prefill (sm90a): only ragged keys and values (paged_prefill is the portable family's)");
  if (plan.config != 0 || plan.tile_q != kBM || !prefill::work_list_fits(p0, plan))
    throw std::invalid_argument("prefill: the plan does not fit this call (compute it with prefill_plan)");
  if (p0.batch == 0 || p0.total_q == 0) return;
  const DeviceGuard guard(device, "ragged_prefill");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  PrefillParams p = p0;
  p.max_items = plan.max_items;
  prefill::launch_schedule(p, kBM, kQOrder, stream, "ragged_prefill");
  const char* op = "ragged_prefill";
  const auto sw = CU_TENSOR_MAP_SWIZZLE_128B;
  Maps maps;
  maps.q = tensor_map_2d(p.q, p.total_q, int64_t(p.heads) * p.head_dim_qk, 64, kRows, sw, op);
  // No keys at all: no tile is ever loaded, but the maps must encode (over q; never read).
  const bool keys = p.total_kv > 0;
  const void* k = keys ? p.k : p.q;
  const void* v = keys ? p.v : p.q;
  const int64_t kv_rows = keys ? p.total_kv : 1;
  const int64_t k_cols = keys ? int64_t(p.kv_heads) * p.head_dim_qk : 64;
  const int64_t v_cols = keys ? int64_t(p.kv_heads) * p.head_dim_v : 64;
  maps.k = tensor_map_2d(k, kv_rows, k_cols, 64, kBN, sw, op);
  maps.k_last = tensor_map_2d(k, kv_rows, k_cols, 64, kLast, sw, op);
  maps.v = tensor_map_2d(v, kv_rows, v_cols, 64, kBN, sw, op);
  maps.v_last = tensor_map_2d(v, kv_rows, v_cols, 64, kLast, sw, op);
  // Persistent: one CTA an SM (or one per item, when fewer).
  const dim3 grid(
      unsigned(std::min<int64_t>(int64_t(plan.max_items) * p.heads,
                                 device_attribute(device, cudaDevAttrMultiProcessorCount, "ragged_prefill (sm90a)"))));
  with_kernel(p.dtype, p.head_dim_qk, p.head_dim_v,
              [&](auto kernel, auto layout) { kernel<<<grid, kThreads, decltype(layout)::bytes, stream>>>(p, maps); });
  check(cudaGetLastError(), "kernel launch");
}

void prefill_prewarm(int device) {
  const DeviceGuard guard(device, "ragged_prefill");
  const int limit = device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "ragged_prefill (sm90a)");
  for (int dtype : {kBF16, kF16})
    for (const auto& d : kPrefillHeadDims)
      with_kernel(dtype, d[0], d[1], [&](auto kernel, auto layout) {
        constexpr int bytes = decltype(layout)::bytes;
        if (bytes <= limit)
          check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "smem attribute");
      });
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, prefill::prefill_schedule_kernel<prefill::kScheduleThreads>), "schedule kernel");
  encode_tiled("ragged_prefill");
}

}  // namespace hmoe
