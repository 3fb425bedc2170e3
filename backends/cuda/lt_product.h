// One projection as a cuBLASLt product, y[rows, out] = x[rows, in] · W[out, in]^T, bf16 operands,
// fp32 accumulation, in the column-major view CublasLinear gives cuBLAS: y^T[out, rows] =
// op_T(W stored [in, out]) · x^T (stored [in, rows]). Its descriptors, the heuristic's candidate
// algorithms, their splits over K, and a launch: what the load-time GEMM tuning (gemm_tuning.h)
// and the GEMM benchmarks (bench/gpu) share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace duet::cuda {

class LtProduct {
 public:
  // Launches use `workspace_bytes` of workspace at most. `sm_count_target` > 0 asks the heuristic
  // for algorithms that leave the device's other SMs free.
  static absl::StatusOr<std::unique_ptr<LtProduct>> Create(cublasLtHandle_t handle, int rows, int in, int out,
                                                           size_t workspace_bytes, int sm_count_target = 0);
  ~LtProduct();
  LtProduct(const LtProduct&) = delete;
  LtProduct& operator=(const LtProduct&) = delete;

  // At most `max` of the heuristic's candidates, fastest first by its estimate; limited to
  // algorithm `algo_id` where >= 0 (none where the library has no such id for these types).
  std::vector<cublasLtMatmulAlgo_t> Candidates(int max, int algo_id = -1) const;
  // `algo` split over K each of `splits` ways, partial sums reduced in fp32 in the workspace, where
  // the algorithm can split, does not split already, and cublasLtMatmulAlgoCheck accepts the split
  // within the workspace.
  std::vector<cublasLtMatmulAlgo_t> SplitsOverK(const cublasLtMatmulAlgo_t& algo,
                                                absl::Span<const int32_t> splits) const;
  // Stream-ordered; a candidate may still be refused here (its status says so).
  cublasStatus_t Launch(const cublasLtMatmulAlgo_t& algo, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                        __nv_bfloat16* y, void* workspace, cudaStream_t stream) const;

 private:
  LtProduct(cublasLtHandle_t handle, size_t workspace_bytes) : handle_(handle), workspace_bytes_(workspace_bytes) {}

  const cublasLtHandle_t handle_;
  const size_t workspace_bytes_;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t w_ = nullptr, x_ = nullptr, y_ = nullptr;  // [in, out], [in, rows], [out, rows]
};

// OK, or an internal error naming the cuBLASLt call `what` and its status.
absl::Status LtStatus(cublasStatus_t status, const char* what);

// One of a cuBLASLt algorithm's configuration attributes (T: the attribute's documented type).
template <typename T>
T AlgorithmConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written);
  return value;
}

// A description of a cuBLASLt algorithm for logs: id, tile, stages, K split.
std::string DescribeAlgorithm(const cublasLtMatmulAlgo_t& algo);

}  // namespace duet::cuda
