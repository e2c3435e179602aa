// decode_linear's entry point for a CUDA family module (host code): the arguments of
// hmoe.ops.decode_linear checked in the order it documents, y allocated on torch's allocator, and the
// launch on torch's current stream.
#pragma once
#include <pybind11/pybind11.h>

#include <climits>
#include <string>

#include "bind/gil.h"
#include "bind/scalars.h"
#include "bind/tensors.h"
#include "linear/decode_linear.h"

namespace hmoe::bind {

inline py::object decode_linear_entry(py::handle x, py::handle weight, py::handle fp32_out) {
  const TensorArg tx = tensor(x, "x", kHalves, 2, Where::kCuda);
  const TensorArg tw = tensor(weight, "weight", dtypes({tx.dtype}), 2, Where::kCuda);
  same_device(tx, tw);
  const int64_t M = tx.shape[0], K = tx.shape[1], N = tw.shape[0];
  if (M > kDecodeLinearMaxRows)
    value_error("x has " + std::to_string(M) + " rows; decode_linear takes at most " +
                std::to_string(kDecodeLinearMaxRows) + " (a decode step's tokens): use a matmul for more");
  if (tw.shape[1] != K)
    value_error("weight has shape " + tw.shape_str() + ", x " + tx.shape_str() + ": weight must be [N, " +
                std::to_string(K) + "] (nn.Linear's layout)");
  if (K < 8 || K % 8)
    value_error("x has " + std::to_string(K) + " columns; decode_linear takes a positive multiple of 8");
  if (N < 1 || N > INT32_MAX || K > INT32_MAX)
    value_error("weight has shape " + tw.shape_str() + "; decode_linear takes 1 to 2^31 - 1 rows and columns");
  aligned16({&tx, &tw});
  DecodeLinearParams p{};
  p.x = tx.data, p.weight = tw.data;
  p.m = int32_t(M), p.n = int32_t(N), p.k = int32_t(K), p.dtype = tx.dtype;
  p.out_dtype = bool_arg(fp32_out, "fp32_out") ? int32_t(kF32) : tx.dtype;
  void* data = nullptr;
  py::object y = empty({M, N}, p.out_dtype, tx.device, &data);
  p.y = data;
  if (M > 0) {
    void* stream = current_stream(tx.device);
    without_gil([&] { decode_linear_cuda(p, tx.device, reinterpret_cast<uintptr_t>(stream)); });
  }
  return y;
}

}  // namespace hmoe::bind
