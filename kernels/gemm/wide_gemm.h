// Tensor-core GEMM for prompt-sized batches (prefill chunks and mixed prefill + decode steps):
// y[rows, out] = x[rows, in] · W[out, in]^T, bf16 in and out, fp32 accumulation (HF's row-major
// nn.Linear layout), optionally with Llama's SiLU·mul fused into the epilogue.
//
// Where cuBLAS loses time at these row counts is tiling, not arithmetic: its tiles cover rows in
// steps of 64-256, and a 4096-feature projection at ~300 rows makes too few of them for 132 SMs
// (Llama-3-8B's o projection at 320 rows runs at 407 TFLOP/s, BENCHMARKS.md). Here the weights'
// features are the wgmma's M and x's rows its N, which may be any multiple of 32 up to 192: 320
// rows are two 160-row tiles, no padding. A CTA computes 256 features x kN rows. One producer
// thread streams the W tile (two 128-feature TMA boxes) and the x tile through a 4-5 stage mbarrier
// pipeline (its warpgroup hands its registers to the others); two consumer warpgroups each multiply
// 2 x 64 features against the rows (features 64w..64w+63 of each box). K is split over a
// thread-block cluster when tiles are too few for the SMs; every split parks its partial tile in
// its shared memory and the cluster sums it in split order (deterministic, no workspace), which is
// also the epilogue without splits: the sums leave as coalesced rows of y.
//
// SiLU·mul (Llama's MLP input): W is [gate; up], 2 * inter rows; a CTA's first box holds gate
// features f0..f0+127 and its second the matching up features, so each consumer thread holds gate
// and up of the same outputs and y[rows, inter] = silu(x·gate^T) * (x·up^T) needs no gate_up
// scratch and no second kernel.
//
// Plan/run: PlanWideGemm picks the row tile and the split for a shape; WideGemm runs it (sm_90a).
// Launched with programmatic dependent launch (kernels/launch.cuh): the first stages' weight loads
// are issued before the kernel waits for the one that produces x.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace duet::kernels {

struct WideGemmParams {
  const __nv_bfloat16* x;       // [rows, in], 16-byte aligned
  const __nv_bfloat16* weight;  // [out, in], 16-byte aligned; with silu_mul [gate; up], out = 2 * inter
  __nv_bfloat16* y;             // [rows, out], or [rows, out / 2] with silu_mul
  int rows, in, out;            // in a multiple of 8; out even with silu_mul
  bool silu_mul = false;
};

struct WideGemmPlan {
  int row_tile;            // rows per CTA (the wgmma N): 64-192, a multiple of 32
  int row_tiles;           // ceil(rows / row_tile)
  int feature_tiles;       // 256 W rows per CTA (with silu_mul: 128 gate + 128 up rows)
  int splits;              // K ranges per tile, the cluster size: 1, 2 or 4
  int k_blocks_per_split;  // 64-wide K blocks each split covers (the last may cover fewer, or none)
};

constexpr int kWideGemmMaxRowTile = 192;

// How many CTAs the device runs at once, by split (cluster size). One per SM without a cluster;
// a cluster's CTAs must share a GPC, so with 2 or 4 the SMs a GPC has left over may hold none, and
// a plan that counted them would send a few clusters into a second wave.
struct WideGemmCapacity {
  int resident_ctas[3];  // splits 1, 2, 4
  int ResidentCtas(int splits) const { return resident_ctas[splits == 1 ? 0 : splits == 2 ? 1 : 2]; }
};
// Every SM usable at every split: planning without a device (tests), an upper bound otherwise.
WideGemmCapacity WideGemmCapacityOfSms(int num_sms);
// The current device's, from the driver's occupancy calculator, asked once per device.
WideGemmCapacity QueryWideGemmCapacity();

// For any rows >= 1; the engine sends it prompt-sized batches (CublasLinear).
WideGemmPlan PlanWideGemm(int rows, int in, int out, bool silu_mul, const WideGemmCapacity& capacity);

// Per device, once: sets each kernel variant's shared-memory limit, checks that the compiler gave
// every variant the registers its warpgroups trade (setmaxnreg), looks up the driver's tensor-map
// encoder and asks the capacity. Call before launches are captured into graphs; WideGemm does it
// lazily otherwise.
void PrepareWideGemm();

void WideGemm(const WideGemmParams& params, const WideGemmPlan& plan, cudaStream_t stream);

}  // namespace duet::kernels
