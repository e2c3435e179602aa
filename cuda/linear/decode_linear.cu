// decode_linear's CUDA kernel: one warp per output column n reads weight row n once (16-byte
// streaming loads, no L1 allocation) and dots it with each of the call's few x rows (cached reads);
// fp32 sums, a warp reduction, one rounding. Memory-bound: every SM gets warps even for small n.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/cuda_util.h"
#include "hmoe/dtype.h"
#include "linear/decode_linear.h"

namespace hmoe {
namespace {

constexpr int kWarps = 8;  // output columns a block computes
constexpr int kBatch = 8;  // 16-byte weight loads a lane has in flight

// Not volatile: independent loads of read-only data that the compiler may issue back to back.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Eight 16-bit values of a 16-byte chunk as floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = h.x, f[2 * i + 1] = h.y;
    }
  }
}

template <typename T, typename O, int M>
__global__ void __launch_bounds__(kWarps * 32) decode_linear_kernel(DecodeLinearParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t n = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (n >= p.n) return;
  const int chunks = p.k / 8;
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(p.weight) + n * p.k);
  const uint4* x = static_cast<const uint4*>(p.x);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  // kBatch chunks of the row in flight per lane before any is used (a 4 KB row at once for k = 2048).
  for (int c0 = lane; c0 < chunks; c0 += 32 * kBatch) {
    uint4 wv[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) wv[u] = c0 + 32 * u < chunks ? ld_stream(w + c0 + 32 * u) : uint4{0, 0, 0, 0};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = c0 + 32 * u;
      if (c >= chunks) break;
      float wf[8];
      unpack8<T>(wv[u], wf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (m < p.m) {
          float xf[8];
          unpack8<T>(__ldg(x + int64_t(m) * chunks + c), xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m] = fmaf(wf[e], xf[e], acc[m]);
        }
      }
    }
  }
  O* y = static_cast<O*>(p.y);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m < p.m) {
      const float s = warp_sum(acc[m]);
      if (lane == 0) {
        if constexpr (std::is_same_v<O, float>)
          y[int64_t(m) * p.n + n] = s;
        else
          y[int64_t(m) * p.n + n] = from_float<O>(s);
      }
    }
  }
}

using KernelFn = void (*)(DecodeLinearParams);

template <typename T, typename O>
KernelFn kernel_for_rows(int m) {
  if (m <= 1) return decode_linear_kernel<T, O, 1>;
  if (m <= 2) return decode_linear_kernel<T, O, 2>;
  if (m <= 4) return decode_linear_kernel<T, O, 4>;
  if (m <= 8) return decode_linear_kernel<T, O, 8>;
  return decode_linear_kernel<T, O, kDecodeLinearMaxRows>;
}

template <typename T>
KernelFn kernel_for_out(int32_t out_dtype, int m) {
  return out_dtype == kF32 ? kernel_for_rows<T, float>(m) : kernel_for_rows<T, T>(m);
}

KernelFn kernel_for(int32_t dtype, int32_t out_dtype, int m) {
  return dtype == kF16 ? kernel_for_out<__half>(out_dtype, m) : kernel_for_out<__nv_bfloat16>(out_dtype, m);
}

const char* check(const DecodeLinearParams& p) {
  if (p.dtype != kBF16 && p.dtype != kF16) return "dtype is not bfloat16/float16";
  if (p.out_dtype != p.dtype && p.out_dtype != kF32) return "out_dtype is neither dtype nor float32";
  if (p.m < 0 || p.m > kDecodeLinearMaxRows) return "m out of range";
  if (p.n < 1 || p.k < 8 || p.k % 8) return "n < 1, or k not a positive multiple of 8";
  if (!pointers_aligned16({p.x, p.weight, p.y})) return "a pointer is not 16-byte aligned";
  return nullptr;
}

}  // namespace

void decode_linear_cuda(const DecodeLinearParams& p, int device, uintptr_t stream) {
  if (const char* why = check(p)) throw std::invalid_argument(std::string("decode_linear: ") + why);
  if (p.m == 0) return;  // nothing to compute (a zero-sized grid is a launch error)
  const DeviceGuard guard(device, "decode_linear");
  const unsigned blocks = unsigned((int64_t(p.n) + kWarps - 1) / kWarps);
  kernel_for(p.dtype, p.out_dtype, p.m)<<<blocks, kWarps * 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "decode_linear", "kernel launch");
}

void decode_linear_prewarm(int device) {
  const DeviceGuard guard(device, "decode_linear");
  cudaFuncAttributes attr;
  for (int32_t dtype : {kF16, kBF16})
    for (int32_t out : {dtype, int32_t(kF32)})
      for (int m : {1, 2, 4, 8, kDecodeLinearMaxRows})
        check_cuda(cudaFuncGetAttributes(&attr, kernel_for(dtype, out, m)), "decode_linear", "loading the kernel");
}

}  // namespace hmoe
