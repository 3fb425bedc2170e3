#include "router/router_service.h"

#include <chrono>
#include <functional>
#include <numeric>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/finish_reason.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"
#include "model/model_config.h"
#include "router/fake_workers.h"
#include "router/prefix_aware_policy.h"
#include "router/router.h"
#include "metrics/test_http_client.h"
#include "rpc/rpc_util.h"

namespace duet::router {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::FakeDecodeWorker;
using testing::FakePrefillWorker;
using testing::FakeServer;
using testing::MalformedDecodeWorker;

constexpr char kModelDir[] = DUET_MODELS_DIR "/tiny-code-llama";

bool WaitFor(const std::function<bool()>& condition, int timeout_ms = 5000) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return condition();
}

struct Result {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::optional<std::string> metadata_request_id;  // the response's x-request-id metadata
  std::vector<int32_t> tokens() const {
    std::vector<int32_t> ids;
    for (const auto& m : messages) ids.insert(ids.end(), m.token_ids().begin(), m.token_ids().end());
    return ids;
  }
};

v1::GenerateRequest TokenRequest(std::vector<int32_t> ids, int max_tokens, std::string request_id = "") {
  v1::GenerateRequest request;
  request.set_request_id(request_id);
  request.mutable_token_ids();  // set even when empty
  for (int32_t id : ids) request.mutable_token_ids()->add_ids(id);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  request.mutable_sampling()->set_temperature(0);
  return request;
}

class RouterServiceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(kModelDir);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = tokenizer->release();
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }

  // Starts `num_prefill` + `num_decode` fake workers and the router service in front of them.
  void Start(int num_prefill, int num_decode, RouterServiceOptions options = {}) {
    for (int i = 0; i < num_prefill; ++i) {
      prefill_.push_back(std::make_unique<FakePrefillWorker>());
      prefill_.back()->late_kv_target = late_target_fakes_;
      prefill_servers_.push_back(std::make_unique<FakeServer>(prefill_.back().get()));
    }
    for (int i = 0; i < num_decode; ++i) {
      decode_.push_back(std::make_unique<FakeDecodeWorker>());
      decode_.back()->prefill_here = prefill_here_fakes_;
      decode_servers_.push_back(std::make_unique<FakeServer>(decode_.back().get()));
    }
    std::vector<std::string> prefill_addresses, decode_addresses;
    for (const auto& s : prefill_servers_) prefill_addresses.push_back(s->address());
    for (const auto& s : decode_servers_) decode_addresses.push_back(s->address());
    StartWith(prefill_addresses, decode_addresses, options, /*wait_until_up=*/true);
  }

  // `wait_until_up`: polls until every worker is up (the first poll may time out on a busy machine).
  void StartWith(const std::vector<std::string>& prefill_addresses,
                 const std::vector<std::string>& decode_addresses, RouterServiceOptions options,
                 bool wait_until_up = false) {
    RegistryOptions registry_options;
    registry_options.poll_interval = absl::Seconds(30);  // states change only through MarkDown here
    registry_options.log_state_changes = false;
    registry_ = std::make_unique<WorkerRegistry>(prefill_addresses, decode_addresses, registry_options);
    registry_->Start();
    if (wait_until_up) {
      ASSERT_TRUE(WaitFor([&] {
        if (registry_->NumUp(WorkerRole::kPrefill) == int(prefill_addresses.size()) &&
            registry_->NumUp(WorkerRole::kDecode) == int(decode_addresses.size())) {
          return true;
        }
        registry_->PollOnce();
        return false;
      }, 10000));
    }
    if (prefix_aware_) {
      policy_ = std::make_unique<PrefixAwarePolicy>(registry_.get(), &prefix_index_);
    } else {
      policy_ = MakeLeastLoadedPolicy(registry_.get());
    }
    options.prefix_index = &prefix_index_;
    options.model_name = "tiny";
    options.vocab_size = 8192;
    if (options.max_model_len == 0) options.max_model_len = 4096;
    service_ = std::make_unique<RouterService>(options, tokenizer_, registry_.get(), policy_.get());
    int port = 0;
    absl::StatusOr<std::unique_ptr<grpc::Server>> server = rpc::StartServer("127.0.0.1:0", {service_.get()}, &port);
    ASSERT_TRUE(server.ok()) << server.status();
    server_port_ = port;
    server_ = *std::move(server);
    stub_ = v1::Duet::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                  grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
    service_.reset();
    policy_.reset();
    registry_.reset();
    prefill_servers_.clear();
    decode_servers_.clear();
  }

  // See the tests that call it (a stalled prefill worker's reservation).
  void ExpectAStalledPrefillWorkersReservationGoesWhen(const std::function<void()>& happens);

  // Runs Generate to the end. `on_message(i)` runs after the i-th message (for cancel/abort).
  Result Generate(const v1::GenerateRequest& request, int deadline_ms = 10000,
                  const std::function<void(int, grpc::ClientContext*)>& on_message = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
    Result result;
    auto reader = stub_->Generate(&context, request);
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
      result.messages.push_back(message);
      last_request_id_ = message.request_id();
      if (on_message) on_message(static_cast<int>(result.messages.size()), &context);
    }
    result.status = reader->Finish();
    const auto& metadata = context.GetServerInitialMetadata();
    if (auto it = metadata.find("x-request-id"); it != metadata.end()) {
      result.metadata_request_id = std::string(it->second.data(), it->second.size());
    }
    return result;
  }

  // A Generate the client cancels once `before_cancel` has run (on another thread: it waits for
  // the request to reach a point, or acts first); the stream ends CANCELLED before any message.
  void GenerateCancelled(const v1::GenerateRequest& request, const std::function<void()>& before_cancel) {
    grpc::ClientContext context;
    std::thread canceller([&] {
      before_cancel();
      context.TryCancel();
    });
    auto reader = stub_->Generate(&context, request);
    v1::GenerateResponse message;
    EXPECT_FALSE(reader->Read(&message));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    canceller.join();
  }

  static Tokenizer* tokenizer_;
  std::vector<std::unique_ptr<FakePrefillWorker>> prefill_;
  std::vector<std::unique_ptr<FakeDecodeWorker>> decode_;
  std::vector<std::unique_ptr<FakeServer>> prefill_servers_;
  std::vector<std::unique_ptr<FakeServer>> decode_servers_;
  std::unique_ptr<MalformedDecodeWorker> malformed_decode_;
  std::unique_ptr<WorkerRegistry> registry_;
  bool prefix_aware_ = false;  // PrefixAwarePolicy instead of LeastLoadedPolicy
  bool late_target_fakes_ = false;  // the fake prefill workers take late KV targets
  bool prefill_here_fakes_ = false;  // the fake decode workers take DecodeRequest.prefill_here
  PrefixIndex prefix_index_;
  std::unique_ptr<AssignmentPolicy> policy_;
  std::unique_ptr<RouterService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Duet::Stub> stub_;
  int server_port_ = 0;
  std::string last_request_id_;  // of the latest message Generate read
};

Tokenizer* RouterServiceTest::tokenizer_ = nullptr;

TEST_F(RouterServiceTest, RelaysTokensInOrder) {
  Start(1, 1);
  Result result = Generate(TokenRequest({1, 2, 3}, 5, "req-1"));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001, 1002, 1003, 1004}));
  ASSERT_EQ(result.messages.size(), 5u);
  for (const auto& m : result.messages) EXPECT_EQ(m.request_id(), "req-1");
  EXPECT_EQ(result.metadata_request_id, "req-1");
  EXPECT_THAT(result.messages[0].prompt_token_ids(), ::testing::ElementsAre(1, 2, 3));
  EXPECT_TRUE(result.messages.back().finished());
  EXPECT_EQ(result.messages.back().finish_reason(), "length");
  EXPECT_EQ(result.messages.back().usage().completion_tokens(), 5);
  EXPECT_EQ(prefill_[0]->last_prompt(), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(decode_[0]->num_reserved, 1);
  EXPECT_NE(decode_[0]->last_transfer_id(), 0u);
  EXPECT_EQ(registry_->prefill_workers()[0]->in_flight(), 0);
  EXPECT_EQ(registry_->decode_workers()[0]->in_flight(), 0);
  EXPECT_EQ(service_->num_in_flight(), 0);
}

