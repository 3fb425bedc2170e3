#include "kernels/gemm/skinny_gemm.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include <cooperative_groups.h>

#include "kernels/cuda_check.h"
#include "kernels/gemm/wgmma.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using launch_detail::LetDependentsLaunch;
using launch_detail::WaitForPriorKernels;
using wgmma::FenceProxyAsync;
using wgmma::kRowBytes;
using wgmma::MatrixDescriptor;
using wgmma::SharedAddress;
using wgmma::SwizzledOffset;

constexpr int kTileOut = 128;                 // W rows (output features) per CTA: two wgmma M halves
constexpr int kTileK = 64;                    // K per pipeline stage
constexpr int kThreads = 128;                 // one warpgroup, which issues the wgmmas
constexpr int kMaxSplits = 8;                 // the largest portable cluster
constexpr int kMinKBlocksPerSplit = 4;
constexpr int kSharedBytesPerSm = 228 * 1024;  // sm_90, of which 1 KiB per resident CTA is the system's
// A split's partial tile in shared memory: [kRows, kPartialStride] fp32, rows padded by 16 bytes
// so the rows and features one warp's accumulators hold fall in 32 different banks.
constexpr int kPartialStride = kTileOut + 4;

template <int kRows>
__host__ __device__ constexpr int StageBytes() { return (kTileOut + kRows) * kRowBytes; }
// A kernel variant's dynamic shared memory: its stages, plus slack to align them to 1024 bytes.
template <int kRows, int kStages>
constexpr int SmemBytes() { return kStages * StageBytes<kRows>() + 1024; }
// The pipeline depths a launch chooses from, deepest first.
template <int... kStages>
struct StageDepths {};
using PipelineDepths = StageDepths<8, 6, 4, 3>;

// 16 bytes global -> shared, bypassing L1; `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// A stage's shared memory: W tile [kTileOut, kTileK], then x tile [kRows, kTileK], both swizzled.
template <int kRows>
struct Stage {
  uint32_t w, x;
  __device__ __forceinline__ Stage(uint32_t base, int index)
      : w(base + uint32_t(index * StageBytes<kRows>())), x(w + kTileOut * kRowBytes) {}
};

// W rows [n0, n0 + kTileOut) x K block kb; features past `out` and K past `in` read as zeros.
template <int kRows>
__device__ __forceinline__ void LoadWeightTile(const Stage<kRows>& s, const __nv_bfloat16* weight, int n0, int kb,
                                               int in, int out) {
#pragma unroll
  for (int j = 0; j < kTileOut * 8 / kThreads; ++j) {
    const int i = threadIdx.x + j * kThreads, row = i >> 3, chunk = i & 7, n = n0 + row, k = kb * kTileK + chunk * 8;
    const bool valid = n < out && k < in;
    CpAsync16(s.w + SwizzledOffset(row, chunk), weight + (valid ? size_t(n) * in + k : 0), valid);
  }
}

template <int kRows>
__device__ __forceinline__ void LoadInputTile(const Stage<kRows>& s, const __nv_bfloat16* x, int kb, int rows,
                                              int in) {
  static_assert(kRows * 8 % kThreads == 0);
#pragma unroll
  for (int j = 0; j < kRows * 8 / kThreads; ++j) {
    const int i = threadIdx.x + j * kThreads, row = i >> 3, chunk = i & 7, k = kb * kTileK + chunk * 8;
    const bool valid = row < rows && k < in;
    CpAsync16(s.x + SwizzledOffset(row, chunk), x + (valid ? size_t(row) * in + k : 0), valid);
  }
}

// acc[h][i]: features are the wgmma's M (64 per instruction, h = which half of the slice), x's
// rows its N. Register i of thread (warp w, lane l) holds feature 64h + 16w + l/4 + 8·((i/2) % 2)
// of row 8·(i/4) + 2·(l%4) + i%2.
template <int kRows>
using Accumulators = float[2][kRows / 2];

