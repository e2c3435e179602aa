// A CTA's 16-bit output rows written through shared memory: the attention kernels hold O in the
// tensor cores' accumulator layout (a warp's 32 lanes: 8 rows x 4 lanes of 2 consecutive columns),
// where a direct store of bf16/fp16 pairs is 8 scattered 16-byte pieces (half sectors) per warp
// instruction. Staged in shared memory, the rows leave in 16-byte vectors, a warp writing 512
// contiguous bytes per instruction.
// The stage: row r at r * row_bytes (a multiple of 128), its 16-byte chunks XOR-swizzled by r % 8,
// so that the accumulator layout's stores (8 rows, one chunk each) and the copy-out's loads (one
// row, 32 chunks) are free of bank conflicts.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_util.h"

namespace hmoe {
namespace attn {

__device__ __forceinline__ uint32_t stage_addr(uint32_t stage, int row_bytes, int row, int byte) {
  return stage + row * row_bytes + ((((byte >> 4) ^ row) & 7) | ((byte >> 4) & ~7)) * 16 + (byte & 15);
}

// Columns col and col + 1 (col even) of row `row`, rounded to T (bf16 or fp16).
template <typename T>
__device__ __forceinline__ void stage_pair(uint32_t stage, int row_bytes, int row, int col, float x, float y) {
  static_assert(sizeof(T) == 2, "16-bit rows: fp32 rows leave the accumulator layout in whole sectors already");
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(stage_addr(stage, row_bytes, row, 2 * col)), "r"(pack2<T>(x, y))
               : "memory");
}

// Rows [0, rows) of the stage to dst (row r at dst + r * row_bytes), by threads tid of nthreads;
// the caller synchronises those threads between their stage_pair stores and this.
__device__ __forceinline__ void copy_out(uint32_t stage, int row_bytes, int rows, void* dst, int tid, int nthreads) {
  const int chunks = row_bytes / 16;
  char* out = static_cast<char*>(dst);
  for (int k = tid; k < rows * chunks; k += nthreads) {
    const int row = k / chunks, byte = (k % chunks) * 16;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage_addr(stage, row_bytes, row, byte)));
    *reinterpret_cast<uint4*>(out + int64_t(row) * row_bytes + byte) = v;
  }
}

}  // namespace attn
}  // namespace hmoe
