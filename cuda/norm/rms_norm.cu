// rms_norm's CUDA kernel: one block per row, 16-byte loads kept in registers between the sum of
// squares (warp shuffles, then the block's warps through shared memory) and the scaled store.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/cuda_util.h"
#include "hmoe/constants.h"
#include "hmoe/dtype.h"
#include "norm/rms_norm.h"

namespace hmoe {
namespace {

constexpr int kThreads = 256;
constexpr int kChunks = 4;  // 16-byte chunks a thread holds: rows up to 256 * 4 * 8 = 8192 values
constexpr int kMaxDim = kThreads * kChunks * 8;
static_assert(kMaxDim == k::rms_norm_max_dim, "constants.h says how long a row may be");

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(RmsNormParams p) {
  const int t = threadIdx.x, chunks = p.dim / 8;
  const uint4* x = static_cast<const uint4*>(p.x) + int64_t(blockIdx.x) * chunks;
  const uint4* w = static_cast<const uint4*>(p.weight);
  uint4 v[kChunks];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = t + i * kThreads;
    v[i] = c < chunks ? x[c] : uint4{0, 0, 0, 0};
    const T* e = reinterpret_cast<const T*>(&v[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += to_float(e[j]) * to_float(e[j]);
  }
  __shared__ float warp_ss[kThreads / 32];
  ss = warp_sum(ss);
  if (t % 32 == 0) warp_ss[t / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) total += warp_ss[i];
  const float inv = rsqrtf(total / float(p.dim) + p.eps);
  uint4* y = static_cast<uint4*>(p.y) + int64_t(blockIdx.x) * chunks;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = t + i * kThreads;
    if (c >= chunks) break;
    const uint4 wv = w[c];
    const T *e = reinterpret_cast<const T*>(&v[i]), *we = reinterpret_cast<const T*>(&wv);
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = from_float<T>(to_float(we[j]) * to_float(from_float<T>(to_float(e[j]) * inv)));
    y[c] = out;
  }
}

using KernelFn = void (*)(RmsNormParams);

KernelFn kernel_for(int32_t dtype) { return dtype == kF16 ? rms_norm_kernel<__half> : rms_norm_kernel<__nv_bfloat16>; }

const char* check(const RmsNormParams& p) {
  if (p.dtype != kBF16 && p.dtype != kF16) return "dtype is not bfloat16/float16";
  if (p.rows < 0 || p.rows > INT32_MAX) return "rows out of range";
  if (p.dim < 8 || p.dim % 8 || p.dim > kMaxDim) return "dim not a multiple of 8 in [8, 8192]";
  if (!(p.eps >= 0.f)) return "eps < 0";
  if (!pointers_aligned16({p.x, p.weight, p.y})) return "a pointer is not 16-byte aligned";
  return nullptr;
}

}  // namespace

void rms_norm_cuda(const RmsNormParams& p, int device, uintptr_t stream) {
  if (const char* why = check(p)) throw std::invalid_argument(std::string("rms_norm: ") + why);
  if (p.rows == 0) return;  // a zero-sized grid is a launch error
  const DeviceGuard guard(device, "rms_norm");
  kernel_for(p.dtype)<<<unsigned(p.rows), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "rms_norm", "kernel launch");
}

void rms_norm_prewarm(int device) {
  const DeviceGuard guard(device, "rms_norm");
  cudaFuncAttributes attr;
  for (int32_t dtype : {kF16, kBF16})
    check_cuda(cudaFuncGetAttributes(&attr, kernel_for(dtype)), "rms_norm", "loading the kernel");
}

}  // namespace hmoe
