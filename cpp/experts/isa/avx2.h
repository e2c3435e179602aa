// AVX2/FMA/F16C ops for the expert kernels: 16 fp32 lanes as two ymm registers.
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace hmoe::isa {

constexpr int kMR = 2;
constexpr int kNR = 2;  // 16-column blocks per register tile
using Tiles = NoTiles;

struct V {
  __m256 a, b;
};

inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, const V& x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
inline V vbcast(float s) {
  __m256 v = _mm256_set1_ps(s);
  return {v, v};
}
inline V vfma(const V& x, const V& y, const V& c) {
  return {_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)};
}
inline V vadd(const V& x, const V& y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline float vsum(const V& x) {
  __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
inline V vload_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 bf16x8_to_f32(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V vload_bf16(const uint16_t* p) {
  return {bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}

// A bf16 pair packed in 32 bits: the low half is k even, the high half k odd.
struct BPair {
  V lo, hi;
};
struct APair {
  __m256 a0, a1;
};
inline BPair load_bpair(const uint16_t* p) {
  const __m256i mask = _mm256_set1_epi32(int(0xffff0000u));
  __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(u0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(u0, mask)), _mm256_castsi256_ps(_mm256_and_si256(u1, mask))}};
}
inline APair bcast_apair(const uint16_t* a) {
  uint32_t lo = uint32_t(a[0]) << 16, hi = uint32_t(a[1]) << 16;
  return {_mm256_castsi256_ps(_mm256_set1_epi32(int(lo))), _mm256_castsi256_ps(_mm256_set1_epi32(int(hi)))};
}
inline V dot_pair(const V& acc, const APair& a, const BPair& b) {
  return {_mm256_fmadd_ps(a.a1, b.hi.a, _mm256_fmadd_ps(a.a0, b.lo.a, acc.a)),
          _mm256_fmadd_ps(a.a1, b.hi.b, _mm256_fmadd_ps(a.a0, b.lo.b, acc.b))};
}

}  // namespace hmoe::isa
