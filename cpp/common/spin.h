// Waiting primitives shared by the thread pool and the doorbells: a pause for spin loops and a
// futex-style sleep on a 32-bit word (a futex on Linux, a condition variable elsewhere).
#pragma once
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#else
#include <condition_variable>
#include <mutex>
#endif

namespace hmoe {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

#ifdef __linux__
// Sleeps while *word == value, at most `timeout` if positive (a spurious return is allowed).
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t value,
                       std::chrono::microseconds timeout = std::chrono::microseconds(0)) {
  timespec ts{time_t(timeout.count() / 1000000), long(timeout.count() % 1000000) * 1000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, value, timeout.count() > 0 ? &ts : nullptr,
          nullptr, 0);
}
// Wakes every sleeper on word.
inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
#else
inline std::mutex& futex_mu() {
  static std::mutex mu;
  return mu;
}
inline std::condition_variable& futex_cv() {
  static std::condition_variable cv;
  return cv;
}
inline void futex_wait(std::atomic<uint32_t>* word, uint32_t value,
                       std::chrono::microseconds timeout = std::chrono::microseconds(0)) {
  std::unique_lock<std::mutex> lk(futex_mu());
  auto changed = [&] { return word->load() != value; };
  if (timeout.count() > 0) {
    futex_cv().wait_for(lk, timeout, changed);
  } else {
    futex_cv().wait(lk, changed);
  }
}
inline void futex_wake_all(std::atomic<uint32_t>*) {
  std::lock_guard<std::mutex> lk(futex_mu());
  futex_cv().notify_all();
}
#endif

}  // namespace hmoe
