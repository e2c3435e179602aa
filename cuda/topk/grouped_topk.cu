// CUDA variant of grouped_topk: one warp routes one token, with its scratch in shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "common/cuda_util.h"
#include "topk/grouped_topk.h"
#include "topk/grouped_topk_rules.h"

namespace hmoe {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxWarpsPerBlock = 4;
// Default dynamic shared memory limit: staying within it needs no cudaFuncSetAttribute,
// i.e. no per-device lazy setup. 3 * kGroupedTopkMaxExperts floats fit exactly.
constexpr size_t kSmemBudget = 48 * 1024;
constexpr int64_t kMaxBlocks = 65535;  // tokens beyond grid * warps are grid-strided
static_assert(3 * sizeof(float) * kGroupedTopkMaxExperts <= kSmemBudget, "scratch too large");

// Per-warp scratch: score[E], sel[E], group[G] floats. Sentinels (NaN never occurs in sel or
// group otherwise, both are sanitised): sel[e] = NaN once expert e is taken or its group
// dropped, group[g] = NaN once group g is kept.

template <int32_t kDtype>
__device__ __forceinline__ float load_logit(const void* base, int64_t i) {
  if constexpr (kDtype == kF16)
    return __half2float(static_cast<const __half*>(base)[i]);
  else if constexpr (kDtype == kBF16)
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  else
    return static_cast<const float*>(base)[i];
}

__device__ __forceinline__ float load_any(const void* base, int32_t dtype, int64_t i) {
  if (dtype == kF16) return __half2float(static_cast<const __half*>(base)[i]);
  if (dtype == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

using topk::ranks_before;

// Butterfly reductions: every lane ends with the result. The ranking is a total order, so
// the winner does not depend on the reduction order.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    float ov = __shfl_xor_sync(kFullMask, v, off);
    int oi = __shfl_xor_sync(kFullMask, i, off);
    if (ranks_before(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}
// Top two over the warp of the lanes' top-two pairs (a >= b; topk::group_push builds them).
__device__ __forceinline__ void warp_top2(float& a, float& b) {
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    float oa = __shfl_xor_sync(kFullMask, a, off);
    float ob = __shfl_xor_sync(kFullMask, b, off);
    float na = fmaxf(a, oa);
    b = fmaxf(fminf(a, oa), fmaxf(b, ob));
    a = na;
  }
}

// score[] and sel[] of one token; lane l owns experts l, l + 32, ...
template <int32_t kDtype>
__device__ void score_token(const GroupedTopkParams& p, int64_t t, int lane, float* score, float* sel) {
  const int E = p.num_experts;
  const int64_t row = t * E;
  if (p.scoring == kScoringSoftmax) {
    // NaN logits are left out of the max and the sum, like -inf logits; sel holds the
    // logits until the scores are final.
    float m = -INFINITY;
    for (int e = lane; e < E; e += kWarp) {
      float x = load_logit<kDtype>(p.logits, row + e);
      sel[e] = x;
      if (!isnan(x)) m = fmaxf(m, x);
    }
    m = warp_max(m);
    float sum = 0.f;
    for (int e = lane; e < E; e += kWarp) {
      const float ex = topk::softmax_exp(sel[e], m);
      score[e] = ex;
      sum += ex;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += kWarp) {
      const float sc = topk::softmax_score(score[e], sum);
      score[e] = sc;
      sel[e] = topk::softmax_sel(sel[e], sc);
    }
  } else {
    for (int e = lane; e < E; e += kWarp) {
      float x = load_logit<kDtype>(p.logits, row + e);
      if (isnan(x)) {
        score[e] = 0.f;
        sel[e] = -INFINITY;
        continue;
      }
      const float sc = topk::sigmoid_score(x);
      score[e] = sc;
      sel[e] = topk::sigmoid_sel(sc, p.bias ? load_any(p.bias, p.bias_dtype, e) : 0.f);
    }
  }
}

// Group scores into group[], then marks the topk_group best groups (group[g] = NaN).
__device__ void select_groups(const GroupedTopkParams& p, int lane, const float* sel, float* group) {
  const int G = p.n_group, S = p.num_experts / p.n_group;
  const bool softmax = p.scoring == kScoringSoftmax;
  // Warp instructions of the two ways to score the groups: a lane per group walks S
  // values; or the warp walks each group and reduces it (~10 steps).
  const int per_lane = (G + kWarp - 1) / kWarp * S;
  const int per_group = G * ((S + kWarp - 1) / kWarp + 10);
  if (per_group < per_lane) {  // few wide groups
    for (int g = 0; g < G; ++g) {
      const float* v = sel + g * S;
      float a = -INFINITY, b = -INFINITY;
      for (int i = lane; i < S; i += kWarp) topk::group_push(v[i], a, b, softmax);
      if (softmax)
        a = warp_max(a);
      else
        warp_top2(a, b);
      const float gs = topk::group_score(a, b, softmax);
      if (lane == 0) group[g] = gs;
    }
  } else {
    for (int g = lane; g < G; g += kWarp) {
      const float* v = sel + g * S;
      float a = -INFINITY, b = -INFINITY;
      for (int i = 0; i < S; ++i) topk::group_push(v[i], a, b, softmax);
      group[g] = topk::group_score(a, b, softmax);
    }
  }
  __syncwarp();
  for (int r = 0; r < p.topk_group; ++r) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int g = lane; g < G; g += kWarp) {
      float v = group[g];
      if (!isnan(v) && ranks_before(v, g, bv, bi)) {
        bv = v;
        bi = g;
      }
    }
    warp_argmax(bv, bi);
    // bi < G: topk_group <= G, so an unkept group is always left. Its reader is its owner.
    if (lane == bi % kWarp) group[bi] = NAN;
  }
  __syncwarp();
}

// The best expert still available among this lane's (l, l + 32, ...); taken or excluded
// experts hold NaN in sel.
__device__ __forceinline__ void lane_best(const float* sel, int E, int lane, float& bv, int& bi) {
  bv = -INFINITY;
  bi = INT_MAX;
  for (int e = lane; e < E; e += kWarp) {
    float v = sel[e];
    if (!isnan(v) && ranks_before(v, e, bv, bi)) {
      bv = v;
      bi = e;
    }
  }
}

template <int32_t kDtype>
__global__ void grouped_topk_kernel(GroupedTopkParams p) {
  extern __shared__ float smem[];
  const int E = p.num_experts, G = p.n_group, S = E / G, K = p.top_k;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  float* score = smem + warp * (2 * E + G);
  float* sel = score + E;
  float* group = sel + E;

  for (int64_t t = int64_t(blockIdx.x) * warps + warp; t < p.num_tokens; t += int64_t(gridDim.x) * warps) {
    score_token<kDtype>(p, t, lane, score, sel);
    __syncwarp();
    if (p.topk_group < G) {  // else every group is kept
      select_groups(p, lane, sel, group);
      for (int e = lane; e < E; e += kWarp)
        if (!isnan(group[e / S])) sel[e] = NAN;  // experts of dropped groups
    }

    float* w = p.weights + t * K;
    int32_t* ids = p.ids + t * K;
    float sum = 0.f;  // identical in every lane: same values, same order as the CPU variant
    float lv;
    int li;
    lane_best(sel, E, lane, lv, li);
    for (int k = 0; k < K; ++k) {
      float bv = lv;
      int bi = li;
      warp_argmax(bv, bi);
      // bi < E: top_k <= kept experts. Only the owner lane reads sel[bi] again.
      if (lane == bi % kWarp) {
        sel[bi] = NAN;
        lane_best(sel, E, lane, lv, li);
      }
      float x = score[bi];
      sum += x;
      // Lane k % 32 writes output k and rescales it below: no cross-lane hand-off.
      if (lane == k % kWarp) {
        ids[k] = bi;
        w[k] = x;
      }
    }
    const float denom = sum + 1e-20f;
    for (int k = lane; k < K; k += kWarp)
      w[k] = topk::final_weight(w[k], denom, p.renormalize, p.routed_scaling_factor);
    __syncwarp();  // every lane is done with this token's scratch before it is overwritten
  }
}

using KernelFn = void (*)(GroupedTopkParams);

KernelFn kernel_for(int32_t dtype) {
  switch (dtype) {
    case kF16:
      return grouped_topk_kernel<kF16>;
    case kBF16:
      return grouped_topk_kernel<kBF16>;
    default:
      return grouped_topk_kernel<kF32>;
  }
}

}  // namespace

