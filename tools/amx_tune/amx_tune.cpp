// Tuning harness for the AMX paths of the CPU experts (cpp/experts/panel.h): one task's GEMM
// (rows x 32 blocks x K) in isolation, on one thread and on every thread at once, for variants of
// the A layout (rows strided by K as the op stores them, or packed tile by tile) and of the
// per-group epilogue. Build: g++ -O3 -std=c++17 -march=sapphirerapids -mamx-tile -mamx-int8
// -mamx-bf16 -fopenmp amx_tune.cpp; run on an AMX machine.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

struct alignas(64) Cfg {
  uint8_t palette, start;
  uint8_t res[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static void config(int a_colsb, int b_rows) {
  Cfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = (i == 4 || i == 5) ? a_colsb : 64;
    c.rows[i] = i >= 6 ? b_rows : 16;
  }
  _tile_loadconfig(&c);
}

constexpr int kRows = 128, kBlocks = 32, kGroup = 128;
// A: kRows x K int8. strided: row r at r * K. packed: [row tile of 16][K / 64][16][64].
// B: kBlocks blocks of [G][group / 4][64] + 64 bytes of scales per group chunk.
struct Problem {
  int K, G;
  std::vector<int8_t> a_strided, a_packed;
  std::vector<uint8_t> b;
  std::vector<float> sa, sw;
  std::vector<int32_t> suma;
  std::vector<float> C;
  explicit Problem(int K_) : K(K_), G(K_ / kGroup) {
    a_strided.resize(size_t(kRows) * K);
    for (size_t i = 0; i < a_strided.size(); ++i) a_strided[i] = int8_t(i * 7 % 251 - 125);
    a_packed.resize(a_strided.size());
    for (int r = 0; r < kRows; ++r)
      for (int k = 0; k < K; ++k)
        a_packed[((size_t(r / 16) * (K / 64) + k / 64) * 16 + r % 16) * 64 + k % 64] = a_strided[size_t(r) * K + k];
    b.resize(size_t(kBlocks) * G * (16 * kGroup + 64));
    for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 13 % 256);
    for (size_t c = 0; c < b.size() / (16 * kGroup + 64); ++c)  // valid (normal) fp32 scales
      for (int j = 0; j < 16; ++j) {
        const float v = 0.01f + 0.001f * j;
        std::memcpy(b.data() + c * (16 * kGroup + 64) + 16 * kGroup + 4 * j, &v, 4);
      }
    sa.assign(size_t(kRows) * G, 0.01f);
    suma.assign(size_t(kRows) * G, 3);
    C.assign(size_t(kRows) * kBlocks * 16, 0.f);
  }
};

static bool kOffsetCorrection = true;
// The per-group epilogue: C[i][c] += float(acc - 128 * sum_a) * (s_a * s_w) for a 32 x 32 tile.
static inline void epilogue(const int32_t* acc, float* tile, const Problem& p, int r, int g, const uint8_t* sw0,
                            const uint8_t* sw1) {
  for (int h = 0; h < 2; ++h) {
    const __m512 sw = _mm512_loadu_ps(reinterpret_cast<const float*>(h ? sw1 : sw0));
    for (int i = 0; i < 32; ++i) {
      const int ig = (r + i) * p.G + g;
      const __m512 s = _mm512_mul_ps(_mm512_set1_ps(p.sa[ig]), sw);
      __m512i d = _mm512_load_si512(acc + i * 32 + h * 16);
      if (kOffsetCorrection) d = _mm512_sub_epi32(d, _mm512_set1_epi32(128 * p.suma[ig]));
      float* t = tile + i * 32 + h * 16;
      _mm512_store_ps(t, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, _mm512_load_ps(t)));
    }
  }
}

static inline void store4(int32_t* acc) {
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  _tile_stored(2, acc + 512, 128);
  _tile_stored(3, acc + 528, 128);
}

