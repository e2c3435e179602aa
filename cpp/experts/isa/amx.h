// AMX-BF16 and AMX-INT8 ops for the expert kernels: the avx512_bf16 register ops plus 2x2 tile
// GEMMs (bf16, and int8 for the quantised formats) used for experts with at least
// Tiles::kMinRows rows.
// Included through isa/contract.h, which states and checks what this header provides.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "experts/isa/avx512_bf16_ops.h"

namespace hmoe::isa {

constexpr int kMR = 6;  // register kernel rows, for experts with few rows
constexpr int kMRInt = 6;
constexpr int kNR = 4;  // 16-column blocks per register tile
// Into L1: on a Sapphire Rapids-class Xeon an L2 prefetch decoded no faster cold and slower back
// to back (V2-Lite int4 0.25-0.31 ms against 0.21-0.25, `hmoe.bench experts`, three rounds).
constexpr bool kPrefetchL2 = false;

struct Tiles {
  static constexpr bool kAvailable = true;
  static constexpr int64_t kMinRows = 8;

  struct alignas(64) Config {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };

  // Linux grants AMX tile data per process; touching a tile without the grant is SIGILL.
  // Returns "" once granted, else why not.
  static const char* ensure_permission() {
    constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXtiledata = 18;
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &mask) == 0 && (mask & (1ul << kXtiledata))) return "";
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) != 0) return "arch_prctl(ARCH_REQ_XCOMP_PERM) refused";
    return "";
  }

  // Tile state is per thread. bf16: every tile register is 16 rows x 64 bytes.
  static void begin() { configure(64, 16); }
  // int8 with kstep (32 or 64) k a step: accumulators 16 x 16 int32, A tiles (4, 5) 16 rows x
  // kstep bytes, B tiles (6, 7) kstep / 4 rows x 64 bytes.
  static void begin_i8(int kstep) { configure(kstep, kstep / 4); }
  static void configure(int a_colsb, int b_rows) {
    Config cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) {
      cfg.colsb[i] = uint16_t(i == 4 || i == 5 ? a_colsb : 64);
      cfg.rows[i] = uint8_t(i >= 6 ? b_rows : 16);
    }
    _tile_loadconfig(&cfg);
  }
  static void end() { _tile_release(); }

  // The low / high nibbles of 64 bytes of the int4 layout (stored q + 8) as signed bytes q, the
  // layout mma_i8_2x2<true> takes: its products need no offset correction.
  static VB s4_lo(VB w) { return _mm512_sub_epi8(nib_lo(w), _mm512_set1_epi8(8)); }
  static VB s4_hi(VB w) { return _mm512_sub_epi8(nib_hi(w), _mm512_set1_epi8(8)); }

  // C[32][32] (fp32, row stride ldc) = A[32 rows, kpad] x blocks (B0, B1), plus C itself when
  // `accumulate`; kpad a multiple of 32. A (bf16): the tile of rows 0-15 of the t-th 32-k step at
  // A0 + t * astep, rows 16-31 at A1 + t * astep, lda elements between a tile's rows; B0/B1 are
  // packed blocks [kpad/2][16][2]. tmm0..3 accumulate, tmm4/5 hold the A tiles, tmm6/7 B0/B1.
  // step() runs once a k step (the caller's prefetches).
  template <class Step = NoStep>
  static void mma_2x2(const uint16_t* A0, const uint16_t* A1, int64_t lda, int64_t astep, const uint16_t* B0,
                      const uint16_t* B1, int64_t kpad, bool accumulate, float* C, int64_t ldc, Step step = {}) {
    if (accumulate) {
      _tile_loadd(0, C, ldc * 4);
      _tile_loadd(1, C + 16, ldc * 4);
      _tile_loadd(2, C + 16 * ldc, ldc * 4);
      _tile_loadd(3, C + 16 * ldc + 16, ldc * 4);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0, t = 0; k < kpad; k += 32, t += astep) {
      _tile_loadd(4, A0 + t, lda * 2);
      _tile_loadd(5, A1 + t, lda * 2);
      _tile_loadd(6, B0 + k * 16, 64);
      _tile_loadd(7, B1 + k * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      step();
    }
    _tile_stored(0, C, ldc * 4);
    _tile_stored(1, C + 16, ldc * 4);
    _tile_stored(2, C + 16 * ldc, ldc * 4);
    _tile_stored(3, C + 16 * ldc + 16, ldc * 4);
  }

  // C[32][32] (int32, row stride ldc) = A[32 rows, group] (int8) x the weights of two group chunks
  // of the int8 layout (B0/B1: [group / 4][16][4] bytes, unsigned, or signed with kSignedB), kstep k
  // a step (begin_i8(kstep) first; A's tiles of the t-th step at A0 / A1 + t * astep, lda bytes
  // between rows): tdpbsud (signed activations times unsigned weights) or tdpbssd, exact. step()
  // runs once a k step (the caller's prefetches).
  template <bool kSignedB = false, class Step = NoStep>
  static void mma_i8_2x2(const int8_t* A0, const int8_t* A1, int64_t lda, int64_t astep, const uint8_t* B0,
                         const uint8_t* B1, int64_t group, int kstep, int32_t* C, int64_t ldc, Step step = {}) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0, t = 0; k < group; k += kstep, t += astep) {
      _tile_loadd(4, A0 + t, lda);
      _tile_loadd(5, A1 + t, lda);
      _tile_loadd(6, B0 + k * 16, 64);
      _tile_loadd(7, B1 + k * 16, 64);
      if constexpr (kSignedB) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      } else {
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        _tile_dpbsud(2, 5, 6);
        _tile_dpbsud(3, 5, 7);
      }
      step();
    }
    _tile_stored(0, C, ldc * 4);
    _tile_stored(1, C + 16, ldc * 4);
    _tile_stored(2, C + 16 * ldc, ldc * 4);
    _tile_stored(3, C + 16 * ldc + 16, ldc * 4);
  }
};

}  // namespace hmoe::isa
