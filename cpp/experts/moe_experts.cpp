// The CPU MoE experts op for one ISA (this file is compiled once per level in arch/cpu.json):
// route (tokens grouped by expert), gather, GEMM1 + silu*up, GEMM2, weighted combine; written
// once over the weight format (format.h) and its microkernels (Micro in gemm.h).
#include "experts/moe_experts.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/thread_pool.h"
#include "experts/act.h"
#include "experts/format.h"
#include "experts/gemm.h"
#include "experts/pack.h"

namespace hmoe {
namespace HMOE_ISA {
namespace {

// With unpacked weights, experts that see at most this many rows use the row-dot kernel,
// which streams each weight row once; more rows and blocks are packed on the fly per task.
constexpr int64_t kRowsMaxM = 4;

template <typename T>
std::unique_ptr<T[]> uninit(int64_t n) {
  return std::unique_ptr<T[]>(new T[size_t(std::max<int64_t>(n, 1))]);
}

struct Routing {
  std::vector<int64_t> offset;  // [E + 1]: rows of expert e are [offset[e], offset[e+1])
  std::vector<int64_t> pos;     // [T * K]: row of slot (t, k)
  std::vector<int64_t> token;   // [S]: token of row r
  std::vector<int32_t> active;  // experts with rows
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
    // weight is touched). std::invalid_argument reaches Python as ValueError.
    if (e < 0 || e >= p.E) {
      throw std::invalid_argument("topk_ids holds " + std::to_string(e) + " (token " + std::to_string(s / p.K) +
                                  ", slot " + std::to_string(s % p.K) + "), outside [0, " + std::to_string(p.E) + ")");
    }
    ids[size_t(s)] = e;
  }
  r.offset.assign(size_t(p.E + 1), 0);
  for (int64_t s = 0; s < S; ++s) ++r.offset[size_t(ids[size_t(s)] + 1)];
  for (int64_t e = 0; e < p.E; ++e) {
    int64_t n = r.offset[size_t(e + 1)];
    if (n > 0) r.active.push_back(int32_t(e));
    r.max_rows = std::max(r.max_rows, n);
    r.offset[size_t(e + 1)] += r.offset[size_t(e)];
  }
  std::vector<int64_t> fill(r.offset.begin(), r.offset.end() - 1);
  r.pos.resize(size_t(S));
  r.token.resize(size_t(S));
  for (int64_t s = 0; s < S; ++s) {
    int64_t row = fill[size_t(ids[size_t(s)])]++;
    r.pos[size_t(s)] = row;
    r.token[size_t(row)] = s / p.K;
  }
  return r;
}

// Splits each active expert's n_blocks into chunks so that there are enough tasks to keep
// every thread busy; a task is (active index, first block, end block).
struct Task {
  int32_t a;
  int64_t b0, b1;
};

// The matrix unit (AMX tiles) where the ISA has one and the format suits it; templates so that
// ISAs without it never instantiate the calls.
template <class Fmt, class T = isa::Tiles>
bool use_tiles(int64_t rows) {
  if constexpr (T::kAvailable && Fmt::kTiles)
    return rows >= T::kMinRows;
  else
    return false;
}
template <class T = isa::Tiles>
void tiles_begin() {
  if constexpr (T::kAvailable) T::begin();
}
template <class T = isa::Tiles>
void tiles_end() {
  if constexpr (T::kAvailable) T::end();
}
template <class T = isa::Tiles>
void tiles_2x2(const uint16_t* A, int64_t lda, const uint16_t* B0, const uint16_t* B1, int64_t kpad, float* C,
               int64_t ldc) {
  if constexpr (T::kAvailable) T::mma_2x2(A, lda, B0, B1, kpad, C, ldc);
}
// Threads worth waking for a phase that moves about `bytes` (weights streamed, or rows copied):
// waking a worker costs a few microseconds, about what streaming 256 KB takes, so tiny calls
// (decode with small experts, the gather and combine of a few tokens) stay on the caller.
constexpr int64_t kBytesPerThread = 256 << 10;
int threads_for(int64_t bytes, int threads) { return int(std::clamp<int64_t>(bytes / kBytesPerThread, 1, threads)); }

std::vector<Task> make_tasks(const Routing& r, int64_t n_blocks, int64_t unit, int threads) {
  int64_t total = int64_t(r.active.size()) * n_blocks;
  int64_t chunk = std::clamp<int64_t>(total / (8 * int64_t(threads)), 1, 16);
  chunk = std::max<int64_t>(unit, chunk / unit * unit);
  std::vector<Task> tasks;
  for (size_t a = 0; a < r.active.size(); ++a)
    for (int64_t b = 0; b < n_blocks; b += chunk) tasks.push_back({int32_t(a), b, std::min(n_blocks, b + chunk)});
  return tasks;
}

struct Dims {
  bool packed_path;               // packed kernels (pre-packed or packed per task) vs row-dot kernels
  bool bf16_act;                  // activations entering matmuls stored as bf16 (Fmt::kBf16Act, packed path)
  int64_t ldx, ldh, ldy, kx, kh;  // row strides of X, Hact, Y; reduction lengths of GEMM1/2
  int64_t n_pairs, n_out_blocks;
  int64_t bytes13, bytes2;  // one packed expert
  int64_t block13, block2;  // bytes of one packed block
};

template <class Fmt>
Dims make_dims(const MoeParams& p, const Routing& r) {
  Dims d;
  d.packed_path = p.packed || r.max_rows > kRowsMaxM;
  d.bf16_act = d.packed_path && Fmt::kBf16Act;
  d.kx = d.packed_path ? Fmt::packed_k(p.H) : p.H;
  d.kh = d.packed_path ? Fmt::packed_k(p.I) : p.I;
  d.ldx = d.kx;
  d.ldh = std::max(d.kh, round_up(p.I, kBlockN));
  d.ldy = round_up(p.H, kBlockN);
  d.n_pairs = ceil_div(p.I, kBlockN);
  d.n_out_blocks = ceil_div(p.H, kBlockN);
  d.bytes13 = Fmt::w13_bytes(p.H, p.I);
  d.bytes2 = Fmt::w2_bytes(p.H, p.I);
  d.block13 = Fmt::block_bytes(p.H);
  d.block2 = Fmt::block_bytes(p.I);
  return d;
}

// Output tiles are at most 32 rows x isa::kMaxNR blocks of 16 columns.
constexpr int kMaxNR = isa::kMaxNR;
constexpr int64_t kLdc = kMaxNR * kBlockN;

// Runs C[rows][NR*16] = A rows x blocks for `rows` rows (any count), calling epi(row0, m, C, kLdc)
// per tile of up to 32 rows. AMX handles 32-row tiles when it exists and the expert has rows.
template <class Fmt, int NR, typename Epi>
void packed_rows(int64_t rows, const void* A, int64_t lda, const void* const* B, int64_t kd, Epi&& epi) {
  using Act = typename Micro<Fmt>::Act;
  alignas(64) float C[32 * kLdc];
  const Act* a = static_cast<const Act*>(A);
  if constexpr (Fmt::kTiles) {
    if (use_tiles<Fmt>(rows)) {
      for (int64_t r = 0; r < rows; r += 32) {
        for (int j = 0; j < NR; j += 2) {
          tiles_2x2(a + r * lda, lda, static_cast<const uint16_t*>(B[j]),
                    static_cast<const uint16_t*>(B[std::min(j + 1, NR - 1)]), Fmt::packed_k(kd), C + j * kBlockN, kLdc);
        }
        epi(r, int(std::min<int64_t>(32, rows - r)), C, kLdc);
      }
      return;
    }
  }
  for (int64_t r = 0; r < rows; r += isa::kMR) {
    const int m = int(std::min<int64_t>(isa::kMR, rows - r));
    with_mr(m,
            [&](auto mr) { Micro<Fmt>::template packed<decltype(mr)::value, NR>(a + r * lda, lda, B, kd, C, kLdc); });
    epi(r, m, C, kLdc);
  }
}

// packed_rows for a run-time block count nr in [1, isa::kNR].
template <class Fmt, typename Epi>
void packed_rows_n(int nr, int64_t rows, const void* A, int64_t lda, const void* const* B, int64_t kd, Epi&& epi) {
  with_count<isa::kNR>(nr, [&](auto NR) { packed_rows<Fmt, NR>(rows, A, lda, B, kd, epi); });
}

void store_h(const Dims& d, const float* h, void* Hact, int64_t row, int64_t col) {
  if (d.bf16_act)
    store_act(h, kBlockN, static_cast<uint16_t*>(Hact) + row * d.ldh + col);
  else
    store_act(h, kBlockN, static_cast<float*>(Hact) + row * d.ldh + col);
}

template <class Fmt>
void run_format(const MoeParams& p) {
  static_assert(std::is_same_v<typename Micro<Fmt>::Act, uint16_t> == Fmt::kBf16Act, "packed activations");
  const Routing r = route(p);
  const Dims d = make_dims<Fmt>(p, r);
  const int threads = std::max(1, p.num_threads);
  ThreadPool& pool = ThreadPool::instance();
  const int64_t S = p.T * p.K;
  const int64_t asz = d.bf16_act ? 2 : 4;
  const int64_t wsz = sizeof(typename Fmt::Elem);  // unpacked weights
  const bool round_bf16 = Fmt::kBf16Act;           // contract: matmul inputs rounded to bf16

  // X rows in expert order, plus 32 zero rows so that 32-row tiles never read past the end.
  auto X = uninit<char>((S + 32) * d.ldx * asz);
  auto Hact = uninit<char>((S + 32) * d.ldh * asz);
  auto Y = uninit<float>(S * d.ldy);
  std::memset(X.get() + S * d.ldx * asz, 0, size_t(32 * d.ldx * asz));
  std::memset(Hact.get() + S * d.ldh * asz, 0, size_t(32 * d.ldh * asz));

  const int64_t row_chunk = std::max<int64_t>(1, S / (4 * threads));
  pool.parallel_for(ceil_div(S, row_chunk), threads_for(S * p.H * 4, threads), [&](int64_t task, int) {
    std::vector<float> tmp(size_t(p.H));
    for (int64_t row = task * row_chunk; row < std::min(S, (task + 1) * row_chunk); ++row) {
      const int64_t t = r.token[size_t(row)];
      load_row_f32(static_cast<const char*>(p.x) + t * p.H * dtype_size(p.x_dtype), p.x_dtype, p.H, tmp.data());
      if (d.bf16_act) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(X.get()) + row * d.ldx;
        store_act(tmp.data(), p.H, dst);
        std::fill(dst + p.H, dst + d.ldx, uint16_t(0));
      } else {
        if (round_bf16) round_act_bf16(tmp.data(), p.H);
        float* dst = reinterpret_cast<float*>(X.get()) + row * d.ldx;
        std::memcpy(dst, tmp.data(), size_t(p.H * 4));
        std::fill(dst + p.H, dst + d.ldx, 0.f);
      }
      // Columns of H that no GEMM1 block writes must read as zero in GEMM2.
      char* hrow = Hact.get() + row * d.ldh * asz;
      std::memset(hrow + d.n_pairs * kBlockN * asz, 0, size_t((d.ldh - d.n_pairs * kBlockN) * asz));
    }
  });

