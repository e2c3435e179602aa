// Packing of expert weights into 16-column blocks (see format.h for the layout).
#include "experts/pack.h"

#include <algorithm>
#include <cstring>

#include "experts/format.h"

namespace hmoe {
namespace {

// Transposes rows[0..15] of src (units of type U, `units` per row, row r at src + r * ld) into
// dst[unit][16]; row -1 gives zeros. Done in 16 x 16 tiles so that reads stay sequential per
// row and writes stay in L1.
template <typename U>
void transpose_block(const char* src, int64_t ld_bytes, int64_t units, const int64_t* rows, U* dst) {
  for (int64_t u0 = 0; u0 < units; u0 += 16) {
    const int64_t un = std::min<int64_t>(16, units - u0);
    for (int64_t j = 0; j < kBlockN; ++j) {
      if (rows[j] < 0) {
        for (int64_t u = 0; u < un; ++u) dst[(u0 + u) * kBlockN + j] = U(0);
        continue;
      }
      const char* s = src + rows[j] * ld_bytes + u0 * int64_t(sizeof(U));
      for (int64_t u = 0; u < un; ++u) {
        U v;
        std::memcpy(&v, s + u * int64_t(sizeof(U)), sizeof(U));
        dst[(u0 + u) * kBlockN + j] = v;
      }
    }
  }
}

// Writes one 16-column block from rows[0..15] of src (row = -1: a zero column).
template <typename T>
void pack_block(const T* src, int64_t kd, const int64_t* rows, bool pairs, int64_t kpad, T* dst) {
  const char* base = reinterpret_cast<const char*>(src);
  const int64_t ld = kd * int64_t(sizeof(T));
  if (!pairs) {
    transpose_block(base, ld, kd, rows, dst);
    return;
  }
  // bf16: whole pairs move as 32-bit units; an odd last k and the padding are written here.
  const int64_t full = kd / 2;
  transpose_block(base, ld, full, rows, reinterpret_cast<uint32_t*>(dst));
  for (int64_t kp = full; kp < kpad / 2; ++kp) {
    for (int64_t j = 0; j < kBlockN; ++j) {
      const int64_t k = 2 * kp;
      dst[(kp * kBlockN + j) * 2] = (rows[j] >= 0 && k < kd) ? src[rows[j] * kd + k] : T(0);
      dst[(kp * kBlockN + j) * 2 + 1] = T(0);
    }
  }
}

// Blocks [b0, b1) of a matrix of format Fmt with reduction length kd; rows_of(block, j) gives
// the source row of column j of block `block`, or -1. Copies weights as they are: a format
// with scales or sub-byte weights brings its own packer.
template <class Fmt, typename RowsOf>
void pack_blocks(const void* src, int64_t b0, int64_t b1, int64_t kd, RowsOf rows_of, void* dst) {
  using T = typename Fmt::Elem;
  static_assert(Fmt::kScaleK == 0 && Fmt::kBits == 8 * int(sizeof(T)), "an unscaled format of whole elements");
  int64_t rows[kBlockN];
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t j = 0; j < kBlockN; ++j) rows[j] = rows_of(b, j);
    pack_block(static_cast<const T*>(src), kd, rows, Fmt::kKGroup == 2, Fmt::packed_k(kd),
               reinterpret_cast<T*>(static_cast<char*>(dst) + (b - b0) * Fmt::block_bytes(kd)));
  }
}

template <typename RowsOf>
void pack_matrix(const void* src, int32_t w_dtype, int64_t b0, int64_t b1, int64_t kd, RowsOf rows_of, void* dst) {
  with_format(w_dtype, [&](auto fmt) { pack_blocks<decltype(fmt)>(src, b0, b1, kd, rows_of, dst); });
}

}  // namespace

void pack_w13_blocks(const void* w13, int32_t w_dtype, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst) {
  pack_matrix(
      w13, w_dtype, b0, b1, H,
      [I](int64_t b, int64_t j) -> int64_t {
        int64_t col = (b / 2) * kBlockN + j;  // column within gate (even b) or up (odd b)
        if (col >= I) return -1;
        return (b % 2) ? I + col : col;
      },
      dst);
}

void pack_w2_blocks(const void* w2, int32_t w_dtype, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst) {
  pack_matrix(
      w2, w_dtype, b0, b1, I,
      [H](int64_t b, int64_t j) -> int64_t {
        int64_t row = b * kBlockN + j;
        return row < H ? row : -1;
      },
      dst);
}

}  // namespace hmoe
