// cuBLASLt algorithms chosen per projection shape by timing them at load, as TensorRT-LLM's GEMM
// profiler does. cublasGemmEx's default algorithm comes from a heuristic; at a mixed step's few
// hundred rows its tiles can leave SMs idle (the down projection at 384 rows ran at 549 TFLOP/s
// against gate_up's 704 in the same step: docs/BENCHMARKS.md). For each shape, Tune() times the
// default against the candidates cuBLASLt's heuristic offers and the best of them split over K,
// on the model's own weights (one launch per layer, so L2 holds none of them) and a random input
// (the card runs at its power cap in serving; on zeros the products draw less power, run faster
// and rank the candidates differently: docs/BENCHMARKS.md), and keeps the fastest where, timed
// again after the default is timed again, it takes at most kMaxTimeRatio of the default's time. Run() launches a kept algorithm with the workspace given at creation, so
// products keep working inside CUDA-graph capture. On an H100 (docs/BENCHMARKS.md) cuBLAS's
// default is 1.2-1.8x slower than the best candidate at some row counts (gate_up at 448 rows,
// qkv and o at 832), and as fast at most.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "backends/cuda/lt_product.h"

namespace duet::cuda {

class GemmTuning {
 public:
  // y[rows, out] = x[rows, in] · W[out, in]^T, bf16 inputs and output, fp32 accumulation; rows as
  // cuBLAS sees them (CublasRowCapacity).
  struct Shape {
    int rows = 0;
    int in = 0;
    int out = 0;
    bool operator==(const Shape& o) const { return rows == o.rows && in == o.in && out == o.out; }
    template <typename H>
    friend H AbslHashValue(H h, const Shape& s) {
      return H::combine(std::move(h), s.rows, s.in, s.out);
    }
  };
  // What tuning one shape found.
  struct Result {
    Shape shape;
    double default_us = 0;  // the default's time per launch
    double best_us = 0;     // the fastest candidate's
    int candidates = 0;     // configurations timed
    bool kept = false;      // whether the fastest candidate runs the shape from now on
    std::string algorithm;  // the fastest candidate (algorithm id, tile, stages, K split)
  };
  // A candidate is kept where it takes at most this share of the default's time: a smaller gain
  // is within the timing's noise, and a choice that flips between runs changes the numerics.
  static constexpr double kMaxTimeRatio = 0.97;

  static absl::StatusOr<std::unique_ptr<GemmTuning>> Create(cudaStream_t stream, void* workspace,
                                                            size_t workspace_bytes);
  ~GemmTuning();
  GemmTuning(const GemmTuning&) = delete;
  GemmTuning& operator=(const GemmTuning&) = delete;

  // Times `shape` on `weights` (each [out, in], e.g. one per layer), reading x ([rows, in], random
  // values as activations have: kernels::FillRandomBf16) and writing y ([rows, out]), both device
  // scratch. `run_default(w)` launches the default product on this stream. The fastest candidate
  // is kept where it takes at most `max_time_ratio` of the default's time. Not while a graph is
  // being captured on the stream.
  absl::StatusOr<Result> Tune(const Shape& shape, absl::Span<const __nv_bfloat16* const> weights,
                              const __nv_bfloat16* x, __nv_bfloat16* y,
                              const std::function<void(const __nv_bfloat16*)>& run_default,
                              double max_time_ratio = kMaxTimeRatio);
  // Launches the product with the shape's kept algorithm; false (nothing launched) where none was
  // kept. Thread-compatible: Tune() must not run at the same time.
  bool Run(const Shape& shape, const __nv_bfloat16* x, const __nv_bfloat16* weight, __nv_bfloat16* y) const;
  size_t num_kept() const { return kept_.size(); }

 private:
  struct Kept {
    std::unique_ptr<LtProduct> product;
    cublasLtMatmulAlgo_t algo;
  };
  struct Timed {
    double us = 0;  // per launch
    cublasLtMatmulAlgo_t algo;
  };
  // Microseconds per launch of the product with an algorithm over the weights being tuned.
  using TimeAlgorithm = std::function<absl::StatusOr<double>(const cublasLtMatmulAlgo_t&)>;
  GemmTuning(cublasLtHandle_t handle, cudaStream_t stream, void* workspace, size_t workspace_bytes, cudaEvent_t start,
             cudaEvent_t stop)
      : handle_(handle),
        stream_(stream),
        workspace_(workspace),
        workspace_bytes_(workspace_bytes),
        start_(start),
        stop_(stop) {}
  // The heuristic's candidates, then the fastest few split over K where cuBLASLt accepts it: those
  // that launched, timed, fastest first.
  absl::StatusOr<std::vector<Timed>> Search(const LtProduct& p, const TimeAlgorithm& time) const;
  // Microseconds per launch of `launch(w)` over `weights`, the better of kTimedPasses passes after
  // a warm-up pass; negative where a launch fails.
  absl::StatusOr<double> TimePerLaunch(absl::Span<const __nv_bfloat16* const> weights,
                                       const std::function<bool(const __nv_bfloat16*)>& launch);

  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  absl::flat_hash_map<Shape, Kept> kept_;
};

}  // namespace duet::cuda
