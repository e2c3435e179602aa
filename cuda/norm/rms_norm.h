// Host entry points of rms_norm's CUDA kernel (cuda/norm/rms_norm.cu).
#pragma once
#include <cstdint>

#include "hmoe/rms_norm.h"

namespace hmoe {

// Enqueues the kernel on `stream` (a cudaStream_t as an integer; asynchronous). Throws
// std::invalid_argument for params outside the contract, std::runtime_error on a CUDA error.
void rms_norm_cuda(const RmsNormParams& p, int device, uintptr_t stream);

// Loads the kernels on `device` (no lazy work left for a call under CUDA-graph capture).
void rms_norm_prewarm(int device);

}  // namespace hmoe
