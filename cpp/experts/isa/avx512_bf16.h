// AVX-512-BF16 ops for the expert kernels (no matrix unit).
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include "experts/isa/avx512_bf16_ops.h"

namespace hmoe::isa {

constexpr int kMR = 6;
constexpr int kMRInt = 6;
constexpr int kNR = 4;  // 16-column blocks per register tile
using Tiles = NoTiles;

}  // namespace hmoe::isa
