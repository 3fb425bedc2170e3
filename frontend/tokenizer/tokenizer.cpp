#include "frontend/tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "frontend/tokenizer/tokenizer_added_tokens.h"
#include "frontend/tokenizer/tokenizer_bpe.h"
#include "frontend/tokenizer/tokenizer_decoder.h"
#include "frontend/tokenizer/tokenizer_normalizer.h"
#include "frontend/tokenizer/tokenizer_pretokenize.h"
#include "frontend/tokenizer/tokenizer_unicode.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

using nlohmann::json;

// One step of post-processing: the output is the template with the encoded text in place of its
// sequence slot (e.g. [BOS] A).
struct PostTemplateItem {
  bool is_sequence = false;
  std::vector<int32_t> special_ids;
};
using PostTemplate = std::vector<PostTemplateItem>;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return contents.str();
}

absl::Status ParsePostProcessor(const json& config, std::vector<PostTemplate>& templates) {
  if (config.is_null()) return absl::OkStatus();
  const std::string type = config.at("type").get<std::string>();
  if (type == "Sequence") {
    for (const auto& step : config.at("processors")) {
      if (auto status = ParsePostProcessor(step, templates); !status.ok()) return status;
    }
    return absl::OkStatus();
  }
  if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    // Single sequence: [CLS] A [SEP]; cls and sep are [token, id].
    PostTemplate post_template;
    post_template.push_back({false, {config.at("cls").at(1).get<int32_t>()}});
    post_template.push_back({true, {}});
    post_template.push_back({false, {config.at("sep").at(1).get<int32_t>()}});
    templates.push_back(std::move(post_template));
    return absl::OkStatus();
  }
  if (type == "TemplateProcessing") {
    const json& special_tokens = config.value("special_tokens", json::object());
    PostTemplate post_template;
    for (const auto& item : config.at("single")) {
      if (item.contains("Sequence")) {
        if (item["Sequence"].at("id").get<std::string>() != "A") {
          return absl::InvalidArgumentError("TemplateProcessing single template uses sequence B");
        }
        post_template.push_back({true, {}});
        continue;
      }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      if (!special_tokens.contains(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("TemplateProcessing special token '", name, "' is not defined"));
      }
      post_template.push_back({false, special_tokens[name].at("ids").get<std::vector<int32_t>>()});
    }
    templates.push_back(std::move(post_template));
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrCat("unsupported post_processor type '", type, "'"));
}

class HfTokenizer final : public Tokenizer {
 public:
  static absl::StatusOr<std::unique_ptr<HfTokenizer>> FromJson(const json& root);

  std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens) const override;
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  std::optional<std::string> IdToToken(int32_t id) const override;
  bool IsSpecial(int32_t id) const override;
  std::optional<int32_t> bos_token_id() const override { return bos_token_id_; }
  std::optional<int32_t> eos_token_id() const override { return eos_token_id_; }

  // Sets bos/eos from a tokenizer_config.json object.
  absl::Status ApplyConfig(const json& config);

 private:
  HfTokenizer() = default;
  const AddedToken* FindAddedToken(int32_t id) const;
  void EncodeOrdinaryText(std::string_view text, bool at_text_start, std::vector<int32_t>& ids) const;

  std::unique_ptr<Normalizer> normalizer_;      // may be null
  std::unique_ptr<PreTokenizer> pre_tokenizer_;  // may be null
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;  // may be null: tokens are then joined with spaces
  std::vector<PostTemplate> post_templates_;
  std::vector<AddedToken> added_tokens_;
  std::unordered_map<int32_t, size_t> added_token_index_by_id_;
  TokenIdMap added_token_id_by_content_;
  std::unique_ptr<AddedTokenMatcher> raw_matcher_;         // added tokens with normalized=false
  std::unique_ptr<AddedTokenMatcher> normalized_matcher_;  // added tokens with normalized=true
  int32_t vocab_size_ = 0;
  std::optional<int32_t> bos_token_id_;
  std::optional<int32_t> eos_token_id_;
};

