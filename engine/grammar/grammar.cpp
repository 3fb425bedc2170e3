#include "engine/grammar/grammar.h"

#include <algorithm>
#include <functional>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/grammar/utf8.h"

namespace duet::grammar {

Expr Expr::Sequence(std::vector<Expr> children) {
  Expr e;
  e.kind = kSequence;
  e.children = std::move(children);
  return e;
}

Expr Expr::Alternation(std::vector<Expr> children) {
  Expr e;
  e.kind = kAlternation;
  e.children = std::move(children);
  return e;
}

Expr Expr::Literal(std::string bytes) {
  Expr e;
  e.kind = kLiteral;
  e.literal = std::move(bytes);
  return e;
}

Expr Expr::CharClass(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negated) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (auto [lo, hi] : ranges) {
    if (lo > hi) continue;
    if (!merged.empty() && lo <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, hi);
    } else {
      merged.push_back({lo, hi});
    }
  }
  if (negated) {
    std::vector<std::pair<uint32_t, uint32_t>> complement;
    uint32_t next = 0;
    for (auto [lo, hi] : merged) {
      if (lo > next) complement.push_back({next, lo - 1});
      next = hi + 1;
    }
    if (next <= kMaxCodePoint) complement.push_back({next, kMaxCodePoint});
    merged = std::move(complement);
  }
  Expr e;
  e.kind = kCharClass;
  e.ranges = std::move(merged);
  return e;
}

Expr Expr::AnyChar() { return CharClass({{0, kMaxCodePoint}}); }

Expr Expr::RuleRef(std::string name) {
  Expr e;
  e.kind = kRuleRef;
  e.literal = std::move(name);
  return e;
}

Expr Expr::Repeat(Expr child, int32_t min, int32_t max) {
  Expr e;
  e.kind = kRepeat;
  e.children.push_back(std::move(child));
  e.min = min;
  e.max = max;
  return e;
}

// Lowers expressions into rules of element sequences, then flattens them into a Grammar.
class GrammarLowering {
 public:
  using Sequence = std::vector<Element>;
  using Alternatives = std::vector<Sequence>;

