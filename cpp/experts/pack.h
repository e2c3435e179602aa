// Repacks row-major expert weights into the packed layout of format.h (bit-exact copy).
#pragma once
#include <cstdint>

namespace hmoe {

// Blocks [b0, b1) of one expert's packed w13 (from [2I, H]; 2 * ceil(I/16) blocks in all) or
// w2 (from [H, I]; ceil(H/16) blocks), written contiguously to dst. The whole expert is
// [0, n_blocks).
void pack_w13_blocks(const void* w13, int32_t w_dtype, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst);
void pack_w2_blocks(const void* w2, int32_t w_dtype, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst);

}  // namespace hmoe
