// Params struct and contract of the grouped_topk router op, shared by the CPU and CUDA variants.
#pragma once
#include <cstdint>

#include "common/dtype.h"

namespace hmoe {

// Scoring codes (python/hmoe/ops/topk.py holds the same table).
enum TopkScoring : int32_t {
  kScoringSoftmax = 0,  // DeepseekV2: softmax, group score = max of the group
  kScoringSigmoid = 1,  // DeepseekV3: sigmoid (+ bias for the choice), group score = sum of top 2
};

// The largest expert count a variant accepts. It keeps the CUDA kernel's per-token scratch
// (scores, selection scores, group scores: at most 3 * E floats) inside the 48 KiB of
// shared memory a block gets without an opt-in attribute, so nothing is set up lazily.
constexpr int32_t kGroupedTopkMaxExperts = 4096;

// The arguments every variant's binding takes first (its signature string; python/hmoe/_native/
// signatures.py holds the same text). The CUDA binding appends device and stream.
#define HMOE_GROUPED_TOPK_SIG_ARGS                                                        \
  "logits:ptr, logits_dtype:i32, bias:ptr, bias_dtype:i32, weights:ptr, ids:ptr, "        \
  "num_tokens:i64, num_experts:i32, top_k:i32, n_group:i32, topk_group:i32, scoring:i32, " \
  "renormalize:bool, routed_scaling_factor:f32"

// Semantics (identical in every variant; all math in fp32):
//   score[e]  = softmax(logits)[e]  or  sigmoid(logits[e])
//   sel[e]    = score[e] (softmax)  or  score[e] + bias[e] (sigmoid; bias 0 when absent)
//   group score = max of sel (softmax) or sum of the two largest sel (sigmoid) per group;
//   keep the topk_group best groups, then the top_k best sel among their experts.
//   weights = score[id]; if renormalize: w /= (sum of the K weights + 1e-20); w *= scale.
// Order: the K outputs are sorted by sel descending, ties to the lower expert index (groups
// likewise). NaN: a NaN logit makes the expert unusable (score 0, sel -inf): it loses to every
// expert with a non-NaN logit; softmax ignores it like a -inf logit; a row with no finite
// logit gets all-zero softmax scores. Any other NaN sel or group score ranks as -inf. Ids are
// always K distinct experts of kept groups.
struct GroupedTopkParams {
  const void* logits;     // [num_tokens, num_experts], row-major contiguous, logits_dtype
  int32_t logits_dtype;   // kF32, kF16 or kBF16
  const void* bias;       // [num_experts] or nullptr; bias_dtype
  int32_t bias_dtype;     // kF32, kF16 or kBF16 (ignored when bias is nullptr)
  float* weights;         // [num_tokens, top_k] out
  int32_t* ids;           // [num_tokens, top_k] out
  int64_t num_tokens;
  int32_t num_experts;
  int32_t top_k;
  int32_t n_group;
  int32_t topk_group;
  int32_t scoring;        // TopkScoring
  int32_t renormalize;    // 0 or 1
  float routed_scaling_factor;
};

// The params from a binding's arguments (pointers as integers, in HMOE_GROUPED_TOPK_SIG_ARGS order).
inline GroupedTopkParams grouped_topk_params(uintptr_t logits, int32_t logits_dtype, uintptr_t bias,
                                             int32_t bias_dtype, uintptr_t weights, uintptr_t ids,
                                             int64_t num_tokens, int32_t num_experts, int32_t top_k,
                                             int32_t n_group, int32_t topk_group, int32_t scoring,
                                             bool renormalize, float routed_scaling_factor) {
  return {reinterpret_cast<const void*>(logits), logits_dtype, reinterpret_cast<const void*>(bias),
          bias_dtype, reinterpret_cast<float*>(weights), reinterpret_cast<int32_t*>(ids), num_tokens,
          num_experts, top_k, n_group, topk_group, scoring, renormalize ? 1 : 0, routed_scaling_factor};
}

// nullptr when p is within the contract, else why not. Python validates first; this is the
// native side's own guard so that no variant reads or writes out of bounds.
inline const char* grouped_topk_check(const GroupedTopkParams& p) {
  if (!is_float_dtype(p.logits_dtype)) return "logits_dtype is not float32/float16/bfloat16";
  if (p.bias != nullptr && !is_float_dtype(p.bias_dtype))
    return "bias_dtype is not float32/float16/bfloat16";
  if (p.scoring != kScoringSoftmax && p.scoring != kScoringSigmoid) return "unknown scoring code";
  if (p.bias != nullptr && p.scoring != kScoringSigmoid) return "bias requires sigmoid scoring";
  if (p.num_tokens < 0) return "num_tokens < 0";
  if (p.num_tokens > 0 && (p.logits == nullptr || p.weights == nullptr || p.ids == nullptr))
    return "null logits/weights/ids pointer";
  if (p.num_experts < 1 || p.num_experts > kGroupedTopkMaxExperts)
    return "num_experts out of range [1, 4096]";
  if (p.n_group < 1 || p.num_experts % p.n_group != 0) return "n_group does not divide num_experts";
  if (p.topk_group < 1 || p.topk_group > p.n_group) return "topk_group out of range [1, n_group]";
  const int32_t group_size = p.num_experts / p.n_group;
  if (p.top_k < 1 || p.top_k > p.topk_group * group_size)
    return "top_k out of range [1, topk_group * num_experts / n_group]";
  if (p.scoring == kScoringSigmoid && p.n_group > 1 && group_size < 2)
    return "sigmoid group scoring needs at least 2 experts per group";
  return nullptr;
}

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
