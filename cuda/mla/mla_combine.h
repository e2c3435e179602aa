// The combine step of MLA decode (every family): merges the fp32 partials of a call's KV splits
// into the output, through the shared split-KV merge (attention/merge.h).
#pragma once
#include <cuda_runtime.h>

#include "common/launch.h"
#include "hmoe/mla_decode.h"

namespace hmoe {

// Records the launch of the merge of p.num_splits (> 1) partials in `into`; `programmatic` (sm_90+):
// as a programmatic dependent of the decode kernel recorded before it.
void mla_combine(const MlaDecodeParams& p, bool programmatic, Launches& into);

// Loads the combine kernels (lazy work that must not happen inside CUDA-graph capture).
void mla_combine_prewarm();

}  // namespace hmoe
