// Host side of the TMA: tensor maps for 2-d tensors of 16-bit elements (read in 2-d boxes, or in
// boxes of several column blocks side by side), encoded through the driver's cuTensorMapEncodeTiled reached
// through the runtime (hmoe links no libcuda), resolved once.
#pragma once
#include <cuda.h>  // CUtensorMap and the encode function's types (no driver symbol is linked)
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/cuda_util.h"

namespace hmoe {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled; `op` names the caller in errors. Call it once outside graph
// capture (prewarm) before the first launch that needs it.
inline EncodeTiled encode_tiled(const char* op) {
  static const EncodeTiled fn = [op] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found), op,
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess || f == nullptr)
      throw std::runtime_error(std::string(op) + ": the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// Encoded maps (tensor_map_2d, tensor_map_blocks below) are kept per thread, keyed by all that an
// encoding takes (a map holds nothing else), so that a call whose tensors sit where an earlier call's
// did with the same shape and box (a layer's KV cache, a query buffer the allocator hands out again)
// reuses its map: cuTensorMapEncodeTiled costs the H200 machines' host 91-96 ns a map
// (docs/perf/mla_decode.md), and a call encodes four or five. Direct-mapped, kTensorMapCache entries a
// thread.
constexpr int kTensorMapCache = 256;

struct TensorMapKey {
  const void* base = nullptr;
  int64_t rows = 0, cols = 0;
  int box_cols = 0, box_rows = 0, swizzle = -1;
  int box_blocks = 0;  // 0: a 2-d map; else tensor_map_blocks's 3-d map, box_blocks blocks a box
  bool operator==(const TensorMapKey& o) const {
    return base == o.base && rows == o.rows && cols == o.cols && box_cols == o.box_cols && box_rows == o.box_rows &&
           swizzle == o.swizzle && box_blocks == o.box_blocks;
  }
  int slot() const {
    uint64_t h = uint64_t(reinterpret_cast<uintptr_t>(base)) ^ (uint64_t(rows) << 17) ^ (uint64_t(cols) << 41) ^
                 (uint64_t(box_cols) << 3) ^ (uint64_t(box_rows) << 9) ^ uint64_t(swizzle) ^
                 (uint64_t(box_blocks) << 15);
    h *= 0x9E3779B97F4A7C15ull;
    static_assert(kTensorMapCache == 256, "the slot is the hash's top 8 bits");
    return int(h >> 56);
  }
};

// The map `key` describes, from this thread's cache or encoded (and cached).
inline CUtensorMap cached_tensor_map(const TensorMapKey& key, const char* op) {
  struct Entry {
    TensorMapKey key;
    CUtensorMap map;
  };
  thread_local Entry cache[kTensorMapCache];
  Entry& e = cache[key.slot()];
  if (e.key == key) return e.map;
  // blocks: dims (box_cols, rows, cols / box_cols), strides cols and box_cols elements; else (cols, rows).
  const bool blocks = key.box_blocks > 0;
  const int64_t nblocks = blocks ? key.cols / key.box_cols : 1;
  const cuuint64_t dims[3] = {cuuint64_t(blocks ? key.box_cols : key.cols), cuuint64_t(key.rows), cuuint64_t(nblocks)};
  const cuuint64_t strides[2] = {cuuint64_t(key.cols) * 2, cuuint64_t(key.box_cols) * 2};
  const cuuint32_t box[3] = {cuuint32_t(key.box_cols), cuuint32_t(key.box_rows),
                             cuuint32_t(blocks ? key.box_blocks : 1)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult r =
      encode_tiled(op)(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, blocks ? 3 : 2, const_cast<void*>(key.base), dims, strides,
                       box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CUtensorMapSwizzle(key.swizzle),
                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string(op) + ": cuTensorMapEncodeTiled failed (CUresult " + std::to_string(int(r)) +
                             ")");
  e.key = key, e.map = map;
  return map;
}

// A [rows, cols] row-major tensor of 16-bit elements at `base`, read in boxes of box_cols x box_rows.
inline CUtensorMap tensor_map_2d(const void* base, int64_t rows, int64_t cols, int box_cols, int box_rows,
                                 CUtensorMapSwizzle swizzle, const char* op) {
  return cached_tensor_map({base, rows, cols, box_cols, box_rows, int(swizzle), 0}, op);
}

// The same tensor seen as blocks of box_cols columns (cols a multiple of box_cols), read in boxes of
// box_rows rows and box_blocks blocks (0: the whole width): one 3-d box (tma_load_3d at (0, row,
// first block)) lands as the box_blocks 2-d boxes of box_cols x box_rows at those blocks' columns
// would, one after another (the same swizzle), in one copy instead of box_blocks.
inline CUtensorMap tensor_map_blocks(const void* base, int64_t rows, int64_t cols, int box_cols, int box_rows,
                                     CUtensorMapSwizzle swizzle, const char* op, int box_blocks = 0) {
  if (box_cols <= 0 || cols % box_cols != 0 || box_blocks < 0 || box_blocks > cols / box_cols)
    throw std::invalid_argument(std::string(op) + ": a blocked tensor map's width must be a multiple of its box's" +
                                " columns, and a box at most the width's blocks");
  return cached_tensor_map(
      {base, rows, cols, box_cols, box_rows, int(swizzle), box_blocks ? box_blocks : int(cols / box_cols)}, op);
}

}  // namespace hmoe