// Issues the stage's 8 wgmmas (2 feature halves x 4 K steps) and waits for them.
template <int kRows>
__device__ __forceinline__ void MultiplyStage(const Stage<kRows>& s, Accumulators<kRows>& acc) {
  wgmma::Fence();
#pragma unroll
  for (int kk = 0; kk < kTileK / 16; ++kk) {
    const uint64_t b = MatrixDescriptor(s.x + kk * 32);
#pragma unroll
    for (int h = 0; h < 2; ++h) wgmma::Wgmma<kRows>(acc[h], MatrixDescriptor(s.w + h * 64 * kRowBytes + kk * 32), b);
  }
  wgmma::Commit();
  wgmma::Wait<0>();
}

// Calls f(row, feature, value) for every accumulator of this thread that lies in the output.
template <int kRows, typename F>
__device__ __forceinline__ void ForEachOutput(const Accumulators<kRows>& acc, int n0, int rows, int out, F&& f) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < kRows / 2; ++i) {
      const int feature = n0 + h * 64 + warp * 16 + (lane >> 2) + 8 * ((i >> 1) & 1);
      const int row = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      if (row < rows && feature < out) f(row, feature, acc[h][i]);
    }
  }
}

template <bool kFp32Out>
__device__ __forceinline__ void StoreOutput(void* y, int row, int feature, int out, float v) {
  const size_t i = size_t(row) * out + feature;
  if constexpr (kFp32Out) {
    static_cast<float*>(y)[i] = v;
  } else {
    static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16(v);
  }
}

template <bool kFp32Out>
__device__ __forceinline__ void StoreOutputPair(void* y, int row, int col, int out, float2 v) {
  const size_t i = size_t(row) * out + col;
  const bool pair = col + 1 < out;
  if constexpr (kFp32Out) {
    float* dst = static_cast<float*>(y) + i;
    if (pair && out % 2 == 0) {
      *reinterpret_cast<float2*>(dst) = v;
    } else {
      dst[0] = v.x;
      if (pair) dst[1] = v.y;
    }
  } else {
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(y) + i;
    if (pair && out % 2 == 0) {
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v.x, v.y);
    } else {
      dst[0] = __float2bfloat16(v.x);
      if (pair) dst[1] = __float2bfloat16(v.y);
    }
  }
}

