// The online-softmax rules of hmoe's attention kernels (decode and prefill), fp32 in the log2
// domain: scores are scaled by sm_scale * log2(e), p = 2^(s - m) for a running max m, l = sum p,
// and a row's lse is m + log2(l) (natural log: times ln 2). A kernel keeps m and l per row as it
// walks the key tiles; these are the decisions every kernel makes the same way.
#pragma once
#include <cuda_runtime.h>

namespace hmoe {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// The running max moves only when a score exceeds it by more than 2^kLazy: p then stays at most
// 2^kLazy (exact in fp32 and in the 16-bit P), and on most tiles the rescale factor is exactly 1,
// so a kernel can skip rescaling its accumulators.
constexpr float kLazy = 8.f;
constexpr float kLazyP = float(1 << int(kLazy));  // 2^kLazy: the largest p

// 2^x on the SFU, subnormal results flushed to zero (exp2f adds a rescale for them: 3 more
// instructions a call). The p are at most 2^kLazy and the sum they feed holds a 1 for the
// running max, so a p below 2^-126 is noise however it rounds.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Whether a tile whose largest score is `mx` moves the running max `m` (see kLazy; m = -inf:
// nothing seen yet).
__device__ __forceinline__ bool max_moves(float m, float mx) { return mx > m + kLazy || m == -INFINITY; }

// The new running max after a tile whose largest score is `mx` (reduced over the row): mx when it
// moves, else m; 0 while every score so far was masked (p = 0 then, whatever m is).
__device__ __forceinline__ float next_max(float m, float mx) { return mx > m + kLazy ? mx : m == -INFINITY ? 0.f : m; }

// The factor the row's accumulators and l take when the max goes from m_old to m_new.
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return m_old == m_new ? 1.f : m_old == -INFINITY ? 0.f : exp2_ftz(m_old - m_new);
}

// log2-domain lse of a row (-inf for a row that saw no key).
__device__ __forceinline__ float lse2(float m, float l) { return l > 0.f ? m + log2f(l) : -INFINITY; }

}  // namespace attn
}  // namespace hmoe
