// The read ceiling of a GPU's memory for the MLA decode's access pattern: every CTA streams cache
// bytes into a ring of shared-memory stages with TMA bulk copies (cp.async.bulk, one issuing thread,
// each stage on its own mbarrier), as the decode kernels fill their KV rings, and does nothing else.
//   partition  static: CTA b reads region b (the decode's splits: one request's tokens a CTA);
//              dynamic: CTAs take units of the buffer from a counter (a balanced schedule)
//   hold       ns a stage stays in use after it lands before it is refilled (the decode's products
//              and softmax of a tile); 0: refilled at once
// Sizes: the cache bytes of the bench's 16-head shapes (tokens x 1152 B: 576 bf16 columns). Each
// case is timed with CUDA events around one launch after an L2 flush that reads (a flush that
// writes leaves dirty lines whose write-backs land in the timed call), median of REPS; "floor" is
// an empty kernel timed the same way. The CTAs' end times (%globaltimer) show how unevenly a static
// partition finishes.
//   build: nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 -Icuda tools/read_peak/read_peak.cu \
//            -o /tmp/read_peak
//   run:   /tmp/read_peak [REPS]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "attention/mbarrier.cuh"
#include "common/cuda_util.h"

using namespace hmoe::attn::sm90;

// A CUDA error ends the tool with its name and description (cuda_util.h's check_cuda).
#define CHECK(x) hmoe::check_cuda((x), "read_peak", #x)

namespace {

constexpr int kMaxStages = 8;

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// `bytes` (a multiple of 16) from global `src` into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

struct Job {
  const char* base;
  size_t region, total, unit;  // bytes: a CTA's region (static), the buffer, a unit (dynamic)
  int dynamic, stages;
  uint32_t stage_bytes, hold_ns;
  unsigned* counter;
  uint64_t* ends;  // [grid] ns, from each CTA's end
  uint64_t* starts;
};

__global__ void read_kernel(const Job job) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  if (threadIdx.x != 0) return;
  job.starts[blockIdx.x] = global_ns();
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  for (int s = 0; s < job.stages; ++s) mbar_init(bar0 + 8 * s, 1);
  mbar_init_fence();
  size_t pos = 0, end = 0;
  bool more = true;
  if (!job.dynamic) pos = blockIdx.x * job.region, end = pos + job.region;
  unsigned issued = 0, landed = 0, sum = 0;
  auto issue = [&] {
    while (more && pos >= end) {  // the next unit (dynamic), or the region is done
      if (!job.dynamic) {
        more = false;
      } else {
        pos = size_t(atomicAdd(job.counter, 1u)) * job.unit;
        end = min(job.total, pos + job.unit);
        more = pos < job.total;
      }
    }
    if (!more) return;
    const uint32_t n = uint32_t(min(size_t(job.stage_bytes), end - pos));
    const uint32_t bar = bar0 + 8 * (issued % job.stages);
    mbar_expect_tx(bar, n);
    bulk_load(ring_s + (issued % job.stages) * job.stage_bytes, job.base + pos, n, bar);
    pos += n;
    ++issued;
  };
  for (int s = 0; s < job.stages; ++s) issue();
  while (landed < issued) {
    const int s = landed % job.stages;
    mbar_wait(bar0 + 8 * s, (landed / job.stages) & 1);
    sum += *reinterpret_cast<volatile unsigned*>(ring + size_t(s) * job.stage_bytes);
    for (const uint64_t t0 = global_ns(); job.hold_ns && global_ns() - t0 < job.hold_ns;) {
    }
    ++landed;
    issue();
  }
  job.ends[blockIdx.x] = global_ns() + (sum == 0x9e3779b9u);  // sum: keeps the reads
}

__global__ void flush_l2(const uint4* buf, size_t n, unsigned* sink) {
  unsigned x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x ^= buf[i].x;
  if (x == 0x9e3779b9u) *sink = x;
}

