// Host entry points of decode_linear's CUDA kernel (cuda/linear/decode_linear.cu).
#pragma once
#include <cstdint>

#include "hmoe/decode_linear.h"

namespace hmoe {

// Enqueues the kernel on `stream` (a cudaStream_t as an integer; asynchronous). Throws
// std::invalid_argument for params outside the contract, std::runtime_error on a CUDA error.
void decode_linear_cuda(const DecodeLinearParams& p, int device, uintptr_t stream);

// Loads the kernels on `device` (no lazy work left for a call under CUDA-graph capture).
void decode_linear_prewarm(int device);

}  // namespace hmoe
