#include "frontend/chat_template/chat_template_parser.h"

#include <cerrno>
#include <cstdlib>
#include <initializer_list>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace duet::jinja {
namespace {

// Deeper nesting than this is refused, so hostile templates cannot exhaust the stack.
constexpr int kMaxNesting = 200;

struct ParseError {
  size_t offset;
  std::string message;
};

class Parser {
 public:
  Parser(const std::string& source, std::vector<Token> tokens) : source_(source), tokens_(std::move(tokens)) {}

  Body ParseProgram() {
    Body program;
    while (!AtEnd()) program.push_back(ParseAny());
    return program;
  }

 private:
  // Keeps the recursion depth of the parser bounded.
  class NestingGuard {
   public:
    explicit NestingGuard(Parser& parser) : parser_(parser) {
      if (++parser_.nesting_ > kMaxNesting) parser_.Fail("template nested too deeply");
    }
    ~NestingGuard() { --parser_.nesting_; }

   private:
    Parser& parser_;
  };

  bool AtEnd() const { return current_ >= tokens_.size(); }
  size_t Offset() const { return AtEnd() ? source_.size() : tokens_[current_].offset; }

  [[noreturn]] void Fail(const std::string& message) const { throw ParseError{Offset(), message}; }

  bool Is(TokenType type, size_t ahead = 0) const {
    return current_ + ahead < tokens_.size() && tokens_[current_ + ahead].type == type;
  }
  bool IsIdentifier(std::string_view name, size_t ahead = 0) const {
    return Is(TokenType::kIdentifier, ahead) && tokens_[current_ + ahead].value == name;
  }
  bool IsStatement(std::initializer_list<std::string_view> names) const {
    if (!Is(TokenType::kOpenStatement) || !Is(TokenType::kIdentifier, 1)) return false;
    for (std::string_view name : names) {
      if (tokens_[current_ + 1].value == name) return true;
    }
    return false;
  }

  const Token& Expect(TokenType type, const std::string& what) {
    if (!Is(type)) {
      Fail(AtEnd() ? absl::StrCat("unexpected end of template, expected ", what)
                   : absl::StrCat("expected ", what, ", got '", tokens_[current_].value, "'"));
    }
    return tokens_[current_++];
  }
  void ExpectIdentifier(const std::string& name) {
    if (!IsIdentifier(name)) Fail(absl::StrCat("expected '", name, "'"));
    ++current_;
  }

  // Parses statements until one of `ends` opens; fails naming the opening tag at end of input.
  Body ParseUntil(std::initializer_list<std::string_view> ends, const Node& opener, const std::string& end_tag) {
    Body body;
    while (!IsStatement(ends)) {
      if (AtEnd()) {
        throw ParseError{opener.offset, absl::StrCat("unclosed block: missing {% ", end_tag, " %}")};
      }
      body.push_back(ParseAny());
    }
    return body;
  }

  void ExpectEndTag(const std::string& name) {
    Expect(TokenType::kOpenStatement, "'{%'");
    ExpectIdentifier(name);
    Expect(TokenType::kCloseStatement, "'%}'");
  }

  Node ParseAny() {
    NestingGuard guard(*this);
    const Token& token = tokens_[current_];
    Node node;
    node.offset = token.offset;
    switch (token.type) {
      case TokenType::kText:
        node.type = Node::Type::kText;
        node.text = token.value;
        ++current_;
        return node;
      case TokenType::kComment:
        node.type = Node::Type::kText;
        ++current_;
        return node;
      case TokenType::kOpenExpression:
        ++current_;
        node.type = Node::Type::kOutput;
        node.expr = ParseExpression();
        Expect(TokenType::kCloseExpression, "'}}'");
        return node;
      case TokenType::kOpenStatement:
        ++current_;
        ParseStatement(node);
        return node;
      default:
        Fail(absl::StrCat("unexpected '", token.value, "'"));
    }
  }

