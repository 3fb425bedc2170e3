#include "kernels/gemm/wide_gemm.h"

#include <cuda.h>  // CUtensorMap and its enums (the encoder comes through the runtime)

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <map>

#include <cooperative_groups.h>

#include "kernels/cuda_check.h"
#include "kernels/gemm/wgmma.cuh"
#include "kernels/launch.cuh"

namespace duet::kernels {
namespace {

using launch_detail::LetDependentsLaunch;
using launch_detail::WaitForPriorKernels;
using wgmma::kRowBytes;
using wgmma::MatrixDescriptor;
using wgmma::SharedAddress;

constexpr int kTileK = 64;                         // K per pipeline stage: one 128-byte swizzled row
constexpr int kBoxFeatures = 128;                  // W rows per TMA box; a CTA loads two per stage
constexpr int kTileFeatures = 2 * kBoxFeatures;
constexpr int kConsumerThreads = 2 * 128;          // two warpgroups issue the wgmmas
constexpr int kThreads = kConsumerThreads + 128;   // and one thread of a third issues the TMA loads
// Registers per thread: the SM's register file is split four ways and each quarter holds three of
// the CTA's warps, so all would get 168; the producer's warpgroup hands most of its share to the
// consumers, whose accumulators (kN per thread) need it.
constexpr int kProducerRegisters = 56;
constexpr int kConsumerRegisters = 224;
constexpr int kMaxSplits = 4;
constexpr int kMinKBlocksPerSplit = 8;
constexpr int kMaxDynamicSmem = 227 * 1024;        // sm_90's per-CTA limit
// The epilogue parks the tile's sums in the stages' memory: [kN rows, 2 boxes x 128 features] fp32,
// rows padded by 16 bytes so one warp's stores fall in 32 different banks.
constexpr int kPartialStride = kTileFeatures + 4;

// A stage: W box 0 [128, 64], W box 1 [128, 64], x [kN, 64], each in the swizzled layout
// (kernels/gemm/wgmma.cuh), each 1024-byte aligned.
template <int kN>
__host__ __device__ constexpr int StageBytes() { return (kTileFeatures + kN) * kRowBytes; }
// As many as fit beside the barriers and the alignment slack, at most 5.
template <int kN>
__host__ __device__ constexpr int Stages() {
  constexpr int kFit = (kMaxDynamicSmem - 2048) / StageBytes<kN>();
  return kFit < 5 ? kFit : 5;
}
// The stages, their full and empty barriers, and slack to align the stages to 1024 bytes.
template <int kN>
constexpr int SmemBytes() { return Stages<kN>() * StageBytes<kN>() + 2048; }

// mbarrier primitives (shared::cta addresses).
__device__ __forceinline__ void InitBarrier(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void ArriveExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void Arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Returns once the barrier's phase of the given parity has completed. With kTrapWhenStuck, a phase
// that never completes (a bug: a lost load or arrival) traps the kernel after 2^28 unsuccessful
// tries (each suspends the thread a while: seconds in all) rather than hang the stream. Only the
// producer bounds its waits: the check costs the consumers registers they cannot spare.
template <bool kTrapWhenStuck>
__device__ __forceinline__ void WaitForPhase(uint32_t bar, uint32_t parity) {
  for (uint32_t tries = 0;; ++tries) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if (kTrapWhenStuck && tries == (1u << 28)) __trap();
  }
}

// TMA: the box of `map` at (k, row) into shared memory at `dst`; completes bytes on `bar`.
__device__ __forceinline__ void LoadBox(const CUtensorMap* map, uint32_t dst, uint32_t bar, int k, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(k), "r"(row)
      : "memory");
}

struct TileCoordinates {
  int row0;          // first row of x (and y) of the tile
  int box_row[2];    // first W row of each box
  int kb_begin, num_kb;  // the split's 64-wide K blocks
};

// The producer (one thread): fills stage i % kStages with K block i once the consumers released
// its previous use. Weights do not depend on the previous kernel: the first stages' are requested
// before waiting for it.
template <int kN>
__device__ __forceinline__ void Produce(const CUtensorMap* w_map, const CUtensorMap* x_map, uint32_t base,
                                        uint32_t full, uint32_t empty, const TileCoordinates& t) {
  constexpr int kStages = Stages<kN>();
  const int early = min(t.num_kb, kStages);
  for (int i = 0; i < early; ++i) {
    const uint32_t stage = base + i * StageBytes<kN>(), bar = full + 8 * i;
    const int k = (t.kb_begin + i) * kTileK;
    ArriveExpectBytes(bar, StageBytes<kN>());
    LoadBox(w_map, stage, bar, k, t.box_row[0]);
    LoadBox(w_map, stage + kBoxFeatures * kRowBytes, bar, k, t.box_row[1]);
  }
  WaitForPriorKernels();
  for (int i = 0; i < early; ++i) {
    LoadBox(x_map, base + i * StageBytes<kN>() + kTileFeatures * kRowBytes, full + 8 * i, (t.kb_begin + i) * kTileK,
            t.row0);
  }
  for (int i = kStages; i < t.num_kb; ++i) {
    const int s = i % kStages;
    const uint32_t stage = base + s * StageBytes<kN>(), bar = full + 8 * s;
    const int k = (t.kb_begin + i) * kTileK;
    WaitForPhase<true>(empty + 8 * s, (i / kStages - 1) & 1);  // the consumers are done with use i / kStages - 1
    ArriveExpectBytes(bar, StageBytes<kN>());
    LoadBox(w_map, stage, bar, k, t.box_row[0]);
    LoadBox(w_map, stage + kBoxFeatures * kRowBytes, bar, k, t.box_row[1]);
    LoadBox(x_map, stage + kTileFeatures * kRowBytes, bar, k, t.row0);
  }
  // The last round of loads has landed too (the earlier ones had, before their stages were
  // released), so a lost load traps here rather than hanging the consumers.
  for (int i = max(0, t.num_kb - kStages); i < t.num_kb; ++i) {
    WaitForPhase<true>(full + 8 * (i % kStages), (i / kStages) & 1);
  }
}

// acc[h][i]: warpgroup g's features 64g..64g+63 of box h (the wgmma's M) against the tile's rows
// (its N), laid out as kernels/gemm/wgmma_instructions.cuh describes.
template <int kN>
using Accumulators = float[2][kN / 2];

// A consumer warpgroup: waits for each stage, multiplies it (one wgmma group in flight while the
// next stage is awaited) and releases the stage once the group that read it has finished.
template <int kN>
__device__ __forceinline__ void Consume(Accumulators<kN>& acc, uint32_t base, uint32_t full, uint32_t empty,
                                        int num_kb, int group) {
  constexpr int kStages = Stages<kN>();
  for (int i = 0; i < num_kb; ++i) {
    const int s = i % kStages;
    const uint32_t stage = base + s * StageBytes<kN>();
    WaitForPhase<false>(full + 8 * s, (i / kStages) & 1);
    wgmma::Fence();
#pragma unroll
    for (int kk = 0; kk < kTileK / 16; ++kk) {
      const uint64_t b = MatrixDescriptor(stage + kTileFeatures * kRowBytes + kk * 32);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t a = stage + (h * kBoxFeatures + group * 64) * kRowBytes + kk * 32;
        wgmma::Wgmma<kN>(acc[h], MatrixDescriptor(a), b);
      }
    }
    wgmma::Commit();
    wgmma::Wait<1>();
    if (i > 0) Arrive(empty + 8 * ((i - 1) % kStages));
  }
  wgmma::Wait<0>();
}

