// Register-tile microkernels of the expert GEMMs, written once over the ops of the ISA header
// this module is compiled with (isa::V = 16 fp32 lanes), and Micro: the ones each weight format
// (format.h) uses. All accumulate in fp32 (integer formats: exact int32 per group, then fp32).
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/dtype.h"
#include "experts/act.h"
#include "experts/format.h"
#include "experts/isa/contract.h"

namespace hmoe {
namespace HMOE_ISA {

using isa::V;

// Accumulator sets per output tile: few rows leave too few independent FMA chains to hide
// the FMA latency, so those tiles split the reduction over two sets of accumulators.
template <int MR, int NR>
constexpr int kSplitK = MR * NR <= 4 ? 2 : 1;

// The software prefetch on each weight stream: Ahead bytes ahead (kPrefetchBytes for the packed
// blocks), into L2 or L1 as the ISA header says (isa::kPrefetchL2). Blocks are 64 KB-ish streams
// that cross a page every 4 KB, where hardware prefetchers restart. (HMOE_TUNE_* macros: set by
// tools/experts_tune only.)
#ifndef HMOE_TUNE_PREFETCH_BYTES
#define HMOE_TUNE_PREFETCH_BYTES 1024
#endif
#ifndef HMOE_TUNE_PREFETCH_LOCALITY
#define HMOE_TUNE_PREFETCH_LOCALITY (isa::kPrefetchL2 ? 2 : 3)
#endif
constexpr int64_t kPrefetchBytes = HMOE_TUNE_PREFETCH_BYTES;

template <int64_t Ahead = kPrefetchBytes>
inline void prefetch(const void* p) {
  if constexpr (Ahead > 0) __builtin_prefetch(static_cast<const char*>(p) + Ahead, 0, HMOE_TUNE_PREFETCH_LOCALITY);
}

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
        prefetch(B[j] + (kp + u) * 32);
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
      prefetch(B[j] + k * 16);
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

// Scaled formats: C[MR][NR*16] = sum over groups g of (int8 or fp8) partial products, each group's
// exact int32 (or fp32) sum times its scales, accumulated in fp32 in C (an L1 tile) in group order.
// chunk: bytes of a group's chunk of a block; its last 64 bytes are the 16 fp32 column scales.
inline void zero_tile(int MR, int NR, float* C, int64_t ldc) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) isa::vstore(C + i * ldc + j * 16, isa::vzero());
}