// Split K: the cluster's CTAs (one per split, cluster rank = split) each park their partial tile
// in their own shared memory (the pipeline stages, no longer read), then each sums one share of
// the tile's rows x 4-feature groups over every CTA's partial, in rank order, and writes y.
template <int kRows, int kStages, bool kFp32Out>
__device__ __forceinline__ void ReduceOverCluster(const Accumulators<kRows>& acc, float* partial,
                                                  const SkinnyGemmParams& p, int n0) {
  static_assert(kRows * kPartialStride * 4 <= kStages * StageBytes<kRows>());
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __syncthreads();  // every warp is done with the stages
  ForEachOutput<kRows>(acc, 0, kRows, kTileOut,
                       [&](int row, int feature, float v) { partial[row * kPartialStride + feature] = v; });
  cluster.sync();  // every partial is in place
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  constexpr int kGroupsPerRow = kTileOut / 4;
  const int groups = p.rows * kGroupsPerRow, share = (groups + splits - 1) / splits;
  const int end = min(groups, (rank + 1) * share);
  for (int g = rank * share + threadIdx.x; g < end; g += kThreads) {
    const int row = g / kGroupsPerRow, col = (g % kGroupsPerRow) * 4;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < splits; ++s) {
      const float* theirs = cluster.map_shared_rank(partial, s);
      const float4 v = *reinterpret_cast<const float4*>(theirs + row * kPartialStride + col);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const int feature = n0 + col;
    if (feature < p.out) StoreOutputPair<kFp32Out>(p.y, row, feature, p.out, make_float2(sum.x, sum.y));
    if (feature + 2 < p.out) StoreOutputPair<kFp32Out>(p.y, row, feature + 2, p.out, make_float2(sum.z, sum.w));
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

// Grid: (128-feature slices, K splits). kRows: the row count rounded up to 16, 32 or 64.
template <int kRows, int kStages, bool kFp32Out>
__global__ void __launch_bounds__(kThreads) SkinnyGemmKernel(const SkinnyGemmParams p, const int k_blocks_per_split) {
  // The 128-byte swizzle repeats every 1024 bytes: stages start on such a boundary.
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - SharedAddress(smem_raw) % 1024) % 1024);
  const uint32_t base = SharedAddress(smem);
  const int slice = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  const int n0 = slice * kTileOut;
  const int total_k_blocks = (p.in + kTileK - 1) / kTileK;
  const int kb_begin = split * k_blocks_per_split;
  const int num_kb = max(0, min(total_k_blocks, kb_begin + k_blocks_per_split) - kb_begin);

  // The first stages' weights do not depend on the previous kernel: they stream while it ends.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_kb) LoadWeightTile(Stage<kRows>(base, s), p.weight, n0, kb_begin + s, p.in, p.out);
  }
  WaitForPriorKernels();
  // Group s holds stage s's x (group 0 also every early weight tile).
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_kb) LoadInputTile(Stage<kRows>(base, s), p.x, kb_begin + s, p.rows, p.in);
    CpAsyncCommit();
  }

  Accumulators<kRows> acc = {};
  for (int i = 0; i < num_kb; ++i) {
    CpAsyncWait<kStages - 2>();  // stage i has landed (for this thread) ...
    FenceProxyAsync();                    // ... where the tensor cores read it ...
    __syncthreads();                      // ... for every thread; stage i - 1's wgmmas are done
    const int next = i + kStages - 1;
    if (next < num_kb) {
      const Stage<kRows> s(base, next % kStages);
      LoadWeightTile(s, p.weight, n0, kb_begin + next, p.in, p.out);
      LoadInputTile(s, p.x, kb_begin + next, p.rows, p.in);
    }
    CpAsyncCommit();
    MultiplyStage(Stage<kRows>(base, i % kStages), acc);
  }
  CpAsyncWait<0>();
  // Only now: the next kernel's CTAs, once resident, take SM slots and prefetch their weights. Let
  // in at the start, they filled slots this grid's later CTAs needed and streamed beside it.
  LetDependentsLaunch();

  if (splits == 1) {
    ForEachOutput<kRows>(acc, n0, p.rows, p.out,
                         [&](int row, int feature, float v) { StoreOutput<kFp32Out>(p.y, row, feature, p.out, v); });
    return;
  }
  ReduceOverCluster<kRows, kStages, kFp32Out>(acc, reinterpret_cast<float*>(smem), p, n0);
}

// How many of a kernel's launch units (CTAs, or clusters of `splits` CTAs) the current device
// holds at once, asked once per device, kernel and cluster size.
int ResidentUnits(const void* kernel, int threads, int smem_bytes, int splits, int num_sms) {
  // Per device: the shared-memory limit is an attribute of the kernel in each device's context (a
  // sequence-parallel group drives several devices from one process).
  int device = 0;
  DUET_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = cache.try_emplace({device, kernel, splits}, 0);
  if (!inserted) return it->second;
  DUET_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  if (splits == 1) {
    int per_sm = 0;
    DUET_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
    it->second = per_sm * num_sms;
  } else {
    it->second = launch_detail::MaxActiveClusters(kernel, dim3(1, unsigned(splits), 1), threads, smem_bytes);
  }
  return it->second;
}

template <int kRows, int kStages, bool kFp32Out>
void LaunchWithStages(const SkinnyGemmParams& p, const SkinnyGemmPlan& plan, cudaStream_t stream) {
  constexpr int kSmemBytes = SmemBytes<kRows, kStages>();
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = ProgrammaticLaunchEnabled() ? 1 : 0;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim = {1, unsigned(plan.splits), 1};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3((p.out + kTileOut - 1) / kTileOut, plan.splits);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = plan.splits > 1 ? 2 : 1;
  DUET_CUDA_CHECK(cudaLaunchKernelEx(&config, SkinnyGemmKernel<kRows, kStages, kFp32Out>, p, plan.k_blocks_per_split));
}

