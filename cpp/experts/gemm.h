// Register-tile microkernels of the expert GEMMs, written once over the ops of the ISA header
// this module is compiled with (isa::V = 16 fp32 lanes), and Micro: the ones each weight format
// (format.h) uses. All accumulate in fp32.
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "experts/format.h"
#include "experts/isa/contract.h"

namespace hmoe {
namespace HMOE_ISA {

using isa::V;

// Accumulator sets per output tile: few rows leave too few independent FMA chains to hide
// the FMA latency, so those tiles split the reduction over two sets of accumulators.
template <int MR, int NR>
constexpr int kSplitK = MR * NR <= 4 ? 2 : 1;

// Distance of the software prefetch on each weight stream, in bytes. Blocks are 64 KB-ish
// streams that cross a page every 4 KB, where hardware prefetchers restart.
constexpr int64_t kPrefetchBytes = 1024;

// C[MR][NR*16] = A[MR, kd] x packed blocks B[0..NR) (format.h layout).
// Activations A are bf16 (u16, row stride lda) for bf16 weights, else fp32.
template <int MR, int NR>
inline void mk_packed_bf16(const uint16_t* A, int64_t lda, const uint16_t* const* B, int64_t kpad, float* C,
                           int64_t ldc) {
  constexpr int U = kSplitK<MR, NR>;
  V acc[U][MR][NR];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[u][i][j] = isa::vzero();
  for (int64_t kp = 0; kp < kpad / 2; kp += U) {  // kpad / 2 is a multiple of 16
    for (int u = 0; u < U; ++u) {
      isa::BPair b[NR];
      for (int j = 0; j < NR; ++j) {
        __builtin_prefetch(reinterpret_cast<const char*>(B[j] + (kp + u) * 32) + kPrefetchBytes);
        b[j] = isa::load_bpair(B[j] + (kp + u) * 32);
      }
      for (int i = 0; i < MR; ++i) {
        isa::APair a = isa::bcast_apair(A + i * lda + 2 * (kp + u));
        for (int j = 0; j < NR; ++j) acc[u][i][j] = isa::dot_pair(acc[u][i][j], a, b[j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      V sum = acc[0][i][j];
      for (int u = 1; u < U; ++u) sum = isa::vadd(sum, acc[u][i][j]);
      isa::vstore(C + i * ldc + j * 16, sum);
    }
}

template <typename W>
inline V load_w16(const W* p);
template <>
inline V load_w16<float>(const float* p) {
  return isa::vload(p);
}
template <>
inline V load_w16<uint16_t>(const uint16_t* p) {
  return isa::vload_f16(p);
}  // fp16 weights

template <int MR, int NR, typename W>
inline void mk_packed_f(const float* A, int64_t lda, const W* const* B, int64_t kd, float* C, int64_t ldc) {
  constexpr int U = kSplitK<MR, NR>;
  V acc[U][MR][NR];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[u][i][j] = isa::vzero();
  auto step = [&](int u, int64_t k) {
    V b[NR];
    for (int j = 0; j < NR; ++j) {
      __builtin_prefetch(reinterpret_cast<const char*>(B[j] + k * 16) + kPrefetchBytes);
      b[j] = load_w16(B[j] + k * 16);
    }
    for (int i = 0; i < MR; ++i) {
      V a = isa::vbcast(A[i * lda + k]);
      for (int j = 0; j < NR; ++j) acc[u][i][j] = isa::vfma(a, b[j], acc[u][i][j]);
    }
  };
  const int64_t kmain = kd / U * U;
  for (int64_t k = 0; k < kmain; k += U)
    for (int u = 0; u < U; ++u) step(u, k + u);
  for (int64_t k = kmain; k < kd; ++k) step(0, k);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      V sum = acc[0][i][j];
      for (int u = 1; u < U; ++u) sum = isa::vadd(sum, acc[u][i][j]);
      isa::vstore(C + i * ldc + j * 16, sum);
    }
}

// Row-major (unpacked) weights, for decode: C[i][r] = dot(A[i, :kd], W row r) for MR rows of
// A (fp32) and 4 weight rows at once (4 independent FMA chains per A row).
template <int WD>
inline V load_row16(const void* p, int64_t k) {
  if constexpr (WD == kF32)
    return isa::vload(static_cast<const float*>(p) + k);
  else if constexpr (WD == kBF16)
    return isa::vload_bf16(static_cast<const uint16_t*>(p) + k);
  else
    return isa::vload_f16(static_cast<const uint16_t*>(p) + k);
}
template <int WD>
inline float load_row1(const void* p, int64_t k) {
  if constexpr (WD == kF32)
    return static_cast<const float*>(p)[k];
  else if constexpr (WD == kBF16)
    return bf16_to_f32(static_cast<const uint16_t*>(p)[k]);
  else
    return f16_to_f32(static_cast<const uint16_t*>(p)[k]);
}

constexpr int kRowsNW = 4;
// Rows are 2-14 KB streams that each start on a new page, where hardware prefetchers restart;
// fetching well ahead keeps enough misses in flight for one core to approach its bandwidth.
constexpr int64_t kRowsPrefetchBytes = 2048;

template <int MR, int WD>
inline void mk_rows(const float* A, int64_t lda, const void* const* rows, int64_t kd, float* C, int64_t ldc) {
  V acc[MR][kRowsNW];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRowsNW; ++j) acc[i][j] = isa::vzero();
  const int64_t kv = kd / 16 * 16;
  constexpr int64_t kEsz = WD == kF32 ? 4 : 2;
  for (int64_t k = 0; k < kv; k += 16) {
    V b[kRowsNW];
    for (int j = 0; j < kRowsNW; ++j) {
      __builtin_prefetch(static_cast<const char*>(rows[j]) + k * kEsz + kRowsPrefetchBytes);
      b[j] = load_row16<WD>(rows[j], k);
    }
    for (int i = 0; i < MR; ++i) {
      V a = isa::vload(A + i * lda + k);
      for (int j = 0; j < kRowsNW; ++j) acc[i][j] = isa::vfma(a, b[j], acc[i][j]);
    }
  }
  for (int j = 0; j < kRowsNW; ++j) {
    for (int i = 0; i < MR; ++i) {
      float s = isa::vsum(acc[i][j]);
      for (int64_t k = kv; k < kd; ++k) s += A[i * lda + k] * load_row1<WD>(rows[j], k);
      C[i * ldc + j] = s;
    }
  }
}

// Calls f(std::integral_constant<int, M>) for the compile-time M == n (1 <= n <= Max).
template <int Max, int M = 1, typename F>
inline void with_count(int n, F&& f) {
  if constexpr (M <= Max) {
    if (n == M) {
      f(std::integral_constant<int, M>{});
      return;
    }
    with_count<Max, M + 1>(n, static_cast<F&&>(f));
  }
}
// with_count for a row count m of a micro-kernel (1 <= m <= isa::kMR).
template <typename F>
inline void with_mr(int m, F&& f) {
  with_count<isa::kMR>(m, static_cast<F&&>(f));
}

// The microkernels of a weight format on this ISA:
//   Act                 the element type of the activation rows the packed kernels read
//   packed<MR, NR>(A, lda, B, kd, C, ldc)   C[MR][NR*16] = A[MR, kd] x packed blocks B[0..NR)
//   rows<MR>(A, lda, rows, kd, C, ldc)      C[i][r] = dot(A[i, :kd], row r) for kRowsNW
//                                           row-major weight rows, A in fp32 (unpacked decode)
template <class Fmt>
struct Micro;

// The row-dot kernel reads any float format straight from its rows.
template <class Fmt>
struct FloatRows {
  template <int MR>
  static void rows(const float* A, int64_t lda, const void* const* rows, int64_t kd, float* C, int64_t ldc) {
    mk_rows<MR, Fmt::kCode>(A, lda, rows, kd, C, ldc);
  }
};

template <>
struct Micro<Format<kBF16>> : FloatRows<Format<kBF16>> {
  using Act = uint16_t;  // bf16: vdpbf16ps pairs
  template <int MR, int NR>
  static void packed(const Act* A, int64_t lda, const void* const* B, int64_t kd, float* C, int64_t ldc) {
    mk_packed_bf16<MR, NR>(A, lda, reinterpret_cast<const uint16_t* const*>(B), Format<kBF16>::packed_k(kd), C, ldc);
  }
};

template <>
struct Micro<Format<kF16>> : FloatRows<Format<kF16>> {
  using Act = float;
  template <int MR, int NR>
  static void packed(const Act* A, int64_t lda, const void* const* B, int64_t kd, float* C, int64_t ldc) {
    mk_packed_f<MR, NR>(A, lda, reinterpret_cast<const uint16_t* const*>(B), kd, C, ldc);
  }
};

template <>
struct Micro<Format<kF32>> : FloatRows<Format<kF32>> {
  using Act = float;
  template <int MR, int NR>
  static void packed(const Act* A, int64_t lda, const void* const* B, int64_t kd, float* C, int64_t ldc) {
    mk_packed_f<MR, NR>(A, lda, reinterpret_cast<const float* const*>(B), kd, C, ldc);
  }
};

}  // namespace HMOE_ISA
}  // namespace hmoe
