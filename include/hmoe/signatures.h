// Every native entry point of hmoe, written once. HMOE_ARGS_<name> lists an entry point's
// arguments as (kind, name) pairs; HMOE_ENTRY_POINTS(X) gives, for each, the module that exports it
// (cpu_core; experts: every experts_<isa> module; cuda: every CUDA family module built with the
// op), the op it belongs to, its name, what it returns and its arguments. The bindings generate
// their parameter lists and their signature tables from these lines (cpp/bind/module.h); Python
// parses this file (installed as hmoe/_native/spec/signatures.h) and refuses a module
// whose table differs (a .so from another build).
//
// Kinds: tensor (a torch tensor), tensor_or_none, int, float, bool, str (values from users,
// checked by the entry point: cpp/bind/scalars.h); i32, i64, u32 (integers from hmoe's Python).
// Every module also exports abi_version(), signatures(), constants() and bind_torch(api, plain,
// fallback) (cpp/bind/module.h): those four never change shape.
#pragma once

#define HMOE_ARGS_NONE
#define HMOE_ARGS_cpuid (u32, leaf), (u32, subleaf)
#define HMOE_ARGS_check_tensor (tensor, t), (str, name), (i64, dtypes), (i32, ndim), (i32, where), (bool, contiguous)
#define HMOE_ARGS_grouped_topk                                                                                      \
  (tensor, router_logits), (int, top_k), (int, n_group), (int, topk_group), (str, scoring), (tensor_or_none, bias), \
      (bool, renormalize), (float, routed_scaling_factor)
#define HMOE_ARGS_moe_experts                                                                                  \
  (tensor, x), (tensor, topk_ids), (tensor, topk_weights), (tensor, w13), (tensor, w2), (tensor_or_none, out), \
      (i32, num_threads)
#define HMOE_ARGS_moe_experts_packed                                                                               \
  (tensor, x), (tensor, topk_ids), (tensor, topk_weights), (tensor, w13), (tensor, w2), (i32, w_format), (i64, E), \
      (i64, H), (i64, I), (i64, group13), (i64, group2), (tensor_or_none, out), (i32, num_threads)
#define HMOE_ARGS_host_job_create                                                                                  \
  (tensor, x), (tensor, topk_ids), (tensor, topk_weights), (tensor, w13), (tensor, w2), (i32, w_format), (i64, E), \
      (i64, H), (i64, I), (i64, group13), (i64, group2), (tensor, out), (i32, num_threads)
#define HMOE_ARGS_host_job_error (i64, job)
#define HMOE_ARGS_host_job_free HMOE_ARGS_host_job_error
#define HMOE_ARGS_host_job_times HMOE_ARGS_host_job_error
#define HMOE_ARGS_host_job_listen (i64, job), (tensor, flags)
#define HMOE_ARGS_pack_weights (tensor, w13), (tensor, w2), (i32, num_threads)
#define HMOE_ARGS_pack_quantized                                                                                     \
  (tensor, w13_data), (tensor, w13_scales), (tensor, w2_data), (tensor, w2_scales), (i32, w_format), (i64, group13), \
      (i64, group2), (i64, scale_rows13), (i64, scale_cols13), (i64, scale_rows2), (i64, scale_cols2),               \
      (i32, num_threads)
#define HMOE_ARGS_quantize_weights                                                                                   \
  (tensor, w), (tensor_or_none, w_scales), (i64, w_rows), (i64, w_cols), (i32, w_format), (i64, group), (tensor, q), \
      (tensor, scales), (i32, num_threads)
#define HMOE_ARGS_dequantize_fp8 \
  (tensor, q), (tensor, scales), (i64, rows), (i64, cols), (tensor, out), (i32, num_threads)
