#include "kernels/gemv.h"

#include <cstdint>

#include "kernels/cuda_check.h"

namespace duet::kernels {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane before the math

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

// One warp per output feature `o`; lanes stride over `in` in 16-byte chunks.
template <int kRows, bool kFp32Out>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) GemvKernel(const __nv_bfloat16* __restrict__ x,
                                                                 const __nv_bfloat16* __restrict__ weight,
                                                                 void* __restrict__ y, int in, int out) {
  const int lane = threadIdx.x & 31;
  const int o = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (o >= out) return;
  const int chunks = in / 8;
  const uint4* w = reinterpret_cast<const uint4*>(weight + size_t(o) * in);
  const uint4* xs = reinterpret_cast<const uint4*>(x);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;

  int c = lane;
  for (; c + 32 * (kUnroll - 1) < chunks; c += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = __ldcs(w + c + 32 * u);  // streamed once: don't keep in L2
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) Accumulate(wv[u], __ldg(xs + size_t(r) * chunks + c + 32 * u), acc[r]);
    }
  }
  for (; c < chunks; c += 32) {
    const uint4 wv = __ldcs(w + c);
#pragma unroll
    for (int r = 0; r < kRows; ++r) Accumulate(wv, __ldg(xs + size_t(r) * chunks + c), acc[r]);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
  }
  if (lane == 0) {
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

template <int kRows>
void Launch(const GemvParams& p, cudaStream_t stream) {
  const dim3 grid((p.out + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (p.y_fp32) {
    GemvKernel<kRows, true><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p.x, p.weight, p.y, p.in, p.out);
  } else {
    GemvKernel<kRows, false><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p.x, p.weight, p.y, p.in, p.out);
  }
}

}  // namespace

void Gemv(const GemvParams& p, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.rows >= 1 && p.rows <= kGemvMaxRows && p.in % 8 == 0);
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

}  // namespace duet::kernels
