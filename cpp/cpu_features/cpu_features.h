// Raw CPU feature primitives (CPUID, XCR0, AMX permission, auxv), compiled for the baseline ISA.
// Python (hmoe/hardware/cpu.py) interprets them against arch/cpu.json.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace hmoe {

bool has_cpuid();
// {eax, ebx, ecx, edx}; zeros where CPUID or the leaf is not available.
std::array<uint32_t, 4> cpuid(uint32_t leaf, uint32_t subleaf);
// XCR0 when the OS enabled XSAVE (CPUID.1:ECX.OSXSAVE), else 0. Never faults.
uint64_t xcr0();
// Asks Linux for permission to use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM).
// Returns "granted", or a reason it was not.
std::string request_amx_permission();
// {AT_HWCAP, AT_HWCAP2} on Linux, zeros elsewhere.
std::array<uint64_t, 2> hwcap();

}  // namespace hmoe
