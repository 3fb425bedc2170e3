// Dense projections: y[rows, out] = x[rows, in] · W[out, in]^T with bf16 inputs,
// fp32 accumulation and a bf16 or fp32 output — HF's row-major nn.Linear layout, no transposes
// materialized (cuBLAS sees the column-major transpose of each operand). Decode-sized batches go
// to Duet's weight-streaming kernels, which beat cuBLAS there (kernels/gemm/*_bench): up to
// kernels::kGemvPreferredMaxRows rows the warp-per-feature Gemv, up to kSkinnyGemmPreferredMaxRows
// rows (by default) the tensor-core SkinnyGemm. Prompt-sized batches (from `wide_gemm_min_rows`
// rows) go to WideGemm, which tiles their rows without padding and fuses SiLU·mul; the rest, and
// fp32 outputs beyond the skinny range, to cuBLAS.
#pragma once

#include <cstddef>
#include <memory>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "backends/cuda/gemm_tuning.h"
#include "kernels/gemm/skinny_gemm.h"
#include "kernels/gemm/wide_gemm.h"

namespace duet::cuda {

// cuBLAS sees row counts above the skinny-GEMM range rounded up to a multiple of this. It picks
// its algorithm per shape, and the lookup for a shape it has not seen costs up to a millisecond
// per projection: a step of a token count first met paid 5-25 ms (speculation and mixed prefill
// steps meet many counts). Rounded, a server meets a few hundred shapes. Callers' x and y must
// have room for the rounded rows; what lands there is ignored.
inline constexpr int kCublasRowQuantum = 64;
inline int64_t CublasRowCapacity(int64_t rows) {
  return (rows + kCublasRowQuantum - 1) / kCublasRowQuantum * kCublasRowQuantum;
}

// From how many rows WideGemm takes the bf16 products by default: none (0). It is correct (its
// tests pass on an H100) but slower than cuBLAS from 128 rows up (0.74-0.97x of the projections,
// BENCHMARKS.md, "Changes measured, kept or not"); cuda_llama_bench --wide-gemm-min-rows N, or
// $DUET_WIDE_GEMM_MIN_ROWS for every command (backends/executor_factory.cpp), turns it on.
inline constexpr int kWideGemmDefaultMinRows = 0;

// Up to how many rows (as cuBLAS sees them) the bf16 projections' cuBLASLt algorithms are tuned
// at load by default (GemmTuning): the decode batches and mixed steps, where cuBLAS's default
// heuristic has its cliffs (a 64 + 384-row mixed step of Llama-3-8B: 18.7 ms with it, 15.2
// tuned, on an H100). Llama-3-8B's 64 shapes take 2-3 s on an H200, 2.6-5 s on H100s. cuda_llama_bench
// --gemm-tuning-max-rows N, or $DUET_GEMM_TUNING_MAX_ROWS for every command, changes it; 0: none.
inline constexpr int kGemmTuningDefaultMaxRows = 1024;

class CublasLinear {
 public:
  // `workspace` (device memory, may be shared by nothing else running concurrently) lets cuBLAS
  // run inside CUDA-graph capture without allocating. Products of more than Gemv's rows and at
  // most `skinny_gemm_max_rows` (<= kernels::kSkinnyGemmMaxRows; 0: none) go to SkinnyGemm, bf16
  // products of at least `wide_gemm_min_rows` (0: none) to WideGemm.
  static absl::StatusOr<CublasLinear> Create(cudaStream_t stream, void* workspace, size_t workspace_bytes,
                                             int skinny_gemm_max_rows = kernels::kSkinnyGemmPreferredMaxRows,
                                             int wide_gemm_min_rows = kWideGemmDefaultMinRows);
  CublasLinear(CublasLinear&& o) noexcept
      : handle_(o.handle_),
        stream_(o.stream_),
        num_sms_(o.num_sms_),
        skinny_gemm_max_rows_(o.skinny_gemm_max_rows_),
        wide_gemm_min_rows_(o.wide_gemm_min_rows_),
        wide_gemm_capacity_(o.wide_gemm_capacity_),
        tuning_(std::move(o.tuning_)) {
    o.handle_ = nullptr;
  }
  CublasLinear& operator=(CublasLinear&&) = delete;
  ~CublasLinear();

  // x: [rows, in] bf16, weight: [out, in] bf16, y: [rows, out] bf16.
  void Forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y, int rows, int in,
               int out) const;
  // Same with an fp32 output (logits).
  void ForwardF32(const __nv_bfloat16* x, const __nv_bfloat16* weight, float* y, int rows, int in, int out) const;
  // Llama's MLP input: gate_up_weight: [2 * inter, in] (gate rows, then up rows), act: [rows,
  // inter] bf16 = silu(gate) * up. Gemv's and WideGemm's batches compute it in the projection's
  // epilogue; others go through gate_up ([rows, 2 * inter] bf16 scratch) and a SiLU·mul kernel.
  void ForwardSiluMul(const __nv_bfloat16* x, const __nv_bfloat16* gate_up_weight, __nv_bfloat16* gate_up,
                      __nv_bfloat16* act, int rows, int in, int inter) const;

  // Whether a bf16 product of `rows` rows reaches cuBLAS (not Gemv, SkinnyGemm or WideGemm).
  bool RunsOnCublas(int rows) const;
  // Times the bf16 product y[rows, in] · W[out, in]^T as cuBLAS runs it (rows rounded) on
  // `weights` (the projection's W of each layer) against cuBLASLt's candidates, and runs it with
  // the fastest from now on where that beats the default (GemmTuning). x and y: device scratch of
  // CublasRowCapacity(rows) × in and × out. Before any graph capture.
  absl::StatusOr<GemmTuning::Result> Tune(int rows, int in, int out, absl::Span<const __nv_bfloat16* const> weights,
                                          const __nv_bfloat16* x, __nv_bfloat16* y,
                                          double max_time_ratio = GemmTuning::kMaxTimeRatio);

 private:
  CublasLinear(cublasHandle_t handle, cudaStream_t stream, int num_sms, int skinny_gemm_max_rows,
               int wide_gemm_min_rows, const kernels::WideGemmCapacity& wide_gemm_capacity,
               std::unique_ptr<GemmTuning> tuning)
      : handle_(handle),
        stream_(stream),
        num_sms_(num_sms),
        skinny_gemm_max_rows_(skinny_gemm_max_rows),
        wide_gemm_min_rows_(wide_gemm_min_rows),
        wide_gemm_capacity_(wide_gemm_capacity),
        tuning_(std::move(tuning)) {}
  // Whether SkinnyGemm takes this product (else Gemv's or cuBLAS's rows).
  bool UseSkinnyGemm(const void* x, const void* weight, int rows, int in) const;
  // Whether WideGemm takes this bf16 product.
  bool UseWideGemm(const void* x, const void* weight, int rows, int in) const;
  void RunSkinnyGemm(const __nv_bfloat16* x, const __nv_bfloat16* weight, void* y, bool y_fp32, int rows, int in,
                     int out) const;

  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int num_sms_ = 0;
  int skinny_gemm_max_rows_ = 0;
  int wide_gemm_min_rows_ = 0;
  kernels::WideGemmCapacity wide_gemm_capacity_{};  // asked when wide_gemm_min_rows_ > 0
  std::unique_ptr<GemmTuning> tuning_;               // the bf16 products' tuned algorithms
};

}  // namespace duet::cuda
