// Elementwise pieces of the expert kernels: silu(g) * u in fp32 and activation rounding.
// Written as plain loops over 16 lanes so that each ISA build vectorises them.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace hmoe {

// exp(x) for fp32 within ~2 ulp: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-7 Taylor
// polynomial, 2^n through the exponent bits. Inputs are clamped to the finite range; NaN
// is handled by the callers (silu keeps a NaN gate NaN).
inline float exp_f32(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // 2^n stays a normal float
  const float magic = 12582912.f;                     // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504f + magic) - magic;
  float r = x - n * 0.693145752f;
  r = r - n * 1.42860677e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// out[j] = silu(g[j]) * u[j] for 16 lanes, fp32.
inline void silu_mul16(const float* g, const float* u, float* out) {
  for (int j = 0; j < 16; ++j) out[j] = g[j] / (1.f + exp_f32(-g[j])) * u[j];
}

// Activation rows entering a matmul are kept in the "compute dtype": fp32, or bf16 (rounded
// to nearest even) when the weights are bf16. These store n values in that form.
inline void store_act(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * 4); }
inline void store_act(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = f32_to_bf16(src[j]);
}
// fp32 values that are exactly what store_act(.., uint16_t*) would keep.
inline void round_act_bf16(float* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) v[j] = bf16_to_f32(f32_to_bf16(v[j]));
}

inline void store_row(const float* src, int64_t n, int32_t dtype, void* dst) {
  if (dtype == kF32) {
    std::memcpy(dst, src, n * 4);
  } else if (dtype == kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) d[j] = f32_to_bf16(src[j]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) d[j] = f32_to_f16(src[j]);
  }
}

}  // namespace hmoe
