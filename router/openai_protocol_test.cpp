#include "router/openai_protocol.h"

#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <sstream>

#include "frontend/chat_template/chat_template.h"
#include "frontend/tokenizer/tokenizer.h"
#include "absl/strings/str_cat.h"
#include "rpc/rpc_util.h"

namespace duet::router::openai {
namespace {

class ProtocolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tokenizer = Tokenizer::FromModelDir(DUET_MODELS_DIR "/tiny-code-llama");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = *std::move(tokenizer);
    auto chat = LoadChatTemplate(DUET_MODELS_DIR "/tiny-code-llama");
    ASSERT_TRUE(chat.ok()) << chat.status();
    chat_ = std::make_unique<LoadedChatTemplate>(*std::move(chat));
    context_.model_name = "tiny";
    context_.tokenizer = tokenizer_.get();
    context_.chat = chat_.get();
    context_.max_model_len = 2048;
  }
  ParsedRequest Completion(const std::string& body) {
    absl::StatusOr<ParsedRequest> r = ParseCompletionRequest(body, context_);
    if (!r.ok()) ADD_FAILURE() << body << " → " << r.status().message();
    return r.ok() ? *r : ParsedRequest{};
  }
  ApiError CompletionError(const std::string& body) {
    absl::StatusOr<ParsedRequest> r = ParseCompletionRequest(body, context_);
    if (r.ok()) ADD_FAILURE() << body << " was accepted";
    return r.ok() ? ApiError{} : ToApiError(r.status());
  }
  ApiError ChatError(const std::string& body) {
    absl::StatusOr<ParsedRequest> r = ParseChatRequest(body, context_);
    if (r.ok()) ADD_FAILURE() << body << " was accepted";
    return r.ok() ? ApiError{} : ToApiError(r.status());
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LoadedChatTemplate> chat_;
  ProtocolContext context_;
};

TEST_F(ProtocolTest, CompletionFields) {
  ParsedRequest r = Completion(R"({"model":"tiny","prompt":"hi","max_tokens":5,"temperature":0,"top_p":0.5,
    "top_k":7,"min_p":0.1,"n":3,"stop":["a","b"],"stop_token_ids":[2],"seed":42,"presence_penalty":0.5,
    "frequency_penalty":-0.5,"repetition_penalty":1.2,"logprobs":3,"ignore_eos":true,"user":"u",
    "stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_TRUE(r.prompts[0].is_text);
  EXPECT_EQ(r.prompts[0].text, "hi");
  EXPECT_EQ(r.sampling.max_tokens(), 5);
  EXPECT_EQ(r.sampling.temperature(), 0.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p(), 0.5f);
  EXPECT_EQ(r.sampling.top_k(), 7);
  EXPECT_FLOAT_EQ(r.sampling.min_p(), 0.1f);
  EXPECT_EQ(r.n, 3);
  ASSERT_EQ(r.sampling.stop_size(), 2);
  EXPECT_EQ(r.sampling.stop(1), "b");
  EXPECT_EQ(r.sampling.stop_token_ids(0), 2);
  EXPECT_EQ(r.seed, 42u);
  EXPECT_FALSE(r.sampling.has_seed());  // per choice: seed + i
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty(), -0.5f);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty(), 1.2f);
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_EQ(r.sampling.logprobs(), 3);
  EXPECT_FALSE(r.echo);
  EXPECT_TRUE(Completion(R"({"prompt":"hi","echo":true})").echo);
  EXPECT_TRUE(r.sampling.ignore_eos());
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST_F(ProtocolTest, PromptForms) {
  EXPECT_EQ(Completion(R"({"prompt":["a","b"]})").prompts.size(), 2u);
  ParsedRequest ids = Completion(R"({"prompt":[1,2,3]})");
  ASSERT_EQ(ids.prompts.size(), 1u);
  EXPECT_FALSE(ids.prompts[0].is_text);
  EXPECT_EQ(ids.prompts[0].token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(Completion(R"({"prompt":[[1,2],[3]]})").prompts.size(), 2u);
  EXPECT_EQ(Completion(R"({"prompt":"x","max_completion_tokens":9})").sampling.max_tokens(), 9);
  EXPECT_FALSE(Completion(R"({"prompt":"x"})").sampling.has_max_tokens());  // the engine default, 16
  EXPECT_EQ(Completion(R"({"prompt":"x","max_tokens":3.0})").sampling.max_tokens(), 3);
}

TEST_F(ProtocolTest, CompletionErrors) {
  struct Case {
    const char* body;
    int status;
    const char* param;  // "" for none
  };
  const Case cases[] = {
      {"not json", 400, ""},
      {"[1,2]", 400, ""},
      {R"({"model":"tiny"})", 400, "prompt"},
      {R"({"prompt":5})", 400, "prompt"},
      {R"({"prompt":[]})", 400, "prompt"},
      {R"({"prompt":["a",1]})", 400, "prompt"},
      {R"({"prompt":[1,"a"]})", 400, "prompt"},
      {R"({"prompt":[[1],[]]})", 400, "prompt"},
      {R"({"prompt":[99999999999]})", 400, "prompt"},
      {R"({"prompt":"x","max_tokens":0})", 400, "max_tokens"},
      {R"({"prompt":"x","max_tokens":-1})", 400, "max_tokens"},
      {R"({"prompt":"x","max_tokens":"5"})", 400, "max_tokens"},
      {R"({"prompt":"x","max_tokens":1.5})", 400, "max_tokens"},
      {R"({"prompt":"x","max_tokens":1e300})", 400, "max_tokens"},
      {R"({"prompt":"x","temperature":"hot"})", 400, "temperature"},
      {R"({"prompt":"x","temperature":-1})", 400, ""},
      {R"({"prompt":"x","top_p":0})", 400, ""},
      {R"({"prompt":"x","top_p":1.5})", 400, ""},
      {R"({"prompt":"x","top_k":-2})", 400, "top_k"},
      {R"({"prompt":"x","min_p":2})", 400, ""},
      {R"({"prompt":"x","presence_penalty":5})", 400, ""},
      {R"({"prompt":"x","frequency_penalty":-5})", 400, ""},
      {R"({"prompt":"x","repetition_penalty":0})", 400, ""},
      {R"({"prompt":"x","n":0})", 400, "n"},
      {R"({"prompt":"x","n":100000})", 400, "n"},
      {R"({"prompt":"x","n":true})", 400, "n"},
      {R"({"prompt":"x","stop":5})", 400, "stop"},
      {R"({"prompt":"x","stop":["a",5]})", 400, "stop"},
      {R"({"prompt":"x","stop_token_ids":"a"})", 400, "stop_token_ids"},
      {R"({"prompt":"x","seed":"s"})", 400, "seed"},
      {R"({"prompt":"x","logprobs":true})", 400, "logprobs"},
      {R"({"prompt":"x","logprobs":21})", 400, "logprobs"},
      {R"({"prompt":"x","logprobs":-1})", 400, "logprobs"},
      {R"({"prompt":"x","echo":"yes"})", 400, "echo"},
      {R"({"prompt":"x","prompt_logprobs":21})", 400, "prompt_logprobs"},
      {R"({"prompt":"x","prompt_logprobs":-1})", 400, "prompt_logprobs"},
      {R"({"prompt":"x","prompt_logprobs":true})", 400, "prompt_logprobs"},
      {R"({"prompt":"x","prompt_logprobs":"2"})", 400, "prompt_logprobs"},
      {R"({"prompt":"x","prompt_logprobs":1.5})", 400, "prompt_logprobs"},
      {R"({"prompt":"x","prompt_logprobs":1,"stream":true})", 400, "prompt_logprobs"},
      {R"({"prompt":"x","echo":true,"logprobs":21})", 400, "logprobs"},
      {R"({"prompt":"x","ignore_eos":1})", 400, "ignore_eos"},
      {R"({"prompt":"x","stream":"true"})", 400, "stream"},
      {R"({"prompt":"x","stream_options":{"include_usage":true}})", 400, "stream_options"},
      {R"({"prompt":"x","stream":true,"stream_options":{"include_usage":1}})", 400, "include_usage"},
      {R"({"prompt":"x","user":5})", 400, "user"},
      {R"({"prompt":"x","suffix":"s"})", 400, "suffix"},
      {R"({"prompt":"x","logit_bias":{"x":5}})", 400, "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"-1":5}})", 400, "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"99999999":5}})", 400, "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"1":"5"}})", 400, "logit_bias"},
      {R"({"prompt":"x","logit_bias":[1]})", 400, "logit_bias"},
      {R"({"prompt":"x","cache_salt":""})", 400, "cache_salt"},
      {R"({"prompt":"x","cache_salt":5})", 400, "cache_salt"},
      {R"({"prompt":"x","include_stop_str_in_output":"yes"})", 400, "include_stop_str_in_output"},
      {R"({"prompt":"x","model":5})", 400, "model"},
      {R"({"prompt":"x","model":"gpt-4"})", 404, "model"},
  };
  for (const Case& c : cases) {
    ApiError e = CompletionError(c.body);
    EXPECT_EQ(e.status, c.status) << c.body;
    EXPECT_EQ(e.param.value_or(""), c.param) << c.body;
    EXPECT_FALSE(e.message.empty()) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
  }
  EXPECT_EQ(CompletionError(R"({"prompt":"x","model":"gpt-4"})").code, "model_not_found");
  // Deep nesting is refused before parsing.
  EXPECT_EQ(CompletionError(std::string(100000, '[') + std::string(100000, ']')).status, 400);
}

TEST_F(ProtocolTest, StructuredOutputsTravelInTheSamplingOptions) {
  ParsedRequest r = Completion(R"({"prompt":"x","guided_regex":"[0-9]+"})");
  EXPECT_EQ(r.sampling.structured_output().regex(), "[0-9]+");
  r = Completion(R"({"prompt":"x","guided_choice":["yes","no"]})");
  ASSERT_EQ(r.sampling.structured_output().choice().choices_size(), 2);
  EXPECT_EQ(r.sampling.structured_output().choice().choices(1), "no");
  r = Completion(R"({"prompt":"x","guided_json":{"type":"object","properties":{"a":{"type":"integer"}}}})");
  EXPECT_EQ(r.sampling.structured_output().json_schema(), R"({"type":"object","properties":{"a":{"type":"integer"}}})");
  r = Completion(R"({"prompt":"x","guided_json":"{\"type\": \"string\"}"})");
  EXPECT_EQ(r.sampling.structured_output().json_schema(), R"({"type": "string"})");
  r = Completion(R"({"prompt":"x","guided_grammar":"root ::= \"a\"+"})");
  EXPECT_EQ(r.sampling.structured_output().grammar(), R"(root ::= "a"+)");
  r = Completion(R"({"prompt":"x","structured_outputs":{"regex":"a|b"}})");
  EXPECT_EQ(r.sampling.structured_output().regex(), "a|b");
  r = Completion(R"({"prompt":"x","response_format":{"type":"text"}})");
  EXPECT_FALSE(r.sampling.has_structured_output());
  absl::StatusOr<ParsedRequest> chat =
      ParseChatRequest(R"({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}})", context_);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_TRUE(chat->sampling.structured_output().json_object());
  chat = ParseChatRequest(R"({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_schema",
      "json_schema":{"name":"x","strict":true,"schema":{"type":"array","items":{"type":"boolean"}}}}})", context_);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->sampling.structured_output().json_schema(), R"({"type":"array","items":{"type":"boolean"}})");
  // It survives the conversion the router and workers make.
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(chat->sampling);
  ASSERT_TRUE(params.ok());
  EXPECT_EQ(params->structured_output.kind, grammar::StructuredOutput::Kind::kJsonSchema);
  EXPECT_EQ(rpc::ToSamplingOptions(*params).structured_output().json_schema(),
            chat->sampling.structured_output().json_schema());
}

