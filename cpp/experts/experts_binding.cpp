// Python module hmoe._native.experts_<isa>: the CPU MoE experts op built for one ISA level.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "bind/gil.h"
#include "bind/module.h"
#include "common/doorbell.h"
#include "common/huge_pages.h"
#include "common/thread_pool.h"
#include "experts/experts_entry.h"
#include "experts/format.h"
#include "experts/gemm.h"
#include "experts/moe_experts.h"
#include "experts/pack.h"
#include "experts/quantize.h"

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
  // An expert id outside [0, E): std::invalid_argument -> ValueError.
  if (p.T > 0) hb::without_gil([&] { hmoe::HMOE_ISA::run_moe(p); });
  return result;
}

// p for prepacked weights (checked against E, H, I, their format and k groups) and the tokens.
MoeParams packed_params(py::handle x, py::handle topk_ids, py::handle topk_weights, const hb::TensorArg& a,
                        const hb::TensorArg& b, int32_t fmt, int64_t E, int64_t H, int64_t I, int64_t g13, int64_t g2) {
  if (E < 1 || H < 1 || I < 1) throw std::invalid_argument("moe_experts_packed: bad sizes");
  hmoe::check_group(fmt, g13, "moe_experts_packed: w13");
  hmoe::check_group(fmt, g2, "moe_experts_packed: w2");
  if (a.numel != E * hmoe::packed_w13_bytes(fmt, H, I, g13) || b.numel != E * hmoe::packed_w2_bytes(fmt, H, I, g2))
    throw std::invalid_argument("moe_experts_packed: the packed weights do not match E, H, I, their format and groups");
  MoeParams p{};
  hb::expert_tokens(x, topk_ids, topk_weights, H, p);
  p.w13 = a.data, p.w2 = b.data, p.w_format = fmt, p.packed = 1, p.E = E, p.H = H, p.I = I;
  p.group13 = g13, p.group2 = g2;
  return p;
}

// One quantised matrix [E, N, kd] of format fmt: data bytes [E, N, kd * bits / 8] (uint8 view),
// scales fp32 [E, ceil(N / rows), ceil(kd / cols)]; kd comes from the data, N is checked.
struct QuantArg {
  hb::TensorArg data, scales;
  int64_t E, N, kd;
};
QuantArg quant_arg(py::handle data, py::handle scales, const char* dname, const char* sname, int32_t fmt, int64_t rows,
                   int64_t cols) {
  QuantArg q{hb::tensor(data, dname, hb::dtypes({hmoe::kU8}), 3, hb::Where::kCpu),
             hb::tensor(scales, sname, hb::dtypes({hmoe::kF32}), 3, hb::Where::kCpu), 0, 0, 0};
  const int bits = hmoe::with_format(fmt, [](auto f) { return decltype(f)::kBits; });
  q.E = q.data.shape[0], q.N = q.data.shape[1], q.kd = q.data.shape[2] * 8 / bits;
  if (q.E < 1 || q.N < 1 || q.kd < 1)
    hb::value_error(std::string(dname) + " has shape " + q.data.shape_str() + ": expected [E, N, K bytes], all >= 1");
  if (rows < 1 || cols < 1) hb::value_error(std::string(sname) + ": scale block sizes must be positive");
  const int64_t want[3] = {q.E, hmoe::ceil_div(q.N, rows), hmoe::ceil_div(q.kd, cols)};
  for (int d = 0; d < 3; ++d)
    if (q.scales.shape[d] != want[d])
      hb::value_error(std::string(sname) + " has shape " + q.scales.shape_str() + ", expected (" +
                      std::to_string(want[0]) + ", " + std::to_string(want[1]) + ", " + std::to_string(want[2]) +
                      ") for " + dname + " " + q.data.shape_str() + " and " + std::to_string(rows) + " x " +
                      std::to_string(cols) + " weights a scale");
  return q;
}