__global__ void empty_kernel() {}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t row = 576 * 2, big = size_t(256) * 4096 * row, flush_n = (size_t(256) << 20) / 16;
  char* buf;
  uint4* flush_buf;
  unsigned* counter;
  uint64_t *ends, *starts;
  CHECK(cudaMalloc(&buf, big));
  CHECK(cudaMemset(buf, 1, big));
  CHECK(cudaMalloc(&flush_buf, flush_n * 16));
  CHECK(cudaMemset(flush_buf, 0, flush_n * 16));
  CHECK(cudaMalloc(&counter, 8));
  CHECK(cudaMalloc(&ends, 8 * 8 * size_t(sms)));
  CHECK(cudaMalloc(&starts, 8 * 8 * size_t(sms)));
  CHECK(cudaFuncSetAttribute(read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  auto median_us = [&](auto launch) {
    std::vector<float> ms;
    for (int r = 0; r < reps + 2; ++r) {
      flush_l2<<<4 * sms, 512>>>(flush_buf, flush_n, counter + 1);
      CHECK(cudaMemsetAsync(counter, 0, 4));
      CHECK(cudaEventRecord(a));
      launch();
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      CHECK(cudaGetLastError());
      float t;
      CHECK(cudaEventElapsedTime(&t, a, b));
      if (r >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return 1e3 * ms[ms.size() / 2];
  };
  const double floor_us = median_us([] { empty_kernel<<<1, 32>>>(); });
  std::printf("%s, %d SMs; floor (an empty kernel, timed the same way): %.2f us; median of %d\n", prop.name, sms,
              floor_us, reps);
  std::printf("%-11s %-8s %5s %-18s %5s %9s %8s %15s   CTA ends, us from the first start: first p50 last\n", "bytes",
              "schedule", "hold", "ring", "grid", "us", "GB/s", "GB/s - floor");
  struct Case {
    int regions, tokens;
  };
  struct Config {
    int dynamic, stages, stage_kb, unit_kb, ctas_per_sm, hold_ns;
  };
  const Case cases[] = {{256, 1024}, {128, 4096}, {256, 4096}};
  const Config configs[] = {{0, 2, 36, 0, 0, 0},    {0, 3, 32, 0, 0, 0},    {0, 6, 16, 0, 0, 0},
                            {1, 4, 24, 288, 2, 0},  {1, 8, 24, 288, 1, 0},  {1, 3, 16, 144, 4, 0},
                            {0, 2, 36, 0, 0, 1000}, {0, 3, 36, 0, 0, 1000}, {0, 5, 18, 0, 0, 1000}};
  for (const Case& c : cases) {
    const size_t region = size_t(c.tokens) * row, total = region * c.regions;
    for (const Config& g : configs) {
      const int grid = g.dynamic ? g.ctas_per_sm * sms : c.regions;
      const Job job{buf,
                    region,
                    total,
                    size_t(g.unit_kb) << 10,
                    g.dynamic,
                    g.stages,
                    uint32_t(g.stage_kb) << 10,
                    uint32_t(g.hold_ns),
                    counter,
                    ends,
                    starts};
      const size_t smem = size_t(g.stages) * job.stage_bytes;
      const double us = median_us([&] { read_kernel<<<grid, 32, smem>>>(job); });
      std::vector<uint64_t> e(grid), s(grid);
      CHECK(cudaMemcpy(e.data(), ends, 8 * grid, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(s.data(), starts, 8 * grid, cudaMemcpyDeviceToHost));
      const uint64_t s0 = *std::min_element(s.begin(), s.end());
      std::vector<double> rel;
      for (uint64_t t : e) rel.push_back((t - s0) / 1e3);
      std::sort(rel.begin(), rel.end());
      char ring_text[32], bytes_text[24];
      std::snprintf(ring_text, sizeof ring_text, "%d x %d KB", g.stages, g.stage_kb);
      std::snprintf(bytes_text, sizeof bytes_text, "%.1f MB", total / 1e6);
      std::printf("%-11s %-8s %5d %-18s %5d %9.1f %8.0f %15.0f   %.1f %.1f %.1f\n", bytes_text,
                  g.dynamic ? "dynamic" : "static", g.hold_ns, ring_text, grid, us, total / us / 1e3,
                  total / (us - floor_us) / 1e3, rel.front(), rel[rel.size() / 2], rel.back());
    }
  }
  return 0;
}
