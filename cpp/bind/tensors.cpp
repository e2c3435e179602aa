// TensorArg: torch tensors read through the DLPack C exchange API (see tensors.h).
#include "bind/tensors.h"

#include <cctype>
#include <exception>
#include <stdexcept>
#include <string>

namespace hmoe::bind {
namespace {

// The module's binding to torch. Plain PyObject* on purpose: these references live for the
// process (a py::object here would be released after the interpreter shut down).
struct Torch {
  const dl::ExchangeApi* api = nullptr;
  PyObject* tensor_type = nullptr;  // torch.Tensor: isinstance checks
  PyTypeObject* plain[4] = {};      // the exact types accepted
  int n_plain = 0;
  PyObject* fallback = nullptr;  // used when api is NULL
  PyObject* is_neg = nullptr;    // interned "is_neg"
  // torch._C._dispatch_keys, DispatchKey.Negative and interned "has": the neg bit read without
  // releasing the GIL (NULL where this torch lacks them; then is_neg everywhere).
  PyObject* dispatch_keys = nullptr;
  PyObject* negative = nullptr;
  PyObject* has = nullptr;
  unsigned long main_thread = 0;  // threading.main_thread().ident
};
Torch g;

void require_bound() {
  if (g.tensor_type == nullptr)
    throw std::runtime_error("hmoe: a native entry point ran before bind_torch (use hmoe's Python API)");
}

std::string py_str(py::handle h) { return py::str(h).cast<std::string>(); }

// torch's spelling of a tensor's dtype ("float64"), for messages only.
std::string dtype_of(py::handle obj) {
  std::string s = py_str(obj.attr("dtype"));
  return s.rfind("torch.", 0) == 0 ? s.substr(6) : s;
}

[[noreturn]] void not_plain(py::handle obj, const std::string& name) {
  PyTypeObject* tp = Py_TYPE(obj.ptr());
  if (PyObject_IsInstance(obj.ptr(), g.tensor_type) != 1) {
    PyErr_Clear();
    type_error(name + " must be a torch.Tensor, got " + tp->tp_name);
  }
  const std::string cls = py_str(py::handle(reinterpret_cast<PyObject*>(tp)).attr("__module__")) + "." +
                          py_str(py::handle(reinterpret_cast<PyObject*>(tp)).attr("__qualname__"));
  std::string lower = cls;
  for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
  const bool traced = lower.find("fake") != std::string::npos || lower.find("functional") != std::string::npos;
  const char* hint = traced ? "it has no real data (tracing under torch.compile or FakeTensorMode?): call the op "
                              "through torch.ops.hmoe, whose fake implementations handle tracing"
                            : "pass a plain tensor with its own storage (e.g. t.as_subclass(torch.Tensor) where "
                              "that is valid)";
  type_error(name + " is a " + cls +
             ", a torch.Tensor subclass: hmoe's kernels read tensor memory directly and "
             "take only plain strided tensors (torch.Tensor or nn.Parameter); " +
             hint);
}

// Where an op wants a tensor, in its error messages.
const char* where_name(Where where) {
  return where == Where::kCpu ? "CPU" : where == Where::kCuda ? "CUDA" : "CPU or CUDA";
}

// Why a plain tensor could not be viewed (sparse, meta, nested...): said in torch's words; a device hmoe
// cannot read (meta) as the device the op wants, as for any other device.
[[noreturn]] void unreadable(py::handle obj, const std::string& name, const std::string& why, Where where) {
  PyErr_Clear();
  try {
    const std::string layout = py_str(obj.attr("layout"));
    if (layout != "torch.strided")
      type_error(name + " has layout " + layout + "; hmoe's ops take dense (strided) tensors (call .to_dense() first)");
    const std::string dev = py_str(obj.attr("device"));
    if (dev.rfind("cpu", 0) != 0 && dev.rfind("cuda", 0) != 0)
      value_error(name + " must be on the " + where_name(where) + ", got device " + dev);
  } catch (const py::error_already_set&) {
    PyErr_Clear();
  }
  value_error(name + " cannot be read as a dense tensor with storage: " + why.substr(0, why.find('\n')));
}

int32_t dtype_code(const dl::DataType& t) {
  if (t.lanes != 1) return -1;
  if (t.code == dl::kFloat) return t.bits == 32 ? kF32 : t.bits == 16 ? kF16 : -1;
  if (t.code == dl::kBfloat) return t.bits == 16 ? kBF16 : -1;
  if (t.code == dl::kInt) return t.bits == 32 ? kI32 : t.bits == 64 ? kI64 : -1;
  if (t.code == dl::kUInt) return t.bits == 8 ? kU8 : -1;
  return -1;
}

dl::DataType dl_dtype(int32_t code) {
  switch (code) {
    case kF32:
      return {dl::kFloat, 32, 1};
    case kF16:
      return {dl::kFloat, 16, 1};
    case kBF16:
      return {dl::kBfloat, 16, 1};
    case kI32:
      return {dl::kInt, 32, 1};
    case kI64:
      return {dl::kInt, 64, 1};
    case kU8:
      return {dl::kUInt, 8, 1};
    default:
      throw std::invalid_argument("hmoe: no DLPack type for dtype code " + std::to_string(code));
  }
}

// Fills `a` from a DLPack description (its shape and strides are read here, while they are alive).
void fill(TensorArg& a, const dl::Tensor& v) {
  if (v.ndim > kMaxDims) value_error(std::string(a.name) + " has more than 8 dimensions");
  a.ndim = v.ndim;
  a.numel = 1;
  int64_t expected = 1;
  for (int i = a.ndim - 1; i >= 0; --i) {
    a.shape[i] = v.shape[i];
    a.numel *= v.shape[i];
    // torch's rule: dimensions of size 1 may have any stride.
    if (v.strides != nullptr && v.shape[i] != 1 && v.strides[i] != expected) a.contiguous = false;
    expected *= v.shape[i];
  }
  if (a.numel == 0) a.contiguous = true;
  a.dtype = dtype_code(v.dtype);
  a.data = v.data == nullptr ? nullptr : static_cast<char*>(v.data) + v.byte_offset;
  const int32_t type = v.device.device_type;
  a.device = type == dl::kCUDA ? v.device.device_id : (type == dl::kCPU || type == dl::kCUDAHost) ? -1 : -2;
}

// Fills `a` from obj's DLPack description: the exchange API, else the Python fallback's capsule.
void view(py::handle obj, TensorArg& a, Where where = Where::kCpuOrCuda) {
  if (g.api != nullptr && g.api->dltensor_from_py_object_no_sync != nullptr) {
    dl::Tensor v;
    int rc = -1;
    try {
      rc = g.api->dltensor_from_py_object_no_sync(obj.ptr(), &v);
    } catch (const std::exception& e) {  // torch's implementation throws for sparse tensors
      unreadable(obj, a.name, e.what(), where);
    }
    if (rc != 0) {
      py::error_already_set err;
      unreadable(obj, a.name, err.what(), where);
    }
    fill(a, v);
    return;
  }
  py::object cap;
  try {
    cap = py::reinterpret_borrow<py::object>(g.fallback).attr("dlpack")(obj);
  } catch (const py::error_already_set& e) {
    unreadable(obj, a.name, e.what(), where);
  }
  auto* m = static_cast<dl::ManagedTensor*>(PyCapsule_GetPointer(cap.ptr(), "dltensor"));
  if (m == nullptr) unreadable(obj, a.name, "torch gave no DLPack capsule", where);
  fill(a, m->dl_tensor);  // the data outlives the capsule: `obj` holds it
}

}  // namespace

std::string TensorArg::shape_str() const {
  std::string s = "(";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (ndim == 1 ? ",)" : ")");
}

std::string TensorArg::device_str() const {
  if (device == -2) return py_str(obj.attr("device"));
  return device < 0 ? "cpu" : "cuda:" + std::to_string(device);
}

void type_error(const std::string& msg) { throw py::type_error(msg); }
void value_error(const std::string& msg) { throw py::value_error(msg); }

void bind_torch(py::handle api, py::handle plain, py::handle fallback) {
  if (!api.is_none()) {
    auto* table = static_cast<const dl::ExchangeApi*>(PyCapsule_GetPointer(api.ptr(), "dlpack_exchange_api"));
    if (table == nullptr) throw py::error_already_set();
    if (table->header.version.major != 1)
      throw std::runtime_error("hmoe: torch's DLPack exchange API is version " +
                               std::to_string(table->header.version.major) + ".x; hmoe reads 1.x");
    g.api = table;
  }
  py::tuple types = py::reinterpret_borrow<py::tuple>(plain);
  if (types.size() < 1 || types.size() > 4) throw std::invalid_argument("bind_torch: 1 to 4 plain tensor types");
  g.n_plain = 0;
  for (py::handle t : types) {
    Py_INCREF(t.ptr());  // held for the process (see Torch)
    g.plain[g.n_plain++] = reinterpret_cast<PyTypeObject*>(t.ptr());
  }
  g.tensor_type = types[0].ptr();
  Py_INCREF(fallback.ptr());
  g.fallback = fallback.ptr();
  g.is_neg = PyUnicode_InternFromString("is_neg");
  try {
    py::module_ c = py::module_::import("torch._C");
    py::object keys = c.attr("_dispatch_keys"), negative = c.attr("DispatchKey").attr("Negative");
    g.dispatch_keys = keys.release().ptr();  // held for the process (see Torch)
    g.negative = negative.release().ptr();
    g.has = PyUnicode_InternFromString("has");
    g.main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  } catch (const py::error_already_set&) {
    PyErr_Clear();
  }
}

namespace {

// Whether obj is a lazily negated view (its memory holds the negated values). torch's is_neg()
// releases the GIL inside, and a thread other than the one finalising the interpreter that asks for
// the GIL back meanwhile is ended there by pthread_exit, whose unwinding through torch's (noexcept)
// GIL guard aborts the process. A daemon thread looping short CPU expert calls spent enough of its
// time in that window to abort every exit of a lab script; so outside the main thread the bit of a
// CPU tensor is read from its dispatch keys, which keeps the GIL (about 0.4 us a tensor against 0.1
// for is_neg). CUDA tensors keep is_neg: their ops' wrappers call torch functions that release the
// GIL anyway.
bool negated(py::handle obj, int device) {
  PyObject* r = nullptr;
  if (device == -1 && g.dispatch_keys != nullptr && PyThread_get_thread_ident() != g.main_thread) {
    PyObject* keys = PyObject_CallOneArg(g.dispatch_keys, obj.ptr());
    if (keys == nullptr) throw py::error_already_set();
    r = PyObject_CallMethodOneArg(keys, g.has, g.negative);
    Py_DECREF(keys);
  } else {
    r = PyObject_CallMethodNoArgs(obj.ptr(), g.is_neg);
  }
  if (r == nullptr) throw py::error_already_set();
  const int yes = PyObject_IsTrue(r);
  Py_DECREF(r);
  if (yes < 0) throw py::error_already_set();
  return yes == 1;
}

}  // namespace

TensorArg tensor(py::handle obj, const char* name, uint32_t mask, int ndim, Where where, bool contiguous) {
  require_bound();
  TensorArg a;
  a.name = name;
  a.obj = obj;
  PyTypeObject* tp = Py_TYPE(obj.ptr());
  bool plain = false;
  for (int i = 0; i < g.n_plain; ++i) plain |= tp == g.plain[i];
  if (!plain) not_plain(obj, name);
  view(obj, a, where);
  if (ndim >= 0 && a.ndim != ndim)
    value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got shape " + a.shape_str());
  if (a.dtype < 0 || !((mask >> a.dtype) & 1u)) {
    std::string allowed;
    for (int32_t c = 0; c < kNumDTypes; ++c)
      if ((mask >> c) & 1u) allowed += (allowed.empty() ? "" : ", ") + std::string(dtype_name(c));
    type_error(std::string(name) + " must have dtype " + allowed + "; got " + dtype_of(obj));
  }
  const bool ok = where == Where::kAny || (where == Where::kCpu && a.device == -1) ||
                  (where == Where::kCuda && a.device >= 0) || (where == Where::kCpuOrCuda && a.device >= -1);
  if (!ok) value_error(std::string(name) + " must be on the " + where_name(where) + ", got device " + a.device_str());
  if (negated(obj, a.device))
    value_error(std::string(name) +
                " is a lazily negated/conjugated view; its memory does not hold its values "
                "(call .resolve_neg() / .resolve_conj() first)");
  if (contiguous && !a.contiguous)
    value_error(std::string(name) + " must be contiguous (call .contiguous() on it first)");
  if (a.data == nullptr && a.numel > 0)
    value_error(std::string(name) + " has no storage (data_ptr() is 0) although it holds " + std::to_string(a.numel) +
                " elements");
  return a;
}

void same_device(const TensorArg& a, const TensorArg& b) {
  if (a.device != b.device)
    value_error(std::string(b.name) + " is on " + b.device_str() + ", " + a.name + " on " + a.device_str() +
                ": all inputs must share a device");
}

void aligned16(std::initializer_list<const TensorArg*> tensors) {
  for (const TensorArg* t : tensors)
    if (reinterpret_cast<uintptr_t>(t->data) % 16)
      value_error(std::string(t->name) + " must start on a 16-byte boundary (it is a view at an odd offset)");
}

void no_overlap(const TensorArg& written, std::initializer_list<const TensorArg*> read) {
  const char* w0 = static_cast<const char*>(written.data);
  for (const TensorArg* t : read) {
    const char* t0 = static_cast<const char*>(t->data);
    if (written.bytes() > 0 && t->bytes() > 0 && t0 < w0 + written.bytes() && w0 < t0 + t->bytes())
      value_error(std::string(written.name) + " overlaps " + t->name +
                  " in memory; the kernel would overwrite its own input: pass a separate tensor as " + written.name);
  }
}

py::object empty(std::initializer_list<int64_t> shape, int32_t dtype, int32_t device, void** data) {
  require_bound();
  int64_t dims[kMaxDims];
  int n = 0;
  for (int64_t d : shape) dims[n++] = d;
  if (g.api != nullptr) {
    dl::Tensor proto{
        nullptr, {device >= 0 ? dl::kCUDA : dl::kCPU, device >= 0 ? device : 0}, n, dl_dtype(dtype), dims, nullptr, 0};
    dl::ManagedTensorVersioned* made = nullptr;
    auto set_error = [](void*, const char* kind, const char* message) {
      PyErr_SetString(std::string(kind) == "MemoryError" ? PyExc_MemoryError : PyExc_RuntimeError, message);
    };
    if (g.api->managed_tensor_allocator(&proto, &made, nullptr, set_error) != 0 || made == nullptr)
      throw py::error_already_set();
    *data = static_cast<char*>(made->dl_tensor.data) + made->dl_tensor.byte_offset;
    void* obj = nullptr;
    if (g.api->managed_tensor_to_py_object_no_sync(made, &obj) != 0) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(static_cast<PyObject*>(obj));
  }
  py::tuple t(n);
  for (int i = 0; i < n; ++i) t[i] = py::int_(dims[i]);
  py::object result = py::reinterpret_borrow<py::object>(g.fallback).attr("empty")(t, dtype, device);
  TensorArg a;
  a.name = "output";
  view(result, a);
  *data = a.data;
  return result;
}

void* current_stream(int32_t device) {
  require_bound();
  if (g.api != nullptr) {
    void* s = nullptr;
    if (g.api->current_work_stream(dl::kCUDA, device, &s) != 0) throw py::error_already_set();
    return s;
  }
  return reinterpret_cast<void*>(
      py::reinterpret_borrow<py::object>(g.fallback).attr("stream")(device).cast<uintptr_t>());
}

}  // namespace hmoe::bind
