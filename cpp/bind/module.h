// What every native module's binding is built from: the entry points of include/hmoe/signatures.h
// become pybind11 functions whose parameter lists are generated from the spec (HMOE_DEF), and the
// four exports every module has (abi_version, signatures, constants, bind_torch); def_common also
// registers the exit hook that without_gil (bind/gil.h) relies on.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "bind/gil.h"
#include "bind/scalars.h"
#include "bind/tensors.h"
#include "hmoe/abi.h"
#include "hmoe/constants.h"
#include "hmoe/signatures.h"

// C++ types of the spec's argument kinds.
#define HMOE_T_tensor pybind11::handle
#define HMOE_T_tensor_or_none pybind11::handle
#define HMOE_T_int pybind11::handle
#define HMOE_T_float pybind11::handle
#define HMOE_T_bool pybind11::handle
#define HMOE_T_str pybind11::handle
#define HMOE_T_i32 int32_t
#define HMOE_T_i64 int64_t
#define HMOE_T_u32 uint32_t

// HMOE_FOR_EACH(M, (a, b), (c, d), ...) -> M (a, b), M (c, d), ...  (up to 16 pairs)
#define HMOE_FE_1(M, p) M p
#define HMOE_FE_2(M, p, ...) M p, HMOE_FE_1(M, __VA_ARGS__)
#define HMOE_FE_3(M, p, ...) M p, HMOE_FE_2(M, __VA_ARGS__)
#define HMOE_FE_4(M, p, ...) M p, HMOE_FE_3(M, __VA_ARGS__)
#define HMOE_FE_5(M, p, ...) M p, HMOE_FE_4(M, __VA_ARGS__)
#define HMOE_FE_6(M, p, ...) M p, HMOE_FE_5(M, __VA_ARGS__)
#define HMOE_FE_7(M, p, ...) M p, HMOE_FE_6(M, __VA_ARGS__)
#define HMOE_FE_8(M, p, ...) M p, HMOE_FE_7(M, __VA_ARGS__)
#define HMOE_FE_9(M, p, ...) M p, HMOE_FE_8(M, __VA_ARGS__)
#define HMOE_FE_10(M, p, ...) M p, HMOE_FE_9(M, __VA_ARGS__)
#define HMOE_FE_11(M, p, ...) M p, HMOE_FE_10(M, __VA_ARGS__)
#define HMOE_FE_12(M, p, ...) M p, HMOE_FE_11(M, __VA_ARGS__)
#define HMOE_FE_13(M, p, ...) M p, HMOE_FE_12(M, __VA_ARGS__)
#define HMOE_FE_14(M, p, ...) M p, HMOE_FE_13(M, __VA_ARGS__)
#define HMOE_FE_15(M, p, ...) M p, HMOE_FE_14(M, __VA_ARGS__)
#define HMOE_FE_16(M, p, ...) M p, HMOE_FE_15(M, __VA_ARGS__)
#define HMOE_FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, N, ...) N
#define HMOE_FOR_EACH(M, ...)                                                                                   \
  HMOE_FE_PICK(__VA_ARGS__, HMOE_FE_16, HMOE_FE_15, HMOE_FE_14, HMOE_FE_13, HMOE_FE_12, HMOE_FE_11, HMOE_FE_10, \
               HMOE_FE_9, HMOE_FE_8, HMOE_FE_7, HMOE_FE_6, HMOE_FE_5, HMOE_FE_4, HMOE_FE_3, HMOE_FE_2,          \
               HMOE_FE_1)(M, __VA_ARGS__)
#define HMOE_PARAM(kind, name) HMOE_T_##kind name
#define HMOE_PARAMS(...) HMOE_FOR_EACH(HMOE_PARAM, __VA_ARGS__)
#define HMOE_STRV_(...) #__VA_ARGS__
#define HMOE_STRV(...) HMOE_STRV_(__VA_ARGS__)

// m.def of entry point `name` with the parameters its HMOE_ARGS_<name> lists, body `...` (a
// braced lambda body that uses those names).
#define HMOE_DEF(m, name, ...) m.def(#name, [](HMOE_PARAMS(HMOE_ARGS_##name)) __VA_ARGS__)

namespace hmoe::bind {

// "(u32, leaf), (u32, subleaf)" -> "leaf:u32, subleaf:u32" (the table's form; Python builds the
// same string from the same text).
inline std::string canonical_args(const char* spec) {
  std::string out, kind, name, *cur = nullptr;
  for (const char* c = spec; *c; ++c) {
    if (*c == '(') {
      kind.clear(), name.clear(), cur = &kind;
    } else if (*c == ',' && cur == &kind) {
      cur = &name;
    } else if (*c == ')' && cur != nullptr) {
      out += (out.empty() ? "" : ", ") + name + ":" + kind;
      cur = nullptr;
    } else if (cur != nullptr && *c != ' ') {
      *cur += *c;
    }
  }
  return out;
}

// Registers the four common exports; `kind` is this module's kind in signatures.h and `has_op`
// says which ops it was built with (CUDA families hold some of them).
template <typename HasOp>
void def_common(py::module_& m, const char* kind, HasOp has_op) {
  m.def("abi_version", [] { return HMOE_ABI_VERSION; });
  py::dict table;
#define HMOE_TABLE_ROW(module_kind, op, name, ret, ...)    \
  if (std::strcmp(#module_kind, kind) == 0 && has_op(#op)) \
    table[#name] = std::string(#name "(") + canonical_args(HMOE_STRV(__VA_ARGS__)) + ") -> " + ret;
  HMOE_ENTRY_POINTS(HMOE_TABLE_ROW)
#undef HMOE_TABLE_ROW
  m.def("signatures", [table] { return table; });
  py::dict constants;
#define HMOE_CONSTANT_ROW(name, value) constants[#name] = value;
  HMOE_CONSTANTS(HMOE_CONSTANT_ROW)
#undef HMOE_CONSTANT_ROW
  m.def("constants", [constants] { return constants; });
  m.def("bind_torch", &bind_torch);
  watch_finalization();
}

}  // namespace hmoe::bind
