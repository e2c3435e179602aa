// The checks of the experts op's tensor arguments, for the entry points of every experts_<isa>
// module (experts_binding.cpp): weights [E, 2I, H] and [E, H, I] in one float dtype, tokens
// x [T, H], topk_ids [T, K], topk_weights [T, K], all on the CPU and contiguous.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

#include "bind/tensors.h"
#include "hmoe/experts.h"

namespace hmoe::bind {

struct ExpertWeights {
  TensorArg w13, w2;
  int64_t E, H, I;
};

inline std::string dim_error(const TensorArg& t, int axis, int64_t expected, const char* what) {
  return std::string(t.name) + " has shape " + t.shape_str() + ": dimension " + std::to_string(axis) + " must be " +
         what + " = " + std::to_string(expected);
}

inline ExpertWeights expert_weights(py::handle w13_obj, py::handle w2_obj) {
  ExpertWeights w{tensor(w13_obj, "w13", kFloats, 3, Where::kCpu), tensor(w2_obj, "w2", kFloats, 3, Where::kCpu), 0, 0,
                  0};
  if (w.w2.dtype != w.w13.dtype)
    type_error(std::string("w13 and w2 must share a dtype, got ") + dtype_name(w.w13.dtype) + " and " +
               dtype_name(w.w2.dtype));
  const int64_t E = w.w13.shape[0], two_i = w.w13.shape[1], H = w.w13.shape[2];
  if (E < 1 || H < 1 || two_i < 2 || two_i % 2)
    value_error("w13 has shape " + w.w13.shape_str() +
                ": expected [E, 2I, H] with E >= 1, an even, non-zero 2I and H >= 1");
  const int64_t I = two_i / 2;
  if (w.w2.shape[0] != E) value_error(dim_error(w.w2, 0, E, "E (w13.shape[0])"));
  if (w.w2.shape[1] != H) value_error(dim_error(w.w2, 1, H, "H (w13.shape[2])"));
  if (w.w2.shape[2] != I) value_error(dim_error(w.w2, 2, I, "I (w13.shape[1] // 2)"));
  w.E = E, w.H = H, w.I = I;
  return w;
}

// Fills the token fields of p (x, ids, weights, T, K) after checking them against H. The ids'
// range is checked by the routing pass of run_moe, which reads every id before using any.
inline void expert_tokens(py::handle x_obj, py::handle ids_obj, py::handle w_obj, int64_t H, MoeParams& p) {
  const TensorArg x = tensor(x_obj, "x", kFloats, 2, Where::kCpu);
  const TensorArg ids = tensor(ids_obj, "topk_ids", dtypes({kI32, kI64}), 2, Where::kCpu);
  const TensorArg w = tensor(w_obj, "topk_weights", dtypes({kF32}), 2, Where::kCpu);
  const int64_t T = x.shape[0];
  if (x.shape[1] != H) value_error(dim_error(x, 1, H, "H (the experts' hidden size)"));
  if (ids.shape[0] != T)
    value_error("topk_ids has " + std::to_string(ids.shape[0]) + " rows, x has " + std::to_string(T) + " tokens");
  const int64_t K = ids.shape[1];
  if (K < 1) value_error("topk_ids has shape " + ids.shape_str() + ": top-k must be at least 1");
  if (w.shape[0] != T || w.shape[1] != K)
    value_error("topk_weights has shape " + w.shape_str() + ", expected (" + std::to_string(T) + ", " +
                std::to_string(K) + ") like topk_ids");
  p.x = x.data, p.x_dtype = x.dtype, p.topk_ids = ids.data, p.ids_dtype = ids.dtype;
  p.topk_weights = static_cast<const float*>(w.data), p.T = T, p.K = K;
}

// p.out: `out` checked ([T, H] in x's dtype, sharing no byte with the inputs), or a new tensor.
inline py::object expert_output(py::handle out, const TensorArg& w13, const TensorArg& w2, MoeParams& p) {
  if (out.is_none()) {
    void* data = nullptr;
    py::object result = empty({p.T, p.H}, p.x_dtype, -1, &data);
    p.out = data;
    return result;
  }
  const TensorArg o = tensor(out, "out", dtypes({p.x_dtype}), 2, Where::kCpu);
  if (o.shape[0] != p.T || o.shape[1] != p.H)
    value_error("out has shape " + o.shape_str() + ", expected (" + std::to_string(p.T) + ", " + std::to_string(p.H) +
                ") like x");
  const char* o0 = static_cast<const char*>(o.data);
  const struct {
    const char* name;
    const void* data;
    int64_t bytes;
  } inputs[] = {{"x", p.x, p.T * p.H * dtype_size(p.x_dtype)},
                {"topk_ids", p.topk_ids, p.T * p.K * dtype_size(p.ids_dtype)},
                {"topk_weights", p.topk_weights, p.T * p.K * 4},
                {w13.name, w13.data, w13.bytes()},
                {w2.name, w2.data, w2.bytes()}};
  for (const auto& in : inputs) {
    const char* t0 = static_cast<const char*>(in.data);
    if (o.bytes() > 0 && in.bytes > 0 && t0 < o0 + o.bytes() && o0 < t0 + in.bytes)
      value_error(std::string("out overlaps ") + in.name +
                  " in memory; the kernel would overwrite its own input: "
                  "pass a separate output tensor");
  }
  p.out = o.data;
  return py::reinterpret_borrow<py::object>(out);
}

}  // namespace hmoe::bind
