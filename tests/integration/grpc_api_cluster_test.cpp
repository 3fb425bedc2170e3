// The public gRPC API offers what the HTTP API offers, with a real gRPC client against a real
// local cluster (router, prefill and decode worker processes on loopback, the bundled model):
// chat through the chat template (the same prompt and greedy answer as HTTP chat completions),
// a JSON-schema constraint whose output parses and validates, tool calls parsed by both
// --tool-call-parser formats, n = 2, the finish reason enum and the x-request-id metadata; a
// router's --chat-template and a chat's chat_template_kwargs shaping the prompt, a chat without
// max_tokens running to the context limit, and bad templates failing start-up.
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/subprocess.h"
#include "gtest/gtest.h"
#include "metrics/test_http_client.h"
#include "nlohmann/json.hpp"
#include "tests/integration/local_cluster.h"
#include "tests/integration/process.h"
#include "tests/structured_outputs/schema_validator.h"

namespace duet {
namespace {

using nlohmann::json;
using testing::LocalCluster;

// Everything one Generate returned, by completion index.
struct Completion {
  std::string text, content;
  std::vector<int32_t> prompt_token_ids, token_ids;
  std::vector<v1::ToolCall> tool_calls;
  std::string finish_reason;
  v1::FinishReason finish_reason_code = v1::FINISH_REASON_UNSPECIFIED;
  int finished_messages = 0;
};
struct Result {
  grpc::Status status;
  std::map<int, Completion> completions;
  std::string metadata_request_id;
};

Result Generate(v1::Duet::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  Result result;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    Completion& c = result.completions[m.index()];
    c.text += m.text();
    c.content += m.content();
    c.token_ids.insert(c.token_ids.end(), m.token_ids().begin(), m.token_ids().end());
    if (m.prompt_token_ids_size() > 0) c.prompt_token_ids.assign(m.prompt_token_ids().begin(), m.prompt_token_ids().end());
    if (m.finished()) {
      ++c.finished_messages;
      c.finish_reason = m.finish_reason();
      c.finish_reason_code = m.finish_reason_code();
      c.tool_calls.assign(m.tool_calls().begin(), m.tool_calls().end());
    }
  }
  result.status = reader->Finish();
  const auto& metadata = context.GetServerInitialMetadata();
  if (auto it = metadata.find("x-request-id"); it != metadata.end()) {
    result.metadata_request_id.assign(it->second.data(), it->second.size());
  }
  return result;
}

v1::GenerateRequest ChatRequest(const std::string& user, int max_tokens) {
  v1::GenerateRequest request;
  v1::ChatMessage* system = request.mutable_chat()->add_messages();
  system->set_role("system");
  system->set_content("You are a helpful assistant.");
  v1::ChatMessage* message = request.mutable_chat()->add_messages();
  message->set_role("user");
  message->set_content(user);
  request.mutable_sampling()->set_temperature(0);
  request.mutable_sampling()->set_max_tokens(max_tokens);
  return request;
}

json HttpPost(int port, const std::string& path, const json& body) {
  const metrics::testing::HttpResponse r =
      metrics::testing::HttpPost(uint16_t(port), path, body.dump(), std::chrono::seconds(120));
  EXPECT_EQ(r.status, 200) << path << ": " << r.body;
  return r.status == 200 ? json::parse(r.body) : json();
}

// A router process in front of the given workers (decode, then prefill); nullptr (and the
// process stopped) unless it announced its ports, gRPC in `grpc_port`, HTTP in `http_port` when
// the flags turn HTTP on.
Subprocess* StartRouter(const std::vector<std::string>& workers, const std::vector<std::string>& flags,
                        std::string* grpc_port, std::string* http_port = nullptr) {
  std::vector<std::string> argv = {testing::DuetBinary(), "router", "--model", DUET_MODELS_DIR "/tiny-code-llama",
                                   "--port", "0", "--decode", workers[0], "--prefill", workers[1]};
  argv.insert(argv.end(), flags.begin(), flags.end());
  absl::StatusOr<std::unique_ptr<Subprocess>> router = Subprocess::Start(argv, {});
  if (!router.ok()) return nullptr;
  if (http_port != nullptr) {
    absl::StatusOr<std::string> port = (*router)->WaitForLine("DUET_HTTP_READY port=", std::chrono::seconds(120));
    if (!port.ok()) {
      (*router)->Stop();
      return nullptr;
    }
    *http_port = *port;
  }
  absl::StatusOr<std::string> port = (*router)->WaitForLine("DUET_READY port=", std::chrono::seconds(120));
  if (!port.ok()) {
    (*router)->Stop();
    return nullptr;
  }
  *grpc_port = *port;
  return router->release();
}

std::unique_ptr<v1::Duet::Stub> StubAt(const std::string& port) {
  return v1::Duet::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
}

// The --chat-template of the custom-template router: roles and contents, and `suffix` when a
// request's chat_template_kwargs give one.
constexpr char kCustomTemplate[] =
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if suffix is defined %}{{ suffix }}{% endif %}\n";
constexpr int kCustomRouterMaxModelLen = 64;

