// Portable MLA decode (absorbed form) for sm_80 and newer: mma.sync m16n8k16, paged KV,
// split-KV with fp32 partials and a combine kernel.
//
// One CTA = (KV split, 16 * MT heads, request) and 4 warps, walking the cache in 32-token tiles
// through a ring of 2 tiles (the next tile is in flight while one is in use). Every warp covers
// all of the CTA's heads, so each shared-memory operand it loads feeds MT mma, and owns a quarter
// of every KV row: latent dims [128 w, 128 w + 128) and rope dims [16 w, 16 w + 16). It copies
// those columns itself (cp.async, or on sm_90+ with 32 heads a CTA the TMA when a tile lies in
// one page: see mla_kv_ring.cuh and choose_loader) and reads no others, so a tile's arrival and the reuse of its buffer
// concern one warp only: two CTA barriers per tile. Per tile:
//   S = Q K^T   each warp its 144 dims (its Q fragments stay in registers) x all tokens; the 4
//               partial sums meet in shared memory
//   softmax     all warps, 128 / (16 * MT) threads per head, online, log2 domain
//   O += P V    each warp its 128 latent dims, fp32 in registers
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention/mma.cuh"
#include "attention/softmax.cuh"
#include "common/cuda_util.h"
#include "common/dtype.h"
#include "common/tma_host.h"
#include "mla/mla_combine.h"
#include "mla/mla_decode.h"
#include "mla/mla_kv_ring.cuh"
#include "mla/mla_splits.h"

