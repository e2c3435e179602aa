// Weight quantisation of hmoe.quant on the CPU (int8 per row or per group, int4 per group) and fp8
// dequantisation, bit for bit what quant.py's torch path computes; see hmoe/quant.py for the rules.
#pragma once
#include <cstdint>

namespace hmoe {

// A stack of weight matrices [L, N, K], row-major, viewed as L * N rows: float (dtype kF32, kF16 or kBF16)
// or float8_e4m3fn bytes (dtype kU8) with fp32 scales [L, ceil(N / rows), ceil(K / cols)] (DeepSeek's
// blocks), whose values are byte * scale (the product in fp32, as hmoe.quant.dequantize computes it).
struct WeightRows {
  const void* data;
  int32_t dtype;
  int64_t L, N, K;
  const float* fp8_scales;  // null for float weights
  int64_t rows, cols;
  bool fp8() const { return fp8_scales != nullptr; }
  // Row r in fp32.
  void row_f32(int64_t r, float* dst) const;
  // Whether rows [r0, r1) of fp8 bytes hold a NaN byte (0x7f or 0xff); false for float weights.
  bool has_nan(int64_t r0, int64_t r1) const;
};

// Quantises rows [r0, r1) of w in groups of `group` columns (K for one scale a row; K % group == 0):
// q int8 [rows, K], or for int4 two values a byte [rows, K / 2] (k even in the low nibble), and scales
// fp32 [rows, K / group]. Returns false when a group holds NaN or infinity, or an fp8 byte is NaN (what
// it wrote for that row is then meaningless).
bool quantize_rows(const WeightRows& w, int64_t group, bool int4, int64_t r0, int64_t r1, void* q, float* scales);

// Rows [r0, r1) of fp8 weights w dequantised into out fp32 [rows, K]. Returns false when a byte is NaN.
bool dequantize_fp8_rows(const WeightRows& w, int64_t r0, int64_t r1, float* out);

// Whether any of n float8_e4m3fn bytes is NaN.
bool fp8_has_nan(const uint8_t* q, int64_t n);

}  // namespace hmoe
