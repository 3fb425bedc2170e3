// Decode and prefill speed of the CUDA backend on one checkpoint, next to the limits measured in
// the same run: the device-memory read bandwidth of a streaming-read kernel (the decode floor: the
// bytes a step reads, weights and KV, over that bandwidth) and cuBLAS bf16 matmul throughput (the
// prefill ceiling). The device copy bandwidth (read + write) is printed beside them for reference.
//
// With --mixed-prompt, it also times steps that carry a prompt chunk beside a batch's decode rows
// (chunked prefill; a decode worker prefilling prompts itself) against the two steps apart. A chunk
// given as N@S continues a prompt: N tokens from position S, attending to the S before them.
//
//   cuda_llama_bench --model DIR [--batch 1,8,32,128] [--context 1024] [--prefill 1024,8192 | --prefill none]
//                    [--mixed-prompt 256,512,256@320] [--no-pdl] [--no-fusion] [--no-mixed-launch] [--no-last-layer-rows] [--early-groups 1|2] [--no-cuda-graphs]
//                    [--skinny-gemm-max-rows N] [--wide-gemm-min-rows N] [--gemm-tuning-max-rows N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "backends/cuda/llama_cuda.h"
#include "bench/gpu/read_bandwidth.h"
#include "bench/sample_stats.h"
#include "kernels/elementwise/random_fill.h"
#include "kernels/gemm/gemv.h"
#include "kernels/gemm/skinny_gemm.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

// Device-to-device copy of 2 GiB; bytes read plus written per second.
double MeasureCopyBandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *a = nullptr, *b = nullptr;
  cudaMalloc(&a, bytes);
  cudaMalloc(&b, bytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> secs;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(start);
    cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 2) secs.push_back(ms / 1e3);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / bench::Summarize(secs).median;
}

// cuBLAS bf16 GEMM 8192^3 with fp32 accumulation, FLOP/s: on random operands (as a model's), or
// on one repeated value, which draws less power and so stays clear of the card's power cap longer.
// 100 launches (~0.15 s on an H200), the median of the last 80: long enough to meet the cap.
double MeasureMatmulPeak(bool random_operands) {
  const int n = 8192;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  cudaMalloc(&a, size_t(n) * n * 2);
  cudaMalloc(&b, size_t(n) * n * 2);
  cudaMalloc(&c, size_t(n) * n * 2);
  if (random_operands) {
    kernels::FillRandomBf16(static_cast<__nv_bfloat16*>(a), size_t(n) * n, 1, 1.f, nullptr);
    kernels::FillRandomBf16(static_cast<__nv_bfloat16*>(b), size_t(n) * n, 2, 1.f, nullptr);
  } else {
    cudaMemset(a, 0x3c, size_t(n) * n * 2);  // 0x3c3c: 0.0115 everywhere
    cudaMemset(b, 0x3c, size_t(n) * n * 2);
  }
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1, beta = 0;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> secs;
  for (int i = 0; i < 100; ++i) {
    cudaEventRecord(start);
    cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta, c,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i >= 20) secs.push_back(ms / 1e3);
  }
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * double(n) * n * n / bench::Summarize(secs).median;
}

// The bytes one decode step must read from device memory. Weights: every tensor once, except the
// embedding table, of which the step gathers only its `batch` rows (tied embeddings are read in
// full anyway, as the LM head, so they stay counted; the gathered rows come on top). KV: each
// sequence's keys and values of every layer, up to and including the token the step writes.
struct DecodeStepBytes {
  double weights = 0;
  double kv = 0;
};

DecodeStepBytes BytesReadByDecodeStep(const ModelConfig& c, int64_t weight_bytes, int batch, int64_t tokens_per_seq) {
  const double row_bytes = double(c.hidden_size) * 2.0;  // bf16
  const double table_bytes = double(c.vocab_size) * row_bytes;
  const double kv_bytes_per_token = 2.0 * double(c.num_layers * c.num_kv_heads * c.head_dim) * 2.0;
  DecodeStepBytes bytes;
  bytes.weights = double(weight_bytes) - (c.tie_word_embeddings ? 0.0 : table_bytes) + batch * row_bytes;
  bytes.kv = double(batch) * double(tokens_per_seq) * kv_bytes_per_token;
  return bytes;
}

