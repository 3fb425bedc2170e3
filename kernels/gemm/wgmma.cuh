// Hopper (sm_90a) building blocks the tensor-core GEMMs share: wgmma's shared-memory operand
// descriptors and fences, the async-proxy fence, and the instructions (wgmma_instructions.cuh).
//
// Operand layout in shared memory: K-major rows of 64 bf16 (128 bytes) with the 128-byte swizzle
// (16-byte chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16)), in 8-row groups 1024 bytes apart.
// It is what a TMA load with CU_TENSOR_MAP_SWIZZLE_128B and a 64-wide box writes, and what
// SwizzledOffset gives cp.async.
#pragma once

#include <cstdint>

#include "kernels/gemm/wgmma_instructions.cuh"

namespace duet::kernels::wgmma {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

constexpr int kRowBytes = 128;  // one 64-wide K row of bf16

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in the swizzled layout above.
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return uint32_t(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// Descriptor of a 16-wide K step of an operand: `address` is the 1024-byte aligned start of its
// first 8-row group plus 32 bytes per K step (the swizzle works on the address bits above them).
__device__ __forceinline__ uint64_t MatrixDescriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4)  // start address
         | uint64_t(1) << 16                 // leading byte offset: unused for swizzled K-major
         | uint64_t(1024 >> 4) << 32         // stride byte offset: 8-row groups
         | uint64_t(1) << 62;                // 128-byte swizzle
}

__device__ __forceinline__ void Fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void Commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending of this warpgroup's committed groups are still running.
template <int kPending>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Generic-proxy writes to shared memory (cp.async, st.shared), made visible to the async proxy
// (wgmma's operand reads, TMA).
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

}  // namespace duet::kernels::wgmma
