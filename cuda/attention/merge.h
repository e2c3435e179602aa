// The split-KV merge shared by hmoe's attention kernels: a kernel that splits a row's keys over
// several CTAs writes each split's normalised fp32 output and log2-domain lse; this merges them
// into the row's output (one rounding to the output dtype) and natural-log lse.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch.h"

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

// Records the launch of the merge of rows of width D (a multiple of 4, at most 512) in `into`;
// `programmatic` (sm_90+): as a programmatic dependent of the launch recorded before it (whose
// kernel calls griddepcontrol.launch_dependents). Instantiated per D by the op that uses it (its
// .cu includes merge.cuh).
template <int D>
void merge_splits(const SplitMerge& m, bool programmatic, Launches& into);

// Loads the merge kernels for D (lazy work that must not happen inside CUDA-graph capture).
template <int D>
void merge_prewarm(const char* op);

}  // namespace attn
}  // namespace hmoe
