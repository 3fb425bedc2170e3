#include "frontend/tokenizer/tokenizer_bpe.h"

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
