// A CTA's 16-bit output rows written through shared memory: the attention kernels hold O in the
// tensor cores' accumulator layout (a warp's 32 lanes: 8 rows x 4 lanes of 2 consecutive columns),
// where a direct store of bf16/fp16 pairs is 8 scattered 16-byte pieces (half sectors) per warp
// instruction. Staged in shared memory, the rows leave in 16-byte vectors, a warp writing 512
// contiguous bytes per instruction.
// The stage: row r at r * row_bytes (a multiple of 128), its 16-byte chunks XOR-swizzled by r % 8,
// so that the stores of the accumulator layout (8 rows, one chunk each: an 8 x 8 piece of stmatrix)
// and the copy-out's loads (one row, 32 chunks) are free of bank conflicts.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace hmoe {
namespace attn {

__device__ __forceinline__ uint32_t stage_addr(uint32_t stage, int row_bytes, int row, int byte) {
  return stage + row * row_bytes + ((((byte >> 4) ^ row) & 7) | ((byte >> 4) & ~7)) * 16 + (byte & 15);
}

// Rows [0, rows) of the stage to dst (row r at dst + r * row_bytes), bytes [first, first + bytes)
// of each (a multiple of 16; the whole row by default), by threads tid of nthreads; the caller
// synchronises those threads between their stores into the stage and this.
__device__ __forceinline__ void copy_out(uint32_t stage, int row_bytes, int rows, void* dst, int tid, int nthreads,
                                         int first = 0, int bytes = -1) {
  const int chunks = (bytes < 0 ? row_bytes : bytes) / 16;
  char* out = static_cast<char*>(dst);
  for (int k = tid; k < rows * chunks; k += nthreads) {
    const int row = k / chunks, byte = first + (k % chunks) * 16;
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(stage_addr(stage, row_bytes, row, byte)));
    *reinterpret_cast<uint4*>(out + int64_t(row) * row_bytes + byte) = v;
  }
}

}  // namespace attn
}  // namespace hmoe
