// The variants of grouped_topk (contract and params: include/hmoe/grouped_topk.h).
#pragma once
#include <cstdint>

#include "hmoe/grouped_topk.h"

namespace hmoe {

// CPU variant (cpp/topk/grouped_topk_cpu.cpp). Throws std::invalid_argument when
// grouped_topk_check fails.
void grouped_topk_cpu(const GroupedTopkParams& p);

// CUDA variant (cuda/topk/grouped_topk.cu): pointers are device pointers of `device`; the
// kernel is enqueued on `stream` (a cudaStream_t as an integer) and not waited for.
// Throws std::invalid_argument (bad params) or std::runtime_error (a CUDA error).
void grouped_topk_cuda(const GroupedTopkParams& p, int device, uintptr_t stream);
// Loads the kernels on `device` and initialises the CUDA runtime, so that a later call
// (possibly under CUDA-graph capture) has no lazy work left to do.
void grouped_topk_cuda_prewarm(int device);

}  // namespace hmoe
