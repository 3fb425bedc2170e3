// tokenizer_bench: how long the router's tokenizer takes on duet-bench's random prompts (the
// serving benchmark's default workload, and its worst case: random tokens defeat the word cache).
//
//   build/bin/tokenizer_bench --tokenizer MODEL_DIR [--input-len 512] [--num-prompts 200]
//
// Each prompt is encoded once, in order, as the router meets them (the cache keeps what earlier
// prompts taught it); prints the median and p90 per prompt and µs per token.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/serving/dataset.h"
#include "frontend/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  CLI::App app{"Encode time of random prompts"};
  std::string model_dir;
  int input_len = 512, num_prompts = 200;
  uint64_t seed = 1;
  app.add_option("--tokenizer", model_dir, "Directory with tokenizer.json")->required();
  app.add_option("--input-len", input_len, "Tokens per prompt")->check(CLI::Range(1, 1 << 20));
  app.add_option("--num-prompts", num_prompts, "Prompts")->check(CLI::Range(1, 100000));
  app.add_option("--seed", seed, "Dataset seed");
  CLI11_PARSE(app, argc, argv);

  absl::StatusOr<std::unique_ptr<duet::Tokenizer>> tokenizer = duet::Tokenizer::FromModelDir(model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  duet::bench::DatasetOptions options;
  options.input_len = input_len;
  options.num_prompts = num_prompts;
  options.seed = seed;
  options.tokenizer = tokenizer->get();
  absl::StatusOr<std::vector<duet::bench::BenchRequest>> requests = duet::bench::LoadDataset(options);
  if (!requests.ok()) {
    std::fprintf(stderr, "%s\n", std::string(requests.status().message()).c_str());
    return 1;
  }
  // A fresh tokenizer: the dataset's own encoding has filled the other one's cache.
  tokenizer = duet::Tokenizer::FromModelDir(model_dir);
  std::vector<double> us;
  size_t tokens = 0, bytes = 0;
  for (const duet::bench::BenchRequest& r : *requests) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = (*tokenizer)->Encode(r.prompt, /*add_special_tokens=*/true);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    tokens += ids.size();
    bytes += r.prompt.size();
  }
  std::vector<double> sorted = us;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2], p90 = sorted[sorted.size() * 9 / 10];
  const double mean_tokens = double(tokens) / double(us.size());
  std::printf("%zu prompts, %.0f tokens and %.0f bytes each on average: encode median %.0f us, p90 %.0f us, "
              "%.2f us per token (median)\n",
              us.size(), mean_tokens, double(bytes) / double(us.size()), median, p90, median / mean_tokens);
  return 0;
}
