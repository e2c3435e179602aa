// MLA decode (absorbed form) for Hopper, sm_90a only: wgmma, TMA and warp specialisation. The same
// op, params, page-walk bounds rules, split-KV partials and combine pass as the portable kernel
// (mla_decode_portable.cu); the dispatcher sends it calls with more than 32 heads and page sizes
// that are multiples of 16 (mla_decode_declines) and the rest to the portable family.
//
// One CTA = (KV split, 64 heads, request) and three warpgroups, walking the cache in 64-token tiles
// through a ring of two. Shared memory holds the CTA's Q (64 heads x 576 dims), the ring and one
// 64 x 64 tile of probabilities P, all as 64-column blocks in the TMA's 128-byte swizzle
// (attention/wgmma.cuh).
//   producer    one thread: Q's nine boxes, then each tile's boxes (64 / box rows per block, box =
//               gcd(page size, 64) rows, so a box never crosses a page; a missing page or tokens
//               past the sequence are boxes outside the tensor, which arrive as zeros), on the
//               tile buffer's "full" mbarrier, after its "empty" one says both consumers are done.
//   consumer c  (c = 0, 1; 128 threads each) per tile:
//               S_c = Q K[32c .. 32c + 32)^T     wgmma m64n32k16, 36 k-steps, fp32
//               the tile's row max: each its 32 tokens, exchanged through shared memory (barrier 1)
//               P_c = 2^(S_c - m) rounded to the input dtype into P's columns [32c, 32c + 32)
//               O_c = alpha O_c + P V[:, 256c .. 256c + 256)   wgmma m64n256k16 (barrier 2 first)
//               and releases the buffer. O_c (64 x 256 fp32) stays in registers.
// The running max is the portable kernel's lazy one (attention/softmax.cuh): on most tiles
// alpha = 1 and O is not rescaled. Both consumers compute the same m from the same two maxima.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention/mma.cuh"
#include "attention/softmax.cuh"
#include "attention/wgmma.cuh"
#include "common/cuda_util.h"
#include "common/dtype.h"
#include "common/tma_host.h"
#include "mla/mla_combine.h"
#include "mla/mla_decode.h"
#include "mla/mla_splits.h"