namespace hmoe {
namespace {

using namespace mla;
using attn::ldmatrix_x4;
using attn::ldmatrix_x4_trans;
using attn::mma16816;
using attn::smem_addr;

constexpr int kDim = kMlaDimCkv + kMlaDimPe;  // 576
using attn::exp2_ftz;
using attn::kLn2;
using attn::kLog2e;

constexpr int kStages = 2;  // ring buffers

// How a CTA fills its ring (MlaLoader in mla_params.h).
enum Loader { kLoadRows = kMlaLoadRows, kLoadContig = kMlaLoadContig, kLoadTma = kMlaLoadTma };

// Shared memory of a CTA, offsets from a kTileAlign-aligned base (the launcher adds kTileAlign
// bytes of slack: the dynamic window's own alignment is not promised).
template <int MT>
struct Smem {
  static constexpr int kHeads = 16 * MT;
  static constexpr int kSRow = kTile;                         // fp32 partial scores, unpadded (see s_off)
  static constexpr int kPRow = kTile + 8;                     // 16-bit probabilities (+16 B for ldmatrix)
  static constexpr int s = 0;                                 // the partial score tiles, one per warp
  static constexpr int kv = s + kWarps * kHeads * kSRow * 4;  // KV ring
  static constexpr int p = kv + kStages * kTileBytes;
  static constexpr int stats = p + kHeads * kPRow * 2;  // m, l, alpha: kHeads floats each
  static constexpr int bars = stats + 3 * kHeads * 4;   // TMA: an mbarrier per warp and buffer
  static constexpr int bytes = bars + kWarps * kStages * 8 + kTileAlign;
  static_assert(kv % kTileAlign == 0 && p % 16 == 0 && bars % 8 == 0, "aligned regions");
  static_assert(kTileBytes == kTile * kDim * 2, "a ring buffer holds kDim columns of kTile rows");
};

// Float offset of 4-float chunk `chunk` (0..7) of partial-score row `row` (32 floats, unpadded).
// The swizzle keeps both accesses at their ideal wavefront count: the mma layout's float2 stores
// (8 rows x one pair of chunks) and the softmax's float4 loads (2 adjacent rows x 4 chunks).
__device__ __forceinline__ int s_off(int row, int chunk) {
  const int x = ((row & 1) << 2) ^ (((row >> 1) & 3) << 1);
  return row * kTile + ((chunk ^ x) << 2);
}

// Programmatic dependent launch (sm_90+; a no-op before): the decode kernel lets the combine
// kernel (mla_combine.cu) launch while its CTAs finish.
__device__ __forceinline__ void grid_dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ int clamp_len(const MlaDecodeParams& p, int b) {
  int len = p.seq_lens[b];
  return min(max(len, 0), p.max_pages * p.page_size);
}

// LOADER: see Loader; kLoadTma compiles as kLoadContig below sm_90 (the launcher never picks it
// there). maps: the TMA's tensor maps (unused by the cp.async loaders).
template <typename T, int MT, int LOADER>
__global__ void __launch_bounds__(32 * kWarps)
    mla_decode_kernel(const MlaDecodeParams p, const __grid_constant__ KvTensorMaps maps) {
  using L = Smem<MT>;
  constexpr int NT = 32 * kWarps;
  constexpr int kHeads = L::kHeads;
  constexpr int kN8 = kTile / 8;       // n8 tiles of tokens in S
  constexpr int kDimsW = kWarpLatent;  // latent dims of S and O per warp (128)
  constexpr int kPeW = kWarpRope;      // rope dims of S per warp (16)
  constexpr int kLS = kDimsW / 16;     // latent k16 steps of S per warp (8; then 1 of rope)
  constexpr int kON8 = kDimsW / 8;
  static_assert(kPeW == 16, "one k16 step of rope per warp");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kTma = LOADER == kLoadTma;
#else
  constexpr bool kTma = false;
#endif
  extern __shared__ __align__(128) unsigned char smem_window[];
  unsigned char* smem = smem_window + (kTileAlign - smem_addr(smem_window) % kTileAlign) % kTileAlign;
  float* s_s = reinterpret_cast<float*>(smem + L::s);
  const uint32_t kv_s = smem_addr(smem + L::kv);
  T* p_s = reinterpret_cast<T*>(smem + L::p);
  float* m_s = reinterpret_cast<float*>(smem + L::stats);
  float* l_s = m_s + kHeads;
  float* a_s = l_s + kHeads;

  const int split = blockIdx.x, head0 = blockIdx.y * kHeads, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The chain that starts the first tile: the sequence length, the page-table entry, the copies.
  // Split 0 starts at token 0 (this lane's token: `first`) whatever the length, so its first entry
  // is read beside the length: two dependent reads before its first tile, not three.
  const int32_t* table = p.page_table + int64_t(b) * p.max_pages;
  const int first = LOADER == kLoadRows ? lane : 0;
  int first_entry = -1;
  if (split == 0 && first < p.max_pages * p.page_size) first_entry = table[first / p.page_size];
  const int len = clamp_len(p, b);
  // This warp's Q fragments (all heads x its 128 latent and 16 rope dims, zero rows past the last
  // head) go straight from global memory into registers, in the mma A layout, in flight with that
  // chain.
  uint32_t qf[MT][kLS][4], qr[MT][4];
  {
    const T* qn = static_cast<const T*>(p.q_nope);
    const T* qp = static_cast<const T*>(p.q_pe);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int h = head0 + m * 16 + lane / 4 + hi * 8;
        const int64_t bh = int64_t(b) * p.heads + min(h, p.heads - 1);
#pragma unroll
        for (int ks = 0; ks < kLS; ++ks) {
          const T* src = qn + bh * kMlaDimCkv + warp * kDimsW + ks * 16 + (lane % 4) * 2;
          qf[m][ks][hi] = h < p.heads ? *reinterpret_cast<const uint32_t*>(src) : 0u;
          qf[m][ks][hi + 2] = h < p.heads ? *reinterpret_cast<const uint32_t*>(src + 8) : 0u;
        }
        const T* src = qp + bh * kMlaDimPe + warp * kPeW + (lane % 4) * 2;
        qr[m][hi] = h < p.heads ? *reinterpret_cast<const uint32_t*>(src) : 0u;
        qr[m][hi + 2] = h < p.heads ? *reinterpret_cast<const uint32_t*>(src + 8) : 0u;
      }
  }

