// Python module hmoe._native.experts_<isa>: the CPU MoE experts op built for one ISA level.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "bind/module.h"
#include "common/thread_pool.h"
#include "experts/experts_entry.h"
#include "experts/format.h"
#include "experts/gemm.h"
#include "experts/moe_experts.h"
#include "experts/pack.h"

namespace py = pybind11;
namespace hb = hmoe::bind;
using hmoe::MoeParams;

namespace {

template <class T = hmoe::isa::Tiles>
void check_ready() {
  if constexpr (T::kAvailable) {
    const char* why = T::ensure_permission();
    if (*why) throw std::runtime_error(std::string("AMX unusable: ") + why);
  }
}

// Runs p (weights and tokens set) into `out` or a new [T, H] tensor of x's dtype.
py::object run(MoeParams& p, py::handle out, const hb::TensorArg& w13, const hb::TensorArg& w2, int32_t num_threads) {
  check_ready();
  py::object result = hb::expert_output(out, w13, w2, p);
  p.num_threads = num_threads;
  if (p.T > 0) {
    py::gil_scoped_release nogil;
    hmoe::HMOE_ISA::run_moe(p);  // an expert id outside [0, E): std::invalid_argument -> ValueError
  }
  return result;
}

// p for prepacked weights (checked against E, H, I and their dtype) and the tokens.
MoeParams packed_params(py::handle x, py::handle topk_ids, py::handle topk_weights, const hb::TensorArg& a,
                        const hb::TensorArg& b, int32_t w_dtype, int64_t E, int64_t H, int64_t I) {
  if (E < 1 || H < 1 || I < 1) throw std::invalid_argument("moe_experts_packed: bad sizes");
  if (a.numel != E * hmoe::packed_w13_bytes(w_dtype, H, I) || b.numel != E * hmoe::packed_w2_bytes(w_dtype, H, I))
    throw std::invalid_argument("moe_experts_packed: the packed weights do not match E, H, I and their dtype");
  MoeParams p{};
  hb::expert_tokens(x, topk_ids, topk_weights, H, p);
  p.w13 = a.data, p.w2 = b.data, p.w_dtype = w_dtype, p.packed = 1, p.E = E, p.H = H, p.I = I;
  return p;
}

hb::TensorArg packed_arg(py::handle t, const char* name) {
  return hb::tensor(t, name, hb::dtypes({hmoe::kU8}), 1, hb::Where::kCpu);
}

// A host job: the experts op over fixed buffers (pinned by the caller), run by whoever calls
// run_job(job) with no Python and no GIL: a CUDA host function enqueued on a stream
// (cudaLaunchHostFunc, also inside a captured CUDA graph). Nothing may throw out of run_job: an
// error is kept for host_job_error and the output is filled with NaN, so that a failure is never
// a plausible result.
struct HostJob {
  MoeParams p;
  std::mutex mu;
  std::string error;
};

void run_job(void* ctx) noexcept {
  auto* job = static_cast<HostJob*>(ctx);
  try {
    check_ready();
    if (job->p.T > 0) hmoe::HMOE_ISA::run_moe(job->p);
  } catch (const std::exception& e) {
    const int64_t n = job->p.T * job->p.H;
    if (job->p.x_dtype == hmoe::kF32) {
      std::fill_n(static_cast<float*>(job->p.out), n, std::numeric_limits<float>::quiet_NaN());
    } else {
      std::fill_n(static_cast<uint16_t*>(job->p.out), n, uint16_t(0x7fff));  // NaN in bf16 and fp16 alike
    }
    std::lock_guard<std::mutex> lock(job->mu);
    job->error = e.what();
  }
}

HostJob* job_at(int64_t address) {
  if (address == 0) throw std::invalid_argument("host job: null handle");
  return reinterpret_cast<HostJob*>(address);
}

}  // namespace

