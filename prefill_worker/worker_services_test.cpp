// Both worker services in one process over real gRPC and UCX loopback, driven as the router
// drives them: ReserveKv (decode) → Prefill (prefill) → Decode (decode).
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/executor_factory.h"
#include "decode_worker/decode_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "prefill_worker/prefill_service.h"
#include "rpc/kv_target_auth.h"
#include "rpc/rpc_util.h"

namespace duet {
namespace {

constexpr char kModel[] = DUET_MODELS_DIR "/tiny-code-llama";

std::unique_ptr<LlmEngine> NewEngine(int32_t block_size, int32_t num_blocks, int32_t max_batched_tokens = 2048) {
  EngineConfig config;
  config.model_dir = kModel;
  config.block_size = block_size;
  config.num_kv_blocks = num_blocks;
  config.scheduler.max_num_batched_tokens = max_batched_tokens;
  absl::StatusOr<std::unique_ptr<LlmEngine>> e = CreateEngine(config);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

std::vector<int32_t> LocalOutput(const std::vector<int32_t>& prompt, const SamplingParams& p) {
  std::unique_ptr<LlmEngine> e = NewEngine(16, 256);
  EXPECT_TRUE(e->AddRequest("x", prompt, p).ok());
  while (e->HasUnfinished()) EXPECT_TRUE(e->Step().ok());
  return e->Find("x")->output;
}

struct FlowResult {
  grpc::Status reserve, prefill, decode;
  std::vector<int32_t> tokens;
  std::vector<int32_t> prompt_echo;
  std::string text;
  std::string finish_reason;
  int32_t num_logprobs = 0;
  int32_t completion_tokens = 0;
};

class WorkerServicesTest : public ::testing::Test {
 protected:
  static constexpr int32_t kDecodeBlocks = 64;

  void SetUp() override {
    // Prefill: block size 16, prompts chunked 8 tokens per step. Decode: block size 8 (the
    // transport re-blocks).
    DecodeServiceOptions decode_options;
    decode_options.kv_pools = decode_staging_;
    decode_options.verify_kv_checksums = true;  // every transfer in these tests is checksummed
    decode_options.kv_target_key = kv_target_key_;
    absl::StatusOr<std::unique_ptr<DecodeService>> decode =
        DecodeService::Create(NewEngine(8, kDecodeBlocks), decode_options);
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::move(*decode);
    PrefillServiceOptions prefill_options;
    prefill_options.sender.operation_timeout = absl::Seconds(3);
    prefill_options.kv_pools = prefill_staging_;
    prefill_options.verify_kv_checksums = true;
    prefill_options.kv_target_key = kv_target_key_;
    absl::StatusOr<std::unique_ptr<PrefillService>> prefill =
        PrefillService::Create(NewEngine(16, 128, /*max_batched_tokens=*/8), prefill_options);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::move(*prefill);

    int port = 0;
    auto decode_server = rpc::StartServer("127.0.0.1:0", {decode_.get()}, &port);
    ASSERT_TRUE(decode_server.ok()) << decode_server.status();
    decode_server_ = std::move(*decode_server);
    decode_stub_ = v1::DecodeWorker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    auto prefill_server = rpc::StartServer("127.0.0.1:0", {prefill_.get()}, &port);
    ASSERT_TRUE(prefill_server.ok()) << prefill_server.status();
    prefill_server_ = std::move(*prefill_server);
    prefill_stub_ = v1::PrefillWorker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));

    static const std::vector<int32_t> prompt = [] {
      absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(kModel);
      EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
      return (*tokenizer)->Encode("import os\n\ndef read_config(path):\n    with open(path) as f:\n");
    }();
    prompt_ = prompt;
  }

  void TearDown() override {
    if (prefill_server_) prefill_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    if (decode_server_) decode_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    prefill_.reset();
    decode_.reset();
  }

