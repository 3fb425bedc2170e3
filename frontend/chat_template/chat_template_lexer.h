// Tokenizer of the chat-template language, following @huggingface/jinja: HF's
// trim_blocks/lstrip_blocks preprocessing, whitespace control ({%- -%} {{- -}} {#- -#}),
// comments, string escapes and negative number literals.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace duet::jinja {

// Whitespace as the language sees it (Python's str.isspace() on ASCII): what the lexer trims and
// what strip() and split() remove.
inline bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

enum class TokenType {
  kText,
  kNumber,
  kString,
  kIdentifier,
  kEquals,
  kOpenParen,
  kCloseParen,
  kOpenStatement,
  kCloseStatement,
  kOpenExpression,
  kCloseExpression,
  kOpenBracket,
  kCloseBracket,
  kOpenBrace,
  kCloseBrace,
  kComma,
  kDot,
  kColon,
  kPipe,
  kAdditive,        // + - ~
  kMultiplicative,  // * / // %
  kPower,           // **
  kComparison,      // < > <= >= == !=
  kUnary,           // a sign with no number after it
  kComment,
};

struct Token {
  TokenType type;
  std::string value;
  size_t offset;  // into the original source
};

// "line L, column C" of a byte offset in source (1-based).
std::string DescribePosition(const std::string& source, size_t offset);

absl::StatusOr<std::vector<Token>> Tokenize(const std::string& source);

}  // namespace duet::jinja
