// `duet generate`: offline batch generation through the engine, all requests submitted at once
// so they share the continuously batched steps.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backends/executor_factory.h"
#include "cli/commands.h"
#include "cli/generate_progress.h"
#include "cli/generate_request.h"
#include "cli/jsonl.h"
#include "common/logging.h"
#include "worker/engine_stats_log.h"

namespace duet {
namespace {

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// vLLM's prompt_logprobs, as the HTTP API answers them: null for the first prompt token, then per
// token {"<token id>": {"logprob", "rank", "decoded_token"}}, the token's own entry and the top-K.
nlohmann::json PromptLogprobsJson(const Request& r, const Tokenizer& tokenizer) {
  auto entry = [&](float logprob, int32_t rank, int32_t id) {
    return nlohmann::json{{"logprob", std::isfinite(logprob) ? double(logprob) : -9999.0},
                          {"rank", rank},
                          {"decoded_token", tokenizer.Decode(absl::MakeConstSpan(&id, 1), /*skip_special_tokens=*/false)}};
  };
  nlohmann::json out = nlohmann::json::array({nullptr});
  for (size_t i = 0; i < r.prompt_logprobs.size() && i + 1 < r.prompt.size(); ++i) {
    const ScoredToken& scored = r.prompt_logprobs[i];
    const int32_t id = r.prompt[i + 1];
    nlohmann::json position = nlohmann::json::object();
    position[std::to_string(id)] = entry(scored.logprob, scored.rank, id);
    for (size_t t = 0; t < scored.top.size(); ++t) {
      if (scored.top[t].token == id) continue;
      position[std::to_string(scored.top[t].token)] = entry(scored.top[t].logprob, int32_t(t + 1), scored.top[t].token);
    }
    out.push_back(std::move(position));
  }
  return out;
}

nlohmann::json OutputRow(const Request& r, const Tokenizer& tokenizer) {
  nlohmann::json row = {
      {"id", r.id},
      {"prompt_token_ids", r.prompt},
      {"token_ids", r.output},
      {"text", r.text},
      {"finish_reason", FinishReasonName(r.finish_reason)},
      {"num_preemptions", r.num_preemptions},
      {"queue_time_s", Seconds(r.arrival_time, r.first_scheduled_time)},
      {"time_to_first_token_s", Seconds(r.arrival_time, r.first_token_time)},
      {"e2e_latency_s", Seconds(r.arrival_time, r.finish_time)},
  };
  if (r.params.logprobs >= 0) {
    nlohmann::json logprobs = nlohmann::json::array();
    for (size_t i = 0; i < r.output.size() && i < r.output_logprobs.size(); ++i) {
      nlohmann::json top = nlohmann::json::array();
      for (const TokenLogprob& t : r.output_top_logprobs[i]) {
        top.push_back({{"token_id", t.token}, {"logprob", t.logprob}});
      }
      logprobs.push_back({{"token_id", r.output[i]}, {"logprob", r.output_logprobs[i]}, {"top_logprobs", top}});
    }
    row["logprobs"] = logprobs;
  }
  if (r.params.prompt_logprobs >= 0) row["prompt_logprobs"] = PromptLogprobsJson(r, tokenizer);
  return row;
}

}  // namespace

int RunGenerate(const GenerateOptions& options) {
  absl::StatusOr<std::vector<nlohmann::json>> rows = ReadJsonl(options.input_path);
  if (!rows.ok()) {
    DUET_LOG(ERROR) << rows.status().message();
    return 2;
  }
  std::vector<GenerateRequest> requests;
  for (size_t i = 0; i < rows->size(); ++i) {
    absl::StatusOr<GenerateRequest> req = ParseGenerateRequest((*rows)[i]);
    if (!req.ok()) {
      DUET_LOG(ERROR) << options.input_path << ": request " << i + 1 << ": " << req.status().message();
      return 2;
    }
    requests.push_back(std::move(*req));
  }

  absl::StatusOr<std::unique_ptr<LlmEngine>> engine = CreateEngine(options.engine);
  if (!engine.ok()) {
    DUET_LOG(ERROR) << engine.status().message();
    return 1;
  }
  LlmEngine& e = **engine;
  DUET_LOG(INFO) << "generate: " << EngineConfigSummary(e);
  std::vector<std::vector<int32_t>> prompts;
  for (const GenerateRequest& req : requests) {
    prompts.push_back(req.prompt ? e.tokenizer().Encode(*req.prompt, /*add_special_tokens=*/true)
                                 : req.prompt_token_ids);
  }
  // Queues requests [0, n) and steps until they all finish, counting the generated tokens
  // (and showing them on `progress`, if any); returns 0 or the exit code.
  auto run = [&](size_t n, int64_t* generated, Clock::time_point* start, GenerateProgress* progress) {
    for (size_t i = 0; i < n; ++i) {
      if (absl::Status s = e.AddRequest(requests[i].id, prompts[i], requests[i].params); !s.ok()) {
        DUET_LOG(ERROR) << options.input_path << ": request " << i + 1 << " (id " << requests[i].id
                        << "): " << s.message();
        return 2;
      }
    }
    *start = Clock::now();
    int64_t done = 0, done_prompt_tokens = 0;
    while (e.HasUnfinished()) {
      absl::StatusOr<std::vector<RequestOutput>> step = e.Step();
      if (!step.ok()) {
        DUET_LOG(ERROR) << step.status().message();
        return 1;
      }
      for (const RequestOutput& out : *step) {
        *generated += int64_t(out.new_token_ids.size());
        if (out.finished) {
          ++done;
          done_prompt_tokens += int64_t(e.Find(out.id)->prompt.size());
        }
      }
      if (progress != nullptr) progress->Update(done, done_prompt_tokens, *generated);
    }
    return 0;
  };

  Clock::time_point start;
  int64_t generated = 0;
  if (const size_t n = std::min(requests.size(), size_t(std::max(options.warmup, 0))); n > 0) {
    if (int rc = run(n, &generated, &start, nullptr); rc != 0) return rc;
    DUET_LOG(INFO) << absl::StrFormat("warm-up: %zu requests, %lld tokens in %.2f s (not timed below)", n,
                                      static_cast<long long>(generated), Seconds(start, Clock::now()));
    for (size_t i = 0; i < n; ++i) e.Release(requests[i].id);
    // The timed run submits the warm-up's requests again: they must not find their KV cached.
    if (absl::Status reset = e.ResetPrefixCache(); !reset.ok()) {
      DUET_LOG(ERROR) << reset.message();
      return 1;
    }
    generated = 0;
  }
  const EngineStats before = e.Stats();
  {
    GenerateProgress progress(int64_t(requests.size()), options.progress);
    if (int rc = run(requests.size(), &generated, &start, &progress); rc != 0) return rc;
  }
  const double elapsed = Seconds(start, Clock::now());

  std::vector<nlohmann::json> out_rows;
  std::vector<double> ttft_ms;
  for (const GenerateRequest& req : requests) {
    const Request& r = *e.Find(req.id);
    out_rows.push_back(OutputRow(r, e.tokenizer()));
    if (r.first_token_time != Clock::time_point{}) ttft_ms.push_back(1e3 * Seconds(r.arrival_time, r.first_token_time));
  }
  if (absl::Status s = WriteJsonl(options.output_path, out_rows); !s.ok()) {
    DUET_LOG(ERROR) << s.message();
    return 1;
  }
  std::sort(ttft_ms.begin(), ttft_ms.end());
  const std::string ttft =
      ttft_ms.empty() ? "no first tokens"
                      : absl::StrFormat("TTFT median %.1f ms, max %.1f ms",
                                        (ttft_ms[(ttft_ms.size() - 1) / 2] + ttft_ms[ttft_ms.size() / 2]) / 2,
                                        ttft_ms.back());
  const EngineStats after = e.Stats();
  const IntervalStats run_stats = EngineIntervalStats(before, after, elapsed, EngineStatsLabelsOf(e));
  DUET_LOG(INFO) << absl::StrFormat(
      "%zu requests, %lld tokens in %.2f s (%.1f tok/s), %s, %lld preemptions, %lld steps of %.2f ms (forward %.2f ms)",
      requests.size(), static_cast<long long>(generated), elapsed, elapsed > 0 ? generated / elapsed : 0.0, ttft,
      static_cast<long long>(after.num_preemptions - before.num_preemptions), static_cast<long long>(run_stats.steps),
      run_stats.step_ms(), run_stats.forward_ms());
  return 0;
}

}  // namespace duet
