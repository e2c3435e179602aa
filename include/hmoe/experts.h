// Plain params struct of the CPU MoE experts op, shared by every ISA variant.
#pragma once
#include <cstdint>

namespace hmoe {

// y[t] = sum_k topk_weights[t, k] * (silu(x[t] Wg^T) * (x[t] Wu^T)) Wd^T for expert topk_ids[t, k],
// w13[e] = [Wg; Wu] ([2I, H]), w2[e] = Wd ([H, I]); the precision contract is hmoe.ops.experts'.
struct MoeParams {
  const void* x;  // [T, H], x_dtype
  int32_t x_dtype;
  const void* topk_ids;  // [T, K], ids_dtype (int32 or int64); -1: an empty slot (adds nothing)
  int32_t ids_dtype;
  const float* topk_weights;  // [T, K]
  const void* w13;            // [E, 2I, H] row-major, or packed (see below)
  const void* w2;             // [E, H, I] row-major, or packed
  int32_t w_format;           // a float dtype code, or a quantised format (cpp/experts/format.h)
  int32_t packed;             // 1: w13/w2 hold the packed layout (always, for quantised formats)
  int64_t group13, group2;    // k per scale group of the packed w13 / w2 (quantised formats), else 0
  void* out;                  // [T, H], x_dtype
  int64_t T, K, E, H, I;
  int32_t num_threads;
};

}  // namespace hmoe