// One cluster for the suite: its router parses hermes tool calls; a second router in front of
// the same workers parses llama3_json ones, and a third renders chats with a --chat-template
// of its own (and a short --max-model-len).
class GrpcApiClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    testing::ClusterOptions options{1, 1, {}, {"--enable-auto-tool-choice", "--tool-call-parser", "hermes"}};
    options.http = true;
    cluster_ = new LocalCluster(options);
    if (!cluster_->ok()) return;
    const std::vector<std::string>& workers = cluster_->worker_addresses();  // decode, then prefill
    std::string port;
    llama3_router_ = StartRouter(workers, {"--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"}, &port);
    if (llama3_router_ != nullptr) llama3_stub_ = StubAt(port).release();
    temp_dir_ = new std::string(testing::MakeTempDir("grpc-api-chat-template"));
    const std::string template_file = *temp_dir_ + "/template.jinja";
    std::ofstream(template_file) << kCustomTemplate;
    custom_router_ = StartRouter(workers,
                                 {"--chat-template", template_file, "--http-port", "0", "--max-model-len",
                                  std::to_string(kCustomRouterMaxModelLen)},
                                 &port, &custom_http_port_);
    if (custom_router_ != nullptr) custom_stub_ = StubAt(port).release();
  }
  static void TearDownTestSuite() {
    delete llama3_stub_;
    delete custom_stub_;
    for (Subprocess* router : {llama3_router_, custom_router_}) {
      if (router != nullptr) router->Stop();
      delete router;
    }
    delete temp_dir_;
    delete cluster_;
  }
  void SetUp() override {
    ASSERT_TRUE(cluster_->ok()) << cluster_->error();
    ASSERT_NE(llama3_stub_, nullptr) << "the llama3_json router did not start";
    ASSERT_NE(custom_stub_, nullptr) << "the --chat-template router did not start";
  }

  static LocalCluster* cluster_;
  static Subprocess* llama3_router_;
  static v1::Duet::Stub* llama3_stub_;
  static Subprocess* custom_router_;
  static v1::Duet::Stub* custom_stub_;
  static std::string custom_http_port_;
  static std::string* temp_dir_;
};
LocalCluster* GrpcApiClusterTest::cluster_ = nullptr;
Subprocess* GrpcApiClusterTest::llama3_router_ = nullptr;
v1::Duet::Stub* GrpcApiClusterTest::llama3_stub_ = nullptr;
Subprocess* GrpcApiClusterTest::custom_router_ = nullptr;
v1::Duet::Stub* GrpcApiClusterTest::custom_stub_ = nullptr;
std::string GrpcApiClusterTest::custom_http_port_;
std::string* GrpcApiClusterTest::temp_dir_ = nullptr;