// A first token that does not end the request goes to the client as soon as the prefill worker
// returns it, before the decode worker answers; the decode worker's first message, which repeats
// it, is not sent again.
TEST_F(RouterServiceTest, SendsTheFirstTokenBeforeTheDecodeWorkerAnswers) {
  Start(1, 1);
  const std::vector<int32_t> prompt = tokenizer_->Encode("def fib(n):", true);
  const int32_t first = tokenizer_->Encode(" return")[0];
  StreamingDecoder decoder(*tokenizer_, prompt);
  const std::string first_text = decoder.Push(first);
  ASSERT_FALSE(first_text.empty());
  prefill_[0]->first_token = first;
  prefill_[0]->first_token_continues = true;
  decode_[0]->SetScript({first_text, " a", " b"}, "stop");
  decode_[0]->HoldFirstMessage();

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GenerateRequest request = TokenRequest(prompt, 3, "early");
  request.mutable_sampling()->set_logprobs(1);
  auto reader = stub_->Generate(&context, request);
  v1::GenerateResponse message;
  ASSERT_TRUE(reader->Read(&message));
  EXPECT_EQ(decode_[0]->num_tokens_sent, 0);  // still held
  EXPECT_THAT(message.token_ids(), ::testing::ElementsAre(first));
  EXPECT_EQ(message.text(), first_text);
  EXPECT_EQ(message.logprobs_size(), 1);
  EXPECT_EQ(message.request_id(), "early");
  EXPECT_EQ(std::vector<int32_t>(message.prompt_token_ids().begin(), message.prompt_token_ids().end()), prompt);
  decode_[0]->ReleaseFirstMessage();
  std::vector<int32_t> rest;
  std::string text;
  while (reader->Read(&message)) {
    EXPECT_EQ(message.prompt_token_ids_size(), 0);
    EXPECT_EQ(message.logprobs_size(), message.token_ids_size());
    rest.insert(rest.end(), message.token_ids().begin(), message.token_ids().end());
    text += message.text();
    if (message.finished()) {
      EXPECT_EQ(message.finish_reason(), "stop");
      EXPECT_EQ(message.usage().completion_tokens(), 3);
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(rest, (std::vector<int32_t>{first + 1, first + 2}));
  EXPECT_EQ(text, " a b");
  EXPECT_EQ(service_->num_in_flight(), 0);
}

// A decode worker whose first message is not the token already sent ends the stream with an
// error, not with a repeated or missing token.
TEST_F(RouterServiceTest, ADecodeWorkerThatDoesNotRepeatTheFirstTokenIsAnError) {
  Start(1, 1);
  const std::vector<int32_t> prompt = tokenizer_->Encode("def fib(n):", true);
  prefill_[0]->first_token = tokenizer_->Encode(" return")[0];
  prefill_[0]->first_token_continues = true;
  decode_[0]->SetScript({" something else", " a"}, "stop");
  Result result = Generate(TokenRequest(prompt, 2));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(result.status.error_message(), HasSubstr("did not begin with the prefill worker's token"));
  ASSERT_EQ(result.messages.size(), 1u);  // the early token
  EXPECT_TRUE(WaitFor([&] { return !decode_[0]->aborted().empty(); }));
  EXPECT_EQ(service_->num_in_flight(), 0);
}

// The token waits for the decode worker when it ends the request there, when max_tokens is 1,
// or when a stop string could hold its text back: the decode worker's messages go out as sent.
TEST_F(RouterServiceTest, TheFirstTokenWaitsForTheDecodeWorkerWhenItsTextMayDiffer) {
  Start(1, 1);
  const std::vector<int32_t> prompt = tokenizer_->Encode("def fib(n):", true);
  prefill_[0]->first_token = tokenizer_->Encode(" return")[0];
  decode_[0]->SetScript({"t0", "t1"}, "stop");  // texts an early token's would not match
  for (const int variant : {0, 1, 2}) {
    prefill_[0]->first_token_continues = variant != 0;  // 0: the token stopped at the prefill worker
    v1::GenerateRequest request = TokenRequest(prompt, variant == 1 ? 1 : 2);
    if (variant == 2) request.mutable_sampling()->add_stop("xyz");
    Result result = Generate(request);
    ASSERT_TRUE(result.status.ok()) << variant << ": " << result.status.error_message();
    EXPECT_EQ(result.messages[0].text(), "t0") << variant;
  }
}

std::vector<int32_t> Iota(int32_t first, int count) {
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) ids[size_t(i)] = first + i;
  return ids;
}

// What the router learns from its placements: the prompt on both workers, and the prompt with the
// output on the decode worker once the stream has finished; the next chat turn, which extends
// them, is predicted cached that far. (The fake workers report 16-token blocks.)
// The prefill worker's prompt logprobs reach the client on the first message, with the prompt's
// ids; a reply without them all is an error, not a silent gap.
TEST_F(RouterServiceTest, RelaysPromptLogprobsOnTheFirstMessage) {
  Start(1, 1);
  v1::GenerateRequest request = TokenRequest({5, 6, 7, 8}, 3);
  request.mutable_sampling()->set_prompt_logprobs(2);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_EQ(result.messages.size(), 3u);
  const v1::GenerateResponse& first = result.messages[0];
  EXPECT_THAT(first.prompt_token_ids(), ::testing::ElementsAre(5, 6, 7, 8));
  ASSERT_EQ(first.prompt_logprobs_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(first.prompt_logprobs(i).logprob(), -float(i + 1));
    EXPECT_EQ(first.prompt_logprobs(i).rank(), i + 2);
    EXPECT_EQ(first.prompt_logprobs(i).top_size(), 2);
  }
  for (size_t i = 1; i < result.messages.size(); ++i) EXPECT_EQ(result.messages[i].prompt_logprobs_size(), 0);
  // Not asked: none.
  result = Generate(TokenRequest({5, 6, 7, 8}, 2));
  ASSERT_TRUE(result.status.ok());
  EXPECT_EQ(result.messages[0].prompt_logprobs_size(), 0);
  // Too many asked: INVALID_ARGUMENT naming the field, before any worker runs.
  const int prefills = prefill_[0]->num_prefills;
  request.mutable_sampling()->set_prompt_logprobs(21);
  result = Generate(request);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(result.status.error_message(), HasSubstr("prompt_logprobs"));
  EXPECT_EQ(prefill_[0]->num_prefills, prefills);
  // A prefill worker that leaves one out: INTERNAL, and the decode worker's blocks are released.
  prefill_[0]->missing_prompt_logprobs = 1;
  request.mutable_sampling()->set_prompt_logprobs(2);
  result = Generate(request);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_THAT(result.status.error_message(), HasSubstr("prompt logprobs"));
  EXPECT_TRUE(WaitFor([&] { return !decode_[0]->aborted().empty(); }));
  EXPECT_EQ(service_->num_in_flight(), 0);
}

TEST_F(RouterServiceTest, PlacementsFeedThePrefixIndexAndItsCounters) {
  Start(1, 1);
  const Worker* prefill = registry_->prefill_workers()[0];
  const Worker* decode = registry_->decode_workers()[0];
  const std::vector<int32_t> turn1 = Iota(1, 40);  // 2 full blocks
  Result first = Generate(TokenRequest(turn1, 30));  // output 1000..1029
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(prefix_index_.NumBlocks(prefill), 2);
  EXPECT_EQ(prefix_index_.NumBlocks(decode), 4);  // 40 + 29 tokens with K/V: 4 full blocks
  metrics::RouterMetrics& m = service_->metrics();
  EXPECT_EQ(m.routed_prompt_blocks(false).Value(), 2);
  EXPECT_EQ(m.routed_prompt_blocks_cached(false).Value(), 0);
  EXPECT_EQ(m.routed_prompt_blocks(true).Value(), 2);
  EXPECT_EQ(m.routed_prompt_blocks_cached(true).Value(), 0);

  // The next turn: the first turn, its answer, a new message (100 tokens, 6 blocks).
  std::vector<int32_t> turn2 = turn1;
  const std::vector<int32_t> answer = first.tokens();
  turn2.insert(turn2.end(), answer.begin(), answer.end());
  const std::vector<int32_t> message = Iota(3000, 30);
  turn2.insert(turn2.end(), message.begin(), message.end());
  Result second = Generate(TokenRequest(turn2, 2));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(m.routed_prompt_blocks(false).Value(), 2 + 6);
  EXPECT_EQ(m.routed_prompt_blocks_cached(false).Value(), 2);  // the prefill worker saw only turn 1's prompt
  EXPECT_EQ(m.routed_prompt_blocks(true).Value(), 2 + 6);
  EXPECT_EQ(m.routed_prompt_blocks_cached(true).Value(), 4);  // the decode worker also holds the answer
  // A salted request shares nothing with unsalted ones.
  v1::GenerateRequest salted = TokenRequest(turn1, 1);
  salted.mutable_sampling()->set_cache_salt("tenant-b");
  ASSERT_TRUE(Generate(salted).status.ok());
  EXPECT_EQ(m.routed_prompt_blocks(false).Value(), 2 + 6 + 2);
  EXPECT_EQ(m.routed_prompt_blocks_cached(false).Value(), 2);
}

// Requests that share a prefix follow it to the worker that has it, where least-loaded
// assignment would alternate between idle workers.
TEST_F(RouterServiceTest, PrefixAwarePolicySendsASharedPrefixToOneWorker) {
  prefix_aware_ = true;
  Start(2, 1);
  const std::vector<int32_t> system = Iota(1, 64);
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt = system;
    prompt.push_back(5000 + i);
    ASSERT_TRUE(Generate(TokenRequest(prompt, 1)).status.ok());
  }
  EXPECT_EQ(std::max(prefill_[0]->num_prefills.load(), prefill_[1]->num_prefills.load()), 6);
  EXPECT_EQ(service_->metrics().routed_prompt_blocks_cached(false).Value(), 5 * 4);
}

TEST_F(RouterServiceTest, TextPromptIsTokenizedWithSpecialTokens) {
  Start(1, 1);
  v1::GenerateRequest request = TokenRequest({}, 2);
  request.set_text("def fib(n):");
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  const std::vector<int32_t> expected = tokenizer_->Encode("def fib(n):", true);
  EXPECT_EQ(prefill_[0]->last_prompt(), expected);
  EXPECT_EQ(result.messages[0].prompt_token_ids_size(), static_cast<int>(expected.size()));
}

TEST_F(RouterServiceTest, MakesUniqueRequestIdsAndTransferIds) {
  Start(1, 1);
  Result a = Generate(TokenRequest({1}, 1));
  const uint64_t transfer_a = decode_[0]->last_transfer_id();
  Result b = Generate(TokenRequest({1}, 1));
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  EXPECT_FALSE(a.messages[0].request_id().empty());
  EXPECT_NE(a.messages[0].request_id(), b.messages[0].request_id());
  EXPECT_NE(transfer_a, decode_[0]->last_transfer_id());
}

TEST_F(RouterServiceTest, InvalidRequests) {
  RouterServiceOptions options;
  options.max_model_len = 256;
  Start(1, 1, options);
  auto expect_invalid = [&](const v1::GenerateRequest& request, const std::string& message) {
    Result result = Generate(request);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_THAT(result.status.error_message(), HasSubstr(message));
  };
  v1::GenerateRequest no_prompt;
  expect_invalid(no_prompt, "prompt is required");
  v1::GenerateRequest empty_text = TokenRequest({}, 4);
  empty_text.set_text("");
  expect_invalid(empty_text, "prompt is empty");
  expect_invalid(TokenRequest({}, 4), "prompt is empty");
  v1::GenerateRequest bad_temperature = TokenRequest({1, 2}, 4);
  bad_temperature.mutable_sampling()->set_temperature(-1);
  expect_invalid(bad_temperature, "temperature");
  v1::GenerateRequest bad_top_p = TokenRequest({1, 2}, 4);
  bad_top_p.mutable_sampling()->set_top_p(0);
  expect_invalid(bad_top_p, "top_p");
  expect_invalid(TokenRequest({1, 2}, 0), "max_tokens");
  expect_invalid(TokenRequest({1, 8192}, 4), "token id 8192 at prompt position 1 is out of vocabulary");
  expect_invalid(TokenRequest({-1}, 4), "out of vocabulary");
  expect_invalid(TokenRequest(std::vector<int32_t>(250, 5), 16),
                 "This model's maximum context length is 256 tokens. However, you requested 266 tokens "
                 "(250 in the messages, 16 in the completion)");
  v1::GenerateRequest bad_regex = TokenRequest({1, 2}, 4);
  bad_regex.mutable_sampling()->mutable_structured_output()->set_regex("(a");
  expect_invalid(bad_regex, "structured_output: regex: missing ')'");
  v1::GenerateRequest bad_schema = TokenRequest({1, 2}, 4);
  bad_schema.mutable_sampling()->mutable_structured_output()->set_json_schema(R"({"type": "number", "minimum": 0})");
  expect_invalid(bad_schema, "minimum on a number (integers only) is not supported");
  v1::GenerateRequest bad_bias = TokenRequest({1, 2}, 4);
  (*bad_bias.mutable_sampling()->mutable_logit_bias())[8192] = 1.0f;
  expect_invalid(bad_bias, "logit_bias: token id 8192 is out of vocabulary");
  bad_bias.mutable_sampling()->mutable_logit_bias()->erase(8192);
  (*bad_bias.mutable_sampling()->mutable_logit_bias())[3] = 101.0f;
  expect_invalid(bad_bias, "logit_bias");
  EXPECT_TRUE(Generate(TokenRequest(std::vector<int32_t>(240, 5), 16)).status.ok());  // exactly fits
  EXPECT_EQ(prefill_[0]->num_prefills, 1);
  EXPECT_EQ(decode_[0]->num_reserved, 1);
}

