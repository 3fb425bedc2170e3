// Speculative decoding on the CPU or CUDA backend: for each mode (none, lookahead, draft model, self)
// and batch size, greedy code completion of prompts cut from sources the model was not trained on
// (this repository's own: the Python of scripts/, tests/ and frontend/tokenizer/tokenizer_unicode_data_gen.py,
// then the C++ of the engine, its front end, model and backends, router/, common/, kvtransfer/
// and the workers; never the reference
// files). Batch B is B requests decoding at once: B slots serve --requests-per-slot × B requests,
// a finished request's slot taking the next one (a server under load; 1: one fixed batch that
// drains, where the slowest request sets the time). Prints mean accepted draft
// tokens per verified proposal, generated tokens per target forward, target forwards per
// generated token, decode tokens per second and the speed-up over no speculation measured in
// the same run (median of --repeat interleaved runs, with the spread of the run-by-run ratios),
// and the same ratio in CPU seconds (a figure that load from other processes moves less).
// Every mode's output is compared with mode none's: same/none counts the requests whose tokens are
// identical (all of them on the CPU, lossless; on the GPU bf16 step shapes may flip near-ties).
//
//   build/bin/spec_decode_bench [--backend cpu|cuda] [--batch 1,8,32,64] [--modes none,lookahead,draft,self]
//                               [--prompt-len 192] [--gen-len 128] [--max-draft-tokens 8] [--repeat 3]
//                               [--requests-per-slot 4]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "CLI/CLI.hpp"
#include "backends/executor_factory.h"
#include "engine/llm_engine.h"

