#include "backends/cuda/lt_product.h"

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace duet::cuda {
absl::Status LtStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuBLASLt ", what, ": ", cublasGetStatusString(status)));
}

namespace {

template <typename T>
absl::Status SetDescAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value,
                              const char* what) {
  return LtStatus(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LtProduct>> LtProduct::Create(cublasLtHandle_t handle, int rows, int in, int out,
                                                              size_t workspace_bytes, int sm_count_target) {
  if (rows <= 0 || in <= 0 || out <= 0) return absl::InvalidArgumentError("a cuBLASLt product needs rows, in and out");
  std::unique_ptr<LtProduct> p(new LtProduct(handle, workspace_bytes));
  absl::Status status = LtStatus(cublasLtMatmulDescCreate(&p->desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor");
  if (status.ok()) status = SetDescAttribute(p->desc_, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "transa");
  if (status.ok()) status = SetDescAttribute(p->desc_, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "transb");
  if (status.ok() && sm_count_target > 0) {
    status = SetDescAttribute(p->desc_, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, int32_t(sm_count_target), "SM target");
  }
  if (status.ok()) status = LtStatus(cublasLtMatrixLayoutCreate(&p->w_, CUDA_R_16BF, in, out, in), "layout");
  if (status.ok()) status = LtStatus(cublasLtMatrixLayoutCreate(&p->x_, CUDA_R_16BF, in, rows, in), "layout");
  if (status.ok()) status = LtStatus(cublasLtMatrixLayoutCreate(&p->y_, CUDA_R_16BF, out, rows, out), "layout");
  if (!status.ok()) return status;
  return p;
}

LtProduct::~LtProduct() {
  if (w_ != nullptr) cublasLtMatrixLayoutDestroy(w_);
  if (x_ != nullptr) cublasLtMatrixLayoutDestroy(x_);
  if (y_ != nullptr) cublasLtMatrixLayoutDestroy(y_);
  if (desc_ != nullptr) cublasLtMatmulDescDestroy(desc_);
}

std::vector<cublasLtMatmulAlgo_t> LtProduct::Candidates(int max, int algo_id) const {
  std::vector<cublasLtMatmulAlgo_t> out;
  cublasLtMatmulPreference_t preference = nullptr;
  if (max <= 0 || cublasLtMatmulPreferenceCreate(&preference) != CUBLAS_STATUS_SUCCESS) return out;
  cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                       sizeof(workspace_bytes_));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(max));
  bool initialized = true;
  if (algo_id >= 0) {
    const uint32_t mode = CUBLASLT_SEARCH_LIMITED_BY_ALGO_ID;
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &mode, sizeof(mode));
    for (cublasLtMatmulHeuristicResult_t& r : results) {
      initialized = initialized && cublasLtMatmulAlgoInit(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF,
                                                          CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, algo_id,
                                                          &r.algo) == CUBLAS_STATUS_SUCCESS;
    }
  }
  int found = 0;
  if (initialized && cublasLtMatmulAlgoGetHeuristic(handle_, desc_, w_, x_, y_, y_, preference, max, results.data(),
                                                    &found) == CUBLAS_STATUS_SUCCESS) {
    for (int k = 0; k < found; ++k) {
      if (results[size_t(k)].state == CUBLAS_STATUS_SUCCESS) out.push_back(results[size_t(k)].algo);
    }
  }
  cublasLtMatmulPreferenceDestroy(preference);
  return out;
}

std::vector<cublasLtMatmulAlgo_t> LtProduct::SplitsOverK(const cublasLtMatmulAlgo_t& algo,
                                                         absl::Span<const int32_t> splits) const {
  std::vector<cublasLtMatmulAlgo_t> out;
  int32_t support = 0;
  size_t written = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support, sizeof(support), &written);
  if (support == 0 || AlgorithmConfig<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1) return out;
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  for (int32_t n : splits) {
    cublasLtMatmulAlgo_t split = algo;
    cublasLtMatmulAlgoConfigSetAttribute(&split, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &n, sizeof(n));
    cublasLtMatmulAlgoConfigSetAttribute(&split, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &reduction, sizeof(reduction));
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle_, desc_, w_, x_, y_, y_, &split, &check) == CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= workspace_bytes_) {
      out.push_back(split);
    }
  }
  return out;
}

cublasStatus_t LtProduct::Launch(const cublasLtMatmulAlgo_t& algo, const __nv_bfloat16* x,
                                 const __nv_bfloat16* weight, __nv_bfloat16* y, void* workspace,
                                 cudaStream_t stream) const {
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle_, desc_, &alpha, weight, w_, x, x_, &beta, y, y_, y, y_, &algo, workspace,
                        workspace_bytes_, stream);
}

std::string DescribeAlgorithm(const cublasLtMatmulAlgo_t& a) {
  char text[160];
  std::snprintf(text, sizeof(text), "id %d tile %u stages %u splitK %d reduction %u swizzle %u custom %u cluster %u",
                AlgorithmConfig<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID),
                AlgorithmConfig<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
                AlgorithmConfig<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                AlgorithmConfig<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                AlgorithmConfig<uint32_t>(a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                AlgorithmConfig<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                AlgorithmConfig<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                unsigned(AlgorithmConfig<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)));
  return text;
}

}  // namespace duet::cuda