  template <typename Stub>
  static v1::WorkerStats StatsOf(Stub& stub) {
    grpc::ClientContext ctx;
    v1::WorkerStats stats;
    EXPECT_TRUE(stub.GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    return stats;
  }
  v1::WorkerStats DecodeStats() { return StatsOf(*decode_stub_); }
  v1::WorkerStats PrefillStats() { return StatsOf(*prefill_stub_); }

  // Waits until a worker holds no blocks (a prefill worker none kept for a late target), leases
  // or requests.
  template <typename Stub>
  static bool BecomesIdle(Stub& stub, std::chrono::milliseconds timeout) {
    return StatsBecome(
        stub,
        [](const v1::WorkerStats& s) {
          return s.num_free_kv_blocks() == s.num_kv_blocks() && s.num_kv_leases() == 0 &&
                 s.num_requests_running() == 0 && s.num_requests_waiting() == 0;
        },
        timeout, "idle");
  }
  // Whether the worker's stats meet `want` within `timeout` (blocks a cancelled reservation held
  // go back on the engine thread, after the Abort's answer).
  template <typename Stub, typename Want>
  static bool StatsBecome(Stub& stub, Want want, std::chrono::milliseconds timeout, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      v1::WorkerStats s = StatsOf(stub);
      if (want(s)) return true;
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << s.role() << " worker not " << what << ": free " << s.num_free_kv_blocks() << "/"
                      << s.num_kv_blocks() << ", leases " << s.num_kv_leases() << ", running "
                      << s.num_requests_running();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  bool DecodeBecomesIdle(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    return BecomesIdle(*decode_stub_, timeout);
  }
  bool PrefillBecomesIdle(std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    return BecomesIdle(*prefill_stub_, timeout);
  }

  grpc::Status Reserve(const std::string& id, uint64_t transfer_id, int32_t lease_ms, v1::KvTarget* target,
                       int32_t num_output_tokens = 0) {
    grpc::ClientContext ctx;
    v1::ReserveKvRequest req;
    req.set_request_id(id);
    req.set_transfer_id(transfer_id);
    req.set_num_prompt_tokens(int32_t(prompt_.size()) + num_output_tokens);
    req.set_lease_ms(lease_ms);
    v1::ReserveKvResponse resp;
    grpc::Status s = decode_stub_->ReserveKv(&ctx, req, &resp);
    *target = resp.target();
    return s;
  }

  grpc::Status Prefill(const std::string& id, const v1::SamplingOptions& sampling, const v1::KvTarget& target,
                       v1::PrefillResponse* resp) {
    return PrefillPrompt(id, prompt_, sampling, target, resp);
  }
  grpc::Status PrefillPrompt(const std::string& id, const std::vector<int32_t>& prompt,
                             const v1::SamplingOptions& sampling, const v1::KvTarget& target,
                             v1::PrefillResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::PrefillRequest req;
    req.set_request_id(id);
    for (int32_t t : prompt) req.add_prompt_token_ids(t);
    *req.mutable_sampling() = sampling;
    *req.mutable_target() = target;
    return prefill_stub_->Prefill(&ctx, req, resp);
  }

  // Greedy, 200 tokens, past EOS: a stream still running when the test acts on it.
  static v1::SamplingOptions LongGreedy() {
    SamplingParams p;
    p.temperature = 0.0f;
    p.max_tokens = 200;
    p.ignore_eos = true;
    return rpc::ToSamplingOptions(p);
  }
  // The KV of request `id` reserved on the decode worker and prefilled into it (10 s lease).
  void ReserveAndPrefill(const std::string& id, uint64_t transfer_id, const v1::SamplingOptions& sampling,
                         v1::PrefillResponse* pre) {
    v1::KvTarget target;
    ASSERT_TRUE(Reserve(id, transfer_id, 10000, &target).ok());
    ASSERT_TRUE(Prefill(id, sampling, target, pre).ok());
  }

  v1::DecodeRequest DecodeRequestFor(const std::string& id, uint64_t transfer_id,
                                     const v1::SamplingOptions& sampling, const v1::PrefillResponse& pre) {
    v1::DecodeRequest req;
    req.set_request_id(id);
    req.set_transfer_id(transfer_id);
    for (int32_t t : prompt_) req.add_prompt_token_ids(t);
    *req.mutable_sampling() = sampling;
    req.set_first_token_id(pre.first_token_id());
    *req.mutable_first_token_logprobs() = pre.first_token_logprobs();
    return req;
  }

  FlowResult RunFlow(const std::string& id, uint64_t transfer_id, const v1::SamplingOptions& sampling) {
    FlowResult r;
    v1::KvTarget target;
    r.reserve = Reserve(id, transfer_id, 10000, &target);
    if (!r.reserve.ok()) return r;
    v1::PrefillResponse pre;
    r.prefill = Prefill(id, sampling, target, &pre);
    if (!r.prefill.ok()) return r;
    ReadDecode(id, transfer_id, sampling, pre, &r);
    return r;
  }

  // Decode's stream into `r`.
  void ReadDecode(const std::string& id, uint64_t transfer_id, const v1::SamplingOptions& sampling,
                  const v1::PrefillResponse& pre, FlowResult* out) {
    ReadStream(DecodeRequestFor(id, transfer_id, sampling, pre), out);
  }
  void ReadStream(const v1::DecodeRequest& request, FlowResult* out) {
    FlowResult& r = *out;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = decode_stub_->Decode(&ctx, request);
    v1::GenerateResponse msg;
    bool first = true;
    while (reader->Read(&msg)) {
      EXPECT_EQ(msg.request_id(), request.request_id());
      if (first) r.prompt_echo.assign(msg.prompt_token_ids().begin(), msg.prompt_token_ids().end());
      first = false;
      r.tokens.insert(r.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
      r.text += msg.text();
      r.num_logprobs += msg.logprobs_size();
      if (msg.finished()) {
        r.finish_reason = msg.finish_reason();
        r.completion_tokens = msg.usage().completion_tokens();
      }
    }
    r.decode = reader->Finish();
  }

  // Reads three messages of `request`'s stream (still running: the request holds blocks), cancels
  // it, and expects CANCELLED and the decode worker idle again.
  void ExpectCancelMidStreamFreesItsBlocks(const v1::DecodeRequest& request) {
    grpc::ClientContext ctx;
    auto reader = decode_stub_->Decode(&ctx, request);
    v1::GenerateResponse msg;
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(reader->Read(&msg));
    EXPECT_LT(DecodeStats().num_free_kv_blocks(), kDecodeBlocks);
    ctx.TryCancel();
    while (reader->Read(&msg)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_TRUE(DecodeBecomesIdle());
  }

  // Conditional disaggregation: the decode worker prefills the prompt itself.
  static v1::DecodeRequest PrefillHereRequest(const std::string& id, const std::vector<int32_t>& prompt,
                                              const v1::SamplingOptions& sampling) {
    v1::DecodeRequest req;
    req.set_request_id(id);
    for (int32_t t : prompt) req.add_prompt_token_ids(t);
    *req.mutable_sampling() = sampling;
    req.set_prefill_here(true);
    return req;
  }

  // Requests 0 .. n-1 at once, each with `params_of(i)` (12 tokens past EOS), each through `run`
  // into its FlowResult; returns them after checking every one succeeded and gave the local
  // generation's tokens.
  std::vector<FlowResult> RunConcurrentlyMatchingLocalGeneration(
      int n, const std::function<SamplingParams(int)>& params_of,
      const std::function<void(int, const v1::SamplingOptions&, FlowResult*)>& run) {
    std::vector<SamplingParams> params(static_cast<size_t>(n));
    std::vector<std::vector<int32_t>> expected(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      params[i] = params_of(i);
      params[i].max_tokens = 12;
      params[i].ignore_eos = true;
      expected[i] = LocalOutput(prompt_, params[i]);
    }
    std::vector<FlowResult> results(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] { run(i, rpc::ToSamplingOptions(params[i]), &results[i]); });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(results[i].reserve.ok() && results[i].prefill.ok() && results[i].decode.ok())
          << i << ": " << results[i].reserve.error_message() << results[i].prefill.error_message()
          << results[i].decode.error_message();
      EXPECT_EQ(results[i].tokens, expected[i]) << i;
    }
    return results;
  }

  // A Prefill whose target follows (SetKvTarget), on a thread of its own.
  struct LatePrefillCall {
    std::thread thread;
    grpc::Status status;
    v1::PrefillResponse response;
  };
  std::unique_ptr<LatePrefillCall> StartLatePrefill(const std::string& id, const v1::SamplingOptions& sampling,
                                                    std::chrono::milliseconds deadline = std::chrono::seconds(20)) {
    auto call = std::make_unique<LatePrefillCall>();
    v1::PrefillRequest req;
    req.set_request_id(id);
    for (int32_t t : prompt_) req.add_prompt_token_ids(t);
    *req.mutable_sampling() = sampling;
    req.set_target_follows(true);
    call->thread = std::thread([this, call = call.get(), req, deadline] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + deadline);
      call->status = prefill_stub_->Prefill(&ctx, req, &call->response);
    });
    return call;
  }
  grpc::Status SetKvTarget(const std::string& id, const v1::KvTarget& target) {
    grpc::ClientContext ctx;
    v1::SetKvTargetRequest req;
    req.set_request_id(id);
    *req.mutable_target() = target;
    v1::SetKvTargetResponse resp;
    return prefill_stub_->SetKvTarget(&ctx, req, &resp);
  }

