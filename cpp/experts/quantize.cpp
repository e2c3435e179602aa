// Weight quantisation of hmoe.quant on the CPU: the activations' group quantiser (act.h) applied to
// weight rows (read as fp32 from a float dtype or from DeepSeek's block-scaled fp8), int4 values then
// packed two a byte; and fp8 dequantisation.
#include "experts/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "common/dtype.h"
#include "experts/act.h"

namespace hmoe {
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

void WeightRows::row_f32(int64_t r, float* dst) const {
  if (!fp8()) {
    load_row_f32(static_cast<const char*>(data) + r * K * dtype_size(dtype), dtype, K, dst);
    return;
  }
  static const Fp8Table table;
  const int64_t nr = (N + rows - 1) / rows, nc = (K + cols - 1) / cols;
  const float* s = fp8_scales + ((r / N) * nr + (r % N) / rows) * nc;
  const uint8_t* src = static_cast<const uint8_t*>(data) + r * K;
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t k1 = std::min(K, (c + 1) * cols);
    for (int64_t k = c * cols; k < k1; ++k) dst[k] = table.v[src[k]] * s[c];
  }
}

bool WeightRows::has_nan(int64_t r0, int64_t r1) const {
  return fp8() && fp8_has_nan(static_cast<const uint8_t*>(data) + r0 * K, (r1 - r0) * K);
}

bool quantize_rows(const WeightRows& w, int64_t group, bool int4, int64_t r0, int64_t r1, void* q, float* scales) {
  const int64_t K = w.K, groups = K / group;
  if (w.has_nan(r0, r1)) return false;
  std::unique_ptr<float[]> row(new float[size_t(K)]);
  std::unique_ptr<int8_t[]> qrow(new int8_t[size_t(K)]);
  bool finite = true;
  for (int64_t r = r0; r < r1; ++r) {
    w.row_f32(r, row.get());
    float* s = scales + r * groups;
    int8_t* dst = int4 ? qrow.get() : static_cast<int8_t*>(q) + r * K;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum;
      if (int4)
        quantize_group<7>(row.get() + g * group, group, dst + g * group, s[g], sum);
      else
        quantize_group<127>(row.get() + g * group, group, dst + g * group, s[g], sum);
      finite = finite && std::isfinite(s[g]);
    }
    if (int4) {
      uint8_t* packed = static_cast<uint8_t*>(q) + r * (K / 2);
      for (int64_t k = 0; k < K / 2; ++k) packed[k] = uint8_t((dst[2 * k] & 0xF) | ((dst[2 * k + 1] & 0xF) << 4));
    }
  }
  return finite;
}

bool dequantize_fp8_rows(const WeightRows& w, int64_t r0, int64_t r1, float* out) {
  if (w.has_nan(r0, r1)) return false;
  for (int64_t r = r0; r < r1; ++r) w.row_f32(r, out + r * w.K);
  return true;
}

}  // namespace hmoe
