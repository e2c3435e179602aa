// The combine step of MLA decode (every family): merges the fp32 partials of a call's KV splits
// into the output, through the shared split-KV merge (attention/merge.h).
#pragma once
#include <cuda_runtime.h>

#include "hmoe/mla_decode.h"

namespace hmoe {

// Launches the merge of p.num_splits (> 1) partials on `stream`; `programmatic` (sm_90+): as a
// programmatic dependent of the decode kernel launched just before. Throws on a CUDA error.
void mla_combine(const MlaDecodeParams& p, cudaStream_t stream, bool programmatic);

// Loads the combine kernels (lazy work that must not happen inside CUDA-graph capture).
void mla_combine_prewarm();

}  // namespace hmoe
