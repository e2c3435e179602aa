// Native work without the GIL, in a way that survives interpreter shutdown: every binding releases
// the GIL through without_gil, never py::gil_scoped_release.
//
// py::gil_scoped_release takes the GIL back in its destructor. A daemon thread whose call is still
// running when the main thread returns finds the interpreter finalising when it asks for the GIL,
// and CPython (3.8-3.13) ends such a thread with pthread_exit: a forced unwinding, which through
// that (noexcept) destructor is std::terminate, "terminate called without an active exception"
// and SIGABRT at exit. without_gil parks such a thread instead (it sleeps until the process ends,
// as CPython 3.14 does with it), and takes the GIL back in ordinary code, outside any destructor: a
// finalisation that begins while the thread waits for the GIL still ends it with pthread_exit,
// whose unwinding may then pass (pybind11 rethrows it; nothing on the way is noexcept). The thread
// that finalises (and runs __del__ methods and finalisers meanwhile) gets the GIL back as always:
// it is the one that ran the atexit callbacks, which watch_finalization() makes it record.
#pragma once
#include <pybind11/pybind11.h>
#include <unistd.h>

#include <atomic>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace hmoe::bind {

inline bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// The thread that finalises the interpreter, recorded by an atexit callback (finalisation runs
// them in that thread, just before it begins); 0 until then.
inline std::atomic<unsigned long>& finalizing_thread() {
  static std::atomic<unsigned long> id{0};
  return id;
}

// Registers that callback; once per module, at its import (the GIL held).
inline void watch_finalization() {
  pybind11::module_::import("atexit").attr("register")(
      pybind11::cpp_function([] { finalizing_thread().store(PyThread_get_thread_ident()); }));
}

// PyEval_RestoreThread(state), or never returns when the interpreter is being finalised by
// another thread (which would end this one there).
inline void take_gil_back(PyThreadState* state) {
  if (interpreter_finalizing()) {
    const unsigned long finalizer = finalizing_thread().load();
    if (finalizer != 0 && finalizer != PyThread_get_thread_ident())
      for (;;) pause();
  }
  PyEval_RestoreThread(state);
}

// fn() with the GIL released; its result, or its exception rethrown once the GIL is held again.
template <class F>
auto without_gil(F&& fn) {
  using R = std::invoke_result_t<F&>;
  if constexpr (std::is_void_v<R>) {
    PyThreadState* state = PyEval_SaveThread();
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    take_gil_back(state);
    if (error) std::rethrow_exception(error);
  } else {
    std::optional<R> result;
    without_gil([&] { result.emplace(fn()); });
    return std::move(*result);
  }
}

}  // namespace hmoe::bind
