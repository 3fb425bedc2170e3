// The Llama projections' matrix products at the row counts serving meets (decode batches, a
// prompt, a batch of prompts), as CublasLinear runs them (cublasGemmEx, CUBLAS_GEMM_DEFAULT), against
// every algorithm cuBLASLt's heuristic offers for the same product: is there a faster one to pick?
// With --search, also every configuration cuBLASLt accepts beyond the heuristic's list: each
// algorithm id's own candidates, and those again split over K (2-8 ways) where the algorithm can.
//
// With --sustain-ms N, each of the heuristic's candidates (and each split over K 2-4 ways) is also
// timed over the second half of N ms of back-to-back launches: long enough for the card to reach
// its power cap, as serving keeps it. The choice by a short timing (what GemmTuning does at load)
// is set against the choice by the sustained one, both at the sustained cost.
//
//   gemm_shapes_bench [--hidden 4096 --inter 14336 --qkv-out 6144 --rows 64,128,512,2048,8192 --reps 20] [--search]
//                     [--sustain-ms 200]
//
// y[rows, out] = x[rows, in] · W[out, in]^T, bf16 in and out, fp32 accumulation. The weights
// rotate over enough copies to exceed the L2 cache, so every product streams its weight from
// device memory as in a forward pass. Per product: median of --reps timed launches (CUDA events
// around each) after 3 warm-up launches.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "backends/cuda/lt_product.h"
#include "bench/sample_stats.h"
#include "kernels/cuda_check.h"
#include "kernels/elementwise/random_fill.h"

namespace {

void Check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: cuBLAS status %d\n", what, int(s));
    std::exit(1);
  }
}

struct Shape {
  const char* name;
  int in, out;
};

// Whether one launch of `algo` runs: a searched configuration may pass cublasLtMatmulAlgoCheck
// and still be refused at launch.
bool Runs(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }

// Every configuration the search tries: each algorithm id's candidates, and each of those without
// a K split again with 2-8 splits.
std::vector<cublasLtMatmulAlgo_t> SearchSpace(cublasLtHandle_t lt, const duet::cuda::LtProduct& p) {
  std::vector<int> ids(512);
  int num_ids = 0;
  Check(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                                 CUDA_R_16BF, int(ids.size()), ids.data(), &num_ids),
        "algo ids");
  std::vector<cublasLtMatmulAlgo_t> space;
  for (int i = 0; i < num_ids; ++i) {
    for (const cublasLtMatmulAlgo_t& algo : p.Candidates(32, ids[size_t(i)])) {
      space.push_back(algo);
      for (const cublasLtMatmulAlgo_t& split : p.SplitsOverK(algo, {2, 3, 4, 6, 8})) space.push_back(split);
    }
  }
  return space;
}

// Median of `reps` timed runs of `launch(i)` (i: the launch's index, which picks the weight copy).
template <typename Launch>
double MedianUs(cudaStream_t stream, int reps, Launch launch) {
  cudaEvent_t start, stop;
  DUET_CUDA_CHECK(cudaEventCreate(&start));
  DUET_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch(i);
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    DUET_CUDA_CHECK(cudaEventRecord(start, stream));
    launch(i);
    DUET_CUDA_CHECK(cudaEventRecord(stop, stream));
    DUET_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    DUET_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(double(ms) * 1000.0);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return duet::bench::Summarize(std::move(us)).median;
}

// Time per launch over the second half of `sustain_ms` of back-to-back launches of `launch(i)`.
template <typename Launch>
double SustainedUs(cudaStream_t stream, double sustain_ms, Launch launch) {
  const double one_us = MedianUs(stream, 5, launch);
  const int half = std::max(1, int(sustain_ms * 500.0 / one_us));
  cudaEvent_t start, stop;
  DUET_CUDA_CHECK(cudaEventCreate(&start));
  DUET_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < half; ++i) launch(i);
  DUET_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < half; ++i) launch(i);
  DUET_CUDA_CHECK(cudaEventRecord(stop, stream));
  DUET_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  DUET_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return double(ms) * 1000.0 / half;
}

