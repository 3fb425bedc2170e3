// Pseudo-random bf16 data on the device: what benchmarks and the load-time GEMM tuning multiply
// instead of zeros or a constant. A tensor core's power draw depends on the bits it multiplies;
// on zeros or a repeated value an H100/H200 stays below its power cap and runs products faster
// than it does on a model's activations.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

// data[i] = uniform in [-scale, scale), a hash of (i, seed): the same seed gives the same values.
void FillRandomBf16(__nv_bfloat16* data, size_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace duet::kernels