// A gRPC chat is the HTTP chat completion: the same prompt tokens (/tokenize renders the same
// template) and, greedy, the same answer.
TEST_F(GrpcApiClusterTest, ChatEqualsHttpChatCompletions) {
  v1::GenerateRequest request = ChatRequest("Write a Python function that adds two numbers.", 24);
  request.set_request_id("chat-parity");
  Result got = Generate(cluster_->router(), request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.metadata_request_id, "chat-parity");
  ASSERT_EQ(got.completions.size(), 1u);
  const Completion& c = got.completions[0];
  EXPECT_EQ(c.finished_messages, 1);
  EXPECT_FALSE(c.text.empty());
  EXPECT_TRUE(c.finish_reason_code == v1::FINISH_REASON_LENGTH || c.finish_reason_code == v1::FINISH_REASON_STOP)
      << c.finish_reason;
  EXPECT_EQ(c.finish_reason, c.finish_reason_code == v1::FINISH_REASON_LENGTH ? "length" : "stop");

  const json messages = json::array({{{"role", "system"}, {"content", "You are a helpful assistant."}},
                                     {{"role", "user"}, {"content", "Write a Python function that adds two numbers."}}});
  const json tokenized = HttpPost(cluster_->http_port(), "/tokenize", {{"messages", messages}});
  EXPECT_EQ(c.prompt_token_ids, tokenized["tokens"].get<std::vector<int32_t>>());
  const json http = HttpPost(cluster_->http_port(), "/v1/chat/completions",
                             {{"messages", messages}, {"temperature", 0}, {"max_tokens", 24}});
  ASSERT_TRUE(http.contains("choices")) << http.dump();
  EXPECT_EQ(c.text, http["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_EQ(c.finish_reason, http["choices"][0]["finish_reason"].get<std::string>());
}

// Every JSON-schema case of the structured-output test set (and any JSON object), with the
// prompts and sampling tests/openai_api/structured_outputs_test.mjs gives HTTP chat.
TEST_F(GrpcApiClusterTest, JsonSchemaOutputsParseAndValidate) {
  std::ifstream in(DUET_SOURCE_DIR "/tests/structured_outputs/cases.json");
  const json cases = json::parse(in);
  for (const json& c : cases["json_schema"]) {
    const bool any_object = c.value("json_object", false);
    const std::string name = c["name"];
    v1::GenerateRequest request = ChatRequest(
        any_object ? c["prompt"].get<std::string>()
                   : absl::StrCat("config = {\"name\": \"x\", \"size\": 3}\n# ", name, "\nvalue = "),
        384);
    request.mutable_chat()->mutable_messages()->DeleteSubrange(0, 1);  // the user message alone
    v1::SamplingOptions* s = request.mutable_sampling();
    s->set_temperature(c.value("temperature", 0.9f));
    s->set_top_p(c.value("top_p", 1.0f));
    s->set_repetition_penalty(c.value("repetition_penalty", 1.0f));
    s->set_seed(any_object ? 1 : 7);
    if (any_object) {
      s->mutable_structured_output()->set_json_object(true);
    } else {
      s->mutable_structured_output()->set_json_schema(c["schema"].dump());
    }
    Result got = Generate(cluster_->router(), request);
    ASSERT_TRUE(got.status.ok()) << name << ": " << got.status.error_message();
    const Completion& out = got.completions[0];
    EXPECT_EQ(out.finish_reason_code, v1::FINISH_REASON_STOP) << name << ": " << out.text;
    const json value = json::parse(out.text, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(value.is_discarded()) << name << ": " << out.text;
    const json schema = any_object ? json{{"type", "object"}} : c["schema"];
    EXPECT_EQ(testing::ValidateJson(value, schema, schema), "") << name << ": " << out.text;
  }
}

// The tiny model calls no tool by itself: a grammar makes it write a call in each router's
// format (tool_choice auto), which that router's parser turns into tool_calls.
TEST_F(GrpcApiClusterTest, ToolCallsAreParsedByBothParsers) {
  const std::map<std::string, std::string> grammars = {
      {"hermes",
       R"(root ::= "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"" [a-zA-Z]{1,8} "\"}}\n</tool_call>")"},
      {"llama3_json", R"(root ::= "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"" [a-zA-Z]{1,8} "\"}}")"},
  };
  for (const auto& [parser, grammar] : grammars) {
    v1::GenerateRequest request = ChatRequest("What is the weather in Paris?", 96);
    v1::Tool* tool = request.mutable_chat()->add_tools();
    tool->set_name("get_weather");
    tool->set_description("Weather in a city.");
    tool->set_parameters(R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
    request.mutable_chat()->mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_AUTO);
    request.mutable_sampling()->mutable_structured_output()->set_grammar(grammar);
    Result got = Generate(parser == "hermes" ? cluster_->router() : *llama3_stub_, request);
    ASSERT_TRUE(got.status.ok()) << parser << ": " << got.status.error_message();
    const Completion& c = got.completions[0];
    EXPECT_EQ(c.finish_reason, "tool_calls") << parser << ": " << c.text;
    EXPECT_EQ(c.finish_reason_code, v1::FINISH_REASON_TOOL_CALLS) << parser;
    EXPECT_EQ(c.content, "") << parser;
    ASSERT_EQ(c.tool_calls.size(), 1u) << parser << ": " << c.text;
    EXPECT_EQ(c.tool_calls[0].name(), "get_weather");
    EXPECT_EQ(c.tool_calls[0].id().rfind("chatcmpl-tool-", 0), 0u) << c.tool_calls[0].id();
    const json arguments = json::parse(c.tool_calls[0].arguments(), nullptr, false);
    ASSERT_TRUE(arguments.is_object()) << parser << ": " << c.tool_calls[0].arguments();
    EXPECT_TRUE(arguments["city"].is_string()) << arguments.dump();
  }
}

// n = 2: both completions stream, told apart by index, completion i sampled with seed + i (so
// each equals a request of one with that seed).
TEST_F(GrpcApiClusterTest, NTwoCompletionsEachEqualTheirSeedsSingleRequest) {
  v1::GenerateRequest request = ChatRequest("Tell me a story.", 12);
  request.set_request_id("two");
  request.set_n(2);
  request.mutable_sampling()->set_temperature(1.0f);
  request.mutable_sampling()->set_seed(7);
  Result got = Generate(cluster_->router(), request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.metadata_request_id, "two");
  ASSERT_EQ(got.completions.size(), 2u);
  for (int index = 0; index < 2; ++index) {
    const Completion& c = got.completions[index];
    EXPECT_EQ(c.finished_messages, 1) << index;
    EXPECT_NE(c.finish_reason_code, v1::FINISH_REASON_UNSPECIFIED) << index;
    v1::GenerateRequest one = request;
    one.clear_n();
    one.clear_request_id();
    one.mutable_sampling()->set_seed(7 + uint64_t(index));
    Result single = Generate(cluster_->router(), one);
    ASSERT_TRUE(single.status.ok()) << single.status.error_message();
    EXPECT_EQ(c.token_ids, single.completions[0].token_ids) << index;
  }
  EXPECT_NE(got.completions[0].token_ids, got.completions[1].token_ids);  // different seeds, different samples
}

// The main router's tokens of `text` as a plain prompt (no special tokens), as a chat prompt is
// tokenized.
std::vector<int32_t> PlainTokens(int http_port, const std::string& text) {
  return HttpPost(http_port, "/tokenize", {{"prompt", text}, {"add_special_tokens", false}})["tokens"]
      .get<std::vector<int32_t>>();
}

// --chat-template replaces the model's template for gRPC and HTTP chats alike, and
// chat_template_kwargs reach it as variables.
TEST_F(GrpcApiClusterTest, ChatTemplateFlagAndTemplateKwargsShapeThePrompt) {
  v1::GenerateRequest request = ChatRequest("hi", 4);
  Result got = Generate(*custom_stub_, request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.completions[0].prompt_token_ids,
            PlainTokens(cluster_->http_port(), "<system>You are a helpful assistant.<user>hi"));

  request.mutable_chat()->set_chat_template_kwargs(R"({"suffix": " Answer:"})");
  got = Generate(*custom_stub_, request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  const std::vector<int32_t> with_suffix =
      PlainTokens(cluster_->http_port(), "<system>You are a helpful assistant.<user>hi Answer:");
  EXPECT_EQ(got.completions[0].prompt_token_ids, with_suffix);
  const json messages = json::array({{{"role", "system"}, {"content", "You are a helpful assistant."}},
                                     {{"role", "user"}, {"content", "hi"}}});
  const json http = HttpPost(std::stoi(custom_http_port_), "/tokenize",
                             {{"messages", messages}, {"chat_template_kwargs", {{"suffix", " Answer:"}}}});
  EXPECT_EQ(http["tokens"].get<std::vector<int32_t>>(), with_suffix);

  // The main router renders the model's own template: not this prompt.
  got = Generate(cluster_->router(), request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_NE(got.completions[0].prompt_token_ids, with_suffix);

  request.mutable_chat()->set_chat_template_kwargs("[1]");
  got = Generate(*custom_stub_, request);
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(got.status.error_message().find("chat_template_kwargs"), std::string::npos) << got.status.error_message();
}

// A gRPC chat without max_tokens runs to the end of the context (HTTP chat completions' default),
// not 16 tokens.
TEST_F(GrpcApiClusterTest, ChatWithoutMaxTokensRunsToTheContextLimit) {
  v1::GenerateRequest request = ChatRequest("hi", 1);
  request.mutable_sampling()->clear_max_tokens();
  request.mutable_sampling()->set_ignore_eos(true);
  Result got = Generate(*custom_stub_, request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  const Completion& c = got.completions[0];
  EXPECT_EQ(c.finish_reason, "length");
  EXPECT_GT(c.token_ids.size(), 16u);
  EXPECT_EQ(c.prompt_token_ids.size() + c.token_ids.size(), size_t(kCustomRouterMaxModelLen));
}

// A --chat-template that does not parse, or names no file, stops `duet router` and `duet serve`
// at start-up with the reason.
TEST(ChatTemplateFlagTest, BadTemplatesFailStartUp) {
  const std::string dir = testing::MakeTempDir("chat-template-flag");
  const std::string model = DUET_MODELS_DIR "/tiny-code-llama";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {absl::StrCat(testing::DuetBinary(), " router --model ", model,
                    " --port 0 --decode 127.0.0.1:1 --prefill 127.0.0.1:1 --chat-template '{% if %}'"),
       "--chat-template: "},
      {absl::StrCat(testing::DuetBinary(), " serve --model ", model, " --grpc-port 0 --http-port -1 --chat-template ",
                    dir, "/missing.jinja"),
       "looks like a file path"},
  };
  for (const auto& [command, reason] : cases) {
    EXPECT_NE(testing::RunCommand(command, dir + "/err.txt"), 0) << command;
    EXPECT_NE(testing::ReadText(dir + "/err.txt").find(reason), std::string::npos) << testing::ReadText(dir + "/err.txt");
  }
}

// `duet complete --chat` (the gRPC client users run) prints the same answer.
TEST_F(GrpcApiClusterTest, DuetCompleteChatPrintsTheChatAnswer) {
  v1::GenerateRequest request = ChatRequest("Write a Python function that adds two numbers.", 16);
  Result got = Generate(cluster_->router(), request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  const std::string dir = testing::MakeTempDir("duet-complete-chat");
  ASSERT_EQ(testing::RunCommand(absl::StrCat(testing::DuetBinary(), " complete --address 127.0.0.1:",
                                             cluster_->router_port(),
                                             " --chat --system 'You are a helpful assistant.' --prompt 'Write a Python "
                                             "function that adds two numbers.' --max-tokens 16 > ",
                                             dir, "/out.txt"),
                                dir + "/err.txt"),
            0)
      << testing::ReadText(dir + "/err.txt");
  EXPECT_EQ(testing::ReadText(dir + "/out.txt"), got.completions[0].text);
  EXPECT_NE(testing::ReadText(dir + "/err.txt").find("finish_reason=" + got.completions[0].finish_reason),
            std::string::npos)
      << testing::ReadText(dir + "/err.txt");
}

}  // namespace
}  // namespace duet