TEST_F(ProtocolTest, BadStructuredOutputsAndToolCallsAre400NamingTheField) {
  struct Case {
    const char* extra;
    const char* param;
  };
  const Case cases[] = {
      {R"("guided_regex":"(a")", "guided_regex"},
      {R"("guided_regex":5)", "guided_regex"},
      {R"("guided_choice":[])", "guided_choice"},
      {R"("guided_choice":["a",1])", "guided_choice"},
      {R"("guided_json":{"type":"integer","multipleOf":2})", "guided_json"},
      {R"("guided_json":"{bad")", "guided_json"},
      {R"("guided_grammar":"root ::= undefined")", "guided_grammar"},
      {R"("guided_whitespace_pattern":" ")", "guided_whitespace_pattern"},
      {R"("response_format":{"type":"json_schema"})", "response_format"},
      {R"("response_format":{"type":"json_schema","json_schema":{"name":"x"}})", "response_format"},
      {R"("response_format":{"type":"structural_tag"})", "response_format"},
      {R"("response_format":"json")", "response_format"},
      {R"("guided_regex":"a","guided_choice":["b"])", "guided_choice"},
      {R"("response_format":{"type":"json_object"},"guided_regex":"a")", "guided_regex"},
      {R"("structured_outputs":{"whitespace_pattern":"x"})", "structured_outputs.whitespace_pattern"},
      {R"("tool_choice":"required")", "tool_choice"},
      {R"("tool_choice":{"type":"function","function":{"name":"f"}})", "tool_choice"},
      {R"("functions":[{"name":"f"}])", "functions"},
      {R"("function_call":"auto")", "function_call"},
  };
  for (const Case& c : cases) {
    const std::string chat = absl::StrCat(R"({"messages":[{"role":"user","content":"hi"}],)", c.extra, "}");
    ApiError e = ChatError(chat);
    EXPECT_EQ(e.status, 400) << chat;
    EXPECT_EQ(e.param.value_or(""), c.param) << chat << " → " << e.message;
    e = CompletionError(absl::StrCat(R"({"prompt":"x",)", c.extra, "}"));
    EXPECT_EQ(e.param.value_or(""), c.param) << c.extra << " → " << e.message;
  }
  // Asking for no tools is not asking for tool calls.
  EXPECT_TRUE(ParseChatRequest(R"({"messages":[{"role":"user","content":"hi"}],"tools":[],"tool_choice":"none"})",
                               context_).ok());
}

constexpr char kWeatherTool[] =
    R"({"type":"function","function":{"name":"get_weather","description":"Weather in a city.",
        "parameters":{"type":"object","properties":{"city":{"type":"string","maxLength":12}},"required":["city"]}}})";

