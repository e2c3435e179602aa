// rms_norm's entry point for a CUDA family module (host code): the arguments of hmoe.ops.rms_norm
// checked in the order it documents, y allocated on torch's allocator, the launch on torch's current
// stream.
#pragma once
#include <pybind11/pybind11.h>

#include <climits>
#include <string>

#include "bind/gil.h"
#include "bind/scalars.h"
#include "bind/tensors.h"
#include "hmoe/constants.h"
#include "norm/rms_norm.h"

namespace hmoe::bind {

inline py::object rms_norm_entry(py::handle x, py::handle weight, py::handle eps) {
  const TensorArg tx = tensor(x, "x", kHalves, 2, Where::kCuda);
  const TensorArg tw = tensor(weight, "weight", dtypes({tx.dtype}), 1, Where::kCuda);
  same_device(tx, tw);
  const int64_t rows = tx.shape[0], dim = tx.shape[1];
  if (tw.shape[0] != dim)
    value_error("weight has shape " + tw.shape_str() + ", x " + tx.shape_str() + ": they must match");
  if (dim < 8 || dim % 8 || dim > k::rms_norm_max_dim)
    value_error("x has rows of " + std::to_string(dim) + " values; rms_norm takes multiples of 8 up to " +
                std::to_string(k::rms_norm_max_dim));
  if (rows > INT32_MAX) value_error("x has " + std::to_string(rows) + " rows; rms_norm takes fewer than 2^31");
  aligned16({&tx, &tw});
  RmsNormParams p{};
  p.eps = nonnegative_float_arg(eps, "eps");
  p.x = tx.data, p.weight = tw.data, p.rows = rows, p.dim = int32_t(dim), p.dtype = tx.dtype;
  void* data = nullptr;
  py::object y = empty({rows, dim}, tx.dtype, tx.device, &data);
  p.y = data;
  if (rows > 0) {
    void* stream = current_stream(tx.device);
    without_gil([&] { rms_norm_cuda(p, tx.device, reinterpret_cast<uintptr_t>(stream)); });
  }
  return y;
}

}  // namespace hmoe::bind