  const int n_tiles = (len + kTile - 1) / kTile;
  const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t0 = split * per_split, t1 = min(n_tiles, t0 + per_split);

  // Tile t goes to ring buffer (t - t0) % 2. Lane l of every warp walks token l of the tiles (or
  // all lanes the tiles' first tokens).
  const KvLoader loader(p);
  const TmaLoader tma{&maps.ckv, &maps.kpe};
  const uint32_t bar0 = smem_addr(smem + L::bars) + warp * kStages * 8;  // this warp's mbarriers
  TokenWalk walk(table, len, p.page_size, p.num_pages, t0 * kTile + first);
  auto issue = [&](int stage) {
    const uint32_t buf = kv_s + stage * kTileBytes;
    if constexpr (kTma) {
      tma.tile(buf, bar0 + 8 * stage, walk.uniform_row());
    } else if constexpr (LOADER != kLoadRows) {
      loader.tile_contig(buf, walk.row(), walk.valid());
    } else {
      loader.tile(buf, walk.row());
    }
  };
  // Tile t + 1 into the buffer of tile t - 1 (which this warp, its only reader, has finished),
  // then the page-table entry of tile t + 2, used at the next step.
  auto prefetch = [&](int t, int i) {
    if (t + 1 < t1) {
      issue((i + 1) % kStages);
      if (t + 2 < t1) walk.read();
    }
  };
  if constexpr (kTma) {
    if (lane == 0)
      for (int st = 0; st < kStages; ++st) TmaLoader::init(bar0 + 8 * st);
    __syncwarp();
  }
  if (split == 0)
    walk.take(first_entry);
  else
    walk.read();
  if (t0 < t1) issue(0);
  if constexpr (!kTma) cp_async_commit();
  if (t0 + 1 < t1) walk.read();  // tile t0 + 1
  // The softmax state of this thread's head (see the softmax): the running max (the same in all of
  // the head's threads) and the sum of this thread's columns, reduced over the head once at the end.
  constexpr int kTpr = NT / kHeads, kCpt = kTile / kTpr;
  const int srow = threadIdx.x / kTpr, sq = threadIdx.x % kTpr;
  float m_run = -INFINITY, l_run = 0.f;
  float o[MT][kON8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < kON8; ++j) o[m][j][0] = o[m][j][1] = o[m][j][2] = o[m][j][3] = 0.f;
  const float scale = p.sm_scale * kLog2e;
  // Ring offsets of this lane's ldmatrix rows for the first 4 latent k16 steps of S (step ks + 4
  // adds kBlockBytes: 8 chunks) and the rope step, and for the first 4 pairs of n8 tiles of P V
  // (pair + 4 adds kBlockBytes).
  uint32_t k_off[4], v_off[4];
  const int k_row = (lane & 7) + (lane >> 4) * 8, k_half = (lane >> 3) & 1;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    k_off[u] = kv_off(k_row, warp * kDimsW / 8 + 2 * u + k_half);
    v_off[u] = kv_off(lane & 15, warp * kDimsW / 8 + 2 * u + (lane >> 4));
  }
  const uint32_t k_rope = rope_off(warp, k_row, k_half);