std::string ChatWithTools(const std::string& extra) {
  return absl::StrCat(R"({"messages":[{"role":"user","content":"Weather in Paris?"}],"tools":[)", kWeatherTool,
                      R"(,{"type":"function","function":{"name":"ping"}}])", extra, "}");
}

TEST_F(ProtocolTest, ToolChoiceModes) {
  context_.auto_tool_call_format = ToolCallFormat::kHermes;
  ParsedRequest r = *ParseChatRequest(ChatWithTools(""), context_);  // tools without tool_choice: auto
  EXPECT_EQ(r.tools.choice, ToolChoice::kAuto);
  EXPECT_EQ(r.tools.format, ToolCallFormat::kHermes);
  EXPECT_FALSE(r.sampling.has_structured_output());
  ASSERT_NE(NewToolCallParser(r.tools), nullptr);

  r = *ParseChatRequest(ChatWithTools(R"(,"tool_choice":"none")"), context_);
  EXPECT_EQ(r.tools.choice, ToolChoice::kNone);
  EXPECT_EQ(NewToolCallParser(r.tools), nullptr);
  EXPECT_FALSE(r.sampling.has_structured_output());

  // required: an array of calls to one of the tools, forced by the grammar engine.
  r = *ParseChatRequest(ChatWithTools(R"(,"tool_choice":"required","parallel_tool_calls":false)"), context_);
  EXPECT_EQ(r.tools.choice, ToolChoice::kRequired);
  EXPECT_FALSE(r.tools.parallel);
  const Json required = Json::parse(r.sampling.structured_output().json_schema());
  EXPECT_EQ(required["type"], "array");
  EXPECT_EQ(required["maxItems"], 1);
  EXPECT_EQ(required["items"]["anyOf"][0]["properties"]["name"]["enum"][0], "get_weather");
  EXPECT_EQ(required["items"]["anyOf"][1]["properties"]["name"]["enum"][0], "ping");

  // A named function: its parameters are the schema.
  r = *ParseChatRequest(ChatWithTools(R"(,"tool_choice":{"type":"function","function":{"name":"get_weather"}})"),
                        context_);
  EXPECT_EQ(r.tools.choice, ToolChoice::kNamed);
  EXPECT_EQ(r.tools.name, "get_weather");
  EXPECT_EQ(Json::parse(r.sampling.structured_output().json_schema()),
            Json::parse(kWeatherTool)["function"]["parameters"]);

  // Nothing to call: "required" with an empty list is "none" (as OpenAI and vLLM).
  r = *ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"tools":[],"tool_choice":"required"})", context_);
  EXPECT_EQ(r.tools.choice, ToolChoice::kNone);
}

