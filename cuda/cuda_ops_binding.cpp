// Python module hmoe._native.cuda_ops (portable kernels: SASS per SM target + PTX): grouped_topk.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/abi.h"
#include "topk/grouped_topk.h"

namespace py = pybind11;

// Must equal CUDA_OPS in python/hmoe/_native/signatures.py.
#define HMOE_GROUPED_TOPK_CUDA_SIG                                                          \
  "grouped_topk(logits:ptr, logits_dtype:i32, bias:ptr, bias_dtype:i32, weights:ptr, "      \
  "ids:ptr, num_tokens:i64, num_experts:i32, top_k:i32, n_group:i32, topk_group:i32, "     \
  "scoring:i32, renormalize:bool, routed_scaling_factor:f32, device:i32, stream:ptr) -> None"
#define HMOE_PREWARM_CUDA_SIG "prewarm(device:i32) -> None"

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe portable CUDA kernels (no libtorch; static CUDA runtime)";
  m.def("abi_version", [] { return HMOE_ABI_VERSION; });
  m.def("signatures", [] {
    py::dict d;
    d["grouped_topk"] = HMOE_GROUPED_TOPK_CUDA_SIG;
    d["prewarm"] = HMOE_PREWARM_CUDA_SIG;
    return d;
  });
  // Pointers and the stream arrive as integers (data_ptr(), Stream.cuda_stream); Python has
  // checked devices, shapes and dtypes. The launch is asynchronous on `stream`.
  m.def("grouped_topk",
        [](uintptr_t logits, int32_t logits_dtype, uintptr_t bias, int32_t bias_dtype,
           uintptr_t weights, uintptr_t ids, int64_t num_tokens, int32_t num_experts,
           int32_t top_k, int32_t n_group, int32_t topk_group, int32_t scoring,
           bool renormalize, float routed_scaling_factor, int32_t device, uintptr_t stream) {
          hmoe::GroupedTopkParams p{reinterpret_cast<const void*>(logits), logits_dtype,
                                    reinterpret_cast<const void*>(bias), bias_dtype,
                                    reinterpret_cast<float*>(weights),
                                    reinterpret_cast<int32_t*>(ids), num_tokens, num_experts,
                                    top_k, n_group, topk_group, scoring,
                                    renormalize ? 1 : 0, routed_scaling_factor};
          py::gil_scoped_release nogil;
          // std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError
          hmoe::grouped_topk_cuda(p, device, stream);
        });
  // Loads every kernel of this module on `device` (first eager call, or hmoe.prewarm()).
  m.def("prewarm", [](int32_t device) {
    py::gil_scoped_release nogil;
    hmoe::grouped_topk_cuda_prewarm(device);
  });
}