// Pipeline depth: the deepest (most weight bytes in flight per SM) at which the whole grid is
// resident at once — a second wave would stream with a fraction of the SMs — else the shallowest.
template <int kRows, bool kFp32Out, int kStages, int... kShallower>
void LaunchDeepest(const SkinnyGemmParams& p, const SkinnyGemmPlan& plan, cudaStream_t stream,
                   StageDepths<kStages, kShallower...>) {
  constexpr int kSmemBytes = SmemBytes<kRows, kStages>();
  const void* kernel = reinterpret_cast<const void*>(SkinnyGemmKernel<kRows, kStages, kFp32Out>);
  const int units = (p.out + kTileOut - 1) / kTileOut;  // slices: CTAs, or clusters when split
  if constexpr (sizeof...(kShallower) == 0) {
    ResidentUnits(kernel, kThreads, kSmemBytes, plan.splits, plan.num_sms);  // sets the shared-memory limit
    LaunchWithStages<kRows, kStages, kFp32Out>(p, plan, stream);
  } else {
    if (kSmemBytes + 1024 <= kSharedBytesPerSm &&
        ResidentUnits(kernel, kThreads, kSmemBytes, plan.splits, plan.num_sms) >= units) {
      LaunchWithStages<kRows, kStages, kFp32Out>(p, plan, stream);
    } else {
      LaunchDeepest<kRows, kFp32Out>(p, plan, stream, StageDepths<kShallower...>{});
    }
  }
}

template <int kRows, bool kFp32Out, int... kStages>
void PrepareVariants(int num_sms, StageDepths<kStages...>) {
  for (int splits = 1; splits <= kMaxSplits; splits *= 2) {
    (ResidentUnits(reinterpret_cast<const void*>(SkinnyGemmKernel<kRows, kStages, kFp32Out>), kThreads,
                   SmemBytes<kRows, kStages>(), splits, num_sms),
     ...);
  }
}

template <int... kRowTiles>
void PrepareRowTiles(int num_sms) {
  (PrepareVariants<kRowTiles, false>(num_sms, PipelineDepths{}), ...);
  (PrepareVariants<kRowTiles, true>(num_sms, PipelineDepths{}), ...);
}

template <int kRows>
void LaunchForRows(const SkinnyGemmParams& p, const SkinnyGemmPlan& plan, cudaStream_t stream) {
  if (p.y_fp32) {
    LaunchDeepest<kRows, true>(p, plan, stream, PipelineDepths{});
  } else {
    LaunchDeepest<kRows, false>(p, plan, stream, PipelineDepths{});
  }
}

}  // namespace

SkinnyGemmPlan PlanSkinnyGemm(int in, int out, int num_sms) {
  DUET_KERNEL_CHECK(in > 0 && out > 0 && num_sms > 0);
  const int slices = (out + kTileOut - 1) / kTileOut;
  const int k_blocks = (in + kTileK - 1) / kTileK;
  // Up to 1.5 CTAs per SM: qkv's 48 slices split 4 ways (192 CTAs) beat 2 ways (96) by 3-7% at
  // 32-64 rows; 8-way splits (256 CTAs for o and down) lose to 4-way from 32 rows.
  const int limit = std::min({3 * num_sms / 2 / slices, kMaxSplits, k_blocks / kMinKBlocksPerSplit});
  SkinnyGemmPlan plan;
  plan.num_sms = num_sms;
  while (plan.splits * 2 <= limit) plan.splits *= 2;
  plan.k_blocks_per_split = (k_blocks + plan.splits - 1) / plan.splits;
  return plan;
}

void PrepareSkinnyGemm(int num_sms) { PrepareRowTiles<16, 32, 64>(num_sms); }

void SkinnyGemm(const SkinnyGemmParams& p, const SkinnyGemmPlan& plan, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.rows >= 1 && p.rows <= kSkinnyGemmMaxRows && p.in > 0 && p.in % 8 == 0 && p.out > 0);
  DUET_KERNEL_CHECK(reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.weight) % 16 == 0);
  DUET_KERNEL_CHECK((plan.splits == 1 || plan.splits == 2 || plan.splits == 4 || plan.splits == kMaxSplits) &&
                    plan.k_blocks_per_split >= 1 &&
                    size_t(plan.splits) * plan.k_blocks_per_split * kTileK >= size_t(p.in));
  if (p.rows <= 16) {
    LaunchForRows<16>(p, plan, stream);
  } else if (p.rows <= 32) {
    LaunchForRows<32>(p, plan, stream);
  } else {
    LaunchForRows<64>(p, plan, stream);
  }
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
