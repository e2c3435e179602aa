// Host entry points of a prefill kernel family (ragged_prefill and paged_prefill): every family
// (cuda/prefill/prefill_<family>.cu) implements these three for its module, with the structs of
// include/hmoe/prefill.h; the entry header (prefill_entry.h) is the same for all of them.
#pragma once
#include <cstdint>

#include "hmoe/prefill.h"

namespace hmoe {

// The plan for this shape on `device`: the tile configuration (from the head dims and the device's
// opt-in shared memory) and the work list's size. It depends on shapes only, never on the index
// arrays' contents, so a captured graph replays with new ones. config >= 0 forces a configuration
// (it must exist for these head dims and fit the device). Throws std::invalid_argument for a forced
// configuration that cannot run, std::runtime_error when none fits.
PrefillPlan prefill_plan(int device, int64_t total_q, int batch, int heads, int kv_heads, int head_dim_qk,
                         int head_dim_v, int config);

// Launches on `stream` (asynchronous): the schedule from the index arrays into p.workspace
// (plan.workspace words), then the attention kernel. p.max_items = plan.max_items. Throws
// std::invalid_argument for a plan that does not fit p, std::runtime_error on a CUDA error.
void prefill_launch(const PrefillParams& p, const PrefillPlan& plan, int device, uintptr_t stream);

// Sets the shared-memory attributes of every configuration on `device` (lazy work that must not
// happen inside CUDA-graph capture).
void prefill_prewarm(int device);

}  // namespace hmoe
