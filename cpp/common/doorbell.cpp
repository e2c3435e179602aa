// Doorbells: see doorbell.h.
#include "common/doorbell.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>

#include "common/process_singleton.h"
#include "common/spin.h"

namespace hmoe {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;

// A decode step rings one bell per MoE layer, a few hundred microseconds apart: the server spins
// this long after the last ring (or wake()) before it sleeps between polls.
constexpr auto kBusy = std::chrono::milliseconds(2);
// Idle polls sleep from kIdleMin, doubling up to kIdleMax.
constexpr auto kIdleMin = microseconds(50);
constexpr auto kIdleMax = microseconds(1000);

}  // namespace

Doorbells& Doorbells::instance() {
  return ProcessSingleton<Doorbells>::get([] { return new Doorbells(); });
}

void Doorbells::add(std::atomic<uint32_t>* ready, std::atomic<uint32_t>* done, Fn fn, void* ctx) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!started_) {
      try {
        std::thread(&Doorbells::serve, this).detach();
      } catch (const std::system_error& e) {
        throw std::runtime_error(std::string("hmoe: could not start the doorbell thread (") + e.what() + ")");
      }
      started_ = true;
    }
    bells_.push_back(Bell{ready, done, fn, ctx});
  }
  wake();
}

void Doorbells::remove(void* ctx) {
  std::unique_lock<std::mutex> lk(mu_);
  ran_.wait(lk, [&] { return running_ != ctx; });
  bells_.erase(std::remove_if(bells_.begin(), bells_.end(), [&](const Bell& b) { return b.ctx == ctx; }), bells_.end());
}

// The seq_cst pair (woken_ here, sleeping_ in serve) makes sure that a server about to sleep either
// is seen sleeping here or sees the bump.
void Doorbells::wake() {
  woken_.fetch_add(1);
  if (sleeping_.load()) futex_wake_all(&woken_);
}

// Answers one ringing bell, if any: ready back to 0, the run, then done = 1 (a release store: the
// run's writes, the pool workers' included, are visible before it).
bool Doorbells::ring_once() {
  std::unique_lock<std::mutex> lk(mu_);
  for (const Bell& b : bells_) {
    if (b.ready->load(std::memory_order_acquire) != 1) continue;
    const Bell bell = b;  // bells_ may change while the run goes on unlocked
    bell.ready->store(0, std::memory_order_relaxed);
    running_ = bell.ctx;
    lk.unlock();
    bell.fn(bell.ctx);
    bell.done->store(1, std::memory_order_release);
    lk.lock();
    running_ = nullptr;
    lk.unlock();
    ran_.notify_all();
    return true;
  }
  return false;
}

void Doorbells::serve() {
  auto last = Clock::now();
  auto idle = kIdleMin;
  uint32_t seen = woken_.load();
  for (;;) {
    if (ring_once()) {
      last = Clock::now();
      idle = kIdleMin;
      continue;
    }
    const uint32_t w = woken_.load();
    const auto now = Clock::now();
    if (w != seen) {
      seen = w, last = now, idle = kIdleMin;
    }
    if (now - last < kBusy) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      continue;
    }
    sleeping_.store(true);
    if (woken_.load() == w) futex_wait(&woken_, w, idle);
    sleeping_.store(false);
    idle = std::min(idle * 2, kIdleMax);
  }
}

}  // namespace hmoe
