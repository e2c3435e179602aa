// Kernel launches as values (host code). A family's launcher records what one op call launches
// (Launches: the kernel, its grid, block, shared memory and arguments, whether it may start as a
// programmatic dependent of the launch before it); the caller then runs them, either one by one on
// a stream or through a stream's EagerGraph. On the H200 machines' hosts a kernel launch costs the
// host 4.2-4.7 us, two 7.0-8.8 us, and a two-kernel graph whose nodes' parameters are set before
// the launch 2.8-4.6 us (docs/perf/mla_decode.md): an eager call that launches two kernels goes
// through the graph.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/cuda_util.h"

namespace hmoe {

// One kernel launch. Its arguments live in `storage` (offsets, so that a copy stays valid).
struct KernelLaunch {
  static constexpr int kMaxArgs = 4;
  static constexpr size_t kStorage = 1024;
  const void* func = nullptr;
  dim3 grid, block;
  unsigned smem = 0;
  bool programmatic = false;  // may start before the launch before it ends (sm_90+: griddepcontrol)
  int nargs = 0;
  unsigned offset[kMaxArgs] = {};
  size_t bytes = 0;  // of storage the arguments (and their padding) take
  alignas(64) unsigned char storage[kStorage];

  // The argument pointers cudaLaunchKernelExC and kernel graph nodes take.
  void argv(void** out) {
    for (int i = 0; i < nargs; ++i) out[i] = storage + offset[i];
  }
  // This launch as a graph kernel node's parameters, its arguments through `out` (kMaxArgs).
  cudaKernelNodeParams node_params(void** out) {
    argv(out);
    cudaKernelNodeParams kp = {};
    kp.func = const_cast<void*>(func), kp.gridDim = grid, kp.blockDim = block, kp.sharedMemBytes = smem;
    kp.kernelParams = out;
    return kp;
  }
  bool same_as(const KernelLaunch& o) const {
    return func == o.func && grid.x == o.grid.x && grid.y == o.grid.y && grid.z == o.grid.z && block.x == o.block.x &&
           block.y == o.block.y && block.z == o.block.z && smem == o.smem && programmatic == o.programmatic &&
           nargs == o.nargs && bytes == o.bytes && std::memcmp(offset, o.offset, sizeof(offset)) == 0 &&
           std::memcmp(storage, o.storage, bytes) == 0;
  }
};

// The launches of one op call, in stream order.
struct Launches {
  static constexpr int kMax = 2;
  const char* op = "";
  KernelLaunch k[kMax];
  int n = 0;

  // Records kernel<<<grid, block, smem>>>(args...); `programmatic`: as a programmatic dependent of the
  // launch recorded before it. The arguments are converted to the kernel's parameter types and copied.
  template <typename... P, typename... A>
  void add(void (*kernel)(P...), dim3 grid, dim3 block, unsigned smem, bool programmatic, const A&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "one argument per kernel parameter");
    static_assert(sizeof...(P) <= KernelLaunch::kMaxArgs, "more kernel parameters than KernelLaunch holds");
    if (n == kMax) throw std::logic_error(std::string(op) + ": more launches than Launches holds");
    KernelLaunch& l = k[n++];
    l.func = reinterpret_cast<const void*>(kernel);
    l.grid = grid, l.block = block, l.smem = smem, l.programmatic = programmatic;
    l.nargs = 0;
    l.bytes = 0;
    (store<std::remove_cv_t<P>>(l, args), ...);
  }

 private:
  template <typename T, typename A>
  static void store(KernelLaunch& l, const A& arg) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel parameters are copied bytes");
    const size_t at = (l.bytes + alignof(T) - 1) / alignof(T) * alignof(T);
    if (at + sizeof(T) > KernelLaunch::kStorage)
      throw std::logic_error("kernel arguments exceed KernelLaunch's storage");
    std::memset(l.storage + l.bytes, 0, at + sizeof(T) - l.bytes);  // padding compares equal in same_as
    new (l.storage + at) T(arg);
    l.offset[l.nargs++] = unsigned(at);
    l.bytes = at + sizeof(T);
  }
};

