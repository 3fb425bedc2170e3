// CPU engine throughput: generated tokens per second at several batch sizes on a model
// directory (default: the bundled tiny-code-llama). Each request has a fixed-length prompt and
// generates a fixed number of tokens (ignore_eos), all submitted at once. Each batch size runs
// --warmup untimed rounds, then --repeat timed ones (fresh random prompts every round); the table
// gives each figure's median and min-max over the timed rounds.
//
//   build/bin/engine_throughput [--model DIR] [--prompt-len 128] [--gen-len 128] [--batch 1,32]
//                               [--repeat 5] [--warmup 1]
#include <chrono>
#include <cstdio>
#include <random>
#include <string>

#include "CLI/CLI.hpp"
#include "backends/executor_factory.h"
#include "bench/sample_stats.h"
#include "engine/llm_engine.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Round {
  double wall_s = 0, gen_tok_per_s = 0, ms_per_step = 0, prefill_s = 0;
};

// One round: `batch` requests submitted at once and stepped until all finish; false on an engine error.
bool RunRound(duet::LlmEngine& e, int batch, int prompt_len, int gen_len, const std::string& tag, std::mt19937& rng,
              Round& round) {
  for (int i = 0; i < batch; ++i) {
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_len));
    for (int32_t& t : prompt) t = int32_t(3 + rng() % (e.model_config().vocab_size - 3));
    duet::SamplingParams p;
    p.temperature = 0.0f;
    p.max_tokens = gen_len;
    p.ignore_eos = true;
    if (!e.AddRequest(tag + "-" + std::to_string(i), prompt, p).ok()) return false;
  }
  const auto start = Clock::now();
  Clock::time_point first_decode{};
  int64_t tokens = 0, decode_steps = 0;
  while (e.HasUnfinished()) {
    auto out = e.Step();
    if (!out.ok()) return false;
    for (const auto& o : *out) tokens += int64_t(o.new_token_ids.size());
    if (first_decode == Clock::time_point{} && tokens >= batch) {
      first_decode = Clock::now();
    } else if (first_decode != Clock::time_point{}) {
      ++decode_steps;
    }
  }
  const auto end = Clock::now();
  round.wall_s = std::chrono::duration<double>(end - start).count();
  round.gen_tok_per_s = double(tokens) / round.wall_s;
  round.ms_per_step = decode_steps ? 1000.0 * std::chrono::duration<double>(end - first_decode).count() / double(decode_steps) : 0.0;
  round.prefill_s = std::chrono::duration<double>(first_decode - start).count();
  for (int i = 0; i < batch; ++i) e.Release(tag + "-" + std::to_string(i));
  return true;
}

// "median (min-max)".
std::string Cell(const std::vector<double>& values, const char* format) {
  const duet::bench::SampleStats s = duet::bench::Summarize(values);
  char text[64];
  std::snprintf(text, sizeof(text), format, s.median, s.min, s.max);
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Duet CPU engine throughput"};
  std::string model_dir = DUET_MODELS_DIR "/tiny-code-llama";
  int prompt_len = 128, gen_len = 128, repeat = 5, warmup = 1;
  std::vector<int> batches = {1, 32};
  app.add_option("--model", model_dir);
  app.add_option("--prompt-len", prompt_len)->check(CLI::Range(1, 100000));
  app.add_option("--gen-len", gen_len)->check(CLI::Range(1, 100000));
  app.add_option("--batch", batches)->delimiter(',');
  app.add_option("--repeat", repeat, "timed rounds per batch size")->check(CLI::Range(1, 1000));
  app.add_option("--warmup", warmup, "untimed rounds per batch size before them")->check(CLI::Range(0, 1000));
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
  std::printf("model %s, prompt %d tokens, %d generated per request; median (min-max) of %d rounds after %d warm-up\n",
              model_dir.c_str(), prompt_len, gen_len, repeat, warmup);
  std::printf("%6s %24s %22s %22s %24s\n", "batch", "gen_tok_per_s", "ms_per_step", "prefill_s", "wall_s");
  int round_id = 0;
  for (int batch : batches) {
    std::vector<double> tok_per_s, ms_per_step, prefill_s, wall_s;
    for (int r = -warmup; r < repeat; ++r) {
      Round round;
      if (!RunRound(e, batch, prompt_len, gen_len, "r" + std::to_string(round_id++), rng, round)) {
        std::fprintf(stderr, "engine error at batch %d\n", batch);
        return 1;
      }
      if (r < 0) continue;
      tok_per_s.push_back(round.gen_tok_per_s);
      ms_per_step.push_back(round.ms_per_step);
      prefill_s.push_back(round.prefill_s);
      wall_s.push_back(round.wall_s);
    }
    std::printf("%6d %24s %22s %22s %24s\n", batch, Cell(tok_per_s, "%.1f (%.1f-%.1f)").c_str(),
                Cell(ms_per_step, "%.2f (%.2f-%.2f)").c_str(), Cell(prefill_s, "%.3f (%.3f-%.3f)").c_str(),
                Cell(wall_s, "%.3f (%.3f-%.3f)").c_str());
    std::fflush(stdout);
  }
  return 0;
}
