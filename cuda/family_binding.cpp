// Python module hmoe._native.<family>: one CUDA kernel family of arch/gpu.json, built with the ops
// CMake lists for it (HMOE_HAS_<op>). Every family module has the same entry points for the ops it
// holds (include/hmoe/signatures.h), so the dispatcher can pick any of them.
#include <pybind11/pybind11.h>

#include <cstring>

#include "bind/gil.h"
#include "bind/module.h"

// The ops of this family (CMake defines those it was built with to 1).
#ifndef HMOE_HAS_grouped_topk
#define HMOE_HAS_grouped_topk 0
#endif
#ifndef HMOE_HAS_mla_decode
#define HMOE_HAS_mla_decode 0
#endif
#ifndef HMOE_HAS_mla_rope_append
#define HMOE_HAS_mla_rope_append 0
#endif
#ifndef HMOE_HAS_decode_linear
#define HMOE_HAS_decode_linear 0
#endif
#ifndef HMOE_HAS_rms_norm
#define HMOE_HAS_rms_norm 0
#endif
#ifndef HMOE_HAS_ragged_prefill
#define HMOE_HAS_ragged_prefill 0
#endif
#ifndef HMOE_HAS_paged_prefill
#define HMOE_HAS_paged_prefill 0
#endif

#if HMOE_HAS_grouped_topk
#include "topk/grouped_topk_entry.h"
#endif
#if HMOE_HAS_mla_decode
#include "mla/mla_decode_entry.h"
#endif
#if HMOE_HAS_mla_rope_append
#include "mla/mla_rope_append_entry.h"
#endif
#if HMOE_HAS_decode_linear
#include "linear/decode_linear_entry.h"
#endif
#if HMOE_HAS_rms_norm
#include "norm/rms_norm_entry.h"
#endif
#if HMOE_HAS_ragged_prefill || HMOE_HAS_paged_prefill
#include "prefill/prefill_entry.h"
#endif

namespace py = pybind11;
namespace hb = hmoe::bind;

namespace {

bool has_op(const char* op) {
  return std::strcmp(op, "cuda") == 0 || (HMOE_HAS_grouped_topk && std::strcmp(op, "grouped_topk") == 0) ||
         (HMOE_HAS_mla_decode && std::strcmp(op, "mla_decode") == 0) ||
         (HMOE_HAS_mla_rope_append && std::strcmp(op, "mla_rope_append") == 0) ||
         (HMOE_HAS_decode_linear && std::strcmp(op, "decode_linear") == 0) ||
         (HMOE_HAS_rms_norm && std::strcmp(op, "rms_norm") == 0) ||
         (HMOE_HAS_ragged_prefill && std::strcmp(op, "ragged_prefill") == 0) ||
         (HMOE_HAS_paged_prefill && std::strcmp(op, "paged_prefill") == 0);
}

}  // namespace

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe CUDA kernel family " HMOE_STR(HMOE_MODULE_NAME) " (no libtorch; static CUDA runtime)";
  hb::def_common(m, "cuda", has_op);
  // Loads every kernel of this module on `device` and sets their shared-memory limits (first eager
  // call, or hmoe.prewarm()): nothing of this may happen inside graph capture.
  HMOE_DEF(m, prewarm, {
    hb::without_gil([&] {
#if HMOE_HAS_grouped_topk
      hmoe::grouped_topk_cuda_prewarm(device);
#endif
#if HMOE_HAS_mla_decode
      hmoe::mla_decode_prewarm(device);
#endif
#if HMOE_HAS_mla_rope_append
      hmoe::mla_rope_append_prewarm(device);
#endif
#if HMOE_HAS_decode_linear
      hmoe::decode_linear_prewarm(device);
#endif
#if HMOE_HAS_rms_norm
      hmoe::rms_norm_prewarm(device);
#endif
#if HMOE_HAS_ragged_prefill || HMOE_HAS_paged_prefill
      hmoe::prefill_prewarm(device);
#endif
    });
  });
#if HMOE_HAS_grouped_topk
  HMOE_DEF(m, grouped_topk, {
    return hb::grouped_topk_entry(
        router_logits, top_k, n_group, topk_group, scoring, bias, renormalize, routed_scaling_factor,
        [](const hmoe::GroupedTopkParams& p, int32_t device) {
          if (device < 0) hb::value_error("grouped_topk: router_logits is on the CPU; this module runs CUDA tensors");
          void* stream = hb::current_stream(device);
          hb::without_gil([&] { hmoe::grouped_topk_cuda(p, device, reinterpret_cast<uintptr_t>(stream)); });
        });
  });
#endif
#if HMOE_HAS_mla_decode
  HMOE_DEF(m, mla_decode_check,
           { hb::mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out); });
  HMOE_DEF(m, mla_decode, {
    return hb::mla_decode_entry(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out, return_lse,
                                config, allow_tma);
  });
  HMOE_DEF(m, mla_decode_plan, {
    const hmoe::MlaDecodePlan p = hb::mla_decode_cached_plan(device, batch, heads, max_pages, page_size, config,
                                                             hb::bool_arg(allow_tma, "allow_tma"));
    return py::make_tuple(p.num_splits, p.config, p.loader, p.heads_per_cta, p.tile_tokens, p.smem_bytes, p.cluster);
  });
  HMOE_DEF(m, mla_decode_declines, {
    const char* why = hmoe::mla_decode_declines(sms, batch, heads, max_pages, page_size);
    return py::str(why == nullptr ? "" : why);
  });
#endif
#if HMOE_HAS_mla_rope_append
  HMOE_DEF(m, mla_rope_append, {
    return hb::mla_rope_append_entry(q, kv, norm_weight, cos, sin, ckv_cache, kpe_cache, page_table, seq_lens, eps,
                                     rope_layout);
  });
#endif
#if HMOE_HAS_decode_linear
  HMOE_DEF(m, decode_linear, { return hb::decode_linear_entry(x, weight, fp32_out); });
#endif
#if HMOE_HAS_rms_norm
  HMOE_DEF(m, rms_norm, { return hb::rms_norm_entry(x, weight, eps); });
#endif
#if HMOE_HAS_ragged_prefill
  HMOE_DEF(m, ragged_prefill_check, { hb::ragged_prefill_args(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, out); });
  HMOE_DEF(m, ragged_prefill, {
    hb::PrefillCall c = hb::ragged_prefill_args(q, k, v, qo_indptr, kv_indptr, sm_scale, causal, out);
    return hb::prefill_run(c, out, return_lse, config);
  });
  HMOE_DEF(m, ragged_prefill_plan, {
    return hb::prefill_plan_tuple(
        hb::prefill_cached_plan(device, total_q, batch, heads, kv_heads, head_dim_qk, head_dim_v, config));
  });
#endif
#if HMOE_HAS_paged_prefill
  HMOE_DEF(m, paged_prefill_check,
           { hb::paged_prefill_args(q, k_cache, v_cache, page_table, kv_lens, qo_indptr, sm_scale, causal, out); });
  HMOE_DEF(m, paged_prefill, {
    hb::PrefillCall c =
        hb::paged_prefill_args(q, k_cache, v_cache, page_table, kv_lens, qo_indptr, sm_scale, causal, out);
    return hb::prefill_run(c, out, return_lse, config);
  });
  HMOE_DEF(m, paged_prefill_plan, {
    return hb::prefill_plan_tuple(
        hb::prefill_cached_plan(device, total_q, batch, heads, kv_heads, head_dim_qk, head_dim_v, config));
  });
#endif
}
