// Repacks expert weights into the packed layout of format.h: row-major float weights bit-exactly,
// quantised weights (hmoe.quant's storage) with their scales attached to every group chunk.
#pragma once
#include <cstdint>

namespace hmoe {

// Blocks [b0, b1) of one expert's packed w13 (from [2I, H]; 2 * ceil(I/16) blocks in all) or
// w2 (from [H, I]; ceil(H/16) blocks) of a float format, written contiguously to dst. The whole
// expert is [0, n_blocks).
void pack_w13_blocks(const void* w13, int32_t fmt, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst);
void pack_w2_blocks(const void* w2, int32_t fmt, int64_t H, int64_t I, int64_t b0, int64_t b1, void* dst);

// One expert's quantised matrix [N, kd] as hmoe.quant stores it: data int8 [N, kd] (int8), fp8
// bytes [N, kd] (fp8) or two nibbles a byte [N, kd / 2] (int4, k even in the low nibble); scales
// fp32 [ceil(N / scale_rows), scale_ncols], the scale of (n, k) at (n / scale_rows, k / scale_cols).
struct QuantMatrix {
  const void* data;
  int64_t kd;
  const float* scales;
  int64_t scale_rows, scale_cols, scale_ncols;
};

// The whole packed w13 (gate/up blocks interleaved) or w2 of one expert in format `fmt` with k group
// `group`; throws std::invalid_argument for NaN fp8 bytes or int8 values of -128.
void pack_quant_w13(int32_t fmt, const QuantMatrix& m, int64_t I, int64_t group, void* dst);
void pack_quant_w2(int32_t fmt, const QuantMatrix& m, int64_t H, int64_t group, void* dst);

}  // namespace hmoe
