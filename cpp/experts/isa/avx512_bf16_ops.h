// AVX-512-BF16 and VNNI ops shared by the avx512_bf16 and amx expert kernels: bf16 pairs go
// straight into vdpbf16ps, int8 quads into vpdpbusd.
#pragma once
#include "experts/isa/avx512_common.h"

namespace hmoe::isa {

using BPair = __m512bh;
using APair = __m512bh;
inline BPair load_bpair(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline APair bcast_apair(const uint16_t* a) {
  uint32_t pair;
  __builtin_memcpy(&pair, a, 4);
  return (__m512bh)_mm512_set1_epi32(int(pair));
}
// vdpbf16ps: acc += a.lo * b.lo + a.hi * b.hi per lane; bf16 products are exact in fp32.
inline V dot_pair(V acc, APair a, BPair b) { return _mm512_dpbf16_ps(acc, a, b); }

inline BPair load_fp8_pair(const uint8_t* p) { return (BPair)fp8x32_to_bf16_bits(p); }

// vpdpbusd: unsigned weight bytes times signed activation bytes, four per lane, into int32.
constexpr bool kDot4Centered = false;
using A4 = __m512i;
inline A4 bcast_a4(const int8_t* a) {
  int32_t word;
  __builtin_memcpy(&word, a, 4);
  return _mm512_set1_epi32(word);
}
// vpdpbusd as inline assembly: GCC 12 copies the accumulator of _mm512_dpbusd_epi32 into a scratch
// register and back around every product (two moves per product, and spills past 16 accumulators),
// which halved the int8 register kernel's rate on Zen 4; the asm ties the accumulator in place.
inline VI dpbusd(VI acc, VB w, A4 a) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
  return acc;
}
inline VI dot4(VI acc, VB w, A4 a) { return dpbusd(acc, w, a); }
// vpdpbusd accumulates exact int32 sums: VS is VI, and the kernels never widen.
constexpr int kU4Steps = 0;
using VS = VI;
inline VS vs_zero() { return _mm512_setzero_si512(); }
inline VS dot4_u4s(VS s, VB w, A4 a) { return dpbusd(s, w, a); }
inline VI vi_add_vs(VI acc, VS s) { return _mm512_add_epi32(acc, s); }

}  // namespace hmoe::isa