  absl::StatusOr<std::shared_ptr<const Grammar>> Run(const std::vector<std::pair<std::string, Expr>>& rules,
                                                     const std::string& root_name) {
    for (const auto& [name, expr] : rules) {
      if (rule_index_.count(name) && defined_[size_t(rule_index_[name])]) {
        return absl::InvalidArgumentError(absl::StrCat("grammar: rule '", name, "' is defined twice"));
      }
      defined_[size_t(RuleId(name))] = true;
    }
    for (const auto& [name, expr] : rules) {
      const int32_t id = rule_index_[name];
      Alternatives alts = Lower(expr);
      if (!error_.ok()) return error_;
      rules_[size_t(id)] = std::move(alts);
    }
    for (size_t i = 0; i < defined_.size(); ++i) {
      if (!defined_[i]) return absl::InvalidArgumentError(absl::StrCat("grammar: rule '", names_[i], "' is not defined"));
    }
    auto root = rule_index_.find(root_name);
    if (root == rule_index_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("grammar: no '", root_name, "' rule"));
    }
    if (absl::Status s = CheckNoLeftRecursion(); !s.ok()) return s;
    return Flatten(root->second);
  }

 private:
  static constexpr size_t kMaxInlinedAlternatives = 32;  // per alternative list, before a helper rule
  static constexpr size_t kMaxElements = size_t(1) << 22;
  static constexpr size_t kMaxCopiedElements = 16;

  int32_t RuleId(const std::string& name) {
    auto [it, inserted] = rule_index_.emplace(name, int32_t(names_.size()));
    if (inserted) {
      names_.push_back(name);
      rules_.emplace_back();
      defined_.push_back(false);
    }
    return it->second;
  }

  int32_t NewHelperRule(Alternatives alts) {
    const int32_t id = int32_t(names_.size());
    names_.push_back(absl::StrCat("_", id));
    rules_.push_back(std::move(alts));
    defined_.push_back(true);
    total_elements_ += 1;
    for (const Sequence& s : rules_.back()) total_elements_ += s.size() + 1;
    if (total_elements_ > kMaxElements && error_.ok()) {
      error_ = absl::InvalidArgumentError("grammar: too large (over 4M elements once expanded)");
    }
    return id;
  }

  int32_t ByteClassId(const ByteClass& c) {
    auto [it, inserted] = class_index_.emplace(c.bits, int32_t(classes_.size()));
    if (inserted) classes_.push_back(c);
    return it->second;
  }

  Element Bytes(uint8_t lo, uint8_t hi) {
    ByteClass c;
    c.AddRange(lo, hi);
    return Element{Element::kBytes, ByteClassId(c)};
  }

  static Element Ref(int32_t rule) { return Element{Element::kRule, rule}; }

  // Every sequence of `a` followed by every sequence of `b`; `b` goes into a helper rule first
  // when the product would be too large.
  Alternatives Concat(Alternatives a, Alternatives b) {
    if (!error_.ok()) return {};
    if (b.size() > 1 && a.size() * b.size() > kMaxInlinedAlternatives) b = {{Ref(NewHelperRule(std::move(b)))}};
    size_t size = 0;
    for (const Sequence& x : a) size += x.size() * b.size();
    for (const Sequence& y : b) size += y.size() * a.size();
    if (size > kMaxElements) {
      error_ = absl::InvalidArgumentError("grammar: too large (over 4M elements once expanded)");
      return {};
    }
    Alternatives out;
    out.reserve(a.size() * b.size());
    for (const Sequence& x : a) {
      for (const Sequence& y : b) {
        Sequence s = x;
        s.insert(s.end(), y.begin(), y.end());
        out.push_back(std::move(s));
      }
    }
    return out;
  }

  Alternatives Lower(const Expr& e) {
    switch (e.kind) {
      case Expr::kLiteral: {
        Sequence s;
        for (char c : e.literal) s.push_back(Bytes(uint8_t(c), uint8_t(c)));
        return {s};
      }
      case Expr::kCharClass: {
        Alternatives alts;
        for (auto [lo, hi] : e.ranges) {
          for (const Utf8Sequence& seq : Utf8Sequences(lo, hi)) {
            Sequence s;
            for (auto [blo, bhi] : seq) s.push_back(Bytes(blo, bhi));
            alts.push_back(std::move(s));
          }
        }
        // One-byte sequences merge into one class (an ASCII class is then a single element).
        ByteClass single;
        bool any_single = false;
        Alternatives merged;
        for (Sequence& s : alts) {
          if (s.size() == 1) {
            const ByteClass& c = classes_[size_t(s[0].id)];
            for (int w = 0; w < 4; ++w) single.bits[size_t(w)] |= c.bits[size_t(w)];
            any_single = true;
          } else {
            merged.push_back(std::move(s));
          }
        }
        if (any_single) merged.insert(merged.begin(), Sequence{Element{Element::kBytes, ByteClassId(single)}});
        return merged;
      }
      case Expr::kRuleRef:
        return {{Ref(RuleId(e.literal))}};
      case Expr::kAlternation: {
        Alternatives out;
        for (const Expr& c : e.children) {
          Alternatives a = Lower(c);
          out.insert(out.end(), std::make_move_iterator(a.begin()), std::make_move_iterator(a.end()));
        }
        return out;
      }
      case Expr::kSequence: {
        Alternatives out = {{}};
        for (const Expr& c : e.children) out = Concat(std::move(out), Lower(c));
        return out;
      }
      case Expr::kRepeat:
        return LowerRepeat(e.children[0], e.min, e.max);
    }
    return {};
  }

  // x{min,max}: min copies of x, then (unbounded) r ::= x r | "", or (bounded) max - min nested
  // optionals o_k ::= x o_(k-1) | "". Each recursive reference ends its alternative: a tail call.
  Alternatives LowerRepeat(const Expr& x, int32_t min, int32_t max) {
    if (min < 0 || (max >= 0 && max < min) || max > 100000 || min > 100000) {
      error_ = absl::InvalidArgumentError(absl::StrCat("grammar: bad repetition {", min, ",", max, "}"));
      return {};
    }
    Alternatives body = Lower(x);
    // A body that is copied many times goes into a rule once, so copies cost one element each
    // (else `(a{1000}){1000}` would expand to a million elements, quadratically).
    size_t body_size = 0;
    for (const Sequence& s : body) body_size += s.size() + 1;
    if (body_size > kMaxCopiedElements && (min > 1 || max == -1 || max - min > 1)) {
      body = {{Ref(NewHelperRule(std::move(body)))}};
    }
    Alternatives out = {{}};
    for (int32_t i = 0; i < min && error_.ok(); ++i) out = Concat(std::move(out), body);
    if (max == -1) {
      const int32_t star = NewHelperRule({});
      rules_[size_t(star)] = Concat(body, {{Ref(star)}});
      rules_[size_t(star)].push_back({});
      out = Concat(std::move(out), {{Ref(star)}});
    } else if (max > min) {
      Alternatives optional = body;  // x | ""
      optional.push_back({});
      int32_t rule = NewHelperRule(std::move(optional));
      for (int32_t k = 2; k <= max - min && error_.ok(); ++k) {
        Alternatives next = Concat(body, {{Ref(rule)}});
        next.push_back({});
        rule = NewHelperRule(std::move(next));
      }
      out = Concat(std::move(out), {{Ref(rule)}});
    }
    return out;
  }

  absl::Status CheckNoLeftRecursion() const {
    const size_t n = rules_.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (const Sequence& s : rules_[r]) {
          const bool all = std::all_of(s.begin(), s.end(), [&](const Element& e) {
            return e.kind == Element::kRule && nullable[size_t(e.id)];
          });
          if (all) {
            nullable[r] = changed = true;
            break;
          }
        }
      }
    }
    // Edges to the rules an alternative can start with; a cycle is left recursion (also a
    // repetition of something nullable, which would loop without consuming).
    std::vector<std::vector<int32_t>> starts(n);
    for (size_t r = 0; r < n; ++r) {
      for (const Sequence& s : rules_[r]) {
        for (const Element& e : s) {
          if (e.kind != Element::kRule) break;
          starts[r].push_back(e.id);
          if (!nullable[size_t(e.id)]) break;
        }
      }
    }
    std::vector<int8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
    std::string cycle_at;
    std::function<bool(int32_t)> visit = [&](int32_t r) {
      color[size_t(r)] = 1;
      for (int32_t next : starts[size_t(r)]) {
        if (color[size_t(next)] == 1) {
          cycle_at = names_[size_t(next)];
          return true;
        }
        if (color[size_t(next)] == 0 && visit(next)) return true;
      }
      color[size_t(r)] = 2;
      return false;
    };
    for (size_t r = 0; r < n; ++r) {
      if (color[r] == 0 && visit(int32_t(r))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "grammar: left recursion (or a repetition of something that can be empty) at rule '",
            cycle_at.starts_with("_") ? "a repetition" : cycle_at, "'"));
      }
    }
    return absl::OkStatus();
  }

  std::shared_ptr<const Grammar> Flatten(int32_t root) {
    auto g = std::make_shared<Grammar>();
    g->byte_classes_ = classes_;
    g->names_ = names_;
    g->root_ = root;
    g->alternatives_.resize(rules_.size());
    for (size_t r = 0; r < rules_.size(); ++r) {
      for (const Sequence& s : rules_[r]) {
        g->alternatives_[r].push_back(int32_t(g->elements_.size()));
        g->elements_.insert(g->elements_.end(), s.begin(), s.end());
        g->elements_.push_back(Element{Element::kEnd, 0});
      }
    }
    return g;
  }

  std::map<std::string, int32_t> rule_index_;
  std::vector<std::string> names_;
  std::vector<Alternatives> rules_;
  std::vector<bool> defined_;
  std::vector<ByteClass> classes_;
  std::map<std::array<uint64_t, 4>, int32_t> class_index_;
  size_t total_elements_ = 0;
  absl::Status error_;
};