  for (int t = t0; t < t1; ++t) {
    const int i = t - t0;
    if constexpr (!kTma) {
      __syncwarp();  // the lanes' ldmatrix reads of the buffer tile t + 1 refills (P V of tile t - 1) are done
      prefetch(t, i);
    }
    const uint32_t buf = kv_s + (i % kStages) * kTileBytes;
    if constexpr (kTma) {
      TmaLoader::wait(bar0 + 8 * (i % kStages), (i / kStages) & 1);
      if (len - t * kTile < kTile) {  // the sequence ends inside this tile
        zero_tail_rows(buf, len - t * kTile);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // before any later TMA write
        __syncwarp();
      }
    } else {
      cp_async_commit();
      cp_async_wait<1>();  // tile t; tile t + 1 may fly on
      __syncwarp();        // the warp's copies of tile t visible to all its lanes
    }

    // Partial S = Q K^T over this warp's dims, every head, 16 tokens at a time
    // (fewer live accumulators next to O and Q).
#pragma unroll
    for (int j = 0; j < kN8; j += 2) {
      float s[MT][2][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) s[m][jj][0] = s[m][jj][1] = s[m][jj][2] = s[m][jj][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kLS; ++ks) {
        uint32_t bk[4];
        ldmatrix_x4(bk, buf + (j / 2) * 16 * 128 + k_off[ks % 4] + kBlockBytes * (ks / 4));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma16816<T>(s[m][0], qf[m][ks], bk);
          mma16816<T>(s[m][1], qf[m][ks], bk + 2);
        }
      }
      {  // the rope step
        uint32_t bk[4];
        ldmatrix_x4(bk, buf + (j / 2) * 512 + k_rope);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma16816<T>(s[m][0], qr[m], bk);
          mma16816<T>(s[m][1], qr[m], bk + 2);
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const int row = warp * kHeads + m * 16 + lane / 4;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int chunk = 2 * (j + jj) + (lane % 4) / 2, within = (lane % 2) * 2;
          *reinterpret_cast<float2*>(s_s + s_off(row, chunk) + within) = make_float2(s[m][jj][0], s[m][jj][1]);
          *reinterpret_cast<float2*>(s_s + s_off(row + 8, chunk) + within) = make_float2(s[m][jj][2], s[m][jj][3]);
        }
      }
    }
    // The TMA's prefetch goes here instead (cp.async: at the top, where its commit groups are
    // counted), where the warp would wait for the others anyway (32x2048x128: 76.0 -> 74.5 us).
    if constexpr (kTma) prefetch(t, i);
    __syncthreads();

    // Online softmax, kTpr threads per head, kCpt score columns each (thread sq of a head takes
    // the 4-column chunks sq, sq + kTpr, ...): the 4 partial sums, scaled, masked. The running max
    // only moves when a score exceeds it by more than 2^kLazy (attention/softmax.cuh): one vote
    // says whether any head of the warp needs it to, and only
    // then is the row max reduced over the head's threads; so alpha is exactly 1 on most tiles
    // and O's rescale is skipped. Each thread sums its own columns' p (l_run), so no reduction
    // stands between the exponentials and the barrier.
    bool moved;
    {
      float v[kCpt];
#pragma unroll
      for (int c = 0; c < kCpt; c += 4) {
        const int chunk = sq + (c / 4) * kTpr;
        float4 acc = *reinterpret_cast<const float4*>(s_s + s_off(srow, chunk));
#pragma unroll
        for (int w = 1; w < kWarps; ++w) {
          const float4 x = *reinterpret_cast<const float4*>(s_s + s_off(w * kHeads + srow, chunk));
          acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
        }
        v[c] = acc.x, v[c + 1] = acc.y, v[c + 2] = acc.z, v[c + 3] = acc.w;
      }
      const int valid = len - t * kTile;  // columns of the tile inside the sequence
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < kCpt; ++c) {
        v[c] = 4 * (sq + (c / 4) * kTpr) + c % 4 < valid ? v[c] * scale : -INFINITY;
        mx = fmaxf(mx, v[c]);
      }
      const float m_old = m_run;
      if (__any_sync(0xffffffffu, attn::max_moves(m_old, mx))) m_run = attn::next_max(m_old, warp_max<kTpr>(mx));
      float sum = 0.f;
      uint32_t pk[kCpt / 2];
#pragma unroll
      for (int c = 0; c < kCpt; c += 2) {
        const float e0 = exp2_ftz(v[c] - m_run), e1 = exp2_ftz(v[c + 1] - m_run);
        sum += e0 + e1;
        pk[c / 2] = pack2<T>(e0, e1);
      }
