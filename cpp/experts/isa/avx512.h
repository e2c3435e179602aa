// AVX-512 (F/BW/DQ/VL) ops for the expert kernels; bf16 pairs are widened and use FMA.
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include "experts/isa/avx512_common.h"

namespace hmoe::isa {

constexpr int kMR = 4;
constexpr int kMRInt = 4;  // an A4 takes two registers; int4 keeps a second set of (partial) sums
constexpr int kNR = 4;     // 16-column blocks per register tile
constexpr bool kPrefetchL2 = false;
using Tiles = NoTiles;

struct BPair {
  V lo, hi;
};
struct APair {
  V a0, a1;
};
inline BPair load_bpair(const uint16_t* p) {
  __m512i u = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))))};
}
inline APair bcast_apair(const uint16_t* a) {
  return {_mm512_castsi512_ps(_mm512_set1_epi32(int(uint32_t(a[0]) << 16))),
          _mm512_castsi512_ps(_mm512_set1_epi32(int(uint32_t(a[1]) << 16)))};
}
inline V dot_pair(V acc, const APair& a, const BPair& b) {
  return _mm512_fmadd_ps(a.a1, b.hi, _mm512_fmadd_ps(a.a0, b.lo, acc));
}

inline BPair load_fp8_pair(const uint8_t* p) {
  const __m512i h = fp8x32_to_bf16_bits(p);  // words: k even, k odd, ... per lane, as load_bpair's
  return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(int(0xffff0000u))))};
}

// Integer dot products without VNNI: vpmaddubsw (unsigned x signed bytes -> saturating int16 pairs)
// and vpmaddwd. Unsigned weights up to 255 times int8 activations could saturate a pair; dot4 takes
// the signed weight w - 128 times |a| with a's sign moved onto it (exact: both at most 127 in
// magnitude, quantised int8 weights never being -128) and leaves the sum centred (kDot4Centered:
// the caller's offset correction is 0). Nibbles (< 16) multiply directly.
constexpr bool kDot4Centered = true;
struct A4 {
  __m512i s, abs;  // the 4 bytes in every lane; their magnitudes
  __mmask64 neg;   // bytes of s below zero
};
inline A4 bcast_a4(const int8_t* a) {
  int32_t word;
  __builtin_memcpy(&word, a, 4);
  const __m512i s = _mm512_set1_epi32(word);
  return {s, _mm512_abs_epi8(s), _mm512_movepi8_mask(s)};
}
inline VI quad_sums(__m512i pairs) { return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)); }
inline VI dot4(VI acc, VB w, const A4& x) {
  const __m512i q = _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80)));
  const __m512i qs = _mm512_mask_sub_epi8(q, x.neg, _mm512_setzero_si512(), q);
  return _mm512_add_epi32(acc, quad_sums(_mm512_maddubs_epi16(x.abs, qs)));
}
// Nibble products summed as int16 pairs (a vpmaddubsw lane is at most 2 * 15 * 127 = 3810, so 8
// of them fit), widened to int32 once per kU4Steps: half the multiplies of widening every product.
constexpr int kU4Steps = 8;
using VS = __m512i;
inline VS vs_zero() { return _mm512_setzero_si512(); }
inline VS dot4_u4s(VS s, VB w, const A4& x) { return _mm512_add_epi16(s, _mm512_maddubs_epi16(w, x.s)); }
inline VI vi_add_vs(VI acc, VS s) { return _mm512_add_epi32(acc, quad_sums(s)); }

}  // namespace hmoe::isa