TEST_F(ProtocolTest, ToolErrorsAre400NamingTheField) {
  // No --enable-auto-tool-choice: "auto" (also implied by tools alone) is refused, as in vLLM.
  ApiError e = ChatError(ChatWithTools(""));
  EXPECT_EQ(e.param, "tool_choice");
  EXPECT_NE(e.message.find("--enable-auto-tool-choice"), std::string::npos) << e.message;
  EXPECT_EQ(ChatError(ChatWithTools(R"(,"tool_choice":"auto")")).param, "tool_choice");
  const struct {
    std::string body;
    const char* param;
  } cases[] = {
      {ChatWithTools(R"(,"tool_choice":"sometimes")"), "tool_choice"},
      {ChatWithTools(R"(,"tool_choice":5)"), "tool_choice"},
      {ChatWithTools(R"(,"tool_choice":{"type":"function"})"), "tool_choice"},
      {ChatWithTools(R"(,"tool_choice":{"type":"function","function":{"name":"nope"}})"), "tool_choice"},
      {ChatWithTools(R"(,"tool_choice":"required","response_format":{"type":"json_object"})"), "tool_choice"},
      {ChatWithTools(R"(,"tool_choice":"required","parallel_tool_calls":"yes")"), "parallel_tool_calls"},
      {R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required"})", "tool_choice"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":5,"tool_choice":"none"})", "tools"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"code_interpreter"}],"tool_choice":"none"})",
       "tools"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{}}],"tool_choice":"none"})",
       "tools"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"function":{"name":"f","parameters":[]}}],"tool_choice":"none"})",
       "tools"},
      // A schema the grammar engine cannot enforce is refused when it is to be enforced.
      {R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required",
          "tools":[{"function":{"name":"f","parameters":{"type":"integer","multipleOf":3}}}]})",
       "tools"},
      // History: an assistant's tool call arguments must be JSON.
      {R"({"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,
          "tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{oops"}}]}]})",
       "messages[1].tool_calls"},
      {R"({"messages":[{"role":"assistant","tool_calls":[{"function":{}}]}]})", "messages[0].tool_calls"},
      {R"({"messages":[{"role":"assistant","tool_calls":{}}]})", "messages[0].tool_calls"},
  };
  for (const auto& c : cases) {
    ApiError error = ChatError(c.body);
    EXPECT_EQ(error.status, 400) << c.body;
    EXPECT_EQ(error.param.value_or(""), c.param) << c.body << " → " << error.message;
  }
  // The same schema with tool_choice "none" is only shown to the template.
  EXPECT_TRUE(ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"none",
      "tools":[{"function":{"name":"f","parameters":{"type":"integer","multipleOf":3}}}]})", context_).ok());
  // Completions have no tools.
  EXPECT_EQ(CompletionError(absl::StrCat(R"({"prompt":"x","tools":[)", kWeatherTool, "]}")).param, "tools");
}

// `tools` reach the template, and a history with tool calls (arguments as JSON strings, as the
// API has them) and tool results renders, with the arguments as objects (as HF and vLLM pass them).
TEST_F(ProtocolTest, ToolsAndToolHistoryRenderThroughTheTemplate) {
  const std::string history = absl::StrCat(
      R"({"messages":[{"role":"user","content":"Weather in Paris?"},
          {"role":"assistant","content":null,"tool_calls":[{"id":"call-1","type":"function",
            "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
          {"role":"tool","tool_call_id":"call-1","content":"21 C"}],"tool_choice":"none","tools":[)",
      kWeatherTool, "]}");
  // The bundled model's template (the fallback): Hermes-style.
  absl::StatusOr<std::string> fallback = RenderChat(Json::parse(history), context_);
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_NE(fallback->find(R"({"type": "function", "function": {"name": "get_weather")"), std::string::npos) << *fallback;
  EXPECT_NE(fallback->find("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                           "\"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>tool\n21 C<|im_end|>\n"),
            std::string::npos)
      << *fallback;
  // Llama 3.1's template: tools in the user turn, the call as JSON, the result as ipython.
  std::ifstream file(std::string(DUET_SOURCE_DIR) + "/tests/chat_template_parity/templates/llama3_1_tools.jinja");
  std::stringstream source;
  source << file.rdbuf();
  absl::StatusOr<ChatTemplate> llama = ChatTemplate::Parse(source.str());
  ASSERT_TRUE(llama.ok()) << llama.status();
  LoadedChatTemplate loaded{*std::move(llama), false, "<|begin_of_text|>", "<|eot_id|>"};
  ProtocolContext context = context_;
  context.chat = &loaded;
  absl::StatusOr<std::string> rendered = RenderChat(Json::parse(history), context);
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_NE(rendered->find(R"("name": "get_weather")"), std::string::npos) << *rendered;
  EXPECT_NE(rendered->find(R"({"name": "get_weather", "parameters": {"city": "Paris"}})"), std::string::npos)
      << *rendered;
  EXPECT_NE(rendered->find("<|start_header_id|>ipython<|end_header_id|>\n\n\"21 C\""), std::string::npos) << *rendered;
}

TEST_F(ProtocolTest, ChatResponseToolCalls) {
  context_.auto_tool_call_format = ToolCallFormat::kHermes;
  ParsedRequest r = *ParseChatRequest(ChatWithTools(""), context_);
  std::vector<ChoiceResult> choices(2);
  choices[0].text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  choices[0].finish_reason = "stop";
  choices[1].index = 1;
  choices[1].text = "<tool_call>{broken</tool_call>";
  choices[1].finish_reason = "stop";
  r.n = 2;
  const Json out = ChatResponse("chatcmpl-t", r, tokenizer_.get(), choices);
  const Json& called = out["choices"][0];
  EXPECT_EQ(called["finish_reason"], "tool_calls");
  EXPECT_EQ(called["message"]["content"], "Checking.");
  ASSERT_EQ(called["message"]["tool_calls"].size(), 1u);
  const Json& call = called["message"]["tool_calls"][0];
  EXPECT_EQ(call["id"].get<std::string>().rfind("chatcmpl-tool-", 0), 0u);
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(call["function"]["arguments"].get<std::string>()), Json::parse(R"({"city":"Paris"})"));
  // Malformed: content as it was, no tool_calls, the engine's finish reason.
  const Json& plain = out["choices"][1];
  EXPECT_EQ(plain["finish_reason"], "stop");
  EXPECT_EQ(plain["message"]["content"], "<tool_call>{broken</tool_call>");
  EXPECT_FALSE(plain["message"].contains("tool_calls"));
  // Only calls: content null. Cut short: "length" stays.
  choices.resize(1);
  choices[0].text = "<tool_call>{\"name\": \"ping\", \"arguments\": {}}</tool_call>";
  r.n = 1;
  EXPECT_TRUE(ChatResponse("c", r, tokenizer_.get(), choices)["choices"][0]["message"]["content"].is_null());
  choices[0].finish_reason = "length";
  EXPECT_EQ(ChatResponse("c", r, tokenizer_.get(), choices)["choices"][0]["finish_reason"], "length");

  // Streaming: a delta opens a call with id, type and name; continuations carry arguments only.
  OutputDelta::Call first{0, "chatcmpl-tool-1", "get_weather", "{\"ci"};
  EXPECT_EQ(ToolCallDeltaJson(first).dump(),
            R"({"index":0,"id":"chatcmpl-tool-1","type":"function","function":{"name":"get_weather","arguments":"{\"ci"}})");
  OutputDelta::Call more{0, std::nullopt, "", "ty\"}"};
  EXPECT_EQ(ToolCallDeltaJson(more).dump(), R"({"index":0,"function":{"arguments":"ty\"}"}})");
  ChunkChoice chunk;
  chunk.tool_calls = {first};
  r.chat = true;
  const Json delta = ChatChunk("c", r, chunk)["choices"][0]["delta"];
  EXPECT_FALSE(delta.contains("content"));
  EXPECT_EQ(delta["tool_calls"][0]["function"]["name"], "get_weather");
}

