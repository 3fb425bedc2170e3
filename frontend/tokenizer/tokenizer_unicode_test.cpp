#include "frontend/tokenizer/tokenizer_unicode.h"

#include "frontend/tokenizer/tokenizer_decoder.h"
#include "frontend/tokenizer/tokenizer_normalizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using ::testing::ElementsAre;

TEST(UnicodeTest, LossyUtf8ReplacesMaximalIllFormedSubsequences) {
  EXPECT_EQ(unicode::Utf8Lossy("abc"), "abc");
  EXPECT_EQ(unicode::Utf8Lossy("\xE4\xB8"), "\uFFFD");                  // truncated: one U+FFFD
  EXPECT_EQ(unicode::Utf8Lossy("\xE4\xB8x"), "\uFFFDx");
  EXPECT_EQ(unicode::Utf8Lossy("\x80\x80"), "\uFFFD\uFFFD");            // stray continuations
  EXPECT_EQ(unicode::Utf8Lossy("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");  // surrogate
  EXPECT_EQ(unicode::Utf8Lossy("\xF0\x9F\x98"), "\uFFFD");
  EXPECT_EQ(unicode::Utf8Lossy("\xC0\xAF"), "\uFFFD\uFFFD");            // overlong
  EXPECT_TRUE(unicode::IsValidUtf8("héllo 😀"));
  EXPECT_FALSE(unicode::IsValidUtf8("\xFF"));
}

TEST(UnicodeTest, Nfc) {
  EXPECT_EQ(unicode::ToNfc("plain ascii"), "plain ascii");
  EXPECT_EQ(unicode::ToNfc("cafe\u0301"), "caf\u00e9");
  EXPECT_EQ(unicode::ToNfc("A\u030a"), "\u00c5");
  EXPECT_EQ(unicode::ToNfc("\u212b"), "\u00c5");                    // singleton Ångström sign
  EXPECT_EQ(unicode::ToNfc("\u1e9b\u0323"), "\u1e9b\u0323");        // canonical reordering
  EXPECT_EQ(unicode::ToNfc("q\u0307\u0323"), "q\u0323\u0307");
  EXPECT_EQ(unicode::ToNfc("\u1100\u1161\u11a8"), "\uac01");        // Hangul jamo compose
  EXPECT_EQ(unicode::ToNfc("\u0958"), "\u0915\u093c");              // composition exclusion
  EXPECT_EQ(unicode::ToNfc("日本語 😀"), "日本語 😀");
}

TEST(UnicodeTest, Lowercase) {
  EXPECT_EQ(unicode::ToLowercase("HeLLo ÉCOLE ΣΑΣ"), "hello école σασ");
}

std::string Normalize(const std::string& config, const std::string& text) {
  auto normalizer = Normalizer::FromJson(nlohmann::json::parse(config));
  EXPECT_TRUE(normalizer.ok()) << normalizer.status();
  return normalizer.ok() ? (*normalizer)->Normalize(text) : "";
}

TEST(NormalizerTest, PrependReplaceStripAndSequence) {
  EXPECT_EQ(Normalize(R"({"type": "Prepend", "prepend": "▁"})", "hi"), "▁hi");
  EXPECT_EQ(Normalize(R"({"type": "Prepend", "prepend": "▁"})", ""), "");
  EXPECT_EQ(Normalize(R"({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})", "a b  c"),
            "a▁b▁▁c");
  EXPECT_EQ(Normalize(R"({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "})", "a \t\n b"),
            "a b");
  EXPECT_EQ(Normalize(R"({"type": "Strip", "strip_left": true, "strip_right": true})", " \u3000a b\n "),
            "a b");
  EXPECT_EQ(Normalize(R"({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]})",
                      "E\u0301COLE"),
            "\u00e9cole");
  EXPECT_FALSE(Normalizer::FromJson(nlohmann::json::parse(R"({"type": "BertNormalizer"})")).ok());
}

std::vector<std::string> DecodeChain(const std::string& config, std::vector<std::string> tokens) {
  auto decoder = Decoder::FromJson(nlohmann::json::parse(config));
  EXPECT_TRUE(decoder.ok()) << decoder.status();
  if (decoder.ok()) (*decoder)->DecodeChain(tokens);
  return tokens;
}

TEST(DecoderTest, Pieces) {
  EXPECT_THAT(DecodeChain(R"({"type": "ByteLevel"})", {"Hello", "Ġworld", "Ċ", "ä¸", "Ń"}),
              ElementsAre("Hello world\n中"));
  EXPECT_THAT(DecodeChain(R"({"type": "ByteLevel"})", {"ä¸"}), ElementsAre("\uFFFD"));
  EXPECT_THAT(DecodeChain(R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"})",
                          {"▁Hey", "▁friend"}),
              ElementsAre("Hey", " friend"));
  EXPECT_THAT(DecodeChain(R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never"})",
                          {"▁Hey", "▁friend"}),
              ElementsAre(" Hey", " friend"));
  EXPECT_THAT(DecodeChain(R"({"type": "ByteFallback"})", {"a", "<0xE4>", "<0xB8>", "<0xAD>", "b"}),
              ElementsAre("a", "中", "b"));
  // An invalid run becomes one U+FFFD per byte, even if it starts with a valid character.
  EXPECT_THAT(DecodeChain(R"({"type": "ByteFallback"})", {"<0xE4>", "<0xB8>", "<0xAD>", "<0xE4>"}),
              ElementsAre("\uFFFD", "\uFFFD", "\uFFFD", "\uFFFD"));
  EXPECT_THAT(DecodeChain(R"({"type": "Strip", "content": " ", "start": 1, "stop": 1})", {"  a  ", " "}),
              ElementsAre(" a ", ""));
  EXPECT_THAT(DecodeChain(R"({"type": "Fuse"})", {"a", "b"}), ElementsAre("ab"));
}

}  // namespace
}  // namespace duet
