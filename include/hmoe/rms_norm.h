// Params struct and contract of rms_norm (transformers' DeepSeek/Llama RMSNorm in one kernel), shared
// by every variant of the op.
#pragma once
#include <cstdint>

namespace hmoe {

// y[t] = round(weight * round(x[t] * rsqrt(mean(x[t]^2) + eps))): the mean of squares in fp32, the
// normalised row rounded to dtype, then its product with the weight rounded again (where transformers'
// RMSNorm rounds: it casts the normalised fp32 row to the input dtype before the weight multiplies it).
struct RmsNormParams {
  const void* x;       // [rows, dim], dtype, contiguous, 16-byte aligned
  const void* weight;  // [dim], dtype, 16-byte aligned
  void* y;             // [rows, dim], dtype
  int64_t rows;
  int32_t dim;    // a multiple of 8
  int32_t dtype;  // kBF16 or kF16
  float eps;
};

}  // namespace hmoe
