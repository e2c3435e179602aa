// Python module hmoe._native.cpu_core (baseline ISA): CPU feature primitives, the tensor checks
// Python uses for its own arguments, and grouped_topk on the CPU.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind/gil.h"
#include "bind/module.h"
#include "cpu_features/cpu_features.h"
#include "membw/read_probe.h"
#include "topk/grouped_topk_entry.h"

namespace py = pybind11;
namespace hb = hmoe::bind;

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe baseline CPU module: feature detection and small CPU ops";
  hb::def_common(m, "cpu_core", [](const char*) { return true; });
  m.def("has_cpuid", &hmoe::has_cpuid);
  HMOE_DEF(m, cpuid, {
    auto r = hmoe::cpuid(leaf, subleaf);
    return py::make_tuple(r[0], r[1], r[2], r[3]);
  });
  m.def("xcr0", &hmoe::xcr0);
  m.def("request_amx_permission", &hmoe::request_amx_permission);
  m.def("hwcap", [] {
    auto r = hmoe::hwcap();
    return py::make_tuple(r[0], r[1]);
  });
  HMOE_DEF(m, check_tensor, {
    const std::string label = name.cast<std::string>();
    if (where < 0 || where > 3) throw std::invalid_argument("check_tensor: where must be 0..3");
    hb::tensor(t, label.c_str(), uint32_t(dtypes), ndim, static_cast<hb::Where>(where),
               hb::bool_arg(contiguous, "contiguous"));
  });
  HMOE_DEF(m, read_bandwidth,
           { return hb::without_gil([&] { return hmoe::read_bandwidth(bytes, threads, repeats); }); });
  HMOE_DEF(m, grouped_topk, {
    return hb::grouped_topk_entry(
        router_logits, top_k, n_group, topk_group, scoring, bias, renormalize, routed_scaling_factor,
        [](const hmoe::GroupedTopkParams& p, int32_t device) {
          if (device >= 0)
            hb::value_error("grouped_topk: router_logits is on cuda:" + std::to_string(device) +
                            "; the CPU module runs CPU tensors only");
          hb::without_gil([&] { hmoe::grouped_topk_cpu(p); });  // std::invalid_argument -> ValueError
        });
  });
}