// Beyond max_concurrent_requests requests wait in the router's queue (num_requests_waiting),
// holding nothing on the workers, and run in arrival order as slots free.
TEST_F(RouterServiceTest, BeyondCapacityRequestsQueueInArrivalOrder) {
  RouterServiceOptions options;
  options.max_concurrent_requests = 1;
  options.max_queued_requests = 3;
  Start(1, 1, options);
  decode_[0]->token_delay_ms = 20;
  metrics::RouterMetrics& m = service_->metrics();
  absl::Mutex mu;
  std::vector<int> finished;  // prompts, in the order their requests ended
  std::vector<Result> results(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      results[i] = Generate(TokenRequest({i + 1}, i == 0 ? 25 : 3));
      absl::MutexLock lock(&mu);
      finished.push_back(i + 1);
    });
    // One at a time, so the arrival order is known: the first runs, the others queue.
    ASSERT_TRUE(WaitFor([&] { return service_->num_in_flight() == i + 1; }));
    EXPECT_EQ(m.num_requests_waiting.Value(), i);
  }
  EXPECT_EQ(decode_[0]->num_reserved, 1);  // the queued ones hold no reservation
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].tokens().size(), i == 0 ? 25u : 3u);
  }
  EXPECT_EQ(finished, (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(m.num_requests_waiting.Value(), 0);
  EXPECT_EQ(service_->num_in_flight(), 0);
  EXPECT_EQ(m.request_queue_time_seconds.Collect().count, 4u);
  EXPECT_EQ(m.request_success(FinishReason::kLength).Value(), 4);
}

// Only a full queue turns a request away: RESOURCE_EXHAUSTED (HTTP 429).
TEST_F(RouterServiceTest, FullQueueIsResourceExhausted) {
  RouterServiceOptions options;
  options.max_concurrent_requests = 1;
  options.max_queued_requests = 1;
  Start(1, 1, options);
  decode_[0]->token_delay_ms = 20;
  Result first, queued;
  std::thread slow([&] { first = Generate(TokenRequest({1}, 25)); });
  ASSERT_TRUE(WaitFor([&] { return service_->num_in_flight() == 1; }));
  std::thread waiting([&] { queued = Generate(TokenRequest({2}, 2)); });
  ASSERT_TRUE(WaitFor([&] { return service_->metrics().num_requests_waiting.Value() == 1; }));
  Result refused = Generate(TokenRequest({3}, 2));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.status.error_message(),
              HasSubstr("server is at capacity: 1 requests in flight (max_concurrent_requests) and 1 waiting "
                        "(max_queued_requests); retry later"));
  slow.join();
  waiting.join();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.tokens().size(), 25u);
  EXPECT_TRUE(queued.status.ok()) << queued.status.error_message();
  EXPECT_TRUE(Generate(TokenRequest({1}, 2)).status.ok());  // room again
  EXPECT_EQ(service_->metrics().num_requests_waiting.Value(), 0);
}

// max_queued_requests 0: no queue, a request beyond the cap is refused at once.
TEST_F(RouterServiceTest, NoQueueMeansAtCapacityIsResourceExhausted) {
  RouterServiceOptions options;
  options.max_concurrent_requests = 1;
  options.max_queued_requests = 0;
  Start(1, 1, options);
  decode_[0]->token_delay_ms = 20;
  Result first;
  std::thread slow([&] { first = Generate(TokenRequest({1}, 25)); });
  ASSERT_TRUE(WaitFor([&] { return service_->num_in_flight() == 1; }));
  EXPECT_EQ(Generate(TokenRequest({1}, 2)).status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  slow.join();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(service_->metrics().num_requests_waiting.Value(), 0);
}

// A queued request can be cancelled by its client or aborted; it leaves the queue, reaches no
// worker, and the ones behind it move up.
TEST_F(RouterServiceTest, QueuedRequestsCanBeCancelledAndAborted) {
  RouterServiceOptions options;
  options.max_concurrent_requests = 1;
  Start(1, 1, options);
  decode_[0]->token_delay_ms = 20;
  metrics::RouterMetrics& m = service_->metrics();
  Result first, aborted, last;
  std::thread a([&] { first = Generate(TokenRequest({1}, 30, "q1")); });
  ASSERT_TRUE(WaitFor([&] { return service_->num_in_flight() == 1; }));
  grpc::ClientContext cancelled_context;
  auto cancelled = stub_->Generate(&cancelled_context, TokenRequest({2}, 3, "q2"));
  ASSERT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 1; }));
  std::thread b([&] { aborted = Generate(TokenRequest({3, 4}, 3, "q3")); });
  ASSERT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 2; }));
  std::thread c([&] { last = Generate(TokenRequest({5}, 3, "q4")); });
  ASSERT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 3; }));
  cancelled_context.TryCancel();
  v1::GenerateResponse message;
  EXPECT_FALSE(cancelled->Read(&message));
  EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_request_id("q3");
  v1::AbortResponse abort_response;
  ASSERT_TRUE(stub_->Abort(&abort_context, abort, &abort_response).ok());
  EXPECT_TRUE(abort_response.found());
  b.join();
  ASSERT_TRUE(aborted.status.ok()) << aborted.status.error_message();
  ASSERT_EQ(aborted.messages.size(), 1u);
  EXPECT_EQ(aborted.messages[0].finish_reason(), "abort");
  // The client's cancel reaches the router's call asynchronously: q2 leaves the count once it has.
  EXPECT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 1; })) << m.num_requests_waiting.Value();
  a.join();
  c.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(last.status.ok()) << last.status.error_message();
  EXPECT_EQ(decode_[0]->num_reserved, 2);  // the cancelled and the aborted never got there
  EXPECT_EQ(prefill_[0]->num_prefills, 2);
  EXPECT_EQ(service_->num_in_flight(), 0);
  EXPECT_EQ(m.num_requests_waiting.Value(), 0);
}

// The router's request metrics follow one request as the client saw it.
TEST_F(RouterServiceTest, MetricsFollowARequest) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 5;
  metrics::RouterMetrics& m = service_->metrics();
  const auto start = std::chrono::steady_clock::now();
  Result result = Generate(TokenRequest({1, 2, 3}, 10));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_EQ(result.tokens().size(), 10u);
  EXPECT_EQ(m.request_success(FinishReason::kLength).Value(), 1);
  EXPECT_EQ(m.time_to_first_token_seconds.Collect().count, 1u);
  EXPECT_EQ(m.inter_token_latency_seconds.Collect().count, 9u);  // one per gap between messages
  EXPECT_EQ(m.time_per_output_token_seconds.Collect().count, 9u);
  EXPECT_EQ(m.time_per_output_token_seconds.Collect().sum, m.inter_token_latency_seconds.Collect().sum);
  EXPECT_LE(m.time_to_first_token_seconds.Collect().sum + m.inter_token_latency_seconds.Collect().sum,
            m.e2e_request_latency_seconds.Collect().sum);
  EXPECT_LE(m.e2e_request_latency_seconds.Collect().sum, seconds);
  // The per-request time per output token is the mean of the gaps.
  EXPECT_DOUBLE_EQ(m.request_time_per_output_token_seconds.Collect().sum,
                   m.inter_token_latency_seconds.Collect().sum / 9);
  EXPECT_EQ(m.request_prompt_tokens.Collect().sum, 3);
  EXPECT_EQ(m.request_generation_tokens.Collect().sum, 10);
  EXPECT_EQ(m.request_max_num_generation_tokens.Collect().sum, 10);
  EXPECT_EQ(m.request_params_n.Collect().sum, 1);
  EXPECT_EQ(m.request_params_max_tokens.Collect().sum, 10);
  EXPECT_EQ(m.request_queue_time_seconds.Collect().count, 1u);
  EXPECT_DOUBLE_EQ(m.request_inference_time_seconds.Collect().sum,
                   m.e2e_request_latency_seconds.Collect().sum - m.request_queue_time_seconds.Collect().sum);
}

// An OpenAI request's n choices are n Generate calls that say so in "duet-choice" metadata: the
// group's n counts once.
TEST_F(RouterServiceTest, RequestParamsNCountsAChoiceGroupOnce) {
  Start(1, 1);
  for (int i = 0; i < 3; ++i) {
    grpc::ClientContext context;
    context.AddMetadata("duet-choice", absl::StrCat(i, "/3"));
    auto reader = stub_->Generate(&context, TokenRequest({1}, 2));
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
    }
    ASSERT_TRUE(reader->Finish().ok());
  }
  EXPECT_EQ(service_->metrics().request_params_n.Collect().count, 1u);
  EXPECT_EQ(service_->metrics().request_params_n.Collect().sum, 3);
  EXPECT_EQ(service_->metrics().request_params_max_tokens.Collect().count, 1u);
  EXPECT_EQ(service_->metrics().request_generation_tokens.Collect().count, 3u);  // each choice is a request
}

TEST_F(RouterServiceTest, NoWorkersIsUnavailable) {
  StartWith({}, {}, {});
  Result result = Generate(TokenRequest({1}, 2));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.status.error_message(), HasSubstr("no decode workers are configured"));
}

TEST_F(RouterServiceTest, DeadWorkersAreUnavailable) {
  std::string dead;
  {
    FakeDecodeWorker decode;
    FakeServer server(&decode);
    dead = server.address();
  }
  StartWith({dead}, {dead}, {});
  EXPECT_EQ(registry_->NumUp(WorkerRole::kDecode), 0);
  Result result = Generate(TokenRequest({1}, 2));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.status.error_message(), HasSubstr("no decode worker is up"));
}

TEST_F(RouterServiceTest, NoPrefillWorkerUpReleasesReservation) {
  Start(1, 1);
  registry_->MarkDown(registry_->prefill_workers()[0], "test");
  Result result = Generate(TokenRequest({1}, 2, "r"));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.status.error_message(), HasSubstr("no prefill worker is up"));
  // Released in the background (the client's answer does not wait for it).
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }));
  EXPECT_THAT(decode_[0]->aborted(), ::testing::ElementsAre(::testing::StartsWith("r@")));  // the router's id for it
}

TEST_F(RouterServiceTest, KvFullDecodeWorkerIsSkipped) {
  Start(1, 2);
  decode_[0]->kv_full = true;
  for (int i = 0; i < 4; ++i) {
    Result result = Generate(TokenRequest({1, 2}, 2));
    EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  }
  EXPECT_EQ(decode_[0]->num_reserved, 0);
  EXPECT_EQ(decode_[1]->num_decodes, 4);
  decode_[1]->kv_full = true;
  Result full = Generate(TokenRequest({1, 2}, 2));
  EXPECT_EQ(full.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.status.error_message(), HasSubstr("no decode worker has room"));
  EXPECT_EQ(registry_->NumUp(WorkerRole::kDecode), 2);  // full is not down
}

TEST_F(RouterServiceTest, PrefillUnavailableRetriesOnAnotherWorker) {
  Start(2, 1);
  prefill_[0]->fail_unavailable = true;  // alive (answers GetStats), but its Prefill fails
  for (int i = 0; i < 4; ++i) {
    Result result = Generate(TokenRequest({1, 2}, 3, "p" + std::to_string(i)));
    EXPECT_TRUE(result.status.ok()) << result.status.error_message();
    EXPECT_EQ(result.tokens().size(), 3u);
  }
  EXPECT_EQ(prefill_[1]->num_prefills, 4);
  const int failures = prefill_[0]->num_prefills;
  EXPECT_GT(failures, 0);                               // ties rotate, so it was tried
  EXPECT_TRUE(registry_->prefill_workers()[0]->up());   // it answers its stats: not down
  EXPECT_EQ(decode_[0]->num_reserved, 4 + failures);    // a fresh reservation for each retry
  EXPECT_TRUE(WaitFor([&] { return static_cast<int>(decode_[0]->aborted().size()) == failures; }))
      << "each failed attempt's reservation is released";

  // Both failing: UNAVAILABLE naming the worker by its label (the worker's own text, which may be
  // gRPC's about its address, goes to the log only).
  prefill_[1]->fail_unavailable = true;
  Result result = Generate(TokenRequest({1, 2}, 3));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.status.error_message(), ::testing::MatchesRegex(".*prefill worker [01] failed.*"));
  EXPECT_THAT(result.status.error_message(), Not(HasSubstr("127.0.0.1")));
}