// Weights [L, N, K] to quantise or dequantise: a float tensor (w_scales None), or float8_e4m3fn bytes
// (uint8) with their block scales fp32 [L, ceil(N / rows), ceil(K / cols)].
hmoe::WeightRows weight_rows(py::handle w, py::handle w_scales, int64_t rows, int64_t cols, const std::string& who) {
  const bool fp8 = !w_scales.is_none();
  const hb::TensorArg a = hb::tensor(w, "w", fp8 ? hb::dtypes({hmoe::kU8}) : hb::kFloats, 3, hb::Where::kCpu);
  const int64_t L = a.shape[0], N = a.shape[1], K = a.shape[2];
  if (N < 1 || K < 1) hb::value_error(who + ": the weights have shape " + a.shape_str() + ": N and K must be >= 1");
  hmoe::WeightRows src{a.data, a.dtype, L, N, K, nullptr, 0, 0};
  if (fp8) {
    const hb::TensorArg sa = hb::tensor(w_scales, "fp8 scales", hb::dtypes({hmoe::kF32}), 3, hb::Where::kCpu);
    if (rows < 1 || cols < 1) hb::value_error(who + ": fp8 block sizes must be positive");
    const int64_t want[3] = {L, hmoe::ceil_div(N, rows), hmoe::ceil_div(K, cols)};
    for (int d = 0; d < 3; ++d)
      if (sa.shape[d] != want[d])
        hb::value_error(who + ": fp8 scales " + sa.shape_str() + " do not fit the weights " + a.shape_str() +
                        " with blocks of " + std::to_string(rows) + " x " + std::to_string(cols));
    src.fp8_scales = static_cast<const float*>(sa.data), src.rows = rows, src.cols = cols;
  }
  return src;
}

// fn(r0, r1) over rows [0, n) of row_bytes each, in tasks of about 1 MB on the pool, without the GIL;
// true when every task returned true.
template <class Fn>
bool for_rows(int64_t n, int64_t row_bytes, int32_t num_threads, const Fn& fn) {
  const int64_t per = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(1, row_bytes));
  std::atomic<bool> ok{true};
  hb::without_gil([&] {
    hmoe::ThreadPool::instance().parallel_for(hmoe::ceil_div(n, per), num_threads, [&](int64_t t, int) {
      const int64_t r0 = t * per;
      if (!fn(r0, std::min(n, r0 + per))) ok.store(false, std::memory_order_relaxed);
    });
  });
  return ok.load();
}

// Packed weights are streamed once per call by every thread: huge-page advised (common/huge_pages.h)
// before the packer first touches them.

// A packed-weights tensor of `bytes` bytes (uint8, CPU) from torch's allocator, huge-page advised.
py::object packed_empty(int64_t bytes, void** data) {
  py::object t = hb::empty({bytes}, hmoe::kU8, -1, data);
  hmoe::advise_huge_pages(*data, bytes);
  return t;
}

hb::TensorArg packed_arg(py::handle t, const char* name) {
  return hb::tensor(t, name, hb::dtypes({hmoe::kU8}), 1, hb::Where::kCpu);
}

// A host job: the experts op over fixed buffers (pinned by the caller), run by whoever calls
// run_job(job) with no Python and no GIL: a CUDA host function enqueued on a stream
// (cudaLaunchHostFunc, also inside a captured CUDA graph), or the doorbell server when the job
// listens (host_job_listen; common/doorbell.h). Nothing may throw out of run_job: an
// error is kept for host_job_error and the output is filled with NaN, so that a failure is never
// a plausible result. Each run's wall time is kept (the last kTimes, read by host_job_times): what
// the experts cost inside a stream or a graph, where no Python timer can see them.
struct HostJob {
  static constexpr int64_t kTimes = 1024;
  MoeParams p;
  std::mutex mu;  // error, times, runs
  std::string error;
  float times[kTimes];
  int64_t runs = 0;  // since the last host_job_times
  bool listening = false;
};