// int8 / int4 weights (kOffset-biased unsigned) times int8 activations quantised per (row, group):
// C[i][c] += float(dot - kOffset * sum_a) * (scale_a[i][g] * scale_w[c][g]) (int8 on an ISA whose
// dot4 is centred: the dot already is that difference).
template <int MR, int NR, int Bits, int Offset>
inline void mk_packed_q(const ActRows<Act::kI8>::Panel& A, const uint8_t* const* B, int64_t groups, int64_t group,
                        float* C, int64_t ldc) {
  const int64_t chunk = kBlockN * group * Bits / 8 + kBlockN * 4;
  static_assert(Bits == 4 || Offset == 128, "int8 weights are stored as q + 128");
  constexpr int32_t kCorrection = Bits == 8 && isa::kDot4Centered ? 0 : Offset;
  zero_tile(MR, NR, C, ldc);
  for (int64_t g = 0; g < groups; ++g) {
    isa::VI acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = isa::vi_zero();
    const uint8_t* b[NR];
    for (int j = 0; j < NR; ++j) b[j] = B[j] + g * chunk;
    const int8_t* a0 = A.q + g * group;
    if constexpr (Bits == 8) {
      for (int64_t r = 0; r < group / 4; ++r) {  // a row: 16 columns x 4 k
        isa::VB w[NR];
        for (int j = 0; j < NR; ++j) {
          prefetch(b[j] + r * 64);
          w[j] = isa::load_vb(b[j] + r * 64);
        }
        for (int i = 0; i < MR; ++i) {
          const auto a = isa::bcast_a4(a0 + i * A.ld + 4 * r);
          for (int j = 0; j < NR; ++j) acc[i][j] = isa::dot4(acc[i][j], w[j], a);
        }
      }
    } else if constexpr (isa::kU4Steps == 0) {
      // int32 partial sums (vpdpbusd, exact for any group): the nibble products go straight into
      // the accumulators; widening them (below) would cost a second set of MR x NR registers.
      for (int64_t r = 0; r < group / 8; ++r) {
        isa::VB w[NR];
        for (int j = 0; j < NR; ++j) {
          prefetch(b[j] + r * 64);
          w[j] = isa::load_vb(b[j] + r * 64);
        }
        for (int i = 0; i < MR; ++i) {
          const auto al = isa::bcast_a4(a0 + i * A.ld + 8 * r), ah = isa::bcast_a4(a0 + i * A.ld + 8 * r + 4);
          for (int j = 0; j < NR; ++j)
            acc[i][j] = isa::dot4_u4s(isa::dot4_u4s(acc[i][j], isa::nib_lo(w[j]), al), isa::nib_hi(w[j]), ah);
        }
      }
    } else {
      // A row: two rows of 4 k as nibbles; their products in short partial sums (isa::VS), widened
      // every kU4Steps / 2 rows and at the group's end.
      constexpr int64_t kRows = isa::kU4Steps / 2;
      for (int64_t r0 = 0; r0 < group / 8; r0 += kRows) {
        isa::VS part[MR][NR];
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) part[i][j] = isa::vs_zero();
        for (int64_t r = r0; r < r0 + kRows && r < group / 8; ++r) {
          isa::VB lo[NR], hi[NR];
          for (int j = 0; j < NR; ++j) {
            prefetch(b[j] + r * 64);
            const isa::VB w = isa::load_vb(b[j] + r * 64);
            lo[j] = isa::nib_lo(w);
            hi[j] = isa::nib_hi(w);
          }
          for (int i = 0; i < MR; ++i) {
            const auto al = isa::bcast_a4(a0 + i * A.ld + 8 * r), ah = isa::bcast_a4(a0 + i * A.ld + 8 * r + 4);
            for (int j = 0; j < NR; ++j) part[i][j] = isa::dot4_u4s(isa::dot4_u4s(part[i][j], lo[j], al), hi[j], ah);
          }
        }
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; ++j) acc[i][j] = isa::vi_add_vs(acc[i][j], part[i][j]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const V sw = isa::vload(reinterpret_cast<const float*>(b[j] + chunk - kBlockN * 4));
      for (int i = 0; i < MR; ++i) {
        const int64_t ig = i * A.ldg + g;
        const V s = isa::vmul(isa::vbcast(A.scale[ig]), sw);
        const isa::VI d = kCorrection ? isa::vi_sub(acc[i][j], isa::vi_bcast(kCorrection * A.sum[ig])) : acc[i][j];
        float* c = C + i * ldc + j * 16;
        isa::vstore(c, isa::vfma(isa::vi_to_v(d), s, isa::vload(c)));
      }
    }
  }
}

