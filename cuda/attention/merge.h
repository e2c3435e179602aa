// The split-KV merge shared by hmoe's attention kernels: a kernel that splits a row's keys over
// several CTAs writes each split's normalised fp32 output and log2-domain lse; this merges them
// into the row's output (one rounding to the output dtype) and natural-log lse.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace hmoe {
namespace attn {

constexpr int kMergeMaxSplits = 64;  // the weights come from two warps

struct SplitMerge {
  const float* partial_o;    // [num_splits, rows, D]
  const float* partial_lse;  // [num_splits, rows], log2 domain; -inf (with a zero partial) for an empty split
  void* out;                 // [rows, D], dtype
  float* lse;                // [rows], natural log, or nullptr
  int64_t rows;              // e.g. requests x heads
  int32_t num_splits;        // 2 .. kMergeMaxSplits
  int32_t dtype;             // kBF16 or kF16
};

// Launches the merge of rows of width D (a multiple of 4, at most 512) on `stream`; `programmatic`
// (sm_90+): as a programmatic dependent of the kernel launched just before (which calls
// griddepcontrol.launch_dependents). `op` names the caller in errors. Instantiated per D by the
// op that uses it (its .cu includes merge.cuh). Throws std::runtime_error on a CUDA error.
template <int D>
void merge_splits(const SplitMerge& m, cudaStream_t stream, bool programmatic, const char* op);

// Loads the merge kernels for D (lazy work that must not happen inside CUDA-graph capture).
template <int D>
void merge_prewarm(const char* op);

}  // namespace attn
}  // namespace hmoe