  void ParseStatement(Node& node) {
    if (!Is(TokenType::kIdentifier)) Fail("expected a statement name after '{%'");
    std::string name = tokens_[current_++].value;
    if (name == "set") {
      node.type = Node::Type::kSet;
      node.target = ParseExpressionSequence(false);
      if (Is(TokenType::kEquals)) {
        ++current_;
        node.expr = ParseExpressionSequence(false);
      } else {
        Expect(TokenType::kCloseStatement, "'%}' or '='");
        node.body = ParseUntil({"endset"}, node, "endset");
        Expect(TokenType::kOpenStatement, "'{%'");
        ExpectIdentifier("endset");
      }
      Expect(TokenType::kCloseStatement, "'%}'");
    } else if (name == "if") {
      ParseIf(node);
      ExpectEndTag("endif");
    } else if (name == "for") {
      ParseFor(node);
      ExpectEndTag("endfor");
    } else if (name == "macro") {
      node.type = Node::Type::kMacro;
      if (!Is(TokenType::kIdentifier)) Fail("expected a macro name");
      node.text = tokens_[current_++].value;
      node.params = ParseArguments(/*parameters=*/true);
      Expect(TokenType::kCloseStatement, "'%}'");
      node.body = ParseUntil({"endmacro"}, node, "endmacro");
      ExpectEndTag("endmacro");
    } else if (name == "call") {
      node.type = Node::Type::kCallBlock;
      if (Is(TokenType::kOpenParen)) node.params = ParseArguments(/*parameters=*/true);
      if (!Is(TokenType::kIdentifier)) Fail("expected a macro name after 'call'");
      auto call = MakeExpr(Expr::Type::kCall);
      auto callee = MakeExpr(Expr::Type::kIdentifier);
      callee->name = tokens_[current_++].value;
      call->children.push_back(std::move(callee));
      for (auto& argument : ParseArguments(/*parameters=*/false)) call->children.push_back(std::move(argument));
      node.expr = std::move(call);
      Expect(TokenType::kCloseStatement, "'%}'");
      node.body = ParseUntil({"endcall"}, node, "endcall");
      ExpectEndTag("endcall");
    } else if (name == "filter") {
      node.type = Node::Type::kFilterBlock;
      node.expr = ParseFilter(nullptr);
      Expect(TokenType::kCloseStatement, "'%}'");
      node.body = ParseUntil({"endfilter"}, node, "endfilter");
      ExpectEndTag("endfilter");
    } else if (name == "break" || name == "continue") {
      node.type = name == "break" ? Node::Type::kBreak : Node::Type::kContinue;
      Expect(TokenType::kCloseStatement, "'%}'");
    } else {
      current_ -= 1;
      Fail(absl::StrCat("unknown statement '", name, "'"));
    }
  }

  void ParseIf(Node& node) {
    NestingGuard guard(*this);
    node.type = Node::Type::kIf;
    node.expr = ParseExpression();
    Expect(TokenType::kCloseStatement, "'%}'");
    node.body = ParseUntil({"elif", "else", "endif"}, node, "endif");
    if (IsStatement({"elif"})) {
      Node elif;
      elif.offset = tokens_[current_].offset;
      current_ += 2;
      ParseIf(elif);
      node.alternate.push_back(std::move(elif));
    } else if (IsStatement({"else"})) {
      current_ += 2;
      Expect(TokenType::kCloseStatement, "'%}'");
      node.alternate = ParseUntil({"endif"}, node, "endif");
    }
  }

  void ParseFor(Node& node) {
    node.type = Node::Type::kFor;
    node.target = ParseExpressionSequence(true);
    if (node.target->type != Expr::Type::kIdentifier && node.target->type != Expr::Type::kTuple) {
      Fail("expected a name or tuple of names as the loop variable");
    }
    if (!IsIdentifier("in")) Fail("expected 'in' after the loop variable");
    ++current_;
    node.expr = ParseExpression();
    Expect(TokenType::kCloseStatement, "'%}'");
    node.body = ParseUntil({"endfor", "else"}, node, "endfor");
    if (IsStatement({"else"})) {
      current_ += 2;
      Expect(TokenType::kCloseStatement, "'%}'");
      node.alternate = ParseUntil({"endfor"}, node, "endfor");
    }
  }

