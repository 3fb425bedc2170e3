// The added latency of disaggregation: time to first token through the local cluster (router →
// prefill worker → KV over UCX → decode worker → router) against the same engine in one process
// (what `duet generate` runs), for the same prompts, one request at a time.
//
//   build/bin/disaggregation_latency [--prompt-lens 32,256,1024] [--runs 10]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "CLI/CLI.hpp"
#include "backends/executor_factory.h"
#include "engine/llm_engine.h"
#include "tests/integration/local_cluster.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"TTFT through the cluster vs in-process"};
  std::vector<int> prompt_lens = {32, 256, 1024};
  int runs = 10;
  app.add_option("--prompt-lens", prompt_lens)->delimiter(',');
  app.add_option("--runs", runs)->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  duet::EngineConfig config;
  config.model_dir = DUET_MODELS_DIR "/tiny-code-llama";
  auto engine = duet::CreateEngine(config);
  if (!engine.ok()) return 1;
  duet::testing::LocalCluster cluster({1, 1});
  if (!cluster.ok()) {
    std::fprintf(stderr, "cluster: %s\n", cluster.error().c_str());
    return 1;
  }
  std::mt19937 rng(1);
  std::printf("%10s %16s %16s %14s\n", "prompt", "local_ttft_ms", "cluster_ttft_ms", "added_ms");
  for (int len : prompt_lens) {
    std::vector<double> local, remote;
    for (int run = 0; run <= runs; ++run) {  // run 0 warms up
      std::vector<int32_t> prompt(static_cast<size_t>(len));
      for (int32_t& t : prompt) t = int32_t(3 + rng() % 8000);
      duet::SamplingParams p;
      p.temperature = 0;
      p.max_tokens = 2;
      const std::string id = "l" + std::to_string(len) + "-" + std::to_string(run);
      auto start = std::chrono::steady_clock::now();
      if (!(*engine)->AddRequest(id, prompt, p).ok()) return 1;
      double first = 0;
      while ((*engine)->HasUnfinished()) {
        auto out = (*engine)->Step();
        if (!out.ok()) return 1;
        if (first == 0 && !out->empty()) {
          first = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        }
      }
      (*engine)->Release(id);

      duet::v1::GenerateRequest r;
      for (int32_t t : prompt) r.mutable_token_ids()->add_ids(t);
      r.mutable_sampling()->set_temperature(0);
      r.mutable_sampling()->set_max_tokens(2);
      grpc::ClientContext ctx;
      start = std::chrono::steady_clock::now();
      auto reader = cluster.router().Generate(&ctx, r);
      duet::v1::GenerateResponse msg;
      double remote_first = 0;
      while (reader->Read(&msg)) {
        if (remote_first == 0) {
          remote_first = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        }
      }
      if (!reader->Finish().ok()) return 1;
      if (run > 0) {
        local.push_back(first);
        remote.push_back(remote_first);
      }
    }
    std::printf("%10d %16.2f %16.2f %14.2f\n", len, Median(local), Median(remote), Median(remote) - Median(local));
  }
  return 0;
}
