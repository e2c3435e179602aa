// Weight quantisation of hmoe.quant on the CPU: the activations' group quantiser (act.h) applied to
// weight rows, int4 values then packed two a byte.
#include "experts/quantize.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "common/dtype.h"
#include "experts/act.h"

namespace hmoe {

bool quantize_rows(const void* w, int32_t dtype, int64_t kd, int64_t group, bool int4, int64_t r0, int64_t r1, void* q,
                   float* scales) {
  const int64_t groups = kd / group, elem = dtype_size(dtype);
  std::unique_ptr<float[]> row(new float[size_t(kd)]);
  std::unique_ptr<int8_t[]> qrow(new int8_t[size_t(kd)]);
  bool finite = true;
  for (int64_t r = r0; r < r1; ++r) {
    load_row_f32(static_cast<const char*>(w) + r * kd * elem, dtype, kd, row.get());
    float* s = scales + r * groups;
    int8_t* dst = int4 ? qrow.get() : static_cast<int8_t*>(q) + r * kd;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum;
      if (int4)
        quantize_group<7>(row.get() + g * group, group, dst + g * group, s[g], sum);
      else
        quantize_group<127>(row.get() + g * group, group, dst + g * group, s[g], sum);
      finite = finite && std::isfinite(s[g]);
    }
    if (int4) {
      uint8_t* packed = static_cast<uint8_t*>(q) + r * (kd / 2);
      for (int64_t k = 0; k < kd / 2; ++k) packed[k] = uint8_t((dst[2 * k] & 0xF) | ((dst[2 * k + 1] & 0xF) << 4));
    }
  }
  return finite;
}

namespace {

// The value of every float8_e4m3fn byte (the NaN bytes read as +-480 here; callers find them first).
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) v[b] = fp8_e4m3_to_f32_scaled(uint8_t(b)) * 256.f;  // exact: a power of two
  }
};

}  // namespace

bool fp8_has_nan(const uint8_t* q, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= (q[i] & 0x7fu) == 0x7fu;  // a loop the compiler vectorises
  return bad != 0;
}

bool dequantize_fp8_rows(const uint8_t* q, int64_t N, int64_t K, const float* scales, int64_t rows, int64_t cols,
                         int64_t r0, int64_t r1, float* out) {
  static const Fp8Table table;
  const int64_t nr = (N + rows - 1) / rows, nc = (K + cols - 1) / cols;
  if (fp8_has_nan(q + r0 * K, (r1 - r0) * K)) return false;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t l = r / N, n = r % N;
    const float* s = scales + (l * nr + n / rows) * nc;
    const uint8_t* src = q + r * K;
    float* dst = out + r * K;
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t k1 = std::min(K, (c + 1) * cols);
      for (int64_t k = c * cols; k < k1; ++k) dst[k] = table.v[src[k]] * s[c];
    }
  }
  return true;
}

}  // namespace hmoe