// Launches l on `stream` (the current device must be the stream's).
inline void launch_one(KernelLaunch& l, cudaStream_t stream, const char* op) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = l.grid, cfg.blockDim = l.block, cfg.dynamicSmemBytes = l.smem, cfg.stream = stream;
  cfg.attrs = &attr, cfg.numAttrs = l.programmatic ? 1 : 0;
  void* argv[KernelLaunch::kMaxArgs];
  l.argv(argv);
  check_cuda(cudaLaunchKernelExC(&cfg, l.func, argv), op, "kernel launch");
}

// A stream's graph for eager calls of two launches: instantiated once per (stream, count of
// launches, which of them are programmatic), its nodes' parameters (kernel, grid, block, shared
// memory, arguments) set before each launch where they changed. Not thread-safe: its owner holds a
// lock around run() (the calls of one stream are ordered anyway). Under graph capture the caller
// launches directly instead, so that the launches join the captured graph.
class EagerGraph {
 public:
  // Runs L on `stream` through the graph. False when it cannot (a CUDA error building or updating
  // it: the graph is then never used again); the caller launches directly.
  bool run(Launches& L, cudaStream_t stream) {
    if (broken_ || L.n < 2) return false;
    if (exec_ != nullptr && !fits(L)) drop();
    if (exec_ == nullptr && !build(L)) return fail();
    void* argv[KernelLaunch::kMaxArgs];
    for (int i = 0; i < L.n; ++i) {
      if (last_[i].same_as(L.k[i])) continue;
      const cudaKernelNodeParams kp = L.k[i].node_params(argv);
      if (cudaGraphExecKernelNodeSetParams(exec_, nodes_[i], &kp) != cudaSuccess) return fail();
      last_[i] = L.k[i];
    }
    if (cudaGraphLaunch(exec_, stream) != cudaSuccess) return fail();
    return true;
  }

 private:
  bool fits(const Launches& L) const {
    if (L.n != n_) return false;
    for (int i = 0; i < n_; ++i)
      if (L.k[i].programmatic != last_[i].programmatic) return false;
    return true;
  }
  bool build(Launches& L) {
    if (cudaGraphCreate(&graph_, 0) != cudaSuccess) return false;
    void* argv[KernelLaunch::kMaxArgs];
    for (int i = 0; i < L.n; ++i) {
      const cudaKernelNodeParams kp = L.k[i].node_params(argv);
      if (cudaGraphAddKernelNode(&nodes_[i], graph_, nullptr, 0, &kp) != cudaSuccess) return false;
      if (i > 0) {
        cudaGraphEdgeData edge = {};
        if (L.k[i].programmatic) {
          edge.from_port = cudaGraphKernelNodePortProgrammatic;
          edge.type = cudaGraphDependencyTypeProgrammatic;
        }
        if (cudaGraphAddDependencies(graph_, &nodes_[i - 1], &nodes_[i], &edge, 1) != cudaSuccess) return false;
      }
      last_[i] = L.k[i];
    }
    if (cudaGraphInstantiate(&exec_, graph_, 0) != cudaSuccess) {
      exec_ = nullptr;
      return false;
    }
    n_ = L.n;
    return true;
  }
  void drop() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    exec_ = nullptr, graph_ = nullptr, n_ = 0;
  }
  bool fail() {
    cudaGetLastError();
    drop();
    broken_ = true;
    return false;
  }

  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  cudaGraphNode_t nodes_[Launches::kMax] = {};
  KernelLaunch last_[Launches::kMax];
  int n_ = 0;
  bool broken_ = false;
};

// Runs the launches of one call on `stream`: through `graph` (the stream's, for an eager call;
// nullptr under capture) where it can, else one by one.
inline void run_launches(Launches& L, cudaStream_t stream, EagerGraph* graph) {
  if (graph != nullptr && graph->run(L, stream)) return;
  for (int i = 0; i < L.n; ++i) launch_one(L.k[i], stream, L.op);
}

}  // namespace hmoe
