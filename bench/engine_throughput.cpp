// CPU engine throughput: generated tokens per second at several batch sizes on a model
// directory (default: the bundled tiny-code-llama). Each request has a fixed-length prompt and
// generates a fixed number of tokens (ignore_eos), all submitted at once.
//
//   build/bin/engine_throughput [--model DIR] [--prompt-len 128] [--gen-len 128] [--batch 1,32]
#include <chrono>
#include <cstdio>
#include <random>
#include <sstream>

#include "CLI/CLI.hpp"
#include "backends/executor_factory.h"
#include "engine/llm_engine.h"

int main(int argc, char** argv) {
  CLI::App app{"Duet CPU engine throughput"};
  std::string model_dir = DUET_MODELS_DIR "/tiny-code-llama";
  int prompt_len = 128, gen_len = 128;
  std::vector<int> batches = {1, 32};
  app.add_option("--model", model_dir);
  app.add_option("--prompt-len", prompt_len)->check(CLI::Range(1, 100000));
  app.add_option("--gen-len", gen_len)->check(CLI::Range(1, 100000));
  app.add_option("--batch", batches)->delimiter(',');
  CLI11_PARSE(app, argc, argv);

  duet::EngineConfig config;
  config.model_dir = model_dir;
  absl::StatusOr<std::unique_ptr<duet::LlmEngine>> engine = duet::CreateEngine(config);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  duet::LlmEngine& e = **engine;
  std::mt19937 rng(0);
  std::printf("model %s, prompt %d tokens, %d generated per request\n", model_dir.c_str(), prompt_len, gen_len);
  std::printf("%6s %12s %14s %14s %12s\n", "batch", "wall_s", "gen_tok_per_s", "ms_per_step", "prefill_s");
  int round = 0;
  for (int batch : batches) {
    for (int i = 0; i < batch; ++i) {
      std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
      for (int32_t& t : prompt) t = int32_t(3 + rng() % (e.model_config().vocab_size - 3));
      duet::SamplingParams p;
      p.temperature = 0.0f;
      p.max_tokens = gen_len;
      p.ignore_eos = true;
      if (!e.AddRequest("r" + std::to_string(round) + "-" + std::to_string(i), prompt, p).ok()) return 1;
    }
    const auto start = std::chrono::steady_clock::now();
    std::chrono::steady_clock::time_point first_decode{};
    int64_t tokens = 0, decode_steps = 0;
    while (e.HasUnfinished()) {
      auto out = e.Step();
      if (!out.ok()) return 1;
      for (const auto& o : *out) tokens += int64_t(o.new_token_ids.size());
      if (first_decode == std::chrono::steady_clock::time_point{} && tokens >= batch) {
        first_decode = std::chrono::steady_clock::now();
      } else if (first_decode != std::chrono::steady_clock::time_point{}) {
        ++decode_steps;
      }
    }
    const auto end = std::chrono::steady_clock::now();
    const double wall = std::chrono::duration<double>(end - start).count();
    const double prefill = std::chrono::duration<double>(first_decode - start).count();
    const double decode = std::chrono::duration<double>(end - first_decode).count();
    std::printf("%6d %12.3f %14.1f %14.2f %12.3f\n", batch, wall, tokens / wall,
                decode_steps ? 1000.0 * decode / decode_steps : 0.0, prefill);
    for (int i = 0; i < batch; ++i) e.Release("r" + std::to_string(round) + "-" + std::to_string(i));
    ++round;
  }
  return 0;
}
