// AVX-512 (F/BW/DQ/VL) ops for the expert kernels; bf16 pairs are widened and use FMA.
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include "experts/isa/avx512_common.h"

namespace hmoe::isa {

constexpr int kMR = 4;
constexpr int kNR = 4;  // 16-column blocks per register tile
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

}  // namespace hmoe::isa
