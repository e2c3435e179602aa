// The plans of a module's ops, computed once per shape and kept (host code).
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace hmoe::bind {

// Plans a cache keeps at most: a server's calls vary the batch, the page table's width and the
// token counts without end, so a full cache starts over rather than grow.
constexpr size_t kPlanCacheEntries = 4096;

template <size_t N>
struct PlanKeyHash {
  size_t operator()(const std::array<int64_t, N>& key) const {
    size_t h = 0;
    for (const int64_t v : key) h = h * 1000003u ^ size_t(v);
    return h;
  }
};

// The plan compute() gives for `key` (the device, the shape and the overrides it depends on),
// computed once and kept; one cache per plan type and key length. compute() runs outside the lock
// (it may query the device); what it throws reaches the caller, and nothing is kept.
template <typename Plan, size_t N, typename Compute>
Plan cached_plan(const std::array<int64_t, N>& key, Compute compute) {
  static std::mutex mu;
  static std::unordered_map<std::array<int64_t, N>, Plan, PlanKeyHash<N>> plans;
  {
    const std::lock_guard<std::mutex> lock(mu);
    const auto it = plans.find(key);
    if (it != plans.end()) return it->second;
  }
  const Plan plan = compute();
  const std::lock_guard<std::mutex> lock(mu);
  if (plans.size() >= kPlanCacheEntries) plans.clear();
  return plans.emplace(key, plan).first->second;
}

}  // namespace hmoe::bind
