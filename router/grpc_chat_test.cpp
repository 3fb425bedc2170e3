#include "router/grpc_chat.h"

#include <memory>
#include <string>
#include <vector>

#include "frontend/chat_template/chat_template.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace duet::router {
namespace {

using ::testing::HasSubstr;
using openai::Json;

v1::ChatMessage Message(const std::string& role, const std::string& content) {
  v1::ChatMessage m;
  m.set_role(role);
  m.set_content(content);
  return m;
}

v1::Tool WeatherTool() {
  v1::Tool tool;
  tool.set_name("get_weather");
  tool.set_description("Weather in a city.");
  tool.set_parameters(R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");
  return tool;
}

TEST(ChatRequestJsonTest, MessagesToolsAndChoiceInTheOpenAiShape) {
  v1::Chat chat;
  *chat.add_messages() = Message("user", "Weather in Paris?");
  v1::ChatMessage* assistant = chat.add_messages();
  assistant->set_role("assistant");  // no content: only a call
  v1::ToolCall* call = assistant->add_tool_calls();
  call->set_id("call-1");
  call->set_name("get_weather");
  call->set_arguments(R"({"city":"Paris"})");
  v1::ChatMessage tool_result = Message("tool", "21 C");
  tool_result.set_tool_call_id("call-1");
  *chat.add_messages() = tool_result;
  *chat.add_tools() = WeatherTool();
  chat.mutable_tool_choice()->set_function_name("get_weather");
  chat.set_parallel_tool_calls(false);
  chat.set_add_generation_prompt(false);
  chat.set_chat_template_kwargs(R"({"enable_thinking": false, "style": {"tone": "dry"}})");

  absl::StatusOr<Json> j = ChatRequestJson(chat);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["messages"][0], Json({{"role", "user"}, {"content", "Weather in Paris?"}}));
  EXPECT_TRUE((*j)["messages"][1]["content"].is_null());
  EXPECT_EQ((*j)["messages"][1]["tool_calls"][0],
            Json({{"id", "call-1"},
                  {"type", "function"},
                  {"function", {{"name", "get_weather"}, {"arguments", R"({"city":"Paris"})"}}}}));
  EXPECT_EQ((*j)["messages"][2]["tool_call_id"], "call-1");
  EXPECT_EQ((*j)["tools"][0]["type"], "function");
  EXPECT_EQ((*j)["tools"][0]["function"]["name"], "get_weather");
  EXPECT_EQ((*j)["tools"][0]["function"]["description"], "Weather in a city.");
  EXPECT_EQ((*j)["tools"][0]["function"]["parameters"]["required"], Json::array({"city"}));
  EXPECT_EQ((*j)["tool_choice"], Json({{"type", "function"}, {"function", {{"name", "get_weather"}}}}));
  EXPECT_EQ((*j)["parallel_tool_calls"], false);
  EXPECT_EQ((*j)["add_generation_prompt"], false);
  EXPECT_EQ((*j)["chat_template_kwargs"], Json({{"enable_thinking", false}, {"style", {{"tone", "dry"}}}}));
}

TEST(ChatRequestJsonTest, ToolChoiceModes) {
  v1::Chat chat;
  *chat.add_messages() = Message("user", "hi");
  EXPECT_FALSE(ChatRequestJson(chat)->contains("tool_choice"));  // unset: OpenAI's default
  const std::vector<std::pair<v1::ToolChoice::Mode, Json>> modes = {
      {v1::ToolChoice::MODE_NONE, "none"}, {v1::ToolChoice::MODE_AUTO, "auto"},
      {v1::ToolChoice::MODE_REQUIRED, "required"}};
  for (const auto& [mode, expected] : modes) {
    chat.mutable_tool_choice()->set_mode(mode);
    EXPECT_EQ((*ChatRequestJson(chat))["tool_choice"], expected);
  }
  chat.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_UNSPECIFIED);
  EXPECT_FALSE(ChatRequestJson(chat)->contains("tool_choice"));
}

