// duet-bench: a serving benchmark client, after vLLM's benchmark_serving. Sends a workload to a
// Duet router (gRPC) or any OpenAI-compatible HTTP server on an arrival schedule, and reports
// throughput, TTFT, TPOT, ITL, E2EL and goodput (multi-turn chats: TTFT of first and later turns too).
//
//   duet-bench --backend duet-grpc --base-url 127.0.0.1:50051 --tokenizer models/tiny-code-llama
//              --dataset random --input-len 128 --output-len 64 --num-prompts 100 --request-rate 4
// vLLM bench serve's flag names work too (--dataset-name, --random-input-len, --host/--port,
// --endpoint, --save-result, --percentile-metrics, --header, --extra-body, ...), and its result
// JSON keys are written. With --save-requests PATH it writes the workload as `duet generate`
// input instead and exits, so the engine alone can run the same requests.
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "CLI/CLI.hpp"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "bench/serving/arrival.h"
#include "bench/serving/client_grpc.h"
#include "bench/serving/client_openai.h"
#include "bench/serving/dataset.h"
#include "bench/serving/metrics.h"
#include "bench/serving/progress.h"
#include "bench/serving/report.h"
#include "frontend/tokenizer/tokenizer.h"
#include "rpc/tls.h"

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
  std::string host = "127.0.0.1";
  std::optional<int> port;  // default: 50051 for duet-grpc, 8000 for OpenAI
  std::string endpoint;
  std::string model, served_model_name;
  std::string dataset = "random";
  std::string dataset_path, code_dir, tokenizer, api_key, result_json, save_requests;
  int input_len = 1024, output_len = 128, num_prompts = 1000, max_concurrency = 0, num_warmups = 0;
  int prefix_len = 512, num_prefix_groups = 4;
  int num_sessions = 16, num_turns = 4;
  double range_ratio = 0, request_rate = std::numeric_limits<double>::infinity(), burstiness = 1;
  uint64_t seed = 0;
  bool ignore_eos = false;
  bool output_len_given = false;
  bool disable_progress = false;
  std::vector<std::string> goodput;
  std::string percentile_metrics = "ttft,tpot,itl,e2el", metric_percentiles = "90,99";
  bool save_result = false, save_detailed = false;
  std::string result_dir, result_filename, label;
  std::vector<std::string> headers, metadata;
  std::string extra_body;
  SamplingFlags sampling;
  bool tls = false;        // TLS with the system's CAs (implied by --ssl-* and https://)
  rpc::TlsFiles tls_files;  // --ssl-ca-certs, --ssl-certfile, --ssl-keyfile
};

// vLLM's backend names for the same clients.
std::string CanonicalBackend(const std::string& backend) {
  return backend == "openai" || backend == "vllm" ? "openai-completions" : backend;
}

// KEY=VALUE items (--header, --metadata) → pairs; `flag` names the flag in errors.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> KeyValues(const std::vector<std::string>& items,
                                                                          const std::string& flag) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " wants KEY=VALUE, got '", item, "'"));
    }
    out.emplace_back(std::string(absl::StripAsciiWhitespace(item.substr(0, eq))),
                     std::string(absl::StripAsciiWhitespace(item.substr(eq + 1))));
  }
  return out;
}

// The server: --base-url, else --host and --port.
std::string BaseUrl(const Flags& f) {
  if (!f.base_url.empty()) return f.base_url;
  const std::string host = f.host.find(':') != std::string::npos ? absl::StrCat("[", f.host, "]") : f.host;
  if (CanonicalBackend(f.backend) == "duet-grpc") return absl::StrCat(host, ":", f.port.value_or(50051));
  const bool tls = f.tls || !f.tls_files.ca_certs.empty() || !f.tls_files.certfile.empty();
  return absl::StrCat(tls ? "https://" : "http://", host, ":", f.port.value_or(8000));
}

// The --ssl-* files, read and checked (nullopt: none given).
absl::StatusOr<std::optional<rpc::TlsMaterial>> ClientTls(const Flags& f) {
  if (f.tls_files.ca_certs.empty() && f.tls_files.certfile.empty() && f.tls_files.keyfile.empty()) return std::nullopt;
  return rpc::LoadClientTls(f.tls_files, "--ssl-");
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "duet-bench: %s\n", std::string(status.message()).c_str());
  return 1;
}

