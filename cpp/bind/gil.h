// Native work without the GIL, in a way that survives interpreter shutdown.
//
// py::gil_scoped_release takes the GIL back in its destructor. A daemon thread whose call is still
// running when the main thread returns finds the interpreter finalising when it asks for the GIL,
// and CPython (3.8-3.13) ends such a thread with pthread_exit: a forced unwinding, which through
// that (noexcept) destructor is std::terminate, "terminate called without an active exception"
// and SIGABRT at exit. without_gil parks such a thread instead (it sleeps until the process ends,
// as CPython 3.14 does with it), and takes the GIL back in ordinary code, outside any destructor: a
// finalisation that begins while the thread waits for the GIL still ends it with pthread_exit,
// whose unwinding may then pass (pybind11 rethrows it; nothing on the way is noexcept).
#pragma once
#include <pybind11/pybind11.h>
#include <unistd.h>

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

// PyEval_RestoreThread(state), or never returns when the interpreter is finalising.
inline void take_gil_back(PyThreadState* state) {
  if (interpreter_finalizing())
    for (;;) pause();
  PyEval_RestoreThread(state);
}

// fn() with the GIL released; its result, or its exception rethrown once the GIL is held again.
template <class F>
auto without_gil(F&& fn) {
  using R = std::invoke_result_t<F&>;
  PyThreadState* state = PyEval_SaveThread();
  std::exception_ptr error;
  if constexpr (std::is_void_v<R>) {
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    take_gil_back(state);
    if (error) std::rethrow_exception(error);
  } else {
    std::optional<R> result;
    try {
      result.emplace(fn());
    } catch (...) {
      error = std::current_exception();
    }
    take_gil_back(state);
    if (error) std::rethrow_exception(error);
    return std::move(*result);
  }
}

}  // namespace hmoe::bind
