#include "backends/cuda/gemm_tuning.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace duet::cuda {
namespace {

// The heuristic's candidates timed per shape, and how many of the fastest are tried split over K.
constexpr int kHeuristicCandidates = 8;
constexpr int kSplitCandidates = 3;
constexpr int32_t kSplits[] = {2, 3, 4};
// Launches per pass: weights spread over the layers (more than L2 holds), and passes timed.
constexpr size_t kLaunchesPerPass = 8;
constexpr int kTimedPasses = 2;

absl::Status CudaOk(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GemmTuning>> GemmTuning::Create(cudaStream_t stream, void* workspace,
                                                               size_t workspace_bytes) {
  cublasLtHandle_t handle = nullptr;
  DUET_RETURN_IF_ERROR(LtStatus(cublasLtCreate(&handle), "create"));
  cudaEvent_t start = nullptr, stop = nullptr;
  absl::Status events = CudaOk(cudaEventCreate(&start), "event");
  if (events.ok()) events = CudaOk(cudaEventCreate(&stop), "event");
  if (!events.ok()) {
    if (start != nullptr) cudaEventDestroy(start);
    cublasLtDestroy(handle);
    return events;
  }
  return std::unique_ptr<GemmTuning>(new GemmTuning(handle, stream, workspace, workspace_bytes, start, stop));
}

GemmTuning::~GemmTuning() {
  kept_.clear();  // the products, before the handle they were made with
  cudaEventDestroy(start_);
  cudaEventDestroy(stop_);
  cublasLtDestroy(handle_);
}

absl::StatusOr<double> GemmTuning::TimePerLaunch(absl::Span<const __nv_bfloat16* const> weights,
                                                 const std::function<bool(const __nv_bfloat16*)>& launch) {
  // Weights spread over the whole list: consecutive launches read different layers' weights.
  const size_t n = std::min(weights.size(), kLaunchesPerPass);
  std::vector<const __nv_bfloat16*> pass;
  for (size_t i = 0; i < n; ++i) pass.push_back(weights[i * weights.size() / n]);
  for (const __nv_bfloat16* w : pass) {
    if (!launch(w)) return -1.0;
  }
  float best_ms = 0;
  for (int timed = 0; timed < kTimedPasses; ++timed) {
    DUET_RETURN_IF_ERROR(CudaOk(cudaEventRecord(start_, stream_), "event record"));
    for (const __nv_bfloat16* w : pass) {
      if (!launch(w)) return -1.0;
    }
    DUET_RETURN_IF_ERROR(CudaOk(cudaEventRecord(stop_, stream_), "event record"));
    DUET_RETURN_IF_ERROR(CudaOk(cudaEventSynchronize(stop_), "timing a GEMM"));
    float ms = 0;
    DUET_RETURN_IF_ERROR(CudaOk(cudaEventElapsedTime(&ms, start_, stop_), "event time"));
    best_ms = timed == 0 ? ms : std::min(best_ms, ms);
  }
  return double(best_ms) * 1000.0 / double(n);
}

absl::StatusOr<std::vector<GemmTuning::Timed>> GemmTuning::Search(const LtProduct& p, const TimeAlgorithm& time) const {
  std::vector<Timed> timed;
  auto time_all = [&](const std::vector<cublasLtMatmulAlgo_t>& algos) -> absl::Status {
    for (const cublasLtMatmulAlgo_t& algo : algos) {
      DUET_ASSIGN_OR_RETURN(const double us, time(algo));
      if (us > 0) timed.push_back({us, algo});
    }
    return absl::OkStatus();
  };
  const auto faster = [](const Timed& l, const Timed& r) { return l.us < r.us; };
  DUET_RETURN_IF_ERROR(time_all(p.Candidates(kHeuristicCandidates)));
  std::sort(timed.begin(), timed.end(), faster);
  std::vector<cublasLtMatmulAlgo_t> splits;
  for (size_t k = 0; k < std::min<size_t>(kSplitCandidates, timed.size()); ++k) {
    for (const cublasLtMatmulAlgo_t& split : p.SplitsOverK(timed[k].algo, kSplits)) splits.push_back(split);
  }
  DUET_RETURN_IF_ERROR(time_all(splits));
  std::stable_sort(timed.begin(), timed.end(), faster);
  return timed;
}

absl::StatusOr<GemmTuning::Result> GemmTuning::Tune(const Shape& shape, absl::Span<const __nv_bfloat16* const> weights,
                                                    const __nv_bfloat16* x, __nv_bfloat16* y,
                                                    const std::function<void(const __nv_bfloat16*)>& run_default,
                                                    double max_time_ratio) {
  if (shape.rows <= 0 || shape.in <= 0 || shape.out <= 0 || weights.empty()) {
    return absl::InvalidArgumentError("a GEMM shape to tune needs rows, in, out and weights");
  }
  kept_.erase(shape);  // tuned again: start from the default
  auto time_default = [&] {
    return TimePerLaunch(weights, [&](const __nv_bfloat16* w) {
      run_default(w);
      return true;
    });
  };
  Result result;
  result.shape = shape;
  DUET_ASSIGN_OR_RETURN(result.default_us, time_default());
  DUET_ASSIGN_OR_RETURN(std::unique_ptr<LtProduct> product,
                        LtProduct::Create(handle_, shape.rows, shape.in, shape.out, workspace_bytes_));
  auto time_algo = [&](const cublasLtMatmulAlgo_t& algo) {
    return TimePerLaunch(weights, [&](const __nv_bfloat16* w) {
      return product->Launch(algo, x, w, y, workspace_, stream_) == CUBLAS_STATUS_SUCCESS;
    });
  };
  DUET_ASSIGN_OR_RETURN(const std::vector<Timed> timed, Search(*product, time_algo));
  result.candidates = int(timed.size());
  if (timed.empty()) return result;
  const Timed& best = timed.front();
  result.best_us = best.us;
  result.algorithm = DescribeAlgorithm(best.algo);
  if (result.best_us <= max_time_ratio * result.default_us) {
    // Timed again, the default first: a gain that came from the GPU getting busier or idler during
    // the search (another process tuning beside this one) does not hold up.
    DUET_ASSIGN_OR_RETURN(const double default_again, time_default());
    DUET_ASSIGN_OR_RETURN(const double best_again, time_algo(best.algo));
    result.default_us = std::min(result.default_us, default_again);
    result.best_us = std::max(result.best_us, best_again);
  }
  result.kept = result.best_us <= max_time_ratio * result.default_us;
  if (result.kept) kept_.emplace(shape, Kept{std::move(product), best.algo});
  return result;
}

bool GemmTuning::Run(const Shape& shape, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                     __nv_bfloat16* y) const {
  // The heuristic's candidates assume 256-byte aligned operands (cuBLASLt's default preference).
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 256 == 0; };
  if (!aligned(x) || !aligned(weight) || !aligned(y)) return false;
  const auto it = kept_.find(shape);
  if (it == kept_.end()) return false;
  // It launched while it was tuned, on the same shape and workspace: failing now is a bug or a
  // dead device.
  if (const cublasStatus_t s = it->second.product->Launch(it->second.algo, x, weight, y, workspace_, stream_);
      s != CUBLAS_STATUS_SUCCESS) {
    DUET_LOG(FATAL) << "cublasLtMatmul with a tuned algorithm failed: " << cublasGetStatusString(s);
  }
  return true;
}

}  // namespace duet::cuda
