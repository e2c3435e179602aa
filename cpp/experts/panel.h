// The GEMM of one task of the experts op: an expert's activation rows times a run of packed weight
// blocks, through the matrix unit (AMX tiles, K-blocked) where the ISA has one and the format and
// row count suit it, else through the register microkernels (gemm.h). Written once over the format.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "experts/act.h"
#include "experts/format.h"
#include "experts/gemm.h"

namespace hmoe {
namespace HMOE_ISA {

// Blocks of 16 columns per register tile that callers provide room for.
constexpr int kMaxNR = isa::kMaxNR;

// The matrix unit (isa::Tiles) where the ISA has one and the format suits it; templates so that
// ISAs without it never instantiate the calls.
template <class Fmt, class T = isa::Tiles>
bool use_tiles(int64_t rows) {
  if constexpr (T::kAvailable && Fmt::kTiles)
    return rows >= T::kMinRows;
  else
    return false;
}

// The tile path. A's rows are first copied into the matrix unit's tile order (TileA), so that a
// tile load reads 16 rows of kw contiguous bytes instead of 16 rows K bytes apart (16 pages for
// large K). K is cut into chunks whose slice of A stays in L2 while every block of the task
// passes over it once, so A is read from memory once per task and each weight block once; C
// (rows x the task's columns, fp32) lives in a per-thread buffer meanwhile. Rows go in runs of at
// most kTileRows (32-row tiles) to bound those buffers.
#ifndef HMOE_TUNE_TILE_ROWS
#define HMOE_TUNE_TILE_ROWS 256
#endif
#ifndef HMOE_TUNE_TILE_CHUNK_BYTES
#define HMOE_TUNE_TILE_CHUNK_BYTES (64 << 10)
#endif
constexpr int64_t kTileRows = HMOE_TUNE_TILE_ROWS;
constexpr int64_t kTileChunkBytes = HMOE_TUNE_TILE_CHUNK_BYTES;  // one A row slice a chunk: 32 rows x 2 KB

// What the tile paths fetch into L2 ahead of use, spread over the tile steps of a block pair's row
// passes: bit 0 the weights of the next pair (or of the next K chunk's first pair), bit 1 this
// pair's share of the next K chunk's activation tiles. Without them the first pass over a pair
// (for int4 its unpacking) waits on memory for the weights: the weights' tile loads were half of
// the bf16 path's time (docs/perf/experts.md).
#ifndef HMOE_TUNE_TILE_PREFETCH
#define HMOE_TUNE_TILE_PREFETCH 3
#endif
constexpr bool kAheadB = HMOE_TUNE_TILE_PREFETCH & 1, kAheadA = HMOE_TUNE_TILE_PREFETCH & 2;

// Byte ranges (in order) fetched into L2 a few cache lines at a time, evenly over a number of
// step() calls.
class L2Ahead {
 public:
  void clear() { n_ = 0, total_ = 0, left_ = 0; }
  void add(const void* p, int64_t bytes) {
    if (bytes <= 0 || n_ == kMaxRanges) return;
    r_[n_] = {static_cast<const char*>(p), (bytes + 63) / 64};
    total_ += r_[n_++].lines;
  }
  int64_t lines() const { return total_; }
  // Lines [lo, hi) of the ranges, over the next `steps` calls of step().
  void spread(int64_t lo, int64_t hi, int64_t steps) {
    cur_ = 0, line_ = lo, left_ = std::max<int64_t>(0, std::min(hi, total_) - lo);
    while (cur_ < n_ && line_ >= r_[cur_].lines) line_ -= r_[cur_++].lines;
    per_ = (left_ + std::max<int64_t>(1, steps) - 1) / std::max<int64_t>(1, steps);
  }
  void step() {
    for (int64_t i = 0; i < per_ && left_ > 0; ++i, --left_) {
      __builtin_prefetch(r_[cur_].p + line_ * 64, 0, 2);  // into L2 (prefetcht1 on x86)
      if (++line_ == r_[cur_].lines) line_ = 0, ++cur_;
    }
  }