// variant: 0 strided A, one epilogue; 1 packed A, one epilogue; then packed A with a per-group
// epilogue: 2 stores only (no epilogue reads), 3 stores + epilogue, 4 stores + mfence + epilogue,
// 5 pipelined (group g's stores read back after group g + 1's products are issued).
static void run_task(Problem& p, int variant) {
  const bool packed = variant != 0, per_group = variant >= 2;
  if (variant == 6) variant = 3;
  const int chunk = 16 * kGroup + 64, K = p.K;
  const int ldc = kBlocks * 16;
  alignas(64) static thread_local int32_t acc[2][32 * 32];
  alignas(64) static thread_local float tile[32 * 32];
  config(64, 16);
  constexpr int gc = 16;  // groups per K chunk
  for (int g0 = 0; g0 < p.G; g0 += gc) {
    const int gn = std::min(gc, p.G - g0);
    for (int j = 0; j < kBlocks; j += 2) {
      const uint8_t* b0 = p.b.data() + size_t(j) * p.G * chunk;
      const uint8_t* b1 = b0 + size_t(p.G) * chunk;
      for (int r = 0; r < kRows; r += 32) {
        float* c = p.C.data() + size_t(r) * ldc + j * 16;
        auto a_tile = [&](int rr, int k) -> std::pair<const int8_t*, int> {
          if (packed) return {p.a_packed.data() + ((size_t(rr / 16) * (K / 64) + k / 64) * 16) * 64, 64};
          return {p.a_strided.data() + size_t(rr) * K + k, K};
        };
        auto products = [&](int g) {
          for (int k = g * kGroup; k < (g + 1) * kGroup; k += 64) {
            auto [a0, lda0] = a_tile(r, k);
            auto [a1, lda1] = a_tile(r + 16, k);
            _tile_loadd(4, a0, lda0);
            _tile_loadd(5, a1, lda1);
            _tile_loadd(6, b0 + size_t(g) * chunk + (k - g * kGroup) * 16, 64);
            _tile_loadd(7, b1 + size_t(g) * chunk + (k - g * kGroup) * 16, 64);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
          }
        };
        auto zero = [] {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        };
        auto sw = [&](const uint8_t* b, int g) { return b + size_t(g) * chunk + 16 * kGroup; };
        if (!per_group) {
          zero();
          for (int g = g0; g < g0 + gn; ++g) products(g);
          store4(acc[0]);
          for (int i = 0; i < 32; ++i)
            for (int h = 0; h < 2; ++h)
              _mm512_storeu_ps(c + i * ldc + h * 16,
                               _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc[0] + i * 32 + h * 16)),
                                             _mm512_loadu_ps(c + i * ldc + h * 16)));
          continue;
        }
        for (int i = 0; i < 32; ++i)
          for (int h = 0; h < 2; ++h) _mm512_store_ps(tile + i * 32 + h * 16, _mm512_loadu_ps(c + i * ldc + h * 16));
        if (variant == 5) {
          zero();
          products(g0);
          for (int g = g0; g < g0 + gn; ++g) {
            store4(acc[g & 1]);
            if (g + 1 < g0 + gn) {
              zero();
              products(g + 1);
            }
            epilogue(acc[g & 1], tile, p, r, g, sw(b0, g), sw(b1, g));
          }
        } else {
          for (int g = g0; g < g0 + gn; ++g) {
            zero();
            products(g);
            store4(acc[0]);
            if (variant == 4) _mm_mfence();
            if (variant >= 3) epilogue(acc[0], tile, p, r, g, sw(b0, g), sw(b1, g));
          }
        }
        for (int i = 0; i < 32; ++i)
          for (int h = 0; h < 2; ++h) _mm512_storeu_ps(c + i * ldc + h * 16, _mm512_load_ps(tile + i * 32 + h * 16));
      }
    }
  }
  _tile_release();
}

