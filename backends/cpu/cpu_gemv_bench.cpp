// The matrix products of a CPU step: OpenBLAS (sgemv for one row, sgemm otherwise) against
// BatchedGemv (backends/cpu/cpu_gemv.h), which LlamaCpu runs for every product, for the projection
// shapes of a model (default: tiny-code-llama's). The default rows are decode and verification
// steps; prefill-sized ones take e.g. --rows 64,512,2048 --repeat 5. Prints milliseconds per
// product and per layer+head "step" (qkv, o, gate_up, down of every layer plus the LM head), by
// row count: the median of --repeat timed runs after --warmup untimed ones, with the p10-p90
// spread; for the batched GEMV on one thread also its thread CPU time, the figure a loaded machine
// moves least, and on the shared pool (ParallelFor::Shared(), one thread per core), as LlamaCpu
// runs it. The weights are random values rounded to bfloat16, as a bf16 checkpoint's (BatchedGemv
// stores them as bfloat16); with --weights fp16 rounded to float16 (stored as float16), with f32
// random float32s (stored as float32).
//
//   build/bin/cpu_gemv_bench [--hidden 512] [--intermediate 1408] [--q-rows 512] [--kv-rows 256]
//                            [--vocab 8192] [--layers 6] [--rows 1,2,4,8,9,12,16,24,32] [--repeat 20]
//                            [--warmup 3] [--weights bf16|fp16|f32]
#include <cblas.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "backends/cpu/cpu_gemv.h"
#include "bench/sample_stats.h"

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

// Timed runs of one product over all its layers' weights.
struct Samples {
  std::vector<double> wall_ms, cpu_ms;  // cpu_ms: this thread's CPU time, same runs
};

