// Params struct and contract of mla_rope_append, the inputs of one MLA decode step in one kernel:
// the rotary embedding of q's rope part, and the step's latent (RMSNorm) and roped key appended to
// the paged cache mla_decode reads. Shared by every variant of the op.
#pragma once
#include <cstdint>

#include "hmoe/constants.h"
#include "hmoe/mla_decode.h"

namespace hmoe {

// Where the rotary pairs sit. A pair (a, b) of input positions goes to output positions (o1, o2):
//   interleaved            a = 2i, b = 2i + 1;  o1 = 2i, o2 = 2i + 1   (DeepSeek-V2's complex rotation)
//   half                   a = i,  b = i + 32;  o1 = i,  o2 = i + 32   (rotate_half)
//   interleaved_to_half    a = 2i, b = 2i + 1;  o1 = i,  o2 = i + 32   (DeepSeek-V3 with rope_interleave)
enum MlaRopeLayout : int32_t {
  kRopeInterleaved = k::rope_layout_interleaved,
  kRopeHalf = k::rope_layout_half,
  kRopeInterleavedToHalf = k::rope_layout_interleaved_to_half,
};

// Semantics (every variant; fp32 math, one rounding per stored value unless said):
//   rope(x)[o1] = x[a] cos[o1] - x[b] sin[o1],  rope(x)[o2] = x[b] cos[o2] + x[a] sin[o2]
//     with cos/sin the row of the request (or the single row), per output element;
//   q_pe_out[b, h] = rope(q[b, h, q_dim - 64 :])
//   latent = kv[b, :512]: n = latent * rsqrt(mean(latent^2) + eps) rounded to dtype, then
//     norm_weight * n rounded to dtype (transformers' DeepSeek RMSNorm);
//   k_pe = rope(kv[b, 512:]);
//   appended at token L - 1 of request b (L = seq_lens[b]): row (L - 1) % page_size of page
//     page_table[b, (L - 1) / page_size] of ckv / kpe. Nothing is written for a request with L < 1,
//     L > max_pages * page_size or a page id outside [0, num_pages): never outside the cache.
struct MlaRopeAppendParams {
  const void* q;              // [B, H, q_dim], dtype, contiguous
  const void* kv;             // [B, 512 + 64], dtype, contiguous
  const void* norm_weight;    // [512], dtype
  const void* cos;            // [cos_rows, 64], cos_dtype (cos_rows 1: every request's)
  const void* sin;            // [cos_rows, 64], cos_dtype
  void* ckv;                  // [num_pages, page_size, 512], dtype
  void* kpe;                  // [num_pages, page_size, 64], dtype
  const int32_t* page_table;  // [B, max_pages]
  const int32_t* seq_lens;    // [B]
  void* q_pe_out;             // [B, H, 64], dtype
  int32_t batch, heads, q_dim, cos_rows, page_size, max_pages, num_pages;
  int32_t dtype;      // kBF16 or kF16
  int32_t cos_dtype;  // kF32, kBF16 or kF16
  int32_t layout;     // MlaRopeLayout
  float eps;
};

}  // namespace hmoe