// Writes warpgroup `group`'s accumulators to the partial tile [kN rows][128 features of box 0,
// 128 of box 1], the warpgroup's at features 64 * group.. of each box.
template <int kN>
__device__ __forceinline__ void ParkAccumulators(const Accumulators<kN>& acc, float* partial, int group) {
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const int m = 16 * warp + lane / 4 + 8 * ((i / 2) % 2), n = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
      partial[n * kPartialStride + kBoxFeatures * h + 64 * group + m] = acc[h][i];
    }
  }
}

__device__ __forceinline__ float Silu(float v) { return v / (1.f + __expf(-v)); }

// y[row, feature..feature+3] (those below `width`), 8-byte stores where aligned.
__device__ __forceinline__ void StoreFour(__nv_bfloat16* y, int row, int feature, int width, float4 v) {
  __nv_bfloat16* dst = y + size_t(row) * width + feature;
  if (feature + 3 < width && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const uint32_t*>(&lo);
    packed.y = *reinterpret_cast<const uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(dst) = packed;
    return;
  }
  const float f[4] = {v.x, v.y, v.z, v.w};
  for (int j = 0; j < 4 && feature + j < width; ++j) dst[j] = __float2bfloat16(f[j]);
}

// The epilogue: the consumers park their accumulators in their CTA's shared memory, then the
// cluster's CTAs (the tile's K splits; one without splits) each sum a share of the tile's
// (row, 4 features) groups over every CTA's partial in split order and store them. Every thread
// of the CTA takes part in the barriers; only consumers (kConsumer) park and sum: the producer's
// warpgroup, down to kProducerRegisters, runs nothing but the barriers.
template <int kN, bool kConsumer>
__device__ __forceinline__ void StoreTile(const Accumulators<kN>* acc, float* partial, const WideGemmParams& p,
                                          const TileCoordinates& t, int splits) {
  namespace cg = cooperative_groups;
  auto sync = [&] {
    if (splits > 1) {
      cg::this_cluster().sync();
    } else {
      __syncthreads();
    }
  };
  __syncthreads();  // every warpgroup is done reading the stages
  if constexpr (kConsumer) ParkAccumulators<kN>(*acc, partial, int(threadIdx.x) / 128);
  sync();  // every CTA's partial is in place
  if constexpr (kConsumer) {
    const int rank = int(blockIdx.z);  // the split: the cluster spans the grid's z, one CTA per split
    const int width = p.silu_mul ? p.out / 2 : p.out;
    // Without SiLU·mul a group is 4 of the 256 columns; with it, 4 gate columns (of the first 128)
    // and the 4 up columns 128 further, which make 4 outputs.
    const int group_shift = p.silu_mul ? 5 : 6;  // log2 of the groups per row
    const int groups = min(kN, p.rows - t.row0) << group_shift, share = (groups + splits - 1) / splits;
    const int end = min(groups, (rank + 1) * share);
    for (int g = rank * share + int(threadIdx.x); g < end; g += kConsumerThreads) {
      const int n = g >> group_shift, c = (g & ((1 << group_shift) - 1)) * 4;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f), up = sum;
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s) {
        if (s == splits) break;
        const float* theirs = splits > 1 ? cg::this_cluster().map_shared_rank(partial, s) : partial;
        const float4 v = *reinterpret_cast<const float4*>(theirs + n * kPartialStride + c);
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
        if (p.silu_mul) {
          const float4 u = *reinterpret_cast<const float4*>(theirs + n * kPartialStride + kBoxFeatures + c);
          up.x += u.x, up.y += u.y, up.z += u.z, up.w += u.w;
        }
      }
      if (p.silu_mul) {
        const float4 act =
            make_float4(Silu(sum.x) * up.x, Silu(sum.y) * up.y, Silu(sum.z) * up.z, Silu(sum.w) * up.w);
        StoreFour(p.y, t.row0 + n, t.box_row[0] + c, width, act);
      } else {
        StoreFour(p.y, t.row0 + n, (c < kBoxFeatures ? t.box_row[0] : t.box_row[1]) + c % kBoxFeatures, width, sum);
      }
    }
  }
  sync();  // no CTA leaves while another still reads its partial
}

