// Skinny GEMM for decode: y[rows, out] = x[rows, in] · W[out, in]^T with 1 <= rows <= 8, bf16
// inputs, fp32 accumulation, bf16 or fp32 output. Decode is a pure stream over the weights, so
// the kernel is built to keep as many 16-byte weight loads in flight as possible: one warp per
// output feature, each lane reading 16 bytes of W per load, the next group of loads issued before
// the current one is used (x comes from L1/L2). Launched with programmatic dependent launch
// (kernels/launch.cuh): each warp's first two weight groups are issued before it waits for the
// kernel that produces x, so the weight stream starts during that kernel's tail.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/attention/paged_kv.h"

namespace duet::kernels {

constexpr int kGemvMaxRows = 8;
// Up to this many rows the kernel beats cuBLAS on the H200 (kernels/gemm/gemv_bench.cpp); from there
// on cuBLAS's tiling reuses each weight load across rows better.
constexpr int kGemvPreferredMaxRows = 2;

// What the kernel writes from the projection z[rows, out].
enum class GemvEpilogue {
  kNone,     // y = z
  // Llama's MLP activation: W stacks gate rows [0, out/2) over up rows [out/2, out) and
  // y[rows, out/2] = silu(gate) * up, computed from the bf16-rounded gate and up (as the
  // unfused SiluAndMul sees them). Needs out % 8 == 0 and a bf16 output.
  kSiluMul,
  // The fused QKV projection's RoPE and KV-cache write (kernels/rope.h, RopeAndWriteKv, without a
  // QKV bias): z rows are q heads, then k heads, then v heads of head_dim; q is rotated into
  // rope.q_out, k rotated and v copied into the caches at each row's slot (negative: not written).
  // y is unused. Needs head_dim % 8 == 0 and out == (num_q_heads + 2 * num_kv_heads) * head_dim.
  kRopeKvWrite,
};

// What kRopeKvWrite needs; the fields mean what they mean in RopeKvWriteParams.
struct GemvRopeKvWrite {
  const int32_t* positions;     // [rows]
  const int32_t* slot_mapping;  // [rows]
  const float2* rope_table;     // [max_positions, head_dim / 2]
  __nv_bfloat16* q_out;         // [rows, num_q_heads, kv.head_dim]
  PagedKvView kv;               // the layer's cache
  int num_q_heads;
};

struct GemvParams {
  const __nv_bfloat16* x;       // [rows, in]
  const __nv_bfloat16* weight;  // [out, in]
  void* y;                      // [rows, out] (kSiluMul: [rows, out/2]): bf16, or fp32 when y_fp32
  int rows, in, out;            // in a multiple of 8
  bool y_fp32;
  GemvEpilogue epilogue = GemvEpilogue::kNone;
  GemvRopeKvWrite rope = {};  // kRopeKvWrite only
};

// How many weight groups each warp issues before it waits for the previous kernel at 1-2 rows (1
// or 2; 2 by default, 1 as before, for comparison). Process-wide; applies to later launches and
// graph captures.
void SetGemvEarlyGroups(int groups);

void Gemv(const GemvParams& params, cudaStream_t stream);

}  // namespace duet::kernels
