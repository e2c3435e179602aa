// Tuning harness for the portable MLA decode kernel (not part of the wheel): times
// mla_decode_portable for each configuration and shape with CUDA events (L2 flushed by reading
// 256 MiB before each call) and checks the first two requests against a naive fp32 kernel.
// It needs no Python or wheel build, so kernel variants can be compiled anywhere and carried:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -Icpp -Icuda \
//     cuda/mla/tune_harness.cu cuda/mla/mla_decode_portable.cu cuda/mla/mla_combine.cu -o mla_tune
//   ./mla_tune [CONFIGS [SHAPES]]   e.g. ./mla_tune auto,0,1 64x4096x16,64x4096x128
// CONFIGS: "auto" or indices into kConfigs (set as HMOE_MLA_CONFIG). Environment:
// HARNESS_SPLITS=n forces the split count, HARNESS_REPS=n the timed calls (25), HARNESS_PAGE=n
// the page size (64; S must be a multiple),
// HARNESS_WFLUSH=1 flushes L2 by writing instead (leaves dirty lines: see cuda/mla/NOTES.md).
// HMOE_MLA_TMA=0 makes the kernel load with cp.async where it would use the TMA (sm_90+).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "mla/mla_decode.h"
#include "common/dtype.h"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void fill_rand(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = __float2bfloat16((int(x & 0xffff) - 32768) / 16384.f);
  }
}

__global__ void read_flush(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) { uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (acc == 0x12345678u) *sink = acc;
}

// naive reference: one block per (b, h), fp32
__global__ void ref_kernel(hmoe::MlaDecodeParams p, float* out) {
  const int b = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  extern __shared__ float sc[];
  const __nv_bfloat16* qn = (const __nv_bfloat16*)p.q_nope + (size_t(b) * p.heads + h) * 512;
  const __nv_bfloat16* qp = (const __nv_bfloat16*)p.q_pe + (size_t(b) * p.heads + h) * 64;
  const __nv_bfloat16* ckv = (const __nv_bfloat16*)p.ckv;
  const __nv_bfloat16* kpe = (const __nv_bfloat16*)p.kpe;
  const int len = p.seq_lens[b];
  for (int t = threadIdx.x; t < len; t += blockDim.x) {
    const size_t slot = size_t(p.page_table[b * p.max_pages + t / p.page_size]) * p.page_size + t % p.page_size;
    float acc = 0.f;
    for (int d = 0; d < 512; ++d) acc += __bfloat162float(qn[d]) * __bfloat162float(ckv[slot * 512 + d]);
    for (int d = 0; d < 64; ++d) acc += __bfloat162float(qp[d]) * __bfloat162float(kpe[slot * 64 + d]);
    sc[t] = acc * p.sm_scale;
  }
  __syncthreads();
  __shared__ float red[2];
  if (threadIdx.x == 0) {
    float m = -INFINITY; for (int t = 0; t < len; ++t) m = fmaxf(m, sc[t]);
    float l = 0; for (int t = 0; t < len; ++t) l += expf(sc[t] - m);
    red[0] = m; red[1] = l;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < 512; d += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < len; ++t) {
      const size_t slot = size_t(p.page_table[b * p.max_pages + t / p.page_size]) * p.page_size + t % p.page_size;
      acc += expf(sc[t] - red[0]) * __bfloat162float(ckv[slot * 512 + d]);
    }
    out[(size_t(b) * p.heads + h) * 512 + d] = acc / red[1];
  }
}