TEST_F(RouterServiceTest, DeadPrefillWorkerIsMarkedDownAndRetried) {
  Start(2, 1);
  prefill_servers_[0]->Stop();  // the registry has not noticed (its poll interval is long)
  for (int i = 0; i < 3; ++i) {
    Result result = Generate(TokenRequest({1, 2}, 3));
    EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  }
  EXPECT_EQ(prefill_[1]->num_prefills, 3);
  EXPECT_FALSE(registry_->prefill_workers()[0]->up());
  EXPECT_TRUE(registry_->decode_workers()[0]->up());
  // The reservation the dead worker was to fill: released once its sender stops and, the worker
  // confirmed gone, at once (two Aborts, sent concurrently: either may arrive first).
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 2; }, 3000));
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::UnorderedElementsAre(false, true));
  // Both name that reservation's transfer: arriving after the retry reserved again on this
  // worker, they leave the retry's reservation alone.
  const std::vector<uint64_t> transfers = decode_[0]->aborted_transfer_ids();
  ASSERT_EQ(transfers.size(), 2u);
  EXPECT_NE(transfers[0], 0u);
  EXPECT_EQ(transfers[0], transfers[1]);
}

// A prefill worker whose Prefill fails and which then does not answer its probe is down, but it
// may only be stalled (SIGSTOPped) with puts still to make into the reservation: the blocks wait
// for its sender's end or the lease, never release_now.
TEST_F(RouterServiceTest, StalledPrefillWorkerIsMarkedDownWithoutReleasingItsTargetAtOnce) {
  Start(2, 1);
  prefill_[0]->fail_unavailable = true;
  prefill_[0]->stats_delay_ms = 1500;  // past the registry's poll_timeout (1 s)
  for (int i = 0; i < 3; ++i) {
    Result result = Generate(TokenRequest({1, 2}, 3));
    EXPECT_TRUE(result.status.ok()) << result.status.error_message();
  }
  EXPECT_EQ(prefill_[0]->num_prefills, 1);
  EXPECT_FALSE(registry_->prefill_workers()[0]->up());
  // The retry has ended, after the probe's answer: an Abort with release_now would be on its way.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(false));
}

// Prefill worker 0 fails a request's Prefill and then does not answer its probe (stalled past the
// registry's poll_timeout, 1 s): the retry on prefill worker 1 succeeds and the reservation worker
// 0 was sent waits. Then `happens` to worker 0, and the poller's next round (its interval is long
// in these tests) releases that reservation at once (release_now, that placement's transfer only),
// not at the end of the lease.
void RouterServiceTest::ExpectAStalledPrefillWorkersReservationGoesWhen(const std::function<void()>& happens) {
  prefill_[0]->fail_unavailable = true;
  prefill_[0]->stats_delay_ms = 1500;  // past the registry's poll_timeout (1 s)
  Result result = Generate(TokenRequest({1, 2}, 3));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_EQ(prefill_[0]->num_prefills, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(false));
  prefill_[0]->stats_delay_ms = 0;
  happens();
  registry_->PollOnce();
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted_release_now().size() == 2; }));
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(false, true));
  const std::vector<uint64_t> transfers = decode_[0]->aborted_transfer_ids();
  ASSERT_EQ(transfers.size(), 2u);
  EXPECT_NE(transfers[0], 0u);
  EXPECT_EQ(transfers[0], transfers[1]);
}

// It dies: its port refuses.
TEST_F(RouterServiceTest, AStalledPrefillWorkerFoundGoneLaterReleasesItsTargetsReservation) {
  Start(2, 1);
  ExpectAStalledPrefillWorkersReservationGoesWhen([&] { prefill_[0]->gone = true; });
}

// A new process answers at its address (a restarted container): another instance id.
TEST_F(RouterServiceTest, AStalledPrefillWorkerReplacedByANewProcessReleasesItsTargetsReservation) {
  Start(2, 1);
  ExpectAStalledPrefillWorkersReservationGoesWhen([&] {
    prefill_[0]->fail_unavailable = false;
    prefill_[0]->instance = 2;
  });
  EXPECT_TRUE(registry_->prefill_workers()[0]->up());
}

TEST_F(RouterServiceTest, DecodeStreamErrorIsUnavailable) {
  Start(1, 1);
  decode_[0]->fail_after_tokens = 2;  // the worker fails the stream but stays alive
  Result result = Generate(TokenRequest({1}, 5));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  // The worker by its label: its address (and gRPC's text about the failed call) is in the log only.
  EXPECT_THAT(result.status.error_message(), HasSubstr("decode worker 0 failed"));
  EXPECT_THAT(result.status.error_message(), Not(HasSubstr("127.0.0.1")));
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));
  EXPECT_TRUE(registry_->decode_workers()[0]->up());  // it still answers GetStats
  decode_[0]->fail_after_tokens = -1;
  EXPECT_TRUE(Generate(TokenRequest({1}, 5)).status.ok());
}

TEST_F(RouterServiceTest, DecodeServerGoneMidStreamIsPromptlyUnavailable) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 50;
  std::thread killer;
  const auto start = std::chrono::steady_clock::now();
  Result result = Generate(TokenRequest({1}, 200), 10000, [&](int n, grpc::ClientContext*) {
    if (n == 2) killer = std::thread([&] { decode_servers_[0]->Stop(0); });
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  killer.join();
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE) << result.status.error_message();
  EXPECT_THAT(result.status.error_message(), HasSubstr("decode worker 0"));
  EXPECT_THAT(result.status.error_message(), Not(HasSubstr("127.0.0.1")));
  EXPECT_LT(seconds, 3.0);
  EXPECT_FALSE(registry_->decode_workers()[0]->up());
  Result next = Generate(TokenRequest({1}, 5));
  EXPECT_EQ(next.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(next.status.error_message(), HasSubstr("no decode worker is up"));
}

// Request migration: the request starts on decode worker 0 (worker 1 reports no free blocks, so it
// comes last) and moves to worker 1 when worker 0's stream breaks.
class MigrationTest : public RouterServiceTest {
 protected:
  void StartOnWorkerZero(int max_request_migrations) {
    RouterServiceOptions options;
    options.max_request_migrations = max_request_migrations;
    Start(1, 2, options);
    decode_[1]->free_blocks = 0;
    registry_->PollOnce();
  }
  double Migrations(metrics::RouterMetrics::Migration outcome) {
    return service_->metrics().request_migrations(outcome).Value();
  }
};

TEST_F(MigrationTest, BrokenStreamContinuesOnAnotherPairWithNothingLostOrRepeated) {
  StartOnWorkerZero(1);
  decode_[0]->fail_after_tokens = 3;  // UNAVAILABLE after 1000, 1001, 1002 (texts "t0 " .. "t2 ")
  v1::GenerateRequest request = TokenRequest({1, 2, 3}, 6, "moved");
  request.mutable_sampling()->set_logprobs(1);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001, 1002, 1003, 1004, 1005}));
  std::string text;
  int with_prompt = 0, logprobs = 0;
  for (const v1::GenerateResponse& m : result.messages) {
    text += m.text();
    with_prompt += m.prompt_token_ids_size() > 0;
    logprobs += m.logprobs_size();
    EXPECT_EQ(m.request_id(), "moved");
  }
  EXPECT_EQ(text, "t0 t1 t2 t3 t4 t5 ");
  EXPECT_EQ(with_prompt, 1);  // on the first message only
  EXPECT_THAT(result.messages[0].prompt_token_ids(), ::testing::ElementsAre(1, 2, 3));
  EXPECT_EQ(logprobs, 6);
  EXPECT_EQ(result.messages.back().usage().prompt_tokens(), 3);
  EXPECT_EQ(result.messages.back().usage().completion_tokens(), 6);
  // The second pair prefilled the prompt and the output so far, and continued after it.
  EXPECT_EQ(prefill_[0]->num_prefills, 2);
  EXPECT_EQ(prefill_[0]->last_prompt(), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(prefill_[0]->last_output_tokens(), (std::vector<int32_t>{1000, 1001, 1002}));
  EXPECT_EQ(decode_[1]->last_reserved_tokens, 6);
  const v1::DecodeRequest resumed = decode_[1]->last_decode();
  EXPECT_THAT(resumed.prompt_token_ids(), ::testing::ElementsAre(1, 2, 3));
  EXPECT_THAT(resumed.output_token_ids(), ::testing::ElementsAre(1000, 1001, 1002));
  EXPECT_EQ(resumed.output_text_bytes(), 9);
  EXPECT_EQ(resumed.first_token_id(), 1003);
  // Worker 0 still answers: it is told to drop the request.
  EXPECT_TRUE(WaitFor([&] { return !decode_[0]->aborted().empty(); }));
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kSuccess), 1);
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kFailure), 0);
  EXPECT_EQ(service_->num_in_flight(), 0);
  EXPECT_EQ(registry_->decode_workers()[1]->in_flight(), 0);
}

// The prefill worker's token went to the client early; the decode worker fails before repeating
// it, or after: the next pair goes on after the tokens the client has, none twice.
TEST_F(MigrationTest, AfterAnEarlyFirstTokenTheStreamGoesOnAfterIt) {
  StartOnWorkerZero(1);
  const std::vector<int32_t> prompt = tokenizer_->Encode("def fib(n):", true);
  const int32_t first = tokenizer_->Encode(" return")[0];
  StreamingDecoder decoder(*tokenizer_, prompt);
  const std::string first_text = decoder.Push(first);
  prefill_[0]->first_token = first;
  prefill_[0]->first_token_continues = true;
  decode_[0]->SetScript({first_text, " a", " b", " c"}, "length");
  for (const int fail_after : {0, 2}) {  // before its first message, or after its second
    decode_[0]->fail_after_tokens = fail_after;
    Result result = Generate(TokenRequest(prompt, 4));
    ASSERT_TRUE(result.status.ok()) << fail_after << ": " << result.status.error_message();
    std::string text;
    int with_prompt = 0;
    for (const v1::GenerateResponse& m : result.messages) {
      text += m.text();
      with_prompt += m.prompt_token_ids_size() > 0;
    }
    EXPECT_EQ(result.tokens(), Iota(first, 4)) << fail_after;
    EXPECT_EQ(text, fail_after == 0 ? first_text + "t1 t2 t3 " : first_text + " at2 t3 ") << fail_after;
    EXPECT_EQ(with_prompt, 1) << fail_after;
    EXPECT_EQ(result.messages.back().usage().completion_tokens(), 4) << fail_after;
    EXPECT_EQ(decode_[0]->last_decode().output_token_ids_size(), 0);  // the early token is not resumed output
    const v1::DecodeRequest resumed = decode_[1]->last_decode();
    EXPECT_EQ(std::vector<int32_t>(resumed.output_token_ids().begin(), resumed.output_token_ids().end()),
              Iota(first, fail_after == 0 ? 1 : 2));
    EXPECT_EQ(resumed.output_text_bytes(), int64_t(first_text.size()) + (fail_after == 0 ? 0 : 2));
  }
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kSuccess), 2);
  EXPECT_EQ(service_->num_in_flight(), 0);
}