 private:
  static constexpr int kMaxRanges = 2 + kTileRows / 16;
  struct Range {
    const char* p;
    int64_t lines;
  };
  Range r_[kMaxRanges];
  int n_ = 0, cur_ = 0;
  int64_t total_ = 0, line_ = 0, left_ = 0, per_ = 0;
};

// The prefetches of block pair j (blocks B[j], B[j + 1] of nb) while the K chunk at byte `off` of
// each block runs, over its `steps` tile steps (all row passes): the next pair's `bytes` from
// `off`, or after the last pair the first pair's next chunk (`next_bytes` from `next_off`; none
// when next_off < 0); and the pair's share of the next chunk's activation tiles, `rows` rows in
// 16-row tiles from `a0` (null for none), `a_bytes` a tile, `a_stride` apart.
struct PairAhead {
  L2Ahead b, a;
  void plan(const void* const* B, int nb, int j, int64_t off, int64_t bytes, int64_t next_off, int64_t next_bytes,
            const char* a0, int64_t a_bytes, int64_t a_stride, int64_t rows, int64_t steps) {
    const bool last = j + 2 >= nb;
    const int bj = last ? 0 : j + 2;
    const int64_t o = last ? next_off : off, n = last ? next_bytes : bytes;
    b.clear(), a.clear();
    if (kAheadB && o >= 0) {
      const char* b0 = static_cast<const char*>(B[bj]) + o;
      const char* b1 = static_cast<const char*>(B[std::min(bj + 1, nb - 1)]) + o;
      b.add(b0, n);
      if (b1 != b0) b.add(b1, n);
    }
    b.spread(0, b.lines(), steps);
    if (kAheadA && a0)
      for (int64_t r = 0; r < rows; r += 16) a.add(a0 + r / 16 * a_stride, a_bytes);
    const int64_t pair = j / 2, pairs = (nb + 1) / 2;
    a.spread(a.lines() * pair / pairs, a.lines() * (pair + 1) / pairs, steps);
  }
  void operator()() {
    b.step();
    a.step();
  }
};

// The first byte of a row panel of activations (int8 or bf16 rows).
inline const char* row_bytes(const ActRows<Act::kI8>::Panel& a) { return reinterpret_cast<const char*>(a.q); }
inline const char* row_bytes(const ActRows<Act::kBF16>::Panel& a) { return reinterpret_cast<const char*>(a.p); }
inline const char* row_bytes(const ActRows<Act::kF32>::Panel& a) { return reinterpret_cast<const char*>(a.p); }

// Rows of A in tile order: [rows / 16][kbytes / kw][16][kw] bytes.
struct TileA {
  const char* p = nullptr;
  int64_t kw = 0, ncols = 0;
  // The tile of rows [r, r + 16) (r a multiple of 16) and the kw bytes from byte kb of each row.
  const char* at(int64_t r, int64_t kb) const { return p + ((r / 16) * ncols + kb / kw) * 16 * kw; }
};

// Copies `rows` (a multiple of 16) rows of kbytes bytes (a multiple of kw), row stride lda bytes,
// into tile order at dst (rows * kbytes bytes).
inline TileA pack_tiles(const char* a, int64_t lda, int64_t rows, int64_t kbytes, int64_t kw, char* dst) {
  const int64_t ncols = kbytes / kw;
  char* d = dst;
  for (int64_t r = 0; r < rows; r += 16)
    for (int64_t c = 0; c < ncols; ++c)
      for (int64_t i = 0; i < 16; ++i, d += kw) std::memcpy(d, a + (r + i) * lda + c * kw, size_t(kw));
  return {dst, kw, ncols};
}

// The tile order's geometry for a format's activation rows: row bytes and bytes a tile row.
template <class Fmt>
struct TileGeometry {
  int64_t kbytes, kw;
  TileGeometry(int64_t ld, const PackedK& K)
      : kbytes(Fmt::kAct == Act::kI8 ? ld : 2 * ld), kw(Fmt::kAct == Act::kI8 ? std::min<int64_t>(64, K.group) : 64) {}
};

// The activation rows of every expert that takes the tile path, copied into tile order once per
// call, so that the tasks of an expert share them: expert a's rows (from its first, a multiple of
// 32 of them) at tiles(a), or at(a) < 0 when the expert runs the register kernels.
struct ExpertTiles {
  char* buf = nullptr;
  std::vector<int64_t> off;  // per active expert: byte offset into buf, or -1
  int64_t kw = 64, ncols = 0;
  bool has(int32_t a) const { return !off.empty() && off[size_t(a)] >= 0; }
  TileA tiles(int32_t a) const { return {buf + off[size_t(a)], kw, ncols}; }
};

template <class Fmt, class T = isa::Tiles>
void tiles_bf16(int64_t rows, const TileA& A, const void* const* B, int nb, const PackedK& K, float* C, int64_t ldc) {
  if constexpr (T::kAvailable) {
    const int64_t kp = Fmt::packed_k(K.kd, 0), kc = std::max<int64_t>(32, kTileChunkBytes / 32 / 2 / 32 * 32);
    const int64_t astep = 16 * 32;  // elements between the tiles of consecutive 32-k steps
    const int64_t a_stride = A.ncols * 16 * A.kw;
    PairAhead ahead;
    T::begin();
    for (int64_t k0 = 0; k0 < kp; k0 += kc) {
      const int64_t kn = std::min(kc, kp - k0), k1 = k0 + kc, kn1 = std::min(kc, kp - k1);
      for (int j = 0; j < nb; j += 2) {
        ahead.plan(B, nb, j, 32 * k0, 32 * kn, k1 < kp ? 32 * k1 : -1, 32 * kn1, k1 < kp ? A.at(0, 2 * k1) : nullptr,
                   32 * kn1, a_stride, rows, rows / 32 * (kn / 32));
        const uint16_t* b0 = static_cast<const uint16_t*>(B[j]) + k0 * 16;
        const uint16_t* b1 = static_cast<const uint16_t*>(B[std::min(j + 1, nb - 1)]) + k0 * 16;
        for (int64_t r = 0; r < rows; r += 32)
          T::mma_2x2(reinterpret_cast<const uint16_t*>(A.at(r, 2 * k0)),
                     reinterpret_cast<const uint16_t*>(A.at(r + 16, 2 * k0)), 32, astep, b0, b1, kn, k0 > 0,
                     C + r * ldc + j * kBlockN, ldc, [&] { ahead(); });
      }
    }
    T::end();
  }
}

// int8 / int4: per group, the tiles' exact int32 products are scaled into a 32 x 32 fp32 tile in
// L1 (C[i][c] += float(dot - kOffset * sum_a) * (scale_a * scale_w), the register kernels' order);
// int4 chunks are first unpacked to the int8 layout as signed bytes q (tdpbssd: dot is then the
// product with q itself, the same integer, and the per-group epilogue has no offset term), once per
// pass over the rows. A: the tile order of the int8 rows (kw = kstep), As: their scales and sums.
template <class Fmt, class T = isa::Tiles>
void tiles_int(int64_t rows, const TileA& A, const ActRows<Act::kI8>::Panel& As, const void* const* B, int nb,
               const PackedK& K, float* C, int64_t ldc) {
  if constexpr (T::kAvailable) {
    constexpr bool kSigned = Fmt::kBits == 4;  // unpacked to signed bytes
    const int64_t group = K.group, chunk = Fmt::chunk_bytes(group), wbytes = kBlockN * group;
    const int kstep = int(A.kw);
    const int64_t gc = std::max<int64_t>(1, kTileChunkBytes / 32 / group);  // groups per chunk
    alignas(64) int32_t acc[32 * 32];
    alignas(64) float tile[32 * 32];
    thread_local std::vector<uint8_t> unpacked;
    if constexpr (Fmt::kBits == 4) unpacked.resize(size_t(2 * gc * wbytes));
    for (int64_t i = 0; i < rows * ldc; ++i) C[i] = 0.f;  // rows a multiple of 32 here
    const auto blk = [&](int j) { return static_cast<const uint8_t*>(B[std::min(j, nb - 1)]); };
    const int64_t a_stride = A.ncols * 16 * A.kw;
    PairAhead ahead;
    T::begin_i8(kstep);
    for (int64_t g0 = 0; g0 < K.groups; g0 += gc) {
      const int64_t gn = std::min(gc, K.groups - g0), g1 = g0 + gc, gn1 = std::min(gc, K.groups - g1);
      for (int j = 0; j < nb; j += 2) {
        ahead.plan(B, nb, j, g0 * chunk, gn * chunk, g1 < K.groups ? g1 * chunk : -1, gn1 * chunk,
                   g1 < K.groups ? A.at(0, g1 * group) : nullptr, 16 * gn1 * group, a_stride, rows,
                   rows / 32 * gn * (group / kstep));
        const uint8_t* src[2] = {blk(j), blk(j + 1)};
        const uint8_t* w[2];  // group g0's weights of each block, then one group every `wstride`
        int64_t wstride = chunk;
        if constexpr (Fmt::kBits == 4) {
          for (int h = 0; h < 2; ++h) {
            uint8_t* dst = unpacked.data() + h * gc * wbytes;
            for (int64_t g = 0; g < gn; ++g)
              for (int64_t r = 0; r < group / 8; ++r) {
                const isa::VB v = isa::load_vb(src[h] + (g0 + g) * chunk + r * 64);
                isa::store_vb(dst + g * wbytes + 128 * r, T::s4_lo(v));
                isa::store_vb(dst + g * wbytes + 128 * r + 64, T::s4_hi(v));
              }
            w[h] = dst;
          }
          wstride = wbytes;
        } else {
          w[0] = src[0] + g0 * chunk, w[1] = src[1] + g0 * chunk;
        }
        for (int64_t r = 0; r < rows; r += 32) {
          float* c = C + r * ldc + j * kBlockN;
          for (int i = 0; i < 32; ++i)
            for (int h = 0; h < 2; ++h) isa::vstore(tile + i * 32 + h * 16, isa::vload(c + i * ldc + h * 16));
          for (int64_t g = 0; g < gn; ++g) {
            const int64_t gg = g0 + g;
            const int8_t* a0 = reinterpret_cast<const int8_t*>(A.at(r, gg * group));
            const int8_t* a1 = reinterpret_cast<const int8_t*>(A.at(r + 16, gg * group));
            T::template mma_i8_2x2<kSigned>(a0, a1, kstep, 16 * kstep, w[0] + g * wstride, w[1] + g * wstride, group,
                                            kstep, acc, 32, [&] { ahead(); });
            for (int h = 0; h < 2; ++h) {
              const V sw = isa::vload(reinterpret_cast<const float*>(src[h] + gg * chunk + chunk - kBlockN * 4));
              for (int i = 0; i < 32; ++i) {
                const int64_t ig = (r + i) * As.ldg + gg;
                const V s = isa::vmul(isa::vbcast(As.scale[ig]), sw);
                isa::VI d = isa::load_vi(acc + i * 32 + h * 16);
                if constexpr (!kSigned) d = isa::vi_sub(d, isa::vi_bcast(Fmt::kOffset * As.sum[ig]));
                float* t = tile + i * 32 + h * 16;
                isa::vstore(t, isa::vfma(isa::vi_to_v(d), s, isa::vload(t)));
              }
            }
          }
          for (int i = 0; i < 32; ++i)
            for (int h = 0; h < 2; ++h) isa::vstore(c + i * ldc + h * 16, isa::vload(tile + i * 32 + h * 16));
        }
      }
    }
    T::end();
  }
}

// Runs C = A rows x blocks B[0..nb) for `rows` rows (any count) and calls
// epi(row0, m, b0, nbk, C, ldc) for runs of m rows and blocks [b0, b0 + nbk):
// C[i][16 * (b - b0) + c] is row row0 + i, column c of block b. `tiles`: A's rows in tile order
// (ExpertTiles), or null (the tile path copies the rows it takes).
template <class Fmt, typename Epi>
void task_gemm(int64_t rows, const typename Micro<Fmt>::Panel& A, const TileA* tiles, const void* const* B, int nb,
               const PackedK& K, Epi&& epi) {
  using M = Micro<Fmt>;
  if constexpr (Fmt::kTiles) {
    if (use_tiles<Fmt>(rows)) {
      thread_local std::vector<float> cbuf;
      const int64_t ldc = round_up(nb, 2) * kBlockN;
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t rn = std::min(kTileRows, rows - r0), rpad = round_up(rn, 32);
        cbuf.resize(size_t(rpad * ldc));
        const auto a = M::offset(A, r0);
        const TileGeometry<Fmt> geo(a.ld, K);
        TileA t;
        if (tiles) {
          t = {tiles->at(r0, 0), tiles->kw, tiles->ncols};
        } else {
          thread_local std::vector<char> abuf;
          abuf.resize(size_t(rpad * geo.kbytes));
          t = pack_tiles(row_bytes(a), geo.kbytes, rpad, geo.kbytes, geo.kw, abuf.data());
        }
        if constexpr (Fmt::kAct == Act::kI8)
          tiles_int<Fmt>(rpad, t, a, B, nb, K, cbuf.data(), ldc);
        else
          tiles_bf16<Fmt>(rpad, t, B, nb, K, cbuf.data(), ldc);
        for (int64_t r = 0; r < rn; r += 32)
          epi(r0 + r, int(std::min<int64_t>(32, rn - r)), 0, nb, cbuf.data() + r * ldc, ldc);
      }
      return;
    }
  }
  constexpr int64_t ldc = kMaxNR * kBlockN;
  alignas(64) float C[isa::kMR * ldc];
  for (int j = 0; j < nb; j += isa::kNR) {
    const int nr = std::min(isa::kNR, nb - j);
    for (int64_t r = 0; r < rows; r += M::kMR) {
      const int m = int(std::min<int64_t>(M::kMR, rows - r));
      with_count<M::kMR>(m, [&](auto mr) {
        with_count<isa::kNR>(nr, [&](auto NR) {
          M::template packed<decltype(mr)::value, decltype(NR)::value>(M::offset(A, r), B + j, K, C, ldc);
        });
      });
      epi(r, m, j, nr, static_cast<const float*>(C), ldc);
    }
  }
}

}  // namespace HMOE_ISA
}  // namespace hmoe
