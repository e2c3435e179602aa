// Params struct, plan and limits of ragged_prefill and paged_prefill, shared by every variant of
// the two ops (the portable family implements both, the sm90a family ragged_prefill: each the
// functions of cuda/prefill/prefill.h with these structs).
#pragma once
#include <cstdint>

#include "hmoe/constants.h"

namespace hmoe {

// The (q/k, v) head dimensions the kernels are built for.
constexpr int kPrefillHeadDims[][2] = {{k::prefill_dim_qk_0, k::prefill_dim_v_0},
                                       {k::prefill_dim_qk_1, k::prefill_dim_v_1},
                                       {k::prefill_dim_qk_2, k::prefill_dim_v_2}};
constexpr int kPrefillNumHeadDims = 3;

// Where a call's keys and values come from.
enum PrefillKv : int32_t {
  kPrefillRagged = 0,  // k [total_kv, Hkv, Dqk], v [total_kv, Hkv, Dv]; request b's rows [kv_indptr[b], kv_indptr[b+1])
  kPrefillPaged = 1,   // k_cache [P, page, Hkv, Dqk], v_cache [P, page, Hkv, Dv]; page_table and kv_lens
};

// How one call runs, decided once per shape by the variant's plan function (cached by the entry
// point; Python reads it for reports). It depends on shapes only, never on the contents of the
// index arrays, so a captured CUDA graph replays with new ones of the same sizes.
struct PrefillPlan {
  int32_t config;       // index into the variant's table of tile configurations
  int32_t tile_q;       // query rows per CTA
  int32_t tile_kv;      // keys per step (the reference that rounds where the kernel does needs it)
  int32_t kv_stages;    // shared-memory buffers of K (V has two)
  int32_t max_items;    // work-list slots: q tiles of all requests at most (grid = max_items * heads)
  int32_t smem_bytes;   // dynamic shared memory per CTA
  int32_t ctas_per_sm;  // resident at once, from shared memory and registers (a report)
  int32_t workspace;    // int32 words of the scheduling workspace the launch needs
};

struct PrefillParams {
  const void* q;             // [total_q, H, Dqk], dtype
  const void* k;             // ragged: [total_kv, Hkv, Dqk]; paged: [P, page, Hkv, Dqk]; dtype
  const void* v;             // ragged: [total_kv, Hkv, Dv]; paged: [P, page, Hkv, Dv]; dtype
  const int32_t* qo_indptr;  // [B + 1]; clamped on the device (request b: [qo[b], max(qo[b], qo[b+1])) in [0, total_q])
  const int32_t* kv_indptr;  // ragged: [B + 1], clamped the same way to [0, total_kv]; paged: nullptr
  const int32_t* page_table;  // paged: [B, max_pages]; entries outside [0, num_pages) read as zeros
  const int32_t* kv_lens;     // paged: [B]; clamped to [0, max_pages * page_size]
  void* out;                  // [total_q, H, Dv], dtype
  float* lse;                 // [total_q, H] natural log, or nullptr
  int32_t* workspace;         // plan.workspace words (the schedule; see cuda/prefill/prefill_schedule.cuh)
  int32_t max_items;          // plan.max_items: the work list's slots
  int32_t kv;                 // PrefillKv
  int32_t batch, heads, kv_heads, head_dim_qk, head_dim_v;
  int32_t total_q, total_kv;  // ragged: total_kv rows of k and v; paged: num_pages * page_size
  int32_t page_size, max_pages, num_pages;
  int32_t causal;  // 1: query i of a request (lq queries, lk keys) sees keys j <= i + lk - lq
  int32_t dtype;   // kBF16 or kF16 (common/dtype.h)
  float sm_scale;
};

}  // namespace hmoe
