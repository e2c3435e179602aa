// Per-call buffers of the experts op from a grow-only arena kept per calling thread: a call reuses
// the memory (and the pages already faulted in) of its thread's previous calls instead of
// allocating and first-touching tens of megabytes every time (a V3 prefill's activations).
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/huge_pages.h"

namespace hmoe {

class Workspace {
 public:
  // The calling thread's arena, opened for one call of the op (closed when the Call goes away).
  class Call {
   public:
    Call() : w_(mine()) { w_.begin(); }
    ~Call() { w_.end(); }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    // n elements of T, 64-byte aligned, uninitialised; valid until the Call ends.
    template <class T>
    T* take(int64_t n) {
      return reinterpret_cast<T*>(w_.take_bytes(std::max<int64_t>(n, 1) * int64_t(sizeof(T))));
    }

   private:
    Workspace& w_;
  };

 private:
  // Memory kept between calls at most; a larger arena (a long prefill) is freed after its call.
  static constexpr int64_t kKeepBytes = int64_t(1) << 30;
  struct Block {
    std::unique_ptr<char[]> mem;
    int64_t size = 0;
  };

  static Workspace& mine() {
    thread_local Workspace w;
    return w;
  }
  // A new call: what earlier calls took is free again; several blocks become one of their size.
  void begin() {
    used_ = 0, block_ = 0;
    if (blocks_.size() > 1) {
      int64_t total = 0;
      for (const Block& b : blocks_) total += b.size;
      blocks_.clear();
      add(total);
    }
  }
  void end() {
    int64_t total = 0;
    for (const Block& b : blocks_) total += b.size;
    if (total > kKeepBytes) blocks_.clear();
  }
  char* take_bytes(int64_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    while (block_ < blocks_.size() && used_ + bytes > blocks_[block_].size) ++block_, used_ = 0;
    if (block_ == blocks_.size()) add(std::max(bytes, blocks_.empty() ? int64_t(64) << 20 : 2 * blocks_.back().size));
    char* p = aligned(blocks_[block_]) + used_;
    used_ += bytes;
    return p;
  }
  void add(int64_t size) {
    Block b;
    b.mem.reset(new char[size_t(size + 64)]);
    b.size = size;
    advise_huge_pages(b.mem.get(), size);
    blocks_.push_back(std::move(b));
  }
  static char* aligned(const Block& b) {
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b.mem.get()) + 63) & ~uintptr_t(63));
  }

  std::vector<Block> blocks_;
  size_t block_ = 0;  // the block taken from now
  int64_t used_ = 0;  // bytes of it taken
};

}  // namespace hmoe
