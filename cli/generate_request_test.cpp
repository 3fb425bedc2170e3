#include "cli/generate_request.h"

#include "gtest/gtest.h"

namespace duet {
namespace {

using nlohmann::json;

TEST(GenerateRequestTest, ParsesEveryField) {
  json row = json::parse(R"({"id": "a", "prompt": "def f():", "max_tokens": 7, "temperature": 0.5,
      "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 123, "stop": ["\n\n", "return"],
      "stop_token_ids": [1, 2], "ignore_eos": true, "repetition_penalty": 1.1,
      "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 3, "prompt_logprobs": 2})");
  absl::StatusOr<GenerateRequest> r = ParseGenerateRequest(row);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->id, "a");
  EXPECT_EQ(*r->prompt, "def f():");
  const SamplingParams& p = r->params;
  EXPECT_EQ(p.max_tokens, 7);
  EXPECT_FLOAT_EQ(p.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.top_p, 0.9f);
  EXPECT_EQ(p.top_k, 40);
  EXPECT_FLOAT_EQ(p.min_p, 0.05f);
  EXPECT_EQ(*p.seed, 123u);
  EXPECT_EQ(p.stop, (std::vector<std::string>{"\n\n", "return"}));
  EXPECT_EQ(p.stop_token_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_EQ(p.logprobs, 3);
  EXPECT_EQ(p.prompt_logprobs, 2);
}

TEST(GenerateRequestTest, TokenIdsAndIntegerId) {
  absl::StatusOr<GenerateRequest> r =
      ParseGenerateRequest(json::parse(R"({"id": 5, "prompt_token_ids": [0, 10, 20], "stop": "x"})"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->id, "5");
  EXPECT_FALSE(r->prompt.has_value());
  EXPECT_EQ(r->prompt_token_ids, (std::vector<int32_t>{0, 10, 20}));
  EXPECT_EQ(r->params.stop, std::vector<std::string>{"x"});
}

TEST(GenerateRequestTest, RejectsBadInputWithTheFieldName) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"prompt": "x"})", "id"},
      {R"({"id": "a"})", "prompt"},
      {R"({"id": "a", "prompt": "x", "prompt_token_ids": [1]})", "prompt"},
      {R"({"id": "a", "prompt": 5})", "prompt"},
      {R"({"id": "a", "prompt_token_ids": [1, -2]})", "prompt_token_ids"},
      {R"({"id": "a", "prompt_token_ids": [1, "x"]})", "prompt_token_ids"},
      {R"({"id": "a", "prompt_token_ids": []})", "prompt_token_ids"},
      {R"({"id": "a", "prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"id": "a", "prompt": "x", "max_tokens": "10"})", "max_tokens"},
      {R"({"id": "a", "prompt": "x", "max_tokens": 1e30})", "max_tokens"},
      {R"({"id": "a", "prompt": "x", "max_tokens": 99999999999999})", "max_tokens"},
      {R"({"id": "a", "prompt": "x", "temperature": -1})", "temperature"},
      {R"({"id": "a", "prompt": "x", "top_p": 0})", "top_p"},
      {R"({"id": "a", "prompt": "x", "top_k": -5})", "top_k"},
      {R"({"id": "a", "prompt": "x", "min_p": 2})", "min_p"},
      {R"({"id": "a", "prompt": "x", "seed": "s"})", "seed"},
      {R"({"id": "a", "prompt": "x", "stop": [1]})", "stop"},
      {R"({"id": "a", "prompt": "x", "stop": [""]})", "stop"},
      {R"({"id": "a", "prompt": "x", "ignore_eos": 1})", "ignore_eos"},
      {R"({"id": "a", "prompt": "x", "logprobs": 50})", "logprobs"},
      {R"({"id": "a", "prompt": "x", "prompt_logprobs": 21})", "prompt_logprobs"},
      {R"({"id": "a", "prompt": "x", "prompt_logprobs": -1})", "prompt_logprobs"},
      {R"({"id": "a", "prompt": "x", "temprature": 0})", "temprature"},
      {R"({"id": [1], "prompt": "x"})", "id"},
  };
  for (const auto& [text, field] : cases) {
    absl::StatusOr<GenerateRequest> r = ParseGenerateRequest(json::parse(text));
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << text << " → " << r.status();
  }
}

}  // namespace
}  // namespace duet