TEST_F(MigrationTest, ZeroMigrationsFailTheStream) {
  StartOnWorkerZero(0);
  decode_[0]->fail_after_tokens = 2;
  Result result = Generate(TokenRequest({1}, 5));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(result.status.error_message(), "decode worker 0 failed");
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));
  EXPECT_EQ(prefill_[0]->num_prefills, 1);
  EXPECT_EQ(decode_[1]->num_decodes, 0);
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kLimit), 0);
}

TEST_F(MigrationTest, AtTheLimitTheStreamFailsSayingSo) {
  StartOnWorkerZero(1);
  decode_[0]->fail_after_tokens = 2;
  decode_[1]->fail_after_tokens = 2;
  Result result = Generate(TokenRequest({1}, 8));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(result.status.error_message(),
            "decode worker 1 failed; the request was not migrated again: it moved 1 time already "
            "(max_request_migrations 1)");
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001, 1002, 1003}));
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kSuccess), 1);
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kLimit), 1);
  EXPECT_EQ(service_->num_in_flight(), 0);
}

TEST_F(MigrationTest, NoDecodeWorkerLeftIsUnavailableNamingTheMigration) {
  RouterServiceOptions options;
  options.max_request_migrations = 2;
  Start(1, 1, options);
  decode_[0]->fail_after_tokens = 2;
  Result result = Generate(TokenRequest({1}, 5));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(result.status.error_message(),
            "decode worker 0 failed; the request could not be migrated: no other decode worker is up");
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kFailure), 1);
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kSuccess), 0);
  EXPECT_EQ(service_->num_in_flight(), 0);
}

TEST_F(MigrationTest, FailedRePrefillIsUnavailableAndReleasesTheReservation) {
  StartOnWorkerZero(1);
  decode_[0]->fail_after_tokens = 2;
  prefill_[0]->fail_resumed = true;
  Result result = Generate(TokenRequest({1}, 5, "re-prefill"));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(result.status.error_message(),
            "decode worker 0 failed; the request could not be migrated: prefill worker 0 failed");
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));
  // Worker 1's reservations (the re-prefill is tried twice) are released at once.
  EXPECT_EQ(decode_[1]->num_reserved, 2);
  EXPECT_TRUE(WaitFor([&] { return decode_[1]->aborted().size() >= 2; }));
  EXPECT_EQ(decode_[1]->num_decodes, 0);
  EXPECT_EQ(Migrations(metrics::RouterMetrics::Migration::kFailure), 1);
  EXPECT_EQ(service_->num_in_flight(), 0);
}

// A decode worker whose stream carries a message the router cannot use (bytes that are no
// GenerateResponse, a token outside the vocabulary, an unknown finish reason) and then goes
// silent: the request ends at once with INTERNAL, the stream is cancelled and the request aborted
// on the worker (its KV freed), and nothing stays in flight.
TEST_F(RouterServiceTest, MalformedDecodeMessageEndsTheRequestPromptly) {
  prefill_.push_back(std::make_unique<FakePrefillWorker>());
  prefill_servers_.push_back(std::make_unique<FakeServer>(prefill_.back().get()));
  malformed_decode_ = std::make_unique<MalformedDecodeWorker>();
  decode_servers_.push_back(std::make_unique<FakeServer>(malformed_decode_.get()));
  StartWith({prefill_servers_[0]->address()}, {decode_servers_[0]->address()}, {}, /*wait_until_up=*/true);
  using Fault = MalformedDecodeWorker::Fault;
  const struct {
    Fault fault;
    const char* message;
  } cases[] = {
      {Fault::kUnparsable, "sent a stream message that is not a valid duet.v1.GenerateResponse"},
      {Fault::kTokenOutOfVocabulary, "sent token id 1073741824, out of vocabulary (vocab size 8192)"},
      {Fault::kUnknownFinishReason, "sent finish reason \"exploded\" (not stop, length or abort)"},
  };
  int n = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.message);
    malformed_decode_->fault = c.fault;
    const std::string id = "bad-" + std::to_string(n);
    const auto start = std::chrono::steady_clock::now();
    Result result = Generate(TokenRequest({1, 2}, 50, id), /*deadline_ms=*/20000);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INTERNAL) << result.status.error_message();
    EXPECT_THAT(result.status.error_message(), HasSubstr("decode worker 0 sent"));
    EXPECT_THAT(result.status.error_message(), Not(HasSubstr("127.0.0.1")));
    EXPECT_THAT(result.status.error_message(), HasSubstr(c.message));
    EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));  // the valid ones were relayed
    ++n;
    EXPECT_TRUE(WaitFor([&] { return malformed_decode_->num_cancelled == n; }, 3000));
    EXPECT_TRUE(WaitFor([&] { return malformed_decode_->aborted().size() == size_t(n); }, 3000));
    EXPECT_THAT(malformed_decode_->aborted().back(), ::testing::StartsWith(id + "@"));
    EXPECT_EQ(service_->num_in_flight(), 0);
    EXPECT_TRUE(WaitFor([&] { return registry_->decode_workers()[0]->in_flight() == 0; }, 3000));
    EXPECT_EQ(service_->metrics().num_requests_waiting.Value(), 0);
    EXPECT_TRUE(registry_->decode_workers()[0]->up());  // it answers GetStats: not down
  }
}

// duet:num_requests_waiting on the router counts only the requests waiting in the router: those
// on the workers are the workers' to count.
TEST_F(RouterServiceTest, NumRequestsWaitingCountsOnlyRequestsWaitingInTheRouter) {
  Start(1, 1);
  prefill_[0]->prefill_delay_ms = 300;
  decode_[0]->token_delay_ms = 30;
  metrics::RouterMetrics& m = service_->metrics();
  Result first, second;
  std::thread a([&] { first = Generate(TokenRequest({1}, 20)); });
  std::thread b([&] { second = Generate(TokenRequest({2}, 20)); });
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_prefills == 2; }));
  EXPECT_EQ(service_->num_in_flight(), 2);
  EXPECT_EQ(m.num_requests_waiting.Value(), 0);
  a.join();
  b.join();
  EXPECT_TRUE(first.status.ok() && second.status.ok());
  EXPECT_EQ(m.num_requests_waiting.Value(), 0);

  // Rejected requests are never counted.
  EXPECT_EQ(Generate(TokenRequest({}, 4)).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  registry_->MarkDown(registry_->prefill_workers()[0], "test");
  EXPECT_EQ(Generate(TokenRequest({1}, 4)).status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(m.num_requests_waiting.Value(), 0);
}

// With a prefill budget of 1 token per worker, requests reserve KV and prefill one at a time; the
// others wait in the router (duet:num_requests_waiting) holding nothing on the workers, and a
// waiting request can be cancelled or aborted there.
TEST_F(RouterServiceTest, PrefillGateHoldsRequestsInTheRouterUntilAPrefillEnds) {
  RouterServiceOptions options;
  options.max_prefill_tokens_per_worker = 1;
  Start(1, 1, options);
  prefill_[0]->prefill_delay_ms = 1000;
  metrics::RouterMetrics& m = service_->metrics();
  Result first, second;
  std::thread a([&] { first = Generate(TokenRequest({1}, 3, "g1")); });
  ASSERT_TRUE(WaitFor([&] { return prefill_[0]->num_prefills == 1; }));
  std::thread b([&] { second = Generate(TokenRequest({2}, 3, "g2")); });
  ASSERT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 1; }));
  EXPECT_EQ(decode_[0]->num_reserved, 1);  // the second holds no reservation while it waits

  // A third, cancelled by its client while waiting, and a fourth, aborted while waiting.
  grpc::ClientContext cancelled_context;
  auto cancelled = stub_->Generate(&cancelled_context, TokenRequest({3}, 3, "g3"));
  ASSERT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 2; }));
  Result aborted;
  std::thread d([&] { aborted = Generate(TokenRequest({4, 5}, 3, "g4")); });
  ASSERT_TRUE(WaitFor([&] { return m.num_requests_waiting.Value() == 3; }));
  cancelled_context.TryCancel();
  v1::GenerateResponse message;
  EXPECT_FALSE(cancelled->Read(&message));
  EXPECT_EQ(cancelled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  grpc::ClientContext abort_context;
  v1::AbortRequest abort;
  abort.set_request_id("g4");
  v1::AbortResponse abort_response;
  ASSERT_TRUE(stub_->Abort(&abort_context, abort, &abort_response).ok());
  EXPECT_TRUE(abort_response.found());
  d.join();
  ASSERT_TRUE(aborted.status.ok()) << aborted.status.error_message();
  ASSERT_EQ(aborted.messages.size(), 1u);
  EXPECT_EQ(aborted.messages[0].finish_reason(), "abort");
  EXPECT_EQ(aborted.messages[0].prompt_token_ids_size(), 2);

  a.join();
  b.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(prefill_[0]->num_prefills, 2);  // the cancelled and the aborted never got there
  EXPECT_EQ(decode_[0]->num_reserved, 2);
  EXPECT_EQ(service_->num_in_flight(), 0);
  EXPECT_EQ(m.num_requests_waiting.Value(), 0);
  EXPECT_EQ(m.request_queue_time_seconds.Collect().count, 2u);  // observed when let through
  EXPECT_EQ(m.request_success(FinishReason::kAbort).Value(), 1);
}

// The gate counts prompt tokens: with 5 per worker, 3 + 2 prefill together and 1 more waits.
TEST_F(RouterServiceTest, PrefillGateCountsPromptTokens) {
  RouterServiceOptions options;
  options.max_prefill_tokens_per_worker = 5;
  Start(1, 1, options);
  prefill_[0]->prefill_delay_ms = 1000;
  Result a, b, c;
  std::thread ta([&] { a = Generate(TokenRequest({1, 2, 3}, 2)); });
  ASSERT_TRUE(WaitFor([&] { return prefill_[0]->num_prefills == 1; }));
  std::thread tb([&] { b = Generate(TokenRequest({4, 5}, 2)); });
  ASSERT_TRUE(WaitFor([&] { return prefill_[0]->num_prefills == 2; }));
  std::thread tc([&] { c = Generate(TokenRequest({6}, 2)); });
  ASSERT_TRUE(WaitFor([&] { return service_->metrics().num_requests_waiting.Value() == 1; }));
  EXPECT_EQ(prefill_[0]->num_prefills, 2);
  EXPECT_EQ(decode_[0]->num_reserved, 2);
  ta.join();
  tb.join();
  tc.join();
  EXPECT_TRUE(a.status.ok() && b.status.ok() && c.status.ok());
  EXPECT_EQ(prefill_[0]->num_prefills, 3);
}

