// The contract of the ISA headers of the expert kernels (isa/<level>.h, one per level of
// arch/cpu.json). Include this file, never an ISA header: it includes the header of the level
// this module is compiled for (HMOE_ISA_HEADER, set by cpp/CMakeLists.txt) and checks it.
//
// In namespace hmoe::isa, an ISA header defines:
//   kMR, kNR      register tile of the packed microkernels: kMR rows (1..8) x kNR blocks of 16
//                 columns (2 or 4: w13 tasks take kNR / 2 gate/up pairs)
//   kMRInt        rows of the integer formats' register tile (1..kMR): its kMRInt x kNR int32
//                 accumulators, the kNR weight rows and their nibbles stay in registers
//   kPrefetchL2   where the register kernels' software prefetch of weight streams lands: L2
//                 (prefetcht1) when true, else L1 (prefetcht0)
//   V             16 fp32 lanes; vzero, vload, vstore, vbcast, vfma(a, b, c) = a * b + c,
//                 vadd, vmul, vsum (horizontal), vload_f16, vload_bf16 (16 halves widened to fp32)
//   BPair, APair  a k-pair of a bf16 block ([16][2]) and a broadcast activation pair;
//                 load_bpair, bcast_apair, dot_pair(acc, a, b) = acc + a.lo * b.lo + a.hi * b.hi;
//                 load_fp8_pair(p): a k-pair row of the fp8 layout (16 x 2 float8_e4m3fn bytes)
//                 as a BPair of the values times 2^-8 (exact; cpp/common/dtype.h)
//   VI            16 int32 lanes: vi_zero, vi_bcast, vi_sub, vi_to_v (to fp32, exact below 2^24),
//                 load_vi
//   VB, A4        64 bytes of a quantised block row (16 lanes x 4 consecutive k) and 4 int8
//                 activations for every lane: load_vb, store_vb, nib_lo / nib_hi (each byte's low / high
//                 nibble), bcast_a4(const int8_t*);
//                 dot4(acc, w, a) = acc + sum_j w[4 lane + j] * a[j], w unsigned bytes, exact;
//                 kDot4Centered: dot4 takes w - 128 in place of w (cheaper without VNNI; the
//                 caller then skips its 128 * sum(a) correction);
//   VS            partial sums of nibble dot products, exact for kU4Steps dot4_u4s in a row (w < 16,
//                 |a| <= 127): vs_zero, dot4_u4s(s, w, a) (as dot4 for unpacked nibbles, maybe
//                 cheaper), vi_add_vs(acc, s) = acc + s; kU4Steps = 0 where VS is VI and
//                 dot4_u4s accumulates exact int32 sums (vpdpbusd): the kernels then feed it their
//                 accumulators directly and never widen
//   Tiles         the matrix unit: NoTiles where there is none, else kAvailable = true,
//                 kMinRows (experts with fewer rows use the register kernels), begin() / end()
//                 around a thread's bf16 tile work, begin_i8(kstep) around its int8 tile work,
//                 ensure_permission() ("" once usable, else why not), mma_2x2 (C[32][32] =
//                 A[32, kpad] x two bf16 blocks, fp32, optionally added to C), mma_i8_2x2 (C[32][32] int32 =
//                 A[32, group] int8 x two int8 group chunks of unsigned bytes, or signed ones with
//                 <true>, kstep k a step; A comes as two 16-row tiles per k step, astep apart: panel.h's
//                 tile order; both take an optional last argument, a functor they call once a k
//                 step, NoStep by default) and s4_lo / s4_hi (int4 bytes' nibbles as signed bytes q)
#pragma once
#include <cstdint>
#include <type_traits>
#include <utility>

namespace hmoe::isa {

// An ISA without a matrix unit.
struct NoTiles {
  static constexpr bool kAvailable = false;
};

// The tile GEMMs' default per-step callback: nothing.
struct NoStep {
  void operator()() const {}
};

// Blocks of 16 columns per output tile that run_moe provides room for.
constexpr int kMaxNR = 4;

}  // namespace hmoe::isa

#include HMOE_ISA_HEADER

// Vector types as template arguments lose their alignment attributes (not their width): the
// comparisons below stay exact, the warning says nothing here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"

