// ThreadPool: dynamic task hand-out over persistent workers; see thread_pool.h.
#include "common/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>

namespace hmoe {
namespace {

// Back-to-back calls (decode steps) are typical: a thread that finished its part spins this
// long for the next job or for the others to finish before sleeping on a condition variable,
// which would add a futex wake-up (tens of microseconds) to every phase of every call.
constexpr auto kSpin = std::chrono::microseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

template <typename Done>
void spin_until(Done done) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1; !done(); ++i) {
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > end) return;
  }
}

// The process's pool. It is never destroyed: at exit its workers sleep on a condition variable
// and die with the process (joining them from a static destructor would race with interpreter
// shutdown), and after fork() the child only forgets it (see instance()).
std::atomic<ThreadPool*> g_pool{nullptr};

// Runs in the child after fork(), where only the forking thread exists: no locks can be taken
// (a parent thread may have held them), so the parent's pool is simply leaked.
void forget_pool_in_child() { g_pool.store(nullptr, std::memory_order_relaxed); }

}  // namespace

ThreadPool& ThreadPool::instance() {
  ThreadPool* pool = g_pool.load(std::memory_order_acquire);
  if (pool != nullptr) return *pool;
  static std::once_flag registered;  // never taken again after the first call: fork-safe
  std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  // Two threads may get here at once: one pool wins, the other is deleted (it has no workers yet).
  ThreadPool* fresh = new ThreadPool();
  if (g_pool.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *pool;
}

void ThreadPool::ensure_workers(int n) {
  workers_.reserve(size_t(n));
  while (int(workers_.size()) < n) {
    int id = int(workers_.size()) + 1;  // worker 0 is the caller
    // Called under mu_ before the job's generation is published: the new worker takes part
    // in every generation after this one.
    uint64_t seen = generation_.load();
    try {
      workers_.emplace_back([this, id, seen] { worker_loop(id, seen); });
    } catch (const std::system_error& e) {
      // The workers started so far stay valid: a later call with fewer threads still works.
      throw std::runtime_error("hmoe: could not start CPU worker thread " + std::to_string(id + 1) + " of " +
                               std::to_string(n + 1) + " (" + e.what() +
                               "); use fewer threads: "
                               "hmoe.set_num_threads(n) or HMOE_NUM_THREADS (this process runs " +
                               std::to_string(workers_.size() + 1) + ")");
    }
  }
}

void ThreadPool::run_tasks(int worker) {
  for (;;) {
    int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    if (t >= n_tasks_) break;
    try {
      (*fn_)(t, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lk(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(n_tasks_, std::memory_order_relaxed);  // stop handing out work
    }
  }
}

void ThreadPool::worker_loop(int id, uint64_t seen) {
  uint64_t woken = wakes_.load();
  for (;;) {
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return (generation_ != seen && id <= active_workers_) || wakes_ != woken; });
      if (generation_ == seen || id > active_workers_) {  // woken ahead of a job: spin for it
        woken = wakes_;
        continue;
      }
      seen = generation_;
    }
    run_tasks(id);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (running_.fetch_sub(1) == 1) cv_done_.notify_all();
    }
  }
}

void ThreadPool::wake(int n_threads) {
  n_threads = std::clamp(n_threads, 1, kMaxThreads);
  if (n_threads == 1) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ensure_workers(n_threads - 1);
    ++wakes_;
  }
  cv_work_.notify_all();
}

void ThreadPool::parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  n_threads = int(std::max<int64_t>(1, std::min<int64_t>({n_threads, n_tasks, kMaxThreads})));
  if (n_threads == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> job(submit_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ensure_workers(n_threads - 1);
    fn_ = &fn;
    n_tasks_ = n_tasks;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    active_workers_ = n_threads - 1;
    running_ = n_threads - 1;
    ++generation_;
  }
  cv_work_.notify_all();
  run_tasks(0);
  spin_until([&] { return running_.load(std::memory_order_acquire) == 0; });
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_done_.wait(lk, [&] { return running_ == 0; });
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace hmoe