absl::StatusOr<std::shared_ptr<const Grammar>> Grammar::Build(const std::vector<std::pair<std::string, Expr>>& rules,
                                                              const std::string& root_name) {
  return GrammarLowering().Run(rules, root_name);
}

std::string Grammar::ToString() const {
  auto class_text = [](const ByteClass& c) {
    std::string out = "[";
    for (int b = 0; b < 256;) {
      if (!c.Contains(uint8_t(b))) {
        ++b;
        continue;
      }
      int e = b;
      while (e + 1 < 256 && c.Contains(uint8_t(e + 1))) ++e;
      absl::StrAppendFormat(&out, "\\x%02X", b);
      if (e > b) absl::StrAppendFormat(&out, "-\\x%02X", e);
      b = e + 1;
    }
    return out + "]";
  };
  std::string out;
  for (int32_t r = 0; r < num_rules(); ++r) {
    absl::StrAppend(&out, names_[size_t(r)], " ::=");
    bool first = true;
    for (int32_t start : alternatives_[size_t(r)]) {
      absl::StrAppend(&out, first ? "" : " |");
      first = false;
      for (int32_t p = start; elements_[size_t(p)].kind != Element::kEnd; ++p) {
        const Element& e = elements_[size_t(p)];
        absl::StrAppend(&out, " ", e.kind == Element::kRule ? names_[size_t(e.id)] : class_text(byte_classes_[size_t(e.id)]));
      }
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

// --- GBNF --------------------------------------------------------------------------------------

namespace {

class GbnfParser {
 public:
  explicit GbnfParser(const std::string& text) : text_(text) {}

  absl::StatusOr<std::vector<std::pair<std::string, Expr>>> Parse() {
    std::vector<std::pair<std::string, Expr>> rules;
    SkipSpace();
    while (pos_ < text_.size()) {
      std::string name = Identifier();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace();
      if (text_.compare(pos_, 3, "::=") != 0) return Error(absl::StrCat("expected '::=' after '", name, "'"));
      pos_ += 3;
      absl::StatusOr<Expr> body = Alternatives(0);
      if (!body.ok()) return body.status();
      rules.emplace_back(std::move(name), std::move(*body));
      SkipSpace();
    }
    if (rules.empty()) return absl::InvalidArgumentError("grammar: empty");
    return rules;
  }

 private:
  absl::Status Error(const std::string& what) const {
    size_t line = 1 + size_t(std::count(text_.begin(), text_.begin() + long(std::min(pos_, text_.size())), '\n'));
    return absl::InvalidArgumentError(absl::StrCat("grammar: line ", line, ": ", what));
  }

  void SkipSpace() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '#') {
        while (pos_ < text_.size() && text_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else {
        break;
      }
    }
  }

  static bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

  std::string Identifier() {
    const size_t start = pos_;
    while (pos_ < text_.size() && IsNameChar(text_[pos_])) ++pos_;
    return text_.substr(start, pos_ - start);
  }

  // Whether a new rule (`name ::=`) starts here.
  bool AtRuleStart() const {
    size_t p = pos_;
    while (p < text_.size() && IsNameChar(text_[p])) ++p;
    if (p == pos_) return false;
    while (p < text_.size() && (text_[p] == ' ' || text_[p] == '\t' || text_[p] == '\n' || text_[p] == '\r')) ++p;
    return text_.compare(p, 3, "::=") == 0;
  }

  absl::StatusOr<Expr> Alternatives(int depth) {
    if (depth > 64) return Error("nesting too deep");
    std::vector<Expr> alts;
    while (true) {
      absl::StatusOr<Expr> seq = SequenceExpr(depth);
      if (!seq.ok()) return seq.status();
      alts.push_back(std::move(*seq));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == '|') {
        ++pos_;
        continue;
      }
      break;
    }
    return alts.size() == 1 ? std::move(alts[0]) : Expr::Alternation(std::move(alts));
  }

  absl::StatusOr<Expr> SequenceExpr(int depth) {
    std::vector<Expr> items;
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size()) break;
      const char c = text_[pos_];
      if (c == '|' || c == ')' || AtRuleStart()) break;
      absl::StatusOr<Expr> item = Primary(depth);
      if (!item.ok()) return item.status();
      absl::StatusOr<Expr> repeated = Postfix(std::move(*item));
      if (!repeated.ok()) return repeated.status();
      items.push_back(std::move(*repeated));
    }
    return items.size() == 1 ? std::move(items[0]) : Expr::Sequence(std::move(items));
  }

  absl::StatusOr<Expr> Primary(int depth) {
    const char c = text_[pos_];
    if (c == '"') {
      ++pos_;
      std::string bytes;
      while (true) {
        if (pos_ >= text_.size()) return Error("unterminated string literal");
        if (text_[pos_] == '"') break;
        absl::StatusOr<uint32_t> cp = Char();
        if (!cp.ok()) return cp.status();
        AppendUtf8(*cp, bytes);
      }
      ++pos_;
      return Expr::Literal(std::move(bytes));
    }
    if (c == '[') {
      ++pos_;
      bool negated = false;
      if (pos_ < text_.size() && text_[pos_] == '^') {
        negated = true;
        ++pos_;
      }
      std::vector<std::pair<uint32_t, uint32_t>> ranges;
      while (true) {
        if (pos_ >= text_.size()) return Error("unterminated character class");
        if (text_[pos_] == ']') break;
        absl::StatusOr<uint32_t> lo = Char();
        if (!lo.ok()) return lo.status();
        uint32_t hi = *lo;
        if (pos_ + 1 < text_.size() && text_[pos_] == '-' && text_[pos_ + 1] != ']') {
          ++pos_;
          absl::StatusOr<uint32_t> h = Char();
          if (!h.ok()) return h.status();
          hi = *h;
          if (hi < *lo) return Error("character range out of order");
        }
        ranges.push_back({*lo, hi});
      }
      ++pos_;
      return Expr::CharClass(std::move(ranges), negated);
    }
    if (c == '.') {
      ++pos_;
      return Expr::AnyChar();
    }
    if (c == '(') {
      ++pos_;
      absl::StatusOr<Expr> inner = Alternatives(depth + 1);
      if (!inner.ok()) return inner.status();
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ')') return Error("expected ')'");
      ++pos_;
      return inner;
    }
    if (IsNameChar(c)) return Expr::RuleRef(Identifier());
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  absl::StatusOr<Expr> Postfix(Expr item) {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '*') {
        item = Expr::Repeat(std::move(item), 0, -1);
      } else if (c == '+') {
        item = Expr::Repeat(std::move(item), 1, -1);
      } else if (c == '?') {
        item = Expr::Repeat(std::move(item), 0, 1);
      } else if (c == '{') {
        ++pos_;
        absl::StatusOr<std::pair<int32_t, int32_t>> bounds = Bounds();
        if (!bounds.ok()) return bounds.status();
        item = Expr::Repeat(std::move(item), bounds->first, bounds->second);
        continue;
      } else {
        break;
      }
      ++pos_;
    }
    return item;
  }

  // After '{': "m}", "m,}", "m,n}".
  absl::StatusOr<std::pair<int32_t, int32_t>> Bounds() {
    auto number = [&]() -> int64_t {
      SkipSpace();
      if (pos_ >= text_.size() || !std::isdigit(static_cast<unsigned char>(text_[pos_]))) return -1;
      int64_t n = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_])) && n < 1000000) {
        n = n * 10 + (text_[pos_++] - '0');
      }
      return n;
    };
    const int64_t min = number();
    if (min < 0) return Error("expected a number in {m,n}");
    int64_t max = min;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ',') {
      ++pos_;
      max = number();  // -1: unbounded
    }
    SkipSpace();
    if (pos_ >= text_.size() || text_[pos_] != '}') return Error("expected '}'");
    ++pos_;
    if (min > 100000 || max > 100000 || (max >= 0 && max < min)) return Error("bad repetition bounds");
    return std::pair<int32_t, int32_t>{int32_t(min), int32_t(max)};
  }

  // One character of a literal or class: an escape or a UTF-8 character.
  absl::StatusOr<uint32_t> Char() {
    if (text_[pos_] != '\\') {
      absl::StatusOr<uint32_t> cp = DecodeUtf8At(text_, pos_);
      if (!cp.ok()) return Error("invalid UTF-8");
      return cp;
    }
    ++pos_;
    if (pos_ >= text_.size()) return Error("dangling escape");
    const char e = text_[pos_++];
    auto hex = [&](int digits) -> absl::StatusOr<uint32_t> {
      uint32_t v = 0;
      for (int i = 0; i < digits; ++i) {
        if (pos_ >= text_.size() || !std::isxdigit(static_cast<unsigned char>(text_[pos_]))) {
          return Error("bad hex escape");
        }
        const char h = text_[pos_++];
        v = v * 16 + uint32_t(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      if (v > kMaxCodePoint) return Error("code point out of range");
      return v;
    };
    switch (e) {
      case 'n': return uint32_t('\n');
      case 'r': return uint32_t('\r');
      case 't': return uint32_t('\t');
      case 'f': return uint32_t('\f');
      case 'v': return uint32_t('\v');
      case '0': return uint32_t(0);
      case 'x': return hex(2);
      case 'u': return hex(4);
      case 'U': return hex(8);
      default: return uint32_t(static_cast<unsigned char>(e));  // \\ \" \[ \] \- \^ \/ ...
    }
  }

  const std::string& text_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<std::vector<std::pair<std::string, Expr>>> ParseGbnfRules(const std::string& text) {
  return GbnfParser(text).Parse();
}

absl::StatusOr<std::shared_ptr<const Grammar>> ParseGbnf(const std::string& text) {
  absl::StatusOr<std::vector<std::pair<std::string, Expr>>> rules = ParseGbnfRules(text);
  if (!rules.ok()) return rules.status();
  return Grammar::Build(*rules, "root");
}

}  // namespace duet::grammar
