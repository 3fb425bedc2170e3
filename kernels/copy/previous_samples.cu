#include "kernels/copy/previous_samples.h"

#include "kernels/cuda_check.h"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    ResolvePreviousStepSamplesKernel(int32_t* __restrict__ tokens, int num_tokens, const int32_t* __restrict__ samples) {
  launch_detail::EnterDependentKernel();
  for (int i = int(blockIdx.x * blockDim.x + threadIdx.x); i < num_tokens; i += int(gridDim.x * blockDim.x)) {
    const int32_t t = tokens[i];
    if (t < 0) tokens[i] = samples[-1 - t];
  }
}

}  // namespace

void ResolvePreviousStepSamples(int32_t* tokens, int num_tokens, const int32_t* samples, cudaStream_t stream) {
  DUET_KERNEL_CHECK(num_tokens >= 0 && tokens != nullptr && samples != nullptr);
  if (num_tokens == 0) return;
  const int blocks = (num_tokens + kThreads - 1) / kThreads;
  launch_detail::LaunchKernel(ResolvePreviousStepSamplesKernel, dim3(unsigned(blocks)), dim3(kThreads), 0, stream,
                              tokens, num_tokens, samples);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