namespace hmoe::isa {

// A value of type T in unevaluated operands (declared only: the checks compile no code).
template <class T>
T any();

template <class T>
constexpr bool TilesContract() {
  if constexpr (T::kAvailable) {
    static_assert(std::is_same_v<decltype(T::kMinRows), const int64_t> && T::kMinRows >= 1, "Tiles::kMinRows");
    static_assert(std::is_same_v<decltype(T::ensure_permission()), const char*>, "Tiles::ensure_permission");
    static_assert(std::is_void_v<decltype(T::begin())> && std::is_void_v<decltype(T::end())>, "Tiles::begin/end");
    static_assert(std::is_void_v<decltype(T::begin_i8(any<int>()))>, "Tiles::begin_i8(kstep)");
    static_assert(std::is_void_v<decltype(T::mma_2x2(any<const uint16_t*>(), any<const uint16_t*>(), any<int64_t>(),
                                                     any<int64_t>(), any<const uint16_t*>(), any<const uint16_t*>(),
                                                     any<int64_t>(), any<bool>(), any<float*>(), any<int64_t>()))>,
                  "Tiles::mma_2x2(A0, A1, lda, astep, B0, B1, kpad, accumulate, C, ldc)");
    static_assert(std::is_void_v<decltype(T::mma_i8_2x2(any<const int8_t*>(), any<const int8_t*>(), any<int64_t>(),
                                                        any<int64_t>(), any<const uint8_t*>(), any<const uint8_t*>(),
                                                        any<int64_t>(), any<int>(), any<int32_t*>(), any<int64_t>()))>,
                  "Tiles::mma_i8_2x2(A0, A1, lda, astep, B0, B1, group, kstep, C, ldc)");
    static_assert(std::is_void_v<decltype(T::template mma_i8_2x2<true>(
                      any<const int8_t*>(), any<const int8_t*>(), any<int64_t>(), any<int64_t>(), any<const uint8_t*>(),
                      any<const uint8_t*>(), any<int64_t>(), any<int>(), any<int32_t*>(), any<int64_t>()))>,
                  "Tiles::mma_i8_2x2<signed weights>");
    static_assert(
        std::is_same_v<decltype(T::s4_lo(any<VB>())), VB> && std::is_same_v<decltype(T::s4_hi(any<VB>())), VB>,
        "Tiles::s4_lo, s4_hi");
  } else {
    static_assert(std::is_same_v<T, NoTiles>, "an ISA without a matrix unit uses NoTiles");
  }
  return true;
}

template <class Vec = V>
constexpr bool IsaContract() {
  static_assert(std::is_same_v<decltype(kMR), const int> && kMR >= 1 && kMR <= 8, "kMR in 1..8");
  static_assert(std::is_same_v<decltype(kNR), const int> && (kNR == 2 || kNR == 4) && kNR <= kMaxNR, "kNR: 2 or 4");
  static_assert(std::is_same_v<decltype(kMRInt), const int> && kMRInt >= 1 && kMRInt <= kMR, "kMRInt in 1..kMR");
  static_assert(std::is_same_v<decltype(kPrefetchL2), const bool>, "kPrefetchL2");
  static_assert(sizeof(Vec) == 64, "V holds 16 fp32 lanes");
  using CV = const Vec&;
  using F = const float*;
  using H = const uint16_t*;
  static_assert(std::is_same_v<decltype(vzero()), Vec>, "vzero");
  static_assert(std::is_same_v<decltype(vload(any<F>())), Vec>, "vload");
  static_assert(std::is_void_v<decltype(vstore(any<float*>(), any<CV>()))>, "vstore");
  static_assert(std::is_same_v<decltype(vbcast(any<float>())), Vec>, "vbcast");
  static_assert(std::is_same_v<decltype(vfma(any<CV>(), any<CV>(), any<CV>())), Vec>, "vfma");
  static_assert(std::is_same_v<decltype(vadd(any<CV>(), any<CV>())), Vec>, "vadd");
  static_assert(std::is_same_v<decltype(vmul(any<CV>(), any<CV>())), Vec>, "vmul");
  static_assert(std::is_same_v<decltype(vsum(any<CV>())), float>, "vsum");
  static_assert(std::is_same_v<decltype(vload_f16(any<H>())), Vec>, "vload_f16");
  static_assert(std::is_same_v<decltype(vload_bf16(any<H>())), Vec>, "vload_bf16");
  static_assert(std::is_same_v<decltype(load_bpair(any<H>())), BPair>, "load_bpair");
  static_assert(std::is_same_v<decltype(bcast_apair(any<H>())), APair>, "bcast_apair");
  static_assert(std::is_same_v<decltype(dot_pair(any<CV>(), any<const APair&>(), any<const BPair&>())), Vec>,
                "dot_pair");
  static_assert(std::is_same_v<decltype(load_fp8_pair(any<const uint8_t*>())), BPair>, "load_fp8_pair");
  static_assert(sizeof(VI) == 64 && sizeof(VB) == 64, "VI: 16 int32 lanes, VB: 64 bytes");
  using CI = const VI&;
  using CB = const VB&;
  static_assert(std::is_same_v<decltype(vi_zero()), VI>, "vi_zero");
  static_assert(std::is_same_v<decltype(vi_bcast(any<int32_t>())), VI>, "vi_bcast");
  static_assert(std::is_same_v<decltype(vi_sub(any<CI>(), any<CI>())), VI>, "vi_sub");
  static_assert(std::is_same_v<decltype(vi_to_v(any<CI>())), Vec>, "vi_to_v");
  static_assert(std::is_same_v<decltype(load_vi(any<const int32_t*>())), VI>, "load_vi");
  static_assert(std::is_same_v<decltype(load_vb(any<const uint8_t*>())), VB>, "load_vb");
  static_assert(std::is_void_v<decltype(store_vb(any<uint8_t*>(), any<CB>()))>, "store_vb");
  static_assert(std::is_same_v<decltype(nib_lo(any<CB>())), VB> && std::is_same_v<decltype(nib_hi(any<CB>())), VB>,
                "nib_lo, nib_hi");
  static_assert(std::is_same_v<decltype(bcast_a4(any<const int8_t*>())), A4>, "bcast_a4");
  static_assert(std::is_same_v<decltype(dot4(any<CI>(), any<CB>(), any<const A4&>())), VI>, "dot4");
  static_assert(std::is_same_v<decltype(kDot4Centered), const bool>, "kDot4Centered");
  static_assert(std::is_same_v<decltype(kU4Steps), const int> &&
                    (kU4Steps == 0 ? std::is_same_v<VS, VI> : kU4Steps >= 2 && kU4Steps % 2 == 0),
                "kU4Steps: 0 (VS is VI) or even");
  static_assert(std::is_same_v<decltype(vs_zero()), VS>, "vs_zero");
  static_assert(std::is_same_v<decltype(dot4_u4s(any<const VS&>(), any<CB>(), any<const A4&>())), VS>, "dot4_u4s");
  static_assert(std::is_same_v<decltype(vi_add_vs(any<CI>(), any<const VS&>())), VI>, "vi_add_vs");
  return TilesContract<Tiles>();
}
static_assert(IsaContract(), "the ISA header fulfils the contract above");

}  // namespace hmoe::isa

#pragma GCC diagnostic pop