// vLLM's extra sampling fields: logit_bias (clamped to [-100, 100]), cache_salt (at most 256
// bytes), include_stop_str_in_output; several served names.
TEST_F(ProtocolTest, LogitBiasCacheSaltAndModelAliases) {
  ParsedRequest r = Completion(R"({"prompt":"x","logit_bias":{"5":2.5,"7":-300,"9":1e9},"cache_salt":"tenant-a",
                                   "include_stop_str_in_output":true})");
  EXPECT_EQ(r.sampling.logit_bias().size(), 3u);
  EXPECT_FLOAT_EQ(r.sampling.logit_bias().at(5), 2.5f);
  EXPECT_FLOAT_EQ(r.sampling.logit_bias().at(7), -100.0f);
  EXPECT_FLOAT_EQ(r.sampling.logit_bias().at(9), 100.0f);
  EXPECT_EQ(r.sampling.cache_salt(), "tenant-a");
  EXPECT_TRUE(r.include_stop_str_in_output);
  absl::StatusOr<SamplingParams> params = rpc::ToSamplingParams(r.sampling);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->logit_bias, (std::vector<std::pair<int32_t, float>>{{5, 2.5f}, {7, -100.0f}, {9, 100.0f}}));
  EXPECT_EQ(rpc::ToSamplingOptions(*params).logit_bias().at(7), -100.0f);
  EXPECT_FALSE(Completion(R"({"prompt":"x"})").sampling.has_cache_salt());
  EXPECT_EQ(CompletionError(absl::StrCat(R"({"prompt":"x","cache_salt":")", std::string(257, 's'), "\"}")).param,
            "cache_salt");
  EXPECT_TRUE(ParseCompletionRequest(absl::StrCat(R"({"prompt":"x","cache_salt":")", std::string(256, 's'), "\"}"),
                                     context_).ok());
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":"x"}],"cache_salt":""})").param, "cache_salt");

  context_.model_aliases = {"alias-1", "alias-2"};
  r = Completion(R"({"prompt":"x","model":"alias-2"})");
  EXPECT_EQ(r.model, "tiny");  // responses name the first
  EXPECT_EQ(CompletionError(R"({"prompt":"x","model":"alias-3"})").status, 404);
}

// stop_reason: the stop string (the earliest in the output; of those there, the first listed) or
// the stop token id that ended a "stop"; null for EOS.
TEST_F(ProtocolTest, StopReason) {
  v1::SamplingOptions sampling;
  for (const char* stop : {"world", "o", "lo w"}) sampling.add_stop(stop);
  sampling.add_stop_token_ids(7);
  const std::vector<int32_t> hello = tokenizer_->Encode("hello world", false);
  EXPECT_EQ(StopReason(sampling, tokenizer_.get(), hello), Json("lo w"));  // at 3: the earliest
  sampling.clear_stop();
  for (const char* stop : {"world", "wor"}) sampling.add_stop(stop);
  EXPECT_EQ(StopReason(sampling, tokenizer_.get(), hello), Json("world"));  // both at 6: the first listed
  std::vector<int32_t> with_stop_token = hello;
  with_stop_token.push_back(7);
  EXPECT_EQ(StopReason(sampling, tokenizer_.get(), with_stop_token), Json(7));
  sampling.clear_stop();
  EXPECT_TRUE(StopReason(sampling, tokenizer_.get(), hello).is_null());
  EXPECT_TRUE(StopReason(sampling, tokenizer_.get(), {}).is_null());
}

