// The scheduling of a prefill call, computed on the GPU from the index arrays so that a captured
// CUDA graph replays with new contents: the request bounds every prefill kernel reads the same way
// (clamped, so no index array can send a kernel outside q, k, v or the cache), and the work list
// (which request and q tile each CTA takes, the heaviest first). Any family includes this and
// launches prefill_schedule_kernel before its attention kernel.
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/cuda_util.h"
#include "hmoe/prefill.h"

namespace hmoe {
namespace prefill {

// A request as the kernels see it: queries [q0, q0 + lq) of q, keys [kv0, kv0 + lk) of k/v
// (ragged) or tokens [0, lk) of its page-table row (paged; kv0 = 0).
struct Request {
  int q0, lq, kv0, lk;
};

// Clamped: an indptr entry outside [0, total] or below its predecessor gives an empty or shorter
// request, a length outside [0, max_pages * page_size] is clamped into it. A call whose arrays
// break the rules computes something for the rows they name and never touches memory outside the
// tensors (check_indices=True reports them instead).
__device__ __forceinline__ Request request(const PrefillParams& p, int b) {
  Request r;
  const int qa = min(max(p.qo_indptr[b], 0), p.total_q);
  const int qb = min(max(p.qo_indptr[b + 1], qa), p.total_q);
  r.q0 = qa, r.lq = qb - qa;
  if (p.kv == kPrefillRagged) {
    const int ka = min(max(p.kv_indptr[b], 0), p.total_kv);
    const int kb = min(max(p.kv_indptr[b + 1], ka), p.total_kv);
    r.kv0 = ka, r.lk = kb - ka;
  } else {
    r.kv0 = 0, r.lk = min(max(p.kv_lens[b], 0), p.max_pages * p.page_size);
  }
  return r;
}

// The keys query i of the request (0-based) sees: [0, visible_keys). Causal attention is aligned to
// the end of the sequence (query i sees keys j <= i + lk - lq), written so that nothing overflows.
__device__ __forceinline__ int visible_keys(const Request& r, int causal, int i) {
  return causal ? min(r.lk, max(0, r.lk - (r.lq - 1 - i))) : r.lk;
}

// The order of a request's q tiles (tile_q rows each), each family's choice; q tile k (below the
// request's tile count: the schedule's items) holds rows [first, first + rows) of its queries.
//   kFromStart  tile k starts at query k tile_q; the request's last queries may form a partial tile.
//   kFromEnd    tile k ends k tile_q queries before the request's end; its first queries may form
//               a partial tile.
// Under the causal mask a partial tile at a request's end sees every key (its CTA costs as much as
// the request's heaviest), one at its start sees the first keys only. From the end, a q tile's
// diagonal no longer lines up with key tiles counted from the request's first key (one masked key
// tile more a q tile). What each family measured: docs/perf/prefill.md.
enum class QOrder { kFromStart, kFromEnd };
struct QTile {
  int first, rows;
};
__device__ __forceinline__ QTile q_tile(const Request& r, int k, int tile_q, QOrder order) {
  if (order == QOrder::kFromStart) {
    const int first = k * tile_q;
    return {first, min(tile_q, r.lq - first)};
  }
  const int end = int(max(int64_t(r.lq) - int64_t(k) * tile_q, int64_t(0)));
  const int first = max(end - tile_q, 0);
  return {first, end - first};
}

// The workspace of a call (plan.workspace int32 words): the work list first (what the attention
// kernel reads), then the schedule's scratch, then a counter the schedule zeroes (a persistent
// attention kernel hands out work items with it).
struct ScheduleLayout {
  int64_t work, items, keys, tile_start, counter, words;  // offsets in int32 words; work and items hold int2
  __host__ __device__ ScheduleLayout(int batch, int max_items) {
    work = 0;
    items = 2 * int64_t(max_items);
    keys = items + 2 * int64_t(max_items);
    tile_start = keys + max_items;
    counter = tile_start + batch + 1;
    words = counter + 1;
  }
};

constexpr int kScheduleThreads = 1024;
constexpr int kScheduleBuckets = 2048;  // costs (in 64-key units) at or past this share the last bucket

// Exclusive prefix sum of v over the block; *total receives the sum (every thread).
__device__ __forceinline__ int block_exclusive_scan(int v, int* total, int* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, off);
      if (lane >= off) s += y;
    }
    warp_sums[lane] = s;  // inclusive over warps
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// One block: (1) the q tiles of each request (tile_q rows each, in the family's order) and their
// running sum; (2) every tile's cost, the keys its last row sees (what its CTA walks), as a bucket;
// (3) a counting sort, heaviest first, so that the light tiles end the grid (the hardware hands
// CTAs to SMs in order); (4) the work list {request, q tile}, then {-1, 0} in the unused slots. The
// order within a bucket depends on atomics, the results do not: each tile's CTA computes the same
// thing wherever it runs.
// A template only so that a translation unit that does not launch it compiles no copy of it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) prefill_schedule_kernel(const PrefillParams p, int tile_q, QOrder order) {
  static_assert(kThreads == kScheduleThreads, "the bucket scan gives each thread kScheduleBuckets / kThreads buckets");
  __shared__ int bucket[kScheduleBuckets];
  __shared__ int warp_sums[32];
  const ScheduleLayout at(p.batch, p.max_items);
  int2* work = reinterpret_cast<int2*>(p.workspace + at.work);
  int2* items = reinterpret_cast<int2*>(p.workspace + at.items);
  int* keys = p.workspace + at.keys;
  int* tile_start = p.workspace + at.tile_start;
  const int tid = threadIdx.x, nt = blockDim.x;

