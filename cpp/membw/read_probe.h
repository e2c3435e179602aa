// A read-only streaming probe of host memory bandwidth: what streaming expert weights can reach
// (a copy also writes and understates it; a torch reduction is bound by its arithmetic on few cores).
#pragma once
#include <cstdint>

namespace hmoe {

// Bytes per second of `threads` threads reading disjoint parts of one `bytes`-byte buffer (touched
// first): the best of `repeats` passes of each of two access patterns (one sequential stream a
// thread; four interleaved streams with a software prefetch, as the experts' kernels read).
double read_bandwidth(int64_t bytes, int threads, int repeats);

}  // namespace hmoe
