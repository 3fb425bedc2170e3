// Device helpers shared by the elementwise and sampling kernels: launcher checks, 16-byte bf16
// vector conversion and block-wide reductions/scans built from warp shuffles.
#pragma once

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda_check.h"


namespace duet::kernels::elementwise_detail {

constexpr int kWarpSize = 32;

inline bool IsAligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
inline int RoundUp(int x, int to) { return (x + to - 1) / to * to; }

// 8 bf16 packed in 16 bytes <-> 8 floats.
__device__ __forceinline__ void Bf16x8ToFloat(const uint4& packed, float (&out)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ uint4 FloatToBf16x8(const float (&in)[8]) {
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return packed;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ int WarpSum(int v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// `scratch` holds 33 values; the leading __syncthreads makes back-to-back calls safe.
template <typename T>
__device__ T BlockSum(T v, T* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < num_warps ? scratch[lane] : T(0);
    w = WarpSum(w);
    if (lane == 0) scratch[kWarpSize] = w;
  }
  __syncthreads();
  return scratch[kWarpSize];
}

__device__ __forceinline__ int WarpMax(int v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Maximum over the block, returned to every thread; same contract as BlockSum.
__device__ __forceinline__ int BlockMax(int v, int* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = lane < num_warps ? scratch[lane] : INT_MIN;
    w = WarpMax(w);
    if (lane == 0) scratch[kWarpSize] = w;
  }
  __syncthreads();
  return scratch[kWarpSize];
}

// Exclusive prefix sum over threads in threadIdx.x order; *total gets the block's sum.
// `scratch` holds 32 values. Same call-safety as BlockSum.
template <typename T>
__device__ T BlockExclusiveScan(T v, T* scratch, T* total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  T inclusive = v;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  T exclusive_in_warp = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive_in_warp = T(0);
  __syncthreads();
  if (lane == kWarpSize - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    T w = lane < num_warps ? scratch[lane] : T(0);
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
      const T up = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w += up;
    }
    scratch[lane] = w;  // inclusive sum of warp totals; every lane read before any lane writes (shfl syncs)
  }
  __syncthreads();
  *total = scratch[num_warps - 1];
  return (warp > 0 ? scratch[warp - 1] : T(0)) + exclusive_in_warp;
}

}  // namespace duet::kernels::elementwise_detail