#pragma unroll
      for (int c = 0; c < kCpt; c += 4)
        *reinterpret_cast<uint2*>(p_s + srow * L::kPRow + 4 * (sq + (c / 4) * kTpr)) =
            make_uint2(pk[c / 2], pk[c / 2 + 1]);
      const float alpha = attn::rescale(m_old, m_run);
      l_run = l_run * alpha + sum;
      if (sq == 0) a_s[srow] = alpha;
      moved = alpha != 1.f;
    }
    moved = __syncthreads_or(moved);  // P and a_s complete; does any head rescale O?

    // O = alpha * O + P V for every head x this warp's latent dims (alpha = 1: no rescale).
    if (moved) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float a0 = a_s[m * 16 + lane / 4], a1 = a_s[m * 16 + lane / 4 + 8];
#pragma unroll
        for (int j = 0; j < kON8; ++j) {
          o[m][j][0] *= a0;
          o[m][j][1] *= a0;
          o[m][j][2] *= a1;
          o[m][j][3] *= a1;
        }
      }
    }
#pragma unroll
    for (int k0 = 0; k0 < kTile; k0 += 16) {
      uint32_t a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
        ldmatrix_x4(a[m], smem_addr(p_s + (m * 16 + (lane & 15)) * L::kPRow + k0 + (lane >> 4) * 8));
#pragma unroll
      for (int j = 0; j < kON8; j += 2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, buf + k0 * 128 + v_off[(j / 2) % 4] + kBlockBytes * (j / 8));
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          mma16816<T>(o[m][j], a[m], bv);
          mma16816<T>(o[m][j + 1], a[m], bv + 2);
        }
      }
    }
  }
  if constexpr (!kTma) cp_async_wait<0>();  // the (empty) groups committed past the last tile
  l_run = warp_sum<kTpr>(l_run);
  if (sq == 0) {  // an empty split: m = -inf, l = 0
    m_s[srow] = m_run;
    l_s[srow] = l_run;
  }
  __syncthreads();  // final m, l
  grid_dependents_may_launch();

  // Normalise and write: the output directly, or this split's fp32 partial.
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * 16 + lane / 4 + half * 8;
      const int h = head0 + row;
      if (h >= p.heads) continue;
      const float l = l_s[row];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse2 = attn::lse2(m_s[row], l);
      const int64_t bh = int64_t(b) * p.heads + h;
      const int col0 = warp * kDimsW + (lane % 4) * 2;
      if (p.num_splits == 1) {
        T* out = static_cast<T*>(p.out) + bh * kMlaDimCkv + col0;
#pragma unroll
        for (int j = 0; j < kON8; ++j)
          *reinterpret_cast<uint32_t*>(out + j * 8) = pack2<T>(o[m][j][half * 2] * inv, o[m][j][half * 2 + 1] * inv);
        if (p.lse != nullptr && warp == 0 && lane % 4 == 0) p.lse[bh] = lse2 * kLn2;
      } else {
        const int64_t sbh = int64_t(split) * p.batch * p.heads + bh;
        float* out = p.partial_o + sbh * kMlaDimCkv + col0;
#pragma unroll
        for (int j = 0; j < kON8; ++j)
          *reinterpret_cast<float2*>(out + j * 8) = make_float2(o[m][j][half * 2] * inv, o[m][j][half * 2 + 1] * inv);
        if (warp == 0 && lane % 4 == 0) p.partial_lse[sbh] = lse2;
      }
    }
}

void check(cudaError_t e, const char* what) { check_cuda(e, "mla_decode", what); }

// The compiled configurations, best first for each head count: {MT}: 32 or 16 heads per CTA
// (~93 / ~83 KB: two CTAs per H100 SM, one per sm_89 SM). More heads per CTA would need more
// registers for O and Q than a thread has; a third ring buffer ran no faster and 16-token steps
// with the two products of consecutive steps interleaved ran slower (measured on an H200:
// docs/perf/mla_decode.md).
constexpr int kConfigs[][1] = {{2}, {1}};
constexpr int kNumConfigs = 2;

