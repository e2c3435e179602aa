// Params struct and contract of decode_linear, y = x W^T for the few rows of a decode step (a
// GEMV-shaped matmul), shared by every variant of the op.
#pragma once
#include <cstdint>

#include "hmoe/constants.h"

namespace hmoe {

constexpr int kDecodeLinearMaxRows = k::decode_linear_max_rows;

// y[m, n] = sum_k x[m, k] * weight[n, k]: the products exact, accumulated in fp32 (in an order of the
// kernel's choosing), rounded once to the output dtype.
struct DecodeLinearParams {
  const void* x;       // [m, k], dtype, contiguous, 16-byte aligned
  const void* weight;  // [n, k], dtype, contiguous (nn.Linear's layout), 16-byte aligned
  void* y;             // [m, n], out_dtype
  int32_t m, n, k;     // 0 <= m <= kDecodeLinearMaxRows, k a multiple of 8
  int32_t dtype;       // kBF16 or kF16
  int32_t out_dtype;   // dtype or kF32
};

}  // namespace hmoe
