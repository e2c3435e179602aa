// Plain params struct for the CPU MoE experts op and the packed weight layout shared by every ISA.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace hmoe {

struct MoeParams {
  const void* x;             // [T, H], x_dtype
  int32_t x_dtype;
  const void* topk_ids;      // [T, K], ids_dtype (int32 or int64)
  int32_t ids_dtype;
  const float* topk_weights; // [T, K]
  const void* w13;           // [E, 2I, H] row-major, or packed (see below)
  const void* w2;            // [E, H, I] row-major, or packed
  int32_t w_dtype;
  int32_t packed;            // 1: w13/w2 hold the packed layout
  void* out;                 // [T, H], x_dtype
  int64_t T, K, E, H, I;
  int32_t num_threads;
};

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
