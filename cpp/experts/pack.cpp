// Packing of expert weights into 16-column blocks (see moe_params.h for the layout).
#include "experts/pack.h"

#include <cstring>

#include "experts/moe_params.h"

namespace hmoe {
namespace {

// Writes one 16-column block from rows[0..15] of src (row = -1: a zero column).
template <typename T>
void pack_block(const T* src, int64_t kd, const int64_t* rows, bool pairs, int64_t kpad, T* dst) {
  if (pairs) {
    for (int64_t kp = 0; kp < kpad / 2; ++kp) {
      for (int64_t j = 0; j < kBlockN; ++j) {
        for (int64_t h = 0; h < 2; ++h) {
          int64_t k = 2 * kp + h;
          dst[(kp * kBlockN + j) * 2 + h] = (rows[j] >= 0 && k < kd) ? src[rows[j] * kd + k] : T(0);
        }
      }
    }
  } else {
    for (int64_t k = 0; k < kd; ++k) {
      for (int64_t j = 0; j < kBlockN; ++j) dst[k * kBlockN + j] = rows[j] >= 0 ? src[rows[j] * kd + k] : T(0);
    }
  }
}

// rows_of(block, j) gives the source row of column j of block `block`, or -1.
template <typename RowsOf>
void pack_matrix(const void* src, int32_t w_dtype, int64_t b0, int64_t b1, int64_t kd, RowsOf rows_of, void* dst) {
  const bool pairs = w_dtype == kBF16;
  const int64_t kpad = packed_k(w_dtype, kd);
  const int64_t block = packed_block_elems(w_dtype, kd);
  int64_t rows[kBlockN];
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t j = 0; j < kBlockN; ++j) rows[j] = rows_of(b, j);
    if (w_dtype == kF32) {
      pack_block(static_cast<const float*>(src), kd, rows, false, kpad,
                 static_cast<float*>(dst) + (b - b0) * block);
    } else {
      pack_block(static_cast<const uint16_t*>(src), kd, rows, pairs, kpad,
                 static_cast<uint16_t*>(dst) + (b - b0) * block);
    }
  }
}

}  // namespace

void pack_w13_blocks(const void* w13, int32_t w_dtype, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst) {
  pack_matrix(w13, w_dtype, b0, b1, H, [I](int64_t b, int64_t j) -> int64_t {
    int64_t col = (b / 2) * kBlockN + j;  // column within gate (even b) or up (odd b)
    if (col >= I) return -1;
    return (b % 2) ? I + col : col;
  }, dst);
}

void pack_w2_blocks(const void* w2, int32_t w_dtype, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst) {
  pack_matrix(w2, w_dtype, b0, b1, I, [H](int64_t b, int64_t j) -> int64_t {
    int64_t row = b * kBlockN + j;
    return row < H ? row : -1;
  }, dst);
}

}  // namespace hmoe