// fp8 weights (read as w * 2^-8, the scales carrying the 2^8) times bf16 activations:
// C[i][c] += (fp32 sum of the group's exact products) * scale_w[c][g].
template <int MR, int NR>
inline void mk_packed_fp8(const uint16_t* A, int64_t lda, const uint8_t* const* B, int64_t groups, int64_t group,
                          float* C, int64_t ldc) {
  const int64_t chunk = kBlockN * group + kBlockN * 4;
  zero_tile(MR, NR, C, ldc);
  for (int64_t g = 0; g < groups; ++g) {
    V acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = isa::vzero();
    for (int64_t kp = 0; kp < group / 2; ++kp) {
      isa::BPair b[NR];
      for (int j = 0; j < NR; ++j) {
        const uint8_t* p = B[j] + g * chunk + kp * 32;
        prefetch(p);
        b[j] = isa::load_fp8_pair(p);
      }
      for (int i = 0; i < MR; ++i) {
        const isa::APair a = isa::bcast_apair(A + i * lda + g * group + 2 * kp);
        for (int j = 0; j < NR; ++j) acc[i][j] = isa::dot_pair(acc[i][j], a, b[j]);
      }
    }
    for (int j = 0; j < NR; ++j) {
      const V sw = isa::vload(reinterpret_cast<const float*>(B[j] + g * chunk + chunk - kBlockN * 4));
      for (int i = 0; i < MR; ++i) {
        float* c = C + i * ldc + j * 16;
        isa::vstore(c, isa::vfma(acc[i][j], sw, isa::vload(c)));
      }
    }
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
// fetching well ahead keeps enough misses in flight for one core to approach its bandwidth. Into
// L2 or L1 as the packed kernels' prefetch (on the Zen 4 the L2 one took moe_experts_cpu's V2-Lite
// bf16 decode from 4.5-4.8 to 3.8-4.3 ms back to back, three alternating rounds).
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
      prefetch<kRowsPrefetchBytes>(static_cast<const char*>(rows[j]) + k * kEsz);
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

// A packed matrix as the microkernels see it: its reduction length and, for scaled formats, the
// k group and the number of groups.
struct PackedK {
  int64_t kd, group, groups;
};

// The microkernels of a weight format on this ISA:
//   kMR                 rows of its register tile (at most isa::kMR)
//   Panel               the activation rows it reads (ActRows<Fmt::kAct>::Panel; at(i) moves i rows)
//   packed<MR, NR>(A, B, K, C, ldc)   C[MR][NR*16] = A rows x packed blocks B[0..NR)
//   rows<MR>(A, lda, rows, kd, C, ldc) (float formats) C[i][r] = dot(A[i, :kd], row r) for
//                       kRowsNW row-major weight rows, A in fp32 (unpacked decode)
template <class Fmt>
struct Micro;

template <class Fmt>
struct FloatMicro {
  static constexpr int kMR = isa::kMR;
  using Panel = typename ActRows<Fmt::kAct>::Panel;
  static Panel offset(const Panel& a, int64_t rows) { return {a.p + rows * a.ld, a.ld}; }
  template <int MR>
  static void rows(const float* A, int64_t lda, const void* const* rows, int64_t kd, float* C, int64_t ldc) {
    mk_rows<MR, Fmt::kCode>(A, lda, rows, kd, C, ldc);
  }
};

template <>
struct Micro<Format<kBF16>> : FloatMicro<Format<kBF16>> {
  template <int MR, int NR>
  static void packed(const Panel& A, const void* const* B, const PackedK& K, float* C, int64_t ldc) {
    mk_packed_bf16<MR, NR>(A.p, A.ld, reinterpret_cast<const uint16_t* const*>(B), Format<kBF16>::packed_k(K.kd, 0), C,
                           ldc);
  }
};

template <>
struct Micro<Format<kF16>> : FloatMicro<Format<kF16>> {
  template <int MR, int NR>
  static void packed(const Panel& A, const void* const* B, const PackedK& K, float* C, int64_t ldc) {
    mk_packed_f<MR, NR>(A.p, A.ld, reinterpret_cast<const uint16_t* const*>(B), K.kd, C, ldc);
  }
};

template <>
struct Micro<Format<kF32>> : FloatMicro<Format<kF32>> {
  template <int MR, int NR>
  static void packed(const Panel& A, const void* const* B, const PackedK& K, float* C, int64_t ldc) {
    mk_packed_f<MR, NR>(A.p, A.ld, reinterpret_cast<const float* const*>(B), K.kd, C, ldc);
  }
};

// Integer formats keep MR x NR int32 accumulators plus the weight rows in registers: isa::kMRInt rows.
template <class Fmt>
struct IntMicro {
  static constexpr int kMR = isa::kMRInt;
  using Panel = ActRows<Act::kI8>::Panel;
  static Panel offset(const Panel& a, int64_t rows) {
    return {a.q + rows * a.ld, a.ld, a.scale + rows * a.ldg, a.sum + rows * a.ldg, a.ldg};
  }
  template <int MR, int NR>
  static void packed(const Panel& A, const void* const* B, const PackedK& K, float* C, int64_t ldc) {
    mk_packed_q<MR, NR, Fmt::kBits, Fmt::kOffset>(A, reinterpret_cast<const uint8_t* const*>(B), K.groups, K.group, C,
                                                  ldc);
  }
};

template <>
struct Micro<Format<kWInt8>> : IntMicro<Format<kWInt8>> {};
template <>
struct Micro<Format<kWInt4>> : IntMicro<Format<kWInt4>> {};

// fp8: the bf16 tile of the ISA (the widening of a weight pair, isa::load_fp8_pair, is shared by kMR rows).
template <>
struct Micro<Format<kWFp8>> {
  static constexpr int kMR = isa::kMR;
  using Panel = ActRows<Act::kBF16>::Panel;
  static Panel offset(const Panel& a, int64_t rows) { return {a.p + rows * a.ld, a.ld}; }
  template <int MR, int NR>
  static void packed(const Panel& A, const void* const* B, const PackedK& K, float* C, int64_t ldc) {
    mk_packed_fp8<MR, NR>(A.p, A.ld, reinterpret_cast<const uint8_t* const*>(B), K.groups, K.group, C, ldc);
  }
};

}  // namespace HMOE_ISA
}  // namespace hmoe
