// Weight quantisation of hmoe.quant on the CPU (int8 per row or per group, int4 per group), bit for
// bit what quant.py's torch path computes for the same weights; see hmoe/quant.py for the rule.
#pragma once
#include <cstdint>

namespace hmoe {

// Quantises rows [r0, r1) of w [rows, kd] (dtype kF32, kF16 or kBF16, row-major) in groups of
// `group` columns (kd for one scale a row; kd % group == 0): q int8 [rows, kd], or for int4 two
// values a byte [rows, kd / 2] (k even in the low nibble), and scales fp32 [rows, kd / group].
// Returns false when a group holds NaN or infinity (what it wrote for that group is then meaningless).
bool quantize_rows(const void* w, int32_t dtype, int64_t kd, int64_t group, bool int4, int64_t r0, int64_t r1, void* q,
                   float* scales);

// Rows [r0, r1) of a stack of fp8 matrices viewed as rows of K float8_e4m3fn bytes (N rows a matrix),
// dequantised into out fp32 [rows, K]: each value times its block's scale (scales fp32 [L, ceil(N / rows),
// ceil(K / cols)]), the product in fp32, as hmoe.quant.dequantize computes it. Returns false when a byte is
// NaN (0x7f or 0xff; what it wrote is then meaningless).
bool dequantize_fp8_rows(const uint8_t* q, int64_t N, int64_t K, const float* scales, int64_t rows, int64_t cols,
                         int64_t r0, int64_t r1, float* out);

// Whether any of n float8_e4m3fn bytes is NaN.
bool fp8_has_nan(const uint8_t* q, int64_t n);

}  // namespace hmoe
