// Host and device helpers shared by the CUDA kernels of cuda_ops.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace hmoe {

// Throws std::runtime_error("<op>: <what> failed: <name>: <description>") on a CUDA error.
inline void check_cuda(cudaError_t err, const char* op, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(op) + ": " + what + " failed: " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
}

// A device attribute (cudaDeviceGetAttribute); `op` names the caller in errors.
inline int device_attribute(int device, cudaDeviceAttr attr, const char* op) {
  int v = 0;
  check_cuda(cudaDeviceGetAttribute(&v, attr, device), op, "device attribute");
  return v;
}

// Makes `device` current for the duration of a call and restores the caller's device (also when
// the call throws), so that torch's notion of the current device is left as it was.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* op) {
    check_cuda(cudaGetDevice(&prev_), op, "cudaGetDevice");
    if (prev_ != device) check_cuda(cudaSetDevice(device), op, "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// Whether every pointer is 16-byte aligned (the kernels' vector loads and stores need it); the
// launchers' own check, beside the binding's bind::aligned16, which refuses tensors by name.
inline bool pointers_aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* ptr : ptrs)
    if (reinterpret_cast<uintptr_t>(ptr) % 16) return false;
  return true;
}

#ifdef __CUDACC__
// Two floats as a pair of T (__nv_bfloat16 or __half, round to nearest) in one 32-bit word, the
// first in the low half: how kernels store 16-bit outputs two at a time.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// A 16-bit (or fp32) value as a float: exact.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// One conversion instruction for the pair (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // .x (a) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A 16-byte global store (the compiler splits uint4 stores through T* into four).
__device__ __forceinline__ void st_global16(void* dst, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Butterfly reductions over the lanes `width` apart at most (width a power of two <= 32): every
// lane of a group of `width` ends with the group's result.
template <int width = 32>
__device__ __forceinline__ float warp_max(float v) {
  for (int off = width / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
template <int width = 32>
__device__ __forceinline__ float warp_sum(float v) {
  for (int off = width / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
#endif

}  // namespace hmoe
