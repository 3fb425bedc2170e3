#include "kernels/gemm/gemv.h"

#include <atomic>
#include <cstdint>

#include "kernels/cuda_check.h"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using launch_detail::LaunchKernel;
using launch_detail::LetDependentsLaunch;
using launch_detail::WaitForPriorKernels;

constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 4;  // 16-byte weight loads per lane in one group; two groups in flight

__device__ __forceinline__ void Accumulate(const uint4& w, const uint4& xv, float& acc) {
  const auto* wh = reinterpret_cast<const __nv_bfloat162*>(&w);
  const auto* xh = reinterpret_cast<const __nv_bfloat162*>(&xv);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = __bfloat1622float2(wh[k]), b = __bfloat1622float2(xh[k]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
}

__device__ __forceinline__ void LoadGroup(const uint4* w, int c, uint4 (&group)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) group[u] = __ldcs(w + c + 32 * u);  // streamed once: don't keep in L2
}

constexpr int kPairsPerBlock = kWarpsPerBlock / 2;

std::atomic<int> early_groups{2};

// The two features of pair `pair` (0..3) of CTA `block` for the paired epilogues: kSiluMul pairs
// gate feature j with up feature out/2 + j; kRopeKvWrite pairs feature i of a head with feature
// i + head_dim/2 of the same head.
template <GemvEpilogue kEpilogue>
__device__ __forceinline__ int2 PairFeatures(int block, int pair, int out, int head_dim) {
  if constexpr (kEpilogue == GemvEpilogue::kSiluMul) {
    const int j = block * kPairsPerBlock + pair;
    return make_int2(j, out / 2 + j);
  } else {
    const int half = head_dim / 2, blocks_per_head = half / kPairsPerBlock;
    const int i = block % blocks_per_head * kPairsPerBlock + pair;
    const int first = block / blocks_per_head * head_dim;
    return make_int2(first + i, first + half + i);
  }
}

// One warp per output feature `o`; lanes stride over `in` in 16-byte chunks. kNone: CTA b
// computes features [8b, 8b + 8). Paired epilogues: warps 0-3 compute the first feature of
// pairs 0-3 (PairFeatures), warps 4-7 the second, and 4 * kRows threads write the results. Each warp keeps two weight groups in flight; kEarlyGroups of them are issued before the
// wait for the previous kernel.
template <int kRows, bool kFp32Out, GemvEpilogue kEpilogue, int kEarlyGroups>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) GemvKernel(const __nv_bfloat16* __restrict__ x,
                                                                 const __nv_bfloat16* __restrict__ weight,
                                                                 void* __restrict__ y, int in, int out,
                                                                 const GemvRopeKvWrite rope) {
  static_assert(kEarlyGroups == 1 || kEarlyGroups == 2);
  constexpr int kGroupStride = 32 * kUnroll;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int o;
  if constexpr (kEpilogue == GemvEpilogue::kNone) {
    o = blockIdx.x * kWarpsPerBlock + warp;
  } else {
    const int2 pair = PairFeatures<kEpilogue>(blockIdx.x, warp % kPairsPerBlock, out, rope.kv.head_dim);
    o = warp < kPairsPerBlock ? pair.x : pair.y;
  }
  const bool active = o < out;
  const int chunks = in / 8;
  const uint4* w = reinterpret_cast<const uint4*>(weight + size_t(active ? o : 0) * in);
  const uint4* xs = reinterpret_cast<const uint4*>(x);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;

  // The early weight groups do not depend on the previous kernel: they are in flight while that
  // kernel finishes (x is read only after the wait).
  int c = lane;
  bool have_group = active && c + 32 * (kUnroll - 1) < chunks;
  bool have_next = have_group && c + kGroupStride + 32 * (kUnroll - 1) < chunks;
  uint4 group[kUnroll], next[kUnroll];
  if (have_group) LoadGroup(w, c, group);
  if (kEarlyGroups == 2 && have_next) LoadGroup(w, c + kGroupStride, next);
  WaitForPriorKernels();
  LetDependentsLaunch();
  if (kEarlyGroups == 1 && have_next) LoadGroup(w, c + kGroupStride, next);

  // Invariant at the top: `group` holds chunks from c, `next` (when have_next) from c + stride.
  while (have_group) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) Accumulate(group[u], __ldg(xs + size_t(r) * chunks + c + 32 * u), acc[r]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) group[u] = next[u];
    c += kGroupStride;
    have_group = have_next;
    have_next = have_group && c + kGroupStride + 32 * (kUnroll - 1) < chunks;
    if (have_next) LoadGroup(w, c + kGroupStride, next);
  }
  if (active) {
    for (; c < chunks; c += 32) {
      const uint4 wv = __ldcs(w + c);
#pragma unroll
      for (int r = 0; r < kRows; ++r) Accumulate(wv, __ldg(xs + size_t(r) * chunks + c), acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
  }

  if constexpr (kEpilogue != GemvEpilogue::kNone) {
    // bf16-rounded projections (as the unfused kernels read them): first features of the pairs
    // (warps 0-3), then second features (warps 4-7).
    __shared__ float z[kWarpsPerBlock][kRows];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) z[warp][r] = __bfloat162float(__float2bfloat16(acc[r]));
    }
    __syncthreads();
    if (threadIdx.x < kPairsPerBlock * kRows) {
      const int pair = threadIdx.x % kPairsPerBlock, r = threadIdx.x / kPairsPerBlock;
      const float first = z[pair][r], second = z[kPairsPerBlock + pair][r];
      const int2 features = PairFeatures<kEpilogue>(blockIdx.x, pair, out, rope.kv.head_dim);
      if constexpr (kEpilogue == GemvEpilogue::kSiluMul) {
        static_cast<__nv_bfloat16*>(y)[size_t(r) * (out / 2) + features.x] =
            __float2bfloat16(first / (1.f + __expf(-first)) * second);
      } else {
        const PagedKvView& kv = rope.kv;
        const int head = features.x / kv.head_dim, i = features.x % kv.head_dim, half = kv.head_dim / 2;
        const int slot = rope.slot_mapping[r];
        __nv_bfloat16* dst = nullptr;
        bool rotate = true;
        if (head < rope.num_q_heads) {
          dst = rope.q_out + (int64_t(r) * rope.num_q_heads + head) * kv.head_dim;
        } else if (slot >= 0 && head < rope.num_q_heads + kv.num_kv_heads) {
          dst = kv.k + kv.RowOffset(slot, head - rope.num_q_heads);
        } else if (slot >= 0) {
          dst = kv.v + kv.RowOffset(slot, head - rope.num_q_heads - kv.num_kv_heads);
          rotate = false;
        }
        if (dst != nullptr) {
          float y1 = first, y2 = second;
          if (rotate) {
            const float2 cs = rope.rope_table[int64_t(rope.positions[r]) * half + i];
            y1 = first * cs.x - second * cs.y;
            y2 = second * cs.x + first * cs.y;
          }
          dst[i] = __float2bfloat16(y1);
          dst[i + half] = __float2bfloat16(y2);
        }
      }
    }
  } else if (active && lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if constexpr (kFp32Out) {
        static_cast<float*>(y)[size_t(r) * out + o] = acc[r];
      } else {
        static_cast<__nv_bfloat16*>(y)[size_t(r) * out + o] = __float2bfloat16(acc[r]);
      }
    }
  }
}

