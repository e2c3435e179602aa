// The packed weight layout shared by every ISA variant of the experts op (params: include/hmoe/experts.h).
#pragma once
#include <cstdint>

#include "common/dtype.h"
#include "hmoe/experts.h"

namespace hmoe {

// Packed layout. A weight matrix W[N, Kd] (N output columns, Kd reduction) is stored as
// blocks of kBlockN = 16 output columns; each block holds all of Kd:
//   bf16:      [Kd_pad / 2][16][2]   (Kd_pad = Kd rounded up to 32: pairs for vdpbf16ps,
//                                     32-deep tiles for AMX)
//   fp16/fp32: [Kd][16]
// Padding is zero. w13 interleaves its blocks as gate 0, up 0, gate 1, up 1, ... so that a
// task holding blocks (2b, 2b+1) can apply silu(gate) * up right away.
constexpr int64_t kBlockN = 16;
constexpr int64_t kBf16KAlign = 32;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t packed_k(int32_t w_dtype, int64_t kd) {
  return w_dtype == kBF16 ? round_up(kd, kBf16KAlign) : kd;
}
inline int64_t packed_block_elems(int32_t w_dtype, int64_t kd) { return kBlockN * packed_k(w_dtype, kd); }
// Bytes of one expert's packed w13 ([2I, H]) and w2 ([H, I]).
inline int64_t packed_w13_bytes(int32_t w_dtype, int64_t H, int64_t I) {
  return 2 * ceil_div(I, kBlockN) * packed_block_elems(w_dtype, H) * dtype_size(w_dtype);
}
inline int64_t packed_w2_bytes(int32_t w_dtype, int64_t H, int64_t I) {
  return ceil_div(H, kBlockN) * packed_block_elems(w_dtype, I) * dtype_size(w_dtype);
}

}  // namespace hmoe
