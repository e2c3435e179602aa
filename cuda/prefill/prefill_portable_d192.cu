// The portable prefill kernels for head dims (192, 128) (MLA's prefill: q/k 192 (128 nope + 64 rope), v 128): both
// dtypes, both KV sources.
#include "prefill/prefill_portable_kernels.cuh"

namespace hmoe {
namespace prefill {

template void portable_kernel_launch<192, 128>(const PrefillParams&, int, bool, cudaStream_t);
template void portable_kernel_prewarm<192, 128>(int);

}  // namespace prefill
}  // namespace hmoe
