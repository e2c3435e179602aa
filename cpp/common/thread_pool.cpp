// ThreadPool: dynamic task hand-out over persistent workers; see thread_pool.h.
#include "common/thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

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

}  // namespace

ThreadPool& ThreadPool::instance() {
  static ThreadPool pool;
  return pool;
}

int ThreadPool::usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::ensure_workers(int n) {
  // After fork() the child has none of the parent's workers: forget them (never join or
  // destroy them; their handles mean nothing here) and start new ones.
  if (owner_pid_ != getpid()) {
    if (!workers_.empty()) new std::vector<std::thread>(std::move(workers_));  // leaked on purpose
    workers_.clear();
    owner_pid_ = getpid();
  }
  while (int(workers_.size()) < n) {
    int id = int(workers_.size()) + 1;  // worker 0 is the caller
    // Called under mu_ before the job's generation is published: the new worker takes part
    // in every generation after this one.
    uint64_t seen = generation_.load();
    workers_.emplace_back([this, id, seen] { worker_loop(id, seen); });
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
  for (;;) {
    spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stop_ || (generation_ != seen && id <= active_workers_); });
      if (stop_) return;
      seen = generation_;
    }
    run_tasks(id);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (running_.fetch_sub(1) == 1) cv_done_.notify_all();
    }
  }
}

void ThreadPool::parallel_for(int64_t n_tasks, int n_threads,
                              const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  n_threads = int(std::max<int64_t>(1, std::min<int64_t>(n_threads, n_tasks)));
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