  ExprPtr MakeExpr(Expr::Type type) {
    auto expr = std::make_unique<Expr>();
    expr->type = type;
    expr->offset = Offset();
    return expr;
  }

  ExprPtr Binary(const std::string& op, ExprPtr left, ExprPtr right) {
    auto expr = MakeExpr(Expr::Type::kBinary);
    expr->offset = left->offset;
    expr->name = op;
    expr->children.push_back(std::move(left));
    expr->children.push_back(std::move(right));
    return expr;
  }

  ExprPtr ParseExpressionSequence(bool primary) {
    auto parse = [&] { return primary ? ParsePrimary() : ParseExpression(); };
    ExprPtr first = parse();
    if (!Is(TokenType::kComma)) return first;
    auto tuple = MakeExpr(Expr::Type::kTuple);
    tuple->offset = first->offset;
    tuple->children.push_back(std::move(first));
    while (Is(TokenType::kComma)) {
      ++current_;
      tuple->children.push_back(parse());
    }
    return tuple;
  }

  ExprPtr ParseExpression() {
    NestingGuard guard(*this);
    ExprPtr value = ParseOr();
    if (!IsIdentifier("if")) return value;
    ++current_;
    ExprPtr test = ParseOr();
    if (IsIdentifier("else")) {
      ++current_;
      auto ternary = MakeExpr(Expr::Type::kTernary);
      ternary->offset = value->offset;
      ternary->children.push_back(std::move(test));
      ternary->children.push_back(std::move(value));
      ternary->children.push_back(ParseExpression());
      return ternary;
    }
    auto select = MakeExpr(Expr::Type::kSelect);
    select->offset = value->offset;
    select->children.push_back(std::move(value));
    select->children.push_back(std::move(test));
    return select;
  }

