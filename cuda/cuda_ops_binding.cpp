// Python module hmoe._native.cuda_ops (portable kernels: SASS per SM target + PTX):
// grouped_topk and mla_decode.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "common/abi.h"
#include "mla/mla_decode.h"
#include "topk/grouped_topk.h"

namespace py = pybind11;

// Must equal CUDA_OPS in python/hmoe/_native/signatures.py.
#define HMOE_GROUPED_TOPK_CUDA_SIG \
  "grouped_topk(" HMOE_GROUPED_TOPK_SIG_ARGS ", device:i32, stream:ptr) -> None"
#define HMOE_PREWARM_CUDA_SIG "prewarm(device:i32) -> None"
#define HMOE_MLA_DECODE_SIG                                                                    \
  "mla_decode(q_nope:ptr, q_pe:ptr, ckv:ptr, kpe:ptr, page_table:ptr, seq_lens:ptr, out:ptr, " \
  "lse:ptr, partial_o:ptr, partial_lse:ptr, batch:i32, heads:i32, page_size:i32, "              \
  "max_pages:i32, num_pages:i32, num_splits:i32, config:i32, loader:i32, dtype:i32, sm_scale:f32, " \
  "device:i32, stream:ptr) -> None"
#define HMOE_MLA_PLAN_SIG                                                                        \
  "mla_decode_plan(device:i32, batch:i32, heads:i32, max_pages:i32, page_size:i32, config:i32, " \
  "allow_tma:bool) -> (num_splits, config, loader, heads_per_cta, tile_tokens, smem_bytes)"

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe portable CUDA kernels (no libtorch; static CUDA runtime)";
  m.def("abi_version", [] { return HMOE_ABI_VERSION; });
  m.def("signatures", [] {
    py::dict d;
    d["grouped_topk"] = HMOE_GROUPED_TOPK_CUDA_SIG;
    d["prewarm"] = HMOE_PREWARM_CUDA_SIG;
    d["mla_decode"] = HMOE_MLA_DECODE_SIG;
    d["mla_decode_plan"] = HMOE_MLA_PLAN_SIG;
    return d;
  });
  // Pointers and the stream arrive as integers (data_ptr(), Stream.cuda_stream); Python has
  // checked devices, shapes and dtypes. The launch is asynchronous on `stream`.
  m.def("grouped_topk",
        [](uintptr_t logits, int32_t logits_dtype, uintptr_t bias, int32_t bias_dtype,
           uintptr_t weights, uintptr_t ids, int64_t num_tokens, int32_t num_experts,
           int32_t top_k, int32_t n_group, int32_t topk_group, int32_t scoring,
           bool renormalize, float routed_scaling_factor, int32_t device, uintptr_t stream) {
          const hmoe::GroupedTopkParams p =
              hmoe::grouped_topk_params(logits, logits_dtype, bias, bias_dtype, weights, ids, num_tokens,
                                        num_experts, top_k, n_group, topk_group, scoring, renormalize,
                                        routed_scaling_factor);
          py::gil_scoped_release nogil;
          // std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError
          hmoe::grouped_topk_cuda(p, device, stream);
        });
  m.def("mla_decode",
        [](uintptr_t q_nope, uintptr_t q_pe, uintptr_t ckv, uintptr_t kpe, uintptr_t page_table,
           uintptr_t seq_lens, uintptr_t out, uintptr_t lse, uintptr_t partial_o, uintptr_t partial_lse,
           int32_t batch, int32_t heads, int32_t page_size, int32_t max_pages, int32_t num_pages,
           int32_t num_splits, int32_t config, int32_t loader, int32_t dtype, float sm_scale, int32_t device,
           uintptr_t stream) {
          hmoe::MlaDecodeParams p{reinterpret_cast<const void*>(q_nope), reinterpret_cast<const void*>(q_pe),
                                  reinterpret_cast<const void*>(ckv), reinterpret_cast<const void*>(kpe),
                                  reinterpret_cast<const int32_t*>(page_table),
                                  reinterpret_cast<const int32_t*>(seq_lens), reinterpret_cast<void*>(out),
                                  reinterpret_cast<float*>(lse), reinterpret_cast<float*>(partial_o),
                                  reinterpret_cast<float*>(partial_lse), batch, heads, page_size, max_pages,
                                  num_pages, num_splits, dtype, sm_scale};
          const hmoe::MlaDecodePlan plan{num_splits, config, loader, 0, 0, 0};
          py::gil_scoped_release nogil;
          hmoe::mla_decode_portable(p, plan, device, stream);
        });
  m.def("mla_decode_plan", [](int32_t device, int32_t batch, int32_t heads, int32_t max_pages, int32_t page_size,
                              int32_t config, bool allow_tma) {
    const hmoe::MlaDecodePlan p = hmoe::mla_decode_plan(device, batch, heads, max_pages, page_size, config, allow_tma);
    return py::make_tuple(p.num_splits, p.config, p.loader, p.heads_per_cta, p.tile_tokens, p.smem_bytes);
  });
  // Loads every kernel of this module on `device` and sets their shared-memory limits (first
  // eager call, or hmoe.prewarm()): nothing of this may happen inside graph capture.
  m.def("prewarm", [](int32_t device) {
    py::gil_scoped_release nogil;
    hmoe::grouped_topk_cuda_prewarm(device);
    hmoe::mla_decode_prewarm(device);
  });
}
