// AVX-512-BF16 ops for the expert kernels (no matrix unit).
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include "experts/isa/avx512_bf16_ops.h"

namespace hmoe::isa {

constexpr int kMR = 6;
constexpr int kMRInt = 6;
constexpr int kNR = 4;  // 16-column blocks per register tile
// Into L2: on the Zen 4 (this level's AMD processor) two threads decoding cold ran V3 int4 in
// 4.8 ms against 6.0 with an L1 prefetch and V2-Lite int8 in 1.62 against 1.80 (tools/experts_tune,
// medians of 5-8 alternating rounds); on the Xeon of the amx level it was no faster (amx.h).
constexpr bool kPrefetchL2 = true;
using Tiles = NoTiles;

}  // namespace hmoe::isa
