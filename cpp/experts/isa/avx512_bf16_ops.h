// AVX-512-BF16 pair ops shared by the avx512_bf16 and amx expert kernels: bf16 pairs go
// straight into vdpbf16ps.
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

}  // namespace hmoe::isa
