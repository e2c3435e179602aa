// Expert weight formats: one trait per format says how its weights are stored, packed and
// rounded, shared by every ISA variant of the experts op (params: include/hmoe/experts.h).
// A new format (int8, int4, fp8 with scales) is a Format specialisation here, its packer
// (pack.cpp) and its microkernels (Micro in gemm.h); with_format is the one dispatch on the
// weight dtype, so run_moe, the packer and the size queries pick it up from there.
//
// Packed layout. A weight matrix W[N, Kd] (N output columns, Kd reduction) is stored as blocks
// of kBlockN = 16 output columns; each block holds all of Kd, rounded up to Format::kKAlign,
// as Format::kKGroup consecutive k of one column side by side:
//   bf16:      [Kd_pad / 2][16][2]   (pairs for vdpbf16ps, 32-deep tiles for AMX)
//   fp16/fp32: [Kd][16]
// followed by the block's scales where the format has them (Format::scale_bytes). Padding is
// zero. w13 interleaves its blocks as gate 0, up 0, gate 1, up 1, ... so that a task holding
// blocks (2b, 2b+1) can apply silu(gate) * up right away.
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

// What every format states (checked by FormatContract below):
//   kCode      the dtype code of the weights as the user passes them (include/hmoe/dtype.h)
//   Elem       the storage unit of one weight as the packer moves it
//   kBits      bits per weight (lets a format hold two weights per byte)
//   kKGroup    consecutive k of one column stored side by side in a block (1, or 2 for pairs)
//   kKAlign    a block's Kd is rounded up to a multiple of this (zeros)
//   kScaleK    weights along k that share one fp32 scale per column; 0: the format has none
//   kBf16Act   activations entering the matmuls are rounded to bf16 (the precision contract
//              of hmoe.ops.experts) and, on the packed path, stored as bf16
//   kTiles     the matrix unit (isa::Tiles, AMX) multiplies this format
template <int32_t Code>
struct Format;

// Sizes every format derives the same way from its constants.
template <class F>
struct FormatSizes {
  static int64_t packed_k(int64_t kd) { return round_up(kd, F::kKAlign); }
  static int64_t scale_bytes(int64_t kd) { return F::kScaleK ? kBlockN * (packed_k(kd) / F::kScaleK) * 4 : 0; }
  // Bytes of one packed block of 16 columns over Kd, scales included.
  static int64_t block_bytes(int64_t kd) { return kBlockN * packed_k(kd) * F::kBits / 8 + scale_bytes(kd); }
  // Bytes of one expert's packed w13 ([2I, H]) and w2 ([H, I]).
  static int64_t w13_bytes(int64_t H, int64_t I) { return 2 * ceil_div(I, kBlockN) * block_bytes(H); }
  static int64_t w2_bytes(int64_t H, int64_t I) { return ceil_div(H, kBlockN) * block_bytes(I); }
};

template <>
struct Format<kBF16> : FormatSizes<Format<kBF16>> {
  static constexpr int32_t kCode = kBF16;
  using Elem = uint16_t;
  static constexpr int kBits = 16, kKGroup = 2;
  static constexpr int64_t kKAlign = 32, kScaleK = 0;
  static constexpr bool kBf16Act = true, kTiles = true;
};

template <>
struct Format<kF16> : FormatSizes<Format<kF16>> {
  static constexpr int32_t kCode = kF16;
  using Elem = uint16_t;
  static constexpr int kBits = 16, kKGroup = 1;
  static constexpr int64_t kKAlign = 1, kScaleK = 0;
  static constexpr bool kBf16Act = false, kTiles = false;
};

template <>
struct Format<kF32> : FormatSizes<Format<kF32>> {
  static constexpr int32_t kCode = kF32;
  using Elem = float;
  static constexpr int kBits = 32, kKGroup = 1;
  static constexpr int64_t kKAlign = 1, kScaleK = 0;
  static constexpr bool kBf16Act = false, kTiles = false;
};

template <class F>
constexpr bool FormatContract() {
  static_assert(Format<F::kCode>::kBits == F::kBits, "Format<kCode> is this format");
  static_assert(F::kBits == 4 || F::kBits == 8 || F::kBits == 16 || F::kBits == 32, "kBits");
  static_assert(int(sizeof(typename F::Elem)) * 8 >= F::kBits, "Elem holds one weight");
  static_assert(F::kKGroup == 1 || F::kKGroup == 2, "kKGroup");
  static_assert(F::kKAlign >= 1 && F::kKAlign % F::kKGroup == 0, "kKAlign covers whole k groups");
  static_assert(F::kKAlign * F::kBits % 8 == 0, "a block's rows are whole bytes");
  static_assert(F::kScaleK == 0 || F::kScaleK % F::kKAlign == 0, "scale groups cover whole k blocks");
  static_assert(!F::kTiles || (F::kBits == 16 && F::kKGroup == 2 && F::kKAlign % 32 == 0),
                "the matrix unit takes bf16 pairs in 32-deep tiles");
  return true;
}
static_assert(FormatContract<Format<kBF16>>() && FormatContract<Format<kF16>>() && FormatContract<Format<kF32>>());

// Calls f(Format<code>{}) for the weight dtype `code`; throws std::invalid_argument (ValueError
// in Python) for a dtype no format covers.
template <typename Fn>
decltype(auto) with_format(int32_t code, Fn&& f) {
  switch (code) {
    case kBF16:
      return f(Format<kBF16>{});
    case kF16:
      return f(Format<kF16>{});
    case kF32:
      return f(Format<kF32>{});
    default:
      throw std::invalid_argument(std::string("expert weights: no weight format for dtype ") + dtype_name(code) +
                                  " (code " + std::to_string(code) + "); expected bfloat16, float16 or float32");
  }
}

inline int64_t packed_w13_bytes(int32_t w_dtype, int64_t H, int64_t I) {
  return with_format(w_dtype, [&](auto f) { return decltype(f)::w13_bytes(H, I); });
}
inline int64_t packed_w2_bytes(int32_t w_dtype, int64_t H, int64_t I) {
  return with_format(w_dtype, [&](auto f) { return decltype(f)::w2_bytes(H, I); });
}

}  // namespace hmoe
