// Portable MLA decode (absorbed form) for sm_80 and newer: mma.sync m16n8k16, cp.async double
// buffering, paged KV, split-KV with fp32 partials and a combine kernel.
//
// One CTA = (KV split, 16 * HG heads, request), WPG warps per 16-head group, STAGES KV tiles
// of TILE tokens in flight (cp.async). Warp (hg, i) of the group, per tile:
//   S = Q K^T   dims quarter i % 4 of the 576 (its Q fragments stay in registers) x tokens
//               part i / 4; the 4 partial sums meet in shared memory (Q's staging area)
//   softmax     16 / WPG of the heads, online, log2 domain
//   O += P V    512 / WPG latent dims for all 16 heads, fp32 in registers
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/dtype.h"
#include "mla/mla_decode.h"

namespace hmoe {
namespace {

constexpr int kDim = kMlaDimCkv + kMlaDimPe;  // 576
constexpr int kRow = kDim + 8;                // smem row (+16 B: ldmatrix rows hit distinct banks)
constexpr int kChunksCkv = kMlaDimCkv / 8;    // 16-byte chunks per row
constexpr int kChunksRow = kDim / 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int HG, int TILE, int STAGES>
struct Smem {
  static constexpr int kHeads = 16 * HG;
  static constexpr int kSRow = TILE + 4;   // fp32 partial scores
  static constexpr int kPRow = TILE + 8;   // 16-bit probabilities (+16 B for ldmatrix)
  static constexpr int s = 0;              // the 4 partial score tiles
  static constexpr int kv = s + 4 * kHeads * kSRow * 4;  // KV tiles; Q is staged here first
  static constexpr int p = kv + STAGES * TILE * kRow * 2;
  static constexpr int stats = p + kHeads * kPRow * 2;  // m, l, alpha: kHeads floats each
  static constexpr int rows = stats + 3 * kHeads * 4;   // STAGES x TILE source slots of KV rows
  static constexpr int bytes = rows + STAGES * TILE * 8;
  static_assert(kHeads <= STAGES * TILE, "Q is staged in the KV buffers");
  static_assert(kv % 16 == 0 && p % 16 == 0, "16-byte aligned regions");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 fills the destination with zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <typename T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  T lo = from_float<T>(a), hi = from_float<T>(b);
  return uint32_t(*reinterpret_cast<uint16_t*>(&lo)) | (uint32_t(*reinterpret_cast<uint16_t*>(&hi)) << 16);
}

__device__ __forceinline__ int clamp_len(const MlaDecodeParams& p, int b) {
  int len = p.seq_lens[b];
  return min(max(len, 0), p.max_pages * p.page_size);
}

// Source row (token slot in the cache) of each token of KV tile `tile`, or -1 for a row to
// zero-fill: past the sequence, or a page id outside the cache. Masked scores are -inf, but
// 0 * NaN from stale cache rows in P V would still poison the output, hence zeros.
template <int TILE>
__device__ __forceinline__ void kv_row_slots(const MlaDecodeParams& p, int b, int len, int tile, int64_t* slots) {
  for (int r = threadIdx.x; r < TILE; r += blockDim.x) {
    const int tok = tile * TILE + r;
    int64_t slot = -1;
    if (tok < len) {
      const int page = p.page_table[int64_t(b) * p.max_pages + tok / p.page_size];
      if (page >= 0 && page < p.num_pages) slot = int64_t(page) * p.page_size + tok % p.page_size;
    }
    slots[r] = slot;
  }
}

// Issues the cp.async copies of one KV tile whose row slots are in `slots`.
template <typename T, int TILE, int NT>
__device__ __forceinline__ void load_kv_tile(const MlaDecodeParams& p, const int64_t* slots, T* dst) {
  const T* ckv = static_cast<const T*>(p.ckv);
  const T* kpe = static_cast<const T*>(p.kpe);
#pragma unroll 4
  for (int i = threadIdx.x; i < TILE * kChunksRow; i += NT) {
    const int r = i / kChunksRow, c = i % kChunksRow;
    const int64_t slot = slots[r];
    const T* src = slot < 0 ? ckv
                   : c < kChunksCkv ? ckv + slot * kMlaDimCkv + c * 8
                                    : kpe + slot * kMlaDimPe + (c - kChunksCkv) * 8;
    cp_async16(dst + r * kRow + c * 8, src, slot < 0 ? 0 : 16);
  }
}

template <typename T, int HG, int WPG, int TILE, int STAGES>
__global__ void __launch_bounds__(32 * HG * WPG, 1) mla_decode_kernel(const MlaDecodeParams p) {
  using L = Smem<HG, TILE, STAGES>;
  constexpr int NT = 32 * HG * WPG;
  constexpr int kHeads = L::kHeads;
  constexpr int kTokS = TILE / (WPG / 4);  // tokens per warp in S
  constexpr int kN8 = kTokS / 8;           // n8 tiles of tokens per warp in S
  constexpr int kKS = kDim / 16 / 4;       // k16 steps of S per warp (9)
  constexpr int kRowsW = 16 / WPG;         // softmax rows per warp
  constexpr int kDimsW = kMlaDimCkv / WPG; // latent dims of O per warp
  constexpr int kON8 = kDimsW / 8;
  static_assert(kN8 % 2 == 0 && kON8 % 2 == 0 && TILE % 32 == 0, "tile shape");
  extern __shared__ __align__(128) unsigned char smem[];
  float* s_s = reinterpret_cast<float*>(smem + L::s);
  T* kv_s = reinterpret_cast<T*>(smem + L::kv);
  T* q_s = kv_s;  // Q's staging area until its fragments are in registers
  T* p_s = reinterpret_cast<T*>(smem + L::p);
  float* m_s = reinterpret_cast<float*>(smem + L::stats);
  float* l_s = m_s + kHeads;
  float* a_s = l_s + kHeads;
  int64_t* slots = reinterpret_cast<int64_t*>(smem + L::rows);

  const int split = blockIdx.x, head0 = blockIdx.y * kHeads, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hg = warp / WPG, wi = warp % WPG, dq = wi % 4, th = wi / 4;
  const int len = clamp_len(p, b);
  const int n_tiles = (len + TILE - 1) / TILE;
  const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t0 = split * per_split, t1 = min(n_tiles, t0 + per_split);

  // Q rows (zero rows past the last head) and the first tiles' row slots.
  {
    const T* qn = static_cast<const T*>(p.q_nope);
    const T* qp = static_cast<const T*>(p.q_pe);
    for (int i = threadIdx.x; i < kHeads * kChunksRow; i += NT) {
      const int r = i / kChunksRow, c = i % kChunksRow, h = head0 + r;
      const T* src = qn;
      int bytes = 0;
      if (h < p.heads) {
        const int64_t bh = int64_t(b) * p.heads + h;
        src = c < kChunksCkv ? qn + bh * kMlaDimCkv + c * 8 : qp + bh * kMlaDimPe + (c - kChunksCkv) * 8;
        bytes = 16;
      }
      cp_async16(q_s + r * kRow + c * 8, src, bytes);
    }
    cp_async_commit();
  }
  for (int i = 0; i < STAGES - 1; ++i)
    if (t0 + i < t1) kv_row_slots<TILE>(p, b, len, t0 + i, slots + i * TILE);
  if (threadIdx.x < kHeads) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();
  // This warp's Q fragments (16 heads x 144 dims) stay in registers; once every warp has
  // read its own, the staging area takes KV tiles.
  uint32_t qf[kKS][4];
#pragma unroll
  for (int ks = 0; ks < kKS; ++ks)
    ldmatrix_x4(qf[ks], q_s + (hg * 16 + (lane & 15)) * kRow + (dq * kKS + ks) * 16 + (lane >> 4) * 8);
  __syncthreads();
  // Tiles t0 .. t0 + STAGES - 2, one commit group each (empty groups keep the count uniform).
  for (int i = 0; i < STAGES - 1; ++i) {
    if (t0 + i < t1) load_kv_tile<T, TILE, NT>(p, slots + i * TILE, kv_s + i * TILE * kRow);
    cp_async_commit();
  }

  float o[kON8][4];
#pragma unroll
  for (int j = 0; j < kON8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  const float scale = p.sm_scale * kLog2e;

  for (int t = t0; t < t1; ++t) {
    const int i = t - t0;
    const T* kv = kv_s + (i % STAGES) * TILE * kRow;
    const int tn = t + STAGES - 1, bn = (i + STAGES - 1) % STAGES;
    if (tn < t1) kv_row_slots<TILE>(p, b, len, tn, slots + bn * TILE);
    cp_async_wait<STAGES - 2>();  // tile t's group; the STAGES - 2 younger ones may fly on
    // After this barrier tile t and tile tn's slots are visible and every warp has left
    // iteration t - 1, so buffer bn (tile t - 1's) is free for tile tn.
    __syncthreads();
    if (tn < t1) load_kv_tile<T, TILE, NT>(p, slots + bn * TILE, kv_s + bn * TILE * kRow);
    cp_async_commit();

    // Partial S = Q K^T over this warp's dims and tokens.
    float s[kN8][4];
#pragma unroll
    for (int j = 0; j < kN8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    const T* kb = kv + (th * kTokS + (lane & 7) + (lane >> 4) * 8) * kRow + dq * kKS * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
#pragma unroll
      for (int j = 0; j < kN8; j += 2) {
        uint32_t bk[4];
        ldmatrix_x4(bk, kb + j * 8 * kRow + ks * 16);
        mma16816<T>(s[j], qf[ks], bk);
        mma16816<T>(s[j + 1], qf[ks], bk + 2);
      }
    }
    float* sp = s_s + (dq * kHeads + hg * 16) * L::kSRow + th * kTokS;
#pragma unroll
    for (int j = 0; j < kN8; ++j) {
      const int col = j * 8 + (lane % 4) * 2;
      *reinterpret_cast<float2*>(sp + (lane / 4) * L::kSRow + col) = make_float2(s[j][0], s[j][1]);
      *reinterpret_cast<float2*>(sp + (lane / 4 + 8) * L::kSRow + col) = make_float2(s[j][2], s[j][3]);
    }
    __syncthreads();

    // Online softmax of this warp's heads: the 4 partial sums, scaled, masked. The rows are
    // independent: all loads first, then the reductions interleaved, so their shuffle
    // latencies overlap instead of adding up row after row.
    {
      constexpr int kPer = TILE / 32;  // columns per lane
      const int row0 = hg * 16 + wi * kRowsW;
      float v[kRowsW][kPer], mx[kRowsW], m_old[kRowsW], sum[kRowsW];
#pragma unroll
      for (int rr = 0; rr < kRowsW; ++rr) {
        m_old[rr] = m_s[row0 + rr];
        mx[rr] = -INFINITY;
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
          const int col = lane * kPer + c;
          float acc = 0.f;
#pragma unroll
          for (int w = 0; w < 4; ++w) acc += s_s[(w * kHeads + row0 + rr) * L::kSRow + col];
          v[rr][c] = (t * TILE + col < len) ? acc * scale : -INFINITY;
          mx[rr] = fmaxf(mx[rr], v[rr][c]);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
#pragma unroll
        for (int rr = 0; rr < kRowsW; ++rr) mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], off));
#pragma unroll
      for (int rr = 0; rr < kRowsW; ++rr) {
        mx[rr] = fmaxf(m_old[rr], mx[rr]);                    // the new running max
        const float m_use = mx[rr] == -INFINITY ? 0.f : mx[rr];  // all masked so far: p = 0
        sum[rr] = 0.f;
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
          const float e = exp2f(v[rr][c] - m_use);
          sum[rr] += e;
          p_s[(row0 + rr) * L::kPRow + lane * kPer + c] = from_float<T>(e);
        }
        v[rr][0] = exp2f(m_old[rr] - m_use);  // alpha, kept in a free register
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1)
#pragma unroll
        for (int rr = 0; rr < kRowsW; ++rr) sum[rr] += __shfl_xor_sync(0xffffffffu, sum[rr], off);
      if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < kRowsW; ++rr) {
          l_s[row0 + rr] = l_s[row0 + rr] * v[rr][0] + sum[rr];
          m_s[row0 + rr] = mx[rr];
          a_s[row0 + rr] = v[rr][0];
        }
      }
    }
    __syncthreads();

    // O = alpha * O + P V for 16 heads x this warp's latent dims.
    const float al0 = a_s[hg * 16 + lane / 4], al1 = a_s[hg * 16 + lane / 4 + 8];
