// Expert weight formats: one trait per format says how its weights are stored, packed and
// rounded, shared by every ISA variant of the experts op (params: include/hmoe/experts.h).
// A format is a Format specialisation here, its packer (pack.cpp) and its microkernels (Micro in
// gemm.h); with_format is the one dispatch on the format code, so run_moe, the packers and the
// size queries pick it up from there.
//
// Packed layout. A weight matrix W[N, Kd] (N output columns, Kd reduction) is stored as blocks
// of kBlockN = 16 output columns; each block holds all of Kd, padded with zeros to packed_k, as
// Format::kKGroup consecutive k of one column side by side:
//   bf16:      [Kp / 2][16][2]        (pairs for vdpbf16ps, 32-deep tiles for AMX)
//   fp16/fp32: [Kp][16]
// Scaled (quantised) formats split Kp into groups of `group` k that share one fp32 scale per
// column; a block is one chunk per group, each the group's weights followed by its 16 scales:
//   int8:      [group / 4][16][4] bytes q + 128, then fp32 scale[16]   (VNNI / AMX-INT8 operand)
//   int4:      [group / 8][64] bytes, byte 4c + j of row r: low nibble q + 8 of k = 8r + j, high
//              nibble q + 8 of k = 8r + 4 + j (column c): unpacking a row gives two int8 rows
//   fp8:       [group / 2][16][2] float8_e4m3fn bytes, then fp32 scale * 256 (the kernels widen
//              e4m3 through fp16 bit patterns, i.e. to w * 2^-8, exactly)
// w13 interleaves its blocks as gate 0, up 0, gate 1, up 1, ... so that a task holding blocks
// (2b, 2b+1) can apply silu(gate) * up right away.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "hmoe/experts.h"

