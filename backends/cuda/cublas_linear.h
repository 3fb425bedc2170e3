// Dense projections (cuBLAS, and Duet's skinny GEMM for decode batches of at most
// kernels::kGemvPreferredMaxRows rows, where a pure weight stream beats cuBLAS): y[rows, out] = x[rows, in] · W[out, in]^T with bf16 inputs,
// fp32 accumulation and a bf16 or fp32 output — HF's row-major nn.Linear layout, no transposes
// materialized (cuBLAS sees the column-major transpose of each operand).
#pragma once

#include <cstddef>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"

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

class CublasLinear {
 public:
  // `workspace` (device memory, may be shared by nothing else running concurrently) lets cuBLAS
  // run inside CUDA-graph capture without allocating.
  static absl::StatusOr<CublasLinear> Create(cudaStream_t stream, void* workspace, size_t workspace_bytes);
  CublasLinear(CublasLinear&& o) noexcept : handle_(o.handle_), stream_(o.stream_) { o.handle_ = nullptr; }
  CublasLinear& operator=(CublasLinear&&) = delete;
  ~CublasLinear();

  // x: [rows, in] bf16, weight: [out, in] bf16, y: [rows, out] bf16.
  void Forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y, int rows, int in,
               int out) const;
  // Same with an fp32 output (logits).
  void ForwardF32(const __nv_bfloat16* x, const __nv_bfloat16* weight, float* y, int rows, int in, int out) const;
  // Llama's MLP input: gate_up_weight: [2 * inter, in] (gate rows, then up rows), act: [rows,
  // inter] bf16 = silu(gate) * up. Skinny batches compute it in the projection's epilogue;
  // others go through gate_up ([rows, 2 * inter] bf16 scratch) and a SiLU·mul kernel.
  void ForwardSiluMul(const __nv_bfloat16* x, const __nv_bfloat16* gate_up_weight, __nv_bfloat16* gate_up,
                      __nv_bfloat16* act, int rows, int in, int inter) const;

 private:
  CublasLinear(cublasHandle_t handle, cudaStream_t stream) : handle_(handle), stream_(stream) {}
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace duet::cuda
