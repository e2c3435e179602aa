// The walk over a request's paged KV cache shared by hmoe's attention kernels: a page table row
// maps token j to cache row page_table[j / page_size] * page_size + j % page_size. Bounds rules
// (the same everywhere): tokens at or past the sequence's length and page ids outside
// [0, num_pages) give row -1, which a loader turns into zeros; the cache is never read out of
// bounds. The kernel clamps lengths to max_pages * page_size before it walks. Two forms: PageWalk
// (a lane's token stepping a tile at a time, decode) and PageLookup (any token, prefill).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace hmoe {
namespace attn {

// The cache row of page id `page` at offset `off` in it, or -1 for an id outside [0, num_pages):
// the bounds rule every walk applies (the launcher checks that rows fit in an int32).
__device__ __forceinline__ int cache_row(int page, int off, int page_size, int num_pages) {
  return page >= 0 && page < num_pages ? page * page_size + off : -1;
}

// Division by the page size without a divide instruction (Granlund-Montgomery, for dividends
// below 2^31): q = (umulhi(n, mul) + n) >> shift. Built on the host.
struct PageDivisor {
  uint32_t mul = 1;
  int32_t shift = 0;

  PageDivisor() = default;
  __host__ __device__ explicit PageDivisor(int d) {
    while ((1u << shift) < uint32_t(d)) ++shift;  // ceil(log2 d)
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - uint64_t(d))) / uint64_t(d) + 1);
  }
  __device__ __forceinline__ int div(int n) const { return int((__umulhi(uint32_t(n), mul) + uint32_t(n)) >> shift); }
};

// Random access to a request's tokens, for kernels whose threads take rows of a tile in any order
// (prefill): token j < len lives in cache row cache_row(table[j / page_size], j % page_size, ...);
// tokens at or past len give -1 (read as zeros). len is clamped by the kernel beforehand, so
// j / page_size stays inside the table row.
struct PageLookup {
  const int32_t* table;  // the request's page-table row
  int len, page_size, num_pages;
  PageDivisor divisor;

  __device__ __forceinline__ int row(int j) const {
    if (j >= len) return -1;
    const int pg = divisor.div(j);
    return cache_row(table[pg], j - pg * page_size, page_size, num_pages);
  }
};

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
    // tok < len <= max_pages * page_size: pg is in the row
    take(tok < len ? table[pg + (threadIdx.x & lane_zero)] : -1);
  }
  // read() with the current token's entry read beforehand (`entry`, any value where the token is at
  // or past len): for a walk whose first token is known before the length is (it starts at 0), so
  // that its entry is read beside the length instead of after it.
  __device__ __forceinline__ void take(int entry) {
    page = tok < len ? entry : -1;
    page_off = off;
    page_tok = tok;
    tok += kTile;
    off += kTile;
    while (off >= page_size) off -= page_size, ++pg;
  }
  // The cache row of the entry read last (the launcher checks that rows fit in an int32).
  __device__ __forceinline__ int row() const { return cache_row(page, page_off, page_size, num_pages); }
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
