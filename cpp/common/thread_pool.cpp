// ThreadPool: dynamic task hand-out over persistent workers; see thread_pool.h.
#include "common/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <stdexcept>
#include <string>
#include <system_error>

#include "common/process_singleton.h"
#include "common/spin.h"

#ifdef __linux__
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hmoe {
namespace {

// Back-to-back calls (decode steps) are typical: a thread that finished its part spins this
// long for the next job (the caller: for the workers still inside) before sleeping, which would
// add a futex wake-up (tens of microseconds; hundreds on a virtual machine whose idle vCPUs halt)
// to every phase of every call.
constexpr auto kSpin = std::chrono::microseconds(50);

// Spins until done() or kSpin has passed; says which.
template <typename Done>
bool spin_until(Done done) {
  const auto end = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1; !done(); ++i) {
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > end) return done();
  }
  return true;
}

constexpr uint64_t kClosed = uint64_t(1) << 31;
constexpr uint64_t kInside = kClosed - 1;
uint64_t gate_of(uint64_t job) { return (job & 0xffffffffu) << 32; }

}  // namespace

// A sleeping worker's CPU mask keeps it off the caller's CPU. On a virtual machine the kernel woke
// a worker that had slept a millisecond or more onto the CPU of the caller that woke it (presumably
// because the idle vCPU, halted, reads as preempted to the guest's scheduler), where one of the two
// then waited for the other: on the 2-core Zen 4 VM, after 100 ms idle, the one worker of a
// 2-thread job ran none or all of its tasks in most calls (tools/experts_tune, V2-Lite int4 decode,
// cold calls: 1.55-1.65 ms, one thread doing the work; 0.98-1.10 ms with this). So before it sleeps
// a worker takes the caller's CPU out of its mask (one sched_setaffinity when the caller's CPU has
// changed since its last sleep) and the wake-up places it elsewhere. A caller that has moved to
// another CPU since then (after its own sleep, say) would find the worker's mask holding only its
// new CPU on a 2-vCPU machine, the worker waiting behind it for a time slice (tools/experts_tune
// on the 2-core Zen 3 VM, V3 int4 decode, cold: the worker's first task 1.4-5.3 ms into GEMM1, on
// the caller's CPU, in half of the calls), so the caller moves the sleeping workers' masks off its
// CPU itself before it wakes them (a sched_setaffinity per worker, only when the caller has moved).
// The CPUs a worker may use are those it started with; with a single one, or off Linux, nothing
// changes.
class ThreadPool::AwayFromCaller {
 public:
#ifdef __linux__
  AwayFromCaller() : tid_(pid_t(syscall(SYS_gettid))) {
    usable_ = sched_getaffinity(0, sizeof(allowed_), &allowed_) == 0 && CPU_COUNT(&allowed_) > 1;
  }
  // From the worker or the caller: this worker's mask without `cpu`.
  void avoid(int cpu) {
    if (!usable_ || cpu == avoided_.load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lk(mu_);
    if (cpu == avoided_.load(std::memory_order_relaxed)) return;
    cpu_set_t mask = allowed_;
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_CLR(cpu, &mask);
    if (CPU_COUNT(&mask) > 0 && sched_setaffinity(tid_, sizeof(mask), &mask) == 0)
      avoided_.store(cpu, std::memory_order_release);
  }
  static int current_cpu() { return sched_getcpu(); }

 private:
  const pid_t tid_;
  cpu_set_t allowed_{};
  bool usable_ = false;
  std::mutex mu_;
  std::atomic<int> avoided_{-2};  // the CPU the mask leaves out now (-1: none left out)
#else
  void avoid(int) {}
  static int current_cpu() { return -1; }
#endif
};

// The caller's CPU, for the workers' masks: stored, and every worker's mask moved off it (a
// syscall only for a worker whose mask leaves out another CPU). Under mu_.
void ThreadPool::place_workers() {
  const int cpu = AwayFromCaller::current_cpu();
  caller_cpu_.store(cpu);
  for (AwayFromCaller* a : aways_) a->avoid(cpu);
}

ThreadPool& ThreadPool::instance() {
  return ProcessSingleton<ThreadPool>::get([] { return new ThreadPool(); });
}

void ThreadPool::ensure_workers(int n) {
  workers_.reserve(size_t(n));
  while (int(workers_.size()) < n) {
    int id = int(workers_.size()) + 1;  // worker 0 is the caller
    // Called under mu_ before the job is published: the new worker takes part in every job
    // after the current one.
    uint64_t seen = job_.load();
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

// Bumps signal_ and wakes the workers sleeping on it. The seq_cst pair (signal_ here, sleepers_
// in await_job) makes sure that a worker about to sleep either is counted here or sees the bump.
void ThreadPool::signal() {
  signal_.fetch_add(1);
  if (sleepers_.load() > 0) futex_wake_all(&signal_);
}

// Workers 1..n_workers are wanted from now on (`lower`: and no others); those parked among them
// are woken.
void ThreadPool::want(int n_workers, bool lower) {
  int before = wanted_.load();
  while ((lower ? before != n_workers : before < n_workers) && !wanted_.compare_exchange_weak(before, n_workers)) {
  }
  if (before < n_workers) {
    unpark_.fetch_add(1);
    if (parked_.load() > 0) futex_wake_all(&unpark_);
  }
}

void ThreadPool::limit(int n_threads) { want(std::clamp(n_threads, 1, kMaxThreads) - 1, true); }

// Returns at once while worker `id` is wanted; otherwise sleeps until it is. The seq_cst pair
// (wanted_ then unpark_ in want(), unpark_ then wanted_ here) makes sure that a worker about to
// sleep either sees the new count or finds unpark_ changed.
void ThreadPool::park(int id) {
  for (;;) {
    const uint32_t s = unpark_.load();
    if (id <= wanted_.load()) return;
    parked_.fetch_add(1);
    futex_wait(&unpark_, s);
    parked_.fetch_sub(1);
  }
}

// Returns once job_ differs from seen: spinning, then asleep on signal_ (woken by a job, or by
// wake(), after which it spins again), off the caller's CPU.
void ThreadPool::await_job(uint64_t seen, AwayFromCaller& away) {
  auto changed = [&] { return job_.load(std::memory_order_acquire) != seen; };
  while (!spin_until(changed)) {
    const uint32_t s = signal_.load();
    sleepers_.fetch_add(1);
    // Again if the caller moved meanwhile (its place_workers may have set this mask first).
    for (int cpu = caller_cpu_.load();;) {
      away.avoid(cpu);
      const int now = caller_cpu_.load();
      if (now == cpu) break;
      cpu = now;
    }
    if (!changed()) futex_wait(&signal_, s);
    sleepers_.fetch_sub(1);
  }
}

void ThreadPool::worker_loop(int id, uint64_t seen) {
#ifdef __linux__
  pthread_setname_np(pthread_self(), ("hmoe-cpu-" + std::to_string(id)).substr(0, 15).c_str());  // top -H, ps -L
#endif
  AwayFromCaller away;
  {
    std::lock_guard<std::mutex> lk(mu_);
    aways_.push_back(&away);  // the worker never ends (the pool lives as long as the process)
  }
  for (;;) {
    park(id);
    await_job(seen, away);
    seen = job_.load(std::memory_order_acquire);
    if (id > active_workers_.load(std::memory_order_relaxed)) continue;
    // Enter unless the job is over (closed, or already followed by another).
    uint64_t g = gate_.load(std::memory_order_acquire);
    bool entered = false;
    while (!entered && (g & ~kInside) == gate_of(seen))
      entered = gate_.compare_exchange_weak(g, g + 1, std::memory_order_acq_rel, std::memory_order_acquire);
    if (!entered) continue;
    run_tasks(id);
    const uint64_t old = gate_.fetch_sub(1, std::memory_order_acq_rel);
    if ((old & kClosed) && (old & kInside) == 1) {  // the caller waits for this worker
      std::lock_guard<std::mutex> lk(mu_);
      cv_done_.notify_all();
    }
  }
}

void ThreadPool::wake(int n_threads) {
  n_threads = std::clamp(n_threads, 1, kMaxThreads);
  if (n_threads == 1) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ensure_workers(n_threads - 1);
    place_workers();
  }
  want(n_threads - 1, false);
  signal();
}

void ThreadPool::parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t, int)>& fn) {
  if (n_tasks <= 0) return;
  n_threads = int(std::max<int64_t>(1, std::min<int64_t>({n_threads, n_tasks, kMaxThreads})));
  if (n_threads == 1) {
    for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> job(submit_mu_);
  const uint64_t id = job_.load(std::memory_order_relaxed) + 1;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ensure_workers(n_threads - 1);
    place_workers();
    error_ = nullptr;
  }
  // No worker is inside the previous job (its gate is closed and empty), so these are ours to set.
  fn_ = &fn;
  n_tasks_ = n_tasks;
  next_.store(0, std::memory_order_relaxed);
  active_workers_.store(n_threads - 1, std::memory_order_relaxed);
  gate_.store(gate_of(id), std::memory_order_release);
  job_.store(id, std::memory_order_release);
  want(n_threads - 1, false);
  signal();
  run_tasks(0);
  // Out of tasks: close the gate and wait for the workers inside to finish theirs.
  if (gate_.fetch_or(kClosed, std::memory_order_acq_rel) & kInside) {
    auto empty = [&] { return (gate_.load(std::memory_order_acquire) & kInside) == 0; };
    if (!spin_until(empty)) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_done_.wait(lk, empty);
    }
  }
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = nullptr;
    err = error_;
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace hmoe