  // Default: the decode cache's own pools are registered with UCX (host caches); the prefill
  // worker always sends from its staging.
  WorkerKvPoolOptions decode_staging_, prefill_staging_;
  std::string kv_target_key_;  // both services' (empty: targets neither signed nor checked)
  std::unique_ptr<DecodeService> decode_;
  std::unique_ptr<PrefillService> prefill_;
  std::unique_ptr<grpc::Server> decode_server_, prefill_server_;
  std::unique_ptr<v1::DecodeWorker::Stub> decode_stub_;
  std::unique_ptr<v1::PrefillWorker::Stub> prefill_stub_;
  std::vector<int32_t> prompt_;
};

// Request migration: a request reserved, prefilled and decoded with the first tokens of its output
// (output_token_ids) streams exactly the rest of the local output, its text after the bytes
// already emitted, and usage counting the whole output.
TEST_F(WorkerServicesTest, ResumedOutputContinuesTheLocalGeneration) {
  for (const bool greedy : {true, false}) {
    SamplingParams p;
    p.temperature = greedy ? 0.0f : 0.9f;
    p.top_p = greedy ? 1.0f : 0.95f;
    p.frequency_penalty = greedy ? 0.0f : 0.5f;
    p.seed = 91;
    p.max_tokens = 20;
    p.ignore_eos = true;
    std::unique_ptr<LlmEngine> local = NewEngine(16, 256);
    ASSERT_TRUE(local->AddRequest("x", prompt_, p).ok());
    std::vector<std::string> texts;  // streamed after each token
    while (local->HasUnfinished()) {
      const absl::StatusOr<std::vector<RequestOutput>> outs = local->Step();
      ASSERT_TRUE(outs.ok()) << outs.status();
      for (const RequestOutput& out : *outs) texts.push_back(out.new_text);
    }
    const std::vector<int32_t> expected = local->Find("x")->output;
    const std::string text = local->Find("x")->text;
    ASSERT_EQ(texts.size(), expected.size());
    for (const int sent : {1, 7}) {
      const std::string id = absl::StrCat(greedy ? "greedy" : "sampled", "-", sent);
      const uint64_t transfer_id = 100 + uint64_t(sent) + (greedy ? 0 : 50);
      std::string emitted;
      for (int i = 0; i < sent; ++i) emitted += texts[size_t(i)];
      v1::KvTarget target;
      ASSERT_TRUE(Reserve(id, transfer_id, 10000, &target, sent).ok());
      const v1::SamplingOptions sampling = rpc::ToSamplingOptions(p);
      grpc::ClientContext prefill_ctx;
      v1::PrefillRequest prefill;
      prefill.set_request_id(id);
      for (int32_t t : prompt_) prefill.add_prompt_token_ids(t);
      prefill.mutable_output_token_ids()->Assign(expected.begin(), expected.begin() + sent);
      *prefill.mutable_sampling() = sampling;
      *prefill.mutable_target() = target;
      v1::PrefillResponse pre;
      grpc::Status prefilled = prefill_stub_->Prefill(&prefill_ctx, prefill, &pre);
      ASSERT_TRUE(prefilled.ok()) << prefilled.error_message();
      EXPECT_EQ(pre.first_token_id(), expected[size_t(sent)]) << id;
      v1::DecodeRequest decode = DecodeRequestFor(id, transfer_id, sampling, pre);
      decode.mutable_output_token_ids()->Assign(expected.begin(), expected.begin() + sent);
      decode.set_output_text_bytes(int64_t(emitted.size()));
      grpc::ClientContext ctx;
      auto reader = decode_stub_->Decode(&ctx, decode);
      std::vector<int32_t> tokens(expected.begin(), expected.begin() + sent);
      v1::GenerateResponse msg;
      while (reader->Read(&msg)) {
        EXPECT_EQ(msg.prompt_token_ids_size(), 0) << id;  // the client has the prompt
        tokens.insert(tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
        emitted += msg.text();
        if (msg.finished()) {
          EXPECT_EQ(msg.usage().completion_tokens(), 20) << id;
        }
      }
      const grpc::Status decoded = reader->Finish();
      ASSERT_TRUE(decoded.ok()) << decoded.error_message();
      EXPECT_EQ(tokens, expected) << id;
      EXPECT_EQ(emitted, text) << id;
    }
  }
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, GreedyAndSeededSampledMatchLocalGeneration) {
  for (const bool greedy : {true, false}) {
    SamplingParams p;
    p.temperature = greedy ? 0.0f : 0.9f;
    p.top_p = greedy ? 1.0f : 0.95f;
    p.seed = 77;
    p.max_tokens = 20;
    p.ignore_eos = true;
    if (!greedy) p.logprobs = 2;
    const std::vector<int32_t> expected = LocalOutput(prompt_, p);
    FlowResult r = RunFlow(greedy ? "greedy" : "sampled", greedy ? 1 : 2, rpc::ToSamplingOptions(p));
    ASSERT_TRUE(r.reserve.ok()) << r.reserve.error_message();
    ASSERT_TRUE(r.prefill.ok()) << r.prefill.error_message();
    ASSERT_TRUE(r.decode.ok()) << r.decode.error_message();
    EXPECT_EQ(r.tokens, expected) << (greedy ? "greedy" : "sampled");
    EXPECT_EQ(r.prompt_echo, prompt_);
    EXPECT_EQ(r.finish_reason, "length");
    EXPECT_EQ(r.completion_tokens, 20);
    EXPECT_FALSE(r.text.empty());
    EXPECT_EQ(r.num_logprobs, greedy ? 0 : 20);
  }
  EXPECT_TRUE(DecodeBecomesIdle());
}

// The worker metrics follow one request: each worker exports what it measures (metrics/README.md):
// the decode worker the tokens it streamed, its decode phase, its steps and its KV usage (up while
// blocks are reserved, 0 when idle); the prefill worker the prompt, its prefill phase, its steps
// and the KV transfer. What the client sees of the request (finish reason, latencies) is the
// router's.
TEST_F(WorkerServicesTest, MetricsFollowARequest) {
  const metrics::DecodeMetrics& dm = decode_->metrics();
  const metrics::PrefillMetrics& pm = prefill_->metrics();
  decode_->RefreshMetrics();
  EXPECT_EQ(dm.kv_cache_usage_perc.Value(), 0.0);

  // A reservation alone takes blocks (the engine's stats catch up after the loop's iteration).
  v1::KvTarget reserved;
  ASSERT_TRUE(Reserve("held", 20, 10000, &reserved).ok());
  const double expected_usage = double(reserved.block_ids_size()) / kDecodeBlocks;
  for (int i = 0; i < 200 && dm.kv_cache_usage_perc.Value() != expected_usage; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    decode_->RefreshMetrics();
  }
  EXPECT_DOUBLE_EQ(dm.kv_cache_usage_perc.Value(), expected_usage);
  {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("held");
    req.set_release_now(true);  // no prefill worker was given the target
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
  }
  EXPECT_TRUE(DecodeBecomesIdle());

  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 20;
  p.ignore_eos = true;
  const absl::Time flow_start = absl::Now();
  FlowResult r = RunFlow("metered", 21, rpc::ToSamplingOptions(p));
  const double flow_seconds = absl::ToDoubleSeconds(absl::Now() - flow_start);
  ASSERT_TRUE(r.decode.ok()) << r.reserve.error_message() << r.prefill.error_message() << r.decode.error_message();
  ASSERT_EQ(r.tokens.size(), 20u);

  // Decode: every token the stream delivered, the prefill's first one included; one engine step
  // of one token for each of the 19 after it.
  EXPECT_EQ(dm.generation_tokens.Value(), 20.0);
  EXPECT_EQ(dm.request_decode_time_seconds.Collect().count, 1u);
  EXPECT_LE(dm.request_decode_time_seconds.Collect().sum, flow_seconds);
  EXPECT_EQ(dm.iteration_tokens_total.Collect().count, 19u);
  EXPECT_EQ(dm.iteration_tokens_total.Collect().sum, 19.0);
  // Prefill: the prompt, its prefill time, the steps that ran it (every prompt token once).
  EXPECT_EQ(pm.prompt_tokens.Value(), double(prompt_.size()));
  EXPECT_EQ(pm.request_prefill_time_seconds.Collect().count, 1u);
  EXPECT_EQ(pm.iteration_tokens_total.Collect().sum, double(prompt_.size()));
  // The KV transfer, counted by the sender: the prompt's bytes.
  const metrics::Histogram::Snapshot sent = pm.kv_transfer_bytes.Collect();
  EXPECT_EQ(sent.count, 1u);
  EXPECT_GT(sent.sum, 0.0);
  // The sender owns the per-path figures: both workers on this host, so UCX shared memory.
  EXPECT_EQ(pm.kv_transfer_seconds("ucx_shm").Collect().count, 1u);
  EXPECT_EQ(pm.kv_transfer_bytes_total("ucx_shm").Value(), sent.sum);
  EXPECT_EQ(pm.kv_transfer_wait_seconds.Collect().count, 1u);
  EXPECT_EQ(pm.kv_transfer_failures.Value(), 0.0);

  EXPECT_TRUE(DecodeBecomesIdle());
  const std::string text = decode_->RenderMetrics();
  EXPECT_EQ(dm.kv_cache_usage_perc.Value(), 0.0);
  EXPECT_EQ(dm.num_requests_running.Value(), 0.0);
  EXPECT_NE(text.find("duet:generation_tokens_total{model_name=\"tiny-code-llama\",role=\"decode\"} 20\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("duet:kv_cache_usage_perc{model_name=\"tiny-code-llama\",role=\"decode\"} 0\n"),
            std::string::npos);
  const std::string prefill_text = prefill_->RenderMetrics();
  EXPECT_NE(prefill_text.find(absl::StrCat("duet:prompt_tokens_total{model_name=\"tiny-code-llama\",role=\"prefill\"} ",
                                           prompt_.size(), "\n")),
            std::string::npos)
      << prefill_text;
  // Each worker describes its cache; only the decode worker's usage is a capacity signal.
  EXPECT_NE(text.find("duet:cache_config_info{model_name=\"tiny-code-llama\",role=\"decode\",block_size=\""),
            std::string::npos);
  EXPECT_NE(prefill_text.find("duet:cache_config_info{model_name=\"tiny-code-llama\",role=\"prefill\""),
            std::string::npos);
  EXPECT_EQ(prefill_text.find("duet:kv_cache_usage_perc"), std::string::npos);
  for (const char* router_family : {"duet:request_success_total", "duet:e2e_request_latency_seconds",
                                    "duet:inter_token_latency_seconds", "duet:time_to_first_token_seconds"}) {
    EXPECT_EQ(text.find(router_family), std::string::npos) << router_family;
    EXPECT_EQ(prefill_text.find(router_family), std::string::npos) << router_family;
  }
}

TEST_F(WorkerServicesTest, ConcurrentRequestsMatchLocalGeneration) {
  RunConcurrentlyMatchingLocalGeneration(
      6,
      [](int i) {
        SamplingParams p;
        p.temperature = i % 2 ? 0.8f : 0.0f;
        p.seed = 1000 + i;
        return p;
      },
      [&](int i, const v1::SamplingOptions& sampling, FlowResult* r) {
        *r = RunFlow("c" + std::to_string(i), 100 + i, sampling);
      });
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, CancellingDecodeMidStreamFreesItsBlocks) {
  const v1::SamplingOptions sampling = LongGreedy();
  v1::PrefillResponse pre;
  ASSERT_NO_FATAL_FAILURE(ReserveAndPrefill("cancel", 7, sampling, &pre));
  ExpectCancelMidStreamFreesItsBlocks(DecodeRequestFor("cancel", 7, sampling, pre));
}

// A request reserved and prefilled before the decode worker began to drain, whose Decode call
// comes after: it joins and leaves at once, parked with its KV (the stream ends UNAVAILABLE with
// the parked trailer) like the requests that were decoding, instead of running to its end on a
// worker that is going away. The parked KV waits for the router (here its Abort).
TEST_F(WorkerServicesTest, ADecodeCallThatJoinsADrainingWorkerIsParkedWithItsKv) {
  const v1::SamplingOptions sampling = LongGreedy();
  v1::PrefillResponse pre;
  ASSERT_NO_FATAL_FAILURE(ReserveAndPrefill("late", 11, sampling, &pre));
  decode_->StartDraining();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto reader = decode_stub_->Decode(&ctx, DecodeRequestFor("late", 11, sampling, pre));
  v1::GenerateResponse msg;
  int tokens = 0;
  while (reader->Read(&msg)) tokens += msg.token_ids_size();
  const grpc::Status status = reader->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_EQ(ctx.GetServerTrailingMetadata().count(rpc::kKvParkedTrailer), 1u);
  EXPECT_LE(tokens, 1) << "it decoded on the draining worker";
  EXPECT_LT(DecodeStats().num_free_kv_blocks(), kDecodeBlocks) << "the parked KV is kept for the move";
  grpc::ClientContext abort_ctx;
  v1::WorkerAbortRequest abort;
  abort.set_request_id("late");
  abort.set_release_now(true);
  v1::WorkerAbortResponse aborted;
  ASSERT_TRUE(decode_stub_->Abort(&abort_ctx, abort, &aborted).ok());
  EXPECT_TRUE(DecodeBecomesIdle());
}

// A Decode call waiting for a transfer that never comes: cancelling it ends the reservation.
TEST_F(WorkerServicesTest, CancellingDecodeWhileItWaitsForTheTransferReleasesTheReservation) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("waiting", 15, 10000, &target).ok());
  grpc::ClientContext ctx;
  auto reader = decode_stub_->Decode(&ctx, DecodeRequestFor("waiting", 15, v1::SamplingOptions(), {}));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(DecodeStats().num_kv_leases(), 1);
  ctx.TryCancel();
  v1::GenerateResponse msg;
  EXPECT_FALSE(reader->Read(&msg));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(DecodeBecomesIdle());
}

// The claim lease of a transferred reservation ends at its deadline: held until then, released
// right after (a timer at the deadline, not a periodic sweep).
TEST_F(WorkerServicesTest, AReceivedReservationIsReleasedAtItsLeaseDeadline) {
  // Margins of seconds on both sides: a loaded 2-core machine can stall a thread for hundreds of ms.
  constexpr int kLeaseMs = 2400;
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("deadline", 16, kLeaseMs, &target).ok());
  v1::PrefillResponse pre;
  ASSERT_TRUE(Prefill("deadline", v1::SamplingOptions(), target, &pre).ok());
  const auto received = std::chrono::steady_clock::now();  // the lease restarts at the transfer's end
  std::this_thread::sleep_for(std::chrono::milliseconds(kLeaseMs / 4));
  EXPECT_EQ(DecodeStats().num_kv_leases(), 1);
  EXPECT_TRUE(DecodeBecomesIdle());
  EXPECT_LT(std::chrono::steady_clock::now() - received, std::chrono::milliseconds(kLeaseMs + 1200));
}