TEST_F(ProtocolTest, ErrorBodyShape) {
  ApiError e = ToApiError(BadRequest("bad", "n"));
  EXPECT_EQ(ErrorBody(e), R"({"error":{"message":"bad","type":"invalid_request_error","param":"n","code":null}})");
  ApiError nf = ToApiError(NotFound("The model `x` does not exist.", "model_not_found"));
  EXPECT_EQ(nf.status, 404);
  EXPECT_NE(ErrorBody(nf).find(R"("code":"model_not_found")"), std::string::npos);
}

TEST_F(ProtocolTest, GrpcStatusMapping) {
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "x")).status, 400);
  ApiError too_long = FromGrpc(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                            "This model's maximum context length is 2048 tokens."));
  EXPECT_EQ(too_long.code, "context_length_exceeded");
  ApiError busy = FromGrpc(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "full"));
  EXPECT_EQ(busy.status, 429);
  EXPECT_EQ(busy.type, "rate_limit_error");
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::UNAVAILABLE, "x")).status, 503);
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "x")).status, 401);
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::INTERNAL, "x")).status, 500);
}

TEST_F(ProtocolTest, ChatTemplateApplied) {
  absl::StatusOr<ParsedRequest> r = ParseChatRequest(
      R"({"model":"tiny","messages":[{"role":"system","content":"Be brief."},
         {"role":"user","content":[{"type":"text","text":"Hello"},{"type":"text","text":"there"}]}],
         "logprobs":true,"top_logprobs":2})",
      context_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ParsedRequest& p = *r;
  const std::string expected =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello\nthere<|im_end|>\n<|im_start|>assistant\n";
  ASSERT_EQ(p.prompts.size(), 1u);
  EXPECT_FALSE(p.prompts[0].is_text);
  EXPECT_EQ(p.prompts[0].token_ids, tokenizer_->Encode(expected, /*add_special_tokens=*/false));
  EXPECT_EQ(p.logprobs, 2);
  // No max_tokens: what is left of the context.
  EXPECT_EQ(p.sampling.max_tokens(), 2048 - static_cast<int>(p.prompts[0].token_ids.size()));
  absl::StatusOr<std::string> rendered =
      RenderChat(Json::parse(R"({"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false})"),
                 context_);
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  EXPECT_EQ(*rendered, "<|im_start|>user\nhi<|im_end|>\n");
}

// vLLM's chat_template_kwargs: extra template variables (not `messages`); a --chat-template
// replaces the model's template.
TEST_F(ProtocolTest, ChatTemplateKwargsAndACustomTemplate) {
  absl::StatusOr<LoadedChatTemplate> custom = LoadChatTemplate(
      DUET_MODELS_DIR "/tiny-code-llama",
      "{% if formal is defined and formal %}Dear {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}");
  ASSERT_TRUE(custom.ok()) << custom.status();
  context_.chat = &*custom;
  absl::StatusOr<ParsedRequest> r = ParseChatRequest(
      R"({"messages":[{"role":"user","content":"Sir"}],"chat_template_kwargs":{"formal":true,"messages":[]},
          "max_tokens":7})",
      context_);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->prompts[0].token_ids, tokenizer_->Encode("Dear Sir", /*add_special_tokens=*/false));
  EXPECT_EQ(r->sampling.max_tokens(), 7);
  absl::StatusOr<Json> tokenized = Tokenize(R"({"messages":[{"role":"user","content":"Sir"}]})", context_);
  ASSERT_TRUE(tokenized.ok()) << tokenized.status();
  EXPECT_EQ((*tokenized)["tokens"].get<std::vector<int32_t>>(), tokenizer_->Encode("Sir", false));
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":[1]})").param,
            "chat_template_kwargs");
}

TEST_F(ProtocolTest, ChatErrors) {
  EXPECT_EQ(ChatError(R"({"model":"tiny"})").param, "messages");
  EXPECT_EQ(ChatError(R"({"messages":[]})").param, "messages");
  EXPECT_EQ(ChatError(R"({"messages":"hi"})").param, "messages");
  EXPECT_EQ(ChatError(R"({"messages":[5]})").status, 400);
  EXPECT_EQ(ChatError(R"({"messages":[{"content":"hi"}]})").param, "messages[0].role");
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":5}]})").param, "messages[0].content");
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})").param,
            "messages[0].content");
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})").param, "top_logprobs");
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":"x"}],"logprobs":3})").param, "logprobs");
  EXPECT_EQ(ChatError(R"({"messages":[{"role":"user","content":"x"}],"model":"nope"})").status, 404);
}

TEST_F(ProtocolTest, TokenizeDetokenize) {
  auto t = Tokenize(R"({"prompt":"hello world"})", context_);
  ASSERT_TRUE(t.ok()) << t.status();
  const Json& tj = *t;
  EXPECT_EQ(tj["tokens"].get<std::vector<int32_t>>(), tokenizer_->Encode("hello world", true));
  EXPECT_EQ(tj["count"], tj["tokens"].size());
  EXPECT_EQ(tj["max_model_len"], 2048);
  Json body;
  body["tokens"] = tokenizer_->Encode("hello world", false);
  auto d = Detokenize(body.dump(), context_);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)["prompt"], "hello world");
  EXPECT_FALSE(Detokenize(R"({"tokens":[-1]})", context_).ok());
  EXPECT_FALSE(Detokenize(R"({"tokens":"x"})", context_).ok());
  EXPECT_FALSE(Tokenize(R"({"prompt":3})", context_).ok());
  auto chat = Tokenize(R"({"messages":[{"role":"user","content":"hi"}]})", context_);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ((*chat)["tokens"].get<std::vector<int32_t>>(),
            tokenizer_->Encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", false));
}

