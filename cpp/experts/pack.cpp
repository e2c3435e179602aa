// Packing of expert weights into 16-column blocks (see format.h for the layout): float weights
// copied bit-exactly, quantised weights (hmoe.quant's storage) re-laid and their scales attached.
#include "experts/pack.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

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

// Blocks [b0, b1) of a float matrix of format Fmt with reduction length kd; rows_of(block, j) gives
// the source row of column j of block `block`, or -1.
template <class Fmt, typename RowsOf>
void pack_blocks(const void* src, int64_t b0, int64_t b1, int64_t kd, RowsOf rows_of, void* dst) {
  if constexpr (Fmt::kScaled) {
    throw std::invalid_argument(std::string("experts: ") + format_name(Fmt::kCode) +
                                " weights are packed from their quantised storage (pack_quantized)");
  } else {
    using T = typename Fmt::Elem;
    static_assert(Fmt::kBits == 8 * int(sizeof(T)), "a format of whole elements");
    int64_t rows[kBlockN];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < kBlockN; ++j) rows[j] = rows_of(b, j);
      pack_block(static_cast<const T*>(src), kd, rows, Fmt::kKGroup == 2, Fmt::packed_k(kd, 0),
                 reinterpret_cast<T*>(static_cast<char*>(dst) + (b - b0) * Fmt::block_bytes(kd, 0)));
    }
  }
}

// The rows of w13 ([2I, H]) behind its blocks: gate 0, up 0, gate 1, ... (format.h).
auto w13_rows(int64_t I) {
  return [I](int64_t b, int64_t j) -> int64_t {
    const int64_t col = (b / 2) * kBlockN + j;  // column within gate (even b) or up (odd b)
    if (col >= I) return -1;
    return (b % 2) ? I + col : col;
  };
}
auto w2_rows(int64_t H) {
  return [H](int64_t b, int64_t j) -> int64_t {
    const int64_t row = b * kBlockN + j;
    return row < H ? row : -1;
  };
}

// One group chunk of a block of a quantised format from rows[0..15] of the source: the weights in
// the format's layout (k from k0, zeros past kd), then the 16 column scales.
template <class Fmt>
void pack_chunk(const QuantMatrix& m, const int64_t* rows, int64_t group, int64_t k0, uint8_t* dst) {
  const int64_t kn = std::clamp<int64_t>(m.kd - k0, 0, group);  // k of this group inside the matrix
  const int64_t row_bytes = m.kd * Fmt::kBits / 8;
  const char* src = reinterpret_cast<const char*>(m.data) + k0 * Fmt::kBits / 8;
  uint8_t* w = dst;
  const int64_t wbytes = kBlockN * group * Fmt::kBits / 8;
  std::memset(w, 0, size_t(wbytes));
  if constexpr (Fmt::kCode == kWFp8) {  // [group/2][16][2]: k pairs as 16-bit units
    transpose_block(src, row_bytes, kn / 2, rows, reinterpret_cast<uint16_t*>(w));
    if (kn % 2)
      for (int64_t j = 0; j < kBlockN; ++j)
        if (rows[j] >= 0) w[(kn / 2 * kBlockN + j) * 2] = uint8_t(src[rows[j] * row_bytes + kn - 1]);
    for (int64_t i = 0; i < wbytes; ++i)
      if ((w[i] & 0x7f) == 0x7f) throw std::invalid_argument("experts: the fp8 weights hold NaN");
  } else if constexpr (Fmt::kBits == 8) {  // int8 [group/4][16][4]: k quads as 32-bit units, then + 128
    transpose_block(src, row_bytes, kn / 4, rows, reinterpret_cast<uint32_t*>(w));
    for (int64_t t = kn / 4 * 4; t < kn; ++t)
      for (int64_t j = 0; j < kBlockN; ++j)
        if (rows[j] >= 0) w[(t / 4 * kBlockN + j) * 4 + t % 4] = uint8_t(src[rows[j] * row_bytes + t]);
    for (int64_t i = 0; i < wbytes; ++i) {
      if (w[i] == 0x80) throw std::invalid_argument("experts: the int8 weights hold -128 (hmoe's int8 is [-127, 127])");
      w[i] ^= 0x80;  // q + 128
    }
  } else {  // int4: 8 k (4 source bytes, low nibble first) per column and 64-byte row
    static_assert(Fmt::kBits == 4, "int4");
    const int64_t kn8 = ceil_div(kn, 8);
    std::unique_ptr<uint32_t[]> t(new uint32_t[size_t(std::max<int64_t>(1, kn8 * kBlockN))]);
    transpose_block(src, row_bytes, kn / 8, rows, t.get());
    if (kn % 8)
      for (int64_t j = 0; j < kBlockN; ++j) {
        uint32_t v = 0;
        if (rows[j] >= 0) std::memcpy(&v, src + rows[j] * row_bytes + kn / 8 * 4, size_t(kn % 8 / 2));
        t[size_t(kn / 8 * kBlockN + j)] = v;
      }
    for (int64_t r = 0; r < group / 8; ++r)
      for (int64_t j = 0; j < kBlockN; ++j) {
        uint32_t v = r < kn8 ? t[size_t(r * kBlockN + j)] : 0;  // nibbles k = 8r .. 8r + 7 of column j
        v ^= 0x88888888u;                                       // two's complement nibble q -> q + 8
        for (int q = 0; q < 4; ++q) {                           // byte q: k = 8r + q (low nibble) and 8r + 4 + q (high)
          const uint32_t lo = (v >> (4 * q)) & 0xf, hi = (v >> (4 * (q + 4))) & 0xf;
          w[r * 64 + 4 * j + q] = uint8_t(lo | hi << 4);
        }
      }
  }
  float* scales = reinterpret_cast<float*>(dst + wbytes);
  const float fold = Fmt::kCode == kWFp8 ? 256.f : 1.f;  // fp8 kernels read w * 2^-8 (format.h)
  for (int64_t j = 0; j < kBlockN; ++j)
    scales[j] = rows[j] < 0 ? 0.f : m.scales[(rows[j] / m.scale_rows) * m.scale_ncols + k0 / m.scale_cols] * fold;
}

