// Host entry points of mla_rope_append's CUDA kernel (cuda/mla/mla_rope_append.cu).
#pragma once
#include <cstdint>

#include "hmoe/mla_rope_append.h"

namespace hmoe {

// Enqueues the kernel on `stream` (a cudaStream_t as an integer; asynchronous). Throws
// std::invalid_argument for params outside the contract, std::runtime_error on a CUDA error.
void mla_rope_append_cuda(const MlaRopeAppendParams& p, int device, uintptr_t stream);

// Loads the kernels on `device`, so that a later call (possibly under CUDA-graph capture) has no
// lazy work left.
void mla_rope_append_prewarm(int device);

}  // namespace hmoe