TEST_F(ProtocolTest, SseFramingAndChunks) {
  ParsedRequest r = Completion(R"({"prompt":"x","stream":true,"stream_options":{"include_usage":true}})");
  r.created = 123;
  r.model = "tiny";
  ChunkChoice text;
  text.content = "ab";
  const std::string event = SseEvent(CompletionChunk("cmpl-1", r, text));
  EXPECT_EQ(event,
            "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":123,\"model\":\"tiny\",\"choices\":"
            "[{\"index\":0,\"text\":\"ab\",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n");
  EXPECT_EQ(std::string(kSseDone), "data: [DONE]\n\n");
  const Json usage = UsageChunk("cmpl-1", r, 3, 4);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 7);
  r.chat = true;
  ChunkChoice role;
  role.role = true;
  role.content = "";
  const Json first = ChatChunk("chatcmpl-1", r, role);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], Json::parse(R"({"role":"assistant","content":""})"));
  ChunkChoice finished;
  finished.finish_reason = "length";
  const Json last = ChatChunk("chatcmpl-1", r, finished);
  EXPECT_EQ(last["choices"][0]["delta"], Json::object());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(NewId("cmpl-").size(), 5u + 32u);
}

// vLLM: echo with logprobs scores the prompt with logprobs' top-N unless prompt_logprobs says
// otherwise; prompt_logprobs alone asks for the prompt's on both endpoints; 0 with a stream is
// taken and gives nothing (vLLM too).
TEST_F(ProtocolTest, PromptLogprobsRequests) {
  ParsedRequest echo = Completion(R"({"prompt":"x","echo":true,"logprobs":2})");
  EXPECT_EQ(echo.sampling.prompt_logprobs(), 2);
  EXPECT_FALSE(echo.prompt_logprobs.has_value());  // no prompt_logprobs field in the choices
  echo = Completion(R"({"prompt":"x","echo":true,"logprobs":0,"stream":true})");
  EXPECT_EQ(echo.sampling.prompt_logprobs(), 0);
  echo = Completion(R"({"prompt":"x","echo":true,"logprobs":2,"prompt_logprobs":4})");
  EXPECT_EQ(echo.sampling.prompt_logprobs(), 4);
  EXPECT_EQ(echo.prompt_logprobs, 4);
  EXPECT_FALSE(Completion(R"({"prompt":"x","echo":true})").sampling.has_prompt_logprobs());
  EXPECT_FALSE(Completion(R"({"prompt":"x","logprobs":3})").sampling.has_prompt_logprobs());
  EXPECT_FALSE(Completion(R"({"prompt":"x","prompt_logprobs":0,"stream":true})").sampling.has_prompt_logprobs());
  const ParsedRequest k = Completion(R"({"prompt":"x","prompt_logprobs":20})");
  EXPECT_EQ(k.prompt_logprobs, 20);
  EXPECT_EQ(k.sampling.prompt_logprobs(), 20);
  absl::StatusOr<ParsedRequest> chat =
      ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":3})", context_);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ(chat->sampling.prompt_logprobs(), 3);
  for (const char* bad : {R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":21})",
                          R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":2,"stream":true})"}) {
    const ApiError e = ChatError(bad);
    EXPECT_EQ(e.status, 400) << bad;
    EXPECT_EQ(e.param.value_or(""), "prompt_logprobs") << bad;
  }
}

// The prompt's scores as a router choice result holds them: token ids and one TokenLogprobs per
// token after the first.
void SetPromptScores(ChoiceResult* c, const std::vector<int32_t>& prompt) {
  c->prompt_token_ids = prompt;
  c->prompt_logprobs.clear();
  for (size_t i = 1; i < prompt.size(); ++i) {
    v1::TokenLogprobs lp;
    lp.set_logprob(-1.0f * float(i));
    lp.set_rank(int32_t(i) + 1);
    v1::TopLogprob* top = lp.add_top();  // the most likely: another token
    top->set_token_id(prompt[i] + 1);
    top->set_logprob(-0.25f);
    top = lp.add_top();
    top->set_token_id(prompt[i]);  // the prompt token itself is the second most likely
    top->set_logprob(-1.0f * float(i));
    c->prompt_logprobs.push_back(lp);
  }
}

TEST_F(ProtocolTest, EchoWithLogprobsCoversThePromptThenTheOutput) {
  const ParsedRequest r = Completion(R"({"prompt":"def f","echo":true,"logprobs":2})");
  const std::vector<int32_t> prompt = tokenizer_->Encode("def f", true);
  ASSERT_GE(prompt.size(), 2u);
  ChoiceResult c;
  c.text = "()";
  c.token_ids = {tokenizer_->Encode("()", false)[0]};
  v1::TokenLogprobs lp;
  lp.set_logprob(-0.5f);
  v1::TopLogprob* top = lp.add_top();
  top->set_token_id(c.token_ids[0]);
  top->set_logprob(-0.5f);
  c.logprobs = {lp};
  c.finish_reason = "length";
  SetPromptScores(&c, prompt);
  const Json out = CompletionResponse("cmpl-e", r, tokenizer_.get(), {c}, {"def f"});
  const Json& choice = out["choices"][0];
  EXPECT_EQ(choice["text"], "def f()");
  EXPECT_FALSE(choice.contains("prompt_logprobs"));  // not asked for by name
  const Json& l = choice["logprobs"];
  const size_t n = prompt.size() + 1;
  ASSERT_EQ(l["tokens"].size(), n);
  ASSERT_EQ(l["token_logprobs"].size(), n);
  ASSERT_EQ(l["top_logprobs"].size(), n);
  ASSERT_EQ(l["text_offset"].size(), n);
  EXPECT_TRUE(l["token_logprobs"][0].is_null());
  EXPECT_TRUE(l["top_logprobs"][0].is_null());
  size_t offset = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    EXPECT_EQ(l["tokens"][i], TokenString(tokenizer_.get(), prompt[i])) << i;
    EXPECT_EQ(l["text_offset"][i], offset) << i;
    offset += TokenString(tokenizer_.get(), prompt[i]).size();
    if (i == 0) continue;
    EXPECT_EQ(l["token_logprobs"][i], -1.0 * double(i)) << i;
    EXPECT_EQ(l["top_logprobs"][i].size(), 2u) << i;
    EXPECT_EQ(l["top_logprobs"][i][TokenString(tokenizer_.get(), prompt[i] + 1)], -0.25) << i;
  }
  EXPECT_EQ(l["tokens"][n - 1], TokenString(tokenizer_.get(), c.token_ids[0]));
  EXPECT_EQ(l["token_logprobs"][n - 1], -0.5);
  EXPECT_EQ(l["text_offset"][n - 1], offset);
}