TEST_F(WorkerServicesTest, UnclaimedReservationIsReleasedWhenItsLeaseExpires) {
  v1::KvTarget target;
  // A lease long enough to be seen held on a loaded machine (600 ms had run out before the stats
  // call below in a full suite on 2 cores).
  ASSERT_TRUE(Reserve("unclaimed", 8, 3000, &target).ok());
  EXPECT_EQ(target.transfer_id(), 8u);
  EXPECT_FALSE(target.receiver_descriptor().empty());
  EXPECT_EQ(target.block_ids_size(), int((prompt_.size() + 7) / 8));
  v1::WorkerStats stats = DecodeStats();
  EXPECT_EQ(stats.num_kv_leases(), 1);
  EXPECT_EQ(stats.num_free_kv_blocks(), kDecodeBlocks - target.block_ids_size());
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::seconds(10)));

  // A Decode for it now fails cleanly.
  grpc::ClientContext ctx;
  auto reader = decode_stub_->Decode(&ctx, DecodeRequestFor("unclaimed", 8, v1::SamplingOptions(), {}));
  v1::GenerateResponse msg;
  EXPECT_FALSE(reader->Read(&msg));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(WorkerServicesTest, TransferredButUnclaimedBlocksAreReleasedAfterTheLease) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("received", 9, 1500, &target).ok());
  v1::PrefillResponse pre;
  ASSERT_TRUE(Prefill("received", v1::SamplingOptions(), target, &pre).ok());
  EXPECT_EQ(DecodeStats().num_kv_leases(), 1);
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, AbortReleasesAReservation) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("aborted", 10, 10000, &target).ok());
  grpc::ClientContext ctx;
  v1::WorkerAbortRequest req;
  req.set_request_id("aborted");
  req.set_release_now(true);  // as the router says when no prefill worker was given the target
  v1::WorkerAbortResponse resp;
  ASSERT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
  EXPECT_TRUE(resp.found());
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::milliseconds(2000)));
}

