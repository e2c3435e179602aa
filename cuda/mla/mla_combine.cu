// The combine kernels of the portable MLA decode (see mla_combine.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "common/cuda_util.h"
#include "common/dtype.h"
#include "mla/mla_combine.h"

namespace hmoe {
namespace {

constexpr float kLn2 = 0.6931471805599453f;

// Programmatic dependent launch (sm_90+; a no-op before): waits for the decode grid to complete
// (its writes visible) before the partials are read.
__device__ __forceinline__ void wait_for_grid_dependencies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Merges the splits of one (request, head): out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - max).
// The weights are computed once per block (thread s of the first two warps takes split s). The
// block's rows of 128 threads (blockDim.x / 128: one per 8 splits, at most kCombineRows) take
// every rows-th split, each thread 4 columns with independent loads (an empty split has w = 0 and
// a zero partial), and the rows' sums meet in shared memory: with 64 splits a single row kept too
// few loads in flight, with 2 or 4 more rows only cost time (cuda/mla/NOTES.md).
// With at most kFewSplits splits (mla_combine_few_kernel) each thread weighs them itself: the lse
// and O loads go out together, one round trip instead of two with barriers between them.
constexpr int kCombineRows = 4;
constexpr int kFewSplits = 8;
template <typename T>
__global__ void __launch_bounds__(128 * kCombineRows) mla_combine_kernel(const MlaDecodeParams p) {
  static_assert(kMlaMaxSplits <= 64, "the weights come from two warps");
  __shared__ float w_s[kMlaMaxSplits];
  __shared__ float red[2][2];
  __shared__ float4 acc_s[kCombineRows - 1][kMlaDimCkv / 4];
  const int64_t bh = blockIdx.x;
  const int64_t stride = int64_t(p.batch) * p.heads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int rows = blockDim.x / 128, row = tid / 128, c = tid % 128;
  wait_for_grid_dependencies();  // the partials of the decode kernel launched before
  const float lse = tid < p.num_splits ? p.partial_lse[tid * stride + bh] : -INFINITY;
  if (warp < 2) {
    float mx = lse;
    mx = warp_max(mx);
    if (lane == 0) red[0][warp] = mx;
  }
  __syncthreads();
  const float mx = fmaxf(red[0][0], red[0][1]);
  const float m_use = mx == -INFINITY ? 0.f : mx;
  if (warp < 2) {
    const float w = tid < p.num_splits ? exp2f(lse - m_use) : 0.f;
    if (tid < p.num_splits) w_s[tid] = w;
    float wsum = w;
    wsum = warp_sum(wsum);
    if (lane == 0) red[1][warp] = wsum;
  }
  __syncthreads();
  const float wsum = red[1][0] + red[1][1];
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float* po = p.partial_o + bh * kMlaDimCkv + c * 4;
#pragma unroll 4
  for (int s = row; s < p.num_splits; s += rows) {
    const float ws = w_s[s];
    const float4 v = *reinterpret_cast<const float4*>(po + s * stride * kMlaDimCkv);
    acc.x += ws * v.x, acc.y += ws * v.y, acc.z += ws * v.z, acc.w += ws * v.w;
  }
  if (row > 0) acc_s[row - 1][c] = acc;
  __syncthreads();
  if (row > 0) return;
  for (int r = 1; r < rows; ++r) {
    const float4 v = acc_s[r - 1][c];
    acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* out = static_cast<T*>(p.out) + bh * kMlaDimCkv + c * 4;
  *reinterpret_cast<uint32_t*>(out) = pack2<T>(acc.x * inv, acc.y * inv);
  *reinterpret_cast<uint32_t*>(out + 2) = pack2<T>(acc.z * inv, acc.w * inv);
  if (p.lse != nullptr && tid == 0) p.lse[bh] = wsum > 0.f ? (m_use + log2f(wsum)) * kLn2 : -INFINITY;
}

// The same for num_splits <= kFewSplits: rows of 128 threads, one (request, head) each, every
// thread 4 columns of it and all of its splits' weights.
template <typename T>
__global__ void __launch_bounds__(128 * kCombineRows) mla_combine_few_kernel(const MlaDecodeParams p) {
  const int64_t stride = int64_t(p.batch) * p.heads;
  const int64_t bh = int64_t(blockIdx.x) * (blockDim.x / 128) + threadIdx.x / 128;
  const int c = threadIdx.x % 128;
  wait_for_grid_dependencies();  // the partials of the decode kernel launched before
  if (bh >= stride) return;
  float lse[kFewSplits];
  float4 v[kFewSplits];
#pragma unroll
  for (int s = 0; s < kFewSplits; ++s) {
    if (s >= p.num_splits) break;
    lse[s] = p.partial_lse[s * stride + bh];
    v[s] = *reinterpret_cast<const float4*>(p.partial_o + (s * stride + bh) * kMlaDimCkv + c * 4);
  }
  float mx = -INFINITY;
#pragma unroll
  for (int s = 0; s < kFewSplits; ++s)
    if (s < p.num_splits) mx = fmaxf(mx, lse[s]);
  const float m_use = mx == -INFINITY ? 0.f : mx;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
#pragma unroll
  for (int s = 0; s < kFewSplits; ++s) {
    if (s >= p.num_splits) break;
    const float w = exp2f(lse[s] - m_use);  // an empty split: lse -inf, w 0, its partial 0
    wsum += w;
    acc.x += w * v[s].x, acc.y += w * v[s].y, acc.z += w * v[s].z, acc.w += w * v[s].w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* out = static_cast<T*>(p.out) + bh * kMlaDimCkv + c * 4;
  *reinterpret_cast<uint32_t*>(out) = pack2<T>(acc.x * inv, acc.y * inv);
  *reinterpret_cast<uint32_t*>(out + 2) = pack2<T>(acc.z * inv, acc.w * inv);
  if (p.lse != nullptr && c == 0) p.lse[bh] = wsum > 0.f ? (m_use + log2f(wsum)) * kLn2 : -INFINITY;
}

}  // namespace

void mla_combine(const MlaDecodeParams& p, cudaStream_t stream, bool programmatic) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  const int heads = p.batch * p.heads;
  const bool few = p.num_splits <= kFewSplits;
  cfg.gridDim = dim3(few ? (heads + kCombineRows - 1) / kCombineRows : heads);
  cfg.blockDim = dim3(128 * (few ? kCombineRows : std::clamp(p.num_splits / 8, 1, kCombineRows)));  // rows of >= 8 splits
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  const bool bf16 = p.dtype == kBF16;
  const auto kernel = few ? (bf16 ? mla_combine_few_kernel<__nv_bfloat16> : mla_combine_few_kernel<__half>)
                          : (bf16 ? mla_combine_kernel<__nv_bfloat16> : mla_combine_kernel<__half>);
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, p), "mla_decode", "combine launch");
}

void mla_combine_prewarm() {
  cudaFuncAttributes attr;
  for (const auto kernel : {mla_combine_kernel<__nv_bfloat16>, mla_combine_kernel<__half>})
    check_cuda(cudaFuncGetAttributes(&attr, kernel), "mla_decode", "combine kernel");
  for (const auto kernel : {mla_combine_few_kernel<__nv_bfloat16>, mla_combine_few_kernel<__half>})
    check_cuda(cudaFuncGetAttributes(&attr, kernel), "mla_decode", "combine kernel");
}

}  // namespace hmoe
