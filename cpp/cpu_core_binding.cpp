// Python module hmoe._native.cpu_core (baseline ISA): CPU feature primitives and grouped_topk.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/abi.h"
#include "cpu_features/cpu_features.h"
#include "topk/grouped_topk.h"

namespace py = pybind11;

// Must equal CPU_CORE["grouped_topk"] in python/hmoe/_native/signatures.py.
#define HMOE_GROUPED_TOPK_CPU_SIG "grouped_topk(" HMOE_GROUPED_TOPK_SIG_ARGS ") -> None"

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe baseline CPU module: feature detection and small CPU ops";
  m.def("abi_version", [] { return HMOE_ABI_VERSION; });
  m.def("signatures", [] {
    py::dict d;
    d["cpuid"] = "cpuid(leaf:u32, subleaf:u32) -> (eax, ebx, ecx, edx)";
    d["xcr0"] = "xcr0() -> u64";
    d["request_amx_permission"] = "request_amx_permission() -> str";
    d["hwcap"] = "hwcap() -> (u64, u64)";
    d["grouped_topk"] = HMOE_GROUPED_TOPK_CPU_SIG;
    return d;
  });
  m.def("has_cpuid", &hmoe::has_cpuid);
  m.def("cpuid", [](uint32_t leaf, uint32_t sub) {
    auto r = hmoe::cpuid(leaf, sub);
    return py::make_tuple(r[0], r[1], r[2], r[3]);
  });
  m.def("xcr0", &hmoe::xcr0);
  m.def("request_amx_permission", &hmoe::request_amx_permission);
  m.def("hwcap", [] {
    auto r = hmoe::hwcap();
    return py::make_tuple(r[0], r[1]);
  });
  // Pointers arrive as integers (tensor.data_ptr()); Python has checked shapes and dtypes.
  m.def("grouped_topk",
        [](uintptr_t logits, int32_t logits_dtype, uintptr_t bias, int32_t bias_dtype,
           uintptr_t weights, uintptr_t ids, int64_t num_tokens, int32_t num_experts,
           int32_t top_k, int32_t n_group, int32_t topk_group, int32_t scoring,
           bool renormalize, float routed_scaling_factor) {
          const hmoe::GroupedTopkParams p =
              hmoe::grouped_topk_params(logits, logits_dtype, bias, bias_dtype, weights, ids, num_tokens,
                                        num_experts, top_k, n_group, topk_group, scoring, renormalize,
                                        routed_scaling_factor);
          py::gil_scoped_release nogil;
          hmoe::grouped_topk_cpu(p);  // std::invalid_argument -> ValueError
        });
}
