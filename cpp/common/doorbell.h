// Doorbells: host work that a CUDA stream starts and awaits through two words of mapped pinned
// memory, with no host function. The stream writes *ready = 1 (cuStreamWriteValue32, after the
// copies of the inputs), waits for *done == 1 (cuStreamWaitValue32) and writes *done = 0; one server
// thread per process polls every registered ready word, and for one that reads 1 stores 0 there,
// runs fn(ctx) and stores 1 into done. The same sequence runs eagerly and inside a captured CUDA
// graph. A host function (cudaLaunchHostFunc) costs a hand-over to and from the driver's callback
// thread, each a thread wake-up (tens of microseconds on a virtual machine); here both directions
// are a store seen by a poller.
//
// The server spins while bells ring (kBusy after the last run or wake()), then polls with sleeps
// that grow to kIdleMax: the first run after a quiet spell may wait that long unless whoever
// enqueues it calls wake() first. (Keeping the thread pool's workers awake while bells ring, so
// that a run never waits for a sleeping worker, measured within the noise of a decode step.)
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace hmoe {

class Doorbells {
 public:
  using Fn = void (*)(void*) noexcept;

  // Answers the bell at ready/done (words that stay valid until remove(ctx)) by fn(ctx) on the
  // server thread. Starts the server on first use: a thread that cannot be started is a
  // std::runtime_error.
  void add(std::atomic<uint32_t>* ready, std::atomic<uint32_t>* done, Fn fn, void* ctx);
  // Stops answering for ctx; returns after a run of ctx in progress has ended.
  void remove(void* ctx);
  // A bell is about to ring: poll busily now.
  void wake();

  static Doorbells& instance();

 private:
  struct Bell {
    std::atomic<uint32_t>* ready;
    std::atomic<uint32_t>* done;
    Fn fn;
    void* ctx;
  };
  Doorbells() = default;
  void serve();
  bool ring_once();

  std::mutex mu_;  // bells_, running_, started_
  std::condition_variable ran_;
  std::vector<Bell> bells_;
  void* running_ = nullptr;
  bool started_ = false;
  std::atomic<uint32_t> woken_{0};  // bumped by wake(): a futex word the idle server sleeps on
  std::atomic<bool> sleeping_{false};
};

}  // namespace hmoe
