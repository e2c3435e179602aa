// Host entry points of an MLA decode kernel family: every family (cuda/mla/mla_decode_<family>.cu)
// implements these three for its module.
#pragma once
#include <cstdint>

#include "common/launch.h"
#include "hmoe/mla_decode.h"

namespace hmoe {

// The plan for this shape on `device`: the tile configuration (from the device's opt-in shared
// memory), the loader and the KV splits. It depends on shapes only, never on seq_lens, so a
// captured graph can replay with new lengths. config >= 0 forces a configuration (it must fit the
// device); allow_tma = false keeps the loader on cp.async. Throws std::invalid_argument for a
// forced configuration the device cannot run.
MlaDecodePlan mla_decode_plan(int device, int batch, int heads, int max_pages, int page_size, int config,
                              bool allow_tma);

// Launches on `stream` (asynchronous) as `plan` says (p.num_splits = plan.num_splits): the decode
// kernel, then the combine pass when it splits, through `graph` (the stream's eager graph) where
// given (common/launch.h). Throws std::invalid_argument for a plan that does not fit p or the device,
// std::runtime_error on a CUDA error.
void mla_decode_launch(const MlaDecodeParams& p, const MlaDecodePlan& plan, int device, uintptr_t stream,
                       EagerGraph* graph = nullptr);

// Why this family does not serve calls of this shape on a device of `sms` SMs (the dispatcher then
// runs them on the portable family and says why), or nullptr when it serves them. Shapes only (max_pages:
// the page table's width, as in the plan): the answer never changes.
const char* mla_decode_declines(int sms, int batch, int heads, int max_pages, int page_size);

// Sets the shared-memory attributes of every configuration on `device` (lazy work that must
// not happen inside CUDA-graph capture).
void mla_decode_prewarm(int device);

}  // namespace hmoe
