// CPU variant of grouped_topk (DeepseekV2/V3 group-limited routing), single-threaded, fp32 math.
#include "topk/grouped_topk.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace hmoe {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float load_f32(const void* base, int32_t dtype, int64_t i) {
  switch (dtype) {
    case kF16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case kBF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// The one ranking used everywhere: larger value first, ties to the lower index. Values are
// never NaN here (sanitised beforehand), so this is a strict weak ordering.
struct RankDesc {
  const float* v;
  bool operator()(int32_t a, int32_t b) const {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  }
};

inline float nan_to_neginf(float x) { return std::isnan(x) ? kNegInf : x; }

struct Scratch {
  std::vector<float> score, sel, group_score;
  std::vector<int32_t> order, group_order;
  std::vector<char> group_kept;
};

// score[] and sel[] of one token (see the semantics in grouped_topk.h).
void score_token(const GroupedTopkParams& p, int64_t t, Scratch& s) {
  const int32_t E = p.num_experts;
  const int64_t row = t * E;
  if (p.scoring == kScoringSoftmax) {
    // NaN logits are left out of the max and the sum, exactly like -inf logits. sel[] holds
    // the logits until the scores are final.
    float m = kNegInf;
    for (int32_t e = 0; e < E; ++e) {
      float x = load_f32(p.logits, p.logits_dtype, row + e);
      s.sel[e] = x;
      if (!std::isnan(x) && x > m) m = x;
    }
    float sum = 0.f;
    for (int32_t e = 0; e < E; ++e) {
      float x = s.sel[e];
      // x == -inf contributes 0 even when m == -inf (where exp(x - m) would be NaN).
      float ex = (std::isnan(x) || x == kNegInf) ? 0.f : std::exp(x - m);
      s.score[e] = ex;
      sum += ex;
    }
    for (int32_t e = 0; e < E; ++e) {
      // sum >= 1 whenever some logit is finite; sum == 0 means no usable logit at all.
      float sc = sum > 0.f ? s.score[e] / sum : 0.f;
      s.score[e] = sc;
      s.sel[e] = std::isnan(s.sel[e]) ? kNegInf : nan_to_neginf(sc);
    }
  } else {
    for (int32_t e = 0; e < E; ++e) {
      float x = load_f32(p.logits, p.logits_dtype, row + e);
      if (std::isnan(x)) {
        s.score[e] = 0.f;
        s.sel[e] = kNegInf;
        continue;
      }
      float sc = 1.f / (1.f + std::exp(-x));
      float b = p.bias ? load_f32(p.bias, p.bias_dtype, e) : 0.f;
      s.score[e] = sc;
      s.sel[e] = nan_to_neginf(sc + b);
    }
  }
}

// Marks the topk_group best groups of one token in s.group_kept.
void select_groups(const GroupedTopkParams& p, Scratch& s) {
  const int32_t G = p.n_group, S = p.num_experts / p.n_group;
  for (int32_t g = 0; g < G; ++g) {
    const float* v = s.sel.data() + int64_t(g) * S;
    float gs;
    if (p.scoring == kScoringSoftmax) {
      gs = kNegInf;
      for (int32_t i = 0; i < S; ++i) gs = std::max(gs, v[i]);
    } else {
      float a = kNegInf, b = kNegInf;  // the two largest, a >= b
      for (int32_t i = 0; i < S; ++i) {
        if (v[i] > a) {
          b = a;
          a = v[i];
        } else if (v[i] > b) {
          b = v[i];
        }
      }
      gs = nan_to_neginf(a + b);  // inf + -inf
    }
    s.group_score[g] = gs;
    s.group_order[g] = g;
    s.group_kept[g] = 0;
  }
  std::partial_sort(s.group_order.begin(), s.group_order.begin() + p.topk_group,
                    s.group_order.end(), RankDesc{s.group_score.data()});
  for (int32_t i = 0; i < p.topk_group; ++i) s.group_kept[s.group_order[i]] = 1;
}

void route_token(const GroupedTopkParams& p, int64_t t, Scratch& s) {
  const int32_t E = p.num_experts, S = p.num_experts / p.n_group, K = p.top_k;
  score_token(p, t, s);
  // Every group is kept when topk_group == n_group: skip the group ranking altogether.
  const bool all_kept = p.topk_group == p.n_group;
  if (!all_kept) select_groups(p, s);
  int32_t n = 0;
  for (int32_t e = 0; e < E; ++e)
    if (all_kept || s.group_kept[e / S]) s.order[n++] = e;
  // n >= K: checked, top_k <= topk_group * S.
  std::partial_sort(s.order.begin(), s.order.begin() + K, s.order.begin() + n,
                    RankDesc{s.sel.data()});
  float* w = p.weights + t * K;
  int32_t* ids = p.ids + t * K;
  float sum = 0.f;
  for (int32_t k = 0; k < K; ++k) {
    ids[k] = s.order[k];
    w[k] = s.score[s.order[k]];
    sum += w[k];
  }
  // Two roundings (divide, then scale), as transformers does them.
  const float denom = sum + 1e-20f;
  for (int32_t k = 0; k < K; ++k) {
    float x = p.renormalize ? w[k] / denom : w[k];
    w[k] = x * p.routed_scaling_factor;
  }
}

}  // namespace

void grouped_topk_cpu(const GroupedTopkParams& p) {
  if (const char* why = grouped_topk_check(p))
    throw std::invalid_argument(std::string("grouped_topk: ") + why);
  if (p.num_tokens == 0) return;
  Scratch s;
  s.score.resize(p.num_experts);
  s.sel.resize(p.num_experts);
  s.order.resize(p.num_experts);
  s.group_score.resize(p.n_group);
  s.group_order.resize(p.n_group);
  s.group_kept.resize(p.n_group);
  for (int64_t t = 0; t < p.num_tokens; ++t) route_token(p, t, s);
}

}  // namespace hmoe
