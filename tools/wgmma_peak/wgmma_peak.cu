// Ceilings of Hopper's wgmma for the instruction mix of the sm90a MLA decode kernel
// (cuda/mla/mla_decode_sm90a.cu), per SM and clock cycle: one CTA an SM, two warpgroups, operands in
// shared memory (random bf16) laid out as the kernel's are, each warpgroup issuing a mode's group of
// wgmma and waiting for it, `iters` times. Cycles come from each CTA's clock64 (first start to last
// end), so the rates do not depend on the clock the GPU ran at; the wall time (CUDA events) gives
// that clock. Dense bf16 on Hopper is 4096 FLOP a cycle an SM.
//   modes  0  S's wgmma, A (Q) and B (K) from shared memory: m64n32k16, 36 a group
//          1  S's wgmma, A from registers: m64n32k16, 36 a group
//          2  P V's wgmma, A (P) from shared memory, B (V) N-major: m64n256k16, 4 a group
//          3  one 32-token tile of the kernel per warpgroup: S as the kernel issues it (24 k-steps
//             with A from shared memory, 12 from registers), then P V of two tiles (4 m64n256k16)
//          4  the same with every third k-step of S from registers instead of the last twelve
//   build: nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icuda tools/wgmma_peak/wgmma_peak.cu \
//            -o /tmp/wgmma_peak
//   run:   /tmp/wgmma_peak [ITERS]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "attention/mma.cuh"
#include "attention/wgmma.cuh"

using namespace hmoe::attn;
using namespace hmoe::attn::sm90;
using T = __nv_bfloat16;

constexpr int kSmem = 220 * 1024;       // Q (72 KB) and a ring of four 36 KB tiles, as the kernel
constexpr int kQ = 0, kKv = 72 * 1024;  // 64-column blocks of 8 KB (Q) and 4 KB (a tile's 32 rows)

__host__ __device__ constexpr double flops_per_group(int mode) {
  return mode == 0 || mode == 1 ? 36.0 * 2 * 64 * 32 * 16
         : mode == 2            ? 4.0 * 2 * 64 * 256 * 16
                                : 36.0 * 2 * 64 * 32 * 16 + 4.0 * 2 * 64 * 256 * 16;
}

template <int MODE>
__global__ void __launch_bounds__(256, 1) peak(const uint4* init, int iters, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem = smem_addr(smem_raw);
  for (int i = threadIdx.x; i < kSmem / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem_raw)[i] = init[i];
  fence_async_smem();
  __syncthreads();
  const int wg = threadIdx.x / 128, warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  uint32_t qa[12][4];  // A fragments for the register k-steps
#pragma unroll
  for (int k = 0; k < 12; ++k)
    ldmatrix_x4(qa[k],
                smem + kQ + (6 + k / 4) * 8192 + swizzled(warp * 16 + lane % 16, (k % 4) * 16 + 8 * (lane / 16)));
  float s[16], o[128];
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const uint64_t q_desc = k_major(smem + kQ);
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    const uint32_t buf = smem + kKv + ((it + wg) % 4) * 36864;
    const uint64_t k_desc = k_major(buf);
    wgmma_fence();
    if (MODE != 2) {
#pragma unroll
      for (int step = 0; step < 36; ++step) {
        const uint64_t kd = desc_add(k_desc, (step / 4) * 4096 + (step % 4) * 32);
        if (MODE == 1 || (MODE == 3 && step >= 24) || (MODE == 4 && step % 3 == 2))
          wgmma<WgmmaRs64x32<0>, T>(s, qa[step % 12], kd, 1);
        else
          wgmma<Wgmma64x32<0>, T>(s, desc_add(q_desc, (step / 4) * 8192 + (step % 4) * 32), kd, 1);
      }
    }
    if (MODE >= 2) {
      const uint64_t p_desc = k_major64(buf + 8 * 4096), v_desc = n_major(buf + 4 * wg * 4096, 4096);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma<Wgmma64x256<1>, T>(o, desc_add(p_desc, (kk % 2) * 32), desc_add(v_desc, (kk % 2) * 16 * 128), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<16>(s);
    fence_regs<128>(o);
  }
  const long long t1 = clock64();
  __syncthreads();
  if (threadIdx.x % 128 == 0) {
    cycles[2 * (blockIdx.x * 2 + wg)] = t0;
    cycles[2 * (blockIdx.x * 2 + wg) + 1] = t1;
  }
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) acc += s[i];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc += o[i];
  if (acc == 12345.f) sink[threadIdx.x] = acc;  // keeps the products
}

template <int MODE>
void run(int sms, int iters, const uint4* init, long long* d_cycles, float* sink) {
  auto k = peak<MODE>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  k<<<sms, 256, kSmem>>>(init, 4, d_cycles, sink);  // warm-up
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaEventRecord(a);
  k<<<sms, 256, kSmem>>>(init, iters, d_cycles, sink);
  cudaEventRecord(b);
  if (cudaEventSynchronize(b) != cudaSuccess) {
    std::printf("mode %d: %s\n", MODE, cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  std::vector<long long> c(4 * sms);
  cudaMemcpy(c.data(), d_cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  double cyc = 0;  // mean over CTAs of (last end - first start)
  for (int i = 0; i < sms; ++i) {
    const long long t0 = std::min(c[4 * i], c[4 * i + 2]), t1 = std::max(c[4 * i + 1], c[4 * i + 3]);
    cyc += double(t1 - t0) / sms;
  }
  const double flop_cta = 2.0 * iters * flops_per_group(MODE);
  const char* what[] = {"S, A and B from smem (m64n32k16)", "S, A from registers (m64n32k16)",
                        "P V, B N-major (m64n256k16)", "the seesaw's tile: S 24 smem + 12 reg, P V x2",
                        "the same, every third k-step of S from registers"};
  std::printf("mode %d  %-46s %6.0f FLOP/cycle/SM (%5.1f%% of 4096)  %7.1f TFLOP/s  clock %4.0f MHz\n", MODE,
              what[MODE], flop_cta / cyc, 100.0 * flop_cta / cyc / 4096, flop_cta * sms / (ms * 1e9), cyc / (ms * 1e3));
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20000;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::vector<uint16_t> host(kSmem / 2);
  uint32_t x = 12345;
  for (auto& h : host) {  // random bf16 in [-1, 1): the tensor cores' power depends on the data
    x = x * 1664525u + 1013904223u;
    const float f = float(int32_t(x) >> 8) / float(1 << 23);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    h = uint16_t(bits >> 16);
  }
  uint4* init;
  long long* cycles;
  float* sink;
  cudaMalloc(&init, kSmem), cudaMalloc(&cycles, 4 * sms * sizeof(long long)), cudaMalloc(&sink, 1024);
  cudaMemcpy(init, host.data(), kSmem, cudaMemcpyHostToDevice);
  run<0>(sms, iters, init, cycles, sink);
  run<1>(sms, iters, init, cycles, sink);
  run<2>(sms, iters, init, cycles, sink);
  run<3>(sms, iters, init, cycles, sink);
  run<4>(sms, iters, init, cycles, sink);
  return 0;
}