// The items of a comma-separated option; "none" has none.
std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> out;
  if (text == "none") return out;
  for (size_t at = 0; at < text.size();) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    out.push_back(text.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::vector<int> ParseList(const std::string& text) {
  std::vector<int> out;
  for (const std::string& item : SplitList(text)) out.push_back(std::stoi(item));
  return out;
}

// A prompt chunk of a mixed step: `tokens` new tokens from `start` ("N" or "N@S").
struct MixedChunk {
  int tokens = 0;
  int start = 0;
};

std::vector<MixedChunk> ParseMixedChunks(const std::string& text) {
  std::vector<MixedChunk> out;
  for (const std::string& item : SplitList(text)) {
    const size_t sign = item.find('@');
    out.push_back({std::stoi(item.substr(0, sign)), sign == std::string::npos ? 0 : std::stoi(item.substr(sign + 1))});
  }
  return out;
}

// The load's GEMM tuning, one line per shape: cuBLAS's default against cuBLASLt's fastest candidate.
void PrintGemmTuning(const std::vector<cuda::GemmTuning::Result>& tuning) {
  if (tuning.empty()) return;
  std::printf("GEMM tuning at load (us per launch, weights not in L2)\n%6s %6s %6s %9s %9s %6s %5s  %s\n", "rows", "in",
              "out", "default", "fastest", "ratio", "kept", "fastest candidate");
  for (const cuda::GemmTuning::Result& r : tuning) {
    std::printf("%6d %6d %6d %9.1f %9.1f %6.3f %5s  %s\n", r.shape.rows, r.shape.in, r.shape.out, r.default_us,
                r.best_us, r.best_us > 0 ? r.best_us / r.default_us : 0.0, r.kept ? "yes" : "no", r.algorithm.c_str());
  }
}

int Run(int argc, char** argv) {
  CLI::App app{"CUDA backend decode/prefill benchmark"};
  std::string model_dir, batches = "1,8,32,128", prefills = "1024,8192", mixed_prompts = "none";
  int context = 1024, steps = 64;
  bool graphs = true, pdl = true, fusion = true, mixed_launch = true, last_layer_rows = true;
  int skinny_max_rows = kernels::kSkinnyGemmPreferredMaxRows;
  int wide_min_rows = cuda::kWideGemmDefaultMinRows;
  int tuning_max_rows = cuda::kGemmTuningDefaultMaxRows;
  int early_groups = 2;
  app.add_option("--model", model_dir, "checkpoint directory")->required();
  app.add_option("--batch", batches, "decode batch sizes");
  app.add_option("--context", context, "tokens already in each sequence's KV cache when decode starts");
  app.add_option("--steps", steps, "decode steps per batch size (the first 4 are not timed)")->check(CLI::Range(5, 100000));
  app.add_option("--prefill", prefills, "single-sequence prefill lengths");
  app.add_option("--mixed-prompt", mixed_prompts,
                 "prompt chunks to time beside each batch's decode rows: N tokens, or N@S (from position S)");
  app.add_flag("!--no-cuda-graphs", graphs, "run decode steps eagerly");
  app.add_flag("!--no-pdl", pdl, "launch kernels without programmatic dependent launch");
  app.add_flag("!--no-fusion", fusion, "RoPE/KV write and SiLU·mul as separate kernels at batch <= 2");
  app.add_flag("!--no-mixed-launch", mixed_launch,
               "a mixed step's decode and prefill attention as two launches instead of one");
  app.add_flag("!--no-last-layer-rows", last_layer_rows,
               "the last layer's output projection and MLP on every row, not only the rows that give logits");
  app.add_option("--skinny-gemm-max-rows", skinny_max_rows,
                 "projections of 3 to N rows through SkinnyGemm, larger ones through cuBLAS (0: all through cuBLAS)")
      ->check(CLI::Range(0, kernels::kSkinnyGemmMaxRows));
  app.add_option("--wide-gemm-min-rows", wide_min_rows,
                 "projections of at least N rows through WideGemm (0: through cuBLAS)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--gemm-tuning-max-rows", tuning_max_rows,
                 "tune the cuBLAS projections' algorithms at load up to N rows (0: cuBLAS's default algorithm)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--early-groups", early_groups, "weight groups the skinny GEMM issues before it waits (1 or 2)")
      ->check(CLI::IsMember({1, 2}));
  CLI11_PARSE(app, argc, argv);
  kernels::SetGemvEarlyGroups(early_groups);

  const std::vector<int> batch_sizes = ParseList(batches), prefill_lens = ParseList(prefills);
  const std::vector<MixedChunk> mixed_chunks = ParseMixedChunks(mixed_prompts);
  if (batch_sizes.empty()) {
    std::fprintf(stderr, "--batch needs at least one batch size\n");
    return 1;
  }
  const int max_batch = *std::max_element(batch_sizes.begin(), batch_sizes.end());
  int max_prefill = prefill_lens.empty() ? 0 : *std::max_element(prefill_lens.begin(), prefill_lens.end());
  for (const MixedChunk& m : mixed_chunks) max_prefill = std::max(max_prefill, m.start + m.tokens + max_batch);
  LlamaCudaOptions options;
  options.max_num_seqs = max_batch + (mixed_chunks.empty() ? 0 : 1);  // a mixed step's prompt is one more
  options.max_num_batched_tokens = std::max(max_prefill, 8192);
  options.max_model_len = std::max<int64_t>(max_prefill, context + steps + 16);
  options.cuda_graphs = graphs;
  options.programmatic_launch = pdl;
  options.fused_decode_epilogues = fusion;
  options.mixed_attention_launch = mixed_launch;
  options.last_layer_logit_rows_only = last_layer_rows;
  options.skinny_gemm_max_rows = skinny_max_rows;
  options.wide_gemm_min_rows = wide_min_rows;
  options.gemm_tuning_max_rows = tuning_max_rows;
  const auto load_started = std::chrono::steady_clock::now();
  auto loaded = LlamaCuda::Load(model_dir, options);
  if (!loaded.ok()) {
    std::fprintf(stderr, "load: %s\n", std::string(loaded.status().message()).c_str());
    return 1;
  }
  LlamaCuda& model = **loaded;
  const ModelConfig& c = model.config();
  std::printf("load %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - load_started).count());
  PrintGemmTuning(model.gemm_tuning());
  // Decode sequences own `context + steps` tokens each; the prefill sequence reuses the first ones.
  const int block_size = 16;
  const int blocks_per_seq = (context + steps + 16 + block_size - 1) / block_size;
  const int prefill_blocks = (max_prefill + block_size - 1) / block_size;
  const int64_t num_blocks = std::max<int64_t>(int64_t(max_batch) * blocks_per_seq, prefill_blocks);
  absl::StatusOr<std::unique_ptr<KvCache>> created = model.CreateKvCache(num_blocks, block_size);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<KvCache> cache = std::move(*created);

  const bench::ReadBandwidth read_bw = bench::MeasureReadBandwidth();
  if (read_bw.error != cudaSuccess) {
    std::fprintf(stderr, "read bandwidth: %s\n", cudaGetErrorString(read_bw.error));
    return 1;
  }
  const double copy_bw = MeasureCopyBandwidth();
  const double matmul_peak = MeasureMatmulPeak(/*random_operands=*/true);
  const double matmul_peak_constant = MeasureMatmulPeak(/*random_operands=*/false);
  const double weight_bytes = double(model.weight_bytes());
  std::printf("model %s: %.2f GB of bf16 weights (embedding table %.2f GB, %s), %lld layers, hidden %lld, vocab %lld\n",
              model_dir.c_str(), weight_bytes / 1e9, double(c.vocab_size) * double(c.hidden_size) * 2.0 / 1e9,
              c.tie_word_embeddings ? "tied: read in full as the LM head" : "untied: a step reads its rows",
              (long long)c.num_layers, (long long)c.hidden_size, (long long)c.vocab_size);
  std::printf("read ceiling %.0f GB/s (streaming read of %.1f GiB, median of %d launches, fastest of %zu shapes):\n%s",
              read_bw.bytes_per_s / 1e9, double(read_bw.buffer_bytes) / double(size_t(1) << 30), read_bw.repeats,
              read_bw.shapes.size(), read_bw.Describe().c_str());
  std::printf("device copy %.0f GB/s (read+write, for reference), cuBLAS bf16 matmul 8192^3 %.0f TFLOP/s on random "
              "operands (the prefill's \"of matmul\"), %.0f on a repeated value\n",
              copy_bw / 1e9, matmul_peak / 1e12, matmul_peak_constant / 1e12);

  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(max_batch));
  for (int s = 0; s < max_batch; ++s) {
    tables[size_t(s)].resize(size_t(blocks_per_seq));
    std::iota(tables[size_t(s)].begin(), tables[size_t(s)].end(), s * blocks_per_seq);
  }
  std::vector<int32_t> prefill_table(static_cast<size_t>(prefill_blocks));
  std::iota(prefill_table.begin(), prefill_table.end(), 0);
  auto tokens_of = [&](int n, int seed) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) t[size_t(i)] = int32_t((uint64_t(i + 1) * 2654435761u + uint64_t(seed) * 97) % uint64_t(c.vocab_size));
    return t;
  };

  // Prefill: one sequence, logits for its last token, synchronous (the time a prompt takes).
  std::printf("programmatic dependent launch %s, fused decode epilogues %s, GEMV early groups %d, "
              "CUDA graphs %s, mixed attention in one launch %s\n",
              pdl ? "on" : "off", fusion ? "on" : "off", early_groups, graphs ? "on" : "off", mixed_launch ? "on" : "off");
  std::printf("\n%-10s %10s %10s %12s\n", "prefill", "ms", "TFLOP/s", "of matmul");
  for (int n : prefill_lens) {
    const std::vector<int32_t> prompt = tokens_of(n, 1);
    std::vector<double> secs;
    std::vector<float> logits;
    for (int rep = 0; rep < 6; ++rep) {
      SequenceChunk chunk{prompt, 0, prefill_table, 1, 1};
      const auto t0 = Clock::now();
      if (absl::Status s = model.Forward({chunk}, *cache, logits); !s.ok()) {
        std::fprintf(stderr, "prefill: %s\n", std::string(s.message()).c_str());
        return 1;
      }
      if (rep >= 1) secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double linear_params = double(c.num_layers) * double(c.hidden_size) *
                                 double((c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim +
                                        3 * c.intermediate_size);
    const double flops = 2.0 * n * linear_params + 2.0 * double(c.hidden_size) * double(c.vocab_size) +
                         4.0 * double(c.num_layers * c.num_heads * c.head_dim) * double(n) * double(n) / 2.0;
    const double t = bench::Summarize(secs).median;
    std::printf("%-10d %10.2f %10.1f %11.0f%%\n", n, t * 1e3, flops / t / 1e12, 100.0 * flops / t / matmul_peak);
  }

  // Decode: fill every sequence's cache with `context` tokens, then time greedy steps sampled on
  // the device (graph replay), each step synchronous because its tokens come back.
  // The floor of a step: the bytes it reads (weights + KV at its context length) over the read
  // ceiling; the table gives both parts, at the median timed step.
  std::printf("\ndecode floor = (weight bytes read + KV bytes read) / read ceiling %.0f GB/s\n", read_bw.bytes_per_s / 1e9);
  std::vector<double> decode_step_seconds;  // per batch size, the median step
  std::printf("%-8s %10s %10s %11s %9s %10s %10s %10s\n", "batch", "ms/step", "tok/s", "weights GB", "KV GB", "floor ms",
              "of floor", "context");
  for (int batch : batch_sizes) {
    const int per_step = std::max(1, int(options.max_num_batched_tokens) / context);
    for (int begin = 0; begin < batch; begin += per_step) {
      std::vector<std::vector<int32_t>> prompts;
      std::vector<SequenceChunk> chunks;
      for (int s = begin; s < std::min(batch, begin + per_step); ++s) prompts.push_back(tokens_of(context, s));
      for (int s = begin; s < std::min(batch, begin + per_step); ++s) {
        chunks.push_back(SequenceChunk{prompts[size_t(s - begin)], 0, tables[size_t(s)], SequenceId(s + 1), 0});
      }
      chunks.back().num_logits = 1;
      std::vector<float> logits;
      if (absl::Status st = model.Forward(chunks, *cache, logits); !st.ok()) {
        std::fprintf(stderr, "context fill: %s\n", std::string(st.message()).c_str());
        return 1;
      }
    }
    std::vector<int32_t> next(size_t(batch), 1);
    std::vector<DeviceSamplingRow> rows(static_cast<size_t>(batch));
    std::vector<DeviceSample> samples;
    std::vector<double> secs;
    std::vector<double> weight_bytes_read, kv_bytes_read;
    for (int step = 0; step < steps; ++step) {
      std::vector<SequenceChunk> chunks;
      for (int s = 0; s < batch; ++s) {
        chunks.push_back(SequenceChunk{absl::MakeConstSpan(&next[size_t(s)], 1), int64_t(context + step), tables[size_t(s)],
                                       SequenceId(s + 1), 1});
      }
      const auto t0 = Clock::now();
      if (absl::Status st = model.ForwardSample(chunks, *cache, rows, samples); !st.ok()) {
        std::fprintf(stderr, "decode: %s\n", std::string(st.message()).c_str());
        return 1;
      }
      if (step >= 4) {
        secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        const DecodeStepBytes bytes = BytesReadByDecodeStep(c, model.weight_bytes(), batch, context + step + 1);
        weight_bytes_read.push_back(bytes.weights);
        kv_bytes_read.push_back(bytes.kv);
      }
      for (int s = 0; s < batch; ++s) next[size_t(s)] = samples[size_t(s)].token;
    }
    // The KV read grows by one token a step: the median step's bytes go with the median time.
    const double t = bench::Summarize(secs).median;
    decode_step_seconds.push_back(t);
    const DecodeStepBytes median_bytes{bench::Summarize(weight_bytes_read).median, bench::Summarize(kv_bytes_read).median};
    const double floor = (median_bytes.weights + median_bytes.kv) / read_bw.bytes_per_s;
    std::printf("%-8d %10.3f %10.0f %11.3f %9.3f %10.3f %9.1f%% %10d\n", batch, t * 1e3, batch / t,
                median_bytes.weights / 1e9, median_bytes.kv / 1e9, floor * 1e3, 100.0 * floor / t, context);
  }
  if (mixed_chunks.empty()) return 0;

  // Mixed steps: each batch's decode rows (at the context they reached) and an N-token prompt
  // chunk in one step, sampled on the device, against the decode step above plus the prompt alone.
  // "decode rows first" is the order the engine's scheduler gives (their attention in the paged
  // decode kernel, the prompt's in the prefill kernel); "prompt first" sends every sequence through
  // the prefill kernel.
  auto time_step = [&](const std::vector<SequenceChunk>& chunks) -> double {
    std::vector<DeviceSamplingRow> rows(chunks.size());
    std::vector<DeviceSample> samples;
    std::vector<double> secs;
    for (int rep = 0; rep < 12; ++rep) {
      const auto t0 = Clock::now();
      if (absl::Status st = model.ForwardSample(chunks, *cache, rows, samples); !st.ok()) {
        std::fprintf(stderr, "mixed step: %s\n", std::string(st.message()).c_str());
        return -1;
      }
      if (rep >= 2) secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return bench::Summarize(secs).median;
  };
  std::printf("\nmixed steps: a batch's decode rows and a prompt chunk in one step (ms, median of 10)\n");
  std::printf("%-8s %8s %14s %13s %13s %13s %10s\n", "batch", "prompt", "decode first", "prompt first",
              "decode alone", "prompt alone", "saved");
  const std::vector<int32_t> one_token = {1};
  for (const MixedChunk& m : mixed_chunks) {
    const std::vector<int32_t> prompt = tokens_of(m.tokens, 2);
    const SequenceChunk prompt_chunk{prompt, m.start, prefill_table, SequenceId(max_batch + 1), 1};
    const double alone = time_step({prompt_chunk});
    for (size_t bi = 0; bi < batch_sizes.size(); ++bi) {
      const int batch = batch_sizes[bi];
      std::vector<SequenceChunk> decode_first;
      for (int s = 0; s < batch; ++s) {
        decode_first.push_back(SequenceChunk{one_token, int64_t(context + steps), tables[size_t(s)], SequenceId(s + 1), 1});
      }
      std::vector<SequenceChunk> prompt_first = {prompt_chunk};
      prompt_first.insert(prompt_first.end(), decode_first.begin(), decode_first.end());
      decode_first.push_back(prompt_chunk);
      // Decode-first last, so that a profile's final steps are the engine's order.
      const double reversed = time_step(prompt_first), mixed = time_step(decode_first);
      if (mixed < 0 || reversed < 0 || alone < 0) return 1;
      const double apart = decode_step_seconds[bi] + alone;
      const std::string label = std::to_string(m.tokens) + (m.start > 0 ? "@" + std::to_string(m.start) : "");
      std::printf("%-8d %8s %14.3f %13.3f %13.3f %13.3f %9.1f%%\n", batch, label.c_str(), mixed * 1e3, reversed * 1e3,
                  decode_step_seconds[bi] * 1e3, alone * 1e3, 100.0 * (apart - mixed) / apart);
    }
  }
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) { return duet::Run(argc, argv); }