  ExprPtr ParseOr() {
    ExprPtr left = ParseAnd();
    while (IsIdentifier("or")) {
      ++current_;
      left = Binary("or", std::move(left), ParseAnd());
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (IsIdentifier("and")) {
      ++current_;
      left = Binary("and", std::move(left), ParseNot());
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (!IsIdentifier("not")) return ParseComparison();
    NestingGuard guard(*this);
    auto expr = MakeExpr(Expr::Type::kUnary);
    expr->name = "not";
    ++current_;
    expr->children.push_back(ParseNot());
    return expr;
  }

  ExprPtr ParseComparison() {
    ExprPtr left = ParseAdditive();
    while (true) {
      std::string op;
      if (IsIdentifier("not") && IsIdentifier("in", 1)) {
        op = "not in";
        current_ += 2;
      } else if (IsIdentifier("in")) {
        op = "in";
        ++current_;
      } else if (Is(TokenType::kComparison)) {
        op = tokens_[current_++].value;
      } else {
        return left;
      }
      left = Binary(op, std::move(left), ParseAdditive());
    }
  }

  ExprPtr ParseAdditive() {
    ExprPtr left = ParseMultiplicative();
    while (Is(TokenType::kAdditive)) {
      std::string op = tokens_[current_++].value;
      left = Binary(op, std::move(left), ParseMultiplicative());
    }
    return left;
  }

  ExprPtr ParseMultiplicative() {
    ExprPtr left = ParsePower();
    while (Is(TokenType::kMultiplicative)) {
      std::string op = tokens_[current_++].value;
      left = Binary(op, std::move(left), ParsePower());
    }
    return left;
  }

  ExprPtr ParsePower() {
    ExprPtr left = ParseTest();
    while (Is(TokenType::kPower)) {
      ++current_;
      left = Binary("**", std::move(left), ParseTest());
    }
    return left;
  }

  ExprPtr ParseTest() {
    ExprPtr operand = ParseFilterChain();
    while (IsIdentifier("is")) {
      auto test = MakeExpr(Expr::Type::kTest);
      test->offset = operand->offset;
      ++current_;
      if (IsIdentifier("not")) {
        test->negate = true;
        ++current_;
      }
      if (!Is(TokenType::kIdentifier)) Fail("expected a test name after 'is'");
      test->name = tokens_[current_++].value;
      test->children.push_back(std::move(operand));
      operand = std::move(test);
    }
    return operand;
  }

  ExprPtr ParseFilterChain() {
    ExprPtr operand = ParseUnarySign();
    while (Is(TokenType::kPipe)) {
      ++current_;
      operand = ParseFilter(std::move(operand));
    }
    return operand;
  }

  // `name` or `name(args)`, applied to operand (null inside {% filter %}).
  ExprPtr ParseFilter(ExprPtr operand) {
    auto filter = MakeExpr(Expr::Type::kFilter);
    if (operand) filter->offset = operand->offset;
    if (!Is(TokenType::kIdentifier)) Fail("expected a filter name");
    filter->name = tokens_[current_++].value;
    filter->children.push_back(std::move(operand));
    if (Is(TokenType::kOpenParen)) {
      filter->has_args = true;
      for (auto& argument : ParseArguments(/*parameters=*/false)) filter->children.push_back(std::move(argument));
    }
    return filter;
  }

  ExprPtr ParseUnarySign() {
    if (Is(TokenType::kUnary) || (Is(TokenType::kAdditive) && tokens_[current_].value != "~")) {
      NestingGuard guard(*this);
      auto expr = MakeExpr(Expr::Type::kUnary);
      expr->name = tokens_[current_++].value;
      expr->children.push_back(ParseUnarySign());
      return expr;
    }
    return ParseCallMember();
  }

  ExprPtr ParseCallMember() {
    ExprPtr expr = ParseMembers(ParsePrimary());
    while (Is(TokenType::kOpenParen)) {
      auto call = MakeExpr(Expr::Type::kCall);
      call->offset = expr->offset;
      call->children.push_back(std::move(expr));
      for (auto& argument : ParseArguments(/*parameters=*/false)) call->children.push_back(std::move(argument));
      expr = ParseMembers(std::move(call));
    }
    return expr;
  }

  std::vector<ExprPtr> ParseArguments(bool parameters) {
    NestingGuard guard(*this);
    Expect(TokenType::kOpenParen, "'('");
    std::vector<ExprPtr> arguments;
    bool saw_keyword = false;
    while (!Is(TokenType::kCloseParen)) {
      if (AtEnd()) Fail("unexpected end of template, expected ')'");
      ExprPtr argument = ParseExpression();
      if (Is(TokenType::kEquals)) {
        if (argument->type != Expr::Type::kIdentifier) Fail("expected a name before '='");
        ++current_;
        auto keyword = MakeExpr(Expr::Type::kKeyword);
        keyword->offset = argument->offset;
        keyword->name = argument->name;
        keyword->children.push_back(ParseExpression());
        argument = std::move(keyword);
        saw_keyword = true;
      } else if (saw_keyword) {
        Fail("positional argument follows keyword argument");
      }
      if (parameters && argument->type != Expr::Type::kIdentifier && argument->type != Expr::Type::kKeyword) {
        Fail("expected a parameter name");
      }
      arguments.push_back(std::move(argument));
      if (Is(TokenType::kComma)) ++current_;
      else if (!Is(TokenType::kCloseParen)) Fail("expected ',' or ')'");
    }
    ++current_;
    return arguments;
  }

  ExprPtr ParseMembers(ExprPtr object) {
    while (Is(TokenType::kDot) || Is(TokenType::kOpenBracket)) {
      NestingGuard guard(*this);
      bool computed = Is(TokenType::kOpenBracket);
      ++current_;
      auto member = MakeExpr(Expr::Type::kMember);
      member->offset = object->offset;
      member->children.push_back(std::move(object));
      if (!computed) {
        auto key = MakeExpr(Expr::Type::kLiteral);
        if (Is(TokenType::kIdentifier)) {
          key->literal = Value::String(tokens_[current_++].value);
        } else if (Is(TokenType::kNumber) && tokens_[current_].value.find_first_of(".-+") == std::string::npos) {
          key->literal = Value::Int(std::strtoll(tokens_[current_++].value.c_str(), nullptr, 10));
        } else {
          Fail("expected a name after '.'");
        }
        member->children.push_back(std::move(key));
      } else {
        ParseSubscript(*member);
        Expect(TokenType::kCloseBracket, "']'");
      }
      object = std::move(member);
    }
    return object;
  }

  // `[key]` or a slice `[start:stop:step]` with any part omitted.
  void ParseSubscript(Expr& member) {
    std::vector<ExprPtr> parts;
    bool is_slice = false;
    parts.emplace_back();
    while (!Is(TokenType::kCloseBracket)) {
      if (AtEnd()) Fail("unexpected end of template, expected ']'");
      if (Is(TokenType::kColon)) {
        ++current_;
        is_slice = true;
        parts.emplace_back();
      } else {
        if (parts.back()) Fail("expected ':' or ']'");
        parts.back() = ParseExpression();
      }
    }
    if (!is_slice) {
      if (!parts[0]) Fail("expected an index inside '[]'");
      member.children.push_back(std::move(parts[0]));
      return;
    }
    if (parts.size() > 3) Fail("a slice takes at most three parts");
    member.type = Expr::Type::kSlice;
    parts.resize(3);
    for (auto& part : parts) member.children.push_back(std::move(part));
  }

  ExprPtr ParsePrimary() {
    NestingGuard guard(*this);
    if (AtEnd()) Fail("unexpected end of template, expected an expression");
    const Token& token = tokens_[current_];
    auto expr = MakeExpr(Expr::Type::kLiteral);
    ++current_;
    switch (token.type) {
      case TokenType::kNumber:
        if (token.value.find('.') != std::string::npos) {
          expr->literal = Value::Float(std::strtod(token.value.c_str(), nullptr));
        } else {
          errno = 0;
          long long value = std::strtoll(token.value.c_str(), nullptr, 10);
          if (errno == ERANGE) Fail("integer literal out of range");
          expr->literal = Value::Int(value);
        }
        return expr;
      case TokenType::kString: {
        std::string value = token.value;
        while (Is(TokenType::kString)) value += tokens_[current_++].value;  // adjacent literals join
        expr->literal = Value::String(std::move(value));
        return expr;
      }
      case TokenType::kIdentifier:
        expr->type = Expr::Type::kIdentifier;
        expr->name = token.value;
        return expr;
      case TokenType::kOpenParen: {
        ExprPtr inner = ParseExpressionSequence(false);
        Expect(TokenType::kCloseParen, "')'");
        return inner;
      }
      case TokenType::kOpenBracket:
        expr->type = Expr::Type::kList;
        while (!Is(TokenType::kCloseBracket)) {
          expr->children.push_back(ParseExpression());
          if (Is(TokenType::kComma)) ++current_;
          else if (!Is(TokenType::kCloseBracket)) Fail("expected ',' or ']'");
        }
        ++current_;
        return expr;
      case TokenType::kOpenBrace:
        expr->type = Expr::Type::kDict;
        while (!Is(TokenType::kCloseBrace)) {
          expr->children.push_back(ParseExpression());
          Expect(TokenType::kColon, "':'");
          expr->children.push_back(ParseExpression());
          if (Is(TokenType::kComma)) ++current_;
          else if (!Is(TokenType::kCloseBrace)) Fail("expected ',' or '}'");
        }
        ++current_;
        return expr;
      default:
        --current_;
        Fail(absl::StrCat("unexpected '", token.value, "'"));
    }
  }

  const std::string& source_;
  std::vector<Token> tokens_;
  size_t current_ = 0;
  int nesting_ = 0;
};

}  // namespace

absl::StatusOr<Body> ParseTemplate(const std::string& source) {
  absl::StatusOr<std::vector<Token>> tokens = Tokenize(source);
  if (!tokens.ok()) return tokens.status();
  try {
    return Parser(source, *std::move(tokens)).ParseProgram();
  } catch (const ParseError& error) {
    return absl::InvalidArgumentError(
        absl::StrCat("template syntax error at ", DescribePosition(source, error.offset), ": ", error.message));
  }
}

}  // namespace duet::jinja
