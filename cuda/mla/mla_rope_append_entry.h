// mla_rope_append's entry point for a CUDA family module (host code): the arguments of
// hmoe.ops.mla_rope_append checked in the order it documents (the cache's checks are mla_decode's),
// q_pe_out allocated on torch's allocator, and the launch on torch's current stream.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

#include "bind/gil.h"
#include "bind/scalars.h"
#include "bind/tensors.h"
#include "mla/mla_decode_entry.h"
#include "mla/mla_rope_append.h"

namespace hmoe::bind {

inline int32_t rope_layout_arg(py::handle layout) {
  if (PyUnicode_Check(layout.ptr())) {
    const std::string s = layout.cast<std::string>();
    if (s == "interleaved") return kRopeInterleaved;
    if (s == "half") return kRopeHalf;
    if (s == "interleaved_to_half") return kRopeInterleavedToHalf;
  }
  value_error("rope_layout must be 'interleaved', 'half' or 'interleaved_to_half', got " +
              py::repr(layout).cast<std::string>());
}

inline py::object mla_rope_append_entry(py::handle q, py::handle kv, py::handle norm_weight, py::handle cos,
                                        py::handle sin, py::handle ckv_cache, py::handle kpe_cache,
                                        py::handle page_table, py::handle seq_lens, py::handle eps,
                                        py::handle rope_layout) {
  const TensorArg tq = tensor(q, "q", kHalves, 3, Where::kCuda);
  const uint32_t same = dtypes({tq.dtype});
  const TensorArg tkv = tensor(kv, "kv", same, 2, Where::kCuda);
  same_device(tq, tkv);
  const TensorArg tw = tensor(norm_weight, "norm_weight", same, 1, Where::kCuda);
  same_device(tq, tw);
  const TensorArg tc = tensor(cos, "cos", kFloats, 2, Where::kCuda);
  same_device(tq, tc);
  const TensorArg ts = tensor(sin, "sin", dtypes({tc.dtype}), 2, Where::kCuda);
  same_device(tq, ts);
  const int64_t B = tq.shape[0], H = tq.shape[1], q_dim = tq.shape[2];
  const std::string R = std::to_string(kMlaDimCkv), D = std::to_string(kMlaDimPe);
  if (H < 1 || H > kMlaMaxHeads)
    value_error("q has " + std::to_string(H) + " heads; mla_rope_append supports 1 to " + std::to_string(kMlaMaxHeads));
  if (q_dim < kMlaDimPe)
    value_error("q has shape " + tq.shape_str() + ": its last dimension (nope + rope) must be at least " + D);
  if (tkv.shape[0] != B || tkv.shape[1] != kMlaDimCkv + kMlaDimPe)
    value_error("kv has shape " + tkv.shape_str() + ", expected (" + std::to_string(B) + ", " +
                std::to_string(kMlaDimCkv + kMlaDimPe) + ") (the latent, then k_pe)");
  if (tw.shape[0] != kMlaDimCkv) value_error("norm_weight has shape " + tw.shape_str() + ", expected (" + R + ",)");
  if ((tc.shape[0] != 1 && tc.shape[0] != B) || tc.shape[1] != kMlaDimPe)
    value_error("cos has shape " + tc.shape_str() + ", expected (1, " + D + ") or (" + std::to_string(B) + ", " + D +
                ")");
  if (ts.shape[0] != tc.shape[0] || ts.shape[1] != kMlaDimPe)
    value_error("sin has shape " + ts.shape_str() + ", expected cos's " + tc.shape_str());
  const MlaCacheArgs cache = mla_cache_args(tq, B, ckv_cache, kpe_cache, page_table, seq_lens);
  for (const TensorArg* t : {&cache.ckv, &cache.kpe})  // written while the others are read
    no_overlap(*t, {&tq, &tkv, &tw, &tc, &ts, &cache.pt, &cache.lens});
  MlaRopeAppendParams p{};
  p.eps = nonnegative_float_arg(eps, "eps");
  p.layout = rope_layout_arg(rope_layout);
  p.q = tq.data, p.kv = tkv.data, p.norm_weight = tw.data, p.cos = tc.data, p.sin = ts.data;
  p.ckv = cache.ckv.data, p.kpe = cache.kpe.data;
  p.page_table = static_cast<const int32_t*>(cache.pt.data), p.seq_lens = static_cast<const int32_t*>(cache.lens.data);
  p.batch = int32_t(B), p.heads = int32_t(H), p.q_dim = int32_t(q_dim), p.cos_rows = int32_t(tc.shape[0]);
  p.page_size = int32_t(cache.ckv.shape[1]), p.max_pages = int32_t(cache.pt.shape[1]);
  p.num_pages = int32_t(cache.ckv.shape[0]), p.dtype = tq.dtype, p.cos_dtype = tc.dtype;
  void* data = nullptr;
  py::object q_pe = empty({B, H, kMlaDimPe}, tq.dtype, tq.device, &data);
  p.q_pe_out = data;
  if (B > 0) {
    void* stream = current_stream(tq.device);
    without_gil([&] { mla_rope_append_cuda(p, tq.device, reinterpret_cast<uintptr_t>(stream)); });
  }
  return q_pe;
}

}  // namespace hmoe::bind
