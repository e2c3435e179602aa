// Exact scalar conversions between fp32 and the 16-bit float types (no intrinsics); the dtype
// codes themselves are include/hmoe/dtype.h.
#pragma once
#include <cstdint>
#include <cstring>

#include "hmoe/dtype.h"

namespace hmoe {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet bit set).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while (!(man & 0x400u));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, overflow to inf, NaN preserved.
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (au >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (au < 0x38800000u) {                                  // below the smallest normal
    if (au < 0x33000000u) return uint16_t(sign);           // < half the smallest subnormal
    uint32_t e = au >> 23;
    uint32_t man = (au & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 .. 24 for this range
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t r = au + 0xfffu + ((au >> 13) & 1u) - (112u << 23);
  return uint16_t(sign | (r >> 13));
}

// float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities) times 2^-8,
// exactly: the byte's bits moved into an fp16 pattern (exponent field e, mantissa m) give that
// value for normal and subnormal bytes alike (the AVX2 kernels widen it so; the AVX-512 ones build
// the bf16 pattern directly: experts/isa/avx512_common.h). The NaN
// bytes (0x7f, 0xff) read as +-1.875: hmoe refuses them when packing.
inline float fp8_e4m3_to_f32_scaled(uint8_t b) { return f16_to_f32(uint16_t(((b & 0x7fu) << 7) | ((b & 0x80u) << 8))); }

// Conversion of n values of a float dtype (kF32, kF16, kBF16) to fp32.
inline void load_row_f32(const void* src, int32_t dtype, int64_t n, float* dst) {
  if (dtype == kF32) {
    std::memcpy(dst, src, n * 4);
  } else if (dtype == kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_f32(s[j]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t j = 0; j < n; ++j) dst[j] = f16_to_f32(s[j]);
  }
}

}  // namespace hmoe