// A request placed on the same decode worker again (a retry, a migration) while the Abort of its
// earlier placement is on the way: the Abort names its transfer, so it releases that reservation
// and leaves the new one, which the request goes on with (an Abort by request id alone would take
// the latest reservation and leave the earlier one to its lease).
TEST_F(WorkerServicesTest, AnAbortNamingATransferReleasesOnlyThatReservation) {
  v1::KvTarget first, second;
  ASSERT_TRUE(Reserve("placed-twice", 31, 10000, &first).ok());
  ASSERT_TRUE(Reserve("placed-twice", 32, 10000, &second).ok());
  EXPECT_EQ(DecodeStats().num_kv_leases(), 2);
  auto abort = [&](uint64_t transfer_id) {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("placed-twice");
    req.set_release_now(true);
    req.set_transfer_id(transfer_id);
    v1::WorkerAbortResponse resp;
    EXPECT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
    return resp.found();
  };
  EXPECT_TRUE(abort(31));
  EXPECT_TRUE(StatsBecome(
      *decode_stub_,
      [&](const v1::WorkerStats& s) {
        return s.num_kv_leases() == 1 && s.num_free_kv_blocks() == kDecodeBlocks - second.block_ids_size();
      },
      std::chrono::milliseconds(2000), "holding only the second reservation"));
  EXPECT_FALSE(abort(31));  // nothing left of that placement
  EXPECT_TRUE(abort(32));
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::milliseconds(2000)));
}

// An Abort while a prefill worker may be writing the KV (its target was handed on) keeps the
// blocks until that sender has stopped: its puts land in blocks no other request has been given,
// and the reservation ends at the sender's finish notice. Released at the Abort, the blocks would
// go to the next reservation while the puts still arrive, and its KV would be overwritten.
TEST_F(WorkerServicesTest, AbortDuringATransferReleasesTheBlocksOnceTheSenderHasStopped) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("in-transfer", 17, 10000, &target).ok());
  const int32_t reserved_blocks = target.block_ids_size();
  {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("in-transfer");
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
    EXPECT_TRUE(resp.found());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  v1::WorkerStats stats = DecodeStats();
  EXPECT_EQ(stats.num_kv_leases(), 1);
  EXPECT_EQ(stats.num_free_kv_blocks(), kDecodeBlocks - reserved_blocks);
  // The prefill worker that had the target ships it: into the blocks still held; then they go.
  v1::PrefillResponse pre;
  (void)Prefill("in-transfer", v1::SamplingOptions(), target, &pre);
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::milliseconds(3000)));
  // A Decode for it now fails: the reservation was aborted, not completed.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto reader = decode_stub_->Decode(&ctx, DecodeRequestFor("in-transfer", 17, v1::SamplingOptions(), pre));
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
  }
  EXPECT_FALSE(reader->Finish().ok());
}

// A Prefill call cancelled on its way never reaches the prefill worker, so no shipment ends with
// a notice: the router's Abort to the prefill worker, with the target, has it tell the decode
// worker the blocks are free, and a Prefill for that request that still arrives ships nothing.
TEST_F(WorkerServicesTest, PrefillAbortOfAnUnknownRequestFreesItsTargetOnTheDecodeWorker) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("lost", 18, 10000, &target).ok());
  {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("lost");  // the target went to a prefill worker: held until it has stopped
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(DecodeStats().num_kv_leases(), 1);
  {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("lost");
    *req.mutable_kv_target() = target;
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(prefill_stub_->Abort(&ctx, req, &resp).ok());
    EXPECT_FALSE(resp.found());
  }
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::milliseconds(2000)));
  v1::PrefillResponse pre;
  EXPECT_EQ(Prefill("lost", v1::SamplingOptions(), target, &pre).error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::milliseconds(2000)));
}

// A late KV target (PrefillRequest.target_follows, then SetKvTarget): whether it comes after the
// forward pass (the engine keeps the prompt's blocks for it), while the pass runs, or before the
// Prefill call itself, the decode worker gets the same KV and continues the local output.
enum class TargetTiming { kAfterTheForwardPass, kDuringIt, kBeforeTheCall };

