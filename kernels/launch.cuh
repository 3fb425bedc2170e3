// Kernel launches with programmatic dependent launch (PDL, sm_90+).
//
// A kernel launched through LaunchKernel may start while the kernel before it on the stream is
// still running: its CTAs get resident as soon as every CTA of the previous kernel has called
// LetDependentsLaunch() (or exited), so the launch latency and the ramp-up overlap the previous
// kernel's tail. The contract every such kernel keeps, in every CTA and on every path (early exits
// included):
//   - before WaitForPriorKernels() it reads only what no kernel of the step writes (weights, and
//     step metadata that was copied in before the step's first kernel) and writes nothing;
//   - it calls WaitForPriorKernels() before anything else, and before it exits: that returns once
//     the previous kernel has completed and its writes are visible. Since every kernel waits before
//     it finishes, "previous kernel complete" implies every earlier kernel is complete too.
// On a stream whose previous operation is not such a kernel (a copy, cuBLAS, a graph boundary),
// or with PDL switched off (SetProgrammaticLaunch), the launch is an ordinary serialized one and
// the wait returns at once.
#pragma once

#include <utility>

#include <cuda_runtime.h>

#include "kernels/cuda_check.h"
#include "kernels/launch.h"

namespace duet::kernels::launch_detail {

// Blocks until the previous kernel on the stream has completed and its memory is visible.
__device__ __forceinline__ void WaitForPriorKernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel on the stream start launching its CTAs (they still wait for this one to
// complete before they read what it writes).
__device__ __forceinline__ void LetDependentsLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Both, in the order every kernel without a pre-wait prologue uses.
__device__ __forceinline__ void EnterDependentKernel() {
  WaitForPriorKernels();
  LetDependentsLaunch();
}

template <typename... KernelArgs, typename... Args>
void LaunchKernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                  Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = ProgrammaticLaunchEnabled() ? 1 : 0;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  DUET_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Clusters of `cluster` CTAs of `kernel` (its shared-memory limit already raised to `smem_bytes`)
// that the current device runs at once. A cluster's CTAs must share a GPC, so this can be fewer
// than the SMs divided by the cluster size.
inline int MaxActiveClusters(const void* kernel, dim3 cluster, int threads, int smem_bytes) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim = {cluster.x, cluster.y, cluster.z};
  cudaLaunchConfig_t config{};
  config.gridDim = cluster;
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.attrs = &attribute;
  config.numAttrs = 1;
  int clusters = 0;
  DUET_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config));
  return clusters;
}

}  // namespace duet::kernels::launch_detail