// Grid: (row tiles, feature tiles, K splits); a cluster is a tile's splits.
template <int kN>
__global__ void __launch_bounds__(kThreads, 1)
    WideGemmKernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
                   const WideGemmParams p, const int k_blocks_per_split) {
  constexpr int kStages = Stages<kN>();
  // The 128-byte swizzle repeats every 1024 bytes: stages start on such a boundary.
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - SharedAddress(smem_raw) % 1024) % 1024);
  const uint32_t base = SharedAddress(smem);
  const uint32_t full = base + kStages * StageBytes<kN>(), empty = full + 8 * kStages;

  TileCoordinates t;
  t.row0 = blockIdx.x * kN;
  if (p.silu_mul) {
    t.box_row[0] = blockIdx.y * kBoxFeatures;  // gate rows; the up rows are `out / 2` further
    t.box_row[1] = p.out / 2 + t.box_row[0];
  } else {
    t.box_row[0] = blockIdx.y * kTileFeatures;
    t.box_row[1] = t.box_row[0] + kBoxFeatures;
  }
  const int total_k_blocks = (p.in + kTileK - 1) / kTileK;
  t.kb_begin = blockIdx.z * k_blocks_per_split;
  t.num_kb = max(0, min(total_k_blocks, t.kb_begin + k_blocks_per_split) - t.kb_begin);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      InitBarrier(full + 8 * s, 1);                    // the producer's arrival (plus the bytes)
      InitBarrier(empty + 8 * s, kConsumerThreads);    // every consumer thread's release
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  float* partial = reinterpret_cast<float*>(smem);
  const int group = threadIdx.x / 128;
  if (group == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (threadIdx.x == kConsumerThreads) {
      Produce<kN>(&w_map, &x_map, base, full, empty, t);
    } else {
      WaitForPriorKernels();
    }
    __syncwarp();  // the producer's warp meets the epilogue's barriers converged
    StoreTile<kN, false>(nullptr, partial, p, t, int(gridDim.z));
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    WaitForPriorKernels();
    Accumulators<kN> acc = {};
    Consume<kN>(acc, base, full, empty, t.num_kb, group);
    // Only now (the producer's warpgroup never signals): the next kernel's CTAs, once resident,
    // take SM slots and prefetch their weights.
    LetDependentsLaunch();
    StoreTile<kN, true>(&acc, partial, p, t, int(gridDim.z));
  }
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's tensor-map encoder, through the runtime (no link against libcuda).
EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    DUET_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    DUET_KERNEL_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr);
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// A [rows, in] bf16 row-major matrix read in boxes of box_rows x 64, 128-byte swizzled; reads
// past its edges fill zeros.
CUtensorMap KMajorMap(const __nv_bfloat16* data, int rows, int in, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(in), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(in) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {kTileK, cuuint32_t(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = EncodeTiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(data), dims,
                                   strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DUET_KERNEL_CHECK(r == CUDA_SUCCESS);
  return map;
}

template <int... kNs>
struct RowTiles {};
using AllRowTiles = RowTiles<64, 96, 128, 160, 192>;

// The shared-memory limit is an attribute of the kernel in each device's context. The register
// check: setmaxnreg.inc waits until the CTA's pool has the registers asked for, so a variant
// compiled to fewer per thread than the warpgroups' trade needs would hang, not fail.
template <int kN>
void PrepareVariant() {
  DUET_CUDA_CHECK(
      cudaFuncSetAttribute(WideGemmKernel<kN>, cudaFuncAttributeMaxDynamicSharedMemorySize, SmemBytes<kN>()));
  cudaFuncAttributes attributes{};
  DUET_CUDA_CHECK(cudaFuncGetAttributes(&attributes, WideGemmKernel<kN>));
  DUET_KERNEL_CHECK(attributes.numRegs * kThreads >=
                        128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters &&
                    "WideGemm compiled with fewer registers than its warpgroups trade");
}

template <int... kNs>
void PrepareVariants(RowTiles<kNs...>) {
  (PrepareVariant<kNs>(), ...);
}

// Clusters of `splits` CTAs of the largest variant resident at once, in CTAs (every variant takes
// one CTA per SM).
int ResidentClusterCtas(int splits) {
  constexpr int kN = kWideGemmMaxRowTile;
  return splits * launch_detail::MaxActiveClusters(reinterpret_cast<const void*>(WideGemmKernel<kN>),
                                                   dim3(1, 1, unsigned(splits)), kThreads, SmemBytes<kN>());
}

// Once per device: the variants prepared and the capacity asked.
const WideGemmCapacity& PreparedDevice() {
  int device = 0;
  DUET_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<int, WideGemmCapacity> prepared;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = prepared.try_emplace(device);
  if (inserted) {
    PrepareVariants(AllRowTiles{});
    int num_sms = 0;
    DUET_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    it->second = {{num_sms, ResidentClusterCtas(2), ResidentClusterCtas(kMaxSplits)}};
    DUET_KERNEL_CHECK(it->second.resident_ctas[1] > 0 && it->second.resident_ctas[2] > 0);
  }
  return it->second;
}

template <int kN>
void Launch(const WideGemmParams& p, const WideGemmPlan& plan, cudaStream_t stream) {
  static_assert(kN * kPartialStride * 4 <= Stages<kN>() * StageBytes<kN>(), "the partial tile fits the stages");
  static_assert(SmemBytes<kN>() <= kMaxDynamicSmem);
  const CUtensorMap w_map = KMajorMap(p.weight, p.out, p.in, kBoxFeatures);
  const CUtensorMap x_map = KMajorMap(p.x, p.rows, p.in, kN);
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = ProgrammaticLaunchEnabled() ? 1 : 0;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim = {1, 1, unsigned(plan.splits)};
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(plan.row_tiles, plan.feature_tiles, plan.splits);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = SmemBytes<kN>();
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = plan.splits > 1 ? 2 : 1;
  DUET_CUDA_CHECK(cudaLaunchKernelEx(&config, WideGemmKernel<kN>, w_map, x_map, p, plan.k_blocks_per_split));
}

template <int kN, int... kLarger>
void LaunchForRowTile(const WideGemmParams& p, const WideGemmPlan& plan, cudaStream_t stream,
                      RowTiles<kN, kLarger...>) {
  if (plan.row_tile == kN) {
    Launch<kN>(p, plan, stream);
  } else if constexpr (sizeof...(kLarger) > 0) {
    LaunchForRowTile(p, plan, stream, RowTiles<kLarger...>{});
  } else {
    DUET_KERNEL_CHECK(false && "row tile is 64-192, a multiple of 32");
  }
}

int CeilDiv(int a, int b) { return (a + b - 1) / b; }

}  // namespace

WideGemmCapacity WideGemmCapacityOfSms(int num_sms) { return {{num_sms, num_sms, num_sms}}; }

WideGemmCapacity QueryWideGemmCapacity() { return PreparedDevice(); }

WideGemmPlan PlanWideGemm(int rows, int in, int out, bool silu_mul, const WideGemmCapacity& capacity) {
  DUET_KERNEL_CHECK(rows >= 1 && in > 0 && out > 0);
  WideGemmPlan plan;
  // As few row tiles as the largest tile allows, each as even as multiples of 32 make them.
  const int row_tiles = CeilDiv(rows, kWideGemmMaxRowTile);
  plan.row_tile = std::max(64, CeilDiv(CeilDiv(rows, row_tiles), 32) * 32);
  plan.row_tiles = CeilDiv(rows, plan.row_tile);
  plan.feature_tiles = silu_mul ? CeilDiv(out / 2, kBoxFeatures) : CeilDiv(out, kTileFeatures);
  const int k_blocks = CeilDiv(in, kTileK);
  const int tiles = plan.row_tiles * plan.feature_tiles;
  // Cost in K blocks on the busiest SM: waves x blocks per split, plus ~2 blocks' time for a
  // split's cluster reduction; a larger split has to save a tenth.
  auto cost = [&](int splits) {
    return CeilDiv(tiles * splits, capacity.ResidentCtas(splits)) * (CeilDiv(k_blocks, splits) + (splits > 1 ? 2 : 0));
  };
  plan.splits = 1;
  for (int splits = 2; splits <= kMaxSplits; splits *= 2) {
    if (k_blocks / splits >= kMinKBlocksPerSplit && 10 * cost(splits) < 9 * cost(plan.splits)) plan.splits = splits;
  }
  plan.k_blocks_per_split = CeilDiv(k_blocks, plan.splits);
  return plan;
}

void PrepareWideGemm() {
  PreparedDevice();
  EncodeTiled();  // looked up once, outside any graph capture
}

void WideGemm(const WideGemmParams& p, const WideGemmPlan& plan, cudaStream_t stream) {
  DUET_KERNEL_CHECK(p.rows >= 1 && p.in > 0 && p.in % 8 == 0 && p.out > 0 && (!p.silu_mul || p.out % 2 == 0));
  DUET_KERNEL_CHECK(reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.weight) % 16 == 0);
  DUET_KERNEL_CHECK(size_t(plan.row_tile) * plan.row_tiles >= size_t(p.rows));
  DUET_KERNEL_CHECK(size_t(plan.feature_tiles) * (p.silu_mul ? kBoxFeatures : kTileFeatures) >=
                    size_t(p.silu_mul ? p.out / 2 : p.out));
  DUET_KERNEL_CHECK((plan.splits == 1 || plan.splits == 2 || plan.splits == kMaxSplits) &&
                    plan.k_blocks_per_split >= 1 &&
                    size_t(plan.splits) * plan.k_blocks_per_split * kTileK >= size_t(p.in));
  PreparedDevice();
  LaunchForRowTile(p, plan, stream, AllRowTiles{});
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::kernels
