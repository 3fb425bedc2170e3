#include "frontend/tokenizer/tokenizer_decoder.h"

#include <cctype>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "frontend/tokenizer/tokenizer_pattern.h"
#include "frontend/tokenizer/tokenizer_pretokenize.h"
#include "frontend/tokenizer/tokenizer_unicode.h"

namespace duet {
namespace {

// Maps the byte-level stand-in characters back to bytes; a token with any other character is
// taken as its raw UTF-8 bytes. The result is repaired as from_utf8_lossy.
class ByteLevelDecoder : public Decoder {
 public:
  ByteLevelDecoder() {
    const auto& alphabet = ByteLevelAlphabet();
    for (int byte = 0; byte < 256; ++byte) {
      size_t pos = 0;
      char_to_byte_[unicode::DecodeUtf8(alphabet[byte], pos)] = static_cast<char>(byte);
    }
  }
  void DecodeChain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const auto& token : tokens) {
      const size_t token_start = bytes.size();
      for (size_t pos = 0; pos < token.size();) {
        auto it = char_to_byte_.find(unicode::DecodeUtf8(token, pos));
        if (it == char_to_byte_.end()) {
          bytes.resize(token_start);
          bytes += token;
          break;
        }
        bytes.push_back(it->second);
      }
    }
    tokens = {unicode::Utf8Lossy(bytes)};
  }

 private:
  std::unordered_map<char32_t, char> char_to_byte_;
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void DecodeChain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string decoded;
      const std::string& token = tokens[i];
      for (size_t pos = 0; pos < token.size();) {
        if (token.compare(pos, replacement_.size(), replacement_) == 0) {
          // HF drops every replacement of the first token when a prefix space was added.
          if (i != 0 || !strip_first_) decoded.push_back(' ');
          pos += replacement_.size();
        } else {
          decoded.push_back(token[pos++]);
        }
      }
      tokens[i] = std::move(decoded);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(TokenizerRegex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) token = pattern_.ReplaceAll(token, content_);
  }

 private:
  TokenizerRegex pattern_;
  std::string content_;
};

// Runs of "<0xXX>" tokens become the bytes they name when those are valid UTF-8, else one U+FFFD
// per byte.
class ByteFallbackDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending_bytes;
    auto flush = [&] {
      if (pending_bytes.empty()) return;
      if (unicode::IsValidUtf8(pending_bytes)) {
        out.push_back(pending_bytes);
      } else {
        for (size_t i = 0; i < pending_bytes.size(); ++i) out.emplace_back(unicode::kReplacementChar);
      }
      pending_bytes.clear();
    };
    for (auto& token : tokens) {
      if (token.size() == 6 && token.starts_with("<0x") && token.ends_with(">") &&
          std::isxdigit(static_cast<unsigned char>(token[3])) &&
          std::isxdigit(static_cast<unsigned char>(token[4]))) {
        pending_bytes.push_back(static_cast<char>(std::stoi(token.substr(3, 2), nullptr, 16)));
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>& tokens) const override {
    tokens = {absl::StrJoin(tokens, "")};
  }
};

// Removes up to `start` leading and `stop` trailing `content` characters from each token.
class StripDecoder : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) {
      std::vector<size_t> char_starts;
      std::vector<char32_t> chars;
      for (size_t pos = 0; pos < token.size();) {
        char_starts.push_back(pos);
        chars.push_back(unicode::DecodeUtf8(token, pos));
      }
      char_starts.push_back(token.size());
      size_t begin = 0;
      while (begin < start_ && begin < chars.size() && chars[begin] == content_) ++begin;
      size_t end = chars.size();
      for (size_t i = 0; i < stop_ && end > begin && chars[end - 1] == content_; ++i) --end;
      token = token.substr(char_starts[begin], char_starts[end] - char_starts[begin]);
    }
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps) : steps_(std::move(steps)) {}
  void DecodeChain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->DecodeChain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> Decoder::FromJson(const nlohmann::json& config) {
  const std::string type = config.at("type").get<std::string>();
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const auto& step_config : config.at("decoders")) {
      auto step = FromJson(step_config);
      if (!step.ok()) return step.status();
      steps.push_back(*std::move(step));
    }
    return std::make_unique<SequenceDecoder>(std::move(steps));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    bool strip_first = config.value("add_prefix_space", true);
    if (config.contains("prepend_scheme")) {
      strip_first = config.at("prepend_scheme").get<std::string>() != "never";
    }
    std::string replacement = config.value("replacement", std::string("\xE2\x96\x81"));
    if (replacement.empty()) return absl::InvalidArgumentError("Metaspace replacement is empty");
    return std::make_unique<MetaspaceDecoder>(std::move(replacement), strip_first);
  }
  if (type == "Replace") {
    auto pattern = PatternFromJson(config.at("pattern"));
    if (!pattern.ok()) return pattern.status();
    return std::make_unique<ReplaceDecoder>(*std::move(pattern), config.at("content").get<std::string>());
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    const std::string content = config.at("content").get<std::string>();
    size_t pos = 0;
    const char32_t content_char = content.empty() ? 0 : unicode::DecodeUtf8(content, pos);
    if (content.empty() || pos != content.size()) {
      return absl::InvalidArgumentError("Strip decoder content must be one character");
    }
    return std::make_unique<StripDecoder>(content_char, config.value("start", size_t{0}),
                                          config.value("stop", size_t{0}));
  }
  return absl::UnimplementedError(absl::StrCat("unsupported decoder type '", type, "'"));
}

}  // namespace duet
