#include "frontend/tokenizer/tokenizer_bpe.h"

#include <map>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using ::testing::ElementsAre;

std::unique_ptr<BpeModel> Model(const std::string& config) {
  auto model = BpeModel::FromJson(nlohmann::json::parse(config));
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *std::move(model) : nullptr;
}

std::vector<int32_t> Tokenize(const BpeModel& model, std::string_view word) {
  std::vector<int32_t> ids;
  model.Tokenize(word, ids);
  return ids;
}

constexpr char kVocab[] = R"("vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "cc": 6})";

TEST(BpeTest, MergesApplyInRankOrder) {
  // "b c" outranks "a b": abc -> a bc (then no merge "a bc").
  auto model = Model(std::string("{") + kVocab + R"(, "merges": ["b c", "a b", "ab c"]})");
  ASSERT_NE(model, nullptr);
  EXPECT_THAT(Tokenize(*model, "abc"), ElementsAre(0, 4));
  // With "a b" first: ab c -> abc. Merges as [a, b] pairs are accepted too.
  auto other = Model(std::string("{") + kVocab + R"(, "merges": [["a", "b"], ["ab", "c"], ["b", "c"]]})");
  ASSERT_NE(other, nullptr);
  EXPECT_THAT(Tokenize(*other, "abc"), ElementsAre(5));
  // Equal ranks resolve leftmost first: ccc -> cc c.
  EXPECT_THAT(Tokenize(*Model(std::string("{") + kVocab + R"(, "merges": ["c c"]})"), "ccc"),
              ElementsAre(6, 2));
  EXPECT_THAT(Tokenize(*other, "abcabc"), ElementsAre(5, 5));
  EXPECT_THAT(Tokenize(*other, "abcabc"), ElementsAre(5, 5));  // cached
  EXPECT_THAT(Tokenize(*other, ""), ElementsAre());
}

// The textbook BPE: merge the lowest-ranked adjacent pair, leftmost among equals, until none is
// left. Words of up to 48 symbols take Tokenize's scan, longer ones its queue: both must agree.
std::vector<std::string> ReferenceBpe(const std::vector<std::string>& chars,
                                      const std::map<std::pair<std::string, std::string>, int>& ranks) {
  std::vector<std::string> symbols = chars;
  while (symbols.size() >= 2) {
    size_t best = 0;
    int best_rank = INT32_MAX;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = ranks.find({symbols[i], symbols[i + 1]});
      if (it != ranks.end() && it->second < best_rank) best = i, best_rank = it->second;
    }
    if (best_rank == INT32_MAX) break;
    symbols[best] += symbols[best + 1];
    symbols.erase(symbols.begin() + best + 1);
  }
  return symbols;
}

TEST(BpeTest, RandomWordsMergeAsTheTextbookAlgorithmAtEveryLength) {
  // Characters of one, two and three bytes (the last beyond Tokenize's one-character table).
  const std::vector<std::string> decoded = {"a", "b", "c", "\xc3\xa9", "\xd0\x96", "\xe4\xb8\xad"};
  std::mt19937 rng(7);
  std::map<std::string, int> vocab;
  for (const std::string& c : decoded) vocab.emplace(c, int(vocab.size()));
  std::map<std::pair<std::string, std::string>, int> ranks;
  nlohmann::json merges = nlohmann::json::array();
  std::vector<std::string> tokens = decoded;
  for (int rank = 0; rank < 60; ++rank) {  // random merges of tokens made so far
    const std::string& left = tokens[rng() % tokens.size()];
    const std::string& right = tokens[rng() % tokens.size()];
    if (ranks.count({left, right}) > 0 || left.size() + right.size() > 12) continue;
    ranks[{left, right}] = int(merges.size());
    merges.push_back(nlohmann::json::array({left, right}));
    if (vocab.emplace(left + right, int(vocab.size())).second) tokens.push_back(left + right);
  }
  nlohmann::json config = {{"vocab", vocab}, {"merges", merges}};
  auto model = BpeModel::FromJson(config);
  ASSERT_TRUE(model.ok()) << model.status();
  for (int trial = 0; trial < 2000; ++trial) {
    const size_t length = 2 + rng() % 100;
    std::vector<std::string> chars;
    std::string word;
    for (size_t i = 0; i < length; ++i) {
      chars.push_back(decoded[rng() % 4 == 0 ? rng() % decoded.size() : rng() % 2]);  // mostly a, b
      word += chars.back();
    }
    std::vector<int32_t> want;
    for (const std::string& symbol : ReferenceBpe(chars, ranks)) want.push_back(vocab.at(symbol));
    EXPECT_EQ(Tokenize(**model, word), want) << "word of " << length << " characters, trial " << trial;
  }
}