template <int kRows, int kEarlyGroups>
void LaunchWith(const GemvParams& p, cudaStream_t stream) {
  const dim3 block(kWarpsPerBlock * 32), grid((p.out + kWarpsPerBlock - 1) / kWarpsPerBlock);
  auto launch = [&](auto kernel) { LaunchKernel(kernel, grid, block, 0, stream, p.x, p.weight, p.y, p.in, p.out, p.rope); };
  switch (p.epilogue) {
    case GemvEpilogue::kSiluMul: launch(GemvKernel<kRows, false, GemvEpilogue::kSiluMul, kEarlyGroups>); return;
    case GemvEpilogue::kRopeKvWrite: launch(GemvKernel<kRows, false, GemvEpilogue::kRopeKvWrite, kEarlyGroups>); return;
    case GemvEpilogue::kNone: break;
  }
  if (p.y_fp32) {
    launch(GemvKernel<kRows, true, GemvEpilogue::kNone, kEarlyGroups>);
  } else {
    launch(GemvKernel<kRows, false, GemvEpilogue::kNone, kEarlyGroups>);
  }
}

// The one-group variant exists for the rows the engine uses the kernel for (comparison only).
template <int kRows>
void Launch(const GemvParams& p, cudaStream_t stream) {
  if constexpr (kRows <= kGemvPreferredMaxRows) {
    if (early_groups.load(std::memory_order_relaxed) == 1) {
      LaunchWith<kRows, 1>(p, stream);
      return;
    }
  }
  LaunchWith<kRows, 2>(p, stream);
}

}  // namespace

void Gemv(const GemvParams& p, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.rows >= 1 && p.rows <= kGemvMaxRows && p.in % 8 == 0);
  DUET_KERNEL_CHECK(p.epilogue == GemvEpilogue::kNone || (p.out % kWarpsPerBlock == 0 && !p.y_fp32));
  if (p.epilogue == GemvEpilogue::kRopeKvWrite) {
    const GemvRopeKvWrite& r = p.rope;
    DUET_KERNEL_CHECK(r.kv.head_dim > 0 && r.kv.head_dim % 8 == 0 && r.num_q_heads > 0 && r.kv.num_kv_heads > 0 &&
                      r.kv.block_size > 0 && p.out == (r.num_q_heads + 2 * r.kv.num_kv_heads) * r.kv.head_dim);
    DUET_KERNEL_CHECK(r.positions != nullptr && r.slot_mapping != nullptr && r.rope_table != nullptr &&
                      r.q_out != nullptr && r.kv.k != nullptr && r.kv.v != nullptr);
  }
  switch (p.rows) {
    case 1: Launch<1>(p, stream); break;
    case 2: Launch<2>(p, stream); break;
    case 3: Launch<3>(p, stream); break;
    case 4: Launch<4>(p, stream); break;
    case 5: Launch<5>(p, stream); break;
    case 6: Launch<6>(p, stream); break;
    case 7: Launch<7>(p, stream); break;
    default: Launch<8>(p, stream); break;
  }
  DUET_CUDA_CHECK(cudaGetLastError());
}

void SetGemvEarlyGroups(int groups) {
  DUET_KERNEL_CHECK(groups == 1 || groups == 2);
  early_groups.store(groups, std::memory_order_relaxed);
}

}  // namespace duet::kernels