#pragma unroll
    for (int j = 0; j < kON8; ++j) {
      o[j][0] *= al0;
      o[j][1] *= al0;
      o[j][2] *= al1;
      o[j][3] *= al1;
    }
    const T* pa = p_s + (hg * 16 + (lane & 15)) * L::kPRow + (lane >> 4) * 8;
#pragma unroll
    for (int k0 = 0; k0 < TILE; k0 += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, pa + k0);
      const T* vb = kv + (k0 + (lane & 15)) * kRow + wi * kDimsW + (lane >> 4) * 8;
#pragma unroll
      for (int j = 0; j < kON8; j += 2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vb + j * 8);
        mma16816<T>(o[j], a, bv);
        mma16816<T>(o[j + 1], a, bv + 2);
      }
    }
  }
  cp_async_wait<0>();  // the (empty) groups committed past the last tile
  __syncthreads();     // final m, l (and empty splits: the initial values)

  // Normalise and write: the output directly, or this split's fp32 partial.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = hg * 16 + lane / 4 + half * 8;
    const int h = head0 + row;
    if (h >= p.heads) continue;
    const float l = l_s[row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse2 = l > 0.f ? m_s[row] + log2f(l) : -INFINITY;
    const int64_t bh = int64_t(b) * p.heads + h;
    const int col0 = wi * kDimsW + (lane % 4) * 2;
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + bh * kMlaDimCkv + col0;
#pragma unroll
      for (int j = 0; j < kON8; ++j)
        *reinterpret_cast<uint32_t*>(out + j * 8) = pack2<T>(o[j][half * 2] * inv, o[j][half * 2 + 1] * inv);
      if (p.lse != nullptr && wi == 0 && lane % 4 == 0) p.lse[bh] = lse2 * kLn2;
    } else {
      const int64_t sbh = int64_t(split) * p.batch * p.heads + bh;
      float* out = p.partial_o + sbh * kMlaDimCkv + col0;
#pragma unroll
      for (int j = 0; j < kON8; ++j)
        *reinterpret_cast<float2*>(out + j * 8) = make_float2(o[j][half * 2] * inv, o[j][half * 2 + 1] * inv);
      if (wi == 0 && lane % 4 == 0) p.partial_lse[sbh] = lse2;
    }
  }
}