// "median (p10-p90)" of `ms` divided by `per`.
std::string Cell(const std::vector<double>& ms, double per) {
  const duet::bench::SampleStats s = duet::bench::Summarize(ms);
  char text[48];
  std::snprintf(text, sizeof(text), "%7.3f (%.2f-%.2f)", s.median / per, s.p10 / per, s.p90 / per);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU GEMM: OpenBLAS vs BatchedGemv"};
  int64_t hidden = 512, inter = 1408, q_rows = 512, kv_rows = 256, vocab = 8192, layers = 6;
  std::vector<int64_t> row_counts = {1, 2, 4, 8, 9, 12, 16, 24, 32};
  int repeat = 20, warmup = 3;
  std::string weight_values = "bf16";
  app.add_option("--hidden", hidden);
  app.add_option("--intermediate", inter);
  app.add_option("--q-rows", q_rows);
  app.add_option("--kv-rows", kv_rows);
  app.add_option("--vocab", vocab);
  app.add_option("--layers", layers);
  app.add_option("--rows", row_counts)->delimiter(',');
  app.add_option("--repeat", repeat, "timed runs per product")->check(CLI::Range(1, 10000));
  app.add_option("--warmup", warmup, "untimed runs per product before them")->check(CLI::Range(0, 10000));
  app.add_option("--weights", weight_values,
                 "bf16 / fp16: random values rounded to bfloat16 / float16; f32: random float32s")
      ->check(CLI::IsMember({"bf16", "fp16", "f32"}));
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
  std::vector<std::vector<duet::PackedWeights>> packed(shapes.size());  // BatchedGemv's, packed as at load
  for (size_t s = 0; s < shapes.size(); ++s) {
    const int64_t copies = s + 1 == shapes.size() ? 1 : layers;
    for (int64_t c = 0; c < copies; ++c) {
      std::vector<float>& w = weights[s].emplace_back(size_t(shapes[s].n * shapes[s].k));
      for (float& v : w) {
        v = dist(rng);
        if (weight_values == "bf16") v = std::bit_cast<float>(std::bit_cast<uint32_t>(v) & 0xffff0000u);
        if (weight_values == "fp16") v = float(_Float16(v));
      }
      packed[s].emplace_back(w.data(), shapes[s].n, shapes[s].k);
    }
  }
  const int64_t max_rows = *std::max_element(row_counts.begin(), row_counts.end());
  std::vector<float> x(size_t(max_rows * std::max(hidden, inter)));
  for (float& v : x) v = dist(rng);
  std::vector<float> y(size_t(max_rows * std::max({vocab, 2 * inter, q_rows + 2 * kv_rows})));

  std::printf("BatchedGemv kernel: %s, %s panels; pool of %d threads; ms, median (p10-p90) of %d runs after %d "
              "warm-up; 'step' = every layer's 4 products + LM head, each run's sum; ratio = openblas / pooled "
              "medians\n",
              duet::BatchedGemvUsesAvx2() ? "AVX2/FMA" : "portable", weight_values.c_str(),
              duet::ParallelFor::Shared().num_threads(), repeat, warmup);
  std::printf("%5s %-8s %22s %22s %22s %22s %9s\n", "rows", "product", "openblas", "batched", "batched cpu", "pooled",
              "ratio");
  for (int64_t rows : row_counts) {
    // The step's run i is the sum of every product's run i.
    Samples step_blas, step_gemv, step_pooled;
    auto add_to_step = [&](Samples& step, const Samples& product) {
      step.wall_ms.resize(product.wall_ms.size());
      step.cpu_ms.resize(product.cpu_ms.size());
      for (size_t i = 0; i < product.wall_ms.size(); ++i) step.wall_ms[i] += product.wall_ms[i];
      for (size_t i = 0; i < product.cpu_ms.size(); ++i) step.cpu_ms[i] += product.cpu_ms[i];
    };
    for (size_t s = 0; s < shapes.size(); ++s) {
      // Wall-clock and thread CPU time of each run; the CPU time matters for the single-threaded
      // kernel, which a loaded machine disturbs less that way (other processes take turns on the core).
      // fn(c) runs the product with the weights of copy c.
      auto time = [&](auto&& fn) {
        Samples out;
        for (int i = -warmup; i < repeat; ++i) {
          const auto start = std::chrono::steady_clock::now();
          const double cpu_start = ThreadCpuMs();
          for (size_t c = 0; c < weights[s].size(); ++c) fn(c);
          if (i < 0) continue;
          out.wall_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
          out.cpu_ms.push_back(ThreadCpuMs() - cpu_start);
        }
        return out;
      };
      const Samples blas =
          time([&](size_t c) { OpenBlas(x.data(), weights[s][c].data(), y.data(), rows, shapes[s].n, shapes[s].k); });
      const Samples gemv = time([&](size_t c) { duet::BatchedGemv(x.data(), packed[s][c], y.data(), rows); });
      const Samples pooled = time([&](size_t c) {
        duet::BatchedGemv(x.data(), packed[s][c], y.data(), rows, &duet::ParallelFor::Shared());
      });
      add_to_step(step_blas, blas);
      add_to_step(step_gemv, gemv);
      add_to_step(step_pooled, pooled);
      const double copies = double(weights[s].size());
      std::printf("%5lld %-8s %22s %22s %22s %22s %8.2fx\n", static_cast<long long>(rows), shapes[s].name,
                  Cell(blas.wall_ms, copies).c_str(), Cell(gemv.wall_ms, copies).c_str(),
                  Cell(gemv.cpu_ms, copies).c_str(), Cell(pooled.wall_ms, copies).c_str(),
                  duet::bench::Summarize(blas.wall_ms).median / duet::bench::Summarize(pooled.wall_ms).median);
    }
    std::printf("%5lld %-8s %22s %22s %22s %22s %8.2fx\n", static_cast<long long>(rows), "step",
                Cell(step_blas.wall_ms, 1).c_str(), Cell(step_gemv.wall_ms, 1).c_str(),
                Cell(step_gemv.cpu_ms, 1).c_str(), Cell(step_pooled.wall_ms, 1).c_str(),
                duet::bench::Summarize(step_blas.wall_ms).median / duet::bench::Summarize(step_pooled.wall_ms).median);
    std::fflush(stdout);
  }
  return 0;
}
