#include "frontend/chat_template/chat_template_lexer.h"

#include <algorithm>
#include <array>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace duet::jinja {
namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsWordChar(char c) {
  return IsDigit(c) || c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
bool IsHexDigit(char c) { return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// The text HF renders after its preprocessing (drop one trailing newline, lstrip_blocks,
// trim_blocks), with the original offset of every byte so errors point into the real source.
struct Preprocessed {
  std::string text;
  std::vector<size_t> origin;  // one per byte of text, plus the end
};

Preprocessed Preprocess(const std::string& source) {
  std::string_view src = source;
  if (!src.empty() && src.back() == '\n') src.remove_suffix(1);
  Preprocessed out;
  out.text.reserve(src.size());
  out.origin.reserve(src.size() + 1);
  for (size_t i = 0; i < src.size(); ++i) {
    if (i == 0 || src[i - 1] == '\n') {  // lstrip_blocks: blanks before a block tag or comment
      size_t j = i;
      while (j < src.size() && (src[j] == ' ' || src[j] == '\t')) ++j;
      if (j > i && j + 1 < src.size() && src[j] == '{' &&
          (src[j + 1] == '%' || src[j + 1] == '#' || src[j + 1] == '-')) {
        i = j;
      }
    }
    // trim_blocks: the newline right after "%}", "#}" (or "-}").
    if (src[i] == '\n' && i >= 2 && src[i - 1] == '}' &&
        (src[i - 2] == '%' || src[i - 2] == '#' || src[i - 2] == '-')) {
      continue;
    }
    out.text += src[i];
    out.origin.push_back(static_cast<size_t>(&src[i] - source.data()));
  }
  out.origin.push_back(src.size());
  return out;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

constexpr std::array<std::pair<std::string_view, TokenType>, 29> kSymbols = {{
    {"{%", TokenType::kOpenStatement},  {"%}", TokenType::kCloseStatement},
    {"{{", TokenType::kOpenExpression}, {"}}", TokenType::kCloseExpression},
    {"(", TokenType::kOpenParen},       {")", TokenType::kCloseParen},
    {"{", TokenType::kOpenBrace},       {"}", TokenType::kCloseBrace},
    {"[", TokenType::kOpenBracket},     {"]", TokenType::kCloseBracket},
    {",", TokenType::kComma},           {".", TokenType::kDot},
    {":", TokenType::kColon},           {"|", TokenType::kPipe},
    {"<=", TokenType::kComparison},     {">=", TokenType::kComparison},
    {"==", TokenType::kComparison},     {"!=", TokenType::kComparison},
    {"<", TokenType::kComparison},      {">", TokenType::kComparison},
    {"+", TokenType::kAdditive},        {"-", TokenType::kAdditive},
    {"~", TokenType::kAdditive},        {"**", TokenType::kPower},
    {"*", TokenType::kMultiplicative},  {"//", TokenType::kMultiplicative},
    {"/", TokenType::kMultiplicative},  {"%", TokenType::kMultiplicative},
    {"=", TokenType::kEquals},
}};

class Lexer {
 public:
  explicit Lexer(const std::string& source) : source_(source), pre_(Preprocess(source)), src_(pre_.text) {}

  absl::StatusOr<std::vector<Token>> Run() {
    while (pos_ < src_.size()) {
      if (!ScanOne()) return absl::InvalidArgumentError(error_);
    }
    return std::move(tokens_);
  }

 private:
  bool Fail(const std::string& message) {
    error_ = absl::StrCat("template syntax error at ", DescribePosition(source_, pre_.origin[pos_]), ": ", message);
    return false;
  }

  bool StartsWith(std::string_view s) const { return src_.compare(pos_, s.size(), s) == 0; }

  void Push(TokenType type, std::string value, size_t start) {
    tokens_.push_back(Token{type, std::move(value), pre_.origin[start]});
  }

  void StripTrailingWhitespace() {
    if (tokens_.empty() || tokens_.back().type != TokenType::kText) return;
    std::string& text = tokens_.back().value;
    while (!text.empty() && IsSpace(text.back())) text.pop_back();
    if (text.empty()) tokens_.pop_back();
  }

  void SkipWhitespace() {
    while (pos_ < src_.size() && IsSpace(src_[pos_])) ++pos_;
  }

  bool AtTagStart() const {
    return pos_ + 1 < src_.size() && src_[pos_] == '{' &&
           (src_[pos_ + 1] == '%' || src_[pos_ + 1] == '{' || src_[pos_ + 1] == '#');
  }

  bool ScanOne() {
    size_t start = pos_;
    bool outside_tags = tokens_.empty() || tokens_.back().type == TokenType::kCloseStatement ||
                        tokens_.back().type == TokenType::kCloseExpression ||
                        tokens_.back().type == TokenType::kComment;
    if (outside_tags && !AtTagStart()) {
      while (pos_ < src_.size() && !AtTagStart()) ++pos_;
      Push(TokenType::kText, src_.substr(start, pos_ - start), start);
      return true;
    }
    if (StartsWith("{#")) return ScanComment();
    if (StartsWith("{%-") || StartsWith("{{-")) {
      StripTrailingWhitespace();
      bool statement = src_[pos_ + 1] == '%';
      Push(statement ? TokenType::kOpenStatement : TokenType::kOpenExpression, statement ? "{%" : "{{", start);
      if (!statement) brace_depth_ = 0;
      pos_ += 3;
      return true;
    }
    SkipWhitespace();
    if (pos_ >= src_.size()) return Fail("unexpected end of template inside a tag");
    start = pos_;
    if (StartsWith("-%}") || StartsWith("-}}")) {
      bool statement = src_[pos_ + 1] == '%';
      Push(statement ? TokenType::kCloseStatement : TokenType::kCloseExpression, statement ? "%}" : "}}", start);
      pos_ += 3;
      SkipWhitespace();
      return true;
    }
    char c = src_[pos_];
    if (c == '-' || c == '+') {
      if (tokens_.empty() || tokens_.back().type == TokenType::kText) {
        return Fail(absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
      TokenType last = tokens_.back().type;
      if (last != TokenType::kIdentifier && last != TokenType::kNumber && last != TokenType::kString &&
          last != TokenType::kCloseParen && last != TokenType::kCloseBracket) {
        ++pos_;
        std::string number = ScanDigits();
        if (!number.empty() && pos_ + 1 < src_.size() && src_[pos_] == '.' && IsDigit(src_[pos_ + 1])) {
          ++pos_;
          number += "." + ScanDigits();
        }
        Push(number.empty() ? TokenType::kUnary : TokenType::kNumber, std::string(1, c) + number, start);
        return true;
      }
    }
    for (const auto& [symbol, type] : kSymbols) {
      if (symbol == "}}" && brace_depth_ > 0) continue;
      if (!StartsWith(symbol)) continue;
      Push(type, std::string(symbol), start);
      if (type == TokenType::kOpenExpression) brace_depth_ = 0;
      if (type == TokenType::kOpenBrace) ++brace_depth_;
      if (type == TokenType::kCloseBrace) --brace_depth_;
      pos_ += symbol.size();
      return true;
    }
    if (c == '\'' || c == '"') return ScanString(c);
    if (IsDigit(c)) {
      std::string number = ScanDigits();
      bool after_dot = !tokens_.empty() && tokens_.back().type == TokenType::kDot;
      if (!after_dot && pos_ + 1 < src_.size() && src_[pos_] == '.' && IsDigit(src_[pos_ + 1])) {
        ++pos_;
        number += "." + ScanDigits();
      }
      Push(TokenType::kNumber, number, start);
      return true;
    }
    if (IsWordChar(c)) {
      while (pos_ < src_.size() && IsWordChar(src_[pos_])) ++pos_;
      Push(TokenType::kIdentifier, src_.substr(start, pos_ - start), start);
      return true;
    }
    return Fail(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  std::string ScanDigits() {
    size_t start = pos_;
    while (pos_ < src_.size() && IsDigit(src_[pos_])) ++pos_;
    return src_.substr(start, pos_ - start);
  }

  bool ScanComment() {
    size_t start = pos_;
    pos_ += 2;
    bool strip_before = pos_ < src_.size() && src_[pos_] == '-';
    if (strip_before) ++pos_;
    size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) {
      pos_ = start;
      return Fail("missing end of comment tag '#}'");
    }
    std::string comment = src_.substr(pos_, end - pos_);
    bool strip_after = !comment.empty() && comment.back() == '-';
    if (strip_before) StripTrailingWhitespace();
    Push(TokenType::kComment, std::move(comment), start);
    pos_ = end + 2;
    if (strip_after) SkipWhitespace();
    return true;
  }

  bool ScanString(char quote) {
    size_t start = pos_++;
    std::string value;
    while (pos_ < src_.size() && src_[pos_] != quote) {
      if (src_[pos_] != '\\') {
        value += src_[pos_++];
        continue;
      }
      if (++pos_ >= src_.size()) break;
      char escaped = src_[pos_++];
      if (escaped == 'x' || escaped == 'u') {
        size_t length = escaped == 'x' ? 2 : 4;
        if (pos_ + length > src_.size() ||
            !std::all_of(src_.begin() + pos_, src_.begin() + pos_ + length, IsHexDigit)) {
          return Fail("invalid hexadecimal escape sequence");
        }
        uint32_t unit = std::stoul(src_.substr(pos_, length), nullptr, 16);
        pos_ += length;
        // Joins a UTF-16 surrogate pair written as two \u escapes.
        if (unit >= 0xd800 && unit < 0xdc00 && src_.compare(pos_, 2, "\\u") == 0 && pos_ + 6 <= src_.size() &&
            std::all_of(src_.begin() + pos_ + 2, src_.begin() + pos_ + 6, IsHexDigit)) {
          uint32_t low = std::stoul(src_.substr(pos_ + 2, 4), nullptr, 16);
          if (low >= 0xdc00 && low < 0xe000) {
            unit = 0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00);
            pos_ += 6;
          }
        }
        AppendUtf8(unit, value);
        continue;
      }
      switch (escaped) {
        case 'n': value += '\n'; break;
        case 't': value += '\t'; break;
        case 'r': value += '\r'; break;
        case 'b': value += '\b'; break;
        case 'f': value += '\f'; break;
        case 'v': value += '\v'; break;
        case '\'': case '"': case '\\': value += escaped; break;
        default:
          pos_ -= 2;
          return Fail(absl::StrCat("unexpected escaped character '\\", std::string(1, escaped), "'"));
      }
    }
    if (pos_ >= src_.size()) {
      pos_ = start;
      return Fail("unterminated string literal");
    }
    ++pos_;
    Push(TokenType::kString, std::move(value), start);
    return true;
  }

  const std::string& source_;
  Preprocessed pre_;
  const std::string& src_;
  size_t pos_ = 0;
  int brace_depth_ = 0;
  std::vector<Token> tokens_;
  std::string error_;
};

}  // namespace

std::string DescribePosition(const std::string& source, size_t offset) {
  offset = std::min(offset, source.size());
  size_t line = 1 + std::count(source.begin(), source.begin() + offset, '\n');
  size_t line_start = offset == 0 ? std::string::npos : source.rfind('\n', offset - 1);
  size_t column = line_start == std::string::npos ? offset + 1 : offset - line_start;
  return absl::StrCat("line ", line, ", column ", column);
}

absl::StatusOr<std::vector<Token>> Tokenize(const std::string& source) { return Lexer(source).Run(); }

}  // namespace duet::jinja