TEST_F(RouterServiceTest, ClientCancelReachesDecodeWorker) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 10;
  Result result = Generate(TokenRequest({1}, 1000), 10000, [](int n, grpc::ClientContext* context) {
    if (n == 3) context->TryCancel();
  });
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->num_cancelled == 1; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return registry_->decode_workers()[0]->in_flight() == 0; }, 3000));
  EXPECT_TRUE(registry_->decode_workers()[0]->up());  // a cancel is not a failure
}

TEST_F(RouterServiceTest, ClientCancelDuringPrefillReachesBothWorkers) {
  Start(1, 1);
  prefill_[0]->prefill_delay_ms = 5000;
  GenerateCancelled(TokenRequest({1}, 5, "c1"), [&] {
    WaitFor([&] { return prefill_[0]->num_prefills == 1; });
  });
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_cancelled == 1; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }, 3000));  // reservation released
  // once the prefill worker, which had the target, has stopped writing into it
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(false));
  // and which is told the target, in case the cancellation overtook the Prefill call
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_aborts_with_kv_target == 1; }, 3000));
  EXPECT_EQ(decode_[0]->num_decodes, 0);
}

// A Prefill call the router gives up on (its timeout here) may never have reached the prefill
// worker, which alone can tell the decode worker that nothing will be written into the reserved
// blocks: the router's Abort to it carries the target. Before, the reservation waited for its lease.
TEST_F(RouterServiceTest, PrefillCallGivenUpOnIsAbortedOnThePrefillWorkerWithItsTarget) {
  RouterServiceOptions options;
  options.prefill_timeout = absl::Milliseconds(200);
  Start(1, 1, options);
  prefill_[0]->prefill_delay_ms = 3000;
  Result result = Generate(TokenRequest({1}, 5, "t1"));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE) << result.status.error_message();
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_aborts_with_kv_target == 1; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }, 3000));
  EXPECT_EQ(decode_[0]->num_decodes, 0);
}

TEST_F(RouterServiceTest, DeadlineReachesDecodeWorker) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 10;
  Result result = Generate(TokenRequest({1}, 1000), 300);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GT(result.messages.size(), 0u);
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->num_cancelled == 1; }, 3000));
  EXPECT_TRUE(registry_->decode_workers()[0]->up());
}

TEST_F(RouterServiceTest, AbortEndsTheStreamWithAbort) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 10;
  v1::AbortResponse abort_response;
  Result result = Generate(TokenRequest({1, 2}, 1000, "to-abort"), 10000, [&](int n, grpc::ClientContext*) {
    if (n != 3) return;
    grpc::ClientContext context;
    v1::AbortRequest abort;
    abort.set_request_id("to-abort");
    EXPECT_TRUE(stub_->Abort(&context, abort, &abort_response).ok());
  });
  EXPECT_TRUE(abort_response.found());
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_GE(result.messages.size(), 4u);
  const v1::GenerateResponse& last = result.messages.back();
  EXPECT_TRUE(last.finished());
  EXPECT_EQ(last.finish_reason(), "abort");
  EXPECT_EQ(last.request_id(), "to-abort");
  EXPECT_EQ(last.usage().prompt_tokens(), 2);
  EXPECT_EQ(last.usage().completion_tokens(), static_cast<int>(result.messages.size()) - 1);
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->num_cancelled == 1; }, 3000));

  grpc::ClientContext context;
  v1::AbortRequest unknown;
  unknown.set_request_id("nope");
  v1::AbortResponse response;
  ASSERT_TRUE(stub_->Abort(&context, unknown, &response).ok());
  EXPECT_FALSE(response.found());
}

TEST_F(RouterServiceTest, AbortDuringPrefill) {
  Start(1, 1);
  prefill_[0]->prefill_delay_ms = 5000;
  std::thread aborter([&] {
    WaitFor([&] { return prefill_[0]->num_prefills == 1; });
    grpc::ClientContext context;
    v1::AbortRequest abort;
    abort.set_request_id("a1");
    v1::AbortResponse response;
    EXPECT_TRUE(stub_->Abort(&context, abort, &response).ok());
    EXPECT_TRUE(response.found());
  });
  const auto start = std::chrono::steady_clock::now();
  Result result = Generate(TokenRequest({1, 2, 3}, 5, "a1"));
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_EQ(result.messages.size(), 1u);
  EXPECT_EQ(result.messages[0].finish_reason(), "abort");
  EXPECT_EQ(result.messages[0].prompt_token_ids_size(), 3);
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_cancelled == 1; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return !decode_[0]->aborted().empty(); }));
  EXPECT_THAT(decode_[0]->aborted(), ::testing::Contains(::testing::StartsWith("a1@")));
  EXPECT_EQ(decode_[0]->num_decodes, 0);
}

TEST_F(RouterServiceTest, DuplicateRequestIdIsRejected) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 20;
  Result first;
  std::thread slow([&] { first = Generate(TokenRequest({1}, 20, "dup")); });
  ASSERT_TRUE(WaitFor([&] { return decode_[0]->in_decode.load(); }));
  Result second = Generate(TokenRequest({1}, 2, "dup"));
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  slow.join();
  EXPECT_TRUE(first.status.ok());
}

// Another client: its own connection to the router (a channel of its own subchannel pool; the
// default pool would share the fixture's connection within this process).
std::unique_ptr<v1::Duet::Stub> OtherClient(int port) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return v1::Duet::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                                     grpc::InsecureChannelCredentials(), args));
}

// Ids the router makes are 128 random bits in hex: distinct, and no neighbour to guess.
TEST_F(RouterServiceTest, RouterMadeRequestIdsAreRandom128BitHex) {
  Start(1, 1);
  std::vector<std::string> ids;
  for (int i = 0; i < 8; ++i) {
    Result r = Generate(TokenRequest({1}, 1));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ids.push_back(r.messages[0].request_id());
    EXPECT_EQ(r.metadata_request_id, ids.back());  // also in the response metadata
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_THAT(ids[i], ::testing::MatchesRegex("cmpl-[0-9a-f]{32}"));
    for (size_t j = 0; j < i; ++j) {
      EXPECT_NE(ids[i].substr(0, 13), ids[j].substr(0, 13)) << "ids share a prefix: " << ids[i] << " " << ids[j];
    }
  }
}

// Abort acts only on the caller's own requests: another client that knows (or guesses) the id
// of a running request, client-chosen or router-made, finds nothing, and the stream runs on.
TEST_F(RouterServiceTest, AbortFromAnotherClientDoesNotEndTheStream) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 10;
  std::unique_ptr<v1::Duet::Stub> attacker = OtherClient(server_port_);
  for (const std::string& id : {std::string("victim"), std::string()}) {
    SCOPED_TRACE(id.empty() ? "router-made id" : "client-chosen id");
    bool found = true;
    Result result = Generate(TokenRequest({1, 2}, 30, id), 10000, [&](int n, grpc::ClientContext*) {
      if (n != 3) return;
      grpc::ClientContext context;
      v1::AbortRequest abort;
      abort.set_request_id(id.empty() ? last_request_id_ : id);
      v1::AbortResponse response;
      EXPECT_TRUE(attacker->Abort(&context, abort, &response).ok());
      found = response.found();
    });
    EXPECT_FALSE(found);
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    EXPECT_EQ(result.tokens().size(), 30u);
    EXPECT_EQ(result.messages.back().finish_reason(), "length");
  }
  EXPECT_EQ(decode_[0]->num_cancelled, 0);
}

// Client-chosen ids are scoped to their client: another client's request with the same id runs
// too (no ALREADY_EXISTS), each stream echoes the id it was given.
TEST_F(RouterServiceTest, SameRequestIdFromTwoClientsRunsBoth) {
  Start(1, 1);
  decode_[0]->token_delay_ms = 10;
  Result first;
  std::thread slow([&] { first = Generate(TokenRequest({1}, 30, "shared")); });
  ASSERT_TRUE(WaitFor([&] { return decode_[0]->in_decode.load(); }));
  std::unique_ptr<v1::Duet::Stub> other = OtherClient(server_port_);
  grpc::ClientContext context;
  auto reader = other->Generate(&context, TokenRequest({2}, 3, "shared"));
  v1::GenerateResponse message;
  int n = 0;
  while (reader->Read(&message)) {
    EXPECT_EQ(message.request_id(), "shared");
    ++n;
  }
  grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(n, 3);
  slow.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.tokens().size(), 30u);
  for (const auto& m : first.messages) EXPECT_EQ(m.request_id(), "shared");
  EXPECT_EQ(decode_[0]->num_decodes, 2);
}

// request_id is at most 256 bytes (it is echoed in every stream message); a longer one is
// INVALID_ARGUMENT, and the error does not repeat it.
TEST_F(RouterServiceTest, RequestIdLongerThan256BytesIsInvalid) {
  Start(1, 1);
  Result ok = Generate(TokenRequest({1}, 2, std::string(256, 'a')));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.messages[0].request_id(), std::string(256, 'a'));
  for (size_t size : {size_t(257), size_t(1) << 20}) {
    Result r = Generate(TokenRequest({1}, 2, std::string(size, 'b')));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << size;
    EXPECT_THAT(r.status.error_message(), HasSubstr("256"));
    EXPECT_LT(r.status.error_message().size(), 200u);
    EXPECT_TRUE(r.messages.empty());
  }
  EXPECT_EQ(decode_[0]->num_reserved, 1);
}

// A client that gives up while ReserveKv is in flight (cancel, or its deadline) leaves no
// reservation behind: the worker's answer may cross the cancellation, so the router aborts the
// request on that decode worker.
TEST_F(RouterServiceTest, CancelOrDeadlineDuringReserveKvAbortsOnTheDecodeWorker) {
  Start(1, 1);
  decode_[0]->reserve_delay_ms = 300;
  Result expired = Generate(TokenRequest({1}, 5, "late"), /*deadline_ms=*/100);
  EXPECT_EQ(expired.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->num_reserved == 1; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }, 3000));
  EXPECT_THAT(decode_[0]->aborted(), ::testing::ElementsAre(::testing::StartsWith("late@")));

  GenerateCancelled(TokenRequest({1}, 5, "gone"), [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 2; }, 3000));
  EXPECT_THAT(decode_[0]->aborted(), ::testing::Contains(::testing::StartsWith("gone@")));
  // No prefill worker got the target: the blocks go at once.
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(true, true));
  EXPECT_EQ(decode_[0]->num_decodes, 0);
  EXPECT_EQ(prefill_[0]->num_prefills, 0);
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
}

// Prefill workers that take a late KV target: Prefill goes out beside ReserveKv, and the target
// follows in SetKvTarget.
class LateTargetTest : public RouterServiceTest {
 protected:
  void SetUp() override { late_target_fakes_ = true; }
};

TEST_F(LateTargetTest, PrefillStartsBeforeTheReservationIsAnsweredAndGetsItsTarget) {
  Start(1, 1);
  decode_[0]->reserve_delay_ms = 1500;
  Result result;
  std::thread client([&] { result = Generate(TokenRequest({1, 2, 3}, 4, "overlap")); });
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_late_prefills == 1; }, 1400));
  EXPECT_EQ(decode_[0]->num_reserved, 0);  // still reserving
  client.join();
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001, 1002, 1003}));
  EXPECT_EQ(decode_[0]->num_reserved, 1);
  EXPECT_THAT(prefill_[0]->targets_set(), ::testing::ElementsAre(decode_[0]->last_transfer_id()));
  EXPECT_TRUE(decode_[0]->aborted().empty());
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
  EXPECT_EQ(registry_->prefill_workers()[0]->in_flight(), 0);
  EXPECT_EQ(registry_->decode_workers()[0]->in_flight(), 0);
}

