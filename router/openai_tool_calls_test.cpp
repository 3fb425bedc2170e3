#include "router/openai_tool_calls.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "engine/grammar/json_schema.h"

namespace duet::router::openai {
namespace {

using Json = nlohmann::ordered_json;

struct Expected {
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments
};

using Factory = std::function<std::unique_ptr<ToolCallParser>()>;

// Ids "call-0", "call-1", ... per parser, so results can be compared whole.
ToolCallIdFn CountingIds() {
  auto next = std::make_shared<int>(0);
  return [next] { return absl::StrCat("call-", (*next)++); };
}

Factory Auto(ToolCallFormat format, int max_calls = 1 << 20) {
  return [=] { return NewAutoToolCallParser(format, max_calls, CountingIds()); };
}

void ExpectOutput(const ParsedOutput& got, const Expected& want, const std::string& where) {
  EXPECT_EQ(got.content, want.content) << where;
  ASSERT_EQ(got.calls.size(), want.calls.size()) << where;
  for (size_t i = 0; i < got.calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].id, absl::StrCat("call-", i)) << where;
    EXPECT_EQ(got.calls[i].name, want.calls[i].first) << where;
    EXPECT_EQ(got.calls[i].arguments, want.calls[i].second) << where;
  }
}

// The whole text, the text split in two at every byte, and the text a byte at a time all parse
// to `want`; no delta names a call out of order.
void ExpectParses(const Factory& factory, const std::string& text, const Expected& want) {
  {
    std::unique_ptr<ToolCallParser> parser = factory();
    ExpectOutput(ParseToolCalls(*parser, text), want, "whole: " + text);
  }
  auto streamed = [&](const std::vector<std::string_view>& pieces, const std::string& where) {
    std::unique_ptr<ToolCallParser> parser = factory();
    ParsedOutput out;
    for (std::string_view piece : pieces) {
      OutputDelta delta;
      parser->Push(piece, &delta);
      int known = static_cast<int>(out.calls.size());
      for (const OutputDelta::Call& c : delta.calls) {
        ASSERT_LE(c.index, known) << where;
        EXPECT_EQ(c.id.has_value(), c.index == known) << where;
        if (c.index == known) ++known;
      }
      Accumulate(delta, &out);
    }
    OutputDelta last;
    parser->Finish(&last);
    Accumulate(last, &out);
    EXPECT_EQ(parser->num_calls(), static_cast<int>(want.calls.size())) << where;
    ExpectOutput(out, want, where);
  };
  for (size_t k = 0; k <= text.size(); ++k) {
    const std::string_view t(text);
    streamed({t.substr(0, k), t.substr(k)}, absl::StrCat("split at ", k, ": ", text));
  }
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < text.size(); ++i) bytes.push_back(std::string_view(text).substr(i, 1));
  streamed(bytes, "byte by byte: " + text);
}

TEST(ToolCallFormatTest, Names) {
  EXPECT_EQ(*ParseToolCallFormat("llama3_json"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(*ParseToolCallFormat("hermes"), ToolCallFormat::kHermes);
  EXPECT_FALSE(ParseToolCallFormat("pythonic").ok());
  EXPECT_STREQ(ToolCallFormatName(ToolCallFormat::kHermes), "hermes");
}

TEST(Llama3JsonParserTest, Calls) {
  const Factory f = Auto(ToolCallFormat::kLlama3Json);
  ExpectParses(f, R"({"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}})",
               {"", {{"get_weather", R"({"city":"Paris","unit":"celsius"})"}}});
  ExpectParses(f, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": {\"x\": [1, 2]}}",
               {"", {{"a", "{}"}, {"b", R"({"x":[1,2]})"}}});
  // Braces, quotes and escapes inside strings; leading and trailing whitespace.
  ExpectParses(f, " \n{\"name\":\"q\",\"parameters\":{\"s\":\"}{\\\"}[\",\"t\":\"é\\n\"}}\n ",
               {"", {{"q", R"({"s":"}{\"}[","t":"é\n"})"}}});
  // Objects one after the other, and arguments given as a JSON string.
  ExpectParses(f, R"({"name":"a","parameters":{}} {"name":"b","arguments":"{\"k\": true}"})",
               {"", {{"a", "{}"}, {"b", R"({"k":true})"}}});
}

TEST(Llama3JsonParserTest, WhatIsNotACallIsContent) {
  const Factory f = Auto(ToolCallFormat::kLlama3Json);
  for (const std::string& text : {
           std::string("The answer is 4."),
           std::string(""),
           std::string("  \n"),
           std::string("Hello {\"name\": \"a\", \"parameters\": {}}"),
           std::string("{\"name\": \"a\", \"parameters\": {\"x\": 1}"),  // cut short
           std::string("{\"foo\": 1} and more"),
           std::string("{\"name\": 5, \"parameters\": {}}"),
           std::string("{\"name\": \"a\"}"),
           std::string("{\"name\": \"a\", \"parameters\": [1]}"),
           std::string("{\"name\": \"a\", \"parameters\": {\"x\": 01}}"),  // not JSON
           std::string("<|python"),
           std::string("<|python_tag|>print(1)"),
           std::string("<|pythonic|>{}"),
           std::string("{") + std::string(100, '[') + std::string(100, ']') + "}",
       }) {
    ExpectParses(f, text, {text, {}});
  }
  // After a call, a bad object and all that follows is content.
  ExpectParses(f, R"({"name":"a","parameters":{}}; oops {"name":"b","parameters":{}})",
               {R"(; oops {"name":"b","parameters":{}})", {{"a", "{}"}}});
  ExpectParses(f, R"({"name":"a","parameters":{}}; {"name":"b")", {R"(; {"name":"b")", {{"a", "{}"}}});
}