#define HMOE_ARGS_fp8_has_nan (tensor, q), (i32, num_threads)
#define HMOE_ARGS_packed_select (tensor, w13_packed), (tensor, w2_packed), (i64, E), (tensor, ids), (i32, num_threads)
#define HMOE_ARGS_packed_bytes (i32, w_format), (i64, H), (i64, I), (i64, group13), (i64, group2)
#define HMOE_ARGS_read_bandwidth (i64, bytes), (i32, threads), (i32, repeats)
#define HMOE_ARGS_prewarm (i32, device)
#define HMOE_ARGS_mla_decode_check                                                                  \
  (tensor, q_nope), (tensor, q_pe), (tensor, ckv_cache), (tensor, kpe_cache), (tensor, page_table), \
      (tensor, seq_lens), (float, sm_scale), (tensor_or_none, out)
#define HMOE_ARGS_mla_decode HMOE_ARGS_mla_decode_check, (bool, return_lse), (i32, config), (bool, allow_tma)
#define HMOE_ARGS_mla_decode_plan \
  (i32, device), (i32, batch), (i32, heads), (i32, max_pages), (i32, page_size), (i32, config), (bool, allow_tma)
#define HMOE_ARGS_mla_decode_declines (i32, sms), (i32, batch), (i32, heads), (i32, max_pages), (i32, page_size)
#define HMOE_ARGS_mla_rope_append                                                                      \
  (tensor, q), (tensor, kv), (tensor, norm_weight), (tensor, cos), (tensor, sin), (tensor, ckv_cache), \
      (tensor, kpe_cache), (tensor, page_table), (tensor, seq_lens), (float, eps), (str, rope_layout)
#define HMOE_ARGS_decode_linear (tensor, x), (tensor, weight), (bool, fp32_out)
#define HMOE_ARGS_rms_norm (tensor, x), (tensor, weight), (float, eps)
#define HMOE_ARGS_ragged_prefill_check                                                                                \
  (tensor, q), (tensor, k), (tensor, v), (tensor, qo_indptr), (tensor, kv_indptr), (float, sm_scale), (bool, causal), \
      (tensor_or_none, out)
#define HMOE_ARGS_ragged_prefill HMOE_ARGS_ragged_prefill_check, (bool, return_lse), (i32, config)
#define HMOE_ARGS_paged_prefill_check                                                                              \
  (tensor, q), (tensor, k_cache), (tensor, v_cache), (tensor, page_table), (tensor, kv_lens), (tensor, qo_indptr), \
      (float, sm_scale), (bool, causal), (tensor_or_none, out)
#define HMOE_ARGS_paged_prefill HMOE_ARGS_paged_prefill_check, (bool, return_lse), (i32, config)
#define HMOE_ARGS_prefill_plan                                                                                       \
  (i32, device), (i64, total_q), (i32, batch), (i32, heads), (i32, kv_heads), (i32, head_dim_qk), (i32, head_dim_v), \
      (i32, config)
#define HMOE_ARGS_ragged_prefill_plan HMOE_ARGS_prefill_plan
#define HMOE_ARGS_paged_prefill_plan HMOE_ARGS_prefill_plan