void grouped_topk_cuda(const GroupedTopkParams& p, int device, uintptr_t stream) {
  if (const char* why = grouped_topk_check(p)) throw std::invalid_argument(std::string("grouped_topk: ") + why);
  if (p.num_tokens == 0) return;  // a zero-sized grid is a launch error
  const DeviceGuard guard(device, "grouped_topk (CUDA)");
  const size_t per_warp = sizeof(float) * (2 * size_t(p.num_experts) + size_t(p.n_group));
  int warps = int(kSmemBudget / per_warp);
  warps = warps < kMaxWarpsPerBlock ? warps : kMaxWarpsPerBlock;
  // warps >= 1: per_warp <= 3 * 4 * kGroupedTopkMaxExperts == kSmemBudget (checked above).
  const int64_t want = (p.num_tokens + warps - 1) / warps;
  const unsigned blocks = unsigned(want < kMaxBlocks ? want : kMaxBlocks);
  kernel_for(p.logits_dtype)<<<blocks, warps * kWarp, per_warp * warps, reinterpret_cast<cudaStream_t>(stream)>>>(p);
  check_cuda(cudaGetLastError(), "grouped_topk (CUDA)", "kernel launch");
}

void grouped_topk_cuda_prewarm(int device) {
  const DeviceGuard guard(device, "grouped_topk (CUDA)");
  cudaFuncAttributes attr;
  for (int32_t dtype : {kF32, kF16, kBF16})
    check_cuda(cudaFuncGetAttributes(&attr, kernel_for(dtype)), "grouped_topk (CUDA)", "loading the kernel");
}

}  // namespace hmoe