TEST(BpeTest, IgnoreMergesTakesWholeWordFromVocab) {
  // Without merges "abc" could never form, but ignore_merges looks the word up first.
  auto model = Model(std::string("{") + kVocab + R"(, "merges": [], "ignore_merges": true})");
  ASSERT_NE(model, nullptr);
  EXPECT_THAT(Tokenize(*model, "abc"), ElementsAre(5));
  EXPECT_THAT(Tokenize(*model, "ca"), ElementsAre(2, 0));
}

TEST(BpeTest, UnknownCharactersUseUnkTokenFusedOrNot) {
  const std::string vocab = R"("vocab": {"<unk>": 0, "a": 1})";
  auto fused = Model("{" + vocab + R"(, "merges": [], "unk_token": "<unk>", "fuse_unk": true})");
  EXPECT_THAT(Tokenize(*fused, "axyza"), ElementsAre(1, 0, 1));
  auto unfused = Model("{" + vocab + R"(, "merges": [], "unk_token": "<unk>", "fuse_unk": false})");
  EXPECT_THAT(Tokenize(*unfused, "axyza"), ElementsAre(1, 0, 0, 0, 1));
  auto no_unk = Model("{" + vocab + R"(, "merges": []})");
  EXPECT_THAT(Tokenize(*no_unk, "axa"), ElementsAre(1, 1));  // dropped, as HF does
}

TEST(BpeTest, ByteFallbackSpellsUnknownCharactersAsBytes) {
  auto model = Model(R"({"vocab": {"<unk>": 0, "a": 1, "<0xC3>": 2, "<0xA9>": 3, "<0xE2>": 4},
                         "merges": [], "unk_token": "<unk>", "byte_fallback": true})");
  ASSERT_NE(model, nullptr);
  EXPECT_THAT(Tokenize(*model, "aé"), ElementsAre(1, 2, 3));
  // "€" = E2 82 AC: not all its bytes have tokens, so it is unknown.
  EXPECT_THAT(Tokenize(*model, "€"), ElementsAre(0));
  EXPECT_EQ(model->TokenToId("<0xC3>"), 2);
  EXPECT_EQ(*model->IdToToken(3), "<0xA9>");
  EXPECT_EQ(model->IdToToken(99), nullptr);
}

TEST(BpeTest, RejectsUnsupportedOptionsAndBadMerges) {
  EXPECT_FALSE(BpeModel::FromJson(nlohmann::json::parse(
                   R"({"vocab": {"a": 0}, "merges": [], "continuing_subword_prefix": "##"})"))
                   .ok());
  EXPECT_TRUE(BpeModel::FromJson(nlohmann::json::parse(
                  R"({"vocab": {"a": 0}, "merges": [], "continuing_subword_prefix": ""})"))
                  .ok());
  EXPECT_FALSE(BpeModel::FromJson(nlohmann::json::parse(R"({"vocab": {"a": 0}, "merges": ["a a"]})")).ok());
  EXPECT_FALSE(BpeModel::FromJson(nlohmann::json::parse(R"({"vocab": {"a": 0}, "merges": ["a a a"]})")).ok());
}

}  // namespace
}  // namespace duet
