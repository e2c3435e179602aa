// The scalar rules of grouped_topk (grouped_topk.h states them), written once for the CPU variant
// and the CUDA kernel: both compile this header (host, or __host__ __device__ under nvcc).
#pragma once
#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define HMOE_HD __host__ __device__ __forceinline__
#else
#define HMOE_HD inline
#endif

namespace hmoe {
namespace topk {

HMOE_HD bool is_nan(float x) {
#ifdef __CUDA_ARCH__
  return isnan(x);
#else
  return std::isnan(x);
#endif
}

HMOE_HD float nan_to_neginf(float x) { return is_nan(x) ? -INFINITY : x; }

// The one ranking: larger value first, ties to the lower index.
HMOE_HD bool ranks_before(float v, int32_t i, float bv, int32_t bi) { return v > bv || (v == bv && i < bi); }

// Softmax numerator of logit x under the max m: NaN and -inf logits contribute 0 (also when
// m == -inf, where exp(x - m) would be NaN); a logit equal to the max 1, so that where the max is
// +inf the +inf logits share the row equally (softmax's limit) and the others get 0.
HMOE_HD float softmax_exp(float x, float m) { return (is_nan(x) || x == -INFINITY) ? 0.f : x == m ? 1.f : expf(x - m); }
// Score and selection value of a softmax expert from its numerator, the row's sum and its logit
// (sum == 0, or NaN: no usable logit in the row).
HMOE_HD float softmax_score(float ex, float sum) { return sum > 0.f ? ex / sum : 0.f; }
HMOE_HD float softmax_sel(float logit, float score) { return is_nan(logit) ? -INFINITY : nan_to_neginf(score); }
// Sigmoid score of a non-NaN logit, and its selection value with the expert's bias.
HMOE_HD float sigmoid_score(float x) { return 1.f / (1.f + expf(-x)); }
HMOE_HD float sigmoid_sel(float score, float bias) { return nan_to_neginf(score + bias); }

// Group score from a group's selection values: the max (softmax) or the sum of the two largest
// (sigmoid), accumulated in (a, b) with a >= b; both start at -inf.
HMOE_HD void group_push(float v, float& a, float& b, bool softmax) {
  if (softmax) {
    a = fmaxf(a, v);
  } else if (v > a) {
    b = a;
    a = v;
  } else if (v > b) {
    b = v;
  }
}
HMOE_HD float group_score(float a, float b, bool softmax) { return softmax ? a : nan_to_neginf(a + b); }  // inf + -inf

// Output weight k: optionally divided by the weights' sum (+ 1e-20), then scaled; two roundings,
// as transformers does them.
HMOE_HD float final_weight(float w, float denom, bool renormalize, float scale) {
  const float x = renormalize ? w / denom : w;
  return x * scale;
}

}  // namespace topk
}  // namespace hmoe
