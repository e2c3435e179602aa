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

// 32 float8_e4m3fn bytes (no NaN: refused when packing) as 32 words of bf16 bit patterns of the
// value times 2^-8, exactly (cpp/common/dtype.h), in 7 integer ops. A normal byte (exponent e > 0,
// mantissa m) moves its bits into bf16's fields with the exponent field 0111 eeee, i.e. e + 112:
// 2^(e - 15) (1 + m / 8) is the value 2^(e - 7) (1 + m / 8) times 2^-8. A subnormal one (e = 0,
// value m 2^-9) takes bf16(m 2^-17) from an 8-entry table. Then the sign.
inline __m512i fp8x32_to_bf16_bits(const uint8_t* p) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  constexpr int kAandBorC = 0xea, kAorBandC = 0xf8;  // vpternlog truth tables: (a & b) | c, a | (b & c)
  __m512i mag = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07f0), _mm512_set1_epi16(0x3800),
                                          kAandBorC);
  const __m512i subnormal = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0x3860, 0x3840, 0x3820, 0x3800, 0x37c0, 0x3780, 0x3700, 0);
  mag = _mm512_mask_permutexvar_epi16(mag, _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78)), w, subnormal);
  return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000)), kAorBandC);
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
