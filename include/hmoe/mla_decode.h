// Params struct, plan and limits of mla_decode, shared by every variant of the op (portable, sm90a).
#pragma once
#include <cstdint>

#include "hmoe/constants.h"

namespace hmoe {

constexpr int kMlaDimCkv = k::mla_dim_ckv;  // latent (the value and the "nope" part of the key)
constexpr int kMlaDimPe = k::mla_dim_pe;    // rope part of the key
constexpr int kMlaMaxHeads = k::mla_max_heads;
constexpr int kMlaMaxBatch = k::mla_max_batch;    // the CUDA grid's z dimension
constexpr int kMlaMaxSplits = k::mla_max_splits;  // KV splits at most (the combine kernel weighs them with two warps)

// How the KV cache reaches shared memory: cp.async per lane-held row (any page size), cp.async
// from one base per tile (page size a multiple of the tile), or the TMA (the same, sm_90+).
enum MlaLoader : int32_t {
  kMlaLoadRows = k::mla_loader_rows,
  kMlaLoadContig = k::mla_loader_contig,
  kMlaLoadTma = k::mla_loader_tma,
};

// How one call runs, decided once per shape by the variant's plan function (and cached by the
// entry point; Python reads it for reports): the kernels obey it and read no environment.
struct MlaDecodePlan {
  int32_t num_splits;     // KV splits (1: no combine pass)
  int32_t config;         // index into the variant's table of tile configurations
  int32_t loader;         // MlaLoader
  int32_t heads_per_cta;  // what the configuration means, for reports
  int32_t tile_tokens;
  int32_t smem_bytes;
  int32_t cluster;  // 1, or num_splits: the splits of a request's head group are a thread-block
                    // cluster and merge in the kernel (no partials, no combine pass)
};

struct MlaDecodeParams {
  const void* q_nope;         // [B, H, 512], dtype
  const void* q_pe;           // [B, H, 64], dtype
  const void* ckv;            // [P, page_size, 512], dtype
  const void* kpe;            // [P, page_size, 64], dtype
  const int32_t* page_table;  // [B, max_pages]; entries outside [0, P) read as zeros
  const int32_t* seq_lens;    // [B]; clamped to [0, max_pages * page_size] on the device
  void* out;                  // [B, H, 512], dtype
  float* lse;                 // [B, H] natural log, or nullptr
  float* partial_o;           // [num_splits, B, H, 512] fp32 when num_splits > 1 (and cluster 1)
  float* partial_lse;         // [num_splits, B, H] (log2 domain) likewise
  int32_t batch, heads, page_size, max_pages, num_pages, num_splits;
  int32_t dtype;  // kBF16 or kF16 (common/dtype.h)
  float sm_scale;
};

}  // namespace hmoe