void run_job(void* ctx) noexcept {
  auto* job = static_cast<HostJob*>(ctx);
  const auto t0 = std::chrono::steady_clock::now();
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
  const float us = std::chrono::duration<float, std::micro>(std::chrono::steady_clock::now() - t0).count();
  try {
    std::lock_guard<std::mutex> lock(job->mu);
    job->times[job->runs++ % HostJob::kTimes] = us;
  } catch (const std::system_error&) {  // the lock failed: this run goes unrecorded
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
    p.w13 = w.w13.data, p.w2 = w.w2.data, p.w_format = w.w13.dtype, p.packed = 0;
    p.E = w.E, p.H = w.H, p.I = w.I;
    return run(p, out, w.w13, w.w2, num_threads);
  });

  HMOE_DEF(m, moe_experts_packed, {
    const hb::TensorArg a = packed_arg(w13, "w13 (packed)"), b = packed_arg(w2, "w2 (packed)");
    MoeParams p = packed_params(x, topk_ids, topk_weights, a, b, w_format, E, H, I, group13, group2);
    return run(p, out, a, b, num_threads);
  });

  // The caller keeps every tensor alive and in place until host_job_free, and frees the job only
  // when no enqueued run can still reach it.
  HMOE_DEF(m, host_job_create, {
    const hb::TensorArg a = packed_arg(w13, "w13 (packed)"), b = packed_arg(w2, "w2 (packed)");
    auto job = std::make_unique<HostJob>();
    job->p = packed_params(x, topk_ids, topk_weights, a, b, w_format, E, H, I, group13, group2);
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

  HMOE_DEF(m, host_job_times, {
    HostJob* j = job_at(job);
    std::lock_guard<std::mutex> lock(j->mu);
    const int64_t n = std::min(j->runs, HostJob::kTimes);
    std::vector<float> out;
    for (int64_t i = j->runs - n; i < j->runs; ++i) out.push_back(j->times[i % HostJob::kTimes]);
    j->runs = 0;
    return out;
  });
  HMOE_DEF(m, host_job_free, {
    HostJob* j = job_at(job);
    if (j->listening) hmoe::Doorbells::instance().remove(j);
    delete j;
  });

  // The job answers the doorbell at flags (int32, CPU, >= 32 words: ready = flags[0], done =
  // flags[16], a cache line apart), which the caller keeps alive and in place until host_job_free.
  HMOE_DEF(m, host_job_listen, {
    HostJob* j = job_at(job);
    const hb::TensorArg f = hb::tensor(flags, "flags", hb::dtypes({hmoe::kI32}), 1, hb::Where::kCpu);
    if (f.numel < 32) hb::value_error("host_job_listen: flags must hold at least 32 int32 words");
    if (j->listening) hb::value_error("host_job_listen: the job already listens");
    auto* words = static_cast<std::atomic<uint32_t>*>(f.data);
    hmoe::Doorbells::instance().add(&words[0], &words[16], &run_job, j);
    j->listening = true;
  });
  m.def("host_job_wake", [] { hmoe::Doorbells::instance().wake(); });

  HMOE_DEF(m, packed_bytes, {
    hmoe::check_group(w_format, group13, "packed_bytes: w13");
    hmoe::check_group(w_format, group2, "packed_bytes: w2");
    return py::make_tuple(hmoe::packed_w13_bytes(w_format, H, I, group13),
                          hmoe::packed_w2_bytes(w_format, H, I, group2));
  });

  // Quantised weights (hmoe.quant's storage, data as uint8 views) packed with their scales.
  HMOE_DEF(m, pack_quantized, {
    if (!hmoe::with_format(w_format, [](auto f) { return decltype(f)::kScaled; }))
      throw std::invalid_argument("pack_quantized: format " + std::string(hmoe::format_name(w_format)) +
                                  " is not quantised; use pack_weights");
    hmoe::check_group(w_format, group13, "pack_quantized: w13");
    hmoe::check_group(w_format, group2, "pack_quantized: w2");
    const QuantArg a = quant_arg(w13_data, w13_scales, "w13", "w13 scales", w_format, scale_rows13, scale_cols13);
    const QuantArg b = quant_arg(w2_data, w2_scales, "w2", "w2 scales", w_format, scale_rows2, scale_cols2);
    const int64_t E = a.E, H = a.kd, I = a.N / 2;
    if (a.N % 2) hb::value_error("w13 has " + std::to_string(a.N) + " rows: expected 2I (gate rows, then up rows)");
    if (b.E != E || b.N != H || b.kd != I)
      hb::value_error("w2 is [" + std::to_string(b.E) + ", " + std::to_string(b.N) + ", " + std::to_string(b.kd) +
                      "] (E, H, I), w13 [" + std::to_string(E) + ", 2 x " + std::to_string(I) + ", " +
                      std::to_string(H) + "]: they must agree");
    const int64_t b13 = hmoe::packed_w13_bytes(w_format, H, I, group13);
    const int64_t b2 = hmoe::packed_w2_bytes(w_format, H, I, group2);
    void *dst13 = nullptr, *dst2 = nullptr;
    py::object p13 = packed_empty(E * b13, &dst13);
    py::object p2 = packed_empty(E * b2, &dst2);
    // Expert e's matrix of a QuantArg (its data and scales are [E, ...]).
    auto matrix = [](const QuantArg& q, int64_t e, int64_t rows, int64_t cols) {
      return hmoe::QuantMatrix{static_cast<const char*>(q.data.data) + e * (q.data.numel / q.E),
                               q.kd,
                               static_cast<const float*>(q.scales.data) + e * (q.scales.numel / q.E),
                               rows,
                               cols,
                               q.scales.shape[2]};
    };
    std::string error;
    std::mutex mu;
    hb::without_gil([&] {
      hmoe::ThreadPool::instance().parallel_for(2 * E, num_threads, [&](int64_t t, int) {
        const int64_t e = t / 2;
        try {
          if (t % 2 == 0)
            hmoe::pack_quant_w13(w_format, matrix(a, e, scale_rows13, scale_cols13), I, group13,
                                 static_cast<char*>(dst13) + e * b13);
          else
            hmoe::pack_quant_w2(w_format, matrix(b, e, scale_rows2, scale_cols2), H, group2,
                                static_cast<char*>(dst2) + e * b2);
        } catch (const std::exception& ex) {  // an error in a worker thread: reported once, after all
          std::lock_guard<std::mutex> lock(mu);
          if (error.empty()) error = std::string(ex.what()) + " (expert " + std::to_string(e) + ")";
        }
      });
    });
    if (!error.empty()) throw std::invalid_argument(error);
    return py::make_tuple(p13, p2);
  });

  // hmoe.quant.quantize of CPU weights w [L, N, K] to int8 or int4 (hmoe.quant's rule and storage) into q
  // (uint8 bytes: [L, N, K], int4 [L, N, K / 2]) and scales (fp32 [L, N, K / group]). w is a float dtype, or
  // float8_e4m3fn bytes (uint8) with w_scales [L, ceil(N / w_rows), ceil(K / w_cols)]: quantised from their
  // fp32 values with no fp32 copy of the weights.
  HMOE_DEF(m, quantize_weights, {
    if (w_format != hmoe::k::weight_format_int8 && w_format != hmoe::k::weight_format_int4)
      hb::value_error("quantize_weights: format " + std::string(hmoe::format_name(w_format)) + " is not int8 or int4");
    const bool int4 = w_format == hmoe::k::weight_format_int4;
    const hmoe::WeightRows src = weight_rows(w, w_scales, w_rows, w_cols, "quantize_weights");
    const hb::TensorArg qa = hb::tensor(q, "q", hb::dtypes({hmoe::kU8}), 3, hb::Where::kCpu);
    const hb::TensorArg sa = hb::tensor(scales, "scales", hb::dtypes({hmoe::kF32}), 3, hb::Where::kCpu);
    const int64_t L = src.L, N = src.N, K = src.K;
    if (group < 1 || K % group || (int4 && K % 2))
      hb::value_error("quantize_weights: K = " + std::to_string(K) + " does not split into groups of " +
                      std::to_string(group) + (int4 ? " (and must be even for int4)" : ""));
    const int64_t want_q[3] = {L, N, int4 ? K / 2 : K}, want_s[3] = {L, N, K / group};
    for (int d = 0; d < 3; ++d)
      if (qa.shape[d] != want_q[d] || sa.shape[d] != want_s[d])
        hb::value_error("quantize_weights: q " + qa.shape_str() + " and scales " + sa.shape_str() +
                        " do not fit the weights with groups of " + std::to_string(group));
    const bool ok = for_rows(L * N, K * hmoe::dtype_size(src.dtype), num_threads, [&](int64_t r0, int64_t r1) {
      return hmoe::quantize_rows(src, group, int4, r0, r1, qa.data, static_cast<float*>(sa.data));
    });
    if (!ok) hb::value_error("quantize: the weights hold NaN or infinity; they cannot be quantised");
  });

  // hmoe.quant.dequantize of CPU fp8 weights: q (float8_e4m3fn bytes as uint8) [L, N, K] with scales fp32
  // [L, ceil(N / rows), ceil(K / cols)] into out fp32 [L, N, K]; a NaN byte is a ValueError.
  HMOE_DEF(m, dequantize_fp8, {
    const hmoe::WeightRows src = weight_rows(q, scales, rows, cols, "dequantize_fp8");
    const hb::TensorArg oa = hb::tensor(out, "out", hb::dtypes({hmoe::kF32}), 3, hb::Where::kCpu);
    if (oa.shape[0] != src.L || oa.shape[1] != src.N || oa.shape[2] != src.K)
      hb::value_error("dequantize_fp8: out " + oa.shape_str() + " does not fit q");
    const bool ok = for_rows(src.L * src.N, src.K, num_threads, [&](int64_t r0, int64_t r1) {
      return hmoe::dequantize_fp8_rows(src, r0, r1, static_cast<float*>(oa.data));
    });
    if (!ok) hb::value_error("dequantize: the fp8 weights hold NaN");
  });

  HMOE_DEF(m, fp8_has_nan, {
    const hb::TensorArg qa = hb::tensor(q, "q", hb::dtypes({hmoe::kU8}), 1, hb::Where::kCpu);
    const auto* bytes = static_cast<const uint8_t*>(qa.data);
    return !for_rows(qa.numel, 1, num_threads,
                     [&](int64_t i0, int64_t i1) { return !hmoe::fp8_has_nan(bytes + i0, i1 - i0); });
  });

  // The packed weights of experts ids (int32 or int64, each in [0, E)) of packed weights of E experts, in
  // that order: each expert's bytes are contiguous, so a copy (huge-page advised, on the pool's threads).
  HMOE_DEF(m, packed_select, {
    const hb::TensorArg a = packed_arg(w13_packed, "w13 (packed)"), b = packed_arg(w2_packed, "w2 (packed)");
    const hb::TensorArg ia = hb::tensor(ids, "ids", hb::dtypes({hmoe::kI32, hmoe::kI64}), 1, hb::Where::kCpu);
    if (E < 1 || a.numel % E || b.numel % E)
      hb::value_error("packed_select: the packed weights do not hold E = " + std::to_string(E) + " experts");
    const int64_t b13 = a.numel / E, b2 = b.numel / E, n = ia.numel;
    std::vector<int64_t> sel(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      sel[size_t(i)] =
          ia.dtype == hmoe::kI32 ? static_cast<const int32_t*>(ia.data)[i] : static_cast<const int64_t*>(ia.data)[i];
      if (sel[size_t(i)] < 0 || sel[size_t(i)] >= E)
        hb::value_error("packed_select: expert id " + std::to_string(sel[size_t(i)]) + " is outside [0, " +
                        std::to_string(E) + ")");
    }
    void *dst13 = nullptr, *dst2 = nullptr;
    py::object p13 = packed_empty(n * b13, &dst13);
    py::object p2 = packed_empty(n * b2, &dst2);
    hb::without_gil([&] {
      hmoe::ThreadPool::instance().parallel_for(2 * n, num_threads, [&](int64_t t, int) {
        const int64_t i = t / 2, e = sel[size_t(i)];
        if (t % 2 == 0)
          std::memcpy(static_cast<char*>(dst13) + i * b13, static_cast<const char*>(a.data) + e * b13, size_t(b13));
        else
          std::memcpy(static_cast<char*>(dst2) + i * b2, static_cast<const char*>(b.data) + e * b2, size_t(b2));
      });
    });
    return py::make_tuple(p13, p2);
  });

  HMOE_DEF(m, pack_weights, {
    const hb::ExpertWeights w = hb::expert_weights(w13, w2);
    const int32_t dt = w.w13.dtype;
    const int64_t E = w.E, H = w.H, I = w.I, ws = hmoe::dtype_size(dt);
    const int64_t b13 = hmoe::packed_w13_bytes(dt, H, I, 0), b2 = hmoe::packed_w2_bytes(dt, H, I, 0);
    void *dst13 = nullptr, *dst2 = nullptr;
    py::object p13 = packed_empty(E * b13, &dst13);
    py::object p2 = packed_empty(E * b2, &dst2);
    const int64_t nb13 = 2 * hmoe::ceil_div(I, hmoe::kBlockN), nb2 = hmoe::ceil_div(H, hmoe::kBlockN);
    const char* src13 = static_cast<const char*>(w.w13.data);
    const char* src2 = static_cast<const char*>(w.w2.data);
    hb::without_gil([&] {
      // One task per (expert, matrix) keeps every thread busy for few, large experts too.
      hmoe::ThreadPool::instance().parallel_for(2 * E, num_threads, [&](int64_t t, int) {
        const int64_t e = t / 2;
        if (t % 2 == 0) {
          hmoe::pack_w13_blocks(src13 + e * 2 * I * H * ws, dt, H, I, 0, nb13, static_cast<char*>(dst13) + e * b13);
        } else {
          hmoe::pack_w2_blocks(src2 + e * H * I * ws, dt, H, I, 0, nb2, static_cast<char*>(dst2) + e * b2);
        }
      });
    });
    return py::make_tuple(p13, p2);
  });
}
