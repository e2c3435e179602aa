// AVX-512F ops shared by the avx512, avx512_bf16 and amx expert kernels: 16 fp32 lanes = one zmm.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace hmoe::isa {

using V = __m512;

inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vbcast(float a) { return _mm512_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// 32 float8_e4m3fn bytes as 32 words of fp16 bit patterns (value times 2^-8; cpp/common/dtype.h).
inline __m512i fp8x32_to_f16_bits(const uint8_t* p) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7f)), 7),
                         _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

// Integer vectors of the quantised formats (the dot products: the level's own header).
using VI = __m512i;
using VB = __m512i;
inline VI vi_zero() { return _mm512_setzero_si512(); }
inline VI vi_bcast(int32_t x) { return _mm512_set1_epi32(x); }
inline VI vi_sub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
inline V vi_to_v(VI a) { return _mm512_cvtepi32_ps(a); }
inline VI load_vi(const int32_t* p) { return _mm512_loadu_si512(p); }
inline VB load_vb(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline void store_vb(uint8_t* p, VB w) { _mm512_storeu_si512(p, w); }
inline VB nib_lo(VB w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0f)); }
inline VB nib_hi(VB w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0f)); }

}  // namespace hmoe::isa