namespace {

std::vector<std::string> SourceFiles(const std::string& root) {
  namespace fs = std::filesystem;
  auto collect = [&](std::vector<std::string> dirs, std::vector<std::string> extensions) {
    std::vector<std::string> files;
    for (const std::string& dir : dirs) {
      if (!fs::exists(root + "/" + dir)) continue;
      for (const auto& entry : fs::recursive_directory_iterator(root + "/" + dir)) {
        const std::string path = entry.path().string();
        if (entry.is_regular_file() && path.find("node_modules") == std::string::npos &&
            std::find(extensions.begin(), extensions.end(), entry.path().extension().string()) != extensions.end()) {
          files.push_back(path);
        }
      }
    }
    std::sort(files.begin(), files.end());
    return files;
  };
  std::vector<std::string> files = {root + "/frontend/tokenizer/tokenizer_unicode_data_gen.py"};
  for (const std::string& f : collect({"scripts", "tests"}, {".py"})) files.push_back(f);
  for (const std::string& f :
       collect({"frontend", "model", "engine", "backends", "router", "common", "kvtransfer", "worker", "decode_worker",
                "prefill_worker"},
               {".cpp", ".h"})) {
    files.push_back(f);
  }
  return files;
}

// User + system CPU seconds of this process (all its threads).
double ProcessCpuSeconds() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct RunResult {
  double decode_seconds = 0;
  double decode_cpu_seconds = 0;  // what a loaded machine moves least (no waiting for a core)
  int64_t generated = 0;         // decode tokens (after each request's first)
  int64_t request_forwards = 0;  // target forwards each request took part in while decoding
  duet::SpecDecodeStats spec;
  int64_t setups = 0;  // one-time executor setups (graph captures) while timed
  std::map<std::string, std::vector<int32_t>> outputs;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Duet speculative decoding benchmark"};
  std::string backend = "cpu";
  std::string model_dir = DUET_MODELS_DIR "/tiny-code-llama";
  std::string draft_dir = DUET_MODELS_DIR "/tiny-code-llama-draft";
  std::string source_root = DUET_SOURCE_DIR;
  std::vector<int> batches = {1, 8, 32, 64};
  std::vector<std::string> modes = {"none", "lookahead", "draft", "self"};
  int prompt_len = 192, gen_len = 128, max_draft = 8, self_layers = 0, repeat = 1, requests_per_slot = 4;
  app.add_option("--backend", backend, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--model", model_dir);
  app.add_option("--draft-model", draft_dir);
  app.add_option("--source-root", source_root, "Repository whose Python files make the prompts");
  app.add_option("--batch", batches)->delimiter(',');
  app.add_option("--modes", modes)->delimiter(',');
  app.add_option("--prompt-len", prompt_len)->check(CLI::Range(8, 4000));
  app.add_option("--gen-len", gen_len)->check(CLI::Range(2, 4000));
  app.add_option("--max-draft-tokens", max_draft)->check(CLI::Range(0, 63));
  app.add_option("--self-spec-layers", self_layers)->check(CLI::Range(0, 1024));
  app.add_option("--requests-per-slot", requests_per_slot, "Requests served per batch slot (1: a fixed batch)")
      ->check(CLI::Range(1, 64));
  app.add_option("--repeat", repeat, "Runs per batch and mode (interleaved); figures are medians")
      ->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);
  if (modes.empty() || modes[0] != "none") modes.insert(modes.begin(), "none");  // the baseline

  absl::StatusOr<std::unique_ptr<duet::Tokenizer>> tokenizer = duet::Tokenizer::FromModelDir(model_dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tokenizer.status().message()).c_str());
    return 1;
  }
  // All sources as one token stream; prompts are windows at evenly spaced offsets, starting at
  // a line start, so every batch size gets distinct prompts.
  std::vector<int32_t> corpus;
  for (const std::string& f : SourceFiles(source_root)) {
    std::ifstream in(f);
    std::stringstream text;
    text << in.rdbuf();
    std::vector<int32_t> ids = (*tokenizer)->Encode(text.str());
    corpus.insert(corpus.end(), ids.begin(), ids.end());
  }
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int max_requests = max_batch * requests_per_slot;
  if (int64_t(corpus.size()) < prompt_len + 2) {
    std::fprintf(stderr, "the sources have only %zu tokens\n", corpus.size());
    return 1;
  }
  const int64_t stride = std::max<int64_t>(1, (int64_t(corpus.size()) - prompt_len) / (max_requests + 2));
  auto prompt_at = [&](int i) {
    const int64_t off = (int64_t(i) * stride) % (int64_t(corpus.size()) - prompt_len);
    return std::vector<int32_t>(corpus.begin() + off, corpus.begin() + off + prompt_len);
  };

  auto run = [&](const std::string& mode, int batch) -> absl::StatusOr<RunResult> {
    duet::EngineConfig config;
    config.model_dir = model_dir;
    config.backend = backend;
    config.num_kv_blocks = (max_batch + 4) * ((prompt_len + gen_len + 64) / 16 + 2);
    config.scheduler.max_num_seqs = batch;  // the slots
    config.scheduler.max_num_batched_tokens = std::max(2048, (batch + 2) * prompt_len);
    absl::StatusOr<duet::SpeculationMode> m = duet::ParseSpeculationMode(mode);
    if (!m.ok()) return m.status();
    config.speculation.default_mode = *m;
    if (*m == duet::SpeculationMode::kDraft) config.speculation.draft_model_dir = draft_dir;
    config.speculation.self_spec_layers = self_layers;
    config.speculation.max_draft_tokens = max_draft;
    absl::StatusOr<std::unique_ptr<duet::LlmEngine>> engine = duet::CreateEngine(config);
    if (!engine.ok()) return engine.status();
    duet::LlmEngine& e = **engine;
    duet::SamplingParams p;
    p.temperature = 0.0f;
    p.ignore_eos = true;
    // Warm-up (not timed), at the measured batch size: one-time costs (the step-cost table's
    // scratch measurements for the step sizes this batch size plans with, first touches of
    // memory) are paid before the clock starts, as a long-running server pays them once. The
    // prompts are the first tokens of two windows past every measured prompt, alternating.
    p.max_tokens = 16;
    for (int i = 0; i < batch; ++i) {
      std::vector<int32_t> warm = prompt_at(max_requests + i % 2);
      warm.resize(std::min<size_t>(warm.size(), 48));
      if (absl::Status s = e.AddRequest("warm" + std::to_string(i), warm, p); !s.ok()) return s;
    }
    while (e.HasUnfinished()) {
      if (absl::StatusOr<std::vector<duet::RequestOutput>> o = e.Step(); !o.ok()) return o.status();
    }
    const duet::SpecDecodeStats before = e.Stats().spec_decode;
    const int64_t setups_before = e.Stats().num_one_time_setups;
    p.max_tokens = gen_len;
    const int num_requests = batch * requests_per_slot;
    for (int i = 0; i < num_requests; ++i) {
      if (absl::Status s = e.AddRequest("r" + std::to_string(i), prompt_at(i), p); !s.ok()) return s;
    }
    // The first slots' prefill (one step) is the same for every mode: the clock starts after it.
    RunResult result;
    if (absl::StatusOr<std::vector<duet::RequestOutput>> o = e.Step(); !o.ok()) return o.status();
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = ProcessCpuSeconds();
    while (e.HasUnfinished()) {
      absl::StatusOr<std::vector<duet::RequestOutput>> outs = e.Step();
      if (!outs.ok()) return outs.status();
      for (const duet::RequestOutput& o : *outs) {
        ++result.request_forwards;
        result.generated += int64_t(o.new_token_ids.size());
      }
    }
    result.decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.decode_cpu_seconds = ProcessCpuSeconds() - cpu_start;
    const duet::SpecDecodeStats after = e.Stats().spec_decode;
    result.setups = e.Stats().num_one_time_setups - setups_before;
    result.spec.num_drafts = after.num_drafts - before.num_drafts;
    result.spec.num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens;
    result.spec.num_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens;
    for (int i = 0; i < num_requests; ++i) {
      result.outputs["r" + std::to_string(i)] = e.Find("r" + std::to_string(i))->output;
    }
    return result;
  };

  std::printf("backend %s; model %s, draft %s; prompts: %d tokens cut from %zu source files (%zu tokens); batch B: B "
              "slots serving %d x B requests; %d generated "
              "per request (greedy); max %d draft tokens per request and step, adaptive budget; %d run(s) per "
              "row, modes interleaved (each first in turn): tok/s is the median, speedup its ratio to none's "
              "median, spread the lowest and highest run-by-run ratio; cpu speedup: the same with the process's "
              "CPU seconds instead of wall-clock\n",
              backend.c_str(), model_dir.c_str(), draft_dir.c_str(), prompt_len, SourceFiles(source_root).size(), corpus.size(),
              requests_per_slot, gen_len, max_draft, repeat);
  std::printf("%6s %-10s %10s %14s %14s %12s %12s %9s %15s %12s %10s %7s\n", "batch", "mode", "drafts", "acc/draft",
              "tok/forward", "fwd/token", "tok/s", "speedup", "spread", "cpu speedup", "same/none", "setups");
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 == 1 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  for (int batch : batches) {
    // runs[mode][rep]; repetitions interleave the modes so load changes hit every mode alike.
    std::map<std::string, std::vector<RunResult>> runs;
    for (int rep = 0; rep < repeat; ++rep) {
      for (size_t m = 0; m < modes.size(); ++m) {
        const std::string& mode = modes[(m + size_t(rep)) % modes.size()];  // each mode goes first in turn
        absl::StatusOr<RunResult> r = run(mode, batch);
        if (!r.ok()) {
          std::fprintf(stderr, "batch %d mode %s: %s\n", batch, mode.c_str(), std::string(r.status().message()).c_str());
          return 1;
        }
        runs[mode].push_back(std::move(*r));
      }
    }
    auto tps = [](const RunResult& r) { return double(r.generated) / r.decode_seconds; };
    auto cpu_tps = [](const RunResult& r) { return double(r.generated) / r.decode_cpu_seconds; };
    std::vector<double> base_tps, base_cpu_tps;
    for (const RunResult& r : runs["none"]) {
      base_tps.push_back(tps(r));
      base_cpu_tps.push_back(cpu_tps(r));
    }
    const double base = median(base_tps), base_cpu = median(base_cpu_tps);
    for (const std::string& mode : modes) {
      const std::vector<RunResult>& rs = runs[mode];
      std::vector<double> mode_tps, mode_cpu_tps;
      double lo = 1e30, hi = 0;
      // Requests whose output equals mode none's (the fewest over the runs). On the CPU every one
      // must; on the GPU, bf16 rounding differs between step shapes, so near-ties may flip.
      const int num_requests = batch * requests_per_slot;
      int64_t same = int64_t(num_requests);
      int64_t drafts = 0, accepted = 0, generated = 0, forwards = 0, setups = 0;
      for (size_t i = 0; i < rs.size(); ++i) {
        mode_tps.push_back(tps(rs[i]));
        mode_cpu_tps.push_back(cpu_tps(rs[i]));
        lo = std::min(lo, tps(rs[i]) / base_tps[i]);
        hi = std::max(hi, tps(rs[i]) / base_tps[i]);
        int64_t same_in_run = 0;
        for (const auto& [id, output] : rs[i].outputs) same_in_run += output == runs["none"][0].outputs.at(id) ? 1 : 0;
        same = std::min(same, same_in_run);
        drafts += rs[i].spec.num_drafts;
        accepted += rs[i].spec.num_accepted_tokens;
        generated += rs[i].generated;
        forwards += rs[i].request_forwards;
        setups += rs[i].setups;
      }
      const double n = double(rs.size());
      char spread[32];
      std::snprintf(spread, sizeof(spread), "%.2f-%.2fx", lo, hi);
      char same_text[32];
      std::snprintf(same_text, sizeof(same_text), "%lld/%d", (long long)same, num_requests);
      std::printf("%6d %-10s %10.0f %14.2f %14.2f %12.3f %12.1f %8.2fx %15s %11.2fx %10s %7.1f\n", batch, mode.c_str(),
                  double(drafts) / n, drafts > 0 ? double(accepted) / double(drafts) : 0.0,
                  double(generated) / double(forwards), double(forwards) / double(generated), median(mode_tps),
                  median(mode_tps) / base, spread, median(mode_cpu_tps) / base_cpu, same_text, double(setups) / n);
      std::fflush(stdout);
    }
  }
  return 0;
}
