#include "membw/read_probe.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/huge_pages.h"

namespace hmoe {
namespace {

// kStreams streams through the range at once, eight independent accumulators. Four streams, each
// with a software prefetch 2 KB ahead (hardware prefetchers restart at every 4 KB page), is what
// the experts' kernels do when several weight blocks stream together; one plain sequential stream
// is what the hardware prefetchers follow best. Which is faster depends on the machine: on the
// 2-core Zen 4 VM one stream read 28.8 GB/s on one thread and 49.7 on two, four streams with the
// prefetch 10.3 and 29.7, while the experts' decode read up to 52 GB/s there.
template <int kStreams>
uint64_t read_range(const uint64_t* p, int64_t n) {
  constexpr int kAhead = 256;  // words
  const int64_t part = n / kStreams / 8 * 8;
  uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < part; i += 8) {
    for (int s = 0; s < kStreams; ++s) {
      const uint64_t* q = p + s * part + i;
      if constexpr (kStreams > 1) __builtin_prefetch(q + kAhead);
      for (int j = 0; j < 8; ++j) a[j] ^= q[j];
    }
  }
  for (int64_t i = kStreams * part; i < n; ++i) a[0] ^= p[i];
  return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

}  // namespace

double read_bandwidth(int64_t bytes, int threads, int repeats) {
  if (bytes < (1 << 20) || threads < 1 || repeats < 1)
    throw std::invalid_argument("read_bandwidth: bytes >= 1 MiB, threads >= 1, repeats >= 1");
  const int64_t n = bytes / 8;
  std::unique_ptr<uint64_t[]> buf(new uint64_t[size_t(n)]);
  advise_huge_pages(buf.get(), n * 8);  // as the packed expert weights are
  // Each thread fills (first touch: its pages land on its node) and then reads its own slice.
  auto run = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { body(n * t / threads, n * (t + 1) / threads, t); });
    for (auto& th : pool) th.join();
  };
  run([&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) buf[size_t(i)] = uint64_t(i) * 0x9E3779B97F4A7C15ull;
  });
  std::vector<uint64_t> sink(size_t(threads) * 8, 0);  // a line per thread
  double best = 0;
  for (int r = 0; r < 2 * repeats; ++r) {  // both access patterns, alternating: the best pass of either
    const auto t0 = std::chrono::steady_clock::now();
    run([&](int64_t b, int64_t e, int t) {
      sink[size_t(t) * 8] ^= r % 2 ? read_range<4>(buf.get() + b, e - b) : read_range<1>(buf.get() + b, e - b);
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(n * 8) / s);
  }
  uint64_t x = 0;
  for (uint64_t v : sink) x ^= v;
  volatile uint64_t keep = x;  // the reads have a use
  (void)keep;
  return best;
}

}  // namespace hmoe