#define HMOE_ENTRY_POINTS(X)                                                                                    \
  X(cpu_core, cpu_features, cpuid, "(eax, ebx, ecx, edx)", HMOE_ARGS_cpuid)                                     \
  X(cpu_core, cpu_features, xcr0, "u64", HMOE_ARGS_NONE)                                                        \
  X(cpu_core, cpu_features, request_amx_permission, "str", HMOE_ARGS_NONE)                                      \
  X(cpu_core, cpu_features, hwcap, "(u64, u64)", HMOE_ARGS_NONE)                                                \
  X(cpu_core, validation, check_tensor, "None", HMOE_ARGS_check_tensor)                                         \
  X(cpu_core, membw, read_bandwidth, "bytes_per_second", HMOE_ARGS_read_bandwidth)                              \
  X(cpu_core, grouped_topk, grouped_topk, "(weights, ids)", HMOE_ARGS_grouped_topk)                             \
  X(experts, experts, moe_experts, "out", HMOE_ARGS_moe_experts)                                                \
  X(experts, experts, moe_experts_packed, "out", HMOE_ARGS_moe_experts_packed)                                  \
  X(experts, experts, host_job_create, "(run_fn, job)", HMOE_ARGS_host_job_create)                              \
  X(experts, experts, host_job_error, "str", HMOE_ARGS_host_job_error)                                          \
  X(experts, experts, host_job_times, "list of run times (us)", HMOE_ARGS_host_job_times)                       \
  X(experts, experts, host_job_free, "None", HMOE_ARGS_host_job_free)                                           \
  X(experts, experts, host_job_listen, "None", HMOE_ARGS_host_job_listen)                                       \
  X(experts, experts, host_job_wake, "None", HMOE_ARGS_NONE)                                                    \
  X(experts, experts, pack_weights, "(w13_packed, w2_packed)", HMOE_ARGS_pack_weights)                          \
  X(experts, experts, pack_quantized, "(w13_packed, w2_packed)", HMOE_ARGS_pack_quantized)                      \
  X(experts, experts, quantize_weights, "None", HMOE_ARGS_quantize_weights)                                     \
  X(experts, experts, dequantize_fp8, "None", HMOE_ARGS_dequantize_fp8)                                         \
  X(experts, experts, fp8_has_nan, "bool", HMOE_ARGS_fp8_has_nan)                                               \
  X(experts, experts, packed_select, "(w13_packed, w2_packed)", HMOE_ARGS_packed_select)                        \
  X(experts, experts, packed_bytes, "(w13_bytes_per_expert, w2_bytes_per_expert)", HMOE_ARGS_packed_bytes)      \
  X(cuda, cuda, prewarm, "None", HMOE_ARGS_prewarm)                                                             \
  X(cuda, grouped_topk, grouped_topk, "(weights, ids)", HMOE_ARGS_grouped_topk)                                 \
  X(cuda, mla_decode, mla_decode_check, "None", HMOE_ARGS_mla_decode_check)                                     \
  X(cuda, mla_decode, mla_decode, "out | (out, lse)", HMOE_ARGS_mla_decode)                                     \
  X(cuda, mla_decode, mla_decode_plan,                                                                          \
    "(num_splits, config, loader, heads_per_cta, tile_tokens, smem_bytes, cluster)", HMOE_ARGS_mla_decode_plan) \
  X(cuda, mla_decode, mla_decode_declines, "str", HMOE_ARGS_mla_decode_declines)                                \
  X(cuda, mla_rope_append, mla_rope_append, "q_pe", HMOE_ARGS_mla_rope_append)                                  \
  X(cuda, decode_linear, decode_linear, "y", HMOE_ARGS_decode_linear)                                           \
  X(cuda, rms_norm, rms_norm, "y", HMOE_ARGS_rms_norm)                                                          \
  X(cuda, ragged_prefill, ragged_prefill_check, "None", HMOE_ARGS_ragged_prefill_check)                         \
  X(cuda, ragged_prefill, ragged_prefill, "out | (out, lse)", HMOE_ARGS_ragged_prefill)                         \
  X(cuda, ragged_prefill, ragged_prefill_plan,                                                                  \
    "(config, tile_q, tile_kv, kv_stages, max_items, smem_bytes, ctas_per_sm, workspace)",                      \
    HMOE_ARGS_ragged_prefill_plan)                                                                              \
  X(cuda, paged_prefill, paged_prefill_check, "None", HMOE_ARGS_paged_prefill_check)                            \
  X(cuda, paged_prefill, paged_prefill, "out | (out, lse)", HMOE_ARGS_paged_prefill)                            \
  X(cuda, paged_prefill, paged_prefill_plan,                                                                    \
    "(config, tile_q, tile_kv, kv_stages, max_items, smem_bytes, ctas_per_sm, workspace)",                      \
    HMOE_ARGS_paged_prefill_plan)
