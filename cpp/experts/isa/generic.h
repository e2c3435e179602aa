// Baseline ISA ops for the expert kernels: 16 fp32 lanes as plain arrays (the compiler
// vectorises what the baseline allows). The contract: isa/contract.h.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace hmoe::isa {

constexpr int kMR = 2;  // rows per register tile
constexpr int kNR = 2;  // 16-column blocks per register tile
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
inline V dot_pair(const V& acc, const APair& a, const BPair& b) {
  V r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.a1 * b.hi.v[i] + (a.a0 * b.lo.v[i] + acc.v[i]);
  return r;
}

}  // namespace hmoe::isa
