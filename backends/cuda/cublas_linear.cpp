#include "backends/cuda/cublas_linear.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "backends/cuda/device_memory.h"
#include "common/logging.h"
#include "kernels/elementwise/activation.h"
#include "kernels/gemm/gemv.h"

namespace duet::cuda {
namespace {

// cuBLAS failing on valid shapes and pointers is a bug or a dead device.
void CheckCublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    DUET_LOG(FATAL) << "cuBLAS " << what << " failed: " << cublasGetStatusString(status);
  }
}

void Gemm(cublasHandle_t handle, const __nv_bfloat16* x, const __nv_bfloat16* weight, void* y,
          cudaDataType_t y_type, int rows, int in, int out) {
  if (rows == 0) return;
  rows = int(CublasRowCapacity(rows));  // the padding rows compute garbage nobody reads
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major view: y^T[out, rows] = W^T^T ... i.e. op(A) = W (stored [in, out] col-major, so
  // transposed), op(B) = x^T (stored [in, rows] col-major, as is).
  CheckCublas(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, out, rows, in, &alpha, weight, CUDA_R_16BF, in, x,
                           CUDA_R_16BF, in, &beta, y, y_type, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
}

}  // namespace

absl::StatusOr<CublasLinear> CublasLinear::Create(cudaStream_t stream, void* workspace, size_t workspace_bytes,
                                                  int skinny_gemm_max_rows, int wide_gemm_min_rows) {
  if (skinny_gemm_max_rows < 0 || skinny_gemm_max_rows > kernels::kSkinnyGemmMaxRows) {
    return absl::InvalidArgumentError(
        absl::StrCat("skinny GEMM rows must be 0-", kernels::kSkinnyGemmMaxRows, ", not ", skinny_gemm_max_rows));
  }
  int device = 0, num_sms = 0, major = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return absl::InternalError(absl::StrCat("device attributes: ", cudaGetErrorString(e)));
  if (wide_gemm_min_rows < 0) {
    return absl::InvalidArgumentError(absl::StrCat("wide GEMM rows must be >= 0, not ", wide_gemm_min_rows));
  }
  if (major < 9) skinny_gemm_max_rows = wide_gemm_min_rows = 0;  // their kernels need Hopper (wgmma, TMA, clusters)
  if (skinny_gemm_max_rows > 0) kernels::PrepareSkinnyGemm(num_sms);
  kernels::WideGemmCapacity wide_gemm_capacity{};
  if (wide_gemm_min_rows > 0) {
    kernels::PrepareWideGemm();
    wide_gemm_capacity = kernels::QueryWideGemmCapacity();
  }
  cublasHandle_t handle = nullptr;
  if (cublasStatus_t s = cublasCreate(&handle); s == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory creating the cuBLAS handle: ", DeviceMemoryReport()));
  } else if (s != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasCreate: ", cublasGetStatusString(s)));
  }
  CheckCublas(cublasSetStream(handle, stream), "cublasSetStream");
  CheckCublas(cublasSetWorkspace(handle, workspace, workspace_bytes), "cublasSetWorkspace");
  CheckCublas(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  absl::StatusOr<std::unique_ptr<GemmTuning>> tuning = GemmTuning::Create(stream, workspace, workspace_bytes);
  if (!tuning.ok()) {
    cublasDestroy(handle);
    return tuning.status();
  }
  return CublasLinear(handle, stream, num_sms, skinny_gemm_max_rows, wide_gemm_min_rows, wide_gemm_capacity,
                      *std::move(tuning));
}

CublasLinear::~CublasLinear() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

bool CublasLinear::UseSkinnyGemm(const void* x, const void* weight, int rows, int in) const {
  return rows > kernels::kGemvPreferredMaxRows && rows <= skinny_gemm_max_rows_ &&
         in % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0;
}

bool CublasLinear::UseWideGemm(const void* x, const void* weight, int rows, int in) const {
  return wide_gemm_min_rows_ > 0 && rows >= wide_gemm_min_rows_ && in % 8 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(weight) % 16 == 0;
}

void CublasLinear::RunSkinnyGemm(const __nv_bfloat16* x, const __nv_bfloat16* weight, void* y, bool y_fp32, int rows,
                                 int in, int out) const {
  kernels::SkinnyGemmParams p{x, weight, y, rows, in, out, y_fp32};
  kernels::SkinnyGemm(p, kernels::PlanSkinnyGemm(in, out, num_sms_), stream_);
}

void CublasLinear::Forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y, int rows,
                           int in, int out) const {
  if (rows >= 1 && rows <= kernels::kGemvPreferredMaxRows && in % 8 == 0) {
    kernels::Gemv({x, weight, y, rows, in, out, false}, stream_);
    return;
  }
  if (UseSkinnyGemm(x, weight, rows, in)) {
    RunSkinnyGemm(x, weight, y, false, rows, in, out);
    return;
  }
  if (UseWideGemm(x, weight, rows, in)) {
    kernels::WideGemm({x, weight, y, rows, in, out, false},
                      kernels::PlanWideGemm(rows, in, out, false, wide_gemm_capacity_), stream_);
    return;
  }
  if (tuning_->Run({int(CublasRowCapacity(rows)), in, out}, x, weight, y)) return;
  Gemm(handle_, x, weight, y, CUDA_R_16BF, rows, in, out);
}

bool CublasLinear::RunsOnCublas(int rows) const {
  return rows > kernels::kGemvPreferredMaxRows && rows > skinny_gemm_max_rows_ &&
         (wide_gemm_min_rows_ == 0 || rows < wide_gemm_min_rows_);
}

absl::StatusOr<GemmTuning::Result> CublasLinear::Tune(int rows, int in, int out,
                                                      absl::Span<const __nv_bfloat16* const> weights,
                                                      const __nv_bfloat16* x, __nv_bfloat16* y,
                                                      double max_time_ratio) {
  return tuning_->Tune(
      {int(CublasRowCapacity(rows)), in, out}, weights, x, y,
      [&](const __nv_bfloat16* w) { Gemm(handle_, x, w, y, CUDA_R_16BF, rows, in, out); }, max_time_ratio);
}

void CublasLinear::ForwardF32(const __nv_bfloat16* x, const __nv_bfloat16* weight, float* y, int rows, int in,
                              int out) const {
  if (rows >= 1 && rows <= kernels::kGemvPreferredMaxRows && in % 8 == 0) {
    kernels::Gemv({x, weight, y, rows, in, out, true}, stream_);
    return;
  }
  if (UseSkinnyGemm(x, weight, rows, in)) {
    RunSkinnyGemm(x, weight, y, true, rows, in, out);
    return;
  }
  Gemm(handle_, x, weight, y, CUDA_R_32F, rows, in, out);
}

void CublasLinear::ForwardSiluMul(const __nv_bfloat16* x, const __nv_bfloat16* gate_up_weight,
                                  __nv_bfloat16* gate_up, __nv_bfloat16* act, int rows, int in, int inter) const {
  if (rows >= 1 && rows <= kernels::kGemvPreferredMaxRows && in % 8 == 0 && inter % 4 == 0) {
    kernels::Gemv({x, gate_up_weight, act, rows, in, 2 * inter, false, kernels::GemvEpilogue::kSiluMul}, stream_);
    return;
  }
  if (UseWideGemm(x, gate_up_weight, rows, in)) {
    kernels::WideGemm({x, gate_up_weight, act, rows, in, 2 * inter, true},
                      kernels::PlanWideGemm(rows, in, 2 * inter, true, wide_gemm_capacity_), stream_);
    return;
  }
  Forward(x, gate_up_weight, gate_up, rows, in, 2 * inter);
  kernels::SiluAndMul(gate_up, act, rows, inter, stream_);
}

}  // namespace duet::cuda