template <class Fmt, typename RowsOf>
void pack_quant(const QuantMatrix& m, int64_t group, int64_t nblocks, RowsOf rows_of, void* dst) {
  const int64_t groups = Fmt::groups(m.kd, group), chunk = Fmt::chunk_bytes(group);
  int64_t rows[kBlockN];
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t j = 0; j < kBlockN; ++j) rows[j] = rows_of(b, j);
    for (int64_t g = 0; g < groups; ++g) pack_chunk<Fmt>(m, rows, group, g * group, out + (b * groups + g) * chunk);
  }
}

template <typename RowsOf>
void pack_quant_matrix(int32_t fmt, const QuantMatrix& m, int64_t group, int64_t nblocks, RowsOf rows_of, void* dst) {
  with_format(fmt, [&](auto f) {
    using Fmt = decltype(f);
    if constexpr (Fmt::kScaled)
      pack_quant<Fmt>(m, group, nblocks, rows_of, dst);
    else
      throw std::invalid_argument("experts: pack_quantized takes a quantised format");
  });
}

}  // namespace

void pack_w13_blocks(const void* w13, int32_t fmt, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst) {
  with_format(fmt, [&](auto f) { pack_blocks<decltype(f)>(w13, b0, b1, H, w13_rows(I), dst); });
}

void pack_w2_blocks(const void* w2, int32_t fmt, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst) {
  with_format(fmt, [&](auto f) { pack_blocks<decltype(f)>(w2, b0, b1, I, w2_rows(H), dst); });
}

void pack_quant_w13(int32_t fmt, const QuantMatrix& m, int64_t I, int64_t group, void* dst) {
  pack_quant_matrix(fmt, m, group, 2 * ceil_div(I, kBlockN), w13_rows(I), dst);
}

void pack_quant_w2(int32_t fmt, const QuantMatrix& m, int64_t H, int64_t group, void* dst) {
  pack_quant_matrix(fmt, m, group, ceil_div(H, kBlockN), w2_rows(H), dst);
}

}  // namespace hmoe
