// Ceilings of the AMX tile unit, per thread: 2x2 tile steps (two A and two B tiles, four
// tdpbf16ps or tdpbssd) with (mode 0) no tile loads, (1) tile loads from 8 KB regions (L1), (2) A
// from a 512 KB region (L2) and B from 32 KB, (3) A and B from 512 KB regions; one thread pinned
// to each vCPU listed, all starting together (run a single vCPU, then pairs, to see which vCPUs
// slow each other down). Build: g++ -O2 -std=c++17 -march=sapphirerapids amx_peak.cpp -lpthread
//   amx_peak INT8(0|1) MODE CPU [CPU...]
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
struct alignas(64) Cfg {
  uint8_t palette, start;
  uint8_t res[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static void config() {
  Cfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}
template <bool kInt>
static double run(int mode, int64_t steps, char* a, int64_t abytes, char* b, int64_t bbytes) {
  config();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a + 1024, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 1024, 64);
  int64_t ao = 0, bo = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < steps; ++s) {
    if (mode) {
      _tile_loadd(4, a + ao, 64);
      _tile_loadd(5, a + ao + 1024, 64);
      _tile_loadd(6, b + bo, 64);
      _tile_loadd(7, b + bo + 1024, 64);
      ao += 2048;
      if (ao >= abytes) ao = 0;
      bo += 2048;
      if (bo >= bbytes) bo = 0;
    }
    if constexpr (kInt) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) static thread_local int32_t out[4][256];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  _tile_release();
  const double ops = double(steps) * 4 * 16 * 16 * (kInt ? 64 : 32) * 2;
  return ops / sec / 1e9;
}
int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s INT8(0|1) MODE(0-3) CPU [CPU...]\n", argv[0]);
    return 2;
  }
  const bool kint = argc > 1 && std::atoi(argv[1]);
  const int mode = argc > 2 ? std::atoi(argv[2]) : 0;
  std::vector<int> cpus;
  for (int i = 3; i < argc; ++i) cpus.push_back(std::atoi(argv[i]));
  const int64_t abytes = mode == 1 ? 8192 : mode >= 2 ? (512 << 10) : 4096;
  const int64_t bbytes = mode == 1 ? 8192 : mode == 2 ? (32 << 10) : mode == 3 ? (512 << 10) : 4096;
  std::vector<double> r(cpus.size());
  std::atomic<int> ready{0};
  std::vector<std::thread> th;
  for (size_t i = 0; i < cpus.size(); ++i)
    th.emplace_back([&, i] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[i], &set);
      pthread_setaffinity_np(pthread_self(), sizeof set, &set);
      if (syscall(SYS_arch_prctl, 0x1023, 18)) {
        r[i] = -1;
        return;
      }
      std::vector<char> a(abytes + 4096, 1), b(bbytes + 4096, 1);
      char* ap = reinterpret_cast<char*>((uintptr_t(a.data()) + 63) & ~uintptr_t(63));
      char* bp = reinterpret_cast<char*>((uintptr_t(b.data()) + 63) & ~uintptr_t(63));
      ++ready;
      while (ready < int(cpus.size())) {
      }
      double best = 0;
      for (int rep = 0; rep < 3; ++rep) {
        double v =
            kint ? run<true>(mode, 200000, ap, abytes, bp, bbytes) : run<false>(mode, 200000, ap, abytes, bp, bbytes);
        best = std::max(best, v);
      }
      r[i] = best;
    });
  for (auto& t : th) t.join();
  double sum = 0, mn = 1e30, mx = 0;
  for (double v : r) sum += v, mn = std::min(mn, v), mx = std::max(mx, v);
  std::printf("%s mode %d cpus", kint ? "int8" : "bf16", mode);
  for (int c : cpus) std::printf(" %d", c);
  std::printf(": total %.0f G/s, per thread %.0f-%.0f\n", sum, mn, mx);
}
