// duet-bench: a serving benchmark client, after vLLM's benchmark_serving. Sends a workload to a
// Duet router (gRPC) or any OpenAI-compatible HTTP server on an arrival schedule, and reports
// throughput, TTFT, TPOT, ITL, E2EL and goodput (multi-turn chats: TTFT of first and later turns too).
//
//   duet-bench --backend duet-grpc --base-url 127.0.0.1:50051 --tokenizer models/tiny-code-llama
//              --dataset random --input-len 128 --output-len 64 --num-prompts 100 --request-rate 4
// With --save-requests PATH it writes the workload as `duet generate` input instead and exits, so
// the engine alone can run the same requests.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "CLI/CLI.hpp"
#include "bench/serving/arrival.h"
#include "bench/serving/client_grpc.h"
#include "bench/serving/client_openai.h"
#include "bench/serving/dataset.h"
#include "bench/serving/metrics.h"
#include "bench/serving/progress.h"
#include "bench/serving/report.h"
#include "frontend/tokenizer/tokenizer.h"

namespace duet::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Streams per gRPC channel before another channel (connection) is opened.
constexpr int kStreamsPerChannel = 100;
constexpr int kMaxChannels = 16;
constexpr int kMaxErrorsShown = 5;

struct Flags {
  std::string backend = "duet-grpc";
  std::string base_url;
  std::string model;
  std::string dataset = "random";
  std::string dataset_path, code_dir, tokenizer, api_key, result_json, save_requests;
  int input_len = 1024, output_len = 128, num_prompts = 1000, max_concurrency = 0;
  int prefix_len = 512, num_prefix_groups = 4;
  int num_sessions = 16, num_turns = 4;
  double range_ratio = 0, request_rate = std::numeric_limits<double>::infinity(), burstiness = 1;
  uint64_t seed = 0;
  bool ignore_eos = false;
  bool output_len_given = false;
  std::vector<std::string> goodput;
};

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "duet-bench: %s\n", std::string(status.message()).c_str());
  return 1;
}