absl::StatusOr<std::unique_ptr<Client>> MakeClient(const Flags& f, Headers headers) {
  const std::string backend = CanonicalBackend(f.backend);
  if (backend == "duet-grpc") {
    if (!f.extra_body.empty()) return absl::InvalidArgumentError("--extra-body is for the OpenAI backends");
    if (!f.endpoint.empty()) return absl::InvalidArgumentError("--endpoint is for the OpenAI backends");
    GrpcClientOptions o;
    o.address = BaseUrl(f);
    absl::StatusOr<std::optional<rpc::TlsMaterial>> tls = ClientTls(f);
    if (!tls.ok()) return tls.status();
    if (tls->has_value()) {
      o.credentials = rpc::ChannelCredentials(**tls);
    } else if (f.tls) {
      o.credentials = grpc::SslCredentials({});  // the system's CAs
    }
    o.api_key = f.api_key;
    o.sampling = f.sampling;
    for (auto& [key, value] : headers) o.headers.emplace_back(absl::AsciiStrToLower(key), std::move(value));
    const int at_once = f.dataset == "multi-turn" ? f.num_sessions : f.num_prompts;  // a session: one turn at a time
    const int in_flight = f.max_concurrency > 0 ? std::min(f.max_concurrency, at_once) : at_once;
    o.num_channels = std::clamp((in_flight + kStreamsPerChannel - 1) / kStreamsPerChannel, 1, kMaxChannels);
    absl::StatusOr<std::unique_ptr<GrpcClient>> client = GrpcClient::Create(o);
    if (!client.ok()) return client.status();
    return std::unique_ptr<Client>(std::move(*client));
  }
  if (backend == "openai-completions" || backend == "openai-chat") {
    OpenAiClientOptions o;
    o.base_url = BaseUrl(f);
    absl::StatusOr<std::optional<rpc::TlsMaterial>> tls = ClientTls(f);
    if (!tls.ok()) return tls.status();
    if (tls->has_value()) o.tls = **tls;
    if (f.tls && !o.base_url.starts_with("https://")) {
      return absl::InvalidArgumentError("--tls with an http:// --base-url: use https://");
    }
    o.chat = backend == "openai-chat";
    o.endpoint = f.endpoint;
    o.model = f.served_model_name.empty() ? f.model : f.served_model_name;
    o.api_key = f.api_key;
    o.sampling = f.sampling;
    o.headers = std::move(headers);
    if (!f.extra_body.empty()) {
      o.extra_body = nlohmann::json::parse(f.extra_body, nullptr, /*allow_exceptions=*/false);
      if (!o.extra_body.is_object()) return absl::InvalidArgumentError("--extra-body must be a JSON object");
    }
    absl::StatusOr<std::unique_ptr<OpenAiClient>> client = OpenAiClient::Create(o);
    if (!client.ok()) return client.status();
    return std::unique_ptr<Client>(std::move(*client));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown --backend '", f.backend, "' (duet-grpc, openai-completions or openai / vllm, openai-chat)"));
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
  absl::StatusOr<std::vector<std::string>> percentile_metrics = ParsePercentileMetrics(f.percentile_metrics);
  if (!percentile_metrics.ok()) return Fail(percentile_metrics.status());
  absl::StatusOr<std::vector<double>> percentiles = ParseMetricPercentiles(f.metric_percentiles);
  if (!percentiles.ok()) return Fail(percentiles.status());
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> metadata = KeyValues(f.metadata, "--metadata");
  if (!metadata.ok()) return Fail(metadata.status());
  absl::StatusOr<Headers> headers = KeyValues(f.headers, "--header");
  if (!headers.ok()) return Fail(headers.status());
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
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(f, *std::move(headers));
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
  if (f.num_warmups > 0) {  // vLLM's --num-warmups: the warm-up request again, untimed
    std::fprintf(stderr, "duet-bench: %d more warm-up requests\n", f.num_warmups);
    Dispatch(std::vector<double>(static_cast<size_t>(f.num_warmups), 0.0), f.max_concurrency,
             [&](int, std::function<void()> done) {
               (*client)->Send(warmup_request, [done = std::move(done)](RequestResult) { done(); });
             });
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
    ProgressBar progress(num_requests, !f.disable_progress);
    auto seconds_since_start = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
    // Request i, sent at `sent`, ended with `r` (`prompt_tokens`: the dataset's count, if the
    // server gave none).
    auto record = [&](int i, double sent, int prompt_tokens, RequestResult r) {
      if (r.prompt_tokens == 0) r.prompt_tokens = prompt_tokens;
      r.start_time = sent;
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
        if (CanonicalBackend(f.backend) == "openai-chat") request.messages = ChatMessages(session, said);
        const double sent = seconds_since_start();
        (*client)->Send(request, [&, s, turn, sent, done = std::move(done)](RequestResult r) {
          answers[size_t(s)].push_back(r.output_text);
          r.turn = turn;
          record(s * f.num_turns + turn, sent, 0, std::move(r));
          done();
        });
      });
    } else {
      Dispatch(*schedule, f.max_concurrency, [&](int i, std::function<void()> done) {
        const BenchRequest& request = requests[size_t(i)];
        const double sent = seconds_since_start();
        (*client)->Send(to_send(request), [&, i, sent, done = std::move(done)](RequestResult r) {
          record(i, sent, request.prompt_tokens, std::move(r));
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

  const BenchmarkMetrics metrics = ComputeMetrics(results, duration, *slo, *percentiles);
  const RunInfo info{.backend = f.backend, .base_url = BaseUrl(f),
                     .model = f.served_model_name.empty() ? f.model : f.served_model_name, .dataset = f.dataset,
                     .label = f.label, .model_id = f.model, .tokenizer_id = f.tokenizer.empty() ? f.model : f.tokenizer,
                     .num_prompts = num_requests, .request_rate = f.request_rate, .burstiness = f.burstiness,
                     .max_concurrency = f.max_concurrency, .ignore_eos = f.ignore_eos, .seed = f.seed,
                     .percentile_metrics = *percentile_metrics, .metadata = *metadata, .date = RunDate()};
  std::fputs(FormatReport(info, metrics).c_str(), stdout);
  std::fflush(stdout);
  // --result-json PATH (Duet's): always with the per-request figures. --save-result (vLLM's):
  // --result-dir / --result-filename or vLLM's file name, per request only with --save-detailed.
  std::vector<std::pair<std::string, bool>> outputs;
  if (!f.result_json.empty()) outputs.emplace_back(f.result_json, true);
  if (f.save_result) {
    std::string name = f.result_filename.empty() ? ResultFileName(info) : f.result_filename;
    if (!f.result_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(f.result_dir, ec);
      if (ec) return Fail(absl::UnavailableError(absl::StrCat("cannot make --result-dir '", f.result_dir, "': ", ec.message())));
      name = (std::filesystem::path(f.result_dir) / name).string();
    }
    outputs.emplace_back(name, f.save_detailed);
  }
  for (const auto& [path, detailed] : outputs) {
    std::ofstream out(path);
    out << ReportJson(info, metrics, results, detailed).dump(2) << "\n";
    if (!out) return Fail(absl::UnavailableError(absl::StrCat("cannot write the results to '", path, "'")));
    std::fprintf(stderr, "duet-bench: results in %s\n", path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace duet::bench

int main(int argc, char** argv) {
  duet::bench::Flags f;
  duet::bench::SamplingFlags& sampling = f.sampling;
  CLI::App app{"duet-bench: serving benchmark for Duet's gRPC API and OpenAI-compatible servers (vLLM bench serve's "
               "flag names work too)"};
  app.option_defaults()->always_capture_default();
  app.add_option("--backend", f.backend, "duet-grpc | openai-completions (or vLLM's openai, vllm) | openai-chat")
      ->check(CLI::IsMember({"duet-grpc", "openai-completions", "openai", "vllm", "openai-chat"}));
  app.add_option("--base-url", f.base_url,
                 "host:port for duet-grpc; http(s)://host:port for OpenAI (default: from --host and --port)");
  app.add_option("--host", f.host, "The server's host when there is no --base-url");
  app.add_option("--port", f.port, "The server's port when there is no --base-url (default: 50051 for duet-grpc, "
                                   "8000 for OpenAI)")
      ->check(CLI::Range(1, 65535));
  app.add_option("--endpoint", f.endpoint, "OpenAI: the API path (default: /v1/completions or /v1/chat/completions)");
  app.add_option("--model", f.model, "Model name sent to OpenAI servers (required there), and the results' model_id");
  app.add_option("--served-model-name", f.served_model_name, "OpenAI: the model name sent, when not --model")
      ->default_str("");
  app.add_option("--dataset,--dataset-name", f.dataset, "random | jsonl | sharegpt | shared-prefix | code | multi-turn");
  app.add_option("--dataset-path", f.dataset_path, "File for jsonl and sharegpt");
  app.add_option("--code-dir", f.code_dir, "Directory of source files for the code dataset");
  app.add_option("--tokenizer", f.tokenizer, "Model directory with tokenizer.json (random, shared-prefix, code)");
  app.add_option("--input-len,--random-input-len", f.input_len,
                 "Prompt tokens (random, code; the question for shared-prefix; each user message for multi-turn)")
      ->check(CLI::PositiveNumber);
  CLI::Option* output_len =
      app.add_option("--output-len,--random-output-len", f.output_len, "Output tokens to ask for")->check(CLI::PositiveNumber);
  app.add_option("--range-ratio,--random-range-ratio", f.range_ratio, "Lengths uniform in len*(1-r)..len*(1+r)")
      ->check(CLI::Range(0.0, 0.999));
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
  app.add_option("--num-warmups", f.num_warmups, "More untimed copies of the warm-up request before the run")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", f.seed, "Seed for the dataset and the arrivals");
  app.add_flag("--ignore-eos", f.ignore_eos, "Generate exactly the asked-for output lengths");
  app.add_option("--goodput", f.goodput, "SLOs for goodput: ttft:MS tpot:MS e2el:MS")->default_str("");
  app.add_option("--percentile-metrics", f.percentile_metrics, "The latency metrics reported, of ttft,tpot,itl,e2el");
  app.add_option("--metric-percentiles", f.metric_percentiles, "The percentiles reported, e.g. 50,90,99.9");
  app.add_option("--result-json", f.result_json, "Write the results (with per-request figures) as JSON here");
  app.add_flag("--save-result", f.save_result,
               "Write the results as JSON to --result-dir/--result-filename (default name: "
               "<label or backend>-<rate>qps[-concurrency<N>]-<model>-<date>.json, as vLLM)");
  app.add_flag("--save-detailed", f.save_detailed, "With --save-result: the per-request figures too");
  app.add_option("--result-dir", f.result_dir, "Directory for --save-result (made if missing)");
  app.add_option("--result-filename", f.result_filename, "File name for --save-result");
  app.add_option("--label", f.label, "The results' label (and file name prefix; default: the backend)");
  app.add_option("--metadata", f.metadata, "KEY=VALUE pairs recorded in the result JSON")->default_str("");
  app.add_option("--header", f.headers, "KEY=VALUE HTTP headers (gRPC metadata) sent with every request")->default_str("");
  app.add_option("--extra-body", f.extra_body, "OpenAI: a JSON object merged into every request body");
  app.add_flag("--disable-tqdm", f.disable_progress, "No progress bar");
  app.add_option("--temperature", sampling.temperature, "Sampling temperature (default: 0, greedy)");
  app.add_option("--top-p", sampling.top_p, "Top-p (default: the server's)");
  app.add_option("--top-k", sampling.top_k, "Top-k (default: the server's)");
  app.add_option("--min-p", sampling.min_p, "Min-p (default: the server's)");
  app.add_option("--frequency-penalty", sampling.frequency_penalty, "Frequency penalty (default: the server's)");
  app.add_option("--presence-penalty", sampling.presence_penalty, "Presence penalty (default: the server's)");
  app.add_option("--repetition-penalty", sampling.repetition_penalty, "Repetition penalty (default: the server's)");
  app.add_option("--save-requests", f.save_requests,
                 "Write the workload as `duet generate` input JSONL (token ids as a Duet router encodes the "
                 "prompts) and exit without contacting a server");
  app.add_option("--api-key", f.api_key, "Bearer token (HTTP Authorization / gRPC metadata)");
  app.add_flag("--tls", f.tls,
               "Connect with TLS (duet-grpc; OpenAI: https://), verifying the server against the system's CAs");
  app.add_option("--ssl-ca-certs", f.tls_files.ca_certs,
                 "PEM CA certificates the server's certificate is verified against (implies --tls)");
  app.add_option("--ssl-certfile", f.tls_files.certfile,
                 "PEM client certificate, for a server that asks for one (--ssl-cert-reqs; needs --ssl-ca-certs)");
  app.add_option("--ssl-keyfile", f.tls_files.keyfile, "PEM private key of --ssl-certfile");
  CLI11_PARSE(app, argc, argv);
  f.output_len_given = output_len->count() > 0;
  return duet::bench::Run(f);
}
