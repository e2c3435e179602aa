// The walk over a request's paged KV cache shared by hmoe's attention kernels: a page table row
// maps token j to cache row page_table[j / page_size] * page_size + j % page_size. Bounds rules
// (the same everywhere): tokens at or past the sequence's length and page ids outside
// [0, num_pages) give row -1, which a loader turns into zeros; the cache is never read out of
// bounds. The kernel clamps lengths to max_pages * page_size before it walks.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace hmoe {
namespace attn {

// One token of each tile of kTile tokens (lane l's token l, or the tile's first token when a tile
// lies in one page): the token's page-table entry is read two tiles ahead and only turned into a
// cache row (and checked) when the tile is issued, one iteration later, so the page-table latency
// stays off the loop's critical path. The page index and offset advance a tile per step without
// division.
template <int kTile>
struct PageWalk {
  const int32_t* table;  // the request's page-table row
  int len, page_size, num_pages;
  int tok, pg, off;              // the token whose entry is read next, its page index and offset
  int page, page_off, page_tok;  // the last entry read (raw; -1 past the sequence), its offset and token

  __device__ __forceinline__ PageWalk(const int32_t* table_row, int len_, int page_size_, int num_pages_, int first)
      : table(table_row),
        len(len_),
        page_size(page_size_),
        num_pages(num_pages_),
        tok(first),
        pg(first / page_size_),
        off(first % page_size_) {}

  // Reads the entry of the current token, then moves to the same lane's token of the next tile.
  __device__ __forceinline__ void read() {
    int lane_zero;  // 0, opaque to the compiler (see uniform_row)
    asm("mov.b32 %0, 0;" : "=r"(lane_zero));
    page =
        tok < len ? table[pg + (threadIdx.x & lane_zero)] : -1;  // tok < len <= max_pages * page_size: pg is in the row
    page_off = off;
    page_tok = tok;
    tok += kTile;
    off += kTile;
    while (off >= page_size) off -= page_size, ++pg;
  }
  // The cache row of the entry read last (the launcher checks that rows fit in an int32).
  __device__ __forceinline__ int row() const {
    return page >= 0 && page < num_pages ? page * page_size + page_off : -1;
  }
  // row() when every lane walks the same token, as a warp-uniform value: lane 0's by shuffle. An
  // entry the compiler knows to be warp-uniform goes into a uniform register right after its load,
  // where the warp then waits for it; read() hides that from it, so the entry waits in an ordinary
  // register until the tile is issued, one step later.
  __device__ __forceinline__ int uniform_row() const { return __shfl_sync(0xffffffffu, row(), 0); }
  // Tokens of the sequence from the entry's token on, at most a tile.
  __device__ __forceinline__ int valid() const { return min(max(len - page_tok, 0), kTile); }
};

}  // namespace attn
}  // namespace hmoe