absl::StatusOr<std::unique_ptr<Client>> MakeClient(const Flags& f) {
  if (f.backend == "duet-grpc") {
    GrpcClientOptions o;
    o.address = f.base_url.empty() ? "127.0.0.1:50051" : f.base_url;
    o.api_key = f.api_key;
    const int at_once = f.dataset == "multi-turn" ? f.num_sessions : f.num_prompts;  // a session: one turn at a time
    const int in_flight = f.max_concurrency > 0 ? std::min(f.max_concurrency, at_once) : at_once;
    o.num_channels = std::clamp((in_flight + kStreamsPerChannel - 1) / kStreamsPerChannel, 1, kMaxChannels);
    absl::StatusOr<std::unique_ptr<GrpcClient>> client = GrpcClient::Create(o);
    if (!client.ok()) return client.status();
    return std::unique_ptr<Client>(std::move(*client));
  }
  if (f.backend == "openai-completions" || f.backend == "openai-chat") {
    OpenAiClientOptions o;
    o.base_url = f.base_url.empty() ? "http://127.0.0.1:8000" : f.base_url;
    o.chat = f.backend == "openai-chat";
    o.model = f.model;
    o.api_key = f.api_key;
    absl::StatusOr<std::unique_ptr<OpenAiClient>> client = OpenAiClient::Create(o);
    if (!client.ok()) return client.status();
    return std::unique_ptr<Client>(std::move(*client));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown --backend '", f.backend, "' (duet-grpc, openai-completions, openai-chat)"));
}

// Sends one request and waits for it.
RequestResult SendAndWait(Client& client, const ClientRequest& request) {
  std::mutex mu;
  std::condition_variable finished;
  std::optional<RequestResult> out;
  client.Send(request, [&](RequestResult r) {
    std::lock_guard lock(mu);
    out = std::move(r);
    finished.notify_all();
  });
  std::unique_lock lock(mu);
  finished.wait(lock, [&] { return out.has_value(); });
  return std::move(*out);
}

// --save-requests: the workload as `duet generate` input, so the engine alone runs the same
// requests; no server is contacted.
int SaveRequests(const Flags& f, const std::vector<BenchRequest>& requests, const Tokenizer* tokenizer) {
  if (tokenizer == nullptr) return Fail(absl::InvalidArgumentError("--save-requests needs --tokenizer"));
  if (f.backend == "openai-chat") {
    return Fail(absl::InvalidArgumentError(
        "--save-requests writes completion prompts; openai-chat servers apply a chat template first"));
  }
  std::ofstream out(f.save_requests);
  out << GenerateInputJsonl(requests, *tokenizer, f.ignore_eos);
  out.close();
  if (!out) return Fail(absl::UnavailableError(absl::StrCat("cannot write --save-requests '", f.save_requests, "'")));
  std::fprintf(stderr, "duet-bench: wrote %zu requests to %s (no benchmark run)\n", requests.size(),
               f.save_requests.c_str());
  return 0;
}

int Run(const Flags& f) {
  absl::StatusOr<GoodputSlo> slo = ParseGoodput(f.goodput);
  if (!slo.ok()) return Fail(slo.status());
  absl::StatusOr<DatasetKind> kind = ParseDatasetKind(f.dataset);
  if (!kind.ok()) return Fail(kind.status());

  std::unique_ptr<Tokenizer> tokenizer;
  if (!f.tokenizer.empty()) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Tokenizer::FromModelDir(f.tokenizer);
    if (!loaded.ok()) return Fail(loaded.status());
    tokenizer = std::move(*loaded);
  }
  DatasetOptions d;
  d.kind = *kind;
  d.path = f.dataset_path;
  d.code_dir = f.code_dir;
  d.num_prompts = f.num_prompts;
  d.input_len = f.input_len;
  d.output_len = f.output_len;
  d.fixed_output_len = f.output_len_given;
  d.range_ratio = f.range_ratio;
  d.prefix_len = f.prefix_len;
  d.num_prefix_groups = f.num_prefix_groups;
  d.num_sessions = f.num_sessions;
  d.num_turns = f.num_turns;
  d.seed = f.seed;
  d.tokenizer = tokenizer.get();
  const bool multi_turn = *kind == DatasetKind::kMultiTurn;
  std::vector<BenchRequest> requests;
  std::vector<ChatSession> sessions;
  if (multi_turn) {
    absl::StatusOr<std::vector<ChatSession>> loaded = LoadChatSessions(d);
    if (!loaded.ok()) return Fail(loaded.status());
    sessions = *std::move(loaded);
    if (!f.save_requests.empty()) {
      return Fail(absl::InvalidArgumentError("--save-requests: multi-turn prompts depend on the server's answers"));
    }
  } else {
    absl::StatusOr<std::vector<BenchRequest>> loaded = LoadDataset(d);
    if (!loaded.ok()) return Fail(loaded.status());
    requests = *std::move(loaded);
    if (!f.save_requests.empty()) return SaveRequests(f, requests, tokenizer.get());
  }
  // multi-turn: the schedule is when each session starts; its later turns follow its answers.
  const int num_requests = multi_turn ? f.num_sessions * f.num_turns : f.num_prompts;
  absl::StatusOr<std::vector<double>> schedule =
      ArrivalSchedule(multi_turn ? f.num_sessions : f.num_prompts,
                      {.request_rate = f.request_rate, .burstiness = f.burstiness, .seed = f.seed});
  if (!schedule.ok()) return Fail(schedule.status());
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(f);
  if (!client.ok()) return Fail(client.status());

  auto to_send = [&](const BenchRequest& r) {
    return ClientRequest{.prompt = r.prompt, .max_tokens = r.output_tokens, .ignore_eos = f.ignore_eos};
  };
  if (tokenizer != nullptr && !multi_turn) {
    int64_t dataset_tokens = 0;
    for (const BenchRequest& r : requests) dataset_tokens += r.prompt_tokens;
    std::fprintf(stderr, "duet-bench: %zu prompts, %lld prompt tokens by the tokenizer (servers may add special tokens)\n",
                 requests.size(), static_cast<long long>(dataset_tokens));
  }
  // multi-turn: the first user message alone, which shares no prefix with any turn's prompt.
  const ClientRequest warmup_request =
      multi_turn ? ClientRequest{.prompt = sessions.front().user_messages.front(), .max_tokens = 4,
                                 .ignore_eos = f.ignore_eos}
                 : to_send(requests.front());
  std::fprintf(stderr, "duet-bench: warm-up request (%s)\n", multi_turn ? "a user message" : "the first prompt");
  const RequestResult warmup = SendAndWait(**client, warmup_request);
  if (!warmup.success) {
    return Fail(absl::UnavailableError(absl::StrCat("the warm-up request failed: ", warmup.error)));
  }
  std::fprintf(stderr, "duet-bench: %d requests%s, rate %s%s, burstiness %g, max concurrency %s\n", num_requests,
               multi_turn ? absl::StrCat(" (", f.num_sessions, " sessions of ", f.num_turns, " turns)").c_str() : "",
               std::isinf(f.request_rate) ? "inf" : absl::StrCat(f.request_rate).c_str(),
               multi_turn ? " sessions/s" : "", f.burstiness,
               f.max_concurrency > 0 ? absl::StrCat(f.max_concurrency).c_str() : "none");

  std::vector<RequestResult> results(static_cast<size_t>(num_requests));
  std::vector<std::vector<std::string>> answers(sessions.size());  // each session's, in turn order
  std::mutex end_mu;
  Clock::time_point last_end;
  const Clock::time_point start = Clock::now();
  {
    ProgressBar progress(num_requests);
    // Request i ended with `r` (`prompt_tokens`: the dataset's count, if the server gave none).
    auto record = [&](int i, int prompt_tokens, RequestResult r) {
      if (r.prompt_tokens == 0) r.prompt_tokens = prompt_tokens;
      const bool success = r.success;
      results[size_t(i)] = std::move(r);
      {
        std::lock_guard lock(end_mu);
        last_end = std::max(last_end, Clock::now());
      }
      progress.Finished(success);
    };
    if (multi_turn) {
      DispatchSessions(*schedule, f.num_turns, f.max_concurrency, [&](int s, int turn, std::function<void()> done) {
        const ChatSession& session = sessions[size_t(s)];
        std::vector<std::string>& said = answers[size_t(s)];  // this session's turns run one at a time
        ClientRequest request{.prompt = ChatPrompt(session, said), .max_tokens = session.output_tokens[size_t(turn)],
                              .ignore_eos = f.ignore_eos};
        if (f.backend == "openai-chat") request.messages = ChatMessages(session, said);
        (*client)->Send(request, [&, s, turn, done = std::move(done)](RequestResult r) {
          answers[size_t(s)].push_back(r.output_text);
          r.turn = turn;
          record(s * f.num_turns + turn, 0, std::move(r));
          done();
        });
      });
    } else {
      Dispatch(*schedule, f.max_concurrency, [&](int i, std::function<void()> done) {
        const BenchRequest& request = requests[size_t(i)];
        (*client)->Send(to_send(request), [&, i, done = std::move(done)](RequestResult r) {
          record(i, request.prompt_tokens, std::move(r));
          done();
        });
      });
    }
  }
  const double duration = std::chrono::duration<double>(last_end - start).count();

  std::map<std::string, int> errors;
  for (const RequestResult& r : results) {
    if (!r.success) ++errors[r.error];
  }
  int shown = 0;
  for (const auto& [error, count] : errors) {
    if (shown++ == kMaxErrorsShown) break;
    std::fprintf(stderr, "duet-bench: %d failed: %s\n", count, error.c_str());
  }

  const BenchmarkMetrics metrics = ComputeMetrics(results, duration, *slo);
  const RunInfo info{.backend = f.backend, .base_url = f.base_url, .model = f.model, .dataset = f.dataset,
                     .num_prompts = num_requests, .request_rate = f.request_rate, .burstiness = f.burstiness,
                     .max_concurrency = f.max_concurrency, .ignore_eos = f.ignore_eos, .seed = f.seed};
  std::fputs(FormatReport(info, metrics).c_str(), stdout);
  std::fflush(stdout);
  if (!f.result_json.empty()) {
    std::ofstream out(f.result_json);
    out << ReportJson(info, metrics, results).dump(2) << "\n";
    if (!out) return Fail(absl::UnavailableError(absl::StrCat("cannot write --result-json '", f.result_json, "'")));
  }
  return 0;
}

}  // namespace
}  // namespace duet::bench