// Calls f(kernel, smem bytes, threads) for configuration `c` (an index into kConfigs) and
// `loader` (a Loader).
template <typename T, typename F>
void with_config(int c, int loader, F&& f) {
  auto pick = [&](auto mt) {
    constexpr int MT = decltype(mt)::value;
    constexpr int kBytes = Smem<MT>::bytes, kThreads = 32 * kWarps;
    switch (loader) {
      case kLoadRows:
        f(mla_decode_kernel<T, MT, kLoadRows>, kBytes, kThreads);
        break;
      case kLoadContig:
        f(mla_decode_kernel<T, MT, kLoadContig>, kBytes, kThreads);
        break;
      default:
        f(mla_decode_kernel<T, MT, kLoadTma>, kBytes, kThreads);
        break;
    }
  };
  if (kConfigs[c][0] == 2)
    pick(std::integral_constant<int, 2>{});
  else
    pick(std::integral_constant<int, 1>{});
}

// The TMA's view of the cache (see KvTensorMaps): `cols` 16-bit columns of num_pages * page_size
// rows, boxes of `box_cols` x kTile.
CUtensorMap tensor_map(const void* base, int64_t rows, int cols, int box_cols, CUtensorMapSwizzle swizzle) {
  return tensor_map_2d(base, rows, cols, box_cols, kTile, swizzle, "mla_decode");
}

// The loader for a configuration: the TMA on sm_90+ when tiles lie in one page and a CTA has 32
// heads (with 16 heads the TMA ran small calls 1-8% faster than cp.async, and 128x8192x16 as fast on
// one H200 and 1.2% slower on another: docs/perf/mla_decode.md), unless the plan was asked to keep
// cp.async. cc_major: the device's compute capability major.
int choose_loader(int cc_major, int config, int page_size, bool allow_tma) {
  if (page_size % kTile != 0) return kLoadRows;
  const bool tma = allow_tma && cc_major >= 9 && kConfigs[config][0] == 2;
  return tma ? kLoadTma : kLoadContig;
}

int config_bytes(int c) {
  int bytes = 0;
  with_config<__nv_bfloat16>(c, kLoadRows, [&](auto, int b, int) { bytes = b; });
  return bytes;
}

int config_heads(int c) { return 16 * kConfigs[c][0]; }

int choose_config(int limit, int heads, int forced) {
  if (forced >= 0) {
    if (forced >= kNumConfigs || config_bytes(forced) > limit)
      throw std::invalid_argument("mla_decode: configuration " + std::to_string(forced) +
                                  " does not exist or does not fit this device's shared memory");
    return forced;
  }
  const int want_mt = heads > 16 ? 2 : 1;
  for (int c = 0; c < kNumConfigs; ++c)
    if (kConfigs[c][0] <= want_mt && config_bytes(c) <= limit) return c;
  throw std::runtime_error("mla_decode: the device's shared memory (" + std::to_string(limit) +
                           " bytes per block) is below the smallest configuration");
}

}  // namespace

MlaDecodePlan mla_decode_plan(int device, int batch, int heads, int max_pages, int page_size, int config,
                              bool allow_tma) {
  const int limit = device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "mla_decode");
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount, "mla_decode");
  const int smem_sm = device_attribute(device, cudaDevAttrMaxSharedMemoryPerMultiprocessor, "mla_decode");
  const int cc_major = device_attribute(device, cudaDevAttrComputeCapabilityMajor, "mla_decode");
  MlaDecodePlan plan{};
  plan.config = choose_config(limit, heads, config);
  plan.loader = choose_loader(cc_major, plan.config, page_size, allow_tma);
  plan.heads_per_cta = config_heads(plan.config);
  plan.tile_tokens = kTile;
  plan.smem_bytes = config_bytes(plan.config);
  const int ctas = batch * ((heads + plan.heads_per_cta - 1) / plan.heads_per_cta);
  const int slots = sms * std::max(1, smem_sm / (plan.smem_bytes + 1024));  // CTAs resident at once
  const int max_tiles = int((int64_t(max_pages) * page_size + kTile - 1) / kTile);
  plan.num_splits = mla_num_splits(slots, ctas, max_tiles);
  plan.cluster = 1;  // the combine pass merges the splits
  return plan;
}

