// The portable prefill kernels for head dims (128, 128) (128-dim heads): both dtypes, both KV sources.
#include "prefill/prefill_portable_kernels.cuh"

namespace hmoe {
namespace prefill {

template void portable_kernel_launch<128, 128>(const PrefillParams&, int, bool, cudaStream_t);
template void portable_kernel_prewarm<128, 128>(int);

}  // namespace prefill
}  // namespace hmoe
