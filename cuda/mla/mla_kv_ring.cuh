// The KV side of the portable MLA decode kernel (mla_decode_portable.cu): the layout of a tile in
// the shared-memory ring, the page walk it uses (attention/page_walk.cuh), and the two ways a warp fills its
// part of a ring buffer: cp.async (every target) and, on sm_90 and newer for tiles that lie in one
// page, the tensor-memory accelerator (TMA: three bulk copies a warp, completion on an mbarrier).
//
// Each of the kWarps warps owns a quarter of every KV row: latent dims [128 w, 128 w + 128) and
// rope dims [16 w, 16 w + 16). It copies those columns itself and reads no others, so a tile's
// arrival and the reuse of its buffer concern one warp only.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: no driver call is made from here)
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/mbarrier.cuh"
#include "attention/mma.cuh"
#include "attention/page_walk.cuh"
#include "hmoe/mla_decode.h"

namespace hmoe {
namespace mla {

constexpr int kWarps = 4;
constexpr int kTile = 32;                         // KV tokens per step (and per ring buffer)
constexpr int kWarpLatent = kMlaDimCkv / kWarps;  // latent dims a warp owns (128)
constexpr int kWarpRope = kMlaDimPe / kWarps;     // rope dims a warp owns (16)
constexpr int kBlockCols = 64;                    // latent columns of a ring block (128 bytes)

// A ring buffer holds a tile as 8 blocks of 64 latent columns (kTile rows of 128 B each) and then
// the rope parts, grouped by the warp that owns them. That is the box layout the TMA writes with
// its 128-byte (latent) and 32-byte (rope) swizzles, which kv_off and rope_off spell out; the
// cp.async loader writes the same layout.
constexpr int kBlockBytes = kTile * kBlockCols * 2;                  // a block of a tile
constexpr int kLatentBytes = kMlaDimCkv / kBlockCols * kBlockBytes;  // 32 KB
constexpr int kWarpBlocks = kWarpLatent / kBlockCols;                // latent blocks a warp owns (2)
constexpr int kRopeWarpBytes = kTile * kWarpRope * 2;                // one warp's rope dims of a tile
constexpr int kTileBytes = kLatentBytes + kWarps * kRopeWarpBytes;
constexpr int kTileAlign = 1024;  // the 128-byte swizzle repeats every 8 rows of 128 B
static_assert(kTileBytes % kTileAlign == 0, "ring buffers stay aligned to the swizzle");

// Byte offset of 16-byte latent chunk `chunk` (0..63) of ring row `row`: inside each 128-byte row
// of a block the chunks are XOR-swizzled by the row's low 3 bits, so an ldmatrix's 8 rows at one
// logical chunk hit 8 distinct bank groups and a warp's copy of 2 rows x 16 chunks writes 4 whole
// lines. Adding 8 to a chunk adds kBlockBytes; adding 8 rows adds 1024.
__device__ __forceinline__ uint32_t kv_off(int row, int chunk) {
  return (chunk >> 3) * kBlockBytes + row * 128 + (((chunk ^ row) & 7) << 4);
}

// Byte offset of rope chunk `chunk` (0 or 1) of warp `warp`'s 32 rope bytes of row `row`: a warp's
// 32 B of every row lie together, so its copy of 16 rows writes 4 whole lines (in place in the
// row they spanned 16); the chunk is swizzled by row bit 2, which keeps an ldmatrix's 8 rows
// (256 B) on distinct bank groups. Adding 16 rows adds 512.
__device__ __forceinline__ uint32_t rope_off(int warp, int row, int chunk) {
  return kLatentBytes + warp * kRopeWarpBytes + row * 32 + ((chunk ^ (row >> 2)) & 1) * 16;
}

using attn::cp_async16;
using attn::cp_async_commit;
using attn::cp_async_wait;

// The page walk of every attention kernel (attention/page_walk.cuh) over tiles of kTile tokens.
using TokenWalk = attn::PageWalk<kTile>;

// The cp.async copies of one warp: its 16 latent chunks of each of a tile's 32 rows (16 copies:
// lanes 0-15 take row 2i, lanes 16-31 row 2i + 1) and its 2 rope chunks (2 copies: lane l takes
// row 16j + l / 2). The swizzles depend only on a row's low 3 bits, so the destinations are 4 + 1
// per-lane constants plus immediates.
struct KvLoader {
  const char* ckv;
  const char* kpe;
  uint32_t dst[4];    // latent copy i: dst[i % 4] + 2i rows
  uint32_t rope_dst;  // rope copy j: rope_dst + 512 j

  __device__ __forceinline__ explicit KvLoader(const MlaDecodeParams& p) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    ckv = static_cast<const char*>(p.ckv) + warp * (2 * kWarpLatent) + (lane & 15) * 16;
    kpe = static_cast<const char*>(p.kpe) + warp * (2 * kWarpRope) + (lane & 1) * 16;
#pragma unroll
    for (int u = 0; u < 4; ++u) dst[u] = kv_off(2 * u + (lane >> 4), warp * 16 + (lane & 15)) - 2 * u * 128;
    rope_dst = rope_off(warp, lane >> 1, lane & 1);
  }

