// The Hopper (sm_90a) primitives of hmoe's warp-specialised attention kernels: wgmma with both
// operands in shared memory, its matrix descriptors for the 128-byte swizzled layout the TMA writes,
// register reallocation, named barriers, mbarriers and 2-d TMA tensor loads. Only compiled for
// sm_90a (the "sm90a" kernel family of arch/gpu.json).
//
// Layout: an operand lives in shared memory as blocks of 64 16-bit columns (128-byte rows), rows
// 128 bytes apart, each 16-byte chunk XOR-swizzled by the row's low 3 bits (the TMA's 128-byte
// swizzle; blocks start on 1024-byte boundaries). Read along its rows (K-major: A = [M, K] and
// B = [N, K] with K the columns), a k16 step is +32 bytes in the row and 8-row groups are 1024
// bytes apart. Read across its rows (B = [K, N] with N the columns, "N-major"), 8-row groups of K
// are 1024 bytes apart and 64-column blocks of N are `block_bytes` apart.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

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
__device__ __forceinline__ uint64_t n_major(uint32_t addr, uint32_t block_bytes) {
  return smem_desc(addr, block_bytes, 1024);
}

// Byte offset of 16-bit element (row, col) of a 64-column block in the 128-byte swizzle.
__device__ __forceinline__ uint32_t swizzled(int row, int col) {
  return row * 128 + ((((col >> 3) ^ row) & 7) << 4) + (col & 7) * 2;
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

// d (m64n32, fp32, 16 registers) += A B for 16-bit inputs from shared memory; scale_d = 0: d = A B.
// TRANS_B = 1: B is N-major (its rows run along K); 0: K-major. One member per input type (bf16, f16).
#define HMOE_WGMMA_64X32(FN, PTX)                                                                                     \
  __device__ __forceinline__ static void FN(float* d, uint64_t a, uint64_t b, int scale_d) {                          \
    asm volatile(                                                                                                     \
        "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                                                \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX "." PTX                                                     \
        " {"                                                                                                          \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"                                        \
        "}, %16, %17, p, 1, 1, 0, %19;\n}\n"                                                                          \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                    \
        : "l"(a), "l"(b), "r"(scale_d), "n"(TRANS_B));                                                                \
  }
template <int TRANS_B>
struct Wgmma64x32 {
  HMOE_WGMMA_64X32(bf16, "bf16")
  HMOE_WGMMA_64X32(f16, "f16")
};
#undef HMOE_WGMMA_64X32

// d (m64n256, fp32, 128 registers) += A B for 16-bit inputs from shared memory; scale_d = 0: d = A B.
// TRANS_B = 1: B is N-major (its rows run along K); 0: K-major. One member per input type (bf16, f16).
#define HMOE_WGMMA_64X256(FN, PTX)                                                                                     \
  __device__ __forceinline__ static void FN(float* d, uint64_t a, uint64_t b, int scale_d) {                           \
    asm volatile(                                                                                                      \
        "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                                                \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX                                                     \
        " {"                                                                                                           \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                       \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                             \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                             \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                             \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                             \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                             \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                 \
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"               \
        "}, %128, %129, p, 1, 1, 0, %131;\n}\n"                                                                        \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),  \
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),      \
          "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),      \
          "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),      \
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),      \
          "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]),      \
          "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]),      \
          "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]),      \
          "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]),      \
          "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]),      \
          "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), \
          "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),            \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),            \
          "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),            \
          "+f"(d[126]), "+f"(d[127])                                                                                   \
        : "l"(a), "l"(b), "r"(scale_d), "n"(TRANS_B));                                                                 \
  }
template <int TRANS_B>
struct Wgmma64x256 {
  HMOE_WGMMA_64X256(bf16, "bf16")
  HMOE_WGMMA_64X256(f16, "f16")
};
#undef HMOE_WGMMA_64X256

// Register reallocation between warpgroups (every thread of the warpgroup executes it).
template <int N>
__device__ __forceinline__ void regs_grow() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_shrink() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Generic-proxy writes to shared memory visible to the async proxy (wgmma operands, TMA).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` of the mbarrier at `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// A 2-d box of the tensor behind `map` (a __grid_constant__ CUtensorMap) at column x, row y into
// shared memory at `dst`, completing on the mbarrier at `bar`. Rows or columns outside the tensor
// (negative ones too) arrive as zeros and still count their bytes.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

}  // namespace sm90
}  // namespace attn
}  // namespace hmoe