// The heuristic's candidates and each of them split over K 2-4 ways (GemmTuning's search, with
// splits of every candidate rather than of the fastest three).
std::vector<cublasLtMatmulAlgo_t> WithSplits(const duet::cuda::LtProduct& p,
                                             const std::vector<cublasLtMatmulAlgo_t>& algos) {
  std::vector<cublasLtMatmulAlgo_t> out = algos;
  for (const cublasLtMatmulAlgo_t& algo : algos) {
    for (const cublasLtMatmulAlgo_t& split : p.SplitsOverK(algo, {2, 3, 4})) out.push_back(split);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cuBLAS default vs cuBLASLt's algorithms on the Llama projections"};
  int hidden = 4096, inter = 14336, qkv_out = 6144, reps = 20, max_algos = 16;
  std::vector<int> row_counts = {64, 128, 512, 2048, 8192};
  app.add_option("--hidden", hidden);
  app.add_option("--inter", inter);
  app.add_option("--qkv-out", qkv_out, "(heads + 2 * kv_heads) * head_dim");
  app.add_option("--rows", row_counts)->delimiter(',');
  app.add_option("--reps", reps)->check(CLI::Range(1, 1000));
  app.add_option("--algos", max_algos, "cuBLASLt heuristic candidates to time")->check(CLI::Range(1, 64));
  bool search = false;
  app.add_flag("--search", search, "also time every configuration cuBLASLt accepts (slow)");
  double sustain_ms = 0;
  app.add_option("--sustain-ms", sustain_ms, "also time candidates over this long a run, at the power cap")
      ->check(CLI::Range(0.0, 5000.0));
  CLI11_PARSE(app, argc, argv);

  const std::vector<Shape> shapes = {
      {"qkv", hidden, qkv_out}, {"o", hidden, hidden}, {"gate_up", hidden, 2 * inter}, {"down", inter, hidden}};
  cudaStream_t stream;
  DUET_CUDA_CHECK(cudaStreamCreate(&stream));
  cublasHandle_t handle;
  Check(cublasCreate(&handle), "cublasCreate");
  Check(cublasSetStream(handle, stream), "cublasSetStream");
  cublasLtHandle_t lt;
  Check(cublasLtCreate(&lt), "cublasLtCreate");
  const size_t workspace_bytes = size_t(64) << 20;
  void* workspace;
  DUET_CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
  Check(cublasSetWorkspace(handle, workspace, workspace_bytes), "cublasSetWorkspace");

  const int max_rows = *std::max_element(row_counts.begin(), row_counts.end());
  size_t max_weight = 0, max_in = 0, max_out = 0;
  for (const Shape& s : shapes) {
    max_weight = std::max(max_weight, size_t(s.in) * s.out);
    max_in = std::max(max_in, size_t(s.in));
    max_out = std::max(max_out, size_t(s.out));
  }
  // Enough copies of the largest weight to exceed a 50 MB L2 several times over.
  const int copies = int(std::max<size_t>(2, (size_t(256) << 20) / (max_weight * 2) + 1));
  std::vector<__nv_bfloat16*> weights(static_cast<size_t>(copies));
  for (auto& w : weights) {
    DUET_CUDA_CHECK(cudaMalloc(&w, max_weight * 2));
    duet::kernels::FillRandomBf16(w, max_weight, uint64_t(&w - weights.data()), 0.025f, stream);
  }
  __nv_bfloat16 *x, *y;
  DUET_CUDA_CHECK(cudaMalloc(&x, size_t(max_rows) * max_in * 2));
  DUET_CUDA_CHECK(cudaMalloc(&y, size_t(max_rows) * max_out * 2));
  duet::kernels::FillRandomBf16(x, size_t(max_rows) * max_in, 99, 0.025f, stream);
  DUET_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::printf("%-8s %6s %6s %6s | %9s %8s %8s | %9s %8s %6s | %s\n", "proj", "rows", "in", "out", "default us",
              "TFLOP/s", "W GB/s", "best us", "TFLOP/s", "gain", "algos timed");
  for (int rows : row_counts) {
    for (const Shape& s : shapes) {
      const double flops = 2.0 * rows * s.in * s.out;
      const double weight_bytes = 2.0 * s.in * s.out;
      const float alpha = 1.0f, beta = 0.0f;
      // As CublasLinear: column-major y^T[out, rows] = W (op T) · x^T.
      const auto run_default = [&](int i) {
        Check(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, s.out, rows, s.in, &alpha, weights[size_t(i % copies)],
                           CUDA_R_16BF, s.in, x, CUDA_R_16BF, s.in, &beta, y, CUDA_R_16BF, s.out, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx");
      };
      const double default_us = MedianUs(stream, reps, run_default);

      const absl::StatusOr<std::unique_ptr<duet::cuda::LtProduct>> made =
          duet::cuda::LtProduct::Create(lt, rows, s.in, s.out, workspace_bytes);
      if (!made.ok()) {
        std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
        return 1;
      }
      const duet::cuda::LtProduct& product = **made;
      const auto run_algo = [&](const cublasLtMatmulAlgo_t& algo, int i) {
        return product.Launch(algo, x, weights[size_t(i % copies)], y, workspace, stream);
      };
      // Median time of one configuration, or a negative value where a launch is refused.
      auto time_algo = [&](const cublasLtMatmulAlgo_t& algo, int timed_reps) {
        if (!Runs(run_algo(algo, 0))) return -1.0;
        return MedianUs(stream, timed_reps, [&](int i) { Check(run_algo(algo, i), "cublasLtMatmul"); });
      };
      double best_us = 1e30;
      int timed = 0;
      for (const cublasLtMatmulAlgo_t& algo : product.Candidates(max_algos)) {
        const double us = time_algo(algo, reps);
        if (us < 0) continue;
        best_us = std::min(best_us, us);
        ++timed;
      }
      std::string searched;
      if (search) {
        // Every configuration briefly, then the ten fastest with the full repetitions.
        std::vector<std::pair<double, cublasLtMatmulAlgo_t>> quick;
        for (const cublasLtMatmulAlgo_t& algo : SearchSpace(lt, product)) {
          const double us = time_algo(algo, 3);
          if (us >= 0) quick.emplace_back(us, algo);
        }
        std::sort(quick.begin(), quick.end(), [](const auto& l, const auto& r) { return l.first < r.first; });
        double search_us = 1e30;
        std::string config;
        for (size_t k = 0; k < std::min<size_t>(10, quick.size()); ++k) {
          const double us = time_algo(quick[k].second, reps);
          if (us >= 0 && us < search_us) {
            search_us = us;
            config = duet::cuda::DescribeAlgorithm(quick[k].second);
          }
        }
        char text[256];
        std::snprintf(text, sizeof(text), " | searched %zu: %.1f us (%.2fx default) %s", quick.size(), search_us,
                      default_us / search_us, config.c_str());
        searched = text;
      }
      std::string sustained;
      if (sustain_ms > 0) {
        // Short (median of --reps single launches) and sustained per candidate; each choice's
        // sustained cost.
        struct Timing {
          double short_us, sustained_us;
          cublasLtMatmulAlgo_t algo;
        };
        std::vector<Timing> timings;
        for (const cublasLtMatmulAlgo_t& algo : WithSplits(product, product.Candidates(max_algos))) {
          const double short_us = time_algo(algo, reps);
          if (short_us < 0) continue;
          const double sustained_us =
              SustainedUs(stream, sustain_ms, [&](int i) { Check(run_algo(algo, i), "cublasLtMatmul"); });
          timings.push_back({short_us, sustained_us, algo});
        }
        const double default_sustained = SustainedUs(stream, sustain_ms, run_default);
        if (!timings.empty()) {
          auto by = [&](auto key) {
            return *std::min_element(timings.begin(), timings.end(),
                                     [&](const Timing& l, const Timing& r) { return key(l) < key(r); });
          };
          const Timing by_short = by([](const Timing& t) { return t.short_us; });
          const Timing by_sustained = by([](const Timing& t) { return t.sustained_us; });
          char text[512];
          std::snprintf(text, sizeof(text),
                        " | sustained %.0f ms, %zu candidates: default %.1f us, chosen by short timing %.1f us "
                        "(short %.1f), chosen by sustained %.1f us (%.3fx; %s)",
                        sustain_ms, timings.size(), default_sustained, by_short.sustained_us, by_short.short_us,
                        by_sustained.sustained_us, by_short.sustained_us / by_sustained.sustained_us,
                        duet::cuda::DescribeAlgorithm(by_sustained.algo).c_str());
          sustained = text;
        }
      }
      std::printf("%-8s %6d %6d %6d | %9.1f %8.1f %8.0f | %9.1f %8.1f %5.2fx | %d%s\n", s.name, rows, s.in, s.out,
                  default_us, flops / default_us * 1e-6, weight_bytes / default_us * 1e-3, best_us,
                  flops / best_us * 1e-6, default_us / best_us, timed, (searched + sustained).c_str());
      std::fflush(stdout);  // a long search may be stopped: keep the rows done
    }
  }
  return 0;
}