// bf16: A rows strided (kRows x K bf16) or packed per tile ([row tile][K / 32][16][32]); B
// [K / 2][16][2] per block; K in chunks of 1024 with C tiles reloaded between chunks.
static void run_task_bf16(Problem& p, bool packed, std::vector<uint16_t>& a, std::vector<uint16_t>& bb) {
  const int K = p.K, ldc = kBlocks * 16;
  config(64, 16);
  for (int k0 = 0; k0 < K; k0 += 1024) {
    for (int j = 0; j < kBlocks; j += 2) {
      const uint16_t* b0 = bb.data() + size_t(j) * K * 16;
      const uint16_t* b1 = b0 + size_t(K) * 16;
      for (int r = 0; r < kRows; r += 32) {
        float* c = p.C.data() + size_t(r) * ldc + j * 16;
        if (k0) {
          _tile_loadd(0, c, ldc * 4);
          _tile_loadd(1, c + 16, ldc * 4);
          _tile_loadd(2, c + 16 * ldc, ldc * 4);
          _tile_loadd(3, c + 16 * ldc + 16, ldc * 4);
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int k = k0; k < k0 + 1024; k += 32) {
          if (packed) {
            _tile_loadd(4, a.data() + ((size_t(r / 16) * (K / 32) + k / 32) * 16) * 32, 64);
            _tile_loadd(5, a.data() + ((size_t(r / 16 + 1) * (K / 32) + k / 32) * 16) * 32, 64);
          } else {
            _tile_loadd(4, a.data() + size_t(r) * K + k, K * 2);
            _tile_loadd(5, a.data() + size_t(r + 16) * K + k, K * 2);
          }
          _tile_loadd(6, b0 + size_t(k) * 16, 64);
          _tile_loadd(7, b1 + size_t(k) * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, ldc * 4);
        _tile_stored(1, c + 16, ldc * 4);
        _tile_stored(2, c + 16 * ldc, ldc * 4);
        _tile_stored(3, c + 16 * ldc + 16, ldc * 4);
      }
    }
  }
  _tile_release();
}

int main() {
  constexpr int kArchReqXcompPerm = 0x1023, kXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata)) return 1;
  const char* names[] = {"strided A, one epilogue",      "packed A, one epilogue", "per group: stores only",
                         "per group: stores + epilogue", "per group: + mfence",    "per group: pipelined",
                         "per group: no offset term"};
  for (int K : {2048, 7168}) {
    for (int v = 0; v < 7; ++v) {
      kOffsetCorrection = v != 6;
      for (int threads : {1, omp_get_max_threads()}) {
        std::vector<Problem*> ps;
        for (int t = 0; t < threads; ++t) ps.push_back(new Problem(K));
        double best = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
          auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
          {
            int t = omp_get_thread_num();
            if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) == 0) run_task(*ps[t], v);
          }
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        const double flop = 2.0 * kRows * kBlocks * 16 * double(K) * threads;
        printf("K=%5d %-30s threads %2d: %8.3f ms  %7.1f GFLOP/s (%.1f per thread)\n", K, names[v], threads, best * 1e3,
               flop / best / 1e9, flop / best / 1e9 / threads);
        for (auto* p : ps) delete p;
      }
    }
  }
  for (int K : {2048, 7168}) {
    for (int packed = 0; packed < 2; ++packed) {
      for (int threads : {1, omp_get_max_threads()}) {
        std::vector<Problem*> ps;
        std::vector<std::vector<uint16_t>> as(threads), bs(threads);
        for (int t = 0; t < threads; ++t) {
          ps.push_back(new Problem(K));
          as[t].assign(size_t(kRows) * K, 0x3f80);
          bs[t].assign(size_t(kBlocks) * K * 16, 0x3f00);
        }
        double best = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
          auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
          {
            int t = omp_get_thread_num();
            if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXtiledata) == 0)
              run_task_bf16(*ps[t], packed, as[t], bs[t]);
          }
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
        const double flop = 2.0 * kRows * kBlocks * 16 * double(K) * threads;
        printf("K=%5d bf16 %-27s threads %2d: %8.3f ms  %7.1f GFLOP/s (%.1f per thread)\n", K,
               packed ? "packed A" : "strided A", threads, best * 1e3, flop / best / 1e9, flop / best / 1e9 / threads);
        for (auto* p : ps) delete p;
      }
    }
  }
  return 0;
}
