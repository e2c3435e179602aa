// The binding layer's scalar arguments: Python ints, floats and bools checked exactly as hmoe's
// API promises (no bool for an int, no overflow of the native width, no silent truncation).
#pragma once
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "bind/tensors.h"

namespace hmoe::bind {

inline std::string type_name(py::handle v) { return Py_TYPE(v.ptr())->tp_name; }

// A whole number in [lo, hi]: int, or anything with __index__ (numpy integers); never a bool.
inline int64_t int_arg(py::handle v, const std::string& name, int64_t lo, int64_t hi) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) type_error(name + " must be an int, got " + type_name(v));
  int overflow = 0;
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!index) throw py::error_already_set();
  const long long x = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow || x < lo || x > hi)
    value_error(name + " = " + py::str(index).cast<std::string>() + " is outside the supported range [" +
                std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

// A real number that fp32 holds (the kernels take fp32): finite and within +-3.4e38; never a bool.
inline float float_arg(py::handle v, const std::string& name) {
  PyObject* o = v.ptr();
  const bool real =
      PyFloat_Check(o) || PyLong_Check(o) ||
      (Py_TYPE(o)->tp_as_number != nullptr && Py_TYPE(o)->tp_as_number->nb_float != nullptr && !PyComplex_Check(o));
  if (PyBool_Check(o) || !real) type_error(name + " must be a float, got " + type_name(v));
  const double x = PyFloat_AsDouble(o);
  if (x == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  if (!std::isfinite(x) || std::fabs(x) > 3.4028234663852886e38)
    value_error(name + " must be finite in float32 (|x| <= 3.4e38), got " + py::repr(v).cast<std::string>());
  return float(x);
}

// float_arg that is also >= 0 (an epsilon).
inline float nonnegative_float_arg(py::handle v, const std::string& name) {
  const float x = float_arg(v, name);
  if (!(x >= 0.f)) value_error(name + " must be >= 0, got " + py::repr(v).cast<std::string>());
  return x;
}

inline bool bool_arg(py::handle v, const std::string& name) {
  if (!PyBool_Check(v.ptr())) type_error(name + " must be a bool, got " + type_name(v));
  return v.ptr() == Py_True;
}

}  // namespace hmoe::bind
