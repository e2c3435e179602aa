// The binding layer's view of torch tensors. Every tensor argument of every entry point is read
// here, through the DLPack C exchange API torch publishes (no libtorch is linked: the wheel works
// with any torch), and checked against what its entry point expects before any pointer is used.
// Outputs and workspaces are allocated through the same API, on torch's allocator and current
// stream. Without the exchange API (torch older than 2.10), a slower Python fallback serves.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bind/dlpack_abi.h"
#include "hmoe/dtype.h"

namespace hmoe::bind {
namespace py = pybind11;

enum class Where { kAny, kCpu, kCuda, kCpuOrCuda };

// A bit per DType code: which element types an argument may have.
constexpr uint32_t dtypes(std::initializer_list<int32_t> codes) {
  uint32_t m = 0;
  for (int32_t c : codes) m |= 1u << c;
  return m;
}
constexpr uint32_t kFloats = dtypes({kF32, kF16, kBF16});
constexpr uint32_t kHalves = dtypes({kBF16, kF16});

constexpr int kMaxDims = 8;

// A checked tensor argument; its pointers are valid until the entry point returns.
struct TensorArg {
  const char* name = nullptr;
  py::handle obj;
  void* data = nullptr;  // first element (the view's byte offset applied)
  int32_t dtype = -1;    // DType
  int32_t ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t numel = 0;
  int32_t device = -1;  // CUDA ordinal; -1 for host memory; -2 for anything else
  bool contiguous = true;

  bool cuda() const { return device >= 0; }
  int64_t bytes() const { return numel * dtype_size(dtype); }
  std::string shape_str() const;   // as Python prints tuple(t.shape): "(2, 3)", "(5,)"
  std::string device_str() const;  // "cpu", "cuda:0"
};

// Called once per module from Python (hmoe/_native/torch_binding.py) before any entry point:
// `api` is torch.Tensor.__dlpack_c_exchange_api__ or None, `plain` the tuple of accepted tensor
// types (torch.Tensor, torch.nn.Parameter), `fallback` the object used when api is None (methods
// dlpack(t) -> capsule, empty(shape, dtype_code, device) -> tensor, stream(device) -> int).
void bind_torch(py::handle api, py::handle plain, py::handle fallback);

// The checks, in this order (the first failure is a TypeError or ValueError naming `name`): a plain
// tensor (not a subclass), dense with storage, `ndim` dimensions (-1: any), a dtype in `mask`,
// on `where`, no lazy negation, contiguous (unless `contiguous` is false), a non-null pointer.
TensorArg tensor(py::handle obj, const char* name, uint32_t mask, int ndim, Where where, bool contiguous = true);
inline bool is_none(py::handle obj) { return obj.is_none(); }

// A new contiguous tensor from torch's allocator on `device` (-1: CPU; on CUDA stream-ordered on
// the current stream, like torch.empty); *data receives its first element's address.
py::object empty(std::initializer_list<int64_t> shape, int32_t dtype, int32_t device, void** data);

// The current CUDA stream of `device`, as torch sees it (torch.cuda.current_stream).
void* current_stream(int32_t device);

// Error helpers: the message says which argument and what is wrong.
[[noreturn]] void type_error(const std::string& msg);
[[noreturn]] void value_error(const std::string& msg);

// Both arguments on the same device, else a ValueError naming them.
void same_device(const TensorArg& a, const TensorArg& b);

// A ValueError unless each tensor starts on a 16-byte boundary (the kernels' vector loads and stores).
void aligned16(std::initializer_list<const TensorArg*> tensors);

// A ValueError unless `written` shares no byte with any of `read`: a kernel writes it while it reads them.
void no_overlap(const TensorArg& written, std::initializer_list<const TensorArg*> read);

}  // namespace hmoe::bind