TEST(ChatRequestJsonTest, InvalidFieldsAreNamed) {
  auto error = [](const v1::Chat& chat) {
    absl::StatusOr<Json> j = ChatRequestJson(chat);
    EXPECT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(j.status().message());
  };
  v1::Chat chat;
  *chat.add_messages() = Message("", "hi");
  EXPECT_THAT(error(chat), HasSubstr("chat.messages[0].role is required"));

  chat.mutable_messages(0)->set_role("assistant");
  chat.mutable_messages(0)->add_tool_calls()->set_name("f");
  chat.mutable_messages(0)->mutable_tool_calls(0)->set_arguments("{not json");
  EXPECT_THAT(error(chat), HasSubstr("chat.messages[0].tool_calls[0].arguments is not valid JSON"));
  chat.mutable_messages(0)->mutable_tool_calls(0)->set_arguments(std::string(200, '[') + std::string(200, ']'));
  EXPECT_THAT(error(chat), HasSubstr("is not valid JSON"));  // nested too deep to parse safely
  chat.mutable_messages(0)->mutable_tool_calls(0)->clear_name();
  chat.mutable_messages(0)->mutable_tool_calls(0)->clear_arguments();
  EXPECT_THAT(error(chat), HasSubstr("chat.messages[0].tool_calls[0].name is required"));

  chat.Clear();
  *chat.add_messages() = Message("user", "hi");
  v1::Tool* tool = chat.add_tools();
  EXPECT_THAT(error(chat), HasSubstr("chat.tools[0].name is required"));
  tool->set_name("f");
  tool->set_parameters("[1, 2]");
  EXPECT_THAT(error(chat), HasSubstr("chat.tools[0].parameters must be a JSON schema"));
  tool->clear_parameters();
  chat.mutable_tool_choice()->set_function_name("");
  EXPECT_THAT(error(chat), HasSubstr("chat.tool_choice.function_name must not be empty"));
  chat.mutable_tool_choice()->set_mode(static_cast<v1::ToolChoice::Mode>(9));
  EXPECT_THAT(error(chat), HasSubstr("chat.tool_choice.mode 9 is not a known mode"));

  chat.clear_tool_choice();
  for (const char* kwargs : {"[1]", "{not json", "\"x\""}) {
    chat.set_chat_template_kwargs(kwargs);
    EXPECT_THAT(error(chat), HasSubstr("chat.chat_template_kwargs must be a JSON object")) << kwargs;
  }
}

class PrepareChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromModelDir(DUET_MODELS_DIR "/tiny-code-llama");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    absl::StatusOr<LoadedChatTemplate> chat = LoadChatTemplate(DUET_MODELS_DIR "/tiny-code-llama");
    ASSERT_TRUE(chat.ok()) << chat.status();
    chat_ = std::make_unique<LoadedChatTemplate>(*std::move(chat));
    context_.tokenizer = tokenizer_.get();
    context_.chat = chat_.get();
    context_.max_model_len = 2048;
  }
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LoadedChatTemplate> chat_;
  openai::ProtocolContext context_;
};

TEST_F(PrepareChatTest, RendersTokenizesAndForcesCalls) {
  v1::Chat chat;
  *chat.add_messages() = Message("system", "Be brief.");
  *chat.add_messages() = Message("user", "Hello");
  v1::SamplingOptions sampling;
  absl::StatusOr<openai::ChatInput> input = PrepareChat(chat, context_, &sampling);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->prompt_token_ids,
            tokenizer_->Encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                               "<|im_start|>assistant\n",
                               /*add_special_tokens=*/false));
  EXPECT_EQ(input->tools.choice, openai::ToolChoice::kNone);
  EXPECT_FALSE(sampling.has_structured_output());

  *chat.add_tools() = WeatherTool();
  chat.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_REQUIRED);
  input = PrepareChat(chat, context_, &sampling);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->tools.choice, openai::ToolChoice::kRequired);
  EXPECT_THAT(sampling.structured_output().json_schema(), HasSubstr("get_weather"));  // the forced calls' schema
}

