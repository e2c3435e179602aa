// A fixed pool of worker threads that runs one parallel-for at a time; callers from several
// threads are serialised, and the calling thread works too. One pool per process: a forked
// child gets a fresh one (see instance()).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hmoe {

// The most threads one parallel-for may use (python/hmoe/_threads.py refuses more first).
constexpr int kMaxThreads = 1024;

class ThreadPool {
 public:
  // fn(task, worker) for task in [0, n_tasks); worker in [0, n_threads) identifies the
  // thread, so callers can index per-thread scratch. Runs on at most n_threads threads
  // (the caller included; clamped to [1, kMaxThreads]) and returns when every task is done.
  // Tasks are handed out dynamically; a worker that is still waking up when the others have run
  // out of tasks stays out of the job. The first exception thrown by a task is rethrown here.
  // A worker thread that cannot be started is a std::runtime_error saying so; the pool stays
  // usable with the workers it has.
  void parallel_for(int64_t n_tasks, int n_threads, const std::function<void(int64_t task, int worker)>& fn);

  // Wakes the workers a parallel_for on n_threads threads will use, so that they are spinning
  // when it comes (a sleeping worker's wake-up costs tens of microseconds, on a virtual machine
  // whose idle vCPUs halt hundreds): call it before
  // the serial work that precedes a parallel phase. Threads not used soon go back to sleep.
  void wake(int n_threads);

  // The threads the coming calls may use at most (the caller's thread count, e.g. the op's
  // num_threads): workers beyond it sleep until a call asks for them again, instead of being
  // woken by every job. parallel_for and wake() raise it when they need more.
  void limit(int n_threads);

  // This process's pool. After fork() the child's copy of the parent's pool is abandoned
  // (its workers do not exist there and its mutexes and condition variables may be held by
  // them or list them as waiters: using it would hang) and a new one is made on first use.
  static ThreadPool& instance();

 private:
  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void ensure_workers(int n);
  class AwayFromCaller;
  void worker_loop(int id, uint64_t seen);
  void await_job(uint64_t seen, AwayFromCaller& away);
  void signal();
  void want(int n_workers, bool lower);
  void park(int id);
  void place_workers();
  void run_tasks(int worker);

  std::mutex submit_mu_;  // one job at a time
  std::mutex mu_;         // workers_ and error_; the caller's sleep when a task outlasts its spin
  std::condition_variable cv_done_;
  std::vector<std::thread> workers_;
  std::vector<AwayFromCaller*> aways_;  // each worker's, registered when it starts (under mu_)
  // A job is published by bumping job_ (after its fields and gate_ are set). Workers that find
  // it enter through gate_: (job & 0xffffffff) << 32 | closed << 31 | workers inside. When the
  // caller runs out of tasks it closes the gate and waits only for the workers inside (each
  // finishing its last task); one still waking up finds the gate closed and stays out, so a
  // slow wake-up never delays a job that the others have finished.
  std::atomic<uint64_t> job_{0};
  std::atomic<uint64_t> gate_{0};
  // Sleeping workers wait on signal_ (a futex word on Linux), bumped by every job and wake().
  std::atomic<uint32_t> signal_{0};
  std::atomic<int> sleepers_{0};
  // The CPU the caller of the last job or wake() ran on (-1: unknown): a sleeping worker keeps off
  // it, and the caller moves the workers off its CPU when it has moved (see AwayFromCaller in
  // thread_pool.cpp).
  std::atomic<int> caller_cpu_{-1};
  std::atomic<int> active_workers_{0};  // workers (excluding the caller) that may take part
  // Workers (excluding the caller) that calls may use (see limit()). Those above it park on
  // unpark_ (a futex word), woken only when a call asks for more workers again: a pool that once
  // ran more threads than the calls now use must not wake all of them for every job.
  std::atomic<int> wanted_{0};
  std::atomic<uint32_t> unpark_{0};
  std::atomic<int> parked_{0};
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

}  // namespace hmoe
