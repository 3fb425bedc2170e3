#include "kernels/elementwise/rope.h"

#include <cmath>

#include "kernels/cuda_check.h"
#include "kernels/elementwise/elementwise_common.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using namespace elementwise_detail;
using launch_detail::LaunchKernel;

constexpr int kMaxThreads = 256;

// kVec bf16 elements (8: 16 bytes, or 4: 8 bytes) moved as one vector.
template <int kVec>
struct Bf16Vec;
template <>
struct Bf16Vec<8> {
  using Storage = uint4;
};
template <>
struct Bf16Vec<4> {
  using Storage = uint2;
};

template <int kVec>
__device__ __forceinline__ void LoadBf16(const __nv_bfloat16* src, float (&out)[kVec]) {
  const typename Bf16Vec<kVec>::Storage packed = *reinterpret_cast<const typename Bf16Vec<kVec>::Storage*>(src);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
template <int kVec>
__device__ __forceinline__ void StoreBf16(__nv_bfloat16* dst, const float (&in)[kVec]) {
  typename Bf16Vec<kVec>::Storage packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<typename Bf16Vec<kVec>::Storage*>(dst) = packed;
}

// One CTA per token. Work items: first the rotations (one per (q or k head, kVec pairs)), then
// the v copies (one per (kv head, 8 elements)); k and v items exist only when the token has a slot.
template <int kVec>
__global__ void __launch_bounds__(kMaxThreads) RopeKvWriteKernel(RopeKvWriteParams p) {
  launch_detail::EnterDependentKernel();
  const int token = blockIdx.x;
  const int head_dim = p.kv.head_dim, half = head_dim / 2, num_kv_heads = p.kv.num_kv_heads;
  const int slot = p.slot_mapping[token];
  const bool write_kv = slot >= 0;
  const float2* rope = p.rope_table + int64_t(p.positions[token]) * half;  // [half]
  const __nv_bfloat16* qkv = p.qkv + int64_t(token) * (p.num_q_heads + 2 * num_kv_heads) * head_dim;

  const int vecs_per_half = half / kVec;
  const int rotated_heads = p.num_q_heads + (write_kv ? num_kv_heads : 0);
  const int rope_items = rotated_heads * vecs_per_half;
  const int v_chunks_per_head = head_dim / 8;
  const int items = rope_items + (write_kv ? num_kv_heads * v_chunks_per_head : 0);

  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    if (item < rope_items) {
      const int head = item / vecs_per_half;  // q heads, then k heads
      const int i0 = (item % vecs_per_half) * kVec;
      const __nv_bfloat16* x = qkv + head * head_dim;
      float x1[kVec], x2[kVec], cs[2 * kVec];
      LoadBf16<kVec>(x + i0, x1);
      LoadBf16<kVec>(x + half + i0, x2);
      const float4* table = reinterpret_cast<const float4*>(rope + i0);  // kVec (cos, sin) pairs
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const float4 t = table[j];
        cs[4 * j] = t.x, cs[4 * j + 1] = t.y, cs[4 * j + 2] = t.z, cs[4 * j + 3] = t.w;
      }
      float y1[kVec], y2[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float c = cs[2 * j], s = cs[2 * j + 1];
        y1[j] = x1[j] * c - x2[j] * s;
        y2[j] = x2[j] * c + x1[j] * s;
      }
      __nv_bfloat16* dst = head < p.num_q_heads
                               ? p.q_out + (int64_t(token) * p.num_q_heads + head) * head_dim
                               : p.kv.k + p.kv.RowOffset(slot, head - p.num_q_heads);
      StoreBf16<kVec>(dst + i0, y1);
      StoreBf16<kVec>(dst + half + i0, y2);
    } else {
      const int v_item = item - rope_items;
      const int kv_head = v_item / v_chunks_per_head;
      const int e0 = (v_item % v_chunks_per_head) * 8;
      const uint4 v = *reinterpret_cast<const uint4*>(qkv + (p.num_q_heads + num_kv_heads + kv_head) * head_dim + e0);
      *reinterpret_cast<uint4*>(p.kv.v + p.kv.RowOffset(slot, kv_head) + e0) = v;
    }
  }
}

}  // namespace

void RopeAndWriteKv(const RopeKvWriteParams& p, cudaStream_t stream) {
  const PagedKvView& kv = p.kv;
  DUET_KERNEL_CHECK(p.num_tokens >= 0 && p.num_q_heads > 0 && kv.num_kv_heads > 0 && kv.block_size > 0);
  DUET_KERNEL_CHECK(kv.head_dim > 0 && kv.head_dim % 8 == 0);
  DUET_KERNEL_CHECK(p.qkv != nullptr && p.positions != nullptr && p.slot_mapping != nullptr &&
                    p.rope_table != nullptr && p.q_out != nullptr && kv.k != nullptr && kv.v != nullptr);
  DUET_KERNEL_CHECK(IsAligned(p.qkv, 16) && IsAligned(p.rope_table, 16) && IsAligned(p.q_out, 16) &&
                    IsAligned(kv.k, 16) && IsAligned(kv.v, 16));
  if (p.num_tokens == 0) return;
  const int half = kv.head_dim / 2;
  const int vec = half % 8 == 0 ? 8 : 4;  // head_dim % 8 == 0 makes half a multiple of 4
  const int max_items = (p.num_q_heads + kv.num_kv_heads) * (half / vec) + kv.num_kv_heads * (kv.head_dim / 8);
  const int threads = RoundUp(max_items < kMaxThreads ? max_items : kMaxThreads, kWarpSize);
  if (vec == 8) {
    LaunchKernel(RopeKvWriteKernel<8>, dim3(p.num_tokens), dim3(threads), 0, stream, p);
  } else {
    LaunchKernel(RopeKvWriteKernel<4>, dim3(p.num_tokens), dim3(threads), 0, stream, p);
  }
  DUET_CUDA_CHECK(cudaGetLastError());
}

std::vector<float2> BuildRopeTable(const std::vector<float>& inv_freq, int max_positions) {
  DUET_KERNEL_CHECK(max_positions >= 0);
  const size_t pairs = inv_freq.size();
  std::vector<float2> table(size_t(max_positions) * pairs);
  for (int pos = 0; pos < max_positions; ++pos) {
    for (size_t i = 0; i < pairs; ++i) {
      const float angle = float(pos) * inv_freq[i];  // fp32 product, as HF computes the angle
      table[size_t(pos) * pairs + i] = make_float2(float(std::cos(double(angle))), float(std::sin(double(angle))));
    }
  }
  return table;
}

}  // namespace duet::kernels
