// A context-free grammar over bytes, the form every constraint (EBNF, regex, JSON schema,
// choice) is lowered to before matching.
//
// Rules are lists of alternatives; an alternative is a sequence of elements, each a byte class
// (a set of bytes) or a reference to a rule. Characters are UTF-8: a character class over code
// points becomes alternatives of byte-class sequences. Repetition becomes right-recursive helper
// rules (`x*` is `r ::= x r | ""`), whose recursive reference is a tail call for the matcher, so
// loops stay inside one rule (what the token-mask cache needs; see matcher.h).
//
// The grammar is stored flat: `elements()` holds every alternative's elements followed by an
// end marker, and a position is an index into it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace duet::grammar {

// A set of bytes.
struct ByteClass {
  std::array<uint64_t, 4> bits{};
  bool Contains(uint8_t b) const { return (bits[b >> 6] >> (b & 63)) & 1; }
  void Add(uint8_t b) { bits[b >> 6] |= uint64_t(1) << (b & 63); }
  void AddRange(uint8_t lo, uint8_t hi) {
    for (int b = lo; b <= hi; ++b) Add(uint8_t(b));
  }
  bool operator==(const ByteClass&) const = default;
};

struct Element {
  enum Kind : uint8_t { kEnd, kBytes, kRule };
  Kind kind = kEnd;
  int32_t id = 0;  // kBytes: index into byte_classes(); kRule: rule index
};

// An expression of the grammar languages before lowering (EBNF and regex parse into it).
struct Expr {
  enum Kind { kSequence, kAlternation, kLiteral, kCharClass, kRuleRef, kRepeat };
  Kind kind = kSequence;
  std::vector<Expr> children;           // kSequence, kAlternation; kRepeat: one child
  std::string literal;                  // kLiteral: UTF-8 bytes; kRuleRef: the rule's name
  std::vector<std::pair<uint32_t, uint32_t>> ranges;  // kCharClass: code point ranges, inclusive
  int32_t min = 0, max = -1;            // kRepeat: max -1 is unbounded

  static Expr Sequence(std::vector<Expr> children);
  static Expr Alternation(std::vector<Expr> children);
  static Expr Literal(std::string bytes);
  // `ranges` of code points; `negated` takes the complement within U+0000..U+10FFFF.
  static Expr CharClass(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negated = false);
  static Expr AnyChar();  // any code point
  static Expr RuleRef(std::string name);
  static Expr Repeat(Expr child, int32_t min, int32_t max);
};

class Grammar {
 public:
  // Lowers named rules (the start rule is `root_name`). InvalidArgument for an undefined rule,
  // left recursion, a repetition of something that can match nothing, or a grammar too large.
  static absl::StatusOr<std::shared_ptr<const Grammar>> Build(
      const std::vector<std::pair<std::string, Expr>>& rules, const std::string& root_name);

  const std::vector<Element>& elements() const { return elements_; }
  const Element& at(int32_t pos) const { return elements_[size_t(pos)]; }
  const std::vector<ByteClass>& byte_classes() const { return byte_classes_; }
  const ByteClass& byte_class(int32_t pos) const { return byte_classes_[size_t(elements_[size_t(pos)].id)]; }
  // Start positions of rule `rule`'s alternatives.
  const std::vector<int32_t>& alternatives(int32_t rule) const { return alternatives_[size_t(rule)]; }
  int32_t root() const { return root_; }
  int32_t num_rules() const { return int32_t(alternatives_.size()); }
  const std::string& rule_name(int32_t rule) const { return names_[size_t(rule)]; }
  // The grammar in EBNF, for tests and debugging (byte classes as [\xNN-\xMM]).
  std::string ToString() const;

 private:
  friend class GrammarLowering;
  std::vector<Element> elements_;
  std::vector<ByteClass> byte_classes_;
  std::vector<std::vector<int32_t>> alternatives_;
  std::vector<std::string> names_;
  int32_t root_ = 0;
};

// The EBNF this engine reads is llama.cpp's GBNF: `name ::= alternatives` rules (a rule may span
// lines; a new one starts at `name ::=`), `|`, juxtaposition, `( )`, `"literal"` with \n \t \r
// \\ \" \xNN \uNNNN \UNNNNNNNN escapes, character classes `[a-z]`, `[^"\\]` (same escapes), `.`
// (any character), `*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`, `#` comments. The start rule is `root`.
absl::StatusOr<std::shared_ptr<const Grammar>> ParseGbnf(const std::string& text);
// The same, returning the rules unlowered (the JSON-schema converter adds its own).
absl::StatusOr<std::vector<std::pair<std::string, Expr>>> ParseGbnfRules(const std::string& text);

}  // namespace duet::grammar
