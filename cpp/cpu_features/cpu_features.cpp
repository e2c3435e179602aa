// CPUID / XGETBV / arch_prctl / getauxval wrappers; see cpu_features.h.
#include "cpu_features/cpu_features.h"

#include <cerrno>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define HMOE_X86 1
#endif
#ifdef __linux__
#include <sys/auxv.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hmoe {

#ifdef HMOE_X86
bool has_cpuid() { return true; }

std::array<uint32_t, 4> cpuid(uint32_t leaf, uint32_t subleaf) {
  std::array<uint32_t, 4> r{0, 0, 0, 0};
  uint32_t max_leaf = __get_cpuid_max(leaf & 0x80000000u, nullptr);
  if (max_leaf < leaf) return r;
  __cpuid_count(leaf, subleaf, r[0], r[1], r[2], r[3]);
  return r;
}

uint64_t xcr0() {
  auto l1 = cpuid(1, 0);
  if (!(l1[2] & (1u << 27))) return 0;  // OSXSAVE off: XGETBV would fault
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}
#else
bool has_cpuid() { return false; }
std::array<uint32_t, 4> cpuid(uint32_t, uint32_t) { return {0, 0, 0, 0}; }
uint64_t xcr0() { return 0; }
#endif

std::string request_amx_permission() {
#if defined(HMOE_X86) && defined(__linux__)
  constexpr int kArchGetXcompPerm = 0x1022;
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    int e = errno;
    return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM) failed: ") + std::strerror(e) +
           (e == EINVAL ? " (kernel older than 5.16 or no AMX support)" : "");
  }
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) {
    return std::string("arch_prctl(ARCH_GET_XCOMP_PERM) failed: ") + std::strerror(errno);
  }
  if (!(bitmask & (1ul << kXfeatureXtiledata))) return "the kernel did not grant XTILEDATA";
  return "granted";
#else
  return "AMX exists only on x86-64 Linux";
#endif
}

std::array<uint64_t, 2> hwcap() {
#ifdef __linux__
  return {uint64_t(getauxval(AT_HWCAP)), uint64_t(getauxval(AT_HWCAP2))};
#else
  return {0, 0};
#endif
}

}  // namespace hmoe