int main(int argc, char** argv) {
  int shapes[][3] = {{64, 4096, 16}, {64, 4096, 128}, {128, 8192, 16}, {1, 32768, 128}, {32, 2048, 128}, {256, 1024, 16}, {256, 512, 16}, {256, 2048, 16}, {256, 4096, 16}, {132, 4096, 16}, {264, 4096, 16}};
  const int page = getenv("HARNESS_PAGE") ? atoi(getenv("HARNESS_PAGE")) : 64;
  const char* cfgs = argc > 1 ? argv[1] : "auto";
  void* flush; CK(cudaMalloc(&flush, 256 << 20));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // copy bandwidth
  {
    void *a, *b; size_t n = size_t(1) << 30; CK(cudaMalloc(&a, n)); CK(cudaMalloc(&b, n));
    std::vector<float> ts;
    for (int i = 0; i < 12; ++i) { cudaEventRecord(e0); CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice)); cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms); }
    std::sort(ts.begin(), ts.end());
    printf("copy %.0f GB/s\n", 2.0 * n / ts[6] / 1e6);
    cudaFree(a); cudaFree(b);
  }
  const std::string only = argc > 2 ? "," + std::string(argv[2]) + "," : "";  // shapes to run, or all
  for (auto& s : shapes) {
    const int B = s[0], S = s[1], H = s[2];
    char nm[64]; snprintf(nm, sizeof nm, "%dx%dx%d", B, S, H);
    if (!only.empty() && only.find("," + std::string(nm) + ",") == std::string::npos) continue;
    const int per = S / page, P = B * per;
    __nv_bfloat16 *ckv, *kpe, *qn, *qp, *out; float *lse, *ref;
    int *pt, *lens;
    CK(cudaMalloc(&ckv, size_t(P) * page * 512 * 2)); CK(cudaMalloc(&kpe, size_t(P) * page * 64 * 2));
    CK(cudaMalloc(&qn, size_t(B) * H * 512 * 2)); CK(cudaMalloc(&qp, size_t(B) * H * 64 * 2));
    CK(cudaMalloc(&out, size_t(B) * H * 512 * 2)); CK(cudaMalloc(&lse, size_t(B) * H * 4));
    CK(cudaMalloc(&ref, size_t(B) * H * 512 * 4));
    CK(cudaMalloc(&pt, size_t(P) * 4)); CK(cudaMalloc(&lens, B * 4));
    fill_rand<<<1024, 256>>>(ckv, size_t(P) * page * 512, 1); fill_rand<<<1024, 256>>>(kpe, size_t(P) * page * 64, 2);
    fill_rand<<<1024, 256>>>(qn, size_t(B) * H * 512, 3); fill_rand<<<1024, 256>>>(qp, size_t(B) * H * 64, 4);
    std::vector<int> perm(P); for (int i = 0; i < P; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), std::mt19937(B + S + H));
    CK(cudaMemcpy(pt, perm.data(), P * 4, cudaMemcpyHostToDevice));
    std::vector<int> hl(B, S); CK(cudaMemcpy(lens, hl.data(), B * 4, cudaMemcpyHostToDevice));
    hmoe::MlaDecodeParams p{};
    p.q_nope = qn; p.q_pe = qp; p.ckv = ckv; p.kpe = kpe; p.page_table = pt; p.seq_lens = lens; p.out = out; p.lse = lse;
    p.batch = B; p.heads = H; p.page_size = page; p.max_pages = per; p.num_pages = P; p.dtype = hmoe::kBF16;
    p.sm_scale = 0.0721f;
    const int nref = std::min(B, 2);
    {
      hmoe::MlaDecodeParams pr = p; pr.batch = nref;
      CK(cudaFuncSetAttribute(ref_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S * 4));
      ref_kernel<<<nref * H, 256, S * 4>>>(pr, ref);
      CK(cudaGetLastError());
    }
    std::vector<float> href(size_t(nref) * H * 512);
    CK(cudaMemcpy(href.data(), ref, href.size() * 4, cudaMemcpyDeviceToHost));
    std::string list = cfgs;
    size_t pos = 0;
    while (pos <= list.size()) {
      size_t e = list.find(',', pos); if (e == std::string::npos) e = list.size();
      std::string c = list.substr(pos, e - pos); pos = e + 1;
      if (c == "auto") unsetenv("HMOE_MLA_CONFIG"); else setenv("HMOE_MLA_CONFIG", c.c_str(), 1);
      hmoe::mla_decode_prewarm(0);
      hmoe::MlaConfig cfg;
      try { cfg = hmoe::mla_decode_config(0, H); } catch (std::exception& ex) { printf("cfg %s: %s\n", c.c_str(), ex.what()); continue; }
      p.num_splits = getenv("HARNESS_SPLITS") ? atoi(getenv("HARNESS_SPLITS")) : hmoe::mla_decode_num_splits(0, B, H, per, page);
      float *po = nullptr, *pl = nullptr;
      if (p.num_splits > 1) { CK(cudaMalloc(&po, size_t(p.num_splits) * B * H * 512 * 4)); CK(cudaMalloc(&pl, size_t(p.num_splits) * B * H * 4)); }
      p.partial_o = po; p.partial_lse = pl;
      CK(cudaMemset(out, 0xff, size_t(B) * H * 512 * 2));
      hmoe::mla_decode_portable(p, 0, 0);
      CK(cudaDeviceSynchronize());
      std::vector<__nv_bfloat16> ho(size_t(nref) * H * 512);
      CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
      double num = 0, den = 0; bool nan = false;
      for (size_t i = 0; i < ho.size(); ++i) { float v = __bfloat162float(ho[i]); if (!std::isfinite(v)) nan = true; num += (v - href[i]) * (v - href[i]); den += href[i] * href[i]; }
      std::vector<float> ts;
      const int reps = getenv("HARNESS_REPS") ? atoi(getenv("HARNESS_REPS")) : 25;
      for (int i = 0; i < reps; ++i) {
        if (getenv("HARNESS_WFLUSH")) CK(cudaMemsetAsync(flush, i, 256 << 20)); else read_flush<<<1056, 512>>>((const uint4*)flush, (256 << 20) / 16, (unsigned*)flush);
        cudaEventRecord(e0); hmoe::mla_decode_portable(p, 0, 0); cudaEventRecord(e1); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1); if (i >= reps / 5) ts.push_back(ms);
      }
      std::sort(ts.begin(), ts.end());
      const double t = ts[ts.size() / 2] * 1e-3;
      const double bytes = double(B) * S * 576 * 2, fl = 2.0 * B * H * S * 1088;
      printf("cfg %-4s %4dx%5dx%3d heads/cta %3d tile %2d smem %6d splits %2d: %8.1f us %6.0f GB/s %6.1f TFLOP/s err %.2e%s\n",
             c.c_str(), B, S, H, cfg.heads_per_cta, cfg.tile_tokens, cfg.smem_bytes, p.num_splits, t * 1e6, bytes / t / 1e9, fl / t / 1e12,
             std::sqrt(num / den), nan ? " NAN" : "");
      if (po) { cudaFree(po); cudaFree(pl); }
    }
    cudaFree(ckv); cudaFree(kpe); cudaFree(qn); cudaFree(qp); cudaFree(out); cudaFree(lse); cudaFree(ref); cudaFree(pt); cudaFree(lens);
  }
  return 0;
}