namespace hmoe {
namespace {

using namespace attn::sm90;
using attn::exp2_ftz;
using attn::kLn2;
using attn::kLog2e;

constexpr int kHeads = 64;                      // heads per CTA: wgmma's M
constexpr int kTile = 64;                       // KV tokens per ring buffer
constexpr int kBlocks = 9;                      // 64-column blocks of a 576-dim row: 8 latent, 1 rope
constexpr int kLatentBlocks = kMlaDimCkv / 64;  // 8
constexpr int kBlockBytes = kTile * 128;        // a block of a tile (or of Q: 64 heads)
constexpr int kTileBytes = kBlocks * kBlockBytes;
constexpr int kStages = 2;
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;
constexpr int kMinHeads = 33;
// fewer heads: the portable family (see mla_decode_declines)
static_assert(kMlaDimPe == 64, "the rope dims are one block");

// Shared memory, offsets from a 1024-byte aligned base (the launcher adds 1024 bytes of slack).
struct Smem {
  static constexpr int q = 0;
  static constexpr int kv = q + kBlocks * kBlockBytes;
  static constexpr int p = kv + kStages * kTileBytes;
  static constexpr int bars = p + kHeads * 128;               // full[kStages], empty[kStages], q
  static constexpr int stats = bars + 8 * (2 * kStages + 1);  // row maxima, then row sums: [2][kHeads] each
  static constexpr int end = stats + 2 * 2 * kHeads * 4;
  static constexpr int bytes = end + 1024;
};

// The tensor maps: q_nope [B * H, 512] and q_pe [B * H, 64] in boxes of 64 x 64, ckv [rows, 512] and
// kpe [rows, 64] in boxes of 64 x box rows; all with the 128-byte swizzle.
struct Maps {
  CUtensorMap q_nope, q_pe, ckv, kpe;
};

__device__ __forceinline__ void grid_dependents_may_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// The producer: Q, then every tile of the split into the ring.
__device__ __forceinline__ void produce(const MlaDecodeParams& p, const Maps& maps, uint32_t smem, int box, int b,
                                        int head0, int len, int t0, int t1) {
  const uint32_t full = smem + Smem::bars, empty = full + 8 * kStages, qbar = empty + 8 * kStages;
  if (t0 >= t1) return;  // an empty split: the consumers wait for nothing
  mbar_expect_tx(qbar, kBlocks * kBlockBytes);
  const int qrow = b * p.heads + head0;
  for (int blk = 0; blk < kBlocks; ++blk)
    tma_load_2d(smem + Smem::q + blk * kBlockBytes, blk < kLatentBlocks ? &maps.q_nope : &maps.q_pe,
                blk < kLatentBlocks ? 64 * blk : 0, qrow, qbar);
  const int32_t* table = p.page_table + int64_t(b) * p.max_pages;
  // The cache row of the box at token `tok`, or -box (outside the tensor: zeros).
  auto box_row = [&](int tok) {
    if (tok >= len) return -box;
    const int pg = tok / p.page_size;
    const int id = table[pg];
    return id >= 0 && id < p.num_pages ? id * p.page_size + (tok - pg * p.page_size) : -box;
  };
  for (int t = t0; t < t1; ++t) {
    const int i = t - t0, stage = i % kStages;
    if (i >= kStages) mbar_wait(empty + 8 * stage, ((i / kStages) - 1) & 1);
    const uint32_t buf = smem + Smem::kv + stage * kTileBytes;
    mbar_expect_tx(full + 8 * stage, kTileBytes);
    for (int g = 0; g < kTile; g += box) {
      const int row = box_row(t * kTile + g);
      for (int blk = 0; blk < kBlocks; ++blk)
        tma_load_2d(buf + blk * kBlockBytes + g * 128, blk < kLatentBlocks ? &maps.ckv : &maps.kpe,
                    blk < kLatentBlocks ? 64 * blk : 0, row, full + 8 * stage);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_sm90a_kernel(const MlaDecodeParams p, const int box, const __grid_constant__ Maps maps) {
  extern __shared__ __align__(1024) unsigned char smem_window[];
  const uint32_t window = attn::smem_addr(smem_window);
  const uint32_t smem = (window + 1023) & ~1023u;
  unsigned char* base = smem_window + (smem - window);
  const uint32_t full = smem + Smem::bars, empty = full + 8 * kStages, qbar = empty + 8 * kStages;
  float* smax = reinterpret_cast<float*>(base + Smem::stats);  // [2][kHeads]
  float* ssum = smax + 2 * kHeads;                             // [2][kHeads]

  const int split = blockIdx.x, head0 = blockIdx.y * kHeads, b = blockIdx.z;
  // Warp-uniform, and so said to the compiler (warp_uniform): the tile loop's buffer addresses and
  // wgmma descriptors then stay in uniform registers.
  const int wg = warp_uniform(threadIdx.x / 128);
  const int len = warp_uniform(min(max(p.seq_lens[b], 0), p.max_pages * p.page_size));
  const int n_tiles = (len + kTile - 1) / kTile;
  const int per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t0 = min(n_tiles, split * per_split), t1 = min(n_tiles, t0 + per_split);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 2);  // one arrival per consumer warpgroup
    }
    mbar_init(qbar, 1);
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {  // producer
    regs_shrink<40>();
    if (threadIdx.x == 0) produce(p, maps, smem, box, b, head0, len, t0, t1);
    return;
  }
  regs_grow<232>();
  const int c = wg - 1, tid = threadIdx.x - 128 * wg, warp = tid / 32, lane = tid % 32;
  const int r0 = warp * 16 + lane / 4;  // this thread's rows: r0 and r0 + 8
  const int q4 = lane % 4;
  const float scale = p.sm_scale * kLog2e;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  // S = Q K^T over this consumer's 32 tokens of the tile in `buf` (asynchronous: wgmma_wait).
  float s[16];
  const uint64_t q_desc = k_major(smem + Smem::q), p_desc = k_major(smem + Smem::p);
  auto issue_s = [&](uint32_t buf) {
    const uint64_t k_desc = k_major(buf + c * 32 * 128);
    wgmma_fence();
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t step = blk * kBlockBytes + kk * 32;
        wgmma<Wgmma64x32<0>, T>(s, desc_add(q_desc, step), desc_add(k_desc, step), blk + kk > 0);
      }
    wgmma_commit();
  };
#pragma unroll
  for (int k = 0; k < 16; ++k) s[k] = 0.f;
  if (t0 < t1) mbar_wait(qbar, 0);
  for (int t = t0; t < t1; ++t) {
    const int i = t - t0, stage = i % kStages;
    const uint32_t buf = smem + Smem::kv + stage * kTileBytes;
    mbar_wait(full + 8 * stage, (i / kStages) & 1);
    issue_s(buf);
    const int valid = len - t * kTile;  // tokens of this tile inside the sequence
    if (valid < kTile) {
      // Rows past the sequence hold whatever the cache holds there; 0 * NaN in P V would poison
      // O: zero this consumer's V columns of them (the masked scores ignore the rest).
      const int rows = kTile - valid;
      for (int idx = tid; idx < rows * 4 * 8; idx += 128) {
        const int row = valid + idx / 32, blk = 4 * c + (idx / 8) % 4, chunk = idx % 8;
        asm volatile(
            "st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(buf + blk * kBlockBytes + row * 128 + chunk * 16),
            "r"(0u)
            : "memory");
      }
      fence_async_smem();
    }
    wgmma_wait<0>();
    fence_regs<16>(s);

    // Scores: s[4j + e] is row r0 (e < 2) or r0 + 8, token 32c + 8j + 2 q4 + e % 2.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = 32 * c + 8 * j + 2 * q4 + (e & 1);
        s[4 * j + e] = tok < valid ? s[4 * j + e] * scale : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    if (q4 == 0) smax[c * kHeads + r0] = mx[0], smax[c * kHeads + r0 + 8] = mx[1];
    named_sync(1, kConsumerThreads);
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float both = fmaxf(mx[h], smax[(1 - c) * kHeads + r0 + 8 * h]);
      const float m_old = m_run[h];
      if (attn::max_moves(m_old, both)) m_run[h] = attn::next_max(m_old, both);
      alpha[h] = attn::rescale(m_old, m_run[h]);
    }
    // P = 2^(s - m) in the input dtype, into P's 128-byte swizzled rows (K-major for P V).
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float e0 = exp2_ftz(s[4 * j + 2 * h] - m_run[h]), e1 = exp2_ftz(s[4 * j + 2 * h + 1] - m_run[h]);
        sum[h] += e0 + e1;
        const int row = r0 + 8 * h, col = 32 * c + 8 * j + 2 * q4;
        *reinterpret_cast<uint32_t*>(base + Smem::p + swizzled(row, col)) = pack2<T>(e0, e1);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + sum[h];
    if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[4 * j] *= alpha[0], o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1], o[4 * j + 3] *= alpha[1];
      }
    }
    fence_async_smem();  // P visible to the wgmma of both consumers
    named_sync(2, kConsumerThreads);

    // O += P V over this consumer's 256 latent columns (4 blocks, N-major B).
    const uint64_t v_desc = n_major(buf + 4 * c * kBlockBytes, kBlockBytes);
    wgmma_fence();
    fence_regs<128>(o);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma<Wgmma64x256<1>, T>(o, desc_add(p_desc, kk * 32), desc_add(v_desc, kk * 16 * 128), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<128>(o);
    if (tid == 0) mbar_arrive(empty + 8 * stage);  // both products are done with this buffer
  }

  // The row sums of both consumers' tokens.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if (q4 == 0) ssum[c * kHeads + r0] = l_run[0], ssum[c * kHeads + r0 + 8] = l_run[1];
  named_sync(1, kConsumerThreads);
  grid_dependents_may_launch();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r0 + 8 * h, head = head0 + row;
    if (head >= p.heads) continue;
    const float l = ssum[row] + ssum[kHeads + row];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse2 = attn::lse2(m_run[h], l);
    const int64_t bh = int64_t(b) * p.heads + head;
    const int col0 = 256 * c + 2 * q4;
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + bh * kMlaDimCkv + col0;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<uint32_t*>(out + 8 * j) = pack2<T>(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      if (p.lse != nullptr && c == 0 && q4 == 0) p.lse[bh] = lse2 * kLn2;
    } else {
      const int64_t sbh = int64_t(split) * p.batch * p.heads + bh;
      float* out = p.partial_o + sbh * kMlaDimCkv + col0;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(out + 8 * j) = make_float2(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
      if (c == 0 && q4 == 0) p.partial_lse[sbh] = lse2;
    }
  }
}

