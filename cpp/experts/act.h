// Activations of the expert kernels: silu(g) * u in fp32, and the rows entering a matmul in the
// form a weight format's kernels read (format.h Act): fp32, bf16, or int8 quantised per group.
// The elementwise loops are plain loops over 16 lanes so that each ISA build vectorises them.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "common/dtype.h"
#include "experts/format.h"
#include "experts/workspace.h"

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

// fp32 values rounded to bf16 (nearest even) and back: what a bf16 activation row holds.
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

// Symmetric quantisation of one group of n values to [-QMax, QMax] (int8 activations: the precision
// contract of hmoe.ops.experts; int8 and int4 weights: hmoe.quant's rule): s = max|x| / QMax (fp32),
// q = round-half-even(x / s) (fp32 division), sum = sum of q. A group of zeros has s = 0, q = 0; a
// group holding NaN or infinity keeps that in s (q = 0), so the products it enters are not finite
// either: a bad input never turns into a plausible result.
template <int QMax>
inline void quantize_group(const float* x, int64_t n, int8_t* q, float& scale, int32_t& sum) {
  // Written as loops the compiler vectorises (16 lanes of max, a division a lane): the gather of a
  // long prefill quantises every activation.
  float m[16] = {};
  int32_t nans = 0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    for (int j = 0; j < 16; ++j) {
      const float a = std::fabs(x[k + j]);
      m[j] = a > m[j] ? a : m[j];
      nans += a != a;
    }
  for (; k < n; ++k) {
    const float a = std::fabs(x[k]);
    m[0] = a > m[0] ? a : m[0];
    nans += a != a;
  }
  float amax = 0.f;
  for (float v : m) amax = v > amax ? v : amax;
  const float s = nans ? std::nanf("") : amax / float(QMax);
  scale = s, sum = 0;
  if (!(s > 0.f) || s == INFINITY) {  // zero, NaN or infinite scale
    std::memset(q, 0, size_t(n));
    return;
  }
  const float magic = 12582912.f;  // 1.5 * 2^23: (v + magic) - magic rounds |v| < 2^22 half to even
  int32_t total = 0;
  for (k = 0; k < n; ++k) {
    float v = (x[k] / s + magic) - magic;
    v = v > float(QMax) ? float(QMax) : (v < -float(QMax) ? -float(QMax) : v);
    const int32_t iv = int32_t(v);
    q[k] = int8_t(iv);
    total += iv;
  }
  sum = total;
}
inline void quantize_group_i8(const float* x, int64_t n, int8_t* q, float& scale, int32_t& sum) {
  quantize_group<127>(x, n, q, scale, sum);
}

// Rows of activations entering a matmul. A buffer keeps `pad` zero rows past its last row (32 where
// the call copies rows into 32-row tiles, which then never read past the end; none otherwise).
// `store` writes one row from n fp32 values (the rest of the row, up to ld, reads as zero),
// `copy_row` copies one row to another; `at(row)` is what the microkernels take.
template <Act A>
struct ActRows;

template <class T>
struct PlainRows {
  struct Panel {
    const T* p;
    int64_t ld;
  };
  T* buf = nullptr;
  int64_t ld = 0;
  void alloc(Workspace::Call& ws, int64_t rows, int64_t ld_, int64_t pad) {
    ld = ld_;
    buf = ws.take<T>((rows + pad) * ld);
    std::memset(static_cast<void*>(buf + rows * ld), 0, size_t(pad * ld) * sizeof(T));
  }
  Panel at(int64_t row) const { return {buf + row * ld, ld}; }
  void copy_row(int64_t dst, int64_t src) {
    std::memcpy(static_cast<void*>(buf + dst * ld), buf + src * ld, size_t(ld) * sizeof(T));
  }
};

// fp32 and bf16 rows can also be written 16 columns at a time (store_cols): silu(g) * u of a
// block pair goes straight into the next matmul's rows.
template <>
struct ActRows<Act::kF32> : PlainRows<float> {
  bool round_bf16 = false;  // the row-dot path of bf16 weights keeps fp32 rows of bf16 values
  void store_cols(int64_t row, int64_t col, float* src, int64_t n) {
    if (round_bf16) round_act_bf16(src, n);
    std::memcpy(buf + row * ld + col, src, size_t(n) * 4);
  }
  void store(int64_t row, float* src, int64_t n) {
    store_cols(row, 0, src, n);
    std::fill(buf + row * ld + n, buf + (row + 1) * ld, 0.f);
  }
};

template <>
struct ActRows<Act::kBF16> : PlainRows<uint16_t> {
  void store_cols(int64_t row, int64_t col, const float* src, int64_t n) {
    uint16_t* d = buf + row * ld + col;
    for (int64_t j = 0; j < n; ++j) d[j] = f32_to_bf16(src[j]);
  }
  void store(int64_t row, float* src, int64_t n) {
    store_cols(row, 0, src, n);
    std::fill(buf + row * ld + n, buf + (row + 1) * ld, uint16_t(0));
  }
};

template <>
struct ActRows<Act::kI8> {
  struct Panel {
    const int8_t* q;
    int64_t ld;  // bytes a row
    const float* scale;
    const int32_t* sum;
    int64_t ldg;  // groups a row
  };
  int8_t* q = nullptr;
  float* scale = nullptr;
  int32_t* sum = nullptr;
  int64_t ld = 0, group = 0, ldg = 0;
  void alloc(Workspace::Call& ws, int64_t rows, int64_t ld_, int64_t pad, int64_t group_) {
    ld = ld_, group = group_, ldg = ld / group;
    q = ws.take<int8_t>((rows + pad) * ld);
    scale = ws.take<float>((rows + pad) * ldg);
    sum = ws.take<int32_t>((rows + pad) * ldg);
    std::memset(q + rows * ld, 0, size_t(pad * ld));
    std::fill(scale + rows * ldg, scale + (rows + pad) * ldg, 0.f);
    std::fill(sum + rows * ldg, sum + (rows + pad) * ldg, 0);
  }
  void store(int64_t row, float* src, int64_t n) {
    for (int64_t g = 0; g < ldg; ++g) {
      const int64_t k0 = g * group, m = std::clamp<int64_t>(n - k0, 0, group);
      int8_t* dst = q + row * ld + k0;
      quantize_group_i8(src + k0, m, dst, scale[size_t(row * ldg + g)], sum[size_t(row * ldg + g)]);
      std::memset(dst + m, 0, size_t(group - m));
    }
  }
  Panel at(int64_t row) const { return {q + row * ld, ld, scale + row * ldg, sum + row * ldg, ldg}; }
  void copy_row(int64_t dst, int64_t src) {
    std::memcpy(q + dst * ld, q + src * ld, size_t(ld));
    std::memcpy(scale + dst * ldg, scale + src * ldg, size_t(ldg) * sizeof(float));
    std::memcpy(sum + dst * ldg, sum + src * ldg, size_t(ldg) * sizeof(int32_t));
  }
};

}  // namespace hmoe
