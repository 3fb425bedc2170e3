#include "frontend/tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <random>

#include "frontend/tokenizer/tokenizer_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using ::duet::testing::TokenizerFromJsonText;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

const std::string kTinyLlamaDir = std::string(DUET_MODELS_DIR) + "/tiny-code-llama";

std::unique_ptr<Tokenizer> LoadTinyLlama() {
  auto tokenizer = Tokenizer::FromModelDir(kTinyLlamaDir);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

TEST(TokenizerTest, MatchesReferenceIdsOfTinyCodeLlama) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  const auto reference = nlohmann::json::parse(
      testing::ReadTextFile(kTinyLlamaDir + "/reference_tokenizer.json"));
  ASSERT_FALSE(reference.empty());
  for (const auto& entry : reference) {
    const std::string text = entry.at("text").get<std::string>();
    const auto expected = entry.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tokenizer->Encode(text), expected) << text.substr(0, 80);
    EXPECT_EQ(tokenizer->Decode(expected), text) << text.substr(0, 80);
  }
}

TEST(TokenizerTest, ReadsBosAndEosFromTokenizerConfig) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->bos_token_id(), 0);
  EXPECT_EQ(tokenizer->eos_token_id(), 1);
  EXPECT_EQ(tokenizer->vocab_size(), 8192);
  EXPECT_TRUE(tokenizer->IsSpecial(0));
  EXPECT_FALSE(tokenizer->IsSpecial(100));
  EXPECT_EQ(tokenizer->TokenToId("<|begin_of_text|>"), 0);
  EXPECT_EQ(tokenizer->IdToToken(0), "<|begin_of_text|>");
  EXPECT_EQ(tokenizer->IdToToken(-1), std::nullopt);
  EXPECT_EQ(tokenizer->IdToToken(1 << 20), std::nullopt);
}

TEST(TokenizerTest, SpecialTokensInTextAreMatchedAndSkippableOnDecode) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  const auto ids = tokenizer->Encode("<|begin_of_text|>hi<|end_of_text|>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids.back(), 1);
  EXPECT_EQ(tokenizer->Decode(ids, /*skip_special_tokens=*/true), "hi");
  EXPECT_EQ(tokenizer->Decode(ids, /*skip_special_tokens=*/false),
            "<|begin_of_text|>hi<|end_of_text|>");
}

TEST(TokenizerTest, DecodeSkipsInvalidIds) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  const auto ids = tokenizer->Encode("hello");
  std::vector<int32_t> with_bad = {-5, 1 << 30};
  with_bad.insert(with_bad.end(), ids.begin(), ids.end());
  with_bad.push_back(tokenizer->vocab_size());
  EXPECT_EQ(tokenizer->Decode(with_bad), "hello");
  EXPECT_EQ(tokenizer->Decode({}), "");
}

TEST(TokenizerTest, EncodeRepairsInvalidUtf8) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  const std::string invalid = "ab\xff\xc3(cd\xe4\xb8";
  EXPECT_EQ(tokenizer->Decode(tokenizer->Encode(invalid)), "ab\uFFFD\uFFFD(cd\uFFFD");
  EXPECT_THAT(tokenizer->Encode(""), IsEmpty());
}

TEST(TokenizerTest, CorruptFilesAreErrors) {
  EXPECT_FALSE(Tokenizer::FromFile("/nonexistent/tokenizer.json").ok());
  EXPECT_FALSE(Tokenizer::FromModelDir("/nonexistent").ok());
  const std::string bad_inputs[] = {
      "",
      "{",
      "[]",
      "{\"model\": 3}",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}}})",                              // no merges
      R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})",                        // unsupported
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})",          // b unknown
      R"({"model": {"type": "BPE", "vocab": {"a": -3}, "merges": []}})",              // bad id
      R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})",             // bad id type
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["ab"]}})",           // bad merge
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "end_of_word_suffix": "</w>"}})",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "normalizer": {"type": "NFKC"}})",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated"}})",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "a"}, "behavior": "Sideways"}})",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "decoder": {"type": "CTC"}})",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "added_tokens": [{"content": "x"}]})",
      R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}], "special_tokens": {}}})",
  };
  for (const std::string& json : bad_inputs) {
    auto tokenizer = TokenizerFromJsonText(json);
    EXPECT_FALSE(tokenizer.ok()) << json;
  }
}