absl::StatusOr<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(const json& root) {
  if (!root.is_object()) return absl::InvalidArgumentError("tokenizer.json is not a JSON object");
  std::unique_ptr<HfTokenizer> tokenizer(new HfTokenizer());

  const json& model = root.at("model");
  const std::string model_type = model.value("type", model.contains("merges") ? "BPE" : "");
  if (model_type != "BPE") {
    return absl::UnimplementedError(
        absl::StrCat("unsupported tokenizer model type '", model_type, "' (only BPE is supported)"));
  }
  auto bpe = BpeModel::FromJson(model);
  if (!bpe.ok()) return bpe.status();
  tokenizer->model_ = *std::move(bpe);

  if (root.contains("normalizer") && !root["normalizer"].is_null()) {
    auto normalizer = Normalizer::FromJson(root["normalizer"]);
    if (!normalizer.ok()) return normalizer.status();
    tokenizer->normalizer_ = *std::move(normalizer);
  }
  if (root.contains("pre_tokenizer") && !root["pre_tokenizer"].is_null()) {
    auto pre_tokenizer = PreTokenizer::FromJson(root["pre_tokenizer"]);
    if (!pre_tokenizer.ok()) return pre_tokenizer.status();
    tokenizer->pre_tokenizer_ = *std::move(pre_tokenizer);
  }
  if (root.contains("decoder") && !root["decoder"].is_null()) {
    auto decoder = Decoder::FromJson(root["decoder"]);
    if (!decoder.ok()) return decoder.status();
    tokenizer->decoder_ = *std::move(decoder);
  }
  if (auto status = ParsePostProcessor(root.value("post_processor", json()), tokenizer->post_templates_);
      !status.ok()) {
    return status;
  }

  int32_t max_id = tokenizer->model_->max_id();
  std::vector<AddedToken> raw_tokens, normalized_tokens;
  std::vector<std::string> raw_patterns, normalized_patterns;
  for (const auto& entry : root.value("added_tokens", json::array())) {
    AddedToken token;
    const int64_t id = entry.at("id").get<int64_t>();
    if (id < 0 || id > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("bad added token id ", id));
    }
    token.id = static_cast<int32_t>(id);
    token.content = entry.at("content").get<std::string>();
    token.special = entry.value("special", false);
    token.single_word = entry.value("single_word", false);
    token.lstrip = entry.value("lstrip", false);
    token.rstrip = entry.value("rstrip", false);
    token.normalized = entry.value("normalized", !token.special);
    max_id = std::max(max_id, token.id);
    tokenizer->added_token_index_by_id_[token.id] = tokenizer->added_tokens_.size();
    tokenizer->added_token_id_by_content_.emplace(token.content, token.id);
    tokenizer->added_tokens_.push_back(token);
    if (token.normalized) {
      normalized_patterns.push_back(tokenizer->normalizer_
                                        ? tokenizer->normalizer_->Normalize(token.content)
                                        : token.content);
      normalized_tokens.push_back(std::move(token));
    } else {
      raw_patterns.push_back(token.content);
      raw_tokens.push_back(std::move(token));
    }
  }
  tokenizer->raw_matcher_ =
      std::make_unique<AddedTokenMatcher>(std::move(raw_tokens), std::move(raw_patterns));
  tokenizer->normalized_matcher_ = std::make_unique<AddedTokenMatcher>(
      std::move(normalized_tokens), std::move(normalized_patterns));
  tokenizer->vocab_size_ = max_id + 1;
  return tokenizer;
}

absl::Status HfTokenizer::ApplyConfig(const json& config) {
  auto token_id = [&](const char* key, std::optional<int32_t>& id) -> absl::Status {
    if (!config.contains(key) || config[key].is_null()) return absl::OkStatus();
    const json& value = config[key];
    const std::string token =
        value.is_object() ? value.at("content").get<std::string>() : value.get<std::string>();
    id = TokenToId(token);
    if (!id) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer_config.json ", key, " '", token, "' is not in the vocabulary"));
    }
    return absl::OkStatus();
  };
  if (auto status = token_id("bos_token", bos_token_id_); !status.ok()) return status;
  return token_id("eos_token", eos_token_id_);
}

const AddedToken* HfTokenizer::FindAddedToken(int32_t id) const {
  auto it = added_token_index_by_id_.find(id);
  return it == added_token_index_by_id_.end() ? nullptr : &added_tokens_[it->second];
}

void HfTokenizer::EncodeOrdinaryText(std::string_view text, bool at_text_start,
                                     std::vector<int32_t>& ids) const {
  std::string normalized = normalizer_ ? normalizer_->Normalize(std::string(text)) : std::string(text);
  for (const TextSegment& segment : normalized_matcher_->Split(normalized)) {
    if (segment.added_token_id) {
      ids.push_back(*segment.added_token_id);
      continue;
    }
    std::vector<PreToken> pieces = {{normalized.substr(segment.begin, segment.end - segment.begin),
                                     at_text_start && segment.begin == 0}};
    if (pre_tokenizer_) pre_tokenizer_->PreTokenize(pieces);
    for (const auto& piece : pieces) model_->Tokenize(piece.text, ids);
  }
}

std::vector<int32_t> HfTokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::string repaired;
  if (!unicode::IsValidUtf8(text)) {
    repaired = unicode::Utf8Lossy(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  for (const TextSegment& segment : raw_matcher_->Split(text)) {
    if (segment.added_token_id) {
      ids.push_back(*segment.added_token_id);
    } else {
      EncodeOrdinaryText(text.substr(segment.begin, segment.end - segment.begin), segment.begin == 0,
                         ids);
    }
  }
  if (add_special_tokens) {
    for (const PostTemplate& post_template : post_templates_) {
      std::vector<int32_t> processed;
      for (const auto& item : post_template) {
        const auto& source = item.is_sequence ? ids : item.special_ids;
        processed.insert(processed.end(), source.begin(), source.end());
      }
      ids = std::move(processed);
    }
  }
  return ids;
}

std::string HfTokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (const AddedToken* added = FindAddedToken(id)) {
      if (!(skip_special_tokens && added->special)) tokens.push_back(added->content);
    } else if (const std::string* token = model_->IdToToken(id)) {
      tokens.push_back(*token);
    }
    // Unknown ids are skipped, as HF does.
  }
  if (!decoder_) return absl::StrJoin(tokens, " ");
  decoder_->DecodeChain(tokens);
  return absl::StrJoin(tokens, "");
}

