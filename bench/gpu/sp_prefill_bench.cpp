// Sequence-parallel (ring-attention) prefill on virtual ranks of one GPU, against one-rank
// prefill of the same prompt: the output check (last-token logits within bf16 tolerance, the same
// greedy token), the measured per-rank work, the bytes a ring step passes, and the prefill time
// projected for N GPUs from them.
//
//   sp_prefill_bench --model DIR [--tokens 8192,32768,131072] [--ranks 2,4,8] [--repeats 3]
//                    [--link-gbps 900]
//   sp_prefill_bench --model DIR --devices 0,1,2,3 [--ranks 2,4] ...
//
// With --devices, the ranks are a group of executors (backends/cuda/sequence_parallel_group.h),
// rank r on devices[r]: measured prefill time at each rank count against one rank, scaling
// efficiency (1-rank time / (N x N-rank time)), the communication not hidden (how long a rank's
// compute stream waited for ring blocks; the most and the mean over ranks) and the output check.
// Devices may repeat: --devices 0,0,0,0 runs the group's code on one GPU (correct, not faster).
//
// Projection (stated assumptions, printed with the table):
//   - per-rank attention = the virtual ranks' attention / N (zigzag balances the causal work);
//   - per-rank dense work (projections, norms) = the virtual ranks' dense time / N, scaled by
//     how much slower a layer's four GEMMs run per row at T/N rows than at T (measured here);
//   - a ring step's block (K and V of a rank's rows, bf16) moves at --link-gbps (NVLink: ~900 GB/s
//     per H200) while the previous step's attention runs; the part that does not fit behind
//     it is exposed;
//   - projected = layers x (dense/N + sum over steps of attention/N + exposed).
// The real multi-GPU run (one rank per GPU, NCCL) is scripts/gpu/h200_sp_scaling.sh's job.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <utility>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime.h>

#include "backends/cuda/cublas_linear.h"
#include "backends/cuda/llama_cuda.h"
#include "backends/cuda/sequence_parallel_group.h"
#include "bench/sample_stats.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

struct Run {
  double ms = 0;
  std::vector<float> logits;
};

absl::StatusOr<Run> Prefill(LlamaCuda& model, KvCache& cache, const std::vector<int32_t>& prompt,
                            const std::vector<int32_t>& table) {
  const SequenceChunk chunk{prompt, 0, table, 1, 1};
  Run run;
  const auto start = Clock::now();
  absl::Status s = model.Forward({chunk}, cache, run.logits);
  run.ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  if (!s.ok()) return s;
  return run;
}

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Median time of one layer's four projections (QKV, O, gate/up, down) at `rows` rows, cuBLAS.
class LayerGemmTimer {
 public:
  LayerGemmTimer(const ModelConfig& c, int max_rows) : c_(c) {
    const size_t hidden = size_t(c.hidden_size), inter = size_t(c.intermediate_size);
    const size_t qkv = size_t(c.num_heads + 2 * c.num_kv_heads) * size_t(c.head_dim);
    const size_t widest = std::max({qkv, 2 * inter, hidden});
    const size_t rows = size_t(cuda::CublasRowCapacity(max_rows));
    for (auto [ptr, elems] : {std::pair{&x_, rows * std::max(hidden, inter)},
                              std::pair{&y_, rows * widest}, std::pair{&w_, widest * std::max(hidden, inter)}}) {
      cudaMalloc(ptr, elems * 2);
      cudaMemset(*ptr, 0x3c, elems * 2);  // finite bf16 values
    }
    cudaMalloc(&workspace_, size_t(32) << 20);
    cudaStreamCreate(&stream_);
    linear_.emplace(*cuda::CublasLinear::Create(stream_, workspace_, size_t(32) << 20));
  }
  ~LayerGemmTimer() {
    linear_.reset();
    for (void* p : {x_, y_, w_, workspace_}) cudaFree(p);
    cudaStreamDestroy(stream_);
  }
  double Ms(int rows) {
    const int hidden = int(c_.hidden_size), inter = int(c_.intermediate_size);
    const int qkv = int((c_.num_heads + 2 * c_.num_kv_heads) * c_.head_dim), q = int(c_.num_heads * c_.head_dim);
    auto x = static_cast<__nv_bfloat16*>(x_), y = static_cast<__nv_bfloat16*>(y_), w = static_cast<__nv_bfloat16*>(w_);
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<double> ms;
    for (int i = 0; i < 7; ++i) {
      cudaEventRecord(start, stream_);
      linear_->Forward(x, w, y, rows, hidden, qkv);
      linear_->Forward(x, w, y, rows, q, hidden);
      linear_->Forward(x, w, y, rows, hidden, 2 * inter);
      linear_->Forward(x, w, y, rows, inter, hidden);
      cudaEventRecord(stop, stream_);
      cudaEventSynchronize(stop);
      float t = 0;
      cudaEventElapsedTime(&t, start, stop);
      if (i >= 2) ms.push_back(t);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return bench::Summarize(ms).median;
  }

 private:
  const ModelConfig& c_;
  void *x_ = nullptr, *y_ = nullptr, *w_ = nullptr, *workspace_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::optional<cuda::CublasLinear> linear_;
};

int64_t Argmax(const std::vector<float>& v) { return std::max_element(v.begin(), v.end()) - v.begin(); }

// Median wall time of `repeats` prefills (after the first, untimed one, whose logits it returns).
absl::StatusOr<Run> Measure(LlamaCuda& model, KvCache& cache, const std::vector<int32_t>& prompt,
                            const std::vector<int32_t>& table, int repeats) {
  absl::StatusOr<Run> first = Prefill(model, cache, prompt, table);
  if (!first.ok()) return first.status();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    absl::StatusOr<Run> r = Prefill(model, cache, prompt, table);
    if (!r.ok()) return r.status();
    ms.push_back(r->ms);
  }
  first->ms = bench::Summarize(ms).median;
  return first;
}