TEST(TokenizerTest, BadTokenizerConfigIsAnError) {
  const std::string dir = ::testing::TempDir() + "/duet_bad_config";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(kTinyLlamaDir + "/tokenizer.json", dir + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": {"content": "<nope>"}})";
  EXPECT_FALSE(Tokenizer::FromModelDir(dir).ok());
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": {"content": "<|pad|>"}, "bos_token": null})";
  auto tokenizer = Tokenizer::FromModelDir(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->eos_token_id(), 2);
  EXPECT_EQ((*tokenizer)->bos_token_id(), std::nullopt);
}

// A Llama-2 style SentencePiece BPE: Prepend/Replace normalizer, byte fallback, and the
// Replace/ByteFallback/Fuse/Strip decoder.
constexpr char kLlama2Style[] = R"({
  "added_tokens": [
    {"id": 0, "content": "<unk>", "special": true, "normalized": false},
    {"id": 1, "content": "<s>", "special": true, "normalized": false},
    {"id": 2, "content": "</s>", "special": true, "normalized": false}
  ],
  "normalizer": {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "▁"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
  "pre_tokenizer": null,
  "post_processor": {"type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": true,
    "byte_fallback": true, "ignore_merges": false,
    "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xE4>": 3, "<0xB8>": 4, "<0xAD>": 5, "<0x0A>": 6,
              "▁": 7, "h": 8, "i": 9, "▁h": 10, "▁hi": 11, "t": 12, "he": 13, "e": 14, "▁t": 15},
    "merges": [["▁", "h"], "▁h i", "▁ t", "h e"]}
})";

TEST(TokenizerTest, Llama2StyleNormalizerByteFallbackAndDecoder) {
  auto tokenizer = TokenizerFromJsonText(kLlama2Style);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const Tokenizer& t = **tokenizer;
  EXPECT_THAT(t.Encode("hi"), ElementsAre(11));
  EXPECT_THAT(t.Encode("hi", /*add_special_tokens=*/true), ElementsAre(1, 11));
  // "中" has no token: its three bytes fall back to <0xE4><0xB8><0xAD>; "x" is unknown.
  EXPECT_THAT(t.Encode("hi 中\nx"), ElementsAre(11, 7, 3, 4, 5, 6, 0));
  EXPECT_EQ(t.Decode({11, 7, 3, 4, 5, 6}), "hi 中\n");
  EXPECT_EQ(t.Decode({1, 11, 15, 13}), "hi the");
  EXPECT_EQ(t.Decode({1, 11, 15, 13}, /*skip_special_tokens=*/false), "<s> hi the");
  // An incomplete byte sequence decodes to one U+FFFD per byte, as HF's ByteFallback does.
  EXPECT_EQ(t.Decode({11, 3, 4}), "hi\uFFFD\uFFFD");
  // Each piece between special tokens is normalized separately (HF's Prepend behavior).
  EXPECT_THAT(t.Encode("<s>hi"), ElementsAre(1, 11));
}

// Newer SentencePiece-style files: Metaspace pre-tokenizer and decoder.
constexpr char kMetaspaceStyle[] = R"({
  "added_tokens": [{"id": 0, "content": "<s>", "special": true, "normalized": false}],
  "normalizer": null,
  "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
  "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
  "model": {"type": "BPE", "unk_token": null, "byte_fallback": false,
    "vocab": {"<s>": 0, "▁": 1, "h": 2, "i": 3, "▁h": 4, "▁hi": 5, "hi": 6},
    "merges": ["▁ h", "▁h i", "h i"]}
})";

TEST(TokenizerTest, MetaspacePrependsOnlyAtTextStartWithSchemeFirst) {
  auto tokenizer = TokenizerFromJsonText(kMetaspaceStyle);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const Tokenizer& t = **tokenizer;
  EXPECT_THAT(t.Encode("hi hi"), ElementsAre(5, 5));
  EXPECT_THAT(t.Encode("<s>hi"), ElementsAre(0, 6));
  EXPECT_EQ(t.Decode({5, 5}), "hi hi");
  EXPECT_EQ(t.Decode({0, 6, 5}, /*skip_special_tokens=*/false), "<s>hi hi");
}

