// Tuning harness for the CPU experts op: run_moe of one ISA level on synthetic packed weights
// (random quantised values with valid scales, or random bf16), timing each phase of the op
// (moe_experts.cpp built with HMOE_PHASE_TIMING). See build.sh beside this file.
//   experts_tune FORMAT(bf16|int8|int4|fp8) H I E K T [repeats] [MODE] [threads] [routings]
// MODE says what precedes each timed call (medians printed): hot (nothing: back to back, the
// default), evict (the caches evicted: `threads` threads read a buffer of max(512 MiB, 2x the
// last-level cache) at once, so that every core's private caches are read through too, as the
// bench's torch read does), idle (100 ms asleep), cold (both, as the bench's cold calls), and
// idle-wake / cold-wake (the same, then the pool woken and 30 us of spinning: the workers are awake
// when the call comes). threads: the op's thread count (default: std::thread::hardware_concurrency()).
// routings: the calls cycle through this many random routings, as the bench's do (default 16; 1:
// every call routes the same, so that with a large last-level cache the weights may stay cached).
// HMOE_TUNE_EACH=1 (environment) also prints every call: its time, its GEMM phases and, per phase,
// each thread's time inside tasks, when it started its first task and on which CPU (a worker that
// woke late, or on the caller's CPU, shows there).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/huge_pages.h"
#include "common/thread_pool.h"
#include "experts/format.h"
#include "experts/isa/contract.h"
#include "experts/moe_experts.h"
#include "experts/pack.h"

namespace hmoe::HMOE_ISA {
extern double g_phase_ms[5];
extern double g_busy_ms[2][64];
extern double g_first_ms[2][64];
extern int g_cpu[2][64];
}  // namespace hmoe::HMOE_ISA

using namespace hmoe;

// The largest cache cpu0 sees (sysfs), 32 MiB when it does not say.
int64_t llc_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string v;
    if (!(f >> v) || v.empty()) continue;
    int64_t n = std::atoll(v.c_str());
    if (v.back() == 'K') n <<= 10;
    if (v.back() == 'M') n <<= 20;
    best = std::max(best, n);
  }
  return best ? best : int64_t(32) << 20;
}

// Reads `junk` on `threads` threads at once, each its own slice.
uint64_t read_through(const std::vector<uint64_t>& junk, int threads) {
  std::vector<uint64_t> sums(size_t(threads) * 8, 0);
  std::vector<std::thread> pool;
  const size_t n = junk.size();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      uint64_t s = 0;
      for (size_t i = n * size_t(t) / size_t(threads); i < n * size_t(t + 1) / size_t(threads); i += 8) s += junk[i];
      sums[size_t(t) * 8] = s;
    });
  for (auto& th : pool) th.join();
  uint64_t s = 0;
  for (uint64_t v : sums) s += v;
  return s;
}

