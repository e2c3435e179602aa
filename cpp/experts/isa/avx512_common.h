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
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V vload_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V vload_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

}  // namespace hmoe::isa