constexpr char kAddedTokenOptions[] = R"({
  "added_tokens": [
    {"id": 10, "content": "<mask>", "special": true, "normalized": false, "lstrip": true, "rstrip": false},
    {"id": 11, "content": "<sep>", "special": true, "normalized": false, "rstrip": true},
    {"id": 12, "content": "cat", "special": false, "normalized": true, "single_word": true},
    {"id": 13, "content": "<m", "special": false, "normalized": false}
  ],
  "pre_tokenizer": {"type": "WhitespaceSplit"},
  "model": {"type": "BPE", "vocab": {"a": 0, "c": 1, "t": 2, "x": 3, "<": 4, "m": 5, ">": 6},
            "merges": []}
})";

TEST(TokenizerTest, AddedTokenOptions) {
  auto tokenizer = TokenizerFromJsonText(kAddedTokenOptions);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const Tokenizer& t = **tokenizer;
  // lstrip swallows the spaces before <mask>; rstrip the spaces after <sep>.
  EXPECT_THAT(t.Encode("x  <mask>x"), ElementsAre(3, 10, 3));
  EXPECT_THAT(t.Encode("x<sep>   x"), ElementsAre(3, 11, 3));
  // Longest match first: "<mask>" wins over "<m".
  EXPECT_THAT(t.Encode("<m<mask>"), ElementsAre(13, 10));
  // single_word: "cat" only as a whole word.
  EXPECT_THAT(t.Encode("a cat x"), ElementsAre(0, 12, 3));
  EXPECT_THAT(t.Encode("xcat"), ElementsAre(3, 1, 0, 2));
  EXPECT_EQ(t.vocab_size(), 14);
  // Without a decoder, tokens are joined by spaces.
  EXPECT_EQ(t.Decode({3, 10, 3}, /*skip_special_tokens=*/false), "x <mask> x");
  EXPECT_EQ(t.Decode({3, 10, 3}), "x x");
}

// Decoding every pushed id incrementally gives exactly the text of decoding them all at once.
void ExpectStreamingMatchesDecode(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                                  bool skip_special_tokens) {
  StreamingDecoder decoder(tokenizer, skip_special_tokens);
  std::string streamed;
  for (int32_t id : ids) streamed += decoder.Push(id);
  streamed += decoder.Flush();
  EXPECT_EQ(streamed, tokenizer.Decode(ids, skip_special_tokens));
}

TEST(StreamingDecoderTest, MatchesDecodeOnMultibyteText) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  for (const std::string text :
       {"hello world", "日本語のテキスト、中文测试", "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇺🇸!", "naïve café — ok",
        "<|begin_of_text|>x<|end_of_text|>"}) {
    const auto ids = tokenizer->Encode(text);
    ExpectStreamingMatchesDecode(*tokenizer, ids, true);
    ExpectStreamingMatchesDecode(*tokenizer, ids, false);
    StreamingDecoder decoder(*tokenizer, /*skip_special_tokens=*/false);
    std::string streamed;
    for (int32_t id : ids) {
      const std::string chunk = decoder.Push(id);
      // Every chunk is complete UTF-8: no partial character is ever emitted.
      EXPECT_EQ(chunk.find("\uFFFD"), std::string::npos) << text;
      streamed += chunk;
    }
    streamed += decoder.Flush();
    EXPECT_EQ(streamed, text);
  }
}

TEST(StreamingDecoderTest, MatchesDecodeOnRandomIds) {
  auto tokenizer = LoadTinyLlama();
  ASSERT_NE(tokenizer, nullptr);
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> any_id(-2, tokenizer->vocab_size() + 2);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids(1 + trial % 40);
    for (auto& id : ids) id = any_id(rng);
    ExpectStreamingMatchesDecode(*tokenizer, ids, trial % 2 == 0);
  }
}

TEST(StreamingDecoderTest, PromptGivesContextWithoutBeingEmitted) {
  auto tokenizer = TokenizerFromJsonText(kLlama2Style);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  // Prompt "<s> hi", then " the": the leading space must survive because of the prompt context.
  StreamingDecoder decoder(**tokenizer, std::vector<int32_t>{1, 11});
  std::string streamed = decoder.Push(15);
  streamed += decoder.Push(13);
  streamed += decoder.Flush();
  EXPECT_EQ(streamed, " the");
  // Byte-fallback pieces of one character are held back until complete.
  StreamingDecoder bytes(**tokenizer, std::vector<int32_t>{1, 11});
  EXPECT_EQ(bytes.Push(7), " ");
  EXPECT_EQ(bytes.Push(3), "");
  EXPECT_EQ(bytes.Push(4), "");
  EXPECT_EQ(bytes.Push(5), "中");
  EXPECT_EQ(bytes.Flush(), "");
}

}  // namespace
}  // namespace duet