std::optional<int32_t> HfTokenizer::TokenToId(std::string_view token) const {
  auto it = added_token_id_by_content_.find(AsKey(token));
  if (it != added_token_id_by_content_.end()) return it->second;
  return model_->TokenToId(token);
}

std::optional<std::string> HfTokenizer::IdToToken(int32_t id) const {
  if (const AddedToken* added = FindAddedToken(id)) return added->content;
  if (const std::string* token = model_->IdToToken(id)) return *token;
  return std::nullopt;
}

bool HfTokenizer::IsSpecial(int32_t id) const {
  const AddedToken* added = FindAddedToken(id);
  return added != nullptr && added->special;
}

absl::StatusOr<std::unique_ptr<HfTokenizer>> ParseTokenizerJson(const std::string& contents,
                                                                const std::string& path) {
  try {
    const json root = json::parse(contents);
    auto tokenizer = HfTokenizer::FromJson(root);
    if (!tokenizer.ok()) {
      return absl::Status(tokenizer.status().code(),
                          absl::StrCat(path, ": ", tokenizer.status().message()));
    }
    return tokenizer;
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": malformed tokenizer.json: ", e.what()));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& tokenizer_json_path) {
  auto contents = ReadFile(tokenizer_json_path);
  if (!contents.ok()) return contents.status();
  auto tokenizer = ParseTokenizerJson(*contents, tokenizer_json_path);
  if (!tokenizer.ok()) return tokenizer.status();
  return std::unique_ptr<Tokenizer>(*std::move(tokenizer));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromModelDir(const std::string& model_dir) {
  const std::string tokenizer_path = model_dir + "/tokenizer.json";
  auto contents = ReadFile(tokenizer_path);
  if (!contents.ok()) return contents.status();
  auto tokenizer = ParseTokenizerJson(*contents, tokenizer_path);
  if (!tokenizer.ok()) return tokenizer.status();

  const std::string config_path = model_dir + "/tokenizer_config.json";
  if (std::ifstream(config_path).good()) {
    auto config_contents = ReadFile(config_path);
    if (!config_contents.ok()) return config_contents.status();
    try {
      const json config = json::parse(*config_contents);
      if (!config.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(config_path, ": not a JSON object"));
      }
      if (auto status = (*tokenizer)->ApplyConfig(config); !status.ok()) return status;
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(config_path, ": malformed: ", e.what()));
    }
  }
  return std::unique_ptr<Tokenizer>(*std::move(tokenizer));
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : StreamingDecoder(tokenizer, {}, skip_special_tokens) {}

StreamingDecoder::StreamingDecoder(const Tokenizer& tokenizer, absl::Span<const int32_t> prompt_ids,
                                   bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {
  // A few prompt tokens are enough context for rules like SentencePiece's leading space.
  constexpr size_t kPromptContextTokens = 5;
  const size_t context = std::min(prompt_ids.size(), kPromptContextTokens);
  ids_.assign(prompt_ids.end() - context, prompt_ids.end());
  prefix_offset_ = 0;
  read_offset_ = ids_.size();
}

std::string StreamingDecoder::Push(int32_t id) {
  ids_.push_back(id);
  const absl::Span<const int32_t> ids(ids_);
  const std::string prefix_text =
      tokenizer_.Decode(ids.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string new_text = tokenizer_.Decode(ids.subspan(prefix_offset_), skip_special_tokens_);
  // Text ending in U+FFFD may be an incomplete UTF-8 sequence that a later token completes.
  if (new_text.size() <= prefix_text.size() || new_text.ends_with(unicode::kReplacementChar)) {
    return "";
  }
  // Lossy decoding can make the two texts differ before their end, so the cut may fall inside a
  // character; streamed pieces must each be valid UTF-8 (they travel as protobuf strings).
  std::string emitted = unicode::Utf8Lossy(std::string_view(new_text).substr(prefix_text.size()));
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  // Drop ids that can no longer matter, keeping memory bounded on long generations.
  ids_.erase(ids_.begin(), ids_.begin() + prefix_offset_);
  read_offset_ -= prefix_offset_;
  prefix_offset_ = 0;
  return emitted;
}

std::string StreamingDecoder::Flush() {
  const absl::Span<const int32_t> ids(ids_);
  const std::string prefix_text =
      tokenizer_.Decode(ids.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string new_text = tokenizer_.Decode(ids.subspan(prefix_offset_), skip_special_tokens_);
  ids_.erase(ids_.begin(), ids_.begin() + read_offset_);
  prefix_offset_ = 0;
  read_offset_ = ids_.size();
  return new_text.size() > prefix_text.size()
             ? unicode::Utf8Lossy(std::string_view(new_text).substr(prefix_text.size()))
             : "";
}

}  // namespace duet
