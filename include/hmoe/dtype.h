// Dtype codes shared by every native module (values from constants.h): the element type travels
// with each tensor as one of these, never as an assumed constant.
#pragma once
#include <cstdint>

#include "hmoe/constants.h"

namespace hmoe {

enum DType : int32_t {
  kF32 = k::dtype_float32,
  kF16 = k::dtype_float16,
  kBF16 = k::dtype_bfloat16,
  kI32 = k::dtype_int32,
  kI64 = k::dtype_int64,
  kU8 = k::dtype_uint8,
};
constexpr int32_t kNumDTypes = 6;  // the codes are 0 .. kNumDTypes - 1

inline const char* dtype_name(int32_t code) {
  switch (code) {
    case kF32:
      return "float32";
    case kF16:
      return "float16";
    case kBF16:
      return "bfloat16";
    case kI32:
      return "int32";
    case kI64:
      return "int64";
    case kU8:
      return "uint8";
    default:
      return "unknown";
  }
}

inline bool is_float_dtype(int32_t code) { return code == kF32 || code == kF16 || code == kBF16; }
inline int64_t dtype_size(int32_t code) {
  return code == kF32 || code == kI32 ? 4 : code == kI64 ? 8 : code == kU8 ? 1 : 2;
}

}  // namespace hmoe