void check(cudaError_t e, const char* what) { check_cuda(e, "mla_decode (sm90a)", what); }

template <typename F>
void with_kernel(int dtype, F&& f) {
  if (dtype == kBF16)
    f(mla_decode_sm90a_kernel<__nv_bfloat16>);
  else
    f(mla_decode_sm90a_kernel<__half>);
}

// Rows a TMA box of the cache covers: the largest power of two <= 64 that divides the page size.
int box_rows(int page_size) { return std::gcd(page_size, kTile); }

}  // namespace

const char* mla_decode_declines(int heads, int page_size) {
  if (heads < kMinHeads)
    return "32 heads or fewer: memory-bound, the portable kernel's 16- and 32-head CTAs read the cache at "
           "full speed where this kernel's 64-row wgmma tiles would do 2x or more of the work";
  if (page_size % 16 != 0) return "page size not a multiple of 16: its TMA boxes need 16-row steps";
  return nullptr;
}

MlaDecodePlan mla_decode_plan(int device, int batch, int heads, int max_pages, int page_size, int config, bool) {
  if (const char* why = mla_decode_declines(heads, page_size))
    throw std::invalid_argument(std::string("mla_decode (sm90a) does not serve this shape: ") + why);
  if (config > 0)
    throw std::invalid_argument("mla_decode (sm90a): configuration " + std::to_string(config) +
                                " does not exist (there is one, 0)");
  if (device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "mla_decode (sm90a)") < Smem::bytes)
    throw std::runtime_error("mla_decode (sm90a): the device's shared memory per block is below " +
                             std::to_string(Smem::bytes) + " bytes");
  MlaDecodePlan plan{};
  plan.config = 0;
  plan.loader = kMlaLoadTma;
  plan.heads_per_cta = kHeads;
  plan.tile_tokens = kTile;
  plan.smem_bytes = Smem::bytes;
  const int sms = device_attribute(device, cudaDevAttrMultiProcessorCount, "mla_decode (sm90a)");
  const int ctas = batch * ((heads + kHeads - 1) / kHeads);
  plan.num_splits = mla_num_splits(sms, ctas, int((int64_t(max_pages) * page_size + kTile - 1) / kTile));
  return plan;
}