  // Issues this warp's copies of the tile at shared address `buf`; lane l holds token l's row
  // (TokenWalk::row), the others get it by shuffle.
  __device__ __forceinline__ void tile(uint32_t buf, int my_row) const {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < kTile / 2; ++i) {
      const int row = __shfl_sync(0xffffffffu, my_row, 2 * i + (lane >> 4));
      const bool zero = row < 0;
      cp_async16(buf + dst[i % 4] + 2 * i * 128, ckv + uint64_t(zero ? 0u : uint32_t(row)) * (2 * kMlaDimCkv), zero);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = __shfl_sync(0xffffffffu, my_row, 16 * j + (lane >> 1));
      const bool zero = row < 0;
      cp_async16(buf + rope_dst + 512 * j, kpe + uint64_t(zero ? 0u : uint32_t(row)) * (2 * kMlaDimPe), zero);
    }
  }

  // The same for a tile that lies in one page (page size a multiple of the tile): its rows are
  // consecutive in the cache from row0 (-1: none), so every source is one base plus an immediate.
  // Rows from `valid` on are zero-filled.
  __device__ __forceinline__ void tile_contig(uint32_t buf, int row0, int valid) const {
    const int lane = threadIdx.x % 32;
    if (row0 < 0) row0 = 0, valid = 0;
    const char* c = ckv + (uint64_t(row0) + (lane >> 4)) * (2 * kMlaDimCkv);
    const int vc = valid - (lane >> 4);
#pragma unroll
    for (int i = 0; i < kTile / 2; ++i)
      cp_async16(buf + dst[i % 4] + 2 * i * 128, c + 2 * i * (2 * kMlaDimCkv), 2 * i >= vc);
    const char* k = kpe + (uint64_t(row0) + (lane >> 1)) * (2 * kMlaDimPe);
    const int vk = valid - (lane >> 1);
#pragma unroll
    for (int j = 0; j < 2; ++j) cp_async16(buf + rope_dst + 512 * j, k + 16 * j * (2 * kMlaDimPe), 16 * j >= vk);
  }
};

// The tensor maps of the TMA loader: the latent cache as a [rows, 512] and the rope cache as a
// [rows, 64] matrix of 16-bit elements, boxes of 64 x kTile (128-byte swizzle) and 16 x kTile
// (32-byte swizzle). Built on the host for each call (mla_decode_portable.cu).
struct KvTensorMaps {
  CUtensorMap ckv, kpe;
};

// One warp's part of a tile through the TMA (sm_90+; only instantiated there): one elected lane
// announces the bytes on the warp's mbarrier for the buffer and issues a box per latent block
// the warp owns and one for its rope dims; the box of a missing page starts kTile rows before the
// tensor, which the TMA fills with zeros. Called by the whole (converged) warp with warp-uniform
// arguments, so the operands sit in uniform registers (a lane-0 branch instead made the compiler
// loop over lanes to build them).
struct TmaLoader {
  const CUtensorMap* ckv;
  const CUtensorMap* kpe;

  static constexpr uint32_t kWarpBytes = kWarpBlocks * kBlockBytes + kRopeWarpBytes;
  static_assert(kWarpBlocks == 2, "tile() issues two latent boxes a warp");

  __device__ __forceinline__ static void init(uint32_t bar) {
    attn::sm90::mbar_init(bar, 1);
    attn::sm90::mbar_init_fence();
    attn::sm90::fence_async_smem();
  }

  __device__ __forceinline__ void tile(uint32_t buf, uint32_t bar, int row0) const {
    const int warp = threadIdx.x / 32;
    const int y = row0 < 0 ? -kTile : row0;
    const uint32_t dst = buf + kWarpBlocks * warp * kBlockBytes;
    asm volatile(
        "{\n .reg .pred p;\n elect.sync _|p, 0xffffffff;\n"
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
        "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3, {%4, %5}], [%0];\n"
        "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%6], [%3, {%7, %5}], [%0];\n"
        "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%8], [%9, {%10, %5}], [%0];\n"
        "}\n" ::"r"(bar),
        "r"(kWarpBytes), "r"(dst), "l"(reinterpret_cast<uint64_t>(ckv)), "r"(kWarpLatent * warp), "r"(y),
        "r"(dst + kBlockBytes), "r"(kWarpLatent * warp + kBlockCols), "r"(buf + rope_off(warp, 0, 0)),
        "l"(reinterpret_cast<uint64_t>(kpe)), "r"(kWarpRope * warp)
        : "memory");
  }

  // Waits (every lane) until the warp's bytes of the buffer behind `bar` have landed; `parity` is
  // the buffer's use count mod 2.
  __device__ __forceinline__ static void wait(uint32_t bar, uint32_t parity) { attn::sm90::mbar_wait(bar, parity); }
};

// Zeroes this warp's columns of ring rows [valid, kTile) of the buffer at `buf` (a tile the TMA
// copied whole although the sequence ends inside it: the rows past the end hold whatever the
// cache holds there, and 0 * NaN in P V would poison the output).
__device__ __forceinline__ void zero_tail_rows(uint32_t buf, int valid) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kLat = kWarpLatent / 8, kChunks = kLat + kWarpRope / 8;  // 16-byte chunks of a row
  for (int idx = valid * kChunks + lane; idx < kTile * kChunks; idx += 32) {
    const int row = idx / kChunks, c = idx % kChunks;
    const uint32_t dst = c < kLat ? buf + (kWarpBlocks * warp + c / 8) * kBlockBytes + row * 128 + (c % 8) * 16
                                  : buf + kLatentBytes + warp * kRopeWarpBytes + row * kWarpRope * 2 + (c - kLat) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
  }
}

}  // namespace mla
}  // namespace hmoe
