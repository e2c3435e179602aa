// Every constant that both C++/CUDA and Python need, written once. C++ includes this file; Python
// parses the HMOE_CONSTANT lines of its installed copy (hmoe/_native/spec/constants.h) and
// checks them against each native module's constants() at load. Format: one
// `X(name, integer)` per line inside HMOE_CONSTANTS.
#pragma once

#define HMOE_CONSTANTS(X)                                                                        \
  /* the version of the entry points, params structs and codes below: bump on any change */      \
  X(abi_version, 7)                                                                              \
  /* dtype codes: what every native entry point calls a tensor's element type */                 \
  X(dtype_float32, 0)                                                                            \
  X(dtype_float16, 1)                                                                            \
  X(dtype_bfloat16, 2)                                                                           \
  X(dtype_int32, 3)                                                                              \
  X(dtype_int64, 4)                                                                              \
  X(dtype_uint8, 5)                                                                              \
  /* expert weight formats: the float formats use their dtype codes, the quantised ones these */ \
  X(weight_format_int8, 16)                                                                      \
  X(weight_format_int4, 17)                                                                      \
  X(weight_format_fp8, 18)                                                                       \
  /* the CPU thread pool */                                                                      \
  X(max_threads, 1024)                                                                           \
  /* grouped_topk */                                                                             \
  X(topk_scoring_softmax, 0)                                                                     \
  X(topk_scoring_sigmoid, 1)                                                                     \
  X(grouped_topk_max_experts, 4096)                                                              \
  /* mla_decode */                                                                               \
  X(mla_dim_ckv, 512)                                                                            \
  X(mla_dim_pe, 64)                                                                              \
  X(mla_max_heads, 128)                                                                          \
  X(mla_max_batch, 65535)                                                                        \
  X(mla_max_splits, 64)                                                                          \
  X(mla_loader_rows, 0)                                                                          \
  X(mla_loader_contig, 1)                                                                        \
  X(mla_loader_tma, 2)                                                                           \
  /* mla_rope_append: rotary layouts (include/hmoe/mla_rope_append.h) */                         \
  X(rope_layout_interleaved, 0)                                                                  \
  X(rope_layout_half, 1)                                                                         \
  X(rope_layout_interleaved_to_half, 2)                                                          \
  /* decode_linear: the most rows of x a call takes */                                           \
  X(decode_linear_max_rows, 16)                                                                  \
  /* rms_norm: the longest row a call takes */                                                   \
  X(rms_norm_max_dim, 8192)                                                                      \
  /* ragged_prefill, paged_prefill: the (q/k, v) head dimensions built, pair i */                \
  X(prefill_dim_qk_0, 192)                                                                       \
  X(prefill_dim_v_0, 128)                                                                        \
  X(prefill_dim_qk_1, 128)                                                                       \
  X(prefill_dim_v_1, 128)                                                                        \
  X(prefill_dim_qk_2, 64)                                                                        \
  X(prefill_dim_v_2, 64)

namespace hmoe {
namespace k {
#define HMOE_CONSTANT_DEF(name, value) constexpr int name = value;
HMOE_CONSTANTS(HMOE_CONSTANT_DEF)
#undef HMOE_CONSTANT_DEF
}  // namespace k
}  // namespace hmoe
