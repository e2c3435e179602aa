// The split-KV merge kernels (merge.h), templates on the row width D: an op's .cu file includes
// this and instantiates merge_splits<D> / merge_prewarm<D> for its D.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "attention/merge.h"
#include "attention/softmax.cuh"
#include "common/cuda_util.h"
#include "common/dtype.h"

namespace hmoe {
namespace attn {
namespace merge_detail {

// Programmatic dependent launch (sm_90+; a no-op before): waits for the splitting grid to complete
// (its writes visible) before the partials are read.
__device__ __forceinline__ void wait_for_grid_dependencies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A row's threads take 4 columns each.
template <int D>
constexpr int kRowThreads = D / 4;
// Rows of threads a block may have (the many-splits kernel: rows of a row's splits).
constexpr int kBlockRows = 4;
constexpr int kFewSplits = 8;

// Merges the splits of one row: out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - max). The weights
// are computed once per block (thread s of the first two warps takes split s). The block's rows of
// kRowThreads threads (one per 8 splits, at most kBlockRows) take every rows-th split, each thread
// 4 columns with independent loads (an empty split has w = 0 and a zero partial), and the rows'
// sums meet in shared memory: with 64 splits a single row kept too few loads in flight, with 2 or
// 4 splits more rows only cost time (measured on an H200 for D = 512: docs/perf/mla_decode.md).
template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads<D>* kBlockRows) merge_kernel(const SplitMerge m) {
  static_assert(D % 4 == 0 && D <= 512, "4 columns a thread, at most 128 threads a row");
  __shared__ float w_s[kMergeMaxSplits];
  __shared__ float red[2][2];
  __shared__ float4 acc_s[kBlockRows - 1][kRowThreads<D>];
  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int rows = blockDim.x / kRowThreads<D>, row = tid / kRowThreads<D>, c = tid % kRowThreads<D>;
  const int weigh_warps = min(2, int(blockDim.x) / 32);  // num_splits <= 32 * weigh_warps (launcher)
  wait_for_grid_dependencies();
  const float lse = tid < m.num_splits ? m.partial_lse[tid * m.rows + r] : -INFINITY;
  if (warp < weigh_warps) {
    const float mx = warp_max(lse);
    if (lane == 0) red[0][warp] = mx;
  }
  __syncthreads();
  const float mx = weigh_warps == 2 ? fmaxf(red[0][0], red[0][1]) : red[0][0];
  const float m_use = mx == -INFINITY ? 0.f : mx;
  if (warp < weigh_warps) {
    const float w = tid < m.num_splits ? exp2f(lse - m_use) : 0.f;
    if (tid < m.num_splits) w_s[tid] = w;
    const float wsum = warp_sum(w);
    if (lane == 0) red[1][warp] = wsum;
  }
  __syncthreads();
  const float wsum = weigh_warps == 2 ? red[1][0] + red[1][1] : red[1][0];
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* po = m.partial_o + r * D + c * 4;
#pragma unroll 4
  for (int s = row; s < m.num_splits; s += rows) {
    const float ws = w_s[s];
    const float4 v = *reinterpret_cast<const float4*>(po + s * m.rows * D);
    acc.x += ws * v.x, acc.y += ws * v.y, acc.z += ws * v.z, acc.w += ws * v.w;
  }
  if (row > 0) acc_s[row - 1][c] = acc;
  __syncthreads();
  if (row > 0) return;
  for (int q = 1; q < rows; ++q) {
    const float4 v = acc_s[q - 1][c];
    acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* out = static_cast<T*>(m.out) + r * D + c * 4;
  *reinterpret_cast<uint32_t*>(out) = pack2<T>(acc.x * inv, acc.y * inv);
  *reinterpret_cast<uint32_t*>(out + 2) = pack2<T>(acc.z * inv, acc.w * inv);
  if (m.lse != nullptr && tid == 0) m.lse[r] = lse2(m_use, wsum) * kLn2;
}

// The same for num_splits <= kFewSplits: rows of kRowThreads threads, one row of the output each,
// every thread 4 columns of it and all of its splits' weights: the lse and O loads go out
// together, one round trip instead of two with barriers between them.
template <typename T, int D>
__global__ void __launch_bounds__(kRowThreads<D>* kBlockRows) merge_few_kernel(const SplitMerge m) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / kRowThreads<D>)+threadIdx.x / kRowThreads<D>;
  const int c = threadIdx.x % kRowThreads<D>;
  wait_for_grid_dependencies();
  if (r >= m.rows) return;
  float lse[kFewSplits];
  float4 v[kFewSplits];
#pragma unroll
  for (int s = 0; s < kFewSplits; ++s) {
    if (s >= m.num_splits) break;
    lse[s] = m.partial_lse[s * m.rows + r];
    v[s] = *reinterpret_cast<const float4*>(m.partial_o + (s * m.rows + r) * D + c * 4);
  }
  float mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < kFewSplits; ++s)
    if (s < m.num_splits) mx = fmaxf(mx, lse[s]);
  const float m_use = mx == -INFINITY ? 0.f : mx;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
#pragma unroll
  for (int s = 0; s < kFewSplits; ++s) {
    if (s >= m.num_splits) break;
    const float w = exp2f(lse[s] - m_use);  // an empty split: lse -inf, w 0, its partial 0
    wsum += w;
    acc.x += w * v[s].x, acc.y += w * v[s].y, acc.z += w * v[s].z, acc.w += w * v[s].w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* out = static_cast<T*>(m.out) + r * D + c * 4;
  *reinterpret_cast<uint32_t*>(out) = pack2<T>(acc.x * inv, acc.y * inv);
  *reinterpret_cast<uint32_t*>(out + 2) = pack2<T>(acc.z * inv, acc.w * inv);
  if (m.lse != nullptr && c == 0) m.lse[r] = lse2(m_use, wsum) * kLn2;
}

}  // namespace merge_detail

template <int D>
void merge_splits(const SplitMerge& m, bool programmatic, Launches& into) {
  using namespace merge_detail;
  const bool few = m.num_splits <= kFewSplits;
  // Rows of >= 8 splits each, and enough threads that the first two warps can weigh every split.
  const int rows =
      std::clamp(std::max(m.num_splits / 8, (m.num_splits + 31) / 32 * 32 / kRowThreads<D>), 1, kBlockRows);
  const dim3 grid(unsigned(few ? (m.rows + kBlockRows - 1) / kBlockRows : m.rows));
  const dim3 block(kRowThreads<D> * (few ? kBlockRows : rows));
  const bool bf16 = m.dtype == kBF16;
  const auto kernel = few ? (bf16 ? merge_few_kernel<__nv_bfloat16, D> : merge_few_kernel<__half, D>)
                          : (bf16 ? merge_kernel<__nv_bfloat16, D> : merge_kernel<__half, D>);
  into.add(kernel, grid, block, 0, programmatic, m);
}

template <int D>
void merge_prewarm(const char* op) {
  using namespace merge_detail;
  cudaFuncAttributes attr;
  for (const auto kernel : {merge_kernel<__nv_bfloat16, D>, merge_kernel<__half, D>, merge_few_kernel<__nv_bfloat16, D>,
                            merge_few_kernel<__half, D>})
    check_cuda(cudaFuncGetAttributes(&attr, kernel), op, "split merge kernel");
}

}  // namespace attn
}  // namespace hmoe
