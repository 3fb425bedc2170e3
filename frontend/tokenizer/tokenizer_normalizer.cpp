#include "frontend/tokenizer/tokenizer_normalizer.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "frontend/tokenizer/tokenizer_pattern.h"
#include "frontend/tokenizer/tokenizer_unicode.h"

namespace duet {
namespace {

class NfcNormalizer : public Normalizer {
 public:
  std::string Normalize(std::string text) const override { return unicode::ToNfc(text); }
};

class LowercaseNormalizer : public Normalizer {
 public:
  std::string Normalize(std::string text) const override { return unicode::ToLowercase(text); }
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string Normalize(std::string text) const override {
    return text.empty() ? text : prefix_ + text;
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(TokenizerRegex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string Normalize(std::string text) const override {
    return pattern_.ReplaceAll(text, content_);
  }

 private:
  TokenizerRegex pattern_;
  std::string content_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  std::string Normalize(std::string text) const override {
    size_t begin = 0, end = text.size();
    if (left_) {
      for (size_t pos = 0; pos < text.size();) {
        if (!unicode::IsWhitespace(unicode::DecodeUtf8(text, pos))) break;
        begin = pos;
      }
    }
    if (right_) {
      // Walk back over whole characters while they are whitespace.
      while (end > begin) {
        size_t start = end - 1;
        while (start > begin && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        size_t pos = start;
        if (!unicode::IsWhitespace(unicode::DecodeUtf8(text, pos))) break;
        end = start;
      }
    }
    return text.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps)
      : steps_(std::move(steps)) {}
  std::string Normalize(std::string text) const override {
    for (const auto& step : steps_) text = step->Normalize(std::move(text));
    return text;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> Normalizer::FromJson(const nlohmann::json& config) {
  const std::string type = config.at("type").get<std::string>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const auto& step_config : config.at("normalizers")) {
      auto step = FromJson(step_config);
      if (!step.ok()) return step.status();
      steps.push_back(*std::move(step));
    }
    return std::make_unique<SequenceNormalizer>(std::move(steps));
  }
  if (type == "NFC") return std::make_unique<NfcNormalizer>();
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Prepend") {
    return std::make_unique<PrependNormalizer>(config.at("prepend").get<std::string>());
  }
  if (type == "Replace") {
    auto pattern = PatternFromJson(config.at("pattern"));
    if (!pattern.ok()) return pattern.status();
    return std::make_unique<ReplaceNormalizer>(*std::move(pattern),
                                               config.at("content").get<std::string>());
  }
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(config.value("strip_left", true),
                                             config.value("strip_right", true));
  }
  return absl::UnimplementedError(absl::StrCat("unsupported normalizer type '", type, "'"));
}

}  // namespace duet