PYBIND11_MODULE(HMOE_MODULE_NAME, m) {
  m.doc() = "hmoe CPU MoE experts, ISA level " HMOE_ISA_NAME;
  m.attr("isa") = HMOE_ISA_NAME;
  hb::def_common(m, "experts", [](const char*) { return true; });

  HMOE_DEF(m, moe_experts, {
    const hb::ExpertWeights w = hb::expert_weights(w13, w2);
    MoeParams p{};
    hb::expert_tokens(x, topk_ids, topk_weights, w.H, p);
    p.w13 = w.w13.data, p.w2 = w.w2.data, p.w_dtype = w.w13.dtype, p.packed = 0;
    p.E = w.E, p.H = w.H, p.I = w.I;
    return run(p, out, w.w13, w.w2, num_threads);
  });

  HMOE_DEF(m, moe_experts_packed, {
    const hb::TensorArg a = packed_arg(w13, "w13 (packed)"), b = packed_arg(w2, "w2 (packed)");
    MoeParams p = packed_params(x, topk_ids, topk_weights, a, b, w_dtype, E, H, I);
    return run(p, out, a, b, num_threads);
  });

  // The caller keeps every tensor alive and in place until host_job_free, and frees the job only
  // when no enqueued run can still reach it.
  HMOE_DEF(m, host_job_create, {
    const hb::TensorArg a = packed_arg(w13, "w13 (packed)"), b = packed_arg(w2, "w2 (packed)");
    auto job = std::make_unique<HostJob>();
    job->p = packed_params(x, topk_ids, topk_weights, a, b, w_dtype, E, H, I);
    hb::expert_output(out, a, b, job->p);
    job->p.num_threads = num_threads;
    check_ready();
    void (*fn)(void*) = &run_job;
    return py::make_tuple(reinterpret_cast<int64_t>(fn), reinterpret_cast<int64_t>(job.release()));
  });

  HMOE_DEF(m, host_job_error, {
    HostJob* j = job_at(job);
    std::lock_guard<std::mutex> lock(j->mu);
    std::string error;
    error.swap(j->error);
    return error;
  });

  HMOE_DEF(m, host_job_free, { delete job_at(job); });

  HMOE_DEF(m, packed_bytes,
           { return py::make_tuple(hmoe::packed_w13_bytes(w_dtype, H, I), hmoe::packed_w2_bytes(w_dtype, H, I)); });

  HMOE_DEF(m, pack_weights, {
    const hb::ExpertWeights w = hb::expert_weights(w13, w2);
    const int32_t dt = w.w13.dtype;
    const int64_t E = w.E, H = w.H, I = w.I, ws = hmoe::dtype_size(dt);
    const int64_t b13 = hmoe::packed_w13_bytes(dt, H, I), b2 = hmoe::packed_w2_bytes(dt, H, I);
    void *dst13 = nullptr, *dst2 = nullptr;
    py::object p13 = hb::empty({E * b13}, hmoe::kU8, -1, &dst13);
    py::object p2 = hb::empty({E * b2}, hmoe::kU8, -1, &dst2);
    const int64_t nb13 = 2 * hmoe::ceil_div(I, hmoe::kBlockN), nb2 = hmoe::ceil_div(H, hmoe::kBlockN);
    const char* src13 = static_cast<const char*>(w.w13.data);
    const char* src2 = static_cast<const char*>(w.w2.data);
    {
      py::gil_scoped_release nogil;
      // One task per (expert, matrix) keeps every thread busy for few, large experts too.
      hmoe::ThreadPool::instance().parallel_for(2 * E, num_threads, [&](int64_t t, int) {
        const int64_t e = t / 2;
        if (t % 2 == 0) {
          hmoe::pack_w13_blocks(src13 + e * 2 * I * H * ws, dt, H, I, 0, nb13, static_cast<char*>(dst13) + e * b13);
        } else {
          hmoe::pack_w2_blocks(src2 + e * H * I * ws, dt, H, I, 0, nb2, static_cast<char*>(dst2) + e * b2);
        }
      });
    }
    return py::make_tuple(p13, p2);
  });
}
