// Params struct and contract of the grouped_topk router op, shared by every variant (CPU, CUDA).
#pragma once
#include <cstdint>

#include "hmoe/constants.h"
#include "hmoe/dtype.h"

namespace hmoe {

// Scoring codes (constants.h).
enum TopkScoring : int32_t {
  kScoringSoftmax = k::topk_scoring_softmax,  // DeepseekV2: softmax, group score = max of the group
  kScoringSigmoid = k::topk_scoring_sigmoid,  // DeepseekV3: sigmoid (+ bias for the choice), group score = sum of top 2
};

// The largest expert count a variant accepts. It keeps the CUDA kernel's per-token scratch
// (scores, selection scores, group scores: at most 3 * E floats) inside the 48 KiB of
// shared memory a block gets without an opt-in attribute, so nothing is set up lazily.
constexpr int32_t kGroupedTopkMaxExperts = k::grouped_topk_max_experts;

// Semantics (identical in every variant; all math in fp32):
//   score[e]  = softmax(logits)[e]  or  sigmoid(logits[e])
//   sel[e]    = score[e] (softmax)  or  score[e] + bias[e] (sigmoid; bias 0 when absent)
//   group score = max of sel (softmax) or sum of the two largest sel (sigmoid) per group;
//   keep the topk_group best groups, then the top_k best sel among their experts.
//   weights = score[id]; if renormalize: w /= (sum of the K weights + 1e-20); w *= scale.
// Order: the K outputs are sorted by sel descending, ties to the lower expert index (groups
// likewise). NaN: a NaN logit makes the expert unusable (score 0, sel -inf): it loses to every
// expert with a non-NaN logit; softmax ignores it like a -inf logit; a row with no finite
// logit gets all-zero softmax scores; +inf logits take softmax's limit (they share the row's
// probability, every other expert scores 0). Any other NaN sel or group score ranks as -inf. Ids
// are always K distinct experts of kept groups.
struct GroupedTopkParams {
  const void* logits;    // [num_tokens, num_experts], row-major contiguous, logits_dtype
  int32_t logits_dtype;  // kF32, kF16 or kBF16
  const void* bias;      // [num_experts] or nullptr; bias_dtype
  int32_t bias_dtype;    // kF32, kF16 or kBF16 (ignored when bias is nullptr)
  float* weights;        // [num_tokens, top_k] out
  int32_t* ids;          // [num_tokens, top_k] out
  int64_t num_tokens;
  int32_t num_experts;
  int32_t top_k;
  int32_t n_group;
  int32_t topk_group;
  int32_t scoring;      // TopkScoring
  int32_t renormalize;  // 0 or 1
  float routed_scaling_factor;
};

// nullptr when p is within the contract, else why not. Python validates first; this is the
// native side's own guard so that no variant reads or writes out of bounds.
inline const char* grouped_topk_check(const GroupedTopkParams& p) {
  if (!is_float_dtype(p.logits_dtype)) return "logits_dtype is not float32/float16/bfloat16";
  if (p.bias != nullptr && !is_float_dtype(p.bias_dtype)) return "bias_dtype is not float32/float16/bfloat16";
  if (p.scoring != kScoringSoftmax && p.scoring != kScoringSigmoid) return "unknown scoring code";
  if (p.bias != nullptr && p.scoring != kScoringSigmoid) return "bias requires sigmoid scoring";
  if (p.num_tokens < 0) return "num_tokens < 0";
  if (p.num_tokens > 0 && (p.logits == nullptr || p.weights == nullptr || p.ids == nullptr))
    return "null logits/weights/ids pointer";
  if (p.num_experts < 1 || p.num_experts > kGroupedTopkMaxExperts) return "num_experts out of range [1, 4096]";
  if (p.n_group < 1 || p.num_experts % p.n_group != 0) return "n_group does not divide num_experts";
  if (p.topk_group < 1 || p.topk_group > p.n_group) return "topk_group out of range [1, n_group]";
  const int32_t group_size = p.num_experts / p.n_group;
  if (p.top_k < 1 || p.top_k > p.topk_group * group_size)
    return "top_k out of range [1, topk_group * num_experts / n_group]";
  if (p.scoring == kScoringSigmoid && p.n_group > 1 && group_size < 2)
    return "sigmoid group scoring needs at least 2 experts per group";
  return nullptr;
}

}  // namespace hmoe