void mla_decode_prewarm(int device) {
  const DeviceGuard guard(device, "mla_decode");
  if (device_attribute(device, cudaDevAttrMaxSharedMemoryPerBlockOptin, "mla_decode (sm90a)") >= Smem::bytes)
    for (int dtype : {kBF16, kF16})
      with_kernel(dtype, [](auto kernel) {
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Smem::bytes), "smem attribute");
      });
  encode_tiled("mla_decode");
  mla_combine_prewarm();
}

void mla_decode_launch(const MlaDecodeParams& p, const MlaDecodePlan& plan, int device, uintptr_t stream_handle) {
  if (p.dtype != kBF16 && p.dtype != kF16) throw std::invalid_argument("mla_decode: dtype must be bf16 or fp16");
  if (int64_t(p.num_pages) * p.page_size > INT32_MAX)
    throw std::invalid_argument("mla_decode: the cache has more than 2^31 - 1 token rows (num_pages * page_size)");
  if (mla_decode_declines(p.heads, p.page_size) != nullptr || plan.config != 0 || plan.loader != kMlaLoadTma ||
      plan.num_splits != p.num_splits || p.num_splits < 1 || p.num_splits > kMlaMaxSplits)
    throw std::invalid_argument("mla_decode: the plan does not fit this call (compute it with mla_decode_plan)");
  const DeviceGuard guard(device, "mla_decode");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const int box = box_rows(p.page_size);
  const int64_t rows = int64_t(p.num_pages) * p.page_size, qrows = int64_t(p.batch) * p.heads;
  Maps maps;
  maps.q_nope = tensor_map_2d(p.q_nope, qrows, kMlaDimCkv, 64, kHeads, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  maps.q_pe = tensor_map_2d(p.q_pe, qrows, kMlaDimPe, 64, kHeads, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  maps.ckv = tensor_map_2d(p.ckv, rows, kMlaDimCkv, 64, box, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  maps.kpe = tensor_map_2d(p.kpe, rows, kMlaDimPe, 64, box, CU_TENSOR_MAP_SWIZZLE_128B, "mla_decode");
  const dim3 grid(p.num_splits, (p.heads + kHeads - 1) / kHeads, p.batch);
  with_kernel(p.dtype, [&](auto kernel) { kernel<<<grid, kThreads, Smem::bytes, stream>>>(p, box, maps); });
  check(cudaGetLastError(), "kernel launch");
  if (p.num_splits > 1) mla_combine(p, stream, true);
}

}  // namespace hmoe