TEST_F(LateTargetTest, SequentialReservationSendsTheTargetWithThePrefill) {
  RouterServiceOptions options;
  options.overlap_kv_reservation = false;
  Start(1, 1, options);
  Result result = Generate(TokenRequest({1, 2}, 2));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(prefill_[0]->num_late_prefills, 0);
  EXPECT_TRUE(prefill_[0]->targets_set().empty());
}

TEST_F(LateTargetTest, TheTargetComesFromTheDecodeWorkerWithRoom) {
  Start(1, 2);
  decode_[0]->kv_full = true;
  Result result = Generate(TokenRequest({1, 2}, 2));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(prefill_[0]->num_late_prefills, 1);
  EXPECT_THAT(prefill_[0]->targets_set(), ::testing::ElementsAre(decode_[1]->last_transfer_id()));
  EXPECT_EQ(decode_[1]->num_decodes, 1);
}

TEST_F(LateTargetTest, NoRoomForTheKvAbortsThePrefill) {
  Start(1, 1);
  decode_[0]->kv_full = true;
  Result full = Generate(TokenRequest({1, 2}, 2, "full"));
  EXPECT_EQ(full.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.status.error_message(), HasSubstr("no decode worker has room"));
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->aborted().size() == 1; }, 3000));
  EXPECT_THAT(prefill_[0]->aborted(), ::testing::ElementsAre(::testing::StartsWith("full@")));
  EXPECT_EQ(prefill_[0]->num_aborts_with_kv_target, 0);  // no target was made
  EXPECT_TRUE(prefill_[0]->targets_set().empty());
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
}

TEST_F(LateTargetTest, APrefillFailingWhileReservingReleasesTheReservationAtOnce) {
  Start(1, 1);
  decode_[0]->reserve_delay_ms = 200;
  prefill_[0]->fail_unavailable = true;  // answers at once, before the reservation
  Result result = Generate(TokenRequest({1, 2}, 2, "failing"));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(prefill_[0]->num_prefills, 2);  // retried once
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 2; }, 3000));
  // Neither reservation's target went anywhere.
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(true, true));
  EXPECT_TRUE(prefill_[0]->targets_set().empty());
  EXPECT_EQ(decode_[0]->num_decodes, 0);
}

TEST_F(LateTargetTest, ATargetThatCannotBeSentEndsTheRequestUnavailable) {
  Start(1, 1);
  prefill_[0]->fail_set_kv_target = true;
  Result result = Generate(TokenRequest({1, 2}, 2, "lost"));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.status.error_message(), HasSubstr("KV target could not be sent"));
  // The prefill worker is told with the target (to tell the decode worker); the decode worker
  // releases the reservation once its sender is done.
  EXPECT_EQ(prefill_[0]->num_aborts_with_kv_target, 1);
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }, 3000));
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(false));
  EXPECT_EQ(decode_[0]->num_decodes, 0);
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
}

// A prefill worker that dies while its Prefill waits for the target fails both calls, here
// SetKvTarget first: the probe finds it gone and the reservation goes at once, not at lease end,
// and the request is retried (no other prefill worker: UNAVAILABLE saying so).
TEST_F(LateTargetTest, APrefillWorkerGoneWhileItsTargetWentOutReleasesTheReservationAtOnce) {
  Start(1, 1);
  decode_[0]->reserve_delay_ms = 300;
  Result result;
  std::thread client([&] { result = Generate(TokenRequest({1, 2}, 2, "dying")); });
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_late_prefills == 1; }, 3000));
  prefill_[0]->gone = true;
  client.join();
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(result.status.error_message(), HasSubstr("prefill worker 0 failed and no prefill worker is up"));
  EXPECT_FALSE(registry_->prefill_workers()[0]->up());
  // The reservation whose target went out is aborted twice: once its sender stops (release_now
  // false) and, the worker confirmed gone, at once. (The retry may reserve again before it finds
  // no prefill worker up; that target went nowhere and is released at once too.)
  auto released_at_once = [&] {
    const std::vector<uint64_t> transfers = decode_[0]->aborted_transfer_ids();
    const std::vector<bool> now = decode_[0]->aborted_release_now();
    if (transfers.size() != now.size()) return false;  // an Abort arriving between the two reads
    const auto waiting = std::find(now.begin(), now.end(), false);
    if (waiting == now.end()) return false;
    const uint64_t shipped = transfers[waiting - now.begin()];
    for (size_t i = 0; i < now.size(); ++i) {
      if (now[i] && transfers[i] == shipped) return true;
    }
    return false;
  };
  EXPECT_TRUE(WaitFor(released_at_once, 3000));
  const std::vector<bool> release_now = decode_[0]->aborted_release_now();
  EXPECT_EQ(std::count(release_now.begin(), release_now.end(), false), 1);
  EXPECT_EQ(decode_[0]->num_decodes, 0);
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
}

TEST_F(LateTargetTest, ClientCancelWhileReservingReachesBothWorkers) {
  Start(1, 1);
  decode_[0]->reserve_delay_ms = 300;
  GenerateCancelled(TokenRequest({1}, 5, "gone"), [&] {
    WaitFor([&] { return prefill_[0]->num_late_prefills == 1; });
  });
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->num_reserved == 1 && decode_[0]->aborted().size() == 1; }, 3000));
  EXPECT_THAT(decode_[0]->aborted_release_now(), ::testing::ElementsAre(true));
  EXPECT_TRUE(WaitFor([&] { return !prefill_[0]->aborted().empty(); }, 3000));
  EXPECT_TRUE(prefill_[0]->targets_set().empty());
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
}

// The client leaves after the target went out (SetKvTarget has ended; the Prefill still runs):
// the Prefill call is cancelled too, so the prefill worker stops working for no one.
TEST_F(LateTargetTest, ClientCancelAfterTheTargetWentOutCancelsThePrefill) {
  Start(1, 1);
  prefill_[0]->prefill_delay_ms = 5000;
  const auto start = std::chrono::steady_clock::now();
  GenerateCancelled(TokenRequest({1}, 5, "gone-later"), [&] {
    WaitFor([&] { return prefill_[0]->targets_set().size() == 1; });
  });
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_cancelled == 1; }, 3000));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));  // not the Prefill's 5 s
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }, 3000));  // the reservation too
  EXPECT_EQ(decode_[0]->num_decodes, 0);
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
}

// A decode worker stalled (SIGSTOPped) while a request it holds a reservation for is cancelled:
// the router's Abort reaches it once it is back, longer than abort_timeout later, whether or not
// the registry marked it down meanwhile; the reservation does not wait for its lease to end.
class StalledDecodeWorkerTest : public RouterServiceTest, public ::testing::WithParamInterface<bool> {};

TEST_P(StalledDecodeWorkerTest, AbortReachesItOnceItIsBack) {
  const bool marked_down = GetParam();
  RouterServiceOptions options;
  options.abort_timeout = absl::Milliseconds(300);
  options.kv_lease_ms = 10000;
  Start(1, 1, options);
  prefill_[0]->prefill_delay_ms = 5000;  // as a prefill whose KV goes to the stalled worker
  GenerateCancelled(TokenRequest({1}, 5, "stalled"), [&] {
    WaitFor([&] { return prefill_[0]->num_prefills == 1; });
    decode_[0]->stalled = true;
    if (marked_down) registry_->MarkDown(registry_->decode_workers()[0], "stalled");  // as the poller would
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // stalled for over abort_timeout
  EXPECT_TRUE(decode_[0]->aborted().empty());
  decode_[0]->stalled = false;
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->aborted().size() == 1; }, 3000));
  EXPECT_THAT(decode_[0]->aborted(), ::testing::ElementsAre(::testing::StartsWith("stalled@")));
  EXPECT_EQ(decode_[0]->num_decodes, 0);
}

INSTANTIATE_TEST_SUITE_P(DownOrNot, StalledDecodeWorkerTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "MarkedDown" : "StillUp";
                         });

TEST_F(RouterServiceTest, GetModelInfo) {
  Start(2, 1);
  registry_->MarkDown(registry_->prefill_workers()[1], "test");
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_name(), "tiny");
  EXPECT_EQ(info.vocab_size(), 8192);
  EXPECT_EQ(info.max_model_len(), 4096);
  EXPECT_EQ(info.num_prefill_workers(), 1);  // workers up
  EXPECT_EQ(info.num_decode_workers(), 1);
}

TEST(RouterTest, StartsWithTheModelAndServesHealthAndModelInfo) {
  FakePrefillWorker prefill;
  FakeDecodeWorker decode;
  FakeServer prefill_server(&prefill);
  FakeServer decode_server(&decode);
  RouterOptions options;
  options.model_dir = kModelDir;
  options.prefill_addresses = {prefill_server.address()};
  options.decode_addresses = {decode_server.address()};
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(options);
  ASSERT_TRUE(router.ok()) << router.status();
  ASSERT_GT((*router)->port(), 0);
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string((*router)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::Duet::NewStub(channel);
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  absl::StatusOr<ModelConfig> config = LoadModelConfig(kModelDir);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(info.model_name(), "tiny-code-llama");
  EXPECT_EQ(info.vocab_size(), config->vocab_size);
  EXPECT_EQ(info.max_model_len(), config->max_position_embeddings);
  EXPECT_EQ(info.num_prefill_workers(), 1);
  EXPECT_EQ(info.num_decode_workers(), 1);

  grpc::ClientContext generate_context;
  v1::GenerateRequest request;
  request.set_text("import os");
  request.mutable_sampling()->set_max_tokens(3);
  auto reader = stub->Generate(&generate_context, request);
  v1::GenerateResponse message;
  int n = 0;
  while (reader->Read(&message)) ++n;
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(n, 3);
  (*router)->Shutdown(100);

  RouterOptions bad = options;
  bad.model_dir = "/nonexistent";
  EXPECT_FALSE(Router::Start(bad).ok());
  bad = options;
  bad.max_model_len = config->max_position_embeddings + 1;
  EXPECT_FALSE(Router::Start(bad).ok());
}

grpc::health::v1::HealthCheckResponse::ServingStatus Health(grpc::health::v1::Health::Stub& stub,
                                                            const std::string& service, grpc::Status* status) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  *status = stub.Check(&context, request, &response);
  return response.status();
}