// As HTTP chat completions: no max_tokens is what is left of the context; a set one stays.
TEST_F(PrepareChatTest, MaxTokensDefaultsToTheRestOfTheContext) {
  v1::Chat chat;
  *chat.add_messages() = Message("user", "Hello");
  v1::SamplingOptions sampling;
  absl::StatusOr<openai::ChatInput> input = PrepareChat(chat, context_, &sampling);
  ASSERT_TRUE(input.ok()) << input.status();
  ASSERT_TRUE(sampling.has_max_tokens());
  EXPECT_EQ(sampling.max_tokens(), 2048 - static_cast<int>(input->prompt_token_ids.size()));
  sampling.set_max_tokens(5);
  ASSERT_TRUE(PrepareChat(chat, context_, &sampling).ok());
  EXPECT_EQ(sampling.max_tokens(), 5);
  context_.max_model_len = 3;  // shorter than the prompt: 1, which the router's length check refuses
  sampling.clear_max_tokens();
  ASSERT_TRUE(PrepareChat(chat, context_, &sampling).ok());
  EXPECT_EQ(sampling.max_tokens(), 1);
}

// chat_template_kwargs reach the template as variables (messages cannot be replaced).
TEST_F(PrepareChatTest, TemplateKwargsAreTemplateVariables) {
  absl::StatusOr<LoadedChatTemplate> custom = LoadChatTemplate(
      DUET_MODELS_DIR "/tiny-code-llama", "{{ greeting }} {% for m in messages %}{{ m['content'] }}{% endfor %}");
  ASSERT_TRUE(custom.ok()) << custom.status();
  context_.chat = &*custom;
  v1::Chat chat;
  *chat.add_messages() = Message("user", "Hello");
  chat.set_chat_template_kwargs(R"({"greeting": "Ahoy", "messages": []})");
  v1::SamplingOptions sampling;
  absl::StatusOr<openai::ChatInput> input = PrepareChat(chat, context_, &sampling);
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ(input->prompt_token_ids, tokenizer_->Encode("Ahoy Hello", /*add_special_tokens=*/false));
}

TEST_F(PrepareChatTest, ErrorsAreInvalidArgumentPrefixedWithChat) {
  v1::Chat chat;
  v1::SamplingOptions sampling;
  absl::Status status = PrepareChat(chat, context_, &sampling).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "chat: 'messages' is an empty list");

  *chat.add_messages() = Message("user", "hi");
  *chat.add_tools() = WeatherTool();
  chat.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_AUTO);
  status = PrepareChat(chat, context_, &sampling).status();
  EXPECT_THAT(status.message(), HasSubstr("--enable-auto-tool-choice"));

  chat.mutable_tool_choice()->set_function_name("nope");
  EXPECT_THAT(PrepareChat(chat, context_, &sampling).status().message(), HasSubstr("'nope'"));

  chat.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_REQUIRED);
  sampling.mutable_structured_output()->set_json_object(true);
  EXPECT_THAT(PrepareChat(chat, context_, &sampling).status().message(), HasSubstr("cannot be combined"));

  sampling.clear_structured_output();
  context_.chat = nullptr;
  EXPECT_EQ(PrepareChat(chat, context_, &sampling).status().message(), "chat: this model has no chat template");
}

v1::GenerateResponse Piece(const std::string& text, const std::string& finish_reason = "") {
  v1::GenerateResponse m;
  m.set_text(text);
  if (!finish_reason.empty()) {
    m.set_finished(true);
    m.set_finish_reason(finish_reason);
  }
  return m;
}

TEST(ResponseAnnotatorTest, FinishReasonAsEnumAndNothingElseWithoutTools) {
  ResponseAnnotator annotator{openai::ToolCalling{}};
  v1::GenerateResponse m = Piece("<tool_call>");
  m.set_content("from a worker");  // the router's fields, cleared
  m.set_index(3);
  m.add_tool_calls()->set_name("x");
  annotator.Annotate(&m);
  EXPECT_EQ(m.text(), "<tool_call>");
  EXPECT_EQ(m.content(), "");
  EXPECT_EQ(m.index(), 0);
  EXPECT_EQ(m.tool_calls_size(), 0);
  EXPECT_EQ(m.finish_reason_code(), v1::FINISH_REASON_UNSPECIFIED);
  for (const auto& [name, code] : std::vector<std::pair<std::string, v1::FinishReason>>{
           {"stop", v1::FINISH_REASON_STOP}, {"length", v1::FINISH_REASON_LENGTH}, {"abort", v1::FINISH_REASON_ABORT}}) {
    m = Piece("", name);
    annotator.Annotate(&m);
    EXPECT_EQ(m.finish_reason(), name);
    EXPECT_EQ(m.finish_reason_code(), code) << name;
  }
}

