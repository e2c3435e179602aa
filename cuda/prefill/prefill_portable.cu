// Portable prefill (ragged_prefill, paged_prefill) for sm_80 and newer: the plan (tile
// configuration and work-list size, per shape), the launch (the GPU schedule, then the attention
// kernel of prefill_kernel.cuh, compiled per head dims in prefill_portable_d<Dqk>.cu) and prewarm.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/cuda_util.h"
#include "common/dtype.h"
#include "common/tma_host.h"
#include "prefill/prefill.h"
#include "prefill/prefill_portable.h"
#include "prefill/prefill_schedule.cuh"

namespace hmoe {
namespace {

using namespace prefill;

void check(cudaError_t e, const char* what) { check_cuda(e, "prefill", what); }

bool has_dims(const PortableConfig& c, int dqk, int dv) { return c.dqk == dqk && c.dv == dv; }

// Calls the per-head-dims function for (dqk, dv): f(std::integral_constant pair).
template <typename F>
void with_dims(int dqk, int dv, F&& f) {
  if (dqk == 192 && dv == 128)
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  else if (dqk == 128 && dv == 128)
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  else if (dqk == 64 && dv == 64)
    f(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  else
    throw std::invalid_argument("prefill: head dims (" + std::to_string(dqk) + ", " + std::to_string(dv) +
                                ") are not built");
}

}  // namespace

PrefillPlan prefill_plan(int device, int64_t total_q, int batch, int heads, int kv_heads, int head_dim_qk,
                         int head_dim_v, int config) {
  const int limit = device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "prefill");
  const int smem_sm = device_attribute(device, cudaDevAttrMaxSharedMemoryPerMultiprocessor, "prefill");
  int chosen = -1;
  if (config >= 0) {
    if (config >= kNumPortableConfigs || !has_dims(kPortableConfigs[config], head_dim_qk, head_dim_v) ||
        portable_smem(kPortableConfigs[config]) > limit)
      throw std::invalid_argument("prefill: configuration " + std::to_string(config) +
                                  " does not exist for head dims (" + std::to_string(head_dim_qk) + ", " +
                                  std::to_string(head_dim_v) + ") or does not fit this device's shared memory");
    chosen = config;
  } else {
    for (int c = 0; c < kNumPortableConfigs && chosen < 0; ++c)
      if (has_dims(kPortableConfigs[c], head_dim_qk, head_dim_v) && portable_smem(kPortableConfigs[c]) <= limit)
        chosen = c;
    if (chosen < 0)
      throw std::runtime_error("prefill: no tile configuration for head dims (" + std::to_string(head_dim_qk) + ", " +
                               std::to_string(head_dim_v) + ") fits the device's " + std::to_string(limit) +
                               " bytes of shared memory per block");
  }
  const PortableConfig& c = kPortableConfigs[chosen];
  PrefillPlan plan{};
  plan.config = chosen;
  plan.tile_q = portable_tile_q(c);
  plan.tile_kv = c.bn;
  plan.kv_stages = c.kstages;
  plan.smem_bytes = portable_smem(c);
  size_work_list(plan, total_q, batch, heads);
  plan.ctas_per_sm = std::min(c.warps == 4 ? 2 : 1, smem_sm / (plan.smem_bytes + 1024));  // the launch bounds
  (void)kv_heads;  // the plan is the same for every GQA ratio
  return plan;
}

void prefill_launch(const PrefillParams& p0, const PrefillPlan& plan, int device, uintptr_t stream_handle) {
  if (p0.dtype != kBF16 && p0.dtype != kF16) throw std::invalid_argument("prefill: dtype must be bf16 or fp16");
  // The plan came from prefill_plan for this shape; these keep a stale or foreign one from
  // launching a kernel of other head dims or with a work list of another size.
  if (plan.config < 0 || plan.config >= kNumPortableConfigs ||
      !has_dims(kPortableConfigs[plan.config], p0.head_dim_qk, p0.head_dim_v) ||
      plan.tile_q != portable_tile_q(kPortableConfigs[plan.config]) || !work_list_fits(p0, plan))
    throw std::invalid_argument("prefill: the plan does not fit this call (compute it with prefill_plan)");
  if (p0.batch == 0 || p0.total_q == 0) return;
  const DeviceGuard guard(device, "prefill");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  PrefillParams p = p0;
  p.max_items = plan.max_items;
  launch_schedule(p, plan.tile_q, kPortableQOrder, stream, "prefill");
  // Keys through the TMA on sm_90 and newer where the configuration's tiles allow (tma_rows,
  // PortableMaps; none to map without keys).
  const bool tma = p.total_kv > 0 && device_attribute(device, cudaDevAttrComputeCapabilityMajor, "prefill") >= 9;
  with_dims(p.head_dim_qk, p.head_dim_v, [&](auto dqk, auto dv) {
    portable_kernel_launch<decltype(dqk)::value, decltype(dv)::value>(p, plan.config, tma, stream);
  });
}

void prefill_prewarm(int device) {
  const DeviceGuard guard(device, "prefill");
  const int limit = device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "prefill");
  portable_kernel_prewarm<192, 128>(limit);
  portable_kernel_prewarm<128, 128>(limit);
  portable_kernel_prewarm<64, 64>(limit);
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, prefill_schedule_kernel<kScheduleThreads>), "schedule kernel");
  if (device_attribute(device, cudaDevAttrComputeCapabilityMajor, "prefill") >= 9)
    encode_tiled("ragged_prefill");  // resolved outside graph capture
}

}  // namespace hmoe