// gRPC health and HTTP /health tell the same truth: NOT_SERVING / 503 while no worker is up,
// SERVING / 200 once a prefill and a decode worker are, NOT_SERVING / 503 again during the drain;
// for the whole server ("") and for duet.v1.Duet (which is never NOT_FOUND).
TEST(RouterTest, HealthSaysWhetherRequestsCanBeServed) {
  using grpc::health::v1::HealthCheckResponse;
  int prefill_port, decode_port;
  {
    // Two free ports, with nothing listening on them when the router starts.
    FakePrefillWorker prefill;
    FakeDecodeWorker decode;
    FakeServer prefill_server(&prefill);
    FakeServer decode_server(&decode);
    prefill_port = prefill_server.port();
    decode_port = decode_server.port();
  }
  RouterOptions options;
  options.model_dir = kModelDir;
  options.prefill_addresses = {"127.0.0.1:" + std::to_string(prefill_port)};
  options.decode_addresses = {"127.0.0.1:" + std::to_string(decode_port)};
  options.http_port = 0;
  absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(options);
  ASSERT_TRUE(router.ok()) << router.status();
  auto health = grpc::health::v1::Health::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*router)->port()), grpc::InsecureChannelCredentials()));
  const uint16_t http_port = uint16_t((*router)->http_port());
  auto http_health = [&] { return metrics::testing::HttpGet(http_port, "/health", std::chrono::seconds(5)).status; };
  auto expect_both = [&](HealthCheckResponse::ServingStatus want, int want_http) {
    for (const std::string service : {"", "duet.v1.Duet"}) {
      grpc::Status status;
      EXPECT_EQ(Health(*health, service, &status), want) << "service '" << service << "'";
      EXPECT_TRUE(status.ok()) << "service '" << service << "': " << status.error_message();
    }
    EXPECT_EQ(http_health(), want_http);
  };
  expect_both(HealthCheckResponse::NOT_SERVING, 503);
  grpc::Status unknown;
  Health(*health, "no.such.Service", &unknown);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);

  // Only a decode worker: still nothing can be served.
  FakeDecodeWorker decode;
  FakeServer decode_server(&decode, decode_port);
  ASSERT_EQ(decode_server.port(), decode_port);
  auto duet = v1::Duet::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string((*router)->port()),
                                                   grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(WaitFor([&] {
    grpc::ClientContext context;
    v1::ModelInfo info;
    return duet->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok() && info.num_decode_workers() == 1;
  }, 10000));
  expect_both(HealthCheckResponse::NOT_SERVING, 503);

  FakePrefillWorker prefill;
  FakeServer prefill_server(&prefill, prefill_port);
  ASSERT_EQ(prefill_server.port(), prefill_port);
  grpc::Status status;
  ASSERT_TRUE(WaitFor([&] { return Health(*health, "", &status) == HealthCheckResponse::SERVING; }, 10000));
  expect_both(HealthCheckResponse::SERVING, 200);

  (*router)->StartDraining();
  expect_both(HealthCheckResponse::NOT_SERVING, 503);
  (*router)->Shutdown(100);
}

// Conditional disaggregation: decode workers that prefill short prompts themselves while the
// prefill workers are busy (RouterServiceOptions::local_prefill_max_tokens).
class PrefillHereTest : public RouterServiceTest {
 protected:
  void SetUp() override { prefill_here_fakes_ = true; }
  static RouterServiceOptions Local(int64_t max_tokens, int64_t queue_tokens = 0) {
    RouterServiceOptions options;
    options.local_prefill_max_tokens = max_tokens;
    options.local_prefill_queue_tokens = queue_tokens;
    return options;
  }
  double Prefills(bool on_decode_worker) { return service_->metrics().prefills(on_decode_worker).Value(); }
};

TEST_F(PrefillHereTest, OffByDefault) {
  Start(1, 1);
  Result result = Generate(TokenRequest({1, 2, 3}, 3));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001, 1002}));
  EXPECT_EQ(decode_[0]->num_prefilled_here, 0);
  EXPECT_EQ(Prefills(false), 1);
  EXPECT_EQ(Prefills(true), 0);
}

TEST_F(PrefillHereTest, AShortPromptIsPrefilledByItsDecodeWorker) {
  Start(1, 1, Local(8));
  Result result = Generate(TokenRequest({1, 2, 3}, 4, "here"));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{3000, 3001, 3002, 3003}));
  EXPECT_THAT(result.messages[0].prompt_token_ids(), ::testing::ElementsAre(1, 2, 3));
  for (size_t i = 1; i < result.messages.size(); ++i) EXPECT_EQ(result.messages[i].prompt_token_ids_size(), 0);
  for (const v1::GenerateResponse& m : result.messages) EXPECT_EQ(m.request_id(), "here");
  EXPECT_EQ(result.messages.back().usage().completion_tokens(), 4);
  // No prefill worker, no reservation, no KV target.
  EXPECT_EQ(prefill_[0]->num_prefills, 0);
  EXPECT_EQ(decode_[0]->num_reserved, 0);
  const v1::DecodeRequest sent = decode_[0]->last_decode();
  EXPECT_TRUE(sent.prefill_here());
  EXPECT_EQ(sent.transfer_id(), 0u);
  EXPECT_THAT(sent.prompt_token_ids(), ::testing::ElementsAre(1, 2, 3));
  EXPECT_EQ(sent.output_token_ids_size(), 0);
  EXPECT_EQ(decode_[0]->num_prefilled_here, 1);
  EXPECT_EQ(Prefills(true), 1);
  EXPECT_EQ(Prefills(false), 0);
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
  EXPECT_EQ(registry_->decode_workers()[0]->in_flight(), 0);
}

TEST_F(PrefillHereTest, LongerPromptsAndPromptLogprobsGoToAPrefillWorker) {
  Start(1, 1, Local(2));
  ASSERT_TRUE(Generate(TokenRequest({1, 2, 3}, 2)).status.ok());
  v1::GenerateRequest scored = TokenRequest({1, 2}, 2);
  scored.mutable_sampling()->set_prompt_logprobs(1);
  Result result = Generate(scored);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));
  EXPECT_EQ(result.messages[0].prompt_logprobs_size(), 1);
  EXPECT_EQ(prefill_[0]->num_prefills, 2);
  EXPECT_EQ(decode_[0]->num_prefilled_here, 0);
}

TEST_F(PrefillHereTest, OnlyWhileThePrefillWorkersAreBusy) {
  Start(1, 1, Local(8, /*queue_tokens=*/5));
  prefill_[0]->prefill_delay_ms = 1500;
  Result first, second;
  std::thread client([&] { first = Generate(TokenRequest({1, 2, 3, 4, 5}, 2, "first")); });
  EXPECT_TRUE(WaitFor([&] { return prefill_[0]->num_prefills == 1; }, 1400));
  // Five prompt tokens at the one prefill worker: busy.
  second = Generate(TokenRequest({7, 8}, 2, "second"));
  client.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(first.tokens(), (std::vector<int32_t>{1000, 1001}));
  EXPECT_EQ(second.tokens(), (std::vector<int32_t>{3000, 3001}));
  EXPECT_EQ(prefill_[0]->num_prefills, 1);
  EXPECT_EQ(decode_[0]->num_prefilled_here, 1);
  // Idle again: the next one goes to the prefill worker.
  prefill_[0]->prefill_delay_ms = 0;
  EXPECT_EQ(Generate(TokenRequest({7, 8}, 1)).tokens(), (std::vector<int32_t>{1000}));
}

// What counts is what the decode worker would compute: a chat's next turn, whose earlier turns the
// router's prefix index predicts in that worker's cache, is short enough though its prompt is not.
TEST_F(PrefillHereTest, ThePromptsCachedPrefixOnTheDecodeWorkerDoesNotCount) {
  Start(1, 1, Local(16));
  std::vector<int32_t> first_turn(40);
  std::iota(first_turn.begin(), first_turn.end(), 100);
  Result first = Generate(TokenRequest(first_turn, 4));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(prefill_[0]->num_prefills, 1);  // 40 tokens to compute: too long
  // The decode worker holds the first turn and its output (the fake's block size is 16: 32
  // tokens in full blocks), so 14 of the next turn's 46 remain.
  std::vector<int32_t> second_turn = first_turn;
  second_turn.insert(second_turn.end(), {1000, 1001, 1002, 1003, 7, 8});
  Result second = Generate(TokenRequest(second_turn, 2));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.tokens(), (std::vector<int32_t>{3000, 3001}));
  EXPECT_EQ(decode_[0]->num_prefilled_here, 1);
  EXPECT_EQ(prefill_[0]->num_prefills, 1);
  // Another prompt as long, nothing of it cached: to the prefill worker.
  std::vector<int32_t> other(46, 9);
  EXPECT_EQ(Generate(TokenRequest(other, 1)).tokens(), (std::vector<int32_t>{1000}));
  EXPECT_EQ(prefill_[0]->num_prefills, 2);
}

TEST_F(PrefillHereTest, DecodeWorkersThatDoNotSayTheyTakeItAreNotAsked) {
  prefill_here_fakes_ = false;
  Start(1, 1, Local(8));
  Result result = Generate(TokenRequest({1, 2, 3}, 2));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{1000, 1001}));
  EXPECT_EQ(decode_[0]->num_reserved, 1);
  EXPECT_FALSE(decode_[0]->last_decode().prefill_here());
}

TEST_F(PrefillHereTest, WithNoPrefillWorkerUpTheDecodeWorkerServesShortPrompts) {
  Start(1, 1, Local(8, /*queue_tokens=*/1 << 20));
  prefill_servers_[0]->Stop();
  registry_->MarkDown(registry_->prefill_workers()[0], "stopped by the test");
  Result result = Generate(TokenRequest({1, 2}, 2));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{3000, 3001}));
  Result longer = Generate(TokenRequest({1, 2, 3, 4, 5, 6, 7, 8, 9}, 2));
  EXPECT_EQ(longer.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(longer.status.error_message(), HasSubstr("no prefill worker is up"));
}

TEST_F(PrefillHereTest, ACancelledRequestLeavesTheDecodeWorker) {
  Start(1, 1, Local(8));
  decode_[0]->token_delay_ms = 300;
  GenerateCancelled(TokenRequest({1, 2}, 50, "gone"), [&] {
    WaitFor([&] { return decode_[0]->in_decode.load(); });
  });
  EXPECT_TRUE(WaitFor([&] { return decode_[0]->num_cancelled == 1; }, 3000));
  EXPECT_TRUE(WaitFor([&] { return service_->num_in_flight() == 0; }, 3000));
  EXPECT_EQ(registry_->decode_workers()[0]->in_flight(), 0);
  EXPECT_EQ(prefill_[0]->num_prefills, 0);
}

TEST_F(PrefillHereTest, ABrokenStreamMigratesThroughAPrefillWorker) {
  RouterServiceOptions options = Local(8);
  Start(1, 2, options);
  decode_[1]->free_blocks = 0;  // the policy takes worker 0 first
  registry_->PollOnce();
  decode_[0]->fail_after_tokens = 2;  // UNAVAILABLE after 3000, 3001
  Result result = Generate(TokenRequest({1, 2, 3}, 5, "moved"));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  // The second pair prefilled the prompt and the output so far on the prefill worker.
  EXPECT_EQ(result.tokens(), (std::vector<int32_t>{3000, 3001, 1002, 1003, 1004}));
  EXPECT_EQ(prefill_[0]->num_prefills, 1);
  EXPECT_EQ(prefill_[0]->last_output_tokens(), (std::vector<int32_t>{3000, 3001}));
  EXPECT_FALSE(decode_[1]->last_decode().prefill_here());
  EXPECT_EQ(Prefills(true), 1);
  EXPECT_EQ(Prefills(false), 1);
}

}  // namespace
}  // namespace duet::router
