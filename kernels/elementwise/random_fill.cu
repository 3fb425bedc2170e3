#include "kernels/elementwise/random_fill.h"

#include "kernels/cuda_check.h"

namespace duet::kernels {
namespace {

// SplitMix64 of (i, seed); its top 24 bits as a fraction.
__global__ void FillRandomBf16Kernel(__nv_bfloat16* data, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    data[i] = __float2bfloat16((float(z >> 40) / float(1 << 24) * 2.f - 1.f) * scale);
  }
}

}  // namespace

void FillRandomBf16(__nv_bfloat16* data, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  DUET_KERNEL_CHECK(data != nullptr && scale >= 0.f);
  FillRandomBf16Kernel<<<1024, 256, 0, stream>>>(data, n, seed, scale);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