// Merges the splits of one (request, head): out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - max).
template <typename T>
__global__ void __launch_bounds__(128) mla_combine_kernel(const MlaDecodeParams p) {
  const int64_t bh = blockIdx.x;
  const int64_t stride = int64_t(p.batch) * p.heads;
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.partial_lse[s * stride + bh]);
  const float m_use = mx == -INFINITY ? 0.f : mx;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, wsum = 0.f;
  const int col = threadIdx.x * 4;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = exp2f(p.partial_lse[s * stride + bh] - m_use);
    if (w == 0.f) continue;  // empty split: its partial may be anything but NaN-free zeros
    wsum += w;
    const float4 v = *reinterpret_cast<const float4*>(p.partial_o + (s * stride + bh) * kMlaDimCkv + col);
    acc[0] += w * v.x;
    acc[1] += w * v.y;
    acc[2] += w * v.z;
    acc[3] += w * v.w;
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* out = static_cast<T*>(p.out) + bh * kMlaDimCkv + col;
  *reinterpret_cast<uint32_t*>(out) = pack2<T>(acc[0] * inv, acc[1] * inv);
  *reinterpret_cast<uint32_t*>(out + 2) = pack2<T>(acc[2] * inv, acc[3] * inv);
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[bh] = wsum > 0.f ? (m_use + log2f(wsum)) * kLn2 : -INFINITY;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("mla_decode: ") + what + ": " + cudaGetErrorString(e));
}