TEST(ResponseAnnotatorTest, HermesCallsBecomeDeltasThenCallsWithFinishReasonToolCalls) {
  openai::ToolCalling tools;
  tools.choice = openai::ToolChoice::kAuto;
  tools.format = openai::ToolCallFormat::kHermes;
  ResponseAnnotator annotator(tools, [] { return std::string("call-id"); });
  std::vector<v1::GenerateResponse> out = {Piece("Checking. <tool_"), Piece("call>\n{\"name\": \"get_weather\", "),
                                           Piece("\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>", "stop")};
  std::string content;
  std::vector<v1::ToolCallDelta> deltas;
  for (v1::GenerateResponse& m : out) {
    annotator.Annotate(&m);
    content += m.content();
    deltas.insert(deltas.end(), m.tool_call_deltas().begin(), m.tool_call_deltas().end());
  }
  EXPECT_EQ(out[0].text(), "Checking. <tool_");  // the raw text is kept
  EXPECT_EQ(content, "Checking.");
  ASSERT_EQ(deltas.size(), 1u);
  EXPECT_EQ(deltas[0].index(), 0);
  EXPECT_EQ(deltas[0].id(), "call-id");
  EXPECT_EQ(deltas[0].name(), "get_weather");
  EXPECT_EQ(Json::parse(deltas[0].arguments()), Json({{"city", "Paris"}}));
  const v1::GenerateResponse& last = out.back();
  ASSERT_EQ(last.tool_calls_size(), 1);
  EXPECT_EQ(last.tool_calls(0).id(), "call-id");
  EXPECT_EQ(last.tool_calls(0).name(), "get_weather");
  EXPECT_EQ(last.tool_calls(0).arguments(), deltas[0].arguments());
  EXPECT_EQ(last.finish_reason(), "tool_calls");
  EXPECT_EQ(last.finish_reason_code(), v1::FINISH_REASON_TOOL_CALLS);
  EXPECT_EQ(out[0].tool_calls_size(), 0);  // the whole calls come on the last message only
}

TEST(ResponseAnnotatorTest, HeldBackTextIsContentOnTheLastMessageAndLengthStaysLength) {
  openai::ToolCalling tools;
  tools.choice = openai::ToolChoice::kAuto;
  tools.format = openai::ToolCallFormat::kHermes;
  ResponseAnnotator annotator(tools);
  v1::GenerateResponse first = Piece("a <tool_ca");
  annotator.Annotate(&first);
  EXPECT_EQ(first.content(), "a");  // "<tool_ca" may still be a call
  v1::GenerateResponse last = Piece("", "length");
  annotator.Annotate(&last);
  EXPECT_EQ(last.content(), " <tool_ca");
  EXPECT_EQ(last.finish_reason(), "length");
  EXPECT_EQ(last.finish_reason_code(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(last.tool_calls_size(), 0);
}

TEST(ResponseAnnotatorTest, NamedFunctionArgumentsStream) {
  openai::ToolCalling tools;
  tools.choice = openai::ToolChoice::kNamed;
  tools.name = "get_weather";
  ResponseAnnotator annotator(tools);
  v1::GenerateResponse a = Piece("{\"city\": ");
  v1::GenerateResponse b = Piece("\"Paris\"}", "stop");
  annotator.Annotate(&a);
  annotator.Annotate(&b);
  ASSERT_EQ(a.tool_call_deltas_size(), 1);
  EXPECT_EQ(a.tool_call_deltas(0).name(), "get_weather");
  EXPECT_FALSE(a.tool_call_deltas(0).id().empty());
  ASSERT_EQ(b.tool_call_deltas_size(), 1);
  EXPECT_EQ(b.tool_call_deltas(0).id(), "");  // a later piece: arguments only
  EXPECT_EQ(a.tool_call_deltas(0).arguments() + b.tool_call_deltas(0).arguments(), "{\"city\": \"Paris\"}");
  ASSERT_EQ(b.tool_calls_size(), 1);
  EXPECT_EQ(b.tool_calls(0).arguments(), "{\"city\": \"Paris\"}");
  EXPECT_EQ(b.finish_reason_code(), v1::FINISH_REASON_TOOL_CALLS);
}

}  // namespace
}  // namespace duet::router
