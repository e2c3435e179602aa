// The parts of the DLPack 1.x C ABI (github.com/dmlc/dlpack) the binding layer uses to read torch
// tensors without linking libtorch: the tensor description, the versioned managed tensor, and the
// C exchange API table a framework publishes as `type(tensor).__dlpack_c_exchange_api__` (a
// PyCapsule named "dlpack_exchange_api"; torch 2.10 and newer). Layouts are fixed by the ABI.
#pragma once
#include <cstdint>

namespace hmoe::dl {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4, kBool = 6, kFloat8_e4m3fn = 10 };

struct Version {
  uint32_t major, minor;
};
struct Device {
  int32_t device_type;  // DeviceType
  int32_t device_id;
};
struct DataType {
  uint8_t code;  // TypeCode
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL means compact row-major
  uint64_t byte_offset;
};
// DLPack < 1.0 (a "dltensor" capsule).
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor*);
};
// DLPack >= 1.0 (a "dltensor_versioned" capsule, and the exchange API).
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned*);
  uint64_t flags;
  Tensor dl_tensor;
};

using SetErrorFn = void (*)(void* ctx, const char* kind, const char* message);
struct ExchangeApiHeader {
  Version version;
  ExchangeApiHeader* prev_api;
};
struct ExchangeApi {
  ExchangeApiHeader header;
  int (*managed_tensor_allocator)(Tensor* prototype, ManagedTensorVersioned** out, void* error_ctx,
                                  SetErrorFn set_error);
  int (*managed_tensor_from_py_object_no_sync)(void* py_object, ManagedTensorVersioned** out);
  int (*managed_tensor_to_py_object_no_sync)(ManagedTensorVersioned* tensor, void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, Tensor* out);  // may be NULL
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

}  // namespace hmoe::dl
