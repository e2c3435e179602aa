// The CPU MoE experts op for one ISA (this file is compiled once per level in arch/cpu.json):
// route (tokens grouped by expert), gather, GEMM1 + silu*up, GEMM2, weighted combine; written
// once over the weight format (format.h), its activation rows (act.h) and its microkernels
// (gemm.h), the GEMMs of a task going through panel.h.
#include "experts/moe_experts.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "experts/act.h"
#include "experts/format.h"
#include "experts/gemm.h"
#include "experts/pack.h"
#include "experts/panel.h"

#if defined(HMOE_PHASE_TIMING) && defined(__linux__)
#include <sched.h>
#endif

namespace hmoe {
namespace HMOE_ISA {

#ifdef HMOE_PHASE_TIMING
// tools/experts_tune builds with this: the wall time of each phase of the last call, in ms
// (0: route, buffers and gather; 1: GEMM1; 2: h quantised; 3: GEMM2; 4: combine).
double g_phase_ms[5];
// Per GEMM phase (0: GEMM1, 1: GEMM2): each worker's time inside tasks, in ms (workers < 64).
double g_busy_ms[2][64];
// ... and when each worker started its first task (ms into the phase; -1: none) and on which CPU
// (-1 where unknown): a worker that wakes late, or on the caller's CPU, shows there.
double g_first_ms[2][64];
int g_cpu[2][64];
#endif

namespace {

#ifdef HMOE_PHASE_TIMING
struct PhaseClock {
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void mark(int i) {
    const auto now = std::chrono::steady_clock::now();
    g_phase_ms[i] = std::chrono::duration<double, std::milli>(now - t).count();
    t = now;
  }
};
// Times fn(task, worker) into g_busy_ms[phase][worker].
template <typename F>
auto busy_timed(int phase, F&& fn) {
  for (double& b : g_busy_ms[phase]) b = 0;
  for (double& b : g_first_ms[phase]) b = -1;
  return [phase, fn, start = std::chrono::steady_clock::now()](int64_t task, int w) {
    const auto t0 = std::chrono::steady_clock::now();
    if (w < 64 && g_first_ms[phase][w] < 0) {
      g_first_ms[phase][w] = std::chrono::duration<double, std::milli>(t0 - start).count();
#ifdef __linux__
      g_cpu[phase][w] = sched_getcpu();
#else
      g_cpu[phase][w] = -1;
#endif
    }
    fn(task, w);
    if (w < 64)
      g_busy_ms[phase][w] += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
}
#else
struct PhaseClock {
  void mark(int) {}
};
template <typename F>
F&& busy_timed(int, F&& fn) {
  return std::forward<F>(fn);
}
#endif

// With unpacked weights, experts that see at most this many rows use the row-dot kernel,
// which streams each weight row once; more rows and blocks are packed on the fly per task.
constexpr int64_t kRowsMaxM = 4;

struct Routing {
  std::vector<int64_t> offset;  // [E + 1]: rows of expert e are [offset[e], offset[e+1])
  std::vector<int64_t> pos;     // [T * K]: row of slot (t, k); -1 for an empty slot
  std::vector<int32_t> active;  // experts with rows
  int64_t rows = 0;             // rows in all: the slots that are not empty
  int64_t max_rows = 0;
};

Routing route(const MoeParams& p) {
  Routing r;
  const int64_t S = p.T * p.K;
  std::vector<int64_t> ids(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    int64_t e =
        p.ids_dtype == kI64 ? static_cast<const int64_t*>(p.topk_ids)[s] : static_cast<const int32_t*>(p.topk_ids)[s];
    // The op's range check (Python leaves it here: this pass reads every id anyway, before any
    // weight is touched). std::invalid_argument reaches Python as ValueError. -1 is an empty slot.
    if (e < -1 || e >= p.E) {
      throw std::invalid_argument("topk_ids holds " + std::to_string(e) + " (token " + std::to_string(s / p.K) +
                                  ", slot " + std::to_string(s % p.K) + "), outside [0, " + std::to_string(p.E) +
                                  ") and not -1 (an empty slot)");
    }
    ids[size_t(s)] = e;
  }
  r.offset.assign(size_t(p.E + 1), 0);
  for (int64_t s = 0; s < S; ++s)
    if (ids[size_t(s)] >= 0) ++r.offset[size_t(ids[size_t(s)] + 1)];
  for (int64_t e = 0; e < p.E; ++e) {
    int64_t n = r.offset[size_t(e + 1)];
    if (n > 0) r.active.push_back(int32_t(e));
    r.max_rows = std::max(r.max_rows, n);
    r.offset[size_t(e + 1)] += r.offset[size_t(e)];
  }
  r.rows = r.offset[size_t(p.E)];
  std::vector<int64_t> fill(r.offset.begin(), r.offset.end() - 1);
  r.pos.resize(size_t(S));
  for (int64_t s = 0; s < S; ++s) r.pos[size_t(s)] = ids[size_t(s)] < 0 ? -1 : fill[size_t(ids[size_t(s)])]++;
  return r;
}

// A task of a GEMM phase: (active index, first block, end block).
struct Task {
  int32_t a;
  int64_t b0, b1;
};

// Threads worth waking for a phase that moves about `bytes` (weights streamed, or rows copied):
// waking a worker costs a few microseconds, about what streaming 256 KB takes, so tiny calls
// (decode with small experts, the gather and combine of a few tokens) stay on the caller.
constexpr int64_t kBytesPerThread = 256 << 10;
int threads_for(int64_t bytes, int threads) { return int(std::clamp<int64_t>(bytes / kBytesPerThread, 1, threads)); }

#ifndef HMOE_TUNE_TASK_UNITS
#define HMOE_TUNE_TASK_UNITS 64
#endif
#ifndef HMOE_TUNE_TASK_TAIL
#define HMOE_TUNE_TASK_TAIL 1
#endif
// Splits each active expert's n_blocks into chunks (multiples of `unit`) so that there are enough
// tasks to keep every thread busy, in hand-out order; the last HMOE_TUNE_TASK_TAIL x threads
// chunks go in quarters, so that the workers finish together: a worker that runs slower than the
// others (on shared hosts some vCPUs run the tile unit at half the others' rate or less, which ones
// changing from run to run) then holds the phase up by a quarter task at most (measured in
// docs/perf/experts.md).
std::vector<Task> make_tasks(const Routing& r, int64_t n_blocks, int64_t unit, int threads) {
  int64_t total = int64_t(r.active.size()) * n_blocks;
  int64_t chunk = std::clamp<int64_t>(total / (8 * int64_t(threads)), 1, HMOE_TUNE_TASK_UNITS);
  chunk = std::max<int64_t>(unit, chunk / unit * unit);
  std::vector<Task> tasks;
  for (size_t a = 0; a < r.active.size(); ++a)
    for (int64_t b = 0; b < n_blocks; b += chunk) tasks.push_back({int32_t(a), b, std::min(n_blocks, b + chunk)});
  const int64_t tail = std::min<int64_t>(int64_t(tasks.size()) / 2, HMOE_TUNE_TASK_TAIL * int64_t(threads));
  const int64_t piece = std::max<int64_t>(unit, chunk / 4 / unit * unit);
  if (tail > 0 && piece < chunk) {
    const std::vector<Task> last(tasks.end() - tail, tasks.end());
    tasks.resize(tasks.size() - size_t(tail));
    for (const Task& t : last)
      for (int64_t b = t.b0; b < t.b1; b += piece) tasks.push_back({t.a, b, std::min(t.b1, b + piece)});
  }
  return tasks;
}

// Calls f(row) for rows [0, S) on `workers` threads.
template <typename F>
void for_rows(int64_t S, int workers, F&& f) {
  const int64_t chunk = std::max<int64_t>(1, S / (4 * workers));
  ThreadPool::instance().parallel_for(ceil_div(S, chunk), workers, [&](int64_t task, int) {
    for (int64_t row = task * chunk; row < std::min(S, (task + 1) * chunk); ++row) f(row);
  });
}

// The rows of x in expert order, on `workers` threads: each token's row is converted (or
// quantised) once, into the row of its first routed slot, and copied to the rows of its other
// routed slots; a token whose slots are all empty is not read.
template <class Rows>
void gather(const MoeParams& p, const Routing& r, Rows& X, int workers) {
  std::vector<std::vector<float>> tmp(static_cast<size_t>(workers));
  const int64_t xsz = dtype_size(p.x_dtype);
  const int64_t chunk = std::max<int64_t>(1, p.T / (4 * workers));
  ThreadPool::instance().parallel_for(ceil_div(p.T, chunk), workers, [&](int64_t task, int w) {
    std::vector<float>& row = tmp[size_t(w)];
    row.resize(size_t(p.H));
    for (int64_t t = task * chunk; t < std::min(p.T, (task + 1) * chunk); ++t) {
      const int64_t* pos = r.pos.data() + t * p.K;
      int64_t k0 = 0;
      while (k0 < p.K && pos[k0] < 0) ++k0;
      if (k0 == p.K) continue;
      load_row_f32(static_cast<const char*>(p.x) + t * p.H * xsz, p.x_dtype, p.H, row.data());
      X.store(pos[k0], row.data(), p.H);
      for (int64_t k = k0 + 1; k < p.K; ++k)
        if (pos[k] >= 0) X.copy_row(pos[k], pos[k0]);
    }
  });
}

// out[t] = sum_k w[t, k] * Y[pos(t, k)] over the routed slots, in k order, then rounded once to
// x's dtype (zeros for a token with no routed slot; an empty slot's weight is not read).
void combine(const MoeParams& p, const Routing& r, const float* Y, int64_t ldy, int threads) {
  const int64_t chunk = std::max<int64_t>(1, p.T / (4 * threads));
  ThreadPool::instance().parallel_for(
      ceil_div(p.T, chunk), threads_for(p.T * p.K * p.H * 4, threads), [&](int64_t task, int) {
        std::vector<float> acc(size_t(p.H));
        for (int64_t t = task * chunk; t < std::min(p.T, (task + 1) * chunk); ++t) {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t k = 0; k < p.K; ++k) {
            const int64_t row = r.pos[size_t(t * p.K + k)];
            if (row < 0) continue;
            const float w = p.topk_weights[t * p.K + k];
            const float* y = Y + row * ldy;
            for (int64_t j = 0; j < p.H; ++j) acc[size_t(j)] += w * y[j];
          }
          store_row(acc.data(), p.H, p.x_dtype, static_cast<char*>(p.out) + t * p.H * dtype_size(p.x_dtype));
        }
      });
}

// Copies the rows of every active expert that takes the tile path (panel.h) into tile order.
template <class Fmt, class Rows>
void build_tiles(Workspace::Call& ws, const Routing& r, const Rows& rows, const PackedK& K, int threads,
                 ExpertTiles& t) {
  if constexpr (Fmt::kTiles && isa::Tiles::kAvailable) {
    const TileGeometry<Fmt> geo(rows.ld, K);
    const size_t n = r.active.size();
    t.off.assign(n, -1);
    int64_t total = 0;
    for (size_t a = 0; a < n; ++a) {
      const int64_t e = r.active[a], m = r.offset[size_t(e + 1)] - r.offset[size_t(e)];
      if (use_tiles<Fmt>(m)) t.off[a] = total, total += round_up(m, 32) * geo.kbytes;
    }
    if (total == 0) return;
    t.buf = ws.take<char>(total);
    t.kw = geo.kw, t.ncols = geo.kbytes / geo.kw;
    ThreadPool::instance().parallel_for(int64_t(n), threads_for(total, threads), [&](int64_t a, int) {
      if (t.off[size_t(a)] < 0) return;
      const int64_t e = r.active[size_t(a)], row0 = r.offset[size_t(e)];
      const int64_t m = r.offset[size_t(e + 1)] - row0;
      pack_tiles(row_bytes(rows.at(row0)), geo.kbytes, round_up(m, 32), geo.kbytes, geo.kw, t.buf + t.off[size_t(a)]);
    });
  } else {
    (void)ws, (void)r, (void)rows, (void)K, (void)threads, (void)t;
  }
}

template <class Fmt>
void alloc_rows(Workspace::Call& ws, ActRows<Fmt::kAct>& a, int64_t rows, int64_t ld, int64_t pad, int64_t group) {
  if constexpr (Fmt::kAct == Act::kI8)
    a.alloc(ws, rows, ld, pad, group);
  else
    a.alloc(ws, rows, ld, pad);
}

// Packed weights (prepacked, or packed on the fly per task): the path of every format.
template <class Fmt>
void run_packed(const MoeParams& p, const Routing& r, int threads) {
  Workspace::Call ws;
  PhaseClock clock;
  ThreadPool& pool = ThreadPool::instance();
  const int64_t S = r.rows;  // activation rows: one a routed slot
  const PackedK k13{p.H, p.group13, Fmt::groups(p.H, p.group13)}, k2{p.I, p.group2, Fmt::groups(p.I, p.group2)};
  const int64_t n_pairs = ceil_div(p.I, kBlockN), n_out = ceil_div(p.H, kBlockN);
  const int64_t bytes13 = Fmt::w13_bytes(p.H, p.I, p.group13), bytes2 = Fmt::w2_bytes(p.H, p.I, p.group2);
  const int64_t block13 = Fmt::block_bytes(p.H, p.group13), block2 = Fmt::block_bytes(p.I, p.group2);
  const int64_t wsz = sizeof(typename Fmt::Elem);  // unpacked (float) weights
  constexpr bool kQuantAct = Fmt::kAct == Act::kI8;

  // Weight bytes streamed, times the 16-row register tiles each block meets (compute grows with rows).
  const int64_t tiles = ceil_div(r.max_rows, 16);
  const int64_t n_active = int64_t(r.active.size());
  const int threads1 = threads_for(n_active * bytes13 * tiles, threads);
  pool.wake(threads1);  // the gather below takes each worker as it comes

  ActRows<Fmt::kAct> X, Hact;
  const int64_t pad = use_tiles<Fmt>(r.max_rows) ? 32 : 0;  // rows a 32-row tile may read past the end
  alloc_rows<Fmt>(ws, X, S, Fmt::packed_k(p.H, p.group13), pad, p.group13);
  const int64_t ldh = std::max(Fmt::packed_k(p.I, p.group2), n_pairs * kBlockN);
  alloc_rows<Fmt>(ws, Hact, S, ldh, pad, p.group2);
  // The workers are woken for GEMM1 already, so the row passes before and after it (the gather,
  // a task per few tokens; h quantised, a task per few rows) may use all of them: quantising a
  // row of int8 activations takes microseconds.
  gather(p, r, X, std::max(threads1, threads_for(S * p.H * 4, threads)));
  ExpertTiles x_tiles, h_tiles;
  build_tiles<Fmt>(ws, r, X, k13, threads, x_tiles);
  // h = silu(gate) * up: straight into Hact 16 columns at a time, or (int8 activations, quantised
  // per group of a whole row) into fp32 rows first.
  ActRows<Act::kF32> Hf;
  if constexpr (kQuantAct) {
    Hf.alloc(ws, S, n_pairs * kBlockN, 0);
  } else {  // columns of Hact no GEMM1 block writes read as zero in GEMM2
    for (int64_t s = 0; s < S; ++s) std::fill(Hact.buf + s * ldh + n_pairs * kBlockN, Hact.buf + (s + 1) * ldh, 0);
  }
  float* Y = ws.take<float>(S * n_out * kBlockN);
  const int64_t ldy = n_out * kBlockN;

  // Per-thread scratch for blocks packed on the fly (unpacked float weights): packed right before
  // the rows that use them, so they stay in L2.
  char* scratch = p.packed ? nullptr : ws.take<char>(threads * kMaxNR * std::max(block13, block2));
  auto scratch_for = [&](int worker) { return scratch + worker * kMaxNR * std::max(block13, block2); };
  // Runs blocks [b0, b1) of expert e's matrix: prepacked, or packed kMaxNR at a time into scratch.
  auto run_blocks = [&](int worker, const char* we, int64_t b0, int64_t b1, int64_t block, auto pack, auto&& gemm) {
    const void* B[128];
    for (int64_t c0 = b0; c0 < b1; c0 += p.packed ? 128 : kMaxNR) {
      const int64_t c1 = std::min(b1, c0 + (p.packed ? 128 : kMaxNR));
      const char* blocks = we + c0 * block;
      if (!p.packed) {
        char* s = scratch_for(worker);
        pack(we, c0, c1, s);
        blocks = s;
      }
      for (int64_t j = 0; j < c1 - c0; ++j) B[j] = blocks + j * block;
      gemm(c0, int(c1 - c0), B);
    }
  };

  clock.mark(0);
  // GEMM1 + silu(gate) * up, one task per (expert, range of gate/up block pairs).
  auto tasks1 = make_tasks(r, n_pairs, isa::kNR / 2, threads);
  auto gemm1_task = [&](int64_t ti, int w) {
    const Task& tk = tasks1[size_t(ti)];
    const int64_t e = r.active[size_t(tk.a)];
    const int64_t row0 = r.offset[size_t(e)], rows = r.offset[size_t(e + 1)] - row0;
    const char* w13e = static_cast<const char*>(p.w13) + e * (p.packed ? bytes13 : 2 * p.I * p.H * wsz);
    const TileA xt = x_tiles.has(tk.a) ? x_tiles.tiles(tk.a) : TileA{};
    auto pack = [&](const char* src, int64_t c0, int64_t c1, char* dst) {
      pack_w13_blocks(src, p.w_format, p.H, p.I, c0, c1, dst);
    };
    run_blocks(w, w13e, 2 * tk.b0, 2 * tk.b1, block13, pack, [&](int64_t c0, int nb, const void* const* B) {
      task_gemm<Fmt>(rows, X.at(row0), x_tiles.has(tk.a) ? &xt : nullptr, B, nb, k13,
                     [&](int64_t r0, int m, int64_t b0, int64_t nbk, const float* C, int64_t ldc) {
                       float h[kBlockN];
                       for (int i = 0; i < m; ++i)
                         for (int64_t q = 0; q < nbk / 2; ++q) {
                           const float* c = C + i * ldc + 2 * q * kBlockN;
                           silu_mul16(c, c + kBlockN, h);
                           const int64_t col = (c0 / 2 + b0 / 2 + q) * kBlockN;
                           if constexpr (kQuantAct)
                             Hf.store_cols(row0 + r0 + i, col, h, kBlockN);
                           else
                             Hact.store_cols(row0 + r0 + i, col, h, kBlockN);
                         }
                     });
    });
  };
  pool.parallel_for(int64_t(tasks1.size()), threads1, busy_timed(0, gemm1_task));
  clock.mark(1);
  if constexpr (kQuantAct)
    for_rows(S, std::max(threads1, threads_for(S * p.I * 4, threads)),
             [&](int64_t s) { Hact.store(s, Hf.buf + s * Hf.ld, p.I); });
  build_tiles<Fmt>(ws, r, Hact, k2, threads, h_tiles);
  clock.mark(2);

  // GEMM2: one task per (expert, range of output blocks); Y rows stay fp32.
  auto tasks2 = make_tasks(r, n_out, isa::kNR, threads);
  auto gemm2_task = [&](int64_t ti, int w) {
    const Task& tk = tasks2[size_t(ti)];
    const int64_t e = r.active[size_t(tk.a)];
    const int64_t row0 = r.offset[size_t(e)], rows = r.offset[size_t(e + 1)] - row0;
    const char* w2e = static_cast<const char*>(p.w2) + e * (p.packed ? bytes2 : p.H * p.I * wsz);
    const TileA ht = h_tiles.has(tk.a) ? h_tiles.tiles(tk.a) : TileA{};
    auto pack = [&](const char* src, int64_t c0, int64_t c1, char* dst) {
      pack_w2_blocks(src, p.w_format, p.H, p.I, c0, c1, dst);
    };
    run_blocks(w, w2e, tk.b0, tk.b1, block2, pack, [&](int64_t c0, int nb, const void* const* B) {
      task_gemm<Fmt>(rows, Hact.at(row0), h_tiles.has(tk.a) ? &ht : nullptr, B, nb, k2,
                     [&](int64_t r0, int m, int64_t b0, int64_t nbk, const float* C, int64_t ldc) {
                       for (int i = 0; i < m; ++i)
                         std::memcpy(Y + (row0 + r0 + i) * ldy + (c0 + b0) * kBlockN, C + i * ldc,
                                     size_t(nbk * kBlockN * 4));
                     });
    });
  };
  pool.parallel_for(int64_t(tasks2.size()), threads_for(n_active * bytes2 * tiles, threads), busy_timed(1, gemm2_task));
  clock.mark(3);
  combine(p, r, Y, ldy, threads);
  clock.mark(4);
}

// Row-major float weights and at most kRowsMaxM rows per expert (decode): the row-dot kernels read
// each weight row once, with fp32 activations (bf16 values for bf16 weights, the same contract).
template <class Fmt>
void run_rows(const MoeParams& p, const Routing& r, int threads) {
  Workspace::Call ws;
  ThreadPool& pool = ThreadPool::instance();
  const int64_t S = r.rows, n_pairs = ceil_div(p.I, kBlockN), n_out = ceil_div(p.H, kBlockN);
  const int64_t wsz = sizeof(typename Fmt::Elem), ldh = n_pairs * kBlockN, ldy = n_out * kBlockN;
  ActRows<Act::kF32> X, Hact;
  X.round_bf16 = Hact.round_bf16 = Fmt::kAct == Act::kBF16;
  X.alloc(ws, S, p.H, 0);
  Hact.alloc(ws, S, ldh, 0);
  gather(p, r, X, threads_for(S * p.H * 4, threads));
  float* Y = ws.take<float>(S * ldy);
  const int64_t n_active = int64_t(r.active.size());

  // Gate rows j and up rows I + j of the row-major [2I, H] matrix.
  auto tasks1 = make_tasks(r, n_pairs, 1, threads);
  pool.parallel_for(int64_t(tasks1.size()), threads_for(n_active * 2 * p.I * p.H * wsz, threads), [&](int64_t ti, int) {
    const Task& tk = tasks1[size_t(ti)];
    const int64_t e = r.active[size_t(tk.a)];
    const int64_t row0 = r.offset[size_t(e)], rows = r.offset[size_t(e + 1)] - row0;
    const char* w13e = static_cast<const char*>(p.w13) + e * 2 * p.I * p.H * wsz;
    float g[isa::kMR * 2 * kBlockN];
    for (int64_t pr = tk.b0; pr < tk.b1; ++pr) {
      for (int64_t i0 = 0; i0 < rows; i0 += isa::kMR) {
        const int m = int(std::min<int64_t>(isa::kMR, rows - i0));
        for (int64_t c = 0; c < 2 * kBlockN; c += kRowsNW) {
          const void* rp[kRowsNW];
          for (int j = 0; j < kRowsNW; ++j) {
            int64_t col = std::min(pr * kBlockN + (c + j) % kBlockN, p.I - 1);  // clip: discarded later
            int64_t wrow = (c + j) < kBlockN ? col : p.I + col;
            rp[j] = w13e + wrow * p.H * wsz;
          }
          with_count<isa::kMR>(m, [&](auto mr) {
            Micro<Fmt>::template rows<decltype(mr)::value>(X.buf + (row0 + i0) * X.ld, X.ld, rp, p.H, g + c,
                                                           2 * kBlockN);
          });
        }
        for (int i = 0; i < m; ++i) {
          float h[kBlockN];
          silu_mul16(g + i * 2 * kBlockN, g + i * 2 * kBlockN + kBlockN, h);
          Hact.store_cols(row0 + i0 + i, pr * kBlockN, h, kBlockN);
        }
      }
    }
  });

  auto tasks2 = make_tasks(r, n_out, 1, threads);
  pool.parallel_for(int64_t(tasks2.size()), threads_for(n_active * p.H * p.I * wsz, threads), [&](int64_t ti, int) {
    const Task& tk = tasks2[size_t(ti)];
    const int64_t e = r.active[size_t(tk.a)];
    const int64_t row0 = r.offset[size_t(e)], rows = r.offset[size_t(e + 1)] - row0;
    const char* w2e = static_cast<const char*>(p.w2) + e * p.H * p.I * wsz;
    for (int64_t nb = tk.b0; nb < tk.b1; ++nb) {
      for (int64_t i0 = 0; i0 < rows; i0 += isa::kMR) {
        const int m = int(std::min<int64_t>(isa::kMR, rows - i0));
        float c[isa::kMR * kBlockN];
        for (int64_t c0 = 0; c0 < kBlockN; c0 += kRowsNW) {
          const void* rp[kRowsNW];
          for (int j = 0; j < kRowsNW; ++j) rp[j] = w2e + std::min(nb * kBlockN + c0 + j, p.H - 1) * p.I * wsz;
          with_count<isa::kMR>(m, [&](auto mr) {
            Micro<Fmt>::template rows<decltype(mr)::value>(Hact.buf + (row0 + i0) * ldh, ldh, rp, p.I, c + c0, kBlockN);
          });
        }
        for (int i = 0; i < m; ++i) std::memcpy(Y + (row0 + i0 + i) * ldy + nb * kBlockN, c + i * kBlockN, 64);
      }
    }
  });
  combine(p, r, Y, ldy, threads);
}

}  // namespace

void run_moe(const MoeParams& p) {
  if (p.T == 0) return;
  const int threads = std::max(1, p.num_threads);
  ThreadPool::instance().limit(threads);  // workers beyond the caller's count sleep
  with_format(p.w_format, [&](auto fmt) {
    using Fmt = decltype(fmt);
    const Routing r = route(p);
    if (r.rows == 0) {  // every slot empty: no expert runs, the sum is zero
      std::memset(p.out, 0, size_t(p.T * p.H * dtype_size(p.x_dtype)));
      return;
    }
    if constexpr (Fmt::kScaled) {
      if (!p.packed) throw std::invalid_argument("experts: quantised weights are only taken packed");
      run_packed<Fmt>(p, r, threads);
    } else {
      if (!p.packed && r.max_rows <= kRowsMaxM)
        run_rows<Fmt>(p, r, threads);
      else
        run_packed<Fmt>(p, r, threads);
    }
  });
}

}  // namespace HMOE_ISA
}  // namespace hmoe
