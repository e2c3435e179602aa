// Python module hmoe._native.experts_<isa>: the CPU MoE experts op built for one ISA level.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "common/abi.h"
#include "common/thread_pool.h"
#include "experts/gemm.h"
#include "experts/moe_experts.h"
#include "experts/pack.h"

namespace py = pybind11;
using hmoe::MoeParams;

namespace {

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

template <class T = hmoe::isa::Tiles>
void check_ready() {
  if constexpr (T::kAvailable) {
    const char* why = T::ensure_permission();
    if (*why) throw std::runtime_error(std::string("AMX unusable: ") + why);
  }
}

void check_dtypes(int32_t x_dtype, int32_t w_dtype) {
  if (!hmoe::is_float_dtype(x_dtype)) throw std::invalid_argument("x: unsupported dtype code " + std::to_string(x_dtype));
  if (!hmoe::is_float_dtype(w_dtype)) throw std::invalid_argument("w13/w2: unsupported dtype code " + std::to_string(w_dtype));
}

}  // namespace

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe CPU MoE experts, ISA level " HMOE_ISA_NAME;
  m.attr("isa") = HMOE_ISA_NAME;
  m.def("abi_version", [] { return HMOE_ABI_VERSION; });
  m.def("signatures", [] {
    py::dict d;
    d["moe_experts"] =
        "moe_experts(x:ptr, x_dtype:i32, topk_ids:ptr, ids_dtype:i32, topk_weights:ptr, w13:ptr, w2:ptr, "
        "w_dtype:i32, packed:i32, out:ptr, T:i64, K:i64, E:i64, H:i64, I:i64, num_threads:i32)";
    d["packed_bytes"] = "packed_bytes(w_dtype:i32, H:i64, I:i64) -> (w13_bytes_per_expert, w2_bytes_per_expert)";
    d["pack_weights"] =
        "pack_weights(w13:ptr, w2:ptr, w_dtype:i32, E:i64, H:i64, I:i64, dst13:ptr, dst2:ptr, num_threads:i32)";
    return d;
  });
  m.def("usable_cores", &hmoe::ThreadPool::usable_cores);

  m.def("moe_experts", [](uintptr_t x, int32_t x_dtype, uintptr_t ids, int32_t ids_dtype, uintptr_t topk_w,
                          uintptr_t w13, uintptr_t w2, int32_t w_dtype, int32_t packed, uintptr_t out, int64_t T,
                          int64_t K, int64_t E, int64_t H, int64_t I, int32_t num_threads) {
    check_dtypes(x_dtype, w_dtype);
    if (ids_dtype != hmoe::kI32 && ids_dtype != hmoe::kI64) throw std::invalid_argument("topk_ids: unsupported dtype code");
    if (T < 0 || K < 1 || E < 1 || H < 1 || I < 1) throw std::invalid_argument("moe_experts: bad sizes");
    check_ready();
    MoeParams p{ptr<const void>(x), x_dtype, ptr<const void>(ids), ids_dtype, ptr<const float>(topk_w),
                ptr<const void>(w13), ptr<const void>(w2), w_dtype, packed, ptr<void>(out), T, K, E, H, I, num_threads};
    py::gil_scoped_release nogil;
    hmoe::HMOE_ISA::run_moe(p);
  });

  m.def("packed_bytes", [](int32_t w_dtype, int64_t H, int64_t I) {
    check_dtypes(hmoe::kF32, w_dtype);
    return py::make_tuple(hmoe::packed_w13_bytes(w_dtype, H, I), hmoe::packed_w2_bytes(w_dtype, H, I));
  });

  m.def("pack_weights", [](uintptr_t w13, uintptr_t w2, int32_t w_dtype, int64_t E, int64_t H, int64_t I,
                           uintptr_t dst13, uintptr_t dst2, int32_t num_threads) {
    check_dtypes(hmoe::kF32, w_dtype);
    const int64_t ws = hmoe::dtype_size(w_dtype);
    const int64_t b13 = hmoe::packed_w13_bytes(w_dtype, H, I), b2 = hmoe::packed_w2_bytes(w_dtype, H, I);
    const int64_t nb13 = 2 * hmoe::ceil_div(I, hmoe::kBlockN), nb2 = hmoe::ceil_div(H, hmoe::kBlockN);
    py::gil_scoped_release nogil;
    // One task per (expert, matrix) keeps every thread busy for few, large experts too.
    hmoe::ThreadPool::instance().parallel_for(2 * E, num_threads, [&](int64_t t, int) {
      const int64_t e = t / 2;
      if (t % 2 == 0) {
        hmoe::pack_w13_blocks(ptr<const char>(w13) + e * 2 * I * H * ws, w_dtype, H, I, 0, nb13,
                              ptr<char>(dst13) + e * b13);
      } else {
        hmoe::pack_w2_blocks(ptr<const char>(w2) + e * H * I * ws, w_dtype, H, I, 0, nb2, ptr<char>(dst2) + e * b2);
      }
    });
  });
}
