// mla_rope_append's CUDA kernel: per request, one block normalises the latent, ropes k_pe and appends
// both to the paged cache, and blocks of kHeads heads each rope q's rope part into q_pe_out.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/cuda_util.h"
#include "hmoe/dtype.h"
#include "mla/mla_rope_append.h"

namespace hmoe {
namespace {

constexpr int kThreads = 128;  // 4 warps; the latent's 512 values are 4 a thread
constexpr int kHeads = 8;      // heads a q block ropes: 8 x 32 pairs, 2 a thread
constexpr int kPairs = kMlaDimPe / 2;
static_assert(kMlaDimCkv == 4 * kThreads, "the latent is read 4 values a thread");

// Input and output positions of rotary pair i (include/hmoe/mla_rope_append.h).
struct Pair {
  int a, b, o1, o2;
};
__device__ __forceinline__ Pair pair_of(int layout, int i) {
  const bool in_interleaved = layout != kRopeHalf, out_interleaved = layout == kRopeInterleaved;
  const int a = in_interleaved ? 2 * i : i, b = in_interleaved ? 2 * i + 1 : i + kPairs;
  return {a, b, out_interleaved ? 2 * i : i, out_interleaved ? 2 * i + 1 : i + kPairs};
}

// Ropes pair i of the 64 values at x into out (both T), with the row's cos/sin (C).
template <typename T, typename C>
__device__ __forceinline__ void rope_pair(const T* x, T* out, const C* cos, const C* sin, int layout, int i) {
  const Pair p = pair_of(layout, i);
  const float xa = to_float(x[p.a]), xb = to_float(x[p.b]);
  out[p.o1] = from_float<T>(xa * to_float(cos[p.o1]) - xb * to_float(sin[p.o1]));
  out[p.o2] = from_float<T>(xb * to_float(cos[p.o2]) + xa * to_float(sin[p.o2]));
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) mla_rope_append_kernel(MlaRopeAppendParams p) {
  const int b = blockIdx.x, t = threadIdx.x;
  const int64_t cos_row = p.cos_rows == 1 ? 0 : b;
  const C* cos = static_cast<const C*>(p.cos) + cos_row * kMlaDimPe;
  const C* sin = static_cast<const C*>(p.sin) + cos_row * kMlaDimPe;
  if (blockIdx.y > 0) {  // q's rope part, kHeads heads
    for (int j = t; j < kHeads * kPairs; j += kThreads) {
      const int h = (blockIdx.y - 1) * kHeads + j / kPairs;
      if (h >= p.heads) break;
      const int64_t bh = int64_t(b) * p.heads + h;
      const T* q = static_cast<const T*>(p.q) + bh * p.q_dim + (p.q_dim - kMlaDimPe);
      rope_pair(q, static_cast<T*>(p.q_pe_out) + bh * kMlaDimPe, cos, sin, p.layout, j % kPairs);
    }
    return;
  }
  // The token's cache row: none (nothing written) for a length or page outside the cache.
  const int32_t L = p.seq_lens[b];
  int64_t row = -1;
  if (L >= 1 && int64_t(L) <= int64_t(p.max_pages) * p.page_size) {
    const int32_t pos = L - 1;
    const int32_t page = p.page_table[int64_t(b) * p.max_pages + pos / p.page_size];
    if (page >= 0 && page < p.num_pages) row = int64_t(page) * p.page_size + pos % p.page_size;
  }
  const T* kv = static_cast<const T*>(p.kv) + int64_t(b) * (kMlaDimCkv + kMlaDimPe);
  // RMSNorm of the latent: fp32 mean of squares over the block, x * rsqrt rounded, times the weight rounded.
  float x[4], ss = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[e] = to_float(kv[4 * t + e]);
    ss += x[e] * x[e];
  }
  __shared__ float warp_ss[kThreads / 32];
  ss = warp_sum(ss);
  if (t % 32 == 0) warp_ss[t / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += warp_ss[w];
  const float inv = rsqrtf(total / float(kMlaDimCkv) + p.eps);
  if (row >= 0) {
    const T* weight = static_cast<const T*>(p.norm_weight);
    T* dst = static_cast<T*>(p.ckv) + row * kMlaDimCkv;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float n = to_float(from_float<T>(x[e] * inv));
      dst[4 * t + e] = from_float<T>(to_float(weight[4 * t + e]) * n);
    }
    if (t < kPairs) rope_pair(kv + kMlaDimCkv, static_cast<T*>(p.kpe) + row * kMlaDimPe, cos, sin, p.layout, t);
  }
}

using KernelFn = void (*)(MlaRopeAppendParams);

template <typename T>
KernelFn kernel_for_cos(int32_t cos_dtype) {
  switch (cos_dtype) {
    case kF16:
      return mla_rope_append_kernel<T, __half>;
    case kBF16:
      return mla_rope_append_kernel<T, __nv_bfloat16>;
    default:
      return mla_rope_append_kernel<T, float>;
  }
}

KernelFn kernel_for(int32_t dtype, int32_t cos_dtype) {
  return dtype == kF16 ? kernel_for_cos<__half>(cos_dtype) : kernel_for_cos<__nv_bfloat16>(cos_dtype);
}

const char* check(const MlaRopeAppendParams& p) {
  if (p.dtype != kBF16 && p.dtype != kF16) return "dtype is not bfloat16/float16";
  if (!is_float_dtype(p.cos_dtype)) return "cos_dtype is not float32/float16/bfloat16";
  if (p.layout != kRopeInterleaved && p.layout != kRopeHalf && p.layout != kRopeInterleavedToHalf)
    return "unknown rope layout";
  if (p.batch < 0 || p.heads < 1 || p.heads > kMlaMaxHeads || p.q_dim < kMlaDimPe) return "shape out of range";
  if (p.cos_rows != 1 && p.cos_rows != p.batch) return "cos_rows is neither 1 nor batch";
  if (p.page_size < 1 || p.max_pages < 1 || p.num_pages < 1) return "empty cache or page table";
  return nullptr;
}

}  // namespace

void mla_rope_append_cuda(const MlaRopeAppendParams& p, int device, uintptr_t stream) {
  if (const char* why = check(p)) throw std::invalid_argument(std::string("mla_rope_append: ") + why);
  if (p.batch == 0) return;  // a zero-sized grid is a launch error
  const DeviceGuard guard(device, "mla_rope_append");
  const dim3 grid(unsigned(p.batch), 1 + unsigned((p.heads + kHeads - 1) / kHeads));
  kernel_for(p.dtype, p.cos_dtype)<<<grid, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "mla_rope_append", "kernel launch");
}

void mla_rope_append_prewarm(int device) {
  const DeviceGuard guard(device, "mla_rope_append");
  cudaFuncAttributes attr;
  for (int32_t dtype : {kF16, kBF16})
    for (int32_t cos_dtype : {kF32, kF16, kBF16})
      check_cuda(cudaFuncGetAttributes(&attr, kernel_for(dtype, cos_dtype)), "mla_rope_append", "loading the kernel");
}

}  // namespace hmoe
