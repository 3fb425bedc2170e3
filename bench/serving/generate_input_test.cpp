// duet-bench --save-requests writes `duet generate` input: every line must parse as a
// GenerateRequest with the token ids a Duet router would make of the prompt.
#include <sstream>

#include "bench/serving/dataset.h"
#include "cli/generate_request.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet::bench {
namespace {

class GenerateInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto tokenizer = Tokenizer::FromModelDir(std::string(DUET_MODELS_DIR) + "/tiny-code-llama");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer).release();
  }
  static void TearDownTestSuite() { delete tokenizer_; }

  static std::vector<BenchRequest> Random(int num_prompts, double range_ratio) {
    DatasetOptions o;
    o.tokenizer = tokenizer_;
    o.num_prompts = num_prompts;
    o.input_len = 32;
    o.output_len = 8;
    o.range_ratio = range_ratio;
    o.seed = 1;
    auto requests = LoadDataset(o);
    EXPECT_TRUE(requests.ok()) << requests.status();
    return requests.ok() ? *requests : std::vector<BenchRequest>{};
  }
  static std::vector<nlohmann::json> Lines(const std::string& text) {
    std::vector<nlohmann::json> rows;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
    return rows;
  }

  static const Tokenizer* tokenizer_;
};
const Tokenizer* GenerateInputTest::tokenizer_ = nullptr;

TEST_F(GenerateInputTest, EveryLineIsTheRequestAsARouterRunsIt) {
  const std::vector<BenchRequest> requests = Random(12, 0.5);
  ASSERT_EQ(requests.size(), 12u);
  const std::vector<nlohmann::json> rows = Lines(GenerateInputJsonl(requests, *tokenizer_, /*ignore_eos=*/true));
  ASSERT_EQ(rows.size(), requests.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE(i);
    absl::StatusOr<GenerateRequest> parsed = ParseGenerateRequest(rows[i]);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->id, std::to_string(i));
    EXPECT_FALSE(parsed->prompt.has_value());
    // The router encodes a text prompt with special tokens added (this tokenizer adds none;
    // Llama 3's adds <|begin_of_text|>).
    EXPECT_EQ(parsed->prompt_token_ids, tokenizer_->Encode(requests[i].prompt, /*add_special_tokens=*/true));
    EXPECT_EQ(parsed->params.max_tokens, requests[i].output_tokens);
    EXPECT_TRUE(parsed->params.greedy());
    EXPECT_TRUE(parsed->params.ignore_eos);
  }
}

TEST_F(GenerateInputTest, IgnoreEosFollowsTheFlagAndNothingElseIsSet) {
  const std::vector<BenchRequest> requests = Random(3, 0);
  for (const nlohmann::json& row : Lines(GenerateInputJsonl(requests, *tokenizer_, /*ignore_eos=*/false))) {
    EXPECT_EQ(row.size(), 5u) << row.dump();  // id, prompt_token_ids, max_tokens, temperature, ignore_eos
    EXPECT_EQ(row["temperature"], 0);
    EXPECT_EQ(row["ignore_eos"], false);
    absl::StatusOr<GenerateRequest> parsed = ParseGenerateRequest(row);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_FALSE(parsed->params.ignore_eos);
  }
  EXPECT_EQ(GenerateInputJsonl({}, *tokenizer_, true), "");
}

}  // namespace
}  // namespace duet::bench