// `t` token ids drawn with seed t (the same prompt for every rank count).
std::vector<int32_t> RandomPrompt(int t, int64_t vocab_size) {
  std::mt19937 rng(static_cast<uint32_t>(t));
  std::vector<int32_t> prompt(static_cast<size_t>(t));
  for (int32_t& id : prompt) id = int32_t(rng() % uint32_t(vocab_size));
  return prompt;
}

// Blocks 0, 1, 2, ... for a prompt of `t` tokens.
std::vector<int32_t> IdentityBlockTable(int t, int block_size) {
  std::vector<int32_t> table(static_cast<size_t>(t / block_size + 2));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  return table;
}

// The group table (--devices): measured, not projected.
int RunGroupBench(LlamaCuda& m, KvCache& cache, const std::vector<int>& tokens, const std::vector<int>& ranks,
                  const std::vector<int>& devices, const std::string& transport, int repeats, int block_size) {
  const ModelConfig& c = m.config();
  std::printf("%7s %5s %-12s %9s %6s %10s %10s %8s %6s %10s %12s %12s\n", "tokens", "ranks", "devices", "rel_err",
              "greedy", "1rank_ms", "group_ms", "speedup", "eff", "step_MiB", "exposed_max", "exposed_mean");
  for (int t : tokens) {
    const std::vector<int32_t> prompt = RandomPrompt(t, c.vocab_size);
    const std::vector<int32_t> table = IdentityBlockTable(t, block_size);
    if (absl::Status s = m.EnableSequenceParallel(1, 0); !s.ok()) return 1;
    absl::StatusOr<Run> one = Measure(m, cache, prompt, table, repeats);
    if (!one.ok()) {
      std::fprintf(stderr, "%d tokens, 1 rank: %s\n", t, std::string(one.status().message()).c_str());
      return 1;
    }
    std::printf("%7d %5d %-12d %9s %6s %10.1f\n", t, 1, devices[0], "-", "-", one->ms);
    for (int n : ranks) {
      if (n < 2 || n > int(devices.size())) continue;
      const std::vector<int> group_devices(devices.begin(), devices.begin() + n);
      if (absl::Status s = m.EnableSequenceParallel(n, 1, group_devices, transport); !s.ok()) {
        std::fprintf(stderr, "%d ranks: %s\n", n, std::string(s.message()).c_str());
        return 1;
      }
      m.sequence_parallel_group()->set_measure_exposed(true);
      absl::StatusOr<Run> sp = Measure(m, cache, prompt, table, repeats);
      if (!sp.ok()) {
        std::fprintf(stderr, "%d tokens, %d ranks: %s\n", t, n, std::string(sp.status().message()).c_str());
        return 1;
      }
      const cuda::SequenceParallelGroup::Exposed& e = m.sequence_parallel_group()->last_exposed();
      std::string names;
      for (int d : group_devices) names += (names.empty() ? "" : ",") + std::to_string(d);
      std::printf("%7d %5d %-12s %9.2e %6s %10.1f %10.1f %8.2f %5.0f%% %10.1f %12.2f %12.2f\n", t, n, names.c_str(),
                  RelativeError(sp->logits, one->logits), Argmax(sp->logits) == Argmax(one->logits) ? "same" : "DIFF",
                  one->ms, sp->ms, one->ms / sp->ms, 100.0 * one->ms / (n * sp->ms), double(e.step_bytes) / (1 << 20),
                  e.max_rank_ms, e.mean_rank_ms);
    }
    if (absl::Status s = m.EnableSequenceParallel(1, 0); !s.ok()) return 1;  // frees the group
  }
  std::printf("transport %s; group_ms: median prefill (last-token logits to the host); eff: 1-rank time / (N x group time); "
              "step_MiB: K+V one rank receives per ring step; exposed_*: ms a rank's compute waited for ring "
              "blocks over the whole prefill (the last measured run)\n", transport.c_str());
  return 0;
}

