// `duet generate`: offline batch generation through the engine, all requests submitted at once
// so they share the continuously batched steps.
#include <chrono>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "backends/executor_factory.h"
#include "cli/commands.h"
#include "cli/generate_request.h"
#include "cli/jsonl.h"
#include "common/logging.h"

namespace duet {
namespace {

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
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
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerateRequest& req = requests[i];
    std::vector<int32_t> prompt = req.prompt ? e.tokenizer().Encode(*req.prompt, /*add_special_tokens=*/true)
                                             : req.prompt_token_ids;
    if (absl::Status s = e.AddRequest(req.id, std::move(prompt), req.params); !s.ok()) {
      DUET_LOG(ERROR) << options.input_path << ": request " << i + 1 << " (id " << req.id << "): " << s.message();
      return 2;
    }
  }

  const Clock::time_point start = Clock::now();
  int64_t generated = 0;
  while (e.HasUnfinished()) {
    absl::StatusOr<std::vector<RequestOutput>> step = e.Step();
    if (!step.ok()) {
      DUET_LOG(ERROR) << step.status().message();
      return 1;
    }
    for (const RequestOutput& out : *step) generated += int64_t(out.new_token_ids.size());
  }
  const double elapsed = Seconds(start, Clock::now());

  std::vector<nlohmann::json> out_rows;
  for (const GenerateRequest& req : requests) out_rows.push_back(OutputRow(*e.Find(req.id), e.tokenizer()));
  if (absl::Status s = WriteJsonl(options.output_path, out_rows); !s.ok()) {
    DUET_LOG(ERROR) << s.message();
    return 1;
  }
  DUET_LOG(INFO) << absl::StrFormat("%zu requests, %lld tokens in %.2f s (%.1f tok/s), %lld preemptions",
                                    requests.size(), static_cast<long long>(generated), elapsed,
                                    elapsed > 0 ? generated / elapsed : 0.0,
                                    static_cast<long long>(e.Stats().num_preemptions));
  return 0;
}

}  // namespace duet