// Linux grants AMX tile data per process, on request ("" when granted or not needed).
template <class T = isa::Tiles>
const char* amx_permission() {
  if constexpr (T::kAvailable)
    return T::ensure_permission();
  else
    return "";
}

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s bf16|int8|int4|fp8 H I E K T [repeats] [MODE] [threads] [routings]\n", argv[0]);
    return 2;
  }
  const std::string fmt_name = argv[1];
  const int64_t H = std::atoll(argv[2]), I = std::atoll(argv[3]), E = std::atoll(argv[4]), K = std::atoll(argv[5]),
                T = std::atoll(argv[6]);
  const int repeats = argc > 7 ? std::atoi(argv[7]) : 5;
  const int threads = argc > 9 ? std::atoi(argv[9]) : std::max(1, int(std::thread::hardware_concurrency()));
  const int routings = argc > 10 ? std::atoi(argv[10]) : 16;
  if (threads < 1 || routings < 1) {
    std::fprintf(stderr, "threads and routings must be at least 1\n");
    return 2;
  }
  if (const char* why = amx_permission(); *why) {
    std::fprintf(stderr, "AMX unusable: %s\n", why);
    return 1;
  }
  const std::pair<const char*, int32_t> formats[] = {
      {"bf16", kBF16}, {"int8", kWInt8}, {"int4", kWInt4}, {"fp8", kWFp8}};
  int32_t fmt = -1;
  for (const auto& [name, code] : formats)
    if (fmt_name == name) fmt = code;
  if (fmt < 0) {
    std::fprintf(stderr, "unknown format %s (bf16, int8, int4 or fp8)\n", fmt_name.c_str());
    return 2;
  }
  const bool per_row = fmt == kWInt8;
  const int64_t g13 = fmt == kBF16 ? 0 : per_row ? round_up(H, 128) : 128;
  const int64_t g2 = fmt == kBF16 ? 0 : per_row ? round_up(I, 128) : 128;
  const int64_t b13 = packed_w13_bytes(fmt, H, I, g13), b2 = packed_w2_bytes(fmt, H, I, g2);
  // Packed weights as the library holds them: huge-page advised before the packers first touch them
  // (new[] of bytes leaves the pages untouched).
  auto packed_buffer = [](int64_t bytes) {
    std::unique_ptr<uint8_t[]> b(new uint8_t[size_t(bytes)]);
    advise_huge_pages(b.get(), bytes);
    return b;
  };
  auto w13 = packed_buffer(E * b13), w2 = packed_buffer(E * b2);
  // Each expert packed by its own thread from random values.
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int64_t e = t; e < E; e += threads) {
        for (int m = 0; m < 2; ++m) {
          const int64_t N = m == 0 ? 2 * I : H, kd = m == 0 ? H : I;
          uint8_t* dst = (m == 0 ? w13.get() + e * b13 : w2.get() + e * b2);
          if (fmt == kBF16) {
            std::vector<uint16_t> src(size_t(N * kd));
            for (auto& v : src) v = f32_to_bf16(float(int(rng() % 200) - 100) * 1e-3f);
            if (m == 0)
              pack_w13_blocks(src.data(), fmt, H, I, 0, 2 * ceil_div(I, kBlockN), dst);
            else
              pack_w2_blocks(src.data(), fmt, H, I, 0, ceil_div(H, kBlockN), dst);
          } else {
            const int64_t g = m == 0 ? g13 : g2, bytes = fmt == kWInt4 ? kd / 2 : kd;
            std::vector<uint8_t> data(size_t(N * bytes));
            for (auto& v : data)
              v = fmt == kWInt4  ? uint8_t(rng() % 256 & 0x77)
                  : fmt == kWFp8 ? uint8_t(rng() % 256 & 0xbe)  // never NaN (0x7f, 0xff)
                                 : uint8_t(int(rng() % 255) - 127);
            const int64_t ncols = per_row ? 1 : kd / g;
            std::vector<float> scales(size_t(N * ncols), 1e-3f);
            // fp8: DeepSeek's (128, 128) blocks (g = 128), one scale per 128 rows and 128 k
            const QuantMatrix qm{data.data(), kd, scales.data(), fmt == kWFp8 ? 128 : 1, per_row ? kd : g, ncols};
            if (m == 0)
              pack_quant_w13(fmt, qm, I, g, dst);
            else
              pack_quant_w2(fmt, qm, H, g, dst);
          }
        }
      }
    });
  for (auto& th : pool) th.join();
  std::mt19937 rng(1);
  std::vector<uint16_t> x(size_t(T * H));
  for (auto& v : x) v = f32_to_bf16(float(int(rng() % 200) - 100) * 1e-2f);
  std::vector<std::vector<int32_t>> routing(size_t(routings), std::vector<int32_t>(size_t(T * K)));
  for (auto& ids : routing)
    for (int64_t t = 0; t < T; ++t) {  // K distinct experts a token
      std::vector<int32_t> perm(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) perm[size_t(e)] = int32_t(e);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t k = 0; k < K; ++k) ids[size_t(t * K + k)] = perm[size_t(k)];
    }
  std::vector<float> tw(size_t(T * K), 1.f / float(K));
  std::vector<uint16_t> out(size_t(T * H));
  MoeParams p{};
  p.x = x.data(), p.x_dtype = kBF16, p.ids_dtype = kI32, p.topk_weights = tw.data();
  p.w13 = w13.get(), p.w2 = w2.get(), p.w_format = fmt, p.packed = 1, p.group13 = g13, p.group2 = g2;
  p.out = out.data(), p.T = T, p.K = K, p.E = E, p.H = H, p.I = I, p.num_threads = threads;
  const double flop = 6.0 * double(H) * double(I) * double(T * K);
  const std::string mode = argc > 8 ? argv[8] : "hot";
  const bool evict = mode == "evict" || mode.rfind("cold", 0) == 0;
  const bool idle = mode.rfind("idle", 0) == 0 || mode.rfind("cold", 0) == 0;
  const bool wake = mode.size() > 5 && mode.compare(mode.size() - 5, 5, "-wake") == 0;
  if (!evict && !idle && mode != "hot") {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  std::vector<uint64_t> junk(evict ? size_t(std::max<int64_t>(int64_t(512) << 20, 2 * llc_bytes()) / 8) : 0, 1);
  volatile uint64_t sink = 0;
  std::vector<double> total;
  std::vector<std::vector<double>> ph(5);
  std::vector<std::vector<double>> busy_mean(2), busy_max(2);
  for (int r = 0; r < repeats + 1; ++r) {
    if (evict) sink = sink + read_through(junk, threads);
    p.topk_ids = routing[size_t(r % routings)].data();
    if (idle) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (wake) {
      ThreadPool::instance().wake(threads);
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(30);
      while (std::chrono::steady_clock::now() < until) {
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    HMOE_ISA::run_moe(p);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (r == 0) continue;
    total.push_back(ms);
    for (int i = 0; i < 5; ++i) ph[size_t(i)].push_back(HMOE_ISA::g_phase_ms[i]);
    if (std::getenv("HMOE_TUNE_EACH")) {  // every call: its time; per GEMM phase and thread, its time in tasks
      std::printf("  call %d: %.3f ms, gemm1 %.3f, gemm2 %.3f; thread: ms in tasks (first task at ms, on cpu)", r, ms,
                  HMOE_ISA::g_phase_ms[1], HMOE_ISA::g_phase_ms[3]);
      for (int g = 0; g < 2; ++g) {
        std::printf(" | gemm%d:", g + 1);
        for (int w = 0; w < std::min(threads, 64); ++w)
          std::printf(" %.2f (%.3f, %d)", HMOE_ISA::g_busy_ms[g][w], HMOE_ISA::g_first_ms[g][w], HMOE_ISA::g_cpu[g][w]);
      }
      std::printf("\n");
    }
    for (int g = 0; g < 2; ++g) {  // workers' time inside GEMM tasks
      double sum = 0, mx = 0;
      for (int w = 0; w < std::min(threads, 64); ++w)
        sum += HMOE_ISA::g_busy_ms[g][w], mx = std::max(mx, HMOE_ISA::g_busy_ms[g][w]);
      busy_mean[size_t(g)].push_back(sum / std::min(threads, 64));
      busy_max[size_t(g)].push_back(mx);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double best = median(total);
  double phases[5];
  for (int i = 0; i < 5; ++i) phases[i] = median(ph[size_t(i)]);
  std::printf(
      "%s H=%lld I=%lld E=%lld K=%lld T=%lld threads %d %s: %.3f ms median (min %.3f)  %.0f GFLOP/s  "
      "(gather %.3f, gemm1 %.3f, quantise h %.3f, gemm2 %.3f, combine %.3f)\n",
      fmt_name.c_str(), (long long)H, (long long)I, (long long)E, (long long)K, (long long)T, threads, mode.c_str(),
      best, *std::min_element(total.begin(), total.end()), flop / best / 1e6, phases[0], phases[1], phases[2],
      phases[3], phases[4]);
  std::printf("  workers' time in tasks, mean / max: gemm1 %.3f / %.3f, gemm2 %.3f / %.3f ms\n", median(busy_mean[0]),
              median(busy_max[0]), median(busy_mean[1]), median(busy_max[1]));
  return 0;
}
