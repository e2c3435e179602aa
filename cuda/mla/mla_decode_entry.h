// mla_decode's entry points for a CUDA family module (host code): the arguments of
// hmoe.ops.mla_decode checked in the order it documents, the plan computed once per shape and
// cached, the output, lse and split partials allocated on torch's allocator, and the launch on
// torch's current stream. The family's kernels come from cuda/mla/mla_decode.h.
#pragma once
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <map>
#include <mutex>
#include <string>

#include "bind/gil.h"
#include "bind/plan_cache.h"
#include "bind/scalars.h"
#include "bind/tensors.h"
#include "mla/mla_decode.h"

namespace hmoe::bind {

struct MlaCall {
  MlaDecodeParams p{};
  TensorArg q_nope, out;  // out.obj is None when the entry allocates it
};

// The paged cache arguments mla_decode and mla_rope_append share, checked against the op's query
// tensor `q` (its dtype, device and batch B).
struct MlaCacheArgs {
  TensorArg ckv, kpe, pt, lens;
};

inline MlaCacheArgs mla_cache_args(const TensorArg& q, int64_t B, py::handle ckv_cache, py::handle kpe_cache,
                                   py::handle page_table, py::handle seq_lens) {
  MlaCacheArgs c;
  const uint32_t i32 = dtypes({kI32});
  c.ckv = tensor(ckv_cache, "ckv_cache", kHalves, 3, Where::kCuda);
  same_device(q, c.ckv);
  c.kpe = tensor(kpe_cache, "kpe_cache", kHalves, 3, Where::kCuda);
  same_device(q, c.kpe);
  c.pt = tensor(page_table, "page_table", i32, 2, Where::kCuda);
  same_device(q, c.pt);
  c.lens = tensor(seq_lens, "seq_lens", i32, 1, Where::kCuda);
  same_device(q, c.lens);
  for (const TensorArg* t : {&c.ckv, &c.kpe})
    if (t->dtype != q.dtype)
      type_error(std::string(t->name) + " has dtype " + dtype_name(t->dtype) + ", " + q.name + " " +
                 dtype_name(q.dtype) + ": they must match");
  const int64_t P = c.ckv.shape[0], page = c.ckv.shape[1];
  if (c.ckv.shape[2] != kMlaDimCkv)
    value_error("ckv_cache has shape " + c.ckv.shape_str() + ": the last dimension must be " +
                std::to_string(kMlaDimCkv));
  if (page < 1 || P < 1) value_error("ckv_cache has shape " + c.ckv.shape_str() + ": no pages");
  if (P * page > INT32_MAX)  // the kernels index cache rows with int32 (2.4 TB of bf16 latents)
    value_error("ckv_cache has " + std::to_string(P * page) + " token rows; mla_decode supports fewer than 2^31");
  if (c.kpe.shape[0] != P || c.kpe.shape[1] != page || c.kpe.shape[2] != kMlaDimPe)
    value_error("kpe_cache has shape " + c.kpe.shape_str() + ", expected (" + std::to_string(P) + ", " +
                std::to_string(page) + ", " + std::to_string(kMlaDimPe) + ")");
  const int64_t max_pages = c.pt.shape[1];
  if (c.pt.shape[0] != B || max_pages < 1)
    value_error("page_table has shape " + c.pt.shape_str() + ", expected [" + std::to_string(B) + ", max_pages >= 1]");
  if (c.lens.shape[0] != B)
    value_error("seq_lens has shape " + c.lens.shape_str() + ", expected (" + std::to_string(B) + ",)");
  if (B > kMlaMaxBatch)
    value_error(std::string(q.name) + " has batch " + std::to_string(B) + "; the MLA kernels run at most " +
                std::to_string(kMlaMaxBatch) + " requests a call (the CUDA grid's limit): split the batch");
  if (max_pages * page > INT32_MAX || B * max_pages > INT32_MAX)
    value_error("page_table [" + std::to_string(B) + ", " + std::to_string(max_pages) + "] with page size " +
                std::to_string(page) +
                ": a request's capacity (max_pages * page_size) and the table (batch * "
                "max_pages) must stay below 2^31");
  return c;
}

inline MlaCall mla_decode_args(py::handle q_nope, py::handle q_pe, py::handle ckv_cache, py::handle kpe_cache,
                               py::handle page_table, py::handle seq_lens, py::handle sm_scale, py::handle out) {
  MlaCall c;
  const TensorArg qn = tensor(q_nope, "q_nope", kHalves, 3, Where::kCuda);
  const TensorArg qp = tensor(q_pe, "q_pe", kHalves, 3, Where::kCuda);
  same_device(qn, qp);
  if (qp.dtype != qn.dtype)
    type_error(std::string("q_pe has dtype ") + dtype_name(qp.dtype) + ", q_nope " + dtype_name(qn.dtype) +
               ": they must match");
  const int64_t B = qn.shape[0], H = qn.shape[1];
  if (qn.shape[2] != kMlaDimCkv)
    value_error("q_nope has shape " + qn.shape_str() + ": the last dimension must be " + std::to_string(kMlaDimCkv));
  if (H < 1 || H > kMlaMaxHeads)
    value_error("q_nope has " + std::to_string(H) + " heads; mla_decode supports 1 to " + std::to_string(kMlaMaxHeads));
  if (qp.shape[0] != B || qp.shape[1] != H || qp.shape[2] != kMlaDimPe)
    value_error("q_pe has shape " + qp.shape_str() + ", expected (" + std::to_string(B) + ", " + std::to_string(H) +
                ", " + std::to_string(kMlaDimPe) + ")");
  const MlaCacheArgs cache = mla_cache_args(qn, B, ckv_cache, kpe_cache, page_table, seq_lens);
  const TensorArg &ckv = cache.ckv, &kpe = cache.kpe, &pt = cache.pt, &lens = cache.lens;
  const int64_t P = ckv.shape[0], page = ckv.shape[1], max_pages = pt.shape[1];
  aligned16({&qn, &qp, &ckv, &kpe});
  c.p.sm_scale = float_arg(sm_scale, "sm_scale");
  if (!out.is_none()) {
    c.out = tensor(out, "out", dtypes({qn.dtype}), 3, Where::kCuda);
    const TensorArg& o = c.out;
    if (o.shape[0] != B || o.shape[1] != H || o.shape[2] != kMlaDimCkv || o.device != qn.device ||
        reinterpret_cast<uintptr_t>(o.data) % 16)
      value_error("out must be a 16-byte aligned [" + std::to_string(B) + ", " + std::to_string(H) + ", " +
                  std::to_string(kMlaDimCkv) + "] tensor on " + qn.device_str());
    no_overlap(o, {&qn, &qp, &ckv, &kpe, &pt, &lens});  // written while they are read
  }
  MlaDecodeParams& p = c.p;
  p.q_nope = qn.data, p.q_pe = qp.data, p.ckv = ckv.data, p.kpe = kpe.data;
  p.page_table = static_cast<const int32_t*>(pt.data), p.seq_lens = static_cast<const int32_t*>(lens.data);
  p.batch = int32_t(B), p.heads = int32_t(H), p.page_size = int32_t(page), p.max_pages = int32_t(max_pages);
  p.num_pages = int32_t(P), p.dtype = qn.dtype;
  c.q_nope = qn;
  return c;
}

// The family's plan for a shape, computed once per (device, shape, overrides).
inline MlaDecodePlan mla_decode_cached_plan(int device, int batch, int heads, int max_pages, int page_size, int config,
                                            bool allow_tma) {
  return cached_plan<MlaDecodePlan>(
      std::array<int64_t, 7>{device, batch, heads, max_pages, page_size, config, allow_tma},
      [&] { return mla_decode_plan(device, batch, heads, max_pages, page_size, config, allow_tma); });
}

// Where a call's split partials go, and how its two kernels (decode, combine) are launched. Eager
// calls reuse one grow-only buffer per (device, stream) and launch through the stream's EagerGraph
// (common/launch.h: one graph launch costs the host less than two kernel launches): the stream
// orders its users, and the buffer's lock is held while a call enqueues its kernels, so calls from
// several threads never interleave on it. Under graph capture every call gets its own allocation
// from torch (the graph's private pool: a graph never shares memory with later eager calls) and
// launches its kernels directly, into the captured graph. The buffers live until the process ends.
class Partials {
 public:
  Partials(int device, void* stream, int64_t floats) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess)
      throw std::runtime_error("mla_decode: cudaStreamIsCapturing failed");
    void* data = nullptr;
    if (status != cudaStreamCaptureStatusNone) {
      own_ = empty({floats}, kF32, device, &data);
      data_ = static_cast<float*>(data);
      return;
    }
    static std::mutex map_mu;
    static std::map<std::pair<int, void*>, Buffer*> buffers;  // leaked on purpose, like the tensors they hold
    {
      std::lock_guard<std::mutex> lock(map_mu);
      Buffer*& b = buffers[{device, stream}];
      if (b == nullptr) b = new Buffer();
      buf_ = b;
    }
    lock_ = std::unique_lock<std::mutex>(buf_->mu);
    if (buf_->floats < floats) {
      py::object grown = empty({floats}, kF32, device, &data);
      // The old block returns to torch's allocator, which reuses it in this stream's order.
      Py_XDECREF(buf_->tensor);
      buf_->tensor = grown.release().ptr();
      buf_->data = static_cast<float*>(data);
      buf_->floats = floats;
    }
    data_ = buf_->data;
  }
  float* data() const { return data_; }
  // The stream's eager graph (the lock held), or nullptr under capture.
  EagerGraph* graph() const { return buf_ == nullptr ? nullptr : &buf_->graph; }
  // Called once the kernels are enqueued, before the GIL is taken back (a thread holding the GIL
  // may be waiting for this lock).
  void unlock() {
    if (lock_.owns_lock()) lock_.unlock();
  }

 private:
  struct Buffer {
    std::mutex mu;
    PyObject* tensor = nullptr;  // a torch tensor from the exchange API's allocator
    float* data = nullptr;
    int64_t floats = 0;
    EagerGraph graph;
  };
  Buffer* buf_ = nullptr;
  std::unique_lock<std::mutex> lock_;  // held until unlock(): the call's kernels are enqueued
  py::object own_;
  float* data_ = nullptr;
};