class LateTargetWorkerTest : public WorkerServicesTest, public ::testing::WithParamInterface<TargetTiming> {};

TEST_P(LateTargetWorkerTest, OutputMatchesLocalGenerationAndNothingStaysHeld) {
  SamplingParams p;
  p.temperature = 0.9f;
  p.seed = 5;
  p.max_tokens = 12;
  p.ignore_eos = true;
  const std::vector<int32_t> expected = LocalOutput(prompt_, p);
  const v1::SamplingOptions sampling = rpc::ToSamplingOptions(p);
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("late", 41, 10000, &target).ok());
  std::unique_ptr<LatePrefillCall> call;
  switch (GetParam()) {
    case TargetTiming::kAfterTheForwardPass:
      call = StartLatePrefill("late", sampling);
      // The forward pass is over when the prefill worker runs nothing and still holds the blocks.
      for (int i = 0; i < 500; ++i) {
        const v1::WorkerStats s = PrefillStats();
        if (s.num_requests_running() == 0 && s.num_free_kv_blocks() < s.num_kv_blocks()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_LT(PrefillStats().num_free_kv_blocks(), PrefillStats().num_kv_blocks()) << "blocks kept";
      ASSERT_TRUE(SetKvTarget("late", target).ok());
      break;
    case TargetTiming::kDuringIt:
      call = StartLatePrefill("late", sampling);
      ASSERT_TRUE(SetKvTarget("late", target).ok());
      break;
    case TargetTiming::kBeforeTheCall:
      ASSERT_TRUE(SetKvTarget("late", target).ok());
      call = StartLatePrefill("late", sampling);
      break;
  }
  call->thread.join();
  ASSERT_TRUE(call->status.ok()) << call->status.error_message();
  FlowResult r;
  ReadDecode("late", 41, sampling, call->response, &r);
  ASSERT_TRUE(r.decode.ok()) << r.decode.error_message();
  EXPECT_EQ(r.tokens, expected);
  EXPECT_TRUE(PrefillBecomesIdle());
  EXPECT_TRUE(DecodeBecomesIdle());
  EXPECT_EQ(PrefillStats().kv_transfers_by_path().begin()->second, 1);
  const metrics::PrefillMetrics& m = prefill_->metrics();
  const double before = m.kv_late_targets_total("before_forward").Value();
  const double during = m.kv_late_targets_total("during_forward").Value();
  const double after = m.kv_late_targets_total("after_forward").Value();
  EXPECT_EQ(before + during + after, 1);
  if (GetParam() == TargetTiming::kAfterTheForwardPass) {
    EXPECT_EQ(after, 1);
  }
  if (GetParam() == TargetTiming::kBeforeTheCall) {
    EXPECT_EQ(before, 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Timing, LateTargetWorkerTest,
                         ::testing::Values(TargetTiming::kAfterTheForwardPass, TargetTiming::kDuringIt,
                                           TargetTiming::kBeforeTheCall),
                         [](const ::testing::TestParamInfo<TargetTiming>& info) {
                           switch (info.param) {
                             case TargetTiming::kAfterTheForwardPass: return "AfterTheForwardPass";
                             case TargetTiming::kDuringIt: return "DuringIt";
                             case TargetTiming::kBeforeTheCall: return "BeforeTheCall";
                           }
                           return "";
                         });

TEST_F(WorkerServicesTest, PrefillStatsSayItTakesALateTarget) { EXPECT_TRUE(PrefillStats().late_kv_target()); }

// A late Prefill whose target never comes: its deadline (or an Abort) ends it, and the blocks the
// engine kept for it are freed.
TEST_F(WorkerServicesTest, ALatePrefillWithoutItsTargetFreesItsKeptBlocks) {
  std::unique_ptr<LatePrefillCall> expired = StartLatePrefill("no-target", LongGreedy(), std::chrono::milliseconds(1500));
  expired->thread.join();
  EXPECT_EQ(expired->status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(PrefillBecomesIdle());

  std::unique_ptr<LatePrefillCall> aborted = StartLatePrefill("aborted", LongGreedy());
  for (int i = 0; i < 500 && PrefillStats().num_free_kv_blocks() == PrefillStats().num_kv_blocks(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("aborted");
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(prefill_stub_->Abort(&ctx, req, &resp).ok());
    EXPECT_TRUE(resp.found());
  }
  aborted->thread.join();
  EXPECT_EQ(aborted->status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(PrefillBecomesIdle());
}

// The router aborts a late Prefill whose target it sent but which never arrived (its SetKvTarget
// cancelled on the way): the Abort carries the target, and the prefill worker, which holds the
// request but not the target, tells the decode worker, whose reservation then goes at once
// instead of at its lease's end.
TEST_F(WorkerServicesTest, AnAbortCarryingALateTargetThatNeverCameReleasesTheReservation) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("lost-target", 44, 60000, &target).ok());
  std::unique_ptr<LatePrefillCall> call = StartLatePrefill("lost-target", LongGreedy());
  for (int i = 0; i < 500 && PrefillStats().num_free_kv_blocks() == PrefillStats().num_kv_blocks(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  {
    grpc::ClientContext ctx;  // the router's own release: after the sender has stopped writing
    v1::WorkerAbortRequest req;
    req.set_request_id("lost-target");
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::WorkerAbortRequest req;
    req.set_request_id("lost-target");
    *req.mutable_kv_target() = target;
    v1::WorkerAbortResponse resp;
    ASSERT_TRUE(prefill_stub_->Abort(&ctx, req, &resp).ok());
    EXPECT_TRUE(resp.found());
  }
  call->thread.join();
  EXPECT_EQ(call->status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_TRUE(PrefillBecomesIdle());
  EXPECT_TRUE(DecodeBecomesIdle(std::chrono::milliseconds(3000)));  // not the 60 s lease
}

// A late target the prefill worker cannot use fails its Prefill call as well, and tells the decode
// worker nothing is coming.
TEST_F(WorkerServicesTest, ALateTargetWithTooFewBlocksFailsThePrefill) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("short", 43, 10000, &target).ok());
  target.mutable_block_ids()->RemoveLast();
  std::unique_ptr<LatePrefillCall> call = StartLatePrefill("short", LongGreedy());
  const grpc::Status set = SetKvTarget("short", target);
  call->thread.join();
  EXPECT_FALSE(call->status.ok());
  EXPECT_TRUE(PrefillBecomesIdle());
  EXPECT_TRUE(DecodeBecomesIdle());
  (void)set;  // refused when the target is checked there, or the transfer fails
}

// Conditional disaggregation (DecodeRequest.prefill_here): the decode worker prefills prompts in
// its own batch, beside requests whose KV came from the prefill worker, and every output equals
// the local generation's.
TEST_F(WorkerServicesTest, PrefillHereBesideTransferredRequestsMatchesLocalGeneration) {
  EXPECT_TRUE(DecodeStats().prefill_here());
  const std::vector<FlowResult> results = RunConcurrentlyMatchingLocalGeneration(
      6,
      [](int i) {
        SamplingParams p;
        p.temperature = i % 3 ? 0.8f : 0.0f;
        p.seed = 2000 + i;
        if (i == 1) p.logprobs = 2;
        return p;
      },
      [&](int i, const v1::SamplingOptions& sampling, FlowResult* r) {
        const std::string id = "mixed" + std::to_string(i);
        if (i % 2 == 0) {
          *r = RunFlow(id, 300 + i, sampling);
        } else {
          ReadStream(PrefillHereRequest(id, prompt_, sampling), r);
        }
      });
  for (const FlowResult& r : results) {
    EXPECT_EQ(r.prompt_echo, prompt_);
    EXPECT_EQ(r.completion_tokens, 12);
    EXPECT_EQ(r.finish_reason, "length");
  }
  EXPECT_EQ(results[1].num_logprobs, 12);
  // The decode worker counts the prompts it prefilled (the others are the prefill worker's).
  EXPECT_EQ(decode_->metrics().prompt_tokens.Value(), double(3 * prompt_.size()));
  EXPECT_EQ(DecodeStats().num_kv_leases(), 0);
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, APrefillHereCallWithTransferFieldsOrPromptLogprobsIsInvalid) {
  SamplingParams p;
  p.max_tokens = 4;
  v1::DecodeRequest with_transfer = PrefillHereRequest("bad1", prompt_, rpc::ToSamplingOptions(p));
  with_transfer.set_transfer_id(9);
  v1::DecodeRequest with_output = PrefillHereRequest("bad2", prompt_, rpc::ToSamplingOptions(p));
  with_output.add_output_token_ids(5);
  p.prompt_logprobs = 1;
  v1::DecodeRequest with_prompt_logprobs = PrefillHereRequest("bad3", prompt_, rpc::ToSamplingOptions(p));
  for (const v1::DecodeRequest& request : {with_transfer, with_output, with_prompt_logprobs}) {
    FlowResult r;
    ReadStream(request, &r);
    EXPECT_EQ(r.decode.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << request.request_id();
    EXPECT_TRUE(r.tokens.empty());
  }
  FlowResult empty;
  ReadStream(PrefillHereRequest("empty", {}, LongGreedy()), &empty);
  EXPECT_EQ(empty.decode.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, CancellingAPrefillHereCallFreesItsBlocks) {
  ExpectCancelMidStreamFreesItsBlocks(PrefillHereRequest("cancel-here", prompt_, LongGreedy()));
}

TEST_F(WorkerServicesTest, ADrainingDecodeWorkerTakesNoPromptToPrefill) {
  decode_->StartDraining();
  FlowResult r;
  ReadStream(PrefillHereRequest("late", prompt_, LongGreedy()), &r);
  EXPECT_EQ(r.decode.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(r.tokens.empty());
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, ReserveKvWithoutRoomIsResourceExhausted) {
  grpc::ClientContext ctx;
  v1::ReserveKvRequest req;
  req.set_request_id("huge");
  req.set_transfer_id(11);
  req.set_num_prompt_tokens(8 * kDecodeBlocks + 1);
  v1::ReserveKvResponse resp;
  grpc::Status s = decode_stub_->ReserveKv(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(WorkerServicesTest, PrefillToABogusDescriptorFailsCleanly) {
  v1::KvTarget target;
  target.set_receiver_descriptor("not a descriptor");
  target.set_transfer_id(12);
  target.add_block_ids(0);
  target.add_block_ids(1);
  target.add_block_ids(2);
  v1::PrefillResponse pre;
  grpc::Status s = Prefill("bogus", v1::SamplingOptions(), target, &pre);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.error_message().find("KV receiver"), std::string::npos) << s.error_message();
  // The worker still serves.
  FlowResult r = RunFlow("after-bogus", 13, rpc::ToSamplingOptions(SamplingParams{}));
  EXPECT_TRUE(r.decode.ok()) << r.reserve.error_message() << r.prefill.error_message() << r.decode.error_message();
  grpc::ClientContext ctx;
  v1::WorkerStats stats;
  ASSERT_TRUE(prefill_stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.role(), "prefill");
  EXPECT_EQ(stats.num_free_kv_blocks(), stats.num_kv_blocks());
}

TEST_F(WorkerServicesTest, PrefillWithWrongBlockCountFailsAndReleasesTheLease) {
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("short", 14, 10000, &target).ok());
  target.mutable_block_ids()->RemoveLast();
  v1::PrefillResponse pre;
  grpc::Status s = Prefill("short", v1::SamplingOptions(), target, &pre);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(DecodeBecomesIdle());
}

// The path a device KV cache takes (CUDA backend: UCX cannot reach device memory), forced on the
// CPU backend: KV travels through host staging blocks on both sides.
class StagedWorkerServicesTest : public WorkerServicesTest {
 protected:
  StagedWorkerServicesTest() {
    decode_staging_.force_staging = true;
    prefill_staging_.force_staging = true;
    // Room for two prompts at the decode worker (block size 8), one at the prefill worker (16).
    decode_staging_.staging_tokens = 2 * 8 * kPromptBlocksAt8;
    prefill_staging_.staging_tokens = 16 * kPromptBlocksAt16;
  }
  void SetUp() override {
    WorkerServicesTest::SetUp();
    ASSERT_EQ((prompt_.size() + 7) / 8, size_t(kPromptBlocksAt8));
    ASSERT_EQ((prompt_.size() + 15) / 16, size_t(kPromptBlocksAt16));
  }
  static constexpr int32_t kPromptBlocksAt8 = 2;
  static constexpr int32_t kPromptBlocksAt16 = 1;
};

TEST_F(StagedWorkerServicesTest, OutputMatchesLocalGenerationAndStagingIsReused) {
  // Six requests in turn through staging that holds two: blocks must come back each time.
  for (int i = 0; i < 6; ++i) {
    SamplingParams p;
    p.temperature = i % 2 == 0 ? 0.0f : 0.9f;
    p.seed = 7 + i;
    p.max_tokens = 12;
    const std::string id = absl::StrCat("staged", i);
    FlowResult r = RunFlow(id, 200 + i, rpc::ToSamplingOptions(p));
    ASSERT_TRUE(r.reserve.ok() && r.prefill.ok() && r.decode.ok())
        << r.reserve.error_message() << r.prefill.error_message() << r.decode.error_message();
    EXPECT_EQ(r.tokens, LocalOutput(prompt_, p)) << id;
  }
  EXPECT_TRUE(DecodeBecomesIdle());
}

// The prefill staging holds one prompt: concurrent prompts wait for it in turn, none fails (two:
// the decode staging's room).
TEST_F(StagedWorkerServicesTest, ConcurrentPromptsWaitForThePrefillStaging) {
  constexpr int kRequests = 2;
  std::vector<FlowResult> results(kRequests);
  std::vector<std::thread> threads;
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 6;
  p.ignore_eos = true;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] { results[i] = RunFlow(absl::StrCat("turn", i), 500 + i, rpc::ToSamplingOptions(p)); });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<int32_t> expected = LocalOutput(prompt_, p);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(results[i].reserve.ok() && results[i].prefill.ok() && results[i].decode.ok())
        << i << ": " << results[i].reserve.error_message() << results[i].prefill.error_message()
        << results[i].decode.error_message();
    EXPECT_EQ(results[i].tokens, expected) << i;
  }
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(StagedWorkerServicesTest, ReserveKvBeyondTheStagingIsResourceExhaustedUntilOneEnds) {
  v1::KvTarget a, b, c;
  ASSERT_TRUE(Reserve("a", 300, 10000, &a).ok());
  ASSERT_TRUE(Reserve("b", 301, 10000, &b).ok());
  // The cache has room; the staging does not.
  grpc::Status s = Reserve("c", 302, 10000, &c);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("staging"), std::string::npos) << s.error_message();
  grpc::ClientContext ctx;
  v1::WorkerAbortRequest req;
  req.set_request_id("a");
  req.set_release_now(true);  // no prefill worker was given the targets
  v1::WorkerAbortResponse resp;
  ASSERT_TRUE(decode_stub_->Abort(&ctx, req, &resp).ok());
  ASSERT_TRUE(Reserve("c", 302, 10000, &c).ok());
  // The landing blocks named to the sender are staging blocks, not cache blocks.
  for (uint32_t id : c.block_ids()) EXPECT_LT(id, uint32_t(2 * kPromptBlocksAt8));
  for (const char* id : {"b", "c"}) {
    grpc::ClientContext abort_ctx;
    req.set_request_id(id);
    ASSERT_TRUE(decode_stub_->Abort(&abort_ctx, req, &resp).ok());
  }
  EXPECT_TRUE(DecodeBecomesIdle());
}

TEST_F(StagedWorkerServicesTest, AFailedTransferGivesItsStagingBack) {
  for (int i = 0; i < 3; ++i) {
    v1::KvTarget target;
    ASSERT_TRUE(Reserve(absl::StrCat("short", i), 400 + i, 10000, &target).ok());
    target.mutable_block_ids()->RemoveLast();
    v1::PrefillResponse pre;
    EXPECT_FALSE(Prefill(absl::StrCat("short", i), v1::SamplingOptions(), target, &pre).ok());
    EXPECT_TRUE(DecodeBecomesIdle());
  }
  FlowResult r = RunFlow("after-failures", 410, rpc::ToSamplingOptions(SamplingParams{}));
  EXPECT_TRUE(r.decode.ok()) << r.reserve.error_message() << r.prefill.error_message() << r.decode.error_message();
}

// With the cluster's key, a Prefill writes only into blocks a ReserveKv granted for its transfer.
class SignedWorkerServicesTest : public WorkerServicesTest {
 protected:
  SignedWorkerServicesTest() { kv_target_key_ = rpc::KvTargetKey("worker-services-test-token"); }

  // Reads a Decode stream to its end.
  FlowResult DecodeAll(const std::string& id, uint64_t transfer_id, const v1::SamplingOptions& sampling,
                       const v1::PrefillResponse& pre) {
    FlowResult r;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto reader = decode_stub_->Decode(&ctx, DecodeRequestFor(id, transfer_id, sampling, pre));
    v1::GenerateResponse msg;
    while (reader->Read(&msg)) r.tokens.insert(r.tokens.end(), msg.token_ids().begin(), msg.token_ids().end());
    r.decode = reader->Finish();
    return r;
  }
};

TEST_F(SignedWorkerServicesTest, GrantedTargetsAreSignedAndServe) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 12;
  v1::KvTarget target;
  ASSERT_TRUE(Reserve("signed", 31, 10000, &target).ok());
  EXPECT_EQ(target.authenticator().size(), 32u);
  EXPECT_TRUE(rpc::VerifyKvTarget(kv_target_key_, target).ok());
  v1::PrefillResponse pre;
  ASSERT_TRUE(Prefill("signed", rpc::ToSamplingOptions(p), target, &pre).ok());
  FlowResult r = DecodeAll("signed", 31, rpc::ToSamplingOptions(p), pre);
  ASSERT_TRUE(r.decode.ok()) << r.decode.error_message();
  EXPECT_EQ(r.tokens, LocalOutput(prompt_, p));
  EXPECT_TRUE(DecodeBecomesIdle());
}

// The attack of issue 17: a Prefill under the attacker's own reservation (transfer id) but with a
// victim's block ids would write the attacker's prompt's KV over the victim's, after the victim's
// prefill and before its Decode. Refused before any byte moves; the victim decodes its own KV.
TEST_F(SignedWorkerServicesTest, PrefillIntoAnotherReservationsBlocksIsRefused) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = 24;
  p.ignore_eos = true;
  const v1::SamplingOptions sampling = rpc::ToSamplingOptions(p);
  v1::KvTarget victim, attacker;
  ASSERT_TRUE(Reserve("victim", 41, 10000, &victim).ok());
  ASSERT_TRUE(Reserve("attacker", 42, 10000, &attacker).ok());
  ASSERT_EQ(victim.block_ids_size(), attacker.block_ids_size());
  v1::PrefillResponse victim_pre;
  ASSERT_TRUE(Prefill("victim", sampling, victim, &victim_pre).ok());

  const std::vector<int32_t> other_prompt(prompt_.rbegin(), prompt_.rend());  // same length, other KV
  v1::KvTarget forged = attacker;
  *forged.mutable_block_ids() = victim.block_ids();
  v1::PrefillResponse pre;
  grpc::Status s = PrefillPrompt("attacker", other_prompt, sampling, forged, &pre);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  // The victim's transfer id with the attacker's blocks, and an unsigned target: refused too.
  forged = attacker;
  forged.set_transfer_id(victim.transfer_id());
  s = PrefillPrompt("attacker", other_prompt, sampling, forged, &pre);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  forged = victim;
  forged.clear_authenticator();
  s = PrefillPrompt("attacker", other_prompt, sampling, forged, &pre);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();

  FlowResult r = DecodeAll("victim", 41, sampling, victim_pre);
  ASSERT_TRUE(r.decode.ok()) << r.decode.error_message();
  EXPECT_EQ(r.tokens, LocalOutput(prompt_, p)) << "the victim's KV was overwritten";
  // The attacker's own reservation is still its own to use or drop.
  grpc::ClientContext ctx;
  v1::WorkerAbortRequest abort;
  abort.set_request_id("attacker");
  abort.set_release_now(true);  // its Prefill was refused before anything was written
  v1::WorkerAbortResponse aborted;
  ASSERT_TRUE(decode_stub_->Abort(&ctx, abort, &aborted).ok());
  EXPECT_TRUE(DecodeBecomesIdle());
}

}  // namespace
}  // namespace duet