TEST_F(ProtocolTest, PromptLogprobsFollowVllmsShape) {
  const std::vector<int32_t> prompt = tokenizer_->Encode("import os", true);
  ASSERT_GE(prompt.size(), 2u);
  ChoiceResult c;
  c.text = "x";
  c.finish_reason = "length";
  SetPromptScores(&c, prompt);
  // vLLM: [null, {"<id>": {logprob, rank, decoded_token}, ...}, ...], the prompt token's own
  // entry first, then the top-K without it.
  Json want = Json::array({nullptr});
  for (size_t i = 1; i < prompt.size(); ++i) {
    Json position = Json::object();
    position[std::to_string(prompt[i])] = {{"logprob", -1.0 * double(i)},
                                           {"rank", int(i) + 1},
                                           {"decoded_token", TokenString(tokenizer_.get(), prompt[i])}};
    position[std::to_string(prompt[i] + 1)] = {
        {"logprob", -0.25}, {"rank", 1}, {"decoded_token", TokenString(tokenizer_.get(), prompt[i] + 1)}};
    want.push_back(position);
  }
  const ParsedRequest r = Completion(R"({"prompt":"import os","prompt_logprobs":2})");
  const Json out = CompletionResponse("cmpl-p", r, tokenizer_.get(), {c}, {});
  EXPECT_EQ(out["choices"][0]["prompt_logprobs"], want);
  EXPECT_EQ(out["choices"][0]["prompt_logprobs"].dump(), want.dump());  // the own entry first
  EXPECT_TRUE(out["choices"][0]["logprobs"].is_null());
  // Chat: once, at the top of the response (as vLLM).
  absl::StatusOr<ParsedRequest> chat =
      ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":2})", context_);
  ASSERT_TRUE(chat.ok());
  const Json chat_out = ChatResponse("chatcmpl-p", *chat, tokenizer_.get(), {c});
  EXPECT_EQ(chat_out["prompt_logprobs"], want);
  EXPECT_FALSE(chat_out["choices"][0].contains("prompt_logprobs"));
  // Unasked, none.
  EXPECT_FALSE(CompletionResponse("cmpl-q", Completion(R"({"prompt":"x"})"), tokenizer_.get(), {c}, {})["choices"][0]
                   .contains("prompt_logprobs"));
  // -inf becomes -9999.0, as vLLM's clamp.
  c.prompt_logprobs[0].set_logprob(-std::numeric_limits<float>::infinity());
  const Json clamped = CompletionResponse("cmpl-r", r, tokenizer_.get(), {c}, {});
  EXPECT_EQ(clamped["choices"][0]["prompt_logprobs"][1][std::to_string(prompt[1])]["logprob"], -9999.0);
}

TEST_F(ProtocolTest, ResponsesAndLogprobs) {
  ParsedRequest r = Completion(R"({"prompt":["p0","p1"],"n":2,"logprobs":1})");
  std::vector<ChoiceResult> choices(4);
  for (int i = 0; i < 4; ++i) {
    choices[i].index = i;
    choices[i].text = "t";
    choices[i].token_ids = {tokenizer_->Encode("hello", false)[0]};
    v1::TokenLogprobs lp;
    lp.set_logprob(-0.5f);
    v1::TopLogprob* top = lp.add_top();
    top->set_token_id(choices[i].token_ids[0]);
    top->set_logprob(-0.5f);
    choices[i].logprobs = {lp};
    choices[i].finish_reason = "length";
    choices[i].prompt_tokens = 2;
    choices[i].completion_tokens = 1;
  }
  const Json out = CompletionResponse("cmpl-x", r, tokenizer_.get(), choices, {});
  EXPECT_EQ(out["object"], "text_completion");
  EXPECT_EQ(out["choices"].size(), 4u);
  EXPECT_EQ(out["choices"][3]["text"], "t");
  EXPECT_EQ(out["choices"][0]["logprobs"]["token_logprobs"][0], -0.5);
  EXPECT_EQ(out["choices"][0]["logprobs"]["text_offset"][0], 0);
  const ParsedRequest echo = Completion(R"({"prompt":["p0","p1"],"n":2,"echo":true})");
  const Json echoed = CompletionResponse("cmpl-y", echo, tokenizer_.get(), choices, {"p0", "p1"});
  EXPECT_EQ(echoed["choices"][3]["text"], "p1t");
  EXPECT_TRUE(echoed["choices"][3]["logprobs"].is_null());
  EXPECT_EQ(out["usage"], Json::parse(R"({"prompt_tokens":4,"completion_tokens":4,"total_tokens":8,
                                          "prompt_tokens_details":null})"));
  EXPECT_TRUE(out["choices"][0].contains("stop_reason"));
  EXPECT_TRUE(out["choices"][0]["stop_reason"].is_null());
  r.chat = true;
  r.logprobs = 1;
  const Json chat = ChatResponse("chatcmpl-x", r, tokenizer_.get(), choices);
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 1u);
  EXPECT_TRUE(chat["choices"][0]["logprobs"]["content"][0]["bytes"].is_array());
}

}  // namespace
}  // namespace duet::router::openai
