// Ceilings of mma.sync m16n8k16 (bf16 in, fp32 accumulators: the portable attention kernels'
// product) per SM and clock cycle, by the number of warps an SM holds and the independent
// accumulators each warp keeps in flight. One CTA an SM; an SM has four schedulers, so 4 warps is
// one warp a scheduler. Cycles come from each CTA's clock64 (its first warp's start to its last
// warp's end), so the rates do not depend on the clock the GPU ran at; the wall time (CUDA events)
// gives that clock.
//   register rows  each warp's A and B fragments in registers, ACC accumulators used in turn
//   S rows         the portable prefill kernel's S = Q K^T at 192 x 128 with 64-key tiles: per k16
//                  step 2 ldmatrix.x4 of Q (32 rows a warp) and 4 of K, 16 mma (a warp's 32 x 64)
//   build: nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -Icuda tools/mma_peak/mma_peak.cu \
//            -o /tmp/mma_peak
//   run:   /tmp/mma_peak [ITERS]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "attention/mma.cuh"

using namespace hmoe::attn;
using T = __nv_bfloat16;

constexpr int kQRow = 384, kSmem = 16 * 32 * kQRow + 64 * kQRow;  // 16 warps' Q rows and one K tile

template <int WARPS, int ACC, bool S_TILE>
__global__ void __launch_bounds__(32 * WARPS, 1) peak(int iters, long long* cycles, float* sink) {
  static_assert(!S_TILE || ACC == 16, "S of 32 x 64 keys: 16 accumulators");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ unsigned long long first_start, last_end;
  const uint32_t smem = smem_addr(smem_raw);
  if (threadIdx.x == 0) first_start = ~0ull, last_end = 0;
  for (int i = threadIdx.x; i < kSmem / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(smem_raw)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[ACC][4];
#pragma unroll
  for (int i = 0; i < ACC; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  uint32_t a[4], b[2];
  ldmatrix_x4(a, smem + lane * kQRow);
  b[0] = a[2] ^ lane, b[1] = a[3] ^ warp;
  const uint32_t q_lane = smem + (32 * warp + (lane & 15)) * kQRow;
  const uint32_t k_lane = smem + 16 * 32 * kQRow + ((lane & 7) + ((lane >> 4) << 3)) * kQRow;
  const int xq = (lane >> 4) ^ (lane & 7), xk = ((lane >> 3) & 1) ^ (lane & 7);
  __syncthreads();
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    if constexpr (S_TILE) {
#pragma unroll
      for (int ks = 0; ks < 12; ++ks) {
        const uint32_t col_q = ((ks >> 2) << 7) + ((((ks & 3) << 1) ^ xq) << 4);
        const uint32_t col_k = ((ks >> 2) << 7) + ((((ks & 3) << 1) ^ xk) << 4);
        uint32_t qa[2][4];
        ldmatrix_x4(qa[0], q_lane + col_q);
        ldmatrix_x4(qa[1], q_lane + 16 * kQRow + col_q);
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, k_lane + j * 8 * kQRow + col_k);
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma16816<T>(acc[mi * 8 + j], qa[mi], kb);
            mma16816<T>(acc[mi * 8 + j + 1], qa[mi], kb + 2);
          }
        }
      }
    } else {
#pragma unroll
      for (int rep = 0; rep < 192 / ACC; ++rep)
#pragma unroll
        for (int i = 0; i < ACC; ++i) mma16816<T>(acc[i], a, b);
    }
  }
  const long long t1 = clock64();
  if (lane == 0) atomicMin(&first_start, (unsigned long long)t0), atomicMax(&last_end, (unsigned long long)t1);
  __syncthreads();
  if (threadIdx.x == 0) cycles[2 * blockIdx.x] = first_start, cycles[2 * blockIdx.x + 1] = last_end;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < ACC; ++i) s += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the products
}

template <int WARPS, int ACC, bool S_TILE>
void run(int sms, int iters, long long* d_cycles, float* sink) {
  auto k = peak<WARPS, ACC, S_TILE>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  k<<<sms, 32 * WARPS, kSmem>>>(4, d_cycles, sink);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<sms, 32 * WARPS, kSmem>>>(iters, d_cycles, sink);
  cudaEventRecord(e1);
  if (cudaEventSynchronize(e1) != cudaSuccess) {
    std::printf("%s\n", cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  std::vector<long long> c(2 * sms);
  cudaMemcpy(c.data(), d_cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  double cyc = 0;
  for (int i = 0; i < sms; ++i) cyc += double(c[2 * i + 1] - c[2 * i]) / sms;
  const double flop_cta = double(iters) * 192 * 4096 * WARPS;  // 192 mma of 2 x 16 x 8 x 16 a warp an iteration
  std::printf(
      "%-8s %2d warps an SM (%d a scheduler), %2d accumulators a warp: %6.0f FLOP/cycle/SM  %6.1f TFLOP/s"
      "  clock %4.0f MHz\n",
      S_TILE ? "S rows" : "register", WARPS, WARPS / 4, ACC, flop_cta / cyc, flop_cta * sms / (ms * 1e9),
      cyc / (ms * 1e3));
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 4000;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* cycles;
  float* sink;
  cudaMalloc(&cycles, 2 * sms * sizeof(long long)), cudaMalloc(&sink, 4096);
  run<4, 4, false>(sms, iters, cycles, sink);
  run<4, 8, false>(sms, iters, cycles, sink);
  run<4, 16, false>(sms, iters, cycles, sink);
  run<8, 4, false>(sms, iters, cycles, sink);
  run<8, 8, false>(sms, iters, cycles, sink);
  run<8, 16, false>(sms, iters, cycles, sink);
  run<16, 8, false>(sms, iters, cycles, sink);
  run<4, 16, true>(sms, iters, cycles, sink);
  run<8, 16, true>(sms, iters, cycles, sink);
  run<16, 16, true>(sms, iters, cycles, sink);
  return 0;
}
