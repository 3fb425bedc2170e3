// The public gRPC API as a router serves it (Router::Start: the drain, the API key, n, the
// service) in front of fake workers: chat through the chat template, tool calls parsed in the
// response, n completions, the finish reason enum and the x-request-id metadata.
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "duet/v1/duet.grpc.pb.h"
#include "frontend/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "router/fake_workers.h"
#include "router/router.h"

namespace duet::router {
namespace {

using ::testing::HasSubstr;
using testing::FakeDecodeWorker;
using testing::FakePrefillWorker;
using testing::FakeServer;

constexpr char kModelDir[] = DUET_MODELS_DIR "/tiny-code-llama";

struct Result {
  grpc::Status status;
  std::vector<v1::GenerateResponse> messages;
  std::optional<std::string> metadata_request_id;
  // Messages of completion `index`.
  std::vector<v1::GenerateResponse> Of(int index) const {
    std::vector<v1::GenerateResponse> out;
    for (const auto& m : messages) {
      if (m.index() == index) out.push_back(m);
    }
    return out;
  }
};

v1::ChatMessage Message(const std::string& role, const std::string& content) {
  v1::ChatMessage m;
  m.set_role(role);
  m.set_content(content);
  return m;
}

v1::GenerateRequest ChatRequest(int max_tokens) {
  v1::GenerateRequest request;
  *request.mutable_chat()->add_messages() = Message("system", "Be brief.");
  *request.mutable_chat()->add_messages() = Message("user", "Weather in Paris?");
  request.mutable_sampling()->set_max_tokens(max_tokens);
  return request;
}

// n = 2 completions of up to 1000 tokens, with request id `id`: long enough to abort.
v1::GenerateRequest LongNRequest(const std::string& id) {
  v1::GenerateRequest request = ChatRequest(1000);
  request.set_request_id(id);
  request.set_n(2);
  return request;
}

void AddWeatherTool(v1::GenerateRequest* request) {
  v1::Tool* tool = request->mutable_chat()->add_tools();
  tool->set_name("get_weather");
  tool->set_parameters(R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
}

class GrpcApiTest : public ::testing::Test {
 protected:
  void StartRouter(const std::string& tool_call_parser = "", const std::string& api_key = "") {
    prefill_server_ = std::make_unique<FakeServer>(&prefill_);
    decode_server_ = std::make_unique<FakeServer>(&decode_);
    RouterOptions options;
    options.model_dir = kModelDir;
    options.prefill_addresses = {prefill_server_->address()};
    options.decode_addresses = {decode_server_->address()};
    options.enable_auto_tool_choice = !tool_call_parser.empty();
    options.tool_call_parser = tool_call_parser;
    options.api_key = api_key;
    api_key_ = api_key;
    absl::StatusOr<std::unique_ptr<Router>> router = Router::Start(options);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    stub_ = v1::Duet::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(router_->port()),
                                                  grpc::InsecureChannelCredentials()));
    // Both workers up (the registry's first poll runs in the background).
    for (int i = 0; i < 1000; ++i) {
      grpc::ClientContext context;
      Authorize(&context);
      v1::ModelInfo info;
      if (stub_->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok() && info.num_prefill_workers() == 1 &&
          info.num_decode_workers() == 1) {
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FAIL() << "the workers did not come up";
  }
  void TearDown() override {
    if (router_) router_->Shutdown(0);
  }
  void Authorize(grpc::ClientContext* context) const {
    if (!api_key_.empty()) context->AddMetadata("authorization", "Bearer " + api_key_);
  }

  // Runs Generate to the end; `on_message(i)` after the i-th message (1-based).
  Result Generate(const v1::GenerateRequest& request, bool authorize = true,
                  const std::function<void(int)>& on_message = nullptr) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (authorize) Authorize(&context);
    Result result;
    auto reader = stub_->Generate(&context, request);
    v1::GenerateResponse message;
    while (reader->Read(&message)) {
      result.messages.push_back(message);
      if (on_message) on_message(static_cast<int>(result.messages.size()));
    }
    result.status = reader->Finish();
    const auto& metadata = context.GetServerInitialMetadata();
    if (auto it = metadata.find("x-request-id"); it != metadata.end()) {
      result.metadata_request_id = std::string(it->second.data(), it->second.size());
    }
    return result;
  }

  bool Abort(const std::string& request_id) {
    grpc::ClientContext context;
    Authorize(&context);
    v1::AbortRequest request;
    request.set_request_id(request_id);
    v1::AbortResponse response;
    return stub_->Abort(&context, request, &response).ok() && response.found();
  }

  FakePrefillWorker prefill_;
  FakeDecodeWorker decode_;
  std::unique_ptr<FakeServer> prefill_server_, decode_server_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<v1::Duet::Stub> stub_;
  std::string api_key_;
};

TEST_F(GrpcApiTest, ChatIsRenderedThroughTheChatTemplate) {
  StartRouter();
  v1::GenerateRequest request = ChatRequest(3);
  request.set_request_id("chat-1");
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(kModelDir);
  ASSERT_TRUE(tokenizer.ok());
  const std::vector<int32_t> expected = (*tokenizer)->Encode(
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n",
      /*add_special_tokens=*/false);
  EXPECT_EQ(prefill_.last_prompt(), expected);
  ASSERT_EQ(result.messages.size(), 3u);
  EXPECT_THAT(result.messages[0].prompt_token_ids(), ::testing::ElementsAreArray(expected));
  EXPECT_EQ(result.messages.back().finish_reason(), "length");
  EXPECT_EQ(result.messages.back().finish_reason_code(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(result.metadata_request_id, "chat-1");
  for (const auto& m : result.messages) EXPECT_EQ(m.content(), "");  // no tools: text only
}

TEST_F(GrpcApiTest, FinishReasonEnumOnPlainRequests) {
  StartRouter();
  decode_.SetScript({"a", "b"}, "stop");
  v1::GenerateRequest request;
  request.set_text("import os");
  request.mutable_sampling()->set_max_tokens(5);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  ASSERT_EQ(result.messages.size(), 2u);
  EXPECT_EQ(result.messages[0].finish_reason_code(), v1::FINISH_REASON_UNSPECIFIED);
  EXPECT_EQ(result.messages[1].finish_reason(), "stop");
  EXPECT_EQ(result.messages[1].finish_reason_code(), v1::FINISH_REASON_STOP);
  ASSERT_TRUE(result.metadata_request_id.has_value());
  EXPECT_EQ(*result.metadata_request_id, result.messages[0].request_id());
}

TEST_F(GrpcApiTest, AutoToolCallsAreParsedWithTheRoutersHermesParser) {
  StartRouter("hermes");
  decode_.SetScript({"Checking. ", "<tool_call>\n{\"name\": \"get_weather\", ",
                     "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"},
                    "stop");
  v1::GenerateRequest request = ChatRequest(16);
  AddWeatherTool(&request);  // tool_choice unset with tools: auto
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  std::string text, content;
  std::vector<v1::ToolCallDelta> deltas;
  for (const auto& m : result.messages) {
    text += m.text();
    content += m.content();
    deltas.insert(deltas.end(), m.tool_call_deltas().begin(), m.tool_call_deltas().end());
  }
  EXPECT_EQ(text, "Checking. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
  EXPECT_EQ(content, "Checking.");
  ASSERT_EQ(deltas.size(), 1u);
  EXPECT_THAT(deltas[0].id(), ::testing::MatchesRegex("chatcmpl-tool-[0-9a-f]{32}"));
  const v1::GenerateResponse& last = result.messages.back();
  ASSERT_EQ(last.tool_calls_size(), 1);
  EXPECT_EQ(last.tool_calls(0).id(), deltas[0].id());
  EXPECT_EQ(last.tool_calls(0).name(), "get_weather");
  EXPECT_EQ(nlohmann::json::parse(last.tool_calls(0).arguments()), nlohmann::json({{"city", "Paris"}}));
  EXPECT_EQ(last.finish_reason(), "tool_calls");
  EXPECT_EQ(last.finish_reason_code(), v1::FINISH_REASON_TOOL_CALLS);
  EXPECT_FALSE(decode_.decoded_sampling().back().has_structured_output());  // auto forces nothing
}

TEST_F(GrpcApiTest, AutoToolCallsAreParsedWithTheRoutersLlama3Parser) {
  StartRouter("llama3_json");
  decode_.SetScript({"{\"name\": \"get_weather\", ", "\"parameters\": {\"city\": \"Paris\"}}"}, "stop");
  v1::GenerateRequest request = ChatRequest(16);
  AddWeatherTool(&request);
  request.mutable_chat()->mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_AUTO);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  const v1::GenerateResponse& last = result.messages.back();
  ASSERT_EQ(last.tool_calls_size(), 1);
  EXPECT_EQ(last.tool_calls(0).name(), "get_weather");
  EXPECT_EQ(nlohmann::json::parse(last.tool_calls(0).arguments()), nlohmann::json({{"city", "Paris"}}));
  EXPECT_EQ(last.finish_reason_code(), v1::FINISH_REASON_TOOL_CALLS);
}

TEST_F(GrpcApiTest, RequiredAndNamedToolChoicesAreForcedAndParsed) {
  StartRouter();  // no parser: required and named need none
  v1::GenerateRequest request = ChatRequest(16);
  AddWeatherTool(&request);
  request.mutable_chat()->mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_REQUIRED);
  decode_.SetScript({"[{\"name\": \"get_weather\", ", "\"parameters\": {\"city\": \"Paris\"}}]"}, "stop");
  Result required = Generate(request);
  ASSERT_TRUE(required.status.ok()) << required.status.error_message();
  EXPECT_THAT(decode_.decoded_sampling().back().structured_output().json_schema(), HasSubstr("get_weather"));
  ASSERT_EQ(required.messages.back().tool_calls_size(), 1);
  EXPECT_EQ(required.messages.back().tool_calls(0).name(), "get_weather");

  request.mutable_chat()->mutable_tool_choice()->set_function_name("get_weather");
  decode_.SetScript({"{\"city\": ", "\"Paris\"}"}, "stop");
  Result named = Generate(request);
  ASSERT_TRUE(named.status.ok()) << named.status.error_message();
  EXPECT_EQ(nlohmann::json::parse(decode_.decoded_sampling().back().structured_output().json_schema())["required"],
            nlohmann::json::array({"city"}));  // the function's parameters
  ASSERT_EQ(named.messages.back().tool_calls_size(), 1);
  EXPECT_EQ(named.messages.back().tool_calls(0).arguments(), "{\"city\": \"Paris\"}");
  EXPECT_EQ(named.messages.back().finish_reason_code(), v1::FINISH_REASON_TOOL_CALLS);
}

TEST_F(GrpcApiTest, InvalidChatAndNAreInvalidArgument) {
  StartRouter();
  auto error = [&](const v1::GenerateRequest& request) {
    Result result = Generate(request);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << result.status.error_message();
    EXPECT_TRUE(result.messages.empty());
    return result.status.error_message();
  };
  v1::GenerateRequest request = ChatRequest(4);
  request.mutable_chat()->clear_messages();
  EXPECT_EQ(error(request), "chat: 'messages' is an empty list");
  request = ChatRequest(4);
  request.mutable_chat()->mutable_messages(1)->clear_role();
  EXPECT_EQ(error(request), "chat.messages[1].role is required");
  request = ChatRequest(4);
  AddWeatherTool(&request);
  request.mutable_chat()->mutable_tools(0)->set_parameters("{");
  EXPECT_THAT(error(request), HasSubstr("chat.tools[0].parameters"));
  request = ChatRequest(4);
  AddWeatherTool(&request);
  EXPECT_THAT(error(request), HasSubstr("--enable-auto-tool-choice"));  // auto without a parser
  request.mutable_chat()->mutable_tool_choice()->set_function_name("other");
  EXPECT_THAT(error(request), HasSubstr("'other'"));
  request.mutable_chat()->mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_REQUIRED);
  request.mutable_sampling()->mutable_structured_output()->set_regex("a+");
  EXPECT_THAT(error(request), HasSubstr("cannot be combined"));

  request = ChatRequest(4);
  request.set_n(-1);
  EXPECT_EQ(error(request), "n must be between 1 and 128, got -1");
  request.set_n(129);
  EXPECT_EQ(error(request), "n must be between 1 and 128, got 129");
  request.set_n(2);
  request.mutable_sampling()->set_temperature(-1);  // each completion's own validation
  EXPECT_THAT(error(request), HasSubstr("temperature"));
  // The server is fine afterwards.
  EXPECT_TRUE(Generate(ChatRequest(2)).status.ok());
}

TEST_F(GrpcApiTest, NCompletionsStreamWithTheirIndexAndSeeds) {
  StartRouter();
  v1::GenerateRequest request = ChatRequest(3);
  request.set_request_id("n-req");
  request.set_n(3);
  request.mutable_sampling()->set_seed(5);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.metadata_request_id, "n-req");
  ASSERT_EQ(result.messages.size(), 9u);
  for (int index = 0; index < 3; ++index) {
    std::vector<v1::GenerateResponse> own = result.Of(index);
    ASSERT_EQ(own.size(), 3u) << index;
    std::string text;
    for (const auto& m : own) {
      EXPECT_EQ(m.request_id(), "n-req");
      text += m.text();
    }
    EXPECT_EQ(text, "t0 t1 t2 ");
    EXPECT_GT(own[0].prompt_token_ids_size(), 0);
    EXPECT_TRUE(own.back().finished());
    EXPECT_EQ(own.back().finish_reason_code(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(own.back().usage().completion_tokens(), 3);
  }
  std::multiset<uint64_t> seeds;
  for (const v1::SamplingOptions& s : decode_.decoded_sampling()) seeds.insert(s.seed());
  EXPECT_EQ(seeds, (std::multiset<uint64_t>{5, 6, 7}));
}

TEST_F(GrpcApiTest, NToolCallsAreParsedPerCompletion) {
  StartRouter("hermes");
  decode_.SetScript({"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"},
                    "stop");
  v1::GenerateRequest request = ChatRequest(8);
  AddWeatherTool(&request);
  request.set_n(2);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  std::set<std::string> ids;
  for (int index = 0; index < 2; ++index) {
    const v1::GenerateResponse last = result.Of(index).back();
    ASSERT_EQ(last.tool_calls_size(), 1) << index;
    ids.insert(last.tool_calls(0).id());
    EXPECT_EQ(last.finish_reason_code(), v1::FINISH_REASON_TOOL_CALLS);
  }
  EXPECT_EQ(ids.size(), 2u);  // each call has its own id
}

TEST_F(GrpcApiTest, AbortEndsEveryCompletionWithAbort) {
  StartRouter();
  decode_.token_delay_ms = 20;
  v1::GenerateRequest request = LongNRequest("to-abort");
  std::thread aborter;
  Result result = Generate(request, true, [&](int i) {
    if (i == 1) aborter = std::thread([&] { EXPECT_TRUE(Abort("to-abort")); });
  });
  aborter.join();
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  for (int index = 0; index < 2; ++index) {
    std::vector<v1::GenerateResponse> own = result.Of(index);
    ASSERT_FALSE(own.empty()) << index;
    EXPECT_EQ(own.back().finish_reason(), "abort") << index;
    EXPECT_EQ(own.back().finish_reason_code(), v1::FINISH_REASON_ABORT) << index;
    EXPECT_LT(own.back().usage().completion_tokens(), 1000);
  }
  EXPECT_FALSE(Abort("to-abort"));  // over: not found
}

TEST_F(GrpcApiTest, AbortRightAfterTheRequestStillEndsBothCompletions) {
  StartRouter();
  prefill_.prefill_delay_ms = 50;
  v1::GenerateRequest request = LongNRequest("early");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  auto reader = stub_->Generate(&context, request);
  reader->WaitForInitialMetadata();  // the request is in flight at the router
  EXPECT_TRUE(Abort("early"));
  std::map<int, v1::GenerateResponse> last;
  v1::GenerateResponse message;
  while (reader->Read(&message)) last[message.index()] = message;
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(last.size(), 2u);
  for (const auto& [index, m] : last) EXPECT_EQ(m.finish_reason_code(), v1::FINISH_REASON_ABORT) << index;
}

TEST_F(GrpcApiTest, DuplicateRequestIdOfAnNRequestIsAlreadyExists) {
  StartRouter();
  decode_.token_delay_ms = 20;
  v1::GenerateRequest request = LongNRequest("dup");
  std::thread second;
  Result first = Generate(request, true, [&](int i) {
    if (i != 1) return;
    second = std::thread([&] {
      Result again = Generate(request);
      EXPECT_EQ(again.status.error_code(), grpc::StatusCode::ALREADY_EXISTS) << again.status.error_message();
      EXPECT_TRUE(Abort("dup"));
    });
  });
  second.join();
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
}

TEST_F(GrpcApiTest, NCompletionsCarryTheApiKey) {
  StartRouter("", "secret");
  v1::GenerateRequest request = ChatRequest(2);
  request.set_n(2);
  Result result = Generate(request);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.messages.size(), 4u);
  EXPECT_EQ(Generate(request, /*authorize=*/false).status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

}  // namespace
}  // namespace duet::router