const char* mla_decode_declines(int, int, int, int, int) { return nullptr; }  // every shape, any page size

void mla_decode_prewarm(int device) {
  const DeviceGuard guard(device, "mla_decode");
  const int limit = device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "mla_decode");
  auto set = [&](auto kernel, int bytes, int) {
    if (bytes <= limit)
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "smem attribute");
  };
  for (int c = 0; c < kNumConfigs; ++c) {
    for (const int loader : {kLoadRows, kLoadContig, kLoadTma}) {
      with_config<__nv_bfloat16>(c, loader, set);
      with_config<__half>(c, loader, set);
    }
  }
  const int cc_major = device_attribute(device, cudaDevAttrComputeCapabilityMajor, "mla_decode");
  for (int c = 0; c < kNumConfigs; ++c)
    if (choose_loader(cc_major, c, kTile, true) == kLoadTma) encode_tiled("mla_decode");
  mla_combine_prewarm();
}

void mla_decode_launch(const MlaDecodeParams& p, const MlaDecodePlan& plan, int device, uintptr_t stream_handle,
                       EagerGraph* graph) {
  if (p.dtype != kBF16 && p.dtype != kF16) throw std::invalid_argument("mla_decode: dtype must be bf16 or fp16");
  if (int64_t(p.num_pages) * p.page_size > INT32_MAX)
    throw std::invalid_argument("mla_decode: the cache has more than 2^31 - 1 token rows (num_pages * page_size)");
  // The plan came from mla_decode_plan for this shape; these keep a stale or foreign one from
  // launching a kernel whose loader the page size (or the device) cannot serve.
  if (plan.config < 0 || plan.config >= kNumConfigs || plan.cluster != 1 || plan.num_splits != p.num_splits ||
      p.num_splits < 1 || p.num_splits > kMlaMaxSplits || plan.loader < kLoadRows || plan.loader > kLoadTma ||
      (plan.loader != kLoadRows && p.page_size % kTile != 0) ||
      (plan.loader == kLoadTma && kConfigs[plan.config][0] != 2))
    throw std::invalid_argument("mla_decode: the plan does not fit this call (compute it with mla_decode_plan)");
  const DeviceGuard guard(device, "mla_decode");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int heads_per_cta = config_heads(plan.config);
  const dim3 grid(p.num_splits, (p.heads + heads_per_cta - 1) / heads_per_cta, p.batch);
  KvTensorMaps maps = {};
  if (plan.loader == kLoadTma) {
    const int64_t rows = int64_t(p.num_pages) * p.page_size;
    maps.ckv = tensor_map(p.ckv, rows, kMlaDimCkv, kBlockCols, CU_TENSOR_MAP_SWIZZLE_128B);
    maps.kpe = tensor_map(p.kpe, rows, kMlaDimPe, kWarpRope, CU_TENSOR_MAP_SWIZZLE_32B);
  }
  Launches launches;
  launches.op = "mla_decode";
  auto add = [&](auto kernel, int bytes, int threads) { launches.add(kernel, grid, threads, bytes, false, p, maps); };
  if (p.dtype == kBF16)
    with_config<__nv_bfloat16>(plan.config, plan.loader, add);
  else
    with_config<__half>(plan.config, plan.loader, add);
  // Programmatic dependent launch exists on sm_90+ only.
  if (p.num_splits > 1)
    mla_combine(p, device_attribute(device, cudaDevAttrComputeCapabilityMajor, "mla_decode") >= 9, launches);
  run_launches(launches, stream, graph);
}

}  // namespace hmoe
