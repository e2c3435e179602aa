// Entry point of the CPU MoE experts op for the ISA this translation unit is compiled for.
#pragma once
#include "hmoe/experts.h"

namespace hmoe {
namespace HMOE_ISA {

// Computes p.out; throws std::invalid_argument for an expert id outside [0, E) other than -1
// (an empty slot: it adds nothing, and its weight is not read).
void run_moe(const MoeParams& p);

}  // namespace HMOE_ISA
}  // namespace hmoe