int smem_optin(int device) {
  int v = 0;
  check(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "device attribute");
  return v;
}

// The compiled configurations, best first for each head count: {HG, WPG, TILE, STAGES}: as
// many heads per CTA as fit (each KV byte then feeds up to 64 heads), 4 warps per 16 heads,
// double-buffered 32-token tiles (16 heads: 95 KB, two CTAs per H100 SM or one per sm_89 SM).
// Measured on an H200 (cuda/mla/NOTES.md): 8 warps per head group with 3 or 4 tiles in
// flight, 64-token tiles and 16-token tiles (3 CTAs per SM) all ran slower for 16 heads.
constexpr int kConfigs[][4] = {{4, 4, 32, 2}, {2, 4, 32, 2}, {1, 4, 32, 2}};
constexpr int kNumConfigs = 3;

// Calls f(kernel, smem bytes, threads) for configuration `c` (an index into kConfigs).
template <typename T, typename F>
void with_config(int c, F&& f) {
  switch (c) {
    case 0: f(mla_decode_kernel<T, 4, 4, 32, 2>, Smem<4, 32, 2>::bytes, 512); break;
    case 1: f(mla_decode_kernel<T, 2, 4, 32, 2>, Smem<2, 32, 2>::bytes, 256); break;
    default: f(mla_decode_kernel<T, 1, 4, 32, 2>, Smem<1, 32, 2>::bytes, 128); break;
  }
}