int main(int argc, char** argv) {
  duet::bench::Flags f;
  CLI::App app{"duet-bench: serving benchmark for Duet's gRPC API and OpenAI-compatible servers"};
  app.add_option("--backend", f.backend, "duet-grpc | openai-completions | openai-chat")
      ->check(CLI::IsMember({"duet-grpc", "openai-completions", "openai-chat"}));
  app.add_option("--base-url", f.base_url,
                 "host:port for duet-grpc (default 127.0.0.1:50051); http://host:port for OpenAI (default "
                 "http://127.0.0.1:8000)");
  app.add_option("--model", f.model, "Model name sent to OpenAI servers (required there)");
  app.add_option("--dataset", f.dataset, "random | jsonl | sharegpt | shared-prefix | code | multi-turn");
  app.add_option("--dataset-path", f.dataset_path, "File for jsonl and sharegpt");
  app.add_option("--code-dir", f.code_dir, "Directory of source files for the code dataset");
  app.add_option("--tokenizer", f.tokenizer, "Model directory with tokenizer.json (random, shared-prefix, code)");
  app.add_option("--input-len", f.input_len,
                 "Prompt tokens (random, code; the question for shared-prefix; each user message for multi-turn)")
      ->check(CLI::PositiveNumber);
  CLI::Option* output_len = app.add_option("--output-len", f.output_len, "Output tokens to ask for")->check(CLI::PositiveNumber);
  app.add_option("--range-ratio", f.range_ratio, "Lengths uniform in len*(1-r)..len*(1+r)")->check(CLI::Range(0.0, 0.999));
  app.add_option("--prefix-len", f.prefix_len, "shared-prefix, multi-turn: tokens of each shared system prompt")
      ->check(CLI::PositiveNumber);
  app.add_option("--num-prefix-groups", f.num_prefix_groups,
                 "shared-prefix, multi-turn: number of system prompts (multi-turn: session s has prompt s mod this)")
      ->check(CLI::PositiveNumber);
  app.add_option("--num-sessions", f.num_sessions, "multi-turn: chat sessions, running side by side")
      ->check(CLI::PositiveNumber);
  app.add_option("--num-turns", f.num_turns, "multi-turn: turns of each session (requests: sessions x turns)")
      ->check(CLI::PositiveNumber);
  app.add_option("--num-prompts", f.num_prompts, "Requests to send (not multi-turn)")->check(CLI::PositiveNumber);
  app.add_option("--request-rate", f.request_rate,
                 "Requests per second (multi-turn: sessions started per second; inf: all at once)");
  app.add_option("--burstiness", f.burstiness, "Gamma shape of the arrivals (1: Poisson)");
  app.add_option("--max-concurrency", f.max_concurrency, "Cap on requests in flight (0: none)")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", f.seed, "Seed for the dataset and the arrivals");
  app.add_flag("--ignore-eos", f.ignore_eos, "Generate exactly the asked-for output lengths");
  app.add_option("--goodput", f.goodput, "SLOs for goodput: ttft:MS tpot:MS e2el:MS");
  app.add_option("--result-json", f.result_json, "Write the results as JSON here");
  app.add_option("--save-requests", f.save_requests,
                 "Write the workload as `duet generate` input JSONL (token ids as a Duet router encodes the "
                 "prompts) and exit without contacting a server");
  app.add_option("--api-key", f.api_key, "Bearer token (HTTP Authorization / gRPC metadata)");
  CLI11_PARSE(app, argc, argv);
  f.output_len_given = output_len->count() > 0;
  return duet::bench::Run(f);
}