  if (tid == 0) p.workspace[at.counter] = 0;
  int count = 0;
  for (int base = 0; base < p.batch; base += nt) {
    const int b = base + tid;
    const int tiles = b < p.batch ? (request(p, b).lq + tile_q - 1) / tile_q : 0;
    int sum = 0;
    const int before = block_exclusive_scan(tiles, &sum, warp_sums);
    if (b < p.batch) tile_start[b] = count + before;
    count += sum;  // the same in every thread
  }
  if (tid == 0) tile_start[p.batch] = count;
  const int n_items = min(count, p.max_items);  // more only when clamped arrays overlap
  for (int k = tid; k < kScheduleBuckets; k += nt) bucket[k] = 0;
  __syncthreads();  // tile_start and the zeroed buckets visible to the block

  for (int w = tid; w < n_items; w += nt) {
    int lo = 0, hi = p.batch - 1;  // the request: the last b with tile_start[b] <= w
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_start[mid] <= w)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int qt = w - tile_start[lo];
    const Request r = request(p, lo);
    const QTile tile = q_tile(r, qt, tile_q, order);
    const int key = min(visible_keys(r, p.causal, tile.first + tile.rows - 1) / 64, kScheduleBuckets - 1);
    items[w] = make_int2(lo, qt);
    keys[w] = key;
    atomicAdd(&bucket[key], 1);
  }
  __syncthreads();

  // Start of each bucket in the sorted list, heaviest bucket first: thread i takes buckets
  // kScheduleBuckets - 1 - i * per .. (descending). The launch uses kScheduleThreads threads.
  constexpr int per = kScheduleBuckets / kScheduleThreads;
  int mine = 0, own[per];
#pragma unroll
  for (int u = 0; u < per; ++u) own[u] = bucket[kScheduleBuckets - 1 - (tid * per + u)], mine += own[u];
  int total = 0;
  int start = block_exclusive_scan(mine, &total, warp_sums);
#pragma unroll
  for (int u = 0; u < per; ++u) bucket[kScheduleBuckets - 1 - (tid * per + u)] = start, start += own[u];
  __syncthreads();

  for (int w = tid; w < n_items; w += nt) work[atomicAdd(&bucket[keys[w]], 1)] = items[w];
  for (int w = n_items + tid; w < p.max_items; w += nt) work[w] = make_int2(-1, 0);
}

// A plan's work list for plan.tile_q query rows a CTA, the same rule for every family: every
// request's last q tile may be partial, so floor(total_q / tile_q) + batch tiles at most. Sets
// plan.max_items and plan.workspace; throws std::invalid_argument when items x heads CTAs would
// exceed the CUDA grid.
inline void size_work_list(PrefillPlan& plan, int64_t total_q, int batch, int heads) {
  const int64_t items = total_q / plan.tile_q + batch;
  if (items * heads > INT32_MAX)
    throw std::invalid_argument("prefill: " + std::to_string(items) + " q tiles x " + std::to_string(heads) +
                                " heads exceed the CUDA grid (2^31 - 1 CTAs)");
  plan.max_items = int32_t(items);
  plan.workspace = int32_t(ScheduleLayout(batch, plan.max_items).words);
}

// Whether plan's work list is the one size_work_list gives this call (a stale or foreign plan
// must not launch with a work list of another size) and the heads divide.
inline bool work_list_fits(const PrefillParams& p, const PrefillPlan& plan) {
  return plan.tile_q > 0 && plan.max_items == int64_t(p.total_q) / plan.tile_q + p.batch &&
         plan.workspace == ScheduleLayout(p.batch, plan.max_items).words && p.heads % p.kv_heads == 0;
}

// Launches the schedule of a call (p.max_items = plan.max_items) on `stream`, before the
// attention kernel; `op` names the caller in errors. A template, like the kernel, so that only a
// translation unit that calls it compiles the kernel.
template <int kThreads = kScheduleThreads>
void launch_schedule(const PrefillParams& p, int tile_q, QOrder order, cudaStream_t stream, const char* op) {
  prefill_schedule_kernel<kThreads><<<1, kThreads, 0, stream>>>(p, tile_q, order);
  check_cuda(cudaGetLastError(), op, "schedule launch");
}

}  // namespace prefill
}  // namespace hmoe
