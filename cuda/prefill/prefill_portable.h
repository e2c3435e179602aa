// The portable family's tile configurations for prefill, shared by its plan (prefill_portable.cu)
// and the per-head-dims kernel files (prefill_portable_d<Dqk>.cu) that instantiate them.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only)
#include <cuda_runtime.h>

#include "hmoe/prefill.h"
#include "prefill/prefill_schedule.cuh"

namespace hmoe {
namespace prefill {

// Query rows a CTA: 32 a warp; two V buffers. Best first for each pair of head dims (the plan takes
// the first that fits the device's shared memory).
struct PortableConfig {
  int dqk, dv, bn, kstages, warps;
};
constexpr PortableConfig kPortableConfigs[] = {
    {192, 128, 64, 1, 4},  // 104 KB: two CTAs an H100 SM, the fastest there (docs/perf/prefill.md)
    {192, 128, 32, 2, 4},  //  88 KB: fits sm_89 and sm_120 (99 KB a block)
    {128, 128, 64, 2, 4},  //  96 KB
    {64, 64, 64, 2, 4},    //  48 KB
};
constexpr int kNumPortableConfigs = int(sizeof(kPortableConfigs) / sizeof(kPortableConfigs[0]));

constexpr int portable_tile_q(const PortableConfig& c) { return 32 * c.warps; }
// The q tiles of a request counted from its end (q_tile): every row of a CTA walks the keys its
// last row sees, so a partial tile at the request's end would cost as much as the heaviest.
constexpr QOrder kPortableQOrder = QOrder::kFromEnd;
// The kernel's shared memory (Config in prefill_kernel.cuh): Q, the K buffers, two V buffers, an
// mbarrier a buffer (the TMA's), and kPortableAlign bytes of slack to align them on the 128-byte
// swizzle's period (the dynamic window's own alignment is not promised).
constexpr int kPortableAlign = 1024;
constexpr int portable_smem(const PortableConfig& c) {
  return portable_tile_q(c) * 2 * c.dqk + c.kstages * c.bn * 2 * c.dqk + 2 * c.bn * 2 * c.dv + 8 * (c.kstages + 2) +
         kPortableAlign;
}

// The rows of the TMA's boxes for paged keys in tiles of bn keys (a power of two), 0 where the TMA
// does not copy them: bn where a page holds whole tiles, the page size where whole pages of 8 keys or
// more make a tile (a box a page and 64-column block: 8 rows are the 128-byte swizzle's period).
// Both need a power of two (the kernel's page lookup shifts where it would divide). Which
// configurations take the second (kTmaParts): prefill_portable_kernels.cuh.
constexpr int paged_tma_rows(int page_size, int bn) {
  return page_size < 8 || (page_size & (page_size - 1)) != 0 ? 0 : page_size % bn == 0 ? bn : page_size;
}

// The TMA's views of k [total_kv, Hkv * Dqk] and v [total_kv, Hkv * Dv] (paged: the cache's P * page
// rows), the kernel's second argument: 64-column blocks in the 128-byte swizzle, a box a tile's rows
// and a head's blocks (tensor_map_blocks), or for pages smaller than the tile a page's rows and one
// block. Built on sm_90 and newer for ragged calls and for the paged calls tma_rows takes.
struct PortableMaps {
  CUtensorMap k, v;
};

// Defined in prefill_portable_d<DQK>.cu: the attention kernel of configuration `config` (an index
// into kPortableConfigs with these head dims) on p (after the schedule), its keys through the TMA
// where `tma` (sm_90 and newer) and the tiles allow, and the shared-memory attributes of every kernel of these
// head dims that fits `smem_limit`.
template <int DQK, int DV>
void portable_kernel_launch(const PrefillParams& p, int config, bool tma, cudaStream_t stream);
template <int DQK, int DV>
void portable_kernel_prewarm(int smem_limit);

}  // namespace prefill
}  // namespace hmoe
