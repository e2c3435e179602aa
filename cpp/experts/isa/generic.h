// Baseline ISA ops for the expert kernels: 16 fp32 lanes as plain arrays (the compiler
// vectorises what the baseline allows). The contract: isa/contract.h.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace hmoe::isa {

constexpr int kMR = 2;  // rows per register tile
constexpr int kMRInt = 2;
constexpr int kNR = 2;  // 16-column blocks per register tile
constexpr bool kPrefetchL2 = false;
using Tiles = NoTiles;

struct V {
  float v[16];
};

inline V vzero() {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = 0.f;
  return r;
}
inline V vload(const float* p) {
  V r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void vstore(float* p, const V& a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V vbcast(float a) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a;
  return r;
}
// a * b + c
inline V vfma(const V& a, const V& b, const V& c) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
inline V vadd(const V& a, const V& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline V vmul(const V& a, const V& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline float vsum(const V& a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
inline V vload_f16(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = f16_to_f32(p[i]);
  return r;
}
inline V vload_bf16(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = bf16_to_f32(p[i]);
  return r;
}

// One k-pair of a bf16 block ([16][2]) and a broadcast activation pair.
struct BPair {
  V lo, hi;
};
struct APair {
  float a0, a1;
};
inline BPair load_bpair(const uint16_t* p) {
  BPair b;
  for (int i = 0; i < 16; ++i) {
    b.lo.v[i] = bf16_to_f32(p[2 * i]);
    b.hi.v[i] = bf16_to_f32(p[2 * i + 1]);
  }
  return b;
}
inline APair bcast_apair(const uint16_t* a) { return {bf16_to_f32(a[0]), bf16_to_f32(a[1])}; }
inline BPair load_fp8_pair(const uint8_t* p) {
  BPair b;
  for (int i = 0; i < 16; ++i) {
    b.lo.v[i] = fp8_e4m3_to_f32_scaled(p[2 * i]);
    b.hi.v[i] = fp8_e4m3_to_f32_scaled(p[2 * i + 1]);
  }
  return b;
}
inline V dot_pair(const V& acc, const APair& a, const BPair& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.a1 * b.hi.v[i] + (a.a0 * b.lo.v[i] + acc.v[i]);
  return r;
}

// Integer dot products of the quantised formats.
struct VI {
  int32_t v[16];
};
struct VB {
  uint8_t v[64];
};
struct A4 {
  int32_t a[4];
};
inline VI vi_zero() {
  VI r;
  for (int i = 0; i < 16; ++i) r.v[i] = 0;
  return r;
}
inline VI vi_bcast(int32_t x) {
  VI r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline VI vi_sub(const VI& a, const VI& b) {
  VI r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] - b.v[i];
  return r;
}
inline V vi_to_v(const VI& a) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = float(a.v[i]);
  return r;
}
inline VI load_vi(const int32_t* p) {
  VI r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline VB load_vb(const uint8_t* p) {
  VB r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void store_vb(uint8_t* p, const VB& w) { std::memcpy(p, w.v, sizeof(w.v)); }
inline VB nib_lo(const VB& w) {
  VB r;
  for (int i = 0; i < 64; ++i) r.v[i] = uint8_t(w.v[i] & 0x0f);
  return r;
}
inline VB nib_hi(const VB& w) {
  VB r;
  for (int i = 0; i < 64; ++i) r.v[i] = uint8_t(w.v[i] >> 4);
  return r;
}
constexpr bool kDot4Centered = false;
inline A4 bcast_a4(const int8_t* a) { return {{a[0], a[1], a[2], a[3]}}; }
inline VI dot4(const VI& acc, const VB& w, const A4& a) {
  VI r;
  for (int i = 0; i < 16; ++i) {
    const uint8_t* q = w.v + 4 * i;
    r.v[i] = acc.v[i] + q[0] * a.a[0] + q[1] * a.a[1] + q[2] * a.a[2] + q[3] * a.a[3];
  }
  return r;
}
// Partial sums in int32 (no narrower product here).
constexpr int kU4Steps = 8;
using VS = VI;
inline VS vs_zero() { return vi_zero(); }
inline VS dot4_u4s(const VS& s, const VB& w, const A4& a) { return dot4(s, w, a); }
inline VI vi_add_vs(const VI& acc, const VS& s) {
  VI r;
  for (int i = 0; i < 16; ++i) r.v[i] = acc.v[i] + s.v[i];
  return r;
}

}  // namespace hmoe::isa
