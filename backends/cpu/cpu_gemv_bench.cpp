// The few-row matrix products of a CPU decode/verification step: OpenBLAS (sgemv for one row,
// sgemm otherwise) against BatchedGemv (engine/cpu_gemv.h), for the projection shapes of a model
// (default: tiny-code-llama's). Prints the best-of-N milliseconds per product and per layer+head
// "step" (qkv, o, gate_up, down of every layer plus the LM head), by row count; for the batched
// GEMV on one thread also the best thread CPU time, the figure a loaded machine moves least, and
// on the shared pool (ParallelFor::Shared(), one thread per core), as LlamaCpu runs it.
//
//   build/bin/cpu_gemv_bench [--hidden 512] [--intermediate 1408] [--q-rows 512] [--kv-rows 256]
//                            [--vocab 8192] [--layers 6] [--rows 1,2,4,8,9,12,16,24,32] [--repeat 20]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <random>
#include <vector>

#include "CLI/CLI.hpp"
#include "backends/cpu/cpu_gemv.h"

namespace {

struct Shape {
  const char* name;
  int64_t n, k;
};

void OpenBlas(const float* x, const float* w, float* y, int64_t rows, int64_t n, int64_t k) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, int(n), int(k), 1.0f, w, int(k), x, 1, 0.0f, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(n), int(k), 1.0f, x, int(k), w, int(k), 0.0f, y,
              int(n));
}

double ThreadCpuMs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) * 1e-6;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Few-row GEMM on the CPU: OpenBLAS vs BatchedGemv"};
  int64_t hidden = 512, inter = 1408, q_rows = 512, kv_rows = 256, vocab = 8192, layers = 6;
  std::vector<int64_t> row_counts = {1, 2, 4, 8, 9, 12, 16, 24, 32};
  int repeat = 20;
  app.add_option("--hidden", hidden);
  app.add_option("--intermediate", inter);
  app.add_option("--q-rows", q_rows);
  app.add_option("--kv-rows", kv_rows);
  app.add_option("--vocab", vocab);
  app.add_option("--layers", layers);
  app.add_option("--rows", row_counts)->delimiter(',');
  app.add_option("--repeat", repeat)->check(CLI::Range(1, 10000));
  CLI11_PARSE(app, argc, argv);

  const std::vector<Shape> shapes = {{"qkv", q_rows + 2 * kv_rows, hidden},
                                     {"o", hidden, q_rows},
                                     {"gate_up", 2 * inter, hidden},
                                     {"down", hidden, inter},
                                     {"lm_head", vocab, hidden}};
  // Every layer has its own weights (as in the model), so a step streams them all from memory.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<std::vector<float>>> weights(shapes.size());
  for (size_t s = 0; s < shapes.size(); ++s) {
    const int64_t copies = s + 1 == shapes.size() ? 1 : layers;
    for (int64_t c = 0; c < copies; ++c) {
      std::vector<float>& w = weights[s].emplace_back(size_t(shapes[s].n * shapes[s].k));
      for (float& v : w) v = dist(rng);
    }
  }
  const int64_t max_rows = *std::max_element(row_counts.begin(), row_counts.end());
  std::vector<float> x(size_t(max_rows * std::max(hidden, inter)));
  for (float& v : x) v = dist(rng);
  std::vector<float> y(size_t(max_rows * std::max({vocab, 2 * inter, q_rows + 2 * kv_rows})));

  std::printf("BatchedGemv kernel: %s; pool of %d threads; ms, best of %d; 'step' = every layer's 4 products + LM "
              "head; ratio = openblas / pooled\n",
              duet::BatchedGemvUsesAvx2() ? "AVX2/FMA" : "portable", duet::ParallelFor::Shared().num_threads(), repeat);
  std::printf("%5s %-8s %12s %12s %12s %12s %9s\n", "rows", "product", "openblas", "batched", "batched cpu",
              "pooled", "ratio");
  for (int64_t rows : row_counts) {
    double step_blas = 0, step_gemv = 0, step_gemv_cpu = 0, step_pooled = 0;
    for (size_t s = 0; s < shapes.size(); ++s) {
      // Best of `repeat` wall-clock times; for the single-threaded kernel also its thread's CPU
      // time, which a loaded machine disturbs less (other processes take turns on the core).
      auto time = [&](auto&& fn, double* best_cpu) {
        double best = 1e30;
        for (int i = 0; i < repeat; ++i) {
          const auto start = std::chrono::steady_clock::now();
          const double cpu_start = ThreadCpuMs();
          for (const std::vector<float>& w : weights[s]) fn(x.data(), w.data(), y.data(), rows, shapes[s].n, shapes[s].k);
          best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
          if (best_cpu != nullptr) *best_cpu = std::min(*best_cpu, ThreadCpuMs() - cpu_start);
        }
        return best;
      };
      double gemv_cpu = 1e30;
      const double blas = time(OpenBlas, nullptr);
      const double gemv = time(
          [](const float* x, const float* w, float* y, int64_t r, int64_t n, int64_t k) {
            duet::BatchedGemv(x, w, y, r, n, k);
          },
          &gemv_cpu);
      const double pooled = time(
          [](const float* x, const float* w, float* y, int64_t r, int64_t n, int64_t k) {
            duet::BatchedGemv(x, w, y, r, n, k, &duet::ParallelFor::Shared());
          },
          nullptr);
      step_blas += blas;
      step_gemv += gemv;
      step_gemv_cpu += gemv_cpu;
      step_pooled += pooled;
      const int64_t copies = int64_t(weights[s].size());
      std::printf("%5lld %-8s %12.3f %12.3f %12.3f %12.3f %8.2fx\n", static_cast<long long>(rows), shapes[s].name,
                  blas / copies, gemv / copies, gemv_cpu / copies, pooled / copies, blas / pooled);
    }
    std::printf("%5lld %-8s %12.3f %12.3f %12.3f %12.3f %8.2fx\n", static_cast<long long>(rows), "step", step_blas,
                step_gemv, step_gemv_cpu, step_pooled, step_blas / step_pooled);
    std::fflush(stdout);
  }
  return 0;
}
