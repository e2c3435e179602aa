// One object per process for classes that own threads (the thread pool, the doorbells): made on
// first use and never destroyed (at exit its threads sleep or poll and die with the process; joining
// them from a static destructor would race with interpreter shutdown). After fork() the child, where
// only the forking thread exists, forgets the parent's object without touching it (its locks may be
// held by threads that are gone) and makes its own on first use.
#pragma once
#include <pthread.h>

#include <atomic>
#include <mutex>

namespace hmoe {

template <class T>
class ProcessSingleton {
 public:
  // The process's T; `make` returns a new T (called where T's constructor is accessible). Two
  // threads may race on the first call: one object wins, the other is deleted unused.
  template <class Make>
  static T& get(Make make) {
    T* obj = ptr_.load(std::memory_order_acquire);
    if (obj != nullptr) return *obj;
    std::call_once(registered_, [] { pthread_atfork(nullptr, nullptr, forget_in_child); });
    T* fresh = make();
    if (ptr_.compare_exchange_strong(obj, fresh, std::memory_order_acq_rel)) return *fresh;
    delete fresh;
    return *obj;
  }

 private:
  static void forget_in_child() { ptr_.store(nullptr, std::memory_order_relaxed); }
  static inline std::atomic<T*> ptr_{nullptr};
  static inline std::once_flag registered_;  // never taken again after the first call: fork-safe
};

}  // namespace hmoe