int config_bytes(int c) {
  int bytes = 0;
  with_config<__nv_bfloat16>(c, [&](auto, int b, int) { bytes = b; });
  return bytes;
}

int choose_config(int device, int heads) {
  const int limit = smem_optin(device);
  const int want_hg = heads > 32 ? 4 : heads > 16 ? 2 : 1;
  // HMOE_MLA_CONFIG=<index into kConfigs> forces one where it fits (a tuning knob).
  if (const char* env = std::getenv("HMOE_MLA_CONFIG")) {
    const int c = std::atoi(env);
    if (c < 0 || c >= kNumConfigs || config_bytes(c) > limit)
      throw std::invalid_argument(std::string("HMOE_MLA_CONFIG=") + env + " is not a configuration this device fits");
    return c;
  }
  for (int c = 0; c < kNumConfigs; ++c)
    if (kConfigs[c][0] <= want_hg && config_bytes(c) <= limit) return c;
  throw std::runtime_error("mla_decode: the device's shared memory (" + std::to_string(limit) +
                           " bytes per block) is below the smallest configuration");
}

}  // namespace

MlaConfig mla_decode_config(int device, int heads) {
  const int c = choose_config(device, heads);
  return {16 * kConfigs[c][0], kConfigs[c][2], config_bytes(c)};
}

int mla_decode_num_splits(int device, int batch, int heads, int max_pages, int page_size) {
  int sms = 0, smem_sm = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device attribute");
  check(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device), "device attribute");
  const MlaConfig cfg = mla_decode_config(device, heads);
  const int ctas = batch * ((heads + cfg.heads_per_cta - 1) / cfg.heads_per_cta);
  const int slots = sms * std::max(1, smem_sm / (cfg.smem_bytes + 1024));  // CTAs resident at once
  const int max_tiles = std::max(1, (max_pages * page_size + cfg.tile_tokens - 1) / cfg.tile_tokens);
  const int max_splits = std::max(1, std::min(64, max_tiles / 2));
  // Enough splits to fill ~90% of the resident CTA slots; a grid that already fills them is
  // not split (every split costs a partial write and the combine pass).
  const int want = (9 * slots + 10 * ctas - 1) / (10 * ctas);
  return std::clamp(want, 1, max_splits);
}

void mla_decode_prewarm(int device) {
  int prev = 0;
  check(cudaGetDevice(&prev), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  const int limit = smem_optin(device);
  auto set = [&](auto kernel, int bytes, int) {
    if (bytes <= limit) check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "smem attribute");
  };
  for (int c = 0; c < kNumConfigs; ++c) {
    with_config<__nv_bfloat16>(c, set);
    with_config<__half>(c, set);
  }
  cudaFuncAttributes attr;
  check(cudaFuncGetAttributes(&attr, mla_combine_kernel<__nv_bfloat16>), "combine kernel");
  check(cudaFuncGetAttributes(&attr, mla_combine_kernel<__half>), "combine kernel");
  check(cudaSetDevice(prev), "cudaSetDevice");
}

void mla_decode_portable(const MlaDecodeParams& p, int device, uintptr_t stream_handle) {
  if (p.dtype != kBF16 && p.dtype != kF16) throw std::invalid_argument("mla_decode: dtype must be bf16 or fp16");
  int prev = 0;
  check(cudaGetDevice(&prev), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int c = choose_config(device, p.heads);
  const int heads_per_cta = 16 * kConfigs[c][0];
  const dim3 grid(p.num_splits, (p.heads + heads_per_cta - 1) / heads_per_cta, p.batch);
  auto launch = [&](auto kernel, int bytes, int threads) { kernel<<<grid, threads, bytes, stream>>>(p); };
  if (p.dtype == kBF16) with_config<__nv_bfloat16>(c, launch);
  else with_config<__half>(c, launch);
  check(cudaGetLastError(), "kernel launch");
  if (p.num_splits > 1) {
    const int bh = p.batch * p.heads;
    if (p.dtype == kBF16) mla_combine_kernel<__nv_bfloat16><<<bh, 128, 0, stream>>>(p);
    else mla_combine_kernel<__half><<<bh, 128, 0, stream>>>(p);
    check(cudaGetLastError(), "combine launch");
  }
  check(cudaSetDevice(prev), "cudaSetDevice");
}

}  // namespace hmoe
