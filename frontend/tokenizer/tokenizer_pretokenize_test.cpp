#include "frontend/tokenizer/tokenizer_pretokenize.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using ::testing::ElementsAre;

std::vector<std::string> PreTokenize(const std::string& config, const std::string& text,
                                     bool at_text_start = true) {
  auto pre_tokenizer = PreTokenizer::FromJson(nlohmann::json::parse(config));
  EXPECT_TRUE(pre_tokenizer.ok()) << pre_tokenizer.status();
  if (!pre_tokenizer.ok()) return {};
  std::vector<PreToken> pieces = {{text, at_text_start}};
  (*pre_tokenizer)->PreTokenize(pieces);
  std::vector<std::string> texts;
  for (const auto& piece : pieces) texts.push_back(piece.text);
  return texts;
}

std::string SplitOnDash(const std::string& behavior, bool invert = false) {
  return R"({"type": "Split", "pattern": {"String": "-"}, "behavior": ")" + behavior +
         R"(", "invert": )" + (invert ? "true" : "false") + "}";
}

// The examples of HF's SplitDelimiterBehavior documentation.
TEST(PreTokenizeTest, SplitBehaviors) {
  const std::string text = "the-final--countdown";
  EXPECT_THAT(PreTokenize(SplitOnDash("Removed"), text), ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(PreTokenize(SplitOnDash("Isolated"), text),
              ElementsAre("the", "-", "final", "-", "-", "countdown"));
  EXPECT_THAT(PreTokenize(SplitOnDash("MergedWithPrevious"), text),
              ElementsAre("the-", "final-", "-", "countdown"));
  EXPECT_THAT(PreTokenize(SplitOnDash("MergedWithNext"), text),
              ElementsAre("the", "-final", "-", "-countdown"));
  EXPECT_THAT(PreTokenize(SplitOnDash("Contiguous"), text),
              ElementsAre("the", "-", "final", "--", "countdown"));
  // Inverted: the dashes are the "non-matches" and are removed.
  EXPECT_THAT(PreTokenize(SplitOnDash("Removed", /*invert=*/true), text), ElementsAre("-", "-", "-"));
}

TEST(PreTokenizeTest, SplitRegexWithUnicodeClassesAndCaseInsensitiveGroup) {
  const std::string llama3 = R"({"type": "Split", "behavior": "Isolated", "pattern": {"Regex":
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}})";
  EXPECT_THAT(PreTokenize(llama3, "I'M 12345 héllo  x\n\n"),
              ElementsAre("I", "'M", " ", "123", "45", " héllo", " ", " x", "\n\n"));
}

TEST(PreTokenizeTest, ByteLevelMapsBytesAndSplitsWithGpt2Regex) {
  EXPECT_THAT(PreTokenize(R"({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true})",
                          "Hello my friend, 1 é"),
              ElementsAre("ĠHello", "Ġmy", "Ġfriend", ",", "Ġ1", "ĠÃ©"));
  EXPECT_THAT(PreTokenize(R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": false})",
                          "a b\n"),
              ElementsAre("aĠbĊ"));
}

TEST(PreTokenizeTest, MetaspacePrependSchemes) {
  const std::string always = R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"})";
  EXPECT_THAT(PreTokenize(always, "Hey friend!"), ElementsAre("▁Hey", "▁friend!"));
  EXPECT_THAT(PreTokenize(always, "Hey", /*at_text_start=*/false), ElementsAre("▁Hey"));
  const std::string first = R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"})";
  EXPECT_THAT(PreTokenize(first, "Hey friend"), ElementsAre("▁Hey", "▁friend"));
  EXPECT_THAT(PreTokenize(first, "Hey friend", /*at_text_start=*/false), ElementsAre("Hey", "▁friend"));
  const std::string never_no_split =
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": false})";
  EXPECT_THAT(PreTokenize(never_no_split, "Hey  friend"), ElementsAre("Hey▁▁friend"));
  // Legacy files say add_prefix_space instead of prepend_scheme.
  EXPECT_THAT(PreTokenize(R"({"type": "Metaspace", "replacement": "▁", "add_prefix_space": true})", "a b"),
              ElementsAre("▁a", "▁b"));
}

TEST(PreTokenizeTest, DigitsWhitespaceAndSequence) {
  EXPECT_THAT(PreTokenize(R"({"type": "Digits", "individual_digits": true})", "a123b"),
              ElementsAre("a", "1", "2", "3", "b"));
  EXPECT_THAT(PreTokenize(R"({"type": "Digits", "individual_digits": false})", "a123b4"),
              ElementsAre("a", "123", "b", "4"));
  EXPECT_THAT(PreTokenize(R"({"type": "Whitespace"})", "Hello, world!  ok"),
              ElementsAre("Hello", ",", "world", "!", "ok"));
  EXPECT_THAT(PreTokenize(R"({"type": "WhitespaceSplit"})", " a  b\tc "), ElementsAre("a", "b", "c"));
  EXPECT_THAT(PreTokenize(R"({"type": "Sequence", "pretokenizers": [
                {"type": "WhitespaceSplit"}, {"type": "Digits", "individual_digits": true}]})",
                          "ab12 c3"),
              ElementsAre("ab", "1", "2", "c", "3"));
}

TEST(PreTokenizeTest, UnknownTypeIsAnError) {
  EXPECT_FALSE(PreTokenizer::FromJson(nlohmann::json::parse(R"({"type": "BertPreTokenizer"})")).ok());
}

}  // namespace
}  // namespace duet
