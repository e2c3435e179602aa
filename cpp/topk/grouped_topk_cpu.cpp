// CPU variant of grouped_topk (DeepseekV2/V3 group-limited routing), single-threaded, fp32 math.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "topk/grouped_topk.h"
#include "topk/grouped_topk_rules.h"

namespace hmoe {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// topk::ranks_before as a sort comparator over indices. Values are never NaN here (sanitised
// beforehand), so this is a strict weak ordering.
struct RankDesc {
  const float* v;
  bool operator()(int32_t a, int32_t b) const { return topk::ranks_before(v[a], a, v[b], b); }
};

struct Scratch {
  std::vector<float> bias;  // fp32 copy of p.bias (sigmoid with bias), converted once per call
  std::vector<float> score, sel, group_score;
  std::vector<int32_t> order, group_order;
  std::vector<char> group_kept;
};

// score[] and sel[] of one token (see the semantics in grouped_topk.h); sel[] holds the
// token's logits until its values are final.
void score_token(const GroupedTopkParams& p, int64_t t, Scratch& s) {
  const int32_t E = p.num_experts;
  load_row_f32(static_cast<const char*>(p.logits) + t * E * dtype_size(p.logits_dtype), p.logits_dtype, E,
               s.sel.data());
  if (p.scoring == kScoringSoftmax) {
    // NaN logits are left out of the max and the sum, exactly like -inf logits.
    float m = kNegInf;
    for (int32_t e = 0; e < E; ++e) {
      const float x = s.sel[e];
      if (!std::isnan(x) && x > m) m = x;
    }
    float sum = 0.f;
    for (int32_t e = 0; e < E; ++e) {
      const float ex = topk::softmax_exp(s.sel[e], m);
      s.score[e] = ex;
      sum += ex;
    }
    for (int32_t e = 0; e < E; ++e) {
      const float sc = topk::softmax_score(s.score[e], sum);
      s.score[e] = sc;
      s.sel[e] = topk::softmax_sel(s.sel[e], sc);
    }
  } else {
    for (int32_t e = 0; e < E; ++e) {
      const float x = s.sel[e];
      if (std::isnan(x)) {
        s.score[e] = 0.f;
        s.sel[e] = kNegInf;
        continue;
      }
      const float sc = topk::sigmoid_score(x);
      s.score[e] = sc;
      s.sel[e] = topk::sigmoid_sel(sc, s.bias.empty() ? 0.f : s.bias[e]);
    }
  }
}

// Marks the topk_group best groups of one token in s.group_kept.
void select_groups(const GroupedTopkParams& p, Scratch& s) {
  const int32_t G = p.n_group, S = p.num_experts / p.n_group;
  const bool softmax = p.scoring == kScoringSoftmax;
  for (int32_t g = 0; g < G; ++g) {
    const float* v = s.sel.data() + int64_t(g) * S;
    float a = kNegInf, b = kNegInf;
    for (int32_t i = 0; i < S; ++i) topk::group_push(v[i], a, b, softmax);
    s.group_score[g] = topk::group_score(a, b, softmax);
    s.group_order[g] = g;
    s.group_kept[g] = 0;
  }
  std::partial_sort(s.group_order.begin(), s.group_order.begin() + p.topk_group, s.group_order.end(),
                    RankDesc{s.group_score.data()});
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
  std::partial_sort(s.order.begin(), s.order.begin() + K, s.order.begin() + n, RankDesc{s.sel.data()});
  float* w = p.weights + t * K;
  int32_t* ids = p.ids + t * K;
  float sum = 0.f;
  for (int32_t k = 0; k < K; ++k) {
    ids[k] = s.order[k];
    w[k] = s.score[s.order[k]];
    sum += w[k];
  }
  const float denom = sum + 1e-20f;
  for (int32_t k = 0; k < K; ++k) w[k] = topk::final_weight(w[k], denom, p.renormalize, p.routed_scaling_factor);
}

}  // namespace

void grouped_topk_cpu(const GroupedTopkParams& p) {
  if (const char* why = grouped_topk_check(p)) throw std::invalid_argument(std::string("grouped_topk: ") + why);
  if (p.num_tokens == 0) return;
  Scratch s;
  if (p.bias != nullptr) {
    s.bias.resize(p.num_experts);
    load_row_f32(p.bias, p.bias_dtype, p.num_experts, s.bias.data());
  }
  s.score.resize(p.num_experts);
  s.sel.resize(p.num_experts);
  s.order.resize(p.num_experts);
  s.group_score.resize(p.n_group);
  s.group_order.resize(p.n_group);
  s.group_kept.resize(p.n_group);
  for (int64_t t = 0; t < p.num_tokens; ++t) route_token(p, t, s);
}

}  // namespace hmoe