TEST(Llama3JsonParserTest, MaxCalls) {
  ExpectParses(Auto(ToolCallFormat::kLlama3Json, 1), R"({"name":"a","parameters":{}}; {"name":"b","parameters":{}})",
               {R"(; {"name":"b","parameters":{}})", {{"a", "{}"}}});
  ExpectParses(Auto(ToolCallFormat::kLlama3Json, 1), "{\"name\":\"a\",\"parameters\":{}}\n", {"", {{"a", "{}"}}});
}

TEST(HermesParserTest, Calls) {
  const Factory f = Auto(ToolCallFormat::kHermes);
  ExpectParses(f, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>", {"", {{"f", R"({"a":1})"}}});
  ExpectParses(f,
               "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n"
               "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"s\": \"</tool\"}}\n</tool_call>\n",
               {"Let me check.", {{"f", "{}"}, {"g", R"({"s":"</tool"})"}}});
  ExpectParses(f, "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\nDone.", {"Done.", {{"f", "{}"}}});
  // The last block may be left unclosed (the model stopped there).
  ExpectParses(f, "<tool_call>\n{\"name\": \"f\", \"parameters\": {\"x\": null}}\n", {"", {{"f", R"({"x":null})"}}});
}

TEST(HermesParserTest, WhatIsNotACallIsContent) {
  const Factory f = Auto(ToolCallFormat::kHermes);
  for (const std::string& text : {
           std::string("Hello\n"),
           std::string("a < b <tool"),
           std::string("<tool_call>{bad json}</tool_call> after"),
           std::string("x\n<tool_call>{\"name\": \"f\"}</tool_call>"),
           std::string("<tool_call>{\"name\":"),
           std::string("  <tool_call>  "),
           std::string("<tool_call>") + std::string(100, '[') + "</tool_call>",
       }) {
    ExpectParses(f, text, {text, {}});
  }
  ExpectParses(f, "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call> <tool_call>nope</tool_call>",
               {"<tool_call>nope</tool_call>", {{"f", "{}"}}});
  ExpectParses(f, "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\n<tool",
               {"<tool", {{"f", "{}"}}});
}

TEST(HermesParserTest, MaxCalls) {
  ExpectParses(Auto(ToolCallFormat::kHermes, 1),
               "<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\n<tool_call>{\"name\":\"g\",\"arguments\":{}}</tool_call>",
               {"<tool_call>{\"name\":\"g\",\"arguments\":{}}</tool_call>", {{"f", "{}"}}});
}

TEST(RequiredParserTest, ForcedArray) {
  const Factory f = [] { return NewRequiredToolCallParser(CountingIds()); };
  ExpectParses(f, R"([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}])",
               {"", {{"f", R"({"a":1})"}, {"g", "{}"}}});
  // Cut short by max_tokens: what is complete is a call, the rest content.
  ExpectParses(f, R"([{"name":"f","parameters":{}}, {"name": "g", "param)", {R"(, {"name": "g", "param)", {{"f", "{}"}}});
  ExpectParses(f, R"([{"name": "f", "par)", {R"([{"name": "f", "par)", {}});
}

TEST(NamedParserTest, ArgumentsStream) {
  const Factory f = [] { return NewNamedToolCallParser("get_weather", CountingIds()); };
  ExpectParses(f, R"({"city": "Paris"})", {"", {{"get_weather", R"({"city": "Paris"})"}}});
  ExpectParses(f, "", {"", {{"get_weather", ""}}});
}

TEST(ToolCallSchemaTest, NamedAndRequiredSchemasBuildGrammars) {
  const Json weather = Json::parse(R"({"type":"object","properties":{"city":{"type":"string","maxLength":8},
      "unit":{"$ref":"#/$defs/unit"}},"required":["city","unit"],
      "$defs":{"unit":{"type":"string","enum":["c","f"]}}})");
  const std::vector<ToolSpec> tools = {{"get_weather", weather}, {"ping", nullptr}};
  EXPECT_EQ(NamedToolCallSchema(tools[0]), weather);
  EXPECT_EQ(NamedToolCallSchema(tools[1]).dump(), R"({"type":"object","properties":{},"additionalProperties":false})");
  for (bool parallel : {true, false}) {
    absl::StatusOr<Json> schema = RequiredToolCallSchema(tools, parallel);
    ASSERT_TRUE(schema.ok()) << schema.status();
    EXPECT_EQ((*schema)["$defs"]["unit"]["enum"][1], "f");
    EXPECT_FALSE((*schema)["items"]["anyOf"][0]["properties"]["parameters"].contains("$defs"));
    EXPECT_EQ(schema->contains("maxItems"), !parallel);
    EXPECT_TRUE(grammar::JsonSchemaToGrammar(schema->dump()).ok()) << schema->dump();
  }
  const Json other = Json::parse(R"({"type":"object","$defs":{"unit":{"type":"integer"}}})");
  EXPECT_FALSE(RequiredToolCallSchema({{"a", weather}, {"b", other}}, true).ok());
}

}  // namespace
}  // namespace duet::router::openai
