// The combine step of MLA decode: the shared split-KV merge (attention/merge.cuh) for rows of
// the 512 latent dims, one row per (request, head).
#include "attention/merge.cuh"
#include "mla/mla_combine.h"

namespace hmoe {

static_assert(kMlaMaxSplits <= attn::kMergeMaxSplits, "the merge weighs at most kMergeMaxSplits splits");

void mla_combine(const MlaDecodeParams& p, bool programmatic, Launches& into) {
  const attn::SplitMerge m{p.partial_o, p.partial_lse, p.out, p.lse, int64_t(p.batch) * p.heads, p.num_splits, p.dtype};
  attn::merge_splits<kMlaDimCkv>(m, programmatic, into);
}

void mla_combine_prewarm() { attn::merge_prewarm<kMlaDimCkv>("mla_decode"); }

}  // namespace hmoe
