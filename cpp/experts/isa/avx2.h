// AVX2/FMA/F16C ops for the expert kernels: 16 fp32 lanes as two ymm registers.
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace hmoe::isa {

constexpr int kMR = 2;
constexpr int kMRInt = 2;
constexpr int kNR = 2;  // 16-column blocks per register tile
constexpr bool kPrefetchL2 = false;
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
inline V vmul(const V& x, const V& y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
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

// 8 lanes x 2 float8_e4m3fn (16 bytes) as fp32 times 2^-8: the bytes moved into fp16 bit
// patterns (cpp/common/dtype.h), even and odd k gathered into the low 8 words each, widened.
inline void fp8x16_to_pairs(__m128i bytes, __m256& lo, __m256& hi) {
  const __m256i w = _mm256_cvtepu8_epi16(bytes);
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  const __m256i even = _mm256_and_si256(h, _mm256_set1_epi32(0xffff)), odd = _mm256_srli_epi32(h, 16);
  // packus within each 128-bit half, then the two halves' low quadwords side by side
  const __m256i e = _mm256_permute4x64_epi64(_mm256_packus_epi32(even, even), 0x08);
  const __m256i o = _mm256_permute4x64_epi64(_mm256_packus_epi32(odd, odd), 0x08);
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(e));
  hi = _mm256_cvtph_ps(_mm256_castsi256_si128(o));
}
inline BPair load_fp8_pair(const uint8_t* p) {
  BPair b;
  fp8x16_to_pairs(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), b.lo.a, b.hi.a);
  fp8x16_to_pairs(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)), b.lo.b, b.hi.b);
  return b;
}

// Integer dot products of the quantised formats: no VNNI here, so pairs go through vpmaddubsw
// (unsigned x signed bytes -> saturating int16 pairs) and vpmaddwd. Unsigned weights up to 255 times
// int8 activations could saturate a pair; dot4 takes the signed weight w - 128 times |a| with a's
// sign moved onto it (exact: both at most 127 in magnitude, quantised int8 weights never being
// -128) and leaves the sum centred (kDot4Centered: the caller's offset correction is 0). Nibbles
// (< 16) multiply directly.
constexpr bool kDot4Centered = true;
struct VI {
  __m256i a, b;
};
struct VB {
  __m256i a, b;
};
struct A4 {
  __m256i s, abs;  // the 4 bytes in every lane; their magnitudes
};
inline VI vi_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VI vi_bcast(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline VI vi_sub(const VI& x, const VI& y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
inline V vi_to_v(const VI& x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline VI load_vi(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline void store_vb(uint8_t* p, const VB& w) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w.a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), w.b);
}
inline VB load_vb(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline VB nib_lo(const VB& w) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(w.a, m), _mm256_and_si256(w.b, m)};
}
inline VB nib_hi(const VB& w) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(_mm256_srli_epi16(w.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(w.b, 4), m)};
}
inline A4 bcast_a4(const int8_t* a) {
  int32_t word;
  __builtin_memcpy(&word, a, 4);
  const __m256i s = _mm256_set1_epi32(word);
  return {s, _mm256_abs_epi8(s)};
}
inline __m256i quad_sums(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline VI dot4(const VI& acc, const VB& w, const A4& x) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  const __m256i qa = _mm256_sign_epi8(_mm256_xor_si256(w.a, flip), x.s);
  const __m256i qb = _mm256_sign_epi8(_mm256_xor_si256(w.b, flip), x.s);
  return {_mm256_add_epi32(acc.a, quad_sums(_mm256_maddubs_epi16(x.abs, qa))),
          _mm256_add_epi32(acc.b, quad_sums(_mm256_maddubs_epi16(x.abs, qb)))};
}
// Nibble products summed as int16 pairs (a vpmaddubsw lane is at most 2 * 15 * 127 = 3810, so 8
// of them fit), widened to int32 once per kU4Steps: half the multiplies of widening every product.
constexpr int kU4Steps = 8;
struct VS {
  __m256i a, b;
};
inline VS vs_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline VS dot4_u4s(const VS& s, const VB& w, const A4& x) {
  return {_mm256_add_epi16(s.a, _mm256_maddubs_epi16(w.a, x.s)), _mm256_add_epi16(s.b, _mm256_maddubs_epi16(w.b, x.s))};
}
inline VI vi_add_vs(const VI& acc, const VS& s) {
  return {_mm256_add_epi32(acc.a, quad_sums(s.a)), _mm256_add_epi32(acc.b, quad_sums(s.b))};
}

}  // namespace hmoe::isa
