"""Hardware facts: CPU features (CPUID/XCR0/AMX permission) and, later, GPUs through NVML."""