int RunBench(int argc, char** argv) {
  CLI::App app{"sequence-parallel prefill on virtual ranks of one GPU"};
  std::string model_dir;
  std::vector<int> tokens = {8192, 32768, 131072}, ranks = {2, 4, 8};
  int repeats = 3;
  double link_gbps = 900;
  app.add_option("--model", model_dir)->required();
  app.add_option("--tokens", tokens)->delimiter(',');
  app.add_option("--ranks", ranks)->delimiter(',');
  app.add_option("--repeats", repeats);
  app.add_option("--link-gbps", link_gbps, "inter-GPU bandwidth per GPU for the projection (GB/s)");
  std::vector<int> devices;
  app.add_option("--devices", devices, "a group of executors, rank r on devices[r] (measured, not projected)")
      ->delimiter(',');
  std::string transport = "peer";
  app.add_option("--sp-transport", transport, "the group's ring transport: peer or nccl");
  CLI11_PARSE(app, argc, argv);

  const int max_tokens = *std::max_element(tokens.begin(), tokens.end());
  LlamaCudaOptions options;
  options.max_num_seqs = 4;
  options.max_num_batched_tokens = max_tokens;
  options.max_model_len = max_tokens + 64;
  options.cuda_graphs = false;
  if (!devices.empty()) options.device = devices[0];
  auto model = LlamaCuda::Load(model_dir, options);
  if (!model.ok()) {
    std::fprintf(stderr, "load: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  LlamaCuda& m = **model;
  const ModelConfig& c = m.config();
  const int block_size = 16;
  auto cache = m.CreateKvCache(max_tokens / block_size + 8, block_size);
  if (!cache.ok()) {
    std::fprintf(stderr, "cache: %s\n", std::string(cache.status().message()).c_str());
    return 1;
  }
  std::printf("model: %lld layers, hidden %lld, %lld heads / %lld KV heads x %lld; link %.0f GB/s (assumed)\n",
              (long long)c.num_layers, (long long)c.hidden_size, (long long)c.num_heads, (long long)c.num_kv_heads,
              (long long)c.head_dim, link_gbps);
  if (!devices.empty()) return RunGroupBench(m, **cache, tokens, ranks, devices, transport, repeats, block_size);
  LayerGemmTimer gemms(c, max_tokens);
  std::printf("%7s %5s %9s %6s %10s %10s %8s %12s %10s %10s %10s %10s %12s %8s\n", "tokens", "ranks", "rel_err",
              "greedy", "1rank_ms", "virt_ms", "gemm_x", "rank_lyr_ms", "step_MiB", "link_us", "expos_us", "d2d_us",
              "proj_ms", "eff");
  const double layers = double(c.num_layers);
  for (int t : tokens) {
    const std::vector<int32_t> prompt = RandomPrompt(t, c.vocab_size);
    const std::vector<int32_t> table = IdentityBlockTable(t, block_size);
    if (absl::Status s = m.EnableSequenceParallel(1, 0); !s.ok()) return 1;
    absl::StatusOr<Run> one = Measure(m, **cache, prompt, table, repeats);
    if (!one.ok()) {
      std::fprintf(stderr, "%d tokens, 1 rank: %s\n", t, std::string(one.status().message()).c_str());
      return 1;
    }
    std::printf("%7d %5d %9s %6s %10.1f\n", t, 1, "-", "-", one->ms);
    for (int n : ranks) {
      if (absl::Status s = m.EnableSequenceParallel(n, 1); !s.ok()) {
        std::fprintf(stderr, "%d ranks: %s\n", n, std::string(s.message()).c_str());
        return 1;
      }
      cuda::RingStepEvents events(n);
      m.set_ring_step_events(&events, int(c.num_layers / 2));
      absl::StatusOr<Run> sp = Measure(m, **cache, prompt, table, repeats);
      m.set_ring_step_events(nullptr, 0);
      if (!sp.ok()) {
        std::fprintf(stderr, "%d tokens, %d ranks: %s\n", t, n, std::string(sp.status().message()).c_str());
        return 1;
      }
      const std::vector<float> attention = events.AttentionMs(), copies = events.CopyMs();
      double attention_layer = 0;
      for (float a : attention) attention_layer += a;
      const double dense_layer = std::max(0.0, sp->ms / layers - attention_layer);
      const int64_t rank_rows = 2 * ((int64_t(t) + 2 * n - 1) / (2 * n));
      const double step_bytes = double(rank_rows) * double(c.num_kv_heads * c.head_dim) * 2 /*K,V*/ * 2 /*bf16*/;
      const double link_ms = step_bytes / (link_gbps * 1e9) * 1e3;
      double exposed_ms = 0, d2d_ms = 0;
      for (int k = 1; k < n; ++k) {
        exposed_ms += std::max(0.0, link_ms - attention[size_t(k - 1)] / n);
        d2d_ms += copies[size_t(k)];
      }
      // Per row, the GEMMs at T/N rows against T rows (>= 1: smaller GEMMs use the GPU less well).
      const double gemm_slowdown = std::max(1.0, n * gemms.Ms(t / n) / gemms.Ms(t));
      const double rank_layer_ms = dense_layer / n * gemm_slowdown + attention_layer / n;
      const double projected_ms = layers * (rank_layer_ms + exposed_ms);
      std::printf("%7d %5d %9.2e %6s %10.1f %10.1f %8.2f %12.3f %10.1f %10.1f %10.1f %10.1f %12.1f %7.0f%%\n", t, n,
                  RelativeError(sp->logits, one->logits), Argmax(sp->logits) == Argmax(one->logits) ? "same" : "DIFF",
                  one->ms, sp->ms, gemm_slowdown, rank_layer_ms, step_bytes / (1 << 20), link_ms * 1e3, exposed_ms * 1e3,
                  n > 1 ? d2d_ms / (n - 1) * 1e3 : 0.0, projected_ms, 100.0 * one->ms / (n * projected_ms));
    }
  }
  std::printf("gemm_x: a layer's GEMMs per row at T/N rows vs T rows; rank_lyr_ms: one rank's compute per layer "
              "(virtual ranks' attention / N + dense / N x gemm_x); step_MiB: one rank's K/V block per "
              "ring step; link_us: its time on the link; expos_us: per layer, link time not hidden behind the "
              "previous step's attention; d2d_us: the one-GPU device copy of a step (all ranks' blocks); eff: "
              "1-rank time / (N x projected)\n");
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) { return duet::RunBench(argc, argv); }