  // Per-thread scratch for the blocks of one output tile packed on the fly (unpacked weights,
  // packed path): they are packed right before the rows that use them, so they stay in L2.
  std::vector<std::unique_ptr<char[]>> scratch(static_cast<size_t>(threads));
  auto scratch_for = [&](int worker) {
    if (!scratch[size_t(worker)]) scratch[size_t(worker)] = uninit<char>(kMaxNR * std::max(d.block13, d.block2));
    return scratch[size_t(worker)].get();
  };

  // GEMM1 + silu(gate) * up, one task per (expert, range of gate/up block pairs).
  // Weight bytes streamed, times the 16-row register tiles each block meets (compute grows with rows).
  const int64_t tiles = ceil_div(r.max_rows, 16);
  const int64_t n_active = int64_t(r.active.size());
  auto tasks1 = make_tasks(r, d.n_pairs, isa::kNR / 2, threads);
  pool.parallel_for(
      int64_t(tasks1.size()), threads_for(n_active * d.bytes13 * tiles, threads), [&](int64_t ti, int worker) {
        const Task& tk = tasks1[size_t(ti)];
        const int64_t e = r.active[size_t(tk.a)];
        const int64_t row0 = r.offset[size_t(e)], rows = r.offset[size_t(e + 1)] - row0;
        const char* w13e = static_cast<const char*>(p.w13) + e * (p.packed ? d.bytes13 : 2 * p.I * p.H * wsz);
        if (d.packed_path) {
          if (use_tiles<Fmt>(rows)) tiles_begin();
          // isa::kNR / 2 gate/up pairs per output tile.
          for (int64_t pr = tk.b0; pr < tk.b1; pr += isa::kNR / 2) {
            const int np = int(std::min<int64_t>(isa::kNR / 2, tk.b1 - pr));
            const char* blocks = w13e + 2 * pr * d.block13;
            if (!p.packed) {
              char* s = scratch_for(worker);
              pack_w13_blocks(w13e, p.w_dtype, p.H, p.I, 2 * pr, 2 * (pr + np), s);
              blocks = s;
            }
            const void* B[kMaxNR];
            for (int j = 0; j < 2 * np; ++j) B[j] = blocks + j * d.block13;
            packed_rows_n<Fmt>(2 * np, rows, X.get() + row0 * d.ldx * asz, d.ldx, B, d.kx,
                               [&](int64_t r0, int m, const float* C, int64_t ldc) {
                                 float h[kBlockN];
                                 for (int i = 0; i < m; ++i) {
                                   for (int q = 0; q < np; ++q) {
                                     silu_mul16(C + i * ldc + 2 * q * kBlockN, C + i * ldc + (2 * q + 1) * kBlockN, h);
                                     store_h(d, h, Hact.get(), row0 + r0 + i, (pr + q) * kBlockN);
                                   }
                                 }
                               });
          }
          if (use_tiles<Fmt>(rows)) tiles_end();
          return;
        }
        // Row-dot path: gate rows j and up rows I + j of the row-major [2I, H] matrix.
        float g[isa::kMR * 2 * kBlockN];
        const float* Xf = reinterpret_cast<const float*>(X.get()) + row0 * d.ldx;
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
              with_mr(m, [&](auto mr) {
                Micro<Fmt>::template rows<decltype(mr)::value>(Xf + i0 * d.ldx, d.ldx, rp, p.H, g + c, 2 * kBlockN);
              });
            }
            for (int i = 0; i < m; ++i) {
              float h[kBlockN];
              silu_mul16(g + i * 2 * kBlockN, g + i * 2 * kBlockN + kBlockN, h);
              if (round_bf16) round_act_bf16(h, kBlockN);
              store_h(d, h, Hact.get(), row0 + i0 + i, pr * kBlockN);
            }
          }
        }
      });

  // GEMM2: one task per (expert, range of output blocks); Y rows stay fp32.
  auto tasks2 = make_tasks(r, d.n_out_blocks, isa::kNR, threads);
  pool.parallel_for(
      int64_t(tasks2.size()), threads_for(n_active * d.bytes2 * tiles, threads), [&](int64_t ti, int worker) {
        const Task& tk = tasks2[size_t(ti)];
        const int64_t e = r.active[size_t(tk.a)];
        const int64_t row0 = r.offset[size_t(e)], rows = r.offset[size_t(e + 1)] - row0;
        const char* w2e = static_cast<const char*>(p.w2) + e * (p.packed ? d.bytes2 : p.H * p.I * wsz);
        if (d.packed_path) {
          if (use_tiles<Fmt>(rows)) tiles_begin();
          for (int64_t nb = tk.b0; nb < tk.b1; nb += isa::kNR) {
            const int nr = int(std::min<int64_t>(isa::kNR, tk.b1 - nb));
            const char* blocks = w2e + nb * d.block2;
            if (!p.packed) {
              char* s = scratch_for(worker);
              pack_w2_blocks(w2e, p.w_dtype, p.H, p.I, nb, nb + nr, s);
              blocks = s;
            }
            const void* B[kMaxNR];
            for (int j = 0; j < nr; ++j) B[j] = blocks + j * d.block2;
            packed_rows_n<Fmt>(nr, rows, Hact.get() + row0 * d.ldh * asz, d.ldh, B, d.kh,
                               [&](int64_t r0, int m, const float* C, int64_t ldc) {
                                 for (int i = 0; i < m; ++i)
                                   std::memcpy(Y.get() + (row0 + r0 + i) * d.ldy + nb * kBlockN, C + i * ldc,
                                               size_t(nr * kBlockN * 4));
                               });
          }
          if (use_tiles<Fmt>(rows)) tiles_end();
          return;
        }
        const float* Hf = reinterpret_cast<const float*>(Hact.get()) + row0 * d.ldh;
        for (int64_t nb = tk.b0; nb < tk.b1; ++nb) {
          for (int64_t i0 = 0; i0 < rows; i0 += isa::kMR) {
            const int m = int(std::min<int64_t>(isa::kMR, rows - i0));
            float c[isa::kMR * kBlockN];
            for (int64_t c0 = 0; c0 < kBlockN; c0 += kRowsNW) {
              const void* rp[kRowsNW];
              for (int j = 0; j < kRowsNW; ++j) rp[j] = w2e + std::min(nb * kBlockN + c0 + j, p.H - 1) * p.I * wsz;
              with_mr(m, [&](auto mr) {
                Micro<Fmt>::template rows<decltype(mr)::value>(Hf + i0 * d.ldh, d.ldh, rp, p.I, c + c0, kBlockN);
              });
            }
            for (int i = 0; i < m; ++i)
              std::memcpy(Y.get() + (row0 + i0 + i) * d.ldy + nb * kBlockN, c + i * kBlockN, kBlockN * 4);
          }
        }
      });

  // out[t] = sum_k w[t, k] * Y[pos(t, k)], in k order, then rounded once to x's dtype.
  const int64_t tok_chunk = std::max<int64_t>(1, p.T / (4 * threads));
  pool.parallel_for(ceil_div(p.T, tok_chunk), threads_for(S * p.H * 4, threads), [&](int64_t task, int) {
    std::vector<float> acc(size_t(p.H));
    for (int64_t t = task * tok_chunk; t < std::min(p.T, (task + 1) * tok_chunk); ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k = 0; k < p.K; ++k) {
        const float w = p.topk_weights[t * p.K + k];
        const float* y = Y.get() + r.pos[size_t(t * p.K + k)] * d.ldy;
        for (int64_t j = 0; j < p.H; ++j) acc[size_t(j)] += w * y[j];
      }
      store_row(acc.data(), p.H, p.x_dtype, static_cast<char*>(p.out) + t * p.H * dtype_size(p.x_dtype));
    }
  });
}

}  // namespace

void run_moe(const MoeParams& p) {
  if (p.T == 0) return;
  with_format(p.w_dtype, [&](auto fmt) { run_format<decltype(fmt)>(p); });
}

}  // namespace HMOE_ISA
}  // namespace hmoe
