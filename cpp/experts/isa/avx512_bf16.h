// AVX-512-BF16 ops for the expert kernels (no matrix unit).
#pragma once
#include "experts/isa/avx512_bf16_ops.h"

namespace hmoe::isa {

constexpr int kMR = 6;
constexpr int kNR = 4;  // 16-column blocks per register tile
struct Tiles { static constexpr bool kAvailable = false; };

}  // namespace hmoe::isa