namespace hmoe {

constexpr int64_t kBlockN = 16;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Weight format codes: the float formats are their dtype codes (include/hmoe/dtype.h).
enum WeightFormat : int32_t {
  kWInt8 = k::weight_format_int8,
  kWInt4 = k::weight_format_int4,
  kWFp8 = k::weight_format_fp8,
};

// The form activations take where they enter a format's matmuls (the precision contract of
// hmoe.ops.experts): fp32, rounded to bf16, or int8 quantised per (row, group).
enum class Act { kF32, kBF16, kI8 };

// What every format states (checked by FormatContract below):
//   kCode      its format code (a dtype code for the float formats)
//   Elem       the storage unit the float packer moves (uint8_t for the quantised formats)
//   kBits      bits per weight
//   kKGroup    consecutive k of one column stored side by side in a block (1, 2 or 4)
//   kKAlign    an unscaled block's Kd is rounded up to a multiple of this (zeros)
//   kScaled    weights carry one fp32 scale per (column, group of k); the group is a run-time
//              property of a packed matrix (valid_group), Kd is padded to a multiple of it
//   kOffset    quantised values are stored as q + kOffset (unsigned); 0 for float formats
//   kAct       the activation form (Act above)
//   kTiles     the matrix unit (isa::Tiles, AMX) multiplies this format
template <int32_t Code>
struct Format;

// k groups a scaled format may be packed with: 32, 64, or a multiple of 128 (int8 scaled per row
// takes its whole row, rounded up, as one group).
inline bool valid_group(int64_t group) { return group == 32 || group == 64 || (group >= 128 && group % 128 == 0); }

// Sizes every format derives the same way from its constants; `group` is ignored (0) for
// unscaled formats.
template <class F>
struct FormatSizes {
  static int64_t packed_k(int64_t kd, int64_t group) { return round_up(kd, F::kScaled ? group : F::kKAlign); }
  static int64_t groups(int64_t kd, int64_t group) { return F::kScaled ? packed_k(kd, group) / group : 1; }
  // Bytes of one group's chunk of a block: its weights, then (scaled formats) 16 fp32 scales.
  static int64_t chunk_bytes(int64_t group) { return kBlockN * group * F::kBits / 8 + (F::kScaled ? kBlockN * 4 : 0); }
  // Bytes of one packed block of 16 columns over Kd, scales included.
  static int64_t block_bytes(int64_t kd, int64_t group) {
    return F::kScaled ? groups(kd, group) * chunk_bytes(group) : kBlockN * packed_k(kd, group) * F::kBits / 8;
  }
  // Bytes of one expert's packed w13 ([2I, H]) and w2 ([H, I]).
  static int64_t w13_bytes(int64_t H, int64_t I, int64_t g13) { return 2 * ceil_div(I, kBlockN) * block_bytes(H, g13); }
  static int64_t w2_bytes(int64_t H, int64_t I, int64_t g2) { return ceil_div(H, kBlockN) * block_bytes(I, g2); }
};

struct FloatFormat {
  static constexpr bool kScaled = false;
  static constexpr int kOffset = 0;
};
struct ScaledFormat {
  using Elem = uint8_t;
  static constexpr bool kScaled = true;
  static constexpr int64_t kKAlign = 8;  // unused: a scaled block's Kd is padded to its group
};

template <>
struct Format<kBF16> : FormatSizes<Format<kBF16>>, FloatFormat {
  static constexpr int32_t kCode = kBF16;
  using Elem = uint16_t;
  static constexpr int kBits = 16, kKGroup = 2;
  static constexpr int64_t kKAlign = 32;
  static constexpr Act kAct = Act::kBF16;
  static constexpr bool kTiles = true;
};

template <>
struct Format<kF16> : FormatSizes<Format<kF16>>, FloatFormat {
  static constexpr int32_t kCode = kF16;
  using Elem = uint16_t;
  static constexpr int kBits = 16, kKGroup = 1;
  static constexpr int64_t kKAlign = 1;
  static constexpr Act kAct = Act::kF32;
  static constexpr bool kTiles = false;
};

template <>
struct Format<kF32> : FormatSizes<Format<kF32>>, FloatFormat {
  static constexpr int32_t kCode = kF32;
  using Elem = float;
  static constexpr int kBits = 32, kKGroup = 1;
  static constexpr int64_t kKAlign = 1;
  static constexpr Act kAct = Act::kF32;
  static constexpr bool kTiles = false;
};

template <>
struct Format<kWInt8> : FormatSizes<Format<kWInt8>>, ScaledFormat {
  static constexpr int32_t kCode = kWInt8;
  static constexpr int kBits = 8, kKGroup = 4, kOffset = 128;
  static constexpr Act kAct = Act::kI8;
  static constexpr bool kTiles = true;
};

template <>
struct Format<kWInt4> : FormatSizes<Format<kWInt4>>, ScaledFormat {
  static constexpr int32_t kCode = kWInt4;
  static constexpr int kBits = 4, kKGroup = 4, kOffset = 8;
  static constexpr Act kAct = Act::kI8;
  static constexpr bool kTiles = true;
};

template <>
struct Format<kWFp8> : FormatSizes<Format<kWFp8>>, ScaledFormat {
  static constexpr int32_t kCode = kWFp8;
  static constexpr int kBits = 8, kKGroup = 2, kOffset = 0;
  static constexpr Act kAct = Act::kBF16;
  static constexpr bool kTiles = false;
  static constexpr float kScaleFold = 256.f;  // the kernels read w * 2^-8 (format.h layout)
};

template <class F>
constexpr bool FormatContract() {
  static_assert(Format<F::kCode>::kBits == F::kBits, "Format<kCode> is this format");
  static_assert(F::kBits == 4 || F::kBits == 8 || F::kBits == 16 || F::kBits == 32, "kBits");
  static_assert(int(sizeof(typename F::Elem)) * 8 >= F::kBits, "Elem holds one weight");
  static_assert(F::kKGroup == 1 || F::kKGroup == 2 || F::kKGroup == 4, "kKGroup");
  static_assert(F::kKAlign >= 1 && F::kKAlign % F::kKGroup == 0, "kKAlign covers whole k groups");
  static_assert(F::kKAlign * F::kBits % 8 == 0, "a block's rows are whole bytes");
  static_assert(F::kScaled || F::kOffset == 0, "only quantised formats store offset values");
  static_assert((F::kAct == Act::kI8) == (F::kScaled && F::kOffset > 0), "integer weights take int8 activations");
  static_assert(!F::kTiles || F::kAct == Act::kI8 || (F::kBits == 16 && F::kKGroup == 2 && F::kKAlign % 32 == 0),
                "the matrix unit takes bf16 pairs in 32-deep tiles, or int8 quads");
  return true;
}
static_assert(FormatContract<Format<kBF16>>() && FormatContract<Format<kF16>>() && FormatContract<Format<kF32>>() &&
              FormatContract<Format<kWInt8>>() && FormatContract<Format<kWInt4>>() && FormatContract<Format<kWFp8>>());

inline const char* format_name(int32_t code) {
  switch (code) {
    case kWInt8:
      return "int8";
    case kWInt4:
      return "int4";
    case kWFp8:
      return "fp8";
    default:
      return dtype_name(code);
  }
}

// Calls f(Format<code>{}) for the weight format `code`; throws std::invalid_argument (ValueError
// in Python) for a code no format covers.
template <typename Fn>
decltype(auto) with_format(int32_t code, Fn&& f) {
  switch (code) {
    case kBF16:
      return f(Format<kBF16>{});
    case kF16:
      return f(Format<kF16>{});
    case kF32:
      return f(Format<kF32>{});
    case kWInt8:
      return f(Format<kWInt8>{});
    case kWInt4:
      return f(Format<kWInt4>{});
    case kWFp8:
      return f(Format<kWFp8>{});
    default:
      throw std::invalid_argument(std::string("expert weights: no weight format for ") +
                                  (code >= 0 && code < kNumDTypes ? std::string("dtype ") + dtype_name(code) : "") +
                                  " (code " + std::to_string(code) +
                                  "); expected bfloat16, float16, float32 or the quantised int8, int4, fp8");
  }
}

// Throws std::invalid_argument unless `group` suits format `code` (a scaled format: 32, 64 or 128;
// an unscaled one: 0).
inline void check_group(int32_t code, int64_t group, const char* what) {
  with_format(code, [&](auto f) {
    if (decltype(f)::kScaled ? !valid_group(group) : group != 0)
      throw std::invalid_argument(std::string(what) + ": k group " + std::to_string(group) + " does not suit the " +
                                  format_name(code) + " format (" +
                                  (decltype(f)::kScaled ? "32, 64 or a multiple of 128" : "0: no scales") + ")");
  });
}

inline int64_t packed_w13_bytes(int32_t fmt, int64_t H, int64_t I, int64_t g13) {
  return with_format(fmt, [&](auto f) { return decltype(f)::w13_bytes(H, I, g13); });
}
inline int64_t packed_w2_bytes(int32_t fmt, int64_t H, int64_t I, int64_t g2) {
  return with_format(fmt, [&](auto f) { return decltype(f)::w2_bytes(H, I, g2); });
}

}  // namespace hmoe
