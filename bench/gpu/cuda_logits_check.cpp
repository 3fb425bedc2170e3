// Compares the CUDA backend's logits with reference logits (Hugging Face transformers' float32
// forward on the same checkpoint, written by scripts/gpu/hf_reference.py) over every position of
// every sequence. Exits 1 when the relative error ||cuda - ref|| / ||ref|| exceeds the bound.
//
//   cuda_logits_check --model DIR --tokens tokens.json --logits logits.f32 [--max-rel-error 0.02]
//                     [--baseline-logits logits_bf16.f32]
//
// With a baseline (transformers' own bf16 forward), the bound is the larger of --max-rel-error
// and 1.25x the baseline's error against the float32 logits: bf16 rounding through dozens of
// layers of random weights costs every bf16 implementation the same.
//
// tokens.json: {"sequences": [[id, ...], ...]} (equal lengths); logits.f32: float32
// [num_sequences, length, vocab], C order.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "backends/cuda/llama_cuda.h"

int main(int argc, char** argv) {
  using namespace duet;
  CLI::App app{"CUDA logits vs reference logits"};
  std::string model_dir, tokens_path, logits_path, baseline_path;
  double max_rel_error = 0.02;
  app.add_option("--model", model_dir)->required();
  app.add_option("--tokens", tokens_path)->required();
  app.add_option("--logits", logits_path)->required();
  app.add_option("--max-rel-error", max_rel_error);
  app.add_option("--baseline-logits", baseline_path, "another bf16 implementation's logits, same layout");
  CLI11_PARSE(app, argc, argv);

  std::ifstream tokens_in(tokens_path);
  const nlohmann::json tokens_json = nlohmann::json::parse(tokens_in, nullptr, false);
  if (tokens_json.is_discarded() || !tokens_json.contains("sequences")) {
    std::fprintf(stderr, "%s: not a {\"sequences\": [...]} JSON file\n", tokens_path.c_str());
    return 2;
  }
  const auto sequences = tokens_json["sequences"].get<std::vector<std::vector<int32_t>>>();
  if (sequences.empty() || sequences[0].empty()) return 2;
  const size_t len = sequences[0].size();

  LlamaCudaOptions options;
  options.max_num_seqs = int(std::max<size_t>(len, 16));
  options.max_num_batched_tokens = int(std::max<size_t>(len, 256));
  options.max_model_len = int64_t(len) + 16;
  auto model = LlamaCuda::Load(model_dir, options);
  if (!model.ok()) {
    std::fprintf(stderr, "load: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const int64_t vocab = (*model)->config().vocab_size;
  std::ifstream logits_in(logits_path, std::ios::binary);
  std::vector<float> reference(sequences.size() * len * size_t(vocab));
  logits_in.read(reinterpret_cast<char*>(reference.data()), std::streamsize(reference.size() * sizeof(float)));
  if (!logits_in) {
    std::fprintf(stderr, "%s: expected %zu float32 values\n", logits_path.c_str(), reference.size());
    return 2;
  }
  const int block_size = 16;
  const int blocks = int((len + block_size - 1) / block_size);
  absl::StatusOr<std::unique_ptr<KvCache>> created = (*model)->CreateKvCache(blocks, block_size);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<KvCache> cache = std::move(*created);
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  std::iota(table.begin(), table.end(), 0);

  double num = 0, den = 0;
  size_t argmax_agree = 0, rows = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    if (sequences[s].size() != len) return 2;
    SequenceChunk chunk{sequences[s], 0, table, SequenceId(s + 1), int32_t(len)};
    std::vector<float> logits;
    if (absl::Status st = (*model)->Forward({chunk}, *cache, logits); !st.ok()) {
      std::fprintf(stderr, "forward: %s\n", std::string(st.message()).c_str());
      return 1;
    }
    const float* ref = reference.data() + s * len * size_t(vocab);
    double seq_num = 0, seq_den = 0;
    for (size_t i = 0; i < len * size_t(vocab); ++i) {
      const double d = double(logits[i]) - double(ref[i]);
      seq_num += d * d;
      seq_den += double(ref[i]) * double(ref[i]);
    }
    for (size_t r = 0; r < len; ++r, ++rows) {
      const float* a = logits.data() + r * size_t(vocab);
      const float* b = ref + r * size_t(vocab);
      argmax_agree += (std::max_element(a, a + vocab) - a) == (std::max_element(b, b + vocab) - b);
    }
    std::printf("sequence %zu (%zu tokens): logits relative error %.3e\n", s, len, std::sqrt(seq_num / seq_den));
    num += seq_num;
    den += seq_den;
  }
  const double rel = std::sqrt(num / den);
  if (!baseline_path.empty()) {
    std::ifstream baseline_in(baseline_path, std::ios::binary);
    std::vector<float> baseline(reference.size());
    baseline_in.read(reinterpret_cast<char*>(baseline.data()), std::streamsize(baseline.size() * sizeof(float)));
    if (!baseline_in) {
      std::fprintf(stderr, "%s: expected %zu float32 values\n", baseline_path.c_str(), baseline.size());
      return 2;
    }
    double bnum = 0;
    size_t bagree = 0;
    for (size_t i = 0; i < baseline.size(); ++i) bnum += (double(baseline[i]) - reference[i]) * (double(baseline[i]) - reference[i]);
    for (size_t r = 0; r < rows; ++r) {
      const float* a = baseline.data() + r * size_t(vocab);
      const float* b = reference.data() + r * size_t(vocab);
      bagree += (std::max_element(a, a + vocab) - a) == (std::max_element(b, b + vocab) - b);
    }
    const double baseline_rel = std::sqrt(bnum / den);
    std::printf("baseline (transformers bf16) vs float32: relative error %.3e, argmax agreement %zu/%zu\n",
                baseline_rel, bagree, rows);
    max_rel_error = std::max(max_rel_error, 1.25 * baseline_rel);
  }
  std::printf("all %zu positions: relative error %.3e (bound %.1e), argmax agreement %zu/%zu\n", rows, rel,
              max_rel_error, argmax_agree, rows);
  return rel <= max_rel_error ? 0 : 1;
}
