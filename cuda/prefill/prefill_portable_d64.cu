// The portable prefill kernels for head dims (64, 64) (64-dim heads): both dtypes, both KV sources.
#include "prefill/prefill_portable_kernels.cuh"

namespace hmoe {
namespace prefill {

template void portable_kernel_launch<64, 64>(const PrefillParams&, int, bool, cudaStream_t);
template void portable_kernel_prewarm<64, 64>(int);

}  // namespace prefill
}  // namespace hmoe
