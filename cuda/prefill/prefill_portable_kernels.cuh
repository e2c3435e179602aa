// The definitions behind portable_kernel_launch / portable_kernel_prewarm (prefill_portable.h) for
// one pair of head dims: each prefill_portable_d<Dqk>.cu includes this and instantiates its pair,
// so the kernels of different head dims compile in parallel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "common/cuda_util.h"
#include "common/dtype.h"
#include "common/tma_host.h"
#include "prefill/prefill_kernel.cuh"
#include "prefill/prefill_portable.h"

namespace hmoe {
namespace prefill {
namespace portable_detail {

template <int I>
using ConfigOf = Config<kPortableConfigs[I].dqk, kPortableConfigs[I].dv, kPortableConfigs[I].bn,
                        kPortableConfigs[I].kstages, kPortableConfigs[I].warps>;

// f(ConfigOf<I>{}) for configuration `c` when it has these head dims; only those are instantiated.
template <int DQK, int DV, int I, typename F>
void visit_one(int c, F& f) {
  if constexpr (kPortableConfigs[I].dqk == DQK && kPortableConfigs[I].dv == DV)
    if (c < 0 || c == I) f(ConfigOf<I>{});
}
template <int DQK, int DV, typename F, int... I>
void visit(int c, F&& f, std::integer_sequence<int, I...>) {
  (visit_one<DQK, DV, I>(c, f), ...);
}
template <int DQK, int DV, typename F>
void for_config(int c, F&& f) {  // c < 0: every configuration of these head dims
  visit<DQK, DV>(c, f, std::make_integer_sequence<int, kNumPortableConfigs>{});
}

// Whether configuration C takes pages smaller than its tile by TMA (PagedTmaParts): with one K buffer,
// where the cp.async copies run among the products (192 x 128 on an H200: 13-15% fewer cycles at
// pages 16 and 32); with two the copies go at the loop's top, where cp.async took 6-8% fewer.
template <typename C>
constexpr bool kTmaParts = C::kKStages == 1;

// The rows of the TMA's boxes for configuration C's tiles of p on a device that can (`tma`), 0 where
// cp.async copies them: a tile's for ragged keys and for pages that hold whole tiles, a page's where
// pages divide the tile and C takes them (kTmaParts; paged_tma_rows).
template <typename C>
int tma_rows(const PrefillParams& p, bool tma) {
  if (!tma) return 0;
  if (p.kv == kPrefillRagged) return C::kBN;
  const int rows = paged_tma_rows(p.page_size, C::kBN);
  return rows == C::kBN || kTmaParts<C> ? rows : 0;
}

// f(kernel) for each dtype and KV source (with_kernel: the one p asks for, tma_rows deciding the
// loader).
template <typename T, typename C, typename F>
void each_source(F&& f) {
  f(prefill_kernel<T, C, RaggedRows>);
  f(prefill_kernel<T, C, RaggedTma>);
  f(prefill_kernel<T, C, PagedRows>);
  f(prefill_kernel<T, C, PagedTma>);
  if constexpr (kTmaParts<C>) f(prefill_kernel<T, C, PagedTmaParts>);
}
template <typename C, typename F>
void each_kernel(F&& f) {
  each_source<__nv_bfloat16, C>(f);
  each_source<__half, C>(f);
}
template <typename T, typename C, typename F>
void with_source(const PrefillParams& p, int rows, F&& f) {
  if (p.kv == kPrefillRagged)
    rows ? f(prefill_kernel<T, C, RaggedTma>) : f(prefill_kernel<T, C, RaggedRows>);
  else if (rows == 0)
    f(prefill_kernel<T, C, PagedRows>);
  else if constexpr (kTmaParts<C>)
    rows == C::kBN ? f(prefill_kernel<T, C, PagedTma>) : f(prefill_kernel<T, C, PagedTmaParts>);
  else
    f(prefill_kernel<T, C, PagedTma>);  // tma_rows: a tile's rows or none
}
template <typename C, typename F>
void with_kernel(const PrefillParams& p, int rows, F&& f) {
  if (p.dtype == kBF16)
    with_source<__nv_bfloat16, C>(p, rows, f);
  else
    with_source<__half, C>(p, rows, f);
}

}  // namespace portable_detail

template <int DQK, int DV>
void portable_kernel_launch(const PrefillParams& p, int config, bool tma, cudaStream_t stream) {
  using namespace portable_detail;
  bool launched = false;
  for_config<DQK, DV>(config, [&](auto cfg) {
    using C = decltype(cfg);
    const dim3 grid(unsigned(int64_t(p.max_items) * p.heads));
    const int rows = tma_rows<C>(p, tma);
    PortableMaps maps{};
    if (rows > 0) {  // see PortableMaps (paged: the cache's P * page rows)
      const auto sw = CU_TENSOR_MAP_SWIZZLE_128B;
      const char* op = p.kv == kPrefillRagged ? "ragged_prefill" : "paged_prefill";
      const bool whole = rows == C::kBN;  // a box of a tile's rows takes the head's blocks, else one
      maps.k = tensor_map_blocks(p.k, p.total_kv, int64_t(p.kv_heads) * DQK, 64, rows, sw, op, whole ? DQK / 64 : 1);
      maps.v = tensor_map_blocks(p.v, p.total_kv, int64_t(p.kv_heads) * DV, 64, rows, sw, op, whole ? DV / 64 : 1);
    }
    with_kernel<C>(p, rows, [&](auto kernel) { kernel<<<grid, C::kThreads, C::kSmem, stream>>>(p, maps); });
    launched = true;
  });
  if (!launched) throw std::invalid_argument("prefill: configuration " + std::to_string(config) + " is not built");
  check_cuda(cudaGetLastError(), "prefill", "kernel launch");
}

template <int DQK, int DV>
void portable_kernel_prewarm(int smem_limit) {
  using namespace portable_detail;
  for_config<DQK, DV>(-1, [&](auto cfg) {
    using C = decltype(cfg);
    if (C::kSmem > smem_limit) return;
    each_kernel<C>([&](auto kernel) {
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem), "prefill",
                 "shared-memory attribute");
    });
  });
}

}  // namespace prefill
}  // namespace hmoe
