// Host entry points of the portable MLA decode kernel (mma.sync + cp.async, sm_80 and newer).
#pragma once
#include <cstdint>

#include "mla/mla_params.h"

namespace hmoe {

// The tile configuration the kernel uses on `device` for `heads` heads, as chosen from the
// device's opt-in shared memory limit: heads per CTA, KV tokens per tile, shared memory.
struct MlaConfig {
  int heads_per_cta;
  int tile_tokens;
  int smem_bytes;
};
MlaConfig mla_decode_config(int device, int heads);

// KV splits for this batch shape on `device` (depends on shapes only, never on seq_lens, so a
// captured graph can replay with new lengths).
int mla_decode_num_splits(int device, int batch, int heads, int max_pages, int page_size);

// Launches on `stream` (asynchronous). Throws std::runtime_error on a CUDA error.
void mla_decode_portable(const MlaDecodeParams& p, int device, uintptr_t stream);

// Sets the shared-memory attributes of every configuration on `device` (lazy work that must
// not happen inside CUDA-graph capture).
void mla_decode_prewarm(int device);

}  // namespace hmoe