inline py::object mla_decode_entry(py::handle q_nope, py::handle q_pe, py::handle ckv_cache, py::handle kpe_cache,
                                   py::handle page_table, py::handle seq_lens, py::handle sm_scale, py::handle out,
                                   py::handle return_lse, int32_t config, py::handle allow_tma) {
  MlaCall c = mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seq_lens, sm_scale, out);
  const bool want_lse = bool_arg(return_lse, "return_lse");
  MlaDecodeParams& p = c.p;
  const int device = c.q_nope.device;
  py::object result = py::reinterpret_borrow<py::object>(out);
  void* data = nullptr;
  if (out.is_none()) {
    result = empty({p.batch, p.heads, kMlaDimCkv}, p.dtype, device, &data);
    p.out = data;
  } else {
    p.out = c.out.data;
  }
  py::object lse;
  if (want_lse) {
    lse = empty({p.batch, p.heads}, kF32, device, &data);
    p.lse = static_cast<float*>(data);
  }
  if (p.batch > 0) {
    const MlaDecodePlan plan = mla_decode_cached_plan(device, p.batch, p.heads, p.max_pages, p.page_size, config,
                                                      bool_arg(allow_tma, "allow_tma"));
    p.num_splits = plan.num_splits;
    void* stream = current_stream(device);
    if (plan.num_splits == 1 || plan.cluster > 1) {  // no partials
      without_gil([&] { mla_decode_launch(p, plan, device, reinterpret_cast<uintptr_t>(stream)); });
    } else {  // [splits, B, H, 512] then [splits, B, H], fp32
      const int64_t n = int64_t(plan.num_splits) * p.batch * p.heads;
      Partials partials(device, stream, n * (kMlaDimCkv + 1));
      p.partial_o = partials.data();
      p.partial_lse = p.partial_o + n * kMlaDimCkv;
      without_gil([&] {
        try {
          mla_decode_launch(p, plan, device, reinterpret_cast<uintptr_t>(stream), partials.graph());
        } catch (...) {
          partials.unlock();
          throw;
        }
        partials.unlock();
      });
    }
  }
  if (!want_lse) return result;
  return py::make_tuple(result, lse);
}

}  // namespace hmoe::bind
