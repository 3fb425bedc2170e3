// Syntax tree and parser of the chat-template language (the Jinja subset of @huggingface/jinja).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "frontend/chat_template/chat_template_lexer.h"
#include "frontend/chat_template/chat_template_value.h"

namespace duet::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Type {
    kLiteral,     // literal
    kIdentifier,  // name
    kList,        // children: items
    kTuple,       // children: items
    kDict,        // children: key0, value0, key1, value1, ...
    kMember,      // children: object, key (a.b is a["b"])
    kSlice,       // children: object, start, stop, step (each may be null)
    kCall,        // children: callee, arguments (kKeyword for key=value)
    kKeyword,     // name = children[0]
    kUnary,       // name: "not", "-", "+"; children: operand
    kBinary,      // name: operator; children: left, right
    kFilter,      // name: filter; children: operand (null in a filter block), arguments; has_args
    kTest,        // name: test; children: operand; negate
    kTernary,     // children: condition, if_true, if_false
    kSelect,      // `x if cond` without else: children: value, condition
  };
  Type type;
  size_t offset = 0;
  std::string name;
  Value literal;
  std::vector<ExprPtr> children;
  bool negate = false;
  bool has_args = false;
};

struct Node;
using Body = std::vector<Node>;

struct Node {
  enum class Type {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // expr: test; body; alternate (elif is a nested kIf)
    kFor,          // target; expr: iterable (kSelect when filtered); body; alternate (else)
    kSet,          // target; expr or (block set) body
    kMacro,        // name; params (kIdentifier or kKeyword with default); body
    kCallBlock,    // expr: kCall of the macro; params: caller's parameters; body
    kFilterBlock,  // expr: kFilter with null operand; body
    kBreak,
    kContinue,
  };
  Type type;
  size_t offset = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr target;
  std::vector<ExprPtr> params;
  Body body;
  Body alternate;
};

// Syntax errors are InvalidArgument naming line and column.
absl::StatusOr<Body> ParseTemplate(const std::string& source);

}  // namespace duet::jinja
