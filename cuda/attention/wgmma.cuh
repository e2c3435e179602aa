// The Hopper (sm_90a) primitives of hmoe's warp-specialised attention kernels: wgmma with both
// operands in shared memory or A in registers, its matrix descriptors for the 128-byte swizzled layout the TMA writes,
// register reallocation and named barriers (mbarriers and TMA loads: attention/mbarrier.cuh). Only
// compiled for sm_90a (the "sm90a" kernel family of arch/gpu.json).
//
// Layout: an operand lives in shared memory as blocks of 64 16-bit columns (128-byte rows), rows
// 128 bytes apart, each 16-byte chunk XOR-swizzled by the row's low 3 bits (the TMA's 128-byte
// swizzle; blocks start on 1024-byte boundaries). Read along its rows (K-major: A = [M, K] and
// B = [N, K] with K the columns), a k16 step is +32 bytes in the row and 8-row groups are 1024
// bytes apart. Read across its rows (B = [K, N] with N the columns, "N-major"), 8-row groups of K
// are 1024 bytes apart and 64-column blocks of N are `block_bytes` apart.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/mbarrier.cuh"

namespace hmoe {
namespace attn {
namespace sm90 {

// A wgmma shared-memory matrix descriptor (128-byte swizzle): start address, the leading byte
// offset (K-major: unused; N-major: between 64-column blocks), the stride byte offset (between
// 8-row groups).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lead_bytes >> 4) & 0x3FFF) << 16 |
         uint64_t((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t(1) << 62;
}
__device__ __forceinline__ uint64_t k_major(uint32_t addr) { return smem_desc(addr, 16, 1024); }
// K-major with the 64-byte swizzle: 32 16-bit columns a row, rows 64 bytes apart, each 16-byte chunk
// XOR-ed with bits 1-2 of the row (swizzled64), 8-row groups 512 bytes apart; 512-byte aligned.
__device__ __forceinline__ uint64_t k_major64(uint32_t addr) {
  return (smem_desc(addr, 16, 512) & ~(uint64_t(3) << 62)) | uint64_t(2) << 62;
}
// The descriptor of addr + bytes from that of addr: the start address field (16-byte units) does
// not carry out of its 14 bits below 256 KB of shared memory. One add, where a descriptor built
// from scratch is a chain of four operations before every wgmma.
__device__ __forceinline__ uint64_t desc_add(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }
__device__ __forceinline__ uint64_t n_major(uint32_t addr, uint32_t block_bytes) {
  return smem_desc(addr, block_bytes, 1024);
}

// Byte offset of 16-bit element (row, col) of a 64-column block in the 128-byte swizzle.
__device__ __forceinline__ uint32_t swizzled(int row, int col) {
  return row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2;
}
// The same for a 32-column block in the 64-byte swizzle (k_major64).
__device__ __forceinline__ uint32_t swizzled64(int row, int col) {
  return row * 64 + ((((col >> 3) ^ (row >> 1)) & 3) << 4) + (col & 7) * 2;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses to accumulator registers across a wgmma's issue or wait.
template <int N>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of a wgmma: "%0, ..., %15", "%16, ..., %31", ... (16 registers a
// piece), and their constraints, d[i] .. d[i + n - 1] read and written.
#define HMOE_ACC_0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define HMOE_ACC_1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define HMOE_ACC_2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define HMOE_ACC_3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define HMOE_ACC_4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define HMOE_ACC_5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define HMOE_ACC_6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define HMOE_ACC_7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define HMOE_ACC32 HMOE_ACC_0 ", " HMOE_ACC_1
#define HMOE_ACC64 HMOE_ACC32 ", " HMOE_ACC_2 ", " HMOE_ACC_3
#define HMOE_ACC128 HMOE_ACC64 ", " HMOE_ACC_4 ", " HMOE_ACC_5 ", " HMOE_ACC_6 ", " HMOE_ACC_7
#define HMOE_D4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define HMOE_D16(i) HMOE_D4(i), HMOE_D4((i) + 4), HMOE_D4((i) + 8), HMOE_D4((i) + 12)
#define HMOE_D32(i) HMOE_D16(i), HMOE_D16((i) + 16)
#define HMOE_D64(i) HMOE_D32(i), HMOE_D32((i) + 32)
#define HMOE_D128 HMOE_D64(0), HMOE_D64(64)
#define HMOE_W4(i) "=f"(d[i]), "=f"(d[(i) + 1]), "=f"(d[(i) + 2]), "=f"(d[(i) + 3])
#define HMOE_W16(i) HMOE_W4(i), HMOE_W4((i) + 4), HMOE_W4((i) + 8), HMOE_W4((i) + 12)

// d (fp32) += A B for 16-bit inputs, both from shared memory (descriptors a, b); scale_d = 0:
// d = A B. SHAPE is the PTX shape, ACC/OUTS its accumulators, AB the operand numbers of a and b,
// SCALE and TRANS those of scale_d and TRANS_B (the enclosing struct's parameter).
#define HMOE_WGMMA_SS(FN, SHAPE, PTX, ACC, OUTS, AB, SCALE, TRANS)                                                   \
  __device__ __forceinline__ static void FN(float* d, uint64_t a, uint64_t b, int scale_d) {                         \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" SCALE                                                        \
                 ", 0;\n"                                                                                            \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX "." PTX " {" ACC "}, " AB ", p, 1, 1, 0, %" TRANS \
                 ";\n}\n"                                                                                            \
                 : OUTS                                                                                              \
                 : "l"(a), "l"(b), "r"(scale_d), "n"(TRANS_B));                                                      \
  }
// The same without scale_d: d = A B, d written only. The compiler then need not keep d's old values
// (nor move them into place), which matters where another wgmma is in flight: ptxas serialises
// every wgmma (C7515) when other instructions define accumulator registers inside a pipeline stage.
#define HMOE_WGMMA_SS0(FN, SHAPE, PTX, ACC, OUTS, AB, TRANS)                                                         \
  __device__ __forceinline__ static void FN(float* d, uint64_t a, uint64_t b) {                                      \
    asm volatile(                                                                                                    \
        "{\n .reg .pred p;\n setp.ne.b32 p, 0, 0;\n"                                                                 \
        "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX "." PTX " {" ACC "}, " AB ", p, 1, 1, 0, %" TRANS ";\n}\n" \
        : OUTS                                                                                                       \
        : "l"(a), "l"(b), "n"(TRANS_B));                                                                             \
  }
// The same with A from registers (a[0..3]: this thread's part of the 64 x 16 A tile, the layout of
// an m16n8k16 mma.sync A fragment per warp); B from shared memory.
#define HMOE_WGMMA_RS(FN, SHAPE, PTX, ACC, OUTS, AB, SCALE, TRANS)                                                \
  __device__ __forceinline__ static void FN(float* d, const uint32_t* a, uint64_t b, int scale_d) {               \
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" SCALE                                                     \
                 ", 0;\n"                                                                                         \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." PTX "." PTX " {" ACC "}, " AB ", p, 1, 1, %" TRANS \
                 ";\n}\n"                                                                                         \
                 : OUTS                                                                                           \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TRANS_B));               \
  }

// One struct per shape and operand source, one member per input type (bf16, f16). TRANS_B = 1: B
// is N-major (its rows run along K); 0: K-major.
template <int TRANS_B>
struct Wgmma64x32 {  // d: 16 registers
  HMOE_WGMMA_SS(bf16, "m64n32k16", "bf16", HMOE_ACC_0, HMOE_D16(0), "%16, %17", "18", "19")
  HMOE_WGMMA_SS(f16, "m64n32k16", "f16", HMOE_ACC_0, HMOE_D16(0), "%16, %17", "18", "19")
  HMOE_WGMMA_SS0(bf16, "m64n32k16", "bf16", HMOE_ACC_0, HMOE_W16(0), "%16, %17", "18")
  HMOE_WGMMA_SS0(f16, "m64n32k16", "f16", HMOE_ACC_0, HMOE_W16(0), "%16, %17", "18")
};
template <int TRANS_B>
struct Wgmma64x128 {  // d: 64 registers
  HMOE_WGMMA_SS(bf16, "m64n128k16", "bf16", HMOE_ACC64, HMOE_D64(0), "%64, %65", "66", "67")
  HMOE_WGMMA_SS(f16, "m64n128k16", "f16", HMOE_ACC64, HMOE_D64(0), "%64, %65", "66", "67")
};
template <int TRANS_B>
struct Wgmma64x256 {  // d: 128 registers
  HMOE_WGMMA_SS(bf16, "m64n256k16", "bf16", HMOE_ACC128, HMOE_D128, "%128, %129", "130", "131")
  HMOE_WGMMA_SS(f16, "m64n256k16", "f16", HMOE_ACC128, HMOE_D128, "%128, %129", "130", "131")
};
template <int TRANS_B>
struct WgmmaRs64x32 {  // d: 16 registers
  HMOE_WGMMA_RS(bf16, "m64n32k16", "bf16", HMOE_ACC_0, HMOE_D16(0), "{%16, %17, %18, %19}, %20", "21", "22")
  HMOE_WGMMA_RS(f16, "m64n32k16", "f16", HMOE_ACC_0, HMOE_D16(0), "{%16, %17, %18, %19}, %20", "21", "22")
};
template <int TRANS_B>
struct WgmmaRs64x64 {  // d: 32 registers
  HMOE_WGMMA_RS(bf16, "m64n64k16", "bf16", HMOE_ACC32, HMOE_D32(0), "{%32, %33, %34, %35}, %36", "37", "38")
  HMOE_WGMMA_RS(f16, "m64n64k16", "f16", HMOE_ACC32, HMOE_D32(0), "{%32, %33, %34, %35}, %36", "37", "38")
};
template <int TRANS_B>
struct WgmmaRs64x128 {  // d: 64 registers
  HMOE_WGMMA_RS(bf16, "m64n128k16", "bf16", HMOE_ACC64, HMOE_D64(0), "{%64, %65, %66, %67}, %68", "69", "70")
  HMOE_WGMMA_RS(f16, "m64n128k16", "f16", HMOE_ACC64, HMOE_D64(0), "{%64, %65, %66, %67}, %68", "69", "70")
};
#undef HMOE_WGMMA_SS
#undef HMOE_WGMMA_SS0
#undef HMOE_WGMMA_RS
#undef HMOE_W16
#undef HMOE_W4
#undef HMOE_D128
#undef HMOE_D64
#undef HMOE_D32
#undef HMOE_D16
#undef HMOE_D4
#undef HMOE_ACC128
#undef HMOE_ACC64
#undef HMOE_ACC32
#undef HMOE_ACC_0
#undef HMOE_ACC_1
#undef HMOE_ACC_2
#undef HMOE_ACC_3
#undef HMOE_ACC_4
#undef HMOE_ACC_5
#undef HMOE_ACC_6
#undef HMOE_ACC_7

// Op::bf16 or Op::f16 (one of the structs above) for the 16-bit input type T: (d, a, b, scale_d), or
// (d, a, b) for d = A B with d written only (the shapes that have it).
template <typename Op, typename T, typename... Args>
__device__ __forceinline__ void wgmma(Args... args) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    Op::bf16(args...);
  else
    Op::f16(args...);
}

// Four 8 x 8 pieces of 16-bit values from registers to shared memory (r[k]: piece k, this lane's two
// values of row lane / 4, columns 2 (lane % 4) and + 1, as an mma accumulator holds them; lane l
// gives the address of row l % 8 of piece l / 8).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// Register reallocation between warpgroups (every thread of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void regs_grow() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_shrink() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// setmaxnreg only moves registers within the CTA's pool, which the launch fixes at the kernel's
// register count a thread: under __launch_bounds__(threads, 1) at most 65536 / threads rounded down
// to a multiple of 8 (168 at 384 threads, what `ptxas -v` reports for both sm90a kernels). An .inc
// waits until other warpgroups' .dec have freed what it asks for, so a split that asks for more than
// the pool hangs the kernel: each kernel checks its split against that count.
constexpr bool regs_split_fits(int threads, int producer_regs, int consumer_warpgroups, int consumer_regs) {
  return 128 * (producer_regs + consumer_warpgroups * consumer_regs) <= threads * (65536 / threads / 8 * 8);
}

// x, which every lane of the warp holds, as the compiler can see it: a broadcast from lane 0. What
// is computed from it (shared-memory addresses, wgmma descriptors, loop counts) then lives in
// uniform registers, not copied there (R2UR) before every wgmma.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: wait for all of them, or
// (named_arrive) count this thread's arrival and go on.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sm90
}  // namespace attn
}  // namespace hmoe
