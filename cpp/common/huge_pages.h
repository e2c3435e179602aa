// Advice that a buffer be backed by 2 MiB pages where the kernel allows it (transparent huge pages
// in "madvise" or "always" mode): a stream over tens of megabytes then takes a page walk every
// 2 MiB instead of every 4 KiB (on a virtual machine a two-level walk). Given before the memory is
// first touched; only advice, so a kernel that refuses changes nothing.
#pragma once
#include <sys/mman.h>

#include <cstdint>

namespace hmoe {

inline void advise_huge_pages(void* p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace hmoe
