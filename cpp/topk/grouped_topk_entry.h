// grouped_topk's entry point for every module that runs it (cpu_core, the CUDA families): the
// arguments of hmoe.ops.grouped_topk checked in the order that function documents, the outputs
// allocated on the logits' device, then the variant `run(params, device)`.
#pragma once
#include <pybind11/pybind11.h>

#include <climits>
#include <string>

#include "bind/scalars.h"
#include "bind/tensors.h"
#include "topk/grouped_topk.h"

namespace hmoe::bind {

template <typename Run>
py::tuple grouped_topk_entry(py::handle router_logits, py::handle top_k, py::handle n_group, py::handle topk_group,
                             py::handle scoring, py::handle bias, py::handle renormalize,
                             py::handle routed_scaling_factor, Run run) {
  const std::string op = "grouped_topk: ";
  const TensorArg logits = tensor(router_logits, "grouped_topk: router_logits", kFloats, 2, Where::kCpuOrCuda);
  const int64_t T = logits.shape[0], E = logits.shape[1];
  if (E < 1 || E > kGroupedTopkMaxExperts)
    value_error(op + "router_logits has " + std::to_string(E) + " experts (dim 1); supported: 1.." +
                std::to_string(kGroupedTopkMaxExperts));
  if (T > INT32_MAX)
    value_error(op + "router_logits has " + std::to_string(T) + " tokens; supported: up to " +
                std::to_string(INT32_MAX));
  int32_t code = -1;
  if (PyUnicode_Check(scoring.ptr())) {
    const std::string s = scoring.cast<std::string>();
    code = s == "softmax" ? kScoringSoftmax : s == "sigmoid" ? kScoringSigmoid : -1;
  }
  if (code < 0)
    value_error(op + "scoring must be 'softmax' or 'sigmoid', got " + py::repr(scoring).cast<std::string>());
  const int64_t groups = int_arg(n_group, op + "n_group", 1, kGroupedTopkMaxExperts);
  const int64_t kept = int_arg(topk_group, op + "topk_group", 1, kGroupedTopkMaxExperts);
  const int64_t K = int_arg(top_k, op + "top_k", 1, kGroupedTopkMaxExperts);
  if (groups < 1 || E % groups)
    value_error(op + "n_group=" + std::to_string(groups) + " must be >= 1 and divide the number of experts " +
                std::to_string(E));
  if (kept < 1 || kept > groups)
    value_error(op + "topk_group=" + std::to_string(kept) + " must be in 1..n_group=" + std::to_string(groups));
  const int64_t group_size = E / groups;
  if (code == kScoringSigmoid && groups > 1 && group_size < 2)
    value_error(op + "sigmoid scoring ranks groups by their two best experts, so n_group=" + std::to_string(groups) +
                " must leave >= 2 experts per group (E=" + std::to_string(E) + ")");
  if (K < 1 || K > kept * group_size)
    value_error(op + "top_k=" + std::to_string(K) + " must be in 1.." + std::to_string(kept * group_size) +
                " (topk_group * experts per group; E=" + std::to_string(E) + ", n_group=" + std::to_string(groups) +
                ")");
  GroupedTopkParams p{};
  if (!bias.is_none()) {
    // As in transformers: only DeepseekV3's sigmoid router has a correction bias.
    if (code != kScoringSigmoid) value_error(op + "bias (e_score_correction_bias) is only used with scoring='sigmoid'");
    const TensorArg b = tensor(bias, "grouped_topk: bias", kFloats, -1, Where::kCpuOrCuda);
    if (b.ndim != 1 || b.shape[0] != E)
      value_error(op + "bias must have shape (" + std::to_string(E) + ",), got " + b.shape_str());
    if (b.device != logits.device)
      value_error(op + "bias is on " + b.device_str() + ", router_logits on " + logits.device_str() +
                  "; they must be on the same device");
    p.bias = b.data;
    p.bias_dtype = b.dtype;
  }
  p.renormalize = bool_arg(renormalize, op + "renormalize") ? 1 : 0;
  p.routed_scaling_factor = float_arg(routed_scaling_factor, op + "routed_scaling_factor");
  p.logits = logits.data;
  p.logits_dtype = logits.dtype;
  p.num_tokens = T;
  p.num_experts = int32_t(E);
  p.top_k = int32_t(K);
  p.n_group = int32_t(groups);
  p.topk_group = int32_t(kept);
  p.scoring = code;
  void *w = nullptr, *ids = nullptr;
  py::object weights = empty({T, K}, kF32, logits.device, &w);
  py::object experts = empty({T, K}, kI32, logits.device, &ids);
  p.weights = static_cast<float*>(w);
  p.ids = static_cast<int32_t*>(ids);
  if (T > 0) run(p, logits.device);
  return py::make_tuple(weights, experts);
}

}  // namespace hmoe::bind
