#include "engine/grammar/regex.h"

#include <cctype>

#include "absl/strings/str_cat.h"
#include "engine/grammar/utf8.h"

namespace duet::grammar {
namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}};

Ranges Complement(const Ranges& r) { return Expr::CharClass(r, true).ranges; }

class RegexParser {
 public:
  explicit RegexParser(const std::string& pattern) : p_(pattern) {}

  absl::StatusOr<Expr> Parse() {
    if (Peek('^')) ++pos_;
    absl::StatusOr<Expr> e = Alternation(0);
    if (!e.ok()) return e;
    if (pos_ < p_.size()) return Error(p_[pos_] == ')' ? "unbalanced ')'" : "unexpected character");
    return e;
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("regex: ", what, " at offset ", pos_));
  }
  bool Peek(char c) const { return pos_ < p_.size() && p_[pos_] == c; }

  absl::StatusOr<Expr> Alternation(int depth) {
    if (depth > 64) return Error("nesting too deep");
    std::vector<Expr> alts;
    while (true) {
      absl::StatusOr<Expr> seq = Sequence(depth);
      if (!seq.ok()) return seq;
      alts.push_back(std::move(*seq));
      if (!Peek('|')) break;
      ++pos_;
    }
    return alts.size() == 1 ? std::move(alts[0]) : Expr::Alternation(std::move(alts));
  }

  absl::StatusOr<Expr> Sequence(int depth) {
    std::vector<Expr> items;
    while (pos_ < p_.size() && !Peek('|') && !Peek(')')) {
      if (Peek('$') && pos_ + 1 == p_.size()) {  // the match is whole anyway
        ++pos_;
        break;
      }
      absl::StatusOr<Expr> atom = Atom(depth);
      if (!atom.ok()) return atom;
      absl::StatusOr<Expr> quantified = Quantifier(std::move(*atom));
      if (!quantified.ok()) return quantified;
      items.push_back(std::move(*quantified));
    }
    return items.size() == 1 ? std::move(items[0]) : Expr::Sequence(std::move(items));
  }

  absl::StatusOr<Expr> Quantifier(Expr atom) {
    while (pos_ < p_.size()) {
      int32_t min = 0, max = -1;
      const char c = p_[pos_];
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        min = 1, ++pos_;
      } else if (c == '?') {
        max = 1, ++pos_;
      } else if (c == '{' && pos_ + 1 < p_.size() && std::isdigit(static_cast<unsigned char>(p_[pos_ + 1]))) {
        ++pos_;
        absl::StatusOr<std::pair<int32_t, int32_t>> b = Bounds();
        if (!b.ok()) return b.status();
        min = b->first, max = b->second;
      } else {
        break;
      }
      if (Peek('?')) ++pos_;  // lazy: the same language
      if (Peek('+')) return Error("possessive quantifiers are not supported");
      atom = Expr::Repeat(std::move(atom), min, max);
    }
    return atom;
  }

  absl::StatusOr<std::pair<int32_t, int32_t>> Bounds() {
    auto number = [&]() -> int64_t {
      if (!(pos_ < p_.size() && std::isdigit(static_cast<unsigned char>(p_[pos_])))) return -1;
      int64_t n = 0;
      while (pos_ < p_.size() && std::isdigit(static_cast<unsigned char>(p_[pos_])) && n < 1000000) n = n * 10 + (p_[pos_++] - '0');
      return n;
    };
    const int64_t min = number();
    int64_t max = min;
    if (Peek(',')) {
      ++pos_;
      max = number();
    }
    if (!Peek('}')) return Error("expected '}'");
    ++pos_;
    if (min < 0 || min > 10000 || max > 10000 || (max >= 0 && max < min)) return Error("bad repetition bounds");
    return std::pair<int32_t, int32_t>{int32_t(min), int32_t(max)};
  }

  absl::StatusOr<Expr> Atom(int depth) {
    const char c = p_[pos_];
    if (c == '(') {
      ++pos_;
      if (Peek('?')) {
        ++pos_;
        if (Peek(':')) {
          ++pos_;
        } else if (Peek('P') || Peek('<')) {
          if (Peek('P')) ++pos_;
          if (!Peek('<')) return Error("unsupported group");
          if (pos_ + 1 < p_.size() && (p_[pos_ + 1] == '=' || p_[pos_ + 1] == '!')) {
            return Error("lookbehind is not supported");
          }
          while (pos_ < p_.size() && p_[pos_] != '>') ++pos_;
          if (!Peek('>')) return Error("unterminated group name");
          ++pos_;
        } else {
          return Error("lookaround and inline flags are not supported");
        }
      }
      absl::StatusOr<Expr> inner = Alternation(depth + 1);
      if (!inner.ok()) return inner;
      if (!Peek(')')) return Error("missing ')'");
      ++pos_;
      return inner;
    }
    if (c == '[') return Class();
    if (c == '.') {
      ++pos_;
      return Expr::CharClass({{'\n', '\n'}}, true);
    }
    if (c == '^' || c == '$') return Error("anchors are supported only at the ends");
    if (c == '*' || c == '+' || c == '?') return Error("nothing to repeat");
    if (c == '\\') {
      Ranges ranges;
      absl::StatusOr<uint32_t> cp = Escape(ranges);
      if (!cp.ok()) return cp.status();
      if (!ranges.empty()) return Expr::CharClass(std::move(ranges));
      std::string bytes;
      AppendUtf8(*cp, bytes);
      return Expr::Literal(std::move(bytes));
    }
    absl::StatusOr<uint32_t> cp = DecodeUtf8At(p_, pos_);
    if (!cp.ok()) return Error("invalid UTF-8");
    std::string bytes;
    AppendUtf8(*cp, bytes);
    return Expr::Literal(std::move(bytes));
  }

  // After '\': a code point, or (in `cls`) a class escape such as \d.
  absl::StatusOr<uint32_t> Escape(Ranges& cls) {
    ++pos_;
    if (pos_ >= p_.size()) return Error("dangling escape");
    const char e = p_[pos_++];
    auto hex = [&](int digits) -> absl::StatusOr<uint32_t> {
      uint32_t v = 0;
      for (int i = 0; i < digits; ++i) {
        if (pos_ >= p_.size() || !std::isxdigit(static_cast<unsigned char>(p_[pos_]))) return Error("bad hex escape");
        const char h = p_[pos_++];
        v = v * 16 + uint32_t(std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : std::tolower(h) - 'a' + 10);
      }
      return v;
    };
    switch (e) {
      case 'd': cls = kDigit; return 0u;
      case 'w': cls = kWord; return 0u;
      case 's': cls = kSpace; return 0u;
      case 'D': cls = Complement(kDigit); return 0u;
      case 'W': cls = Complement(kWord); return 0u;
      case 'S': cls = Complement(kSpace); return 0u;
      case 'n': return uint32_t('\n');
      case 't': return uint32_t('\t');
      case 'r': return uint32_t('\r');
      case 'f': return uint32_t('\f');
      case 'v': return uint32_t('\v');
      case '0': return 0u;
      case 'x': return hex(2);
      case 'u': return hex(4);
      case 'b': case 'B': case 'A': case 'Z': case 'z':
        return Error("word boundaries and anchors are not supported");
      default:
        if (std::isdigit(static_cast<unsigned char>(e))) return Error("backreferences are not supported");
        if (std::isalnum(static_cast<unsigned char>(e))) return Error(absl::StrCat("unknown escape \\", std::string(1, e)));
        return uint32_t(static_cast<unsigned char>(e));
    }
  }

  absl::StatusOr<Expr> Class() {
    ++pos_;
    bool negated = false;
    if (Peek('^')) {
      negated = true;
      ++pos_;
    }
    Ranges ranges;
    bool first = true;
    while (true) {
      if (pos_ >= p_.size()) return Error("unterminated character class");
      if (Peek(']') && !first) break;
      first = false;
      auto one = [&](Ranges& cls) -> absl::StatusOr<uint32_t> {
        if (Peek('\\')) return Escape(cls);
        absl::StatusOr<uint32_t> cp = DecodeUtf8At(p_, pos_);
        if (!cp.ok()) return Error("invalid UTF-8");
        return cp;
      };
      Ranges cls;
      absl::StatusOr<uint32_t> lo = one(cls);
      if (!lo.ok()) return lo.status();
      if (!cls.empty()) {
        ranges.insert(ranges.end(), cls.begin(), cls.end());
        continue;
      }
      uint32_t hi = *lo;
      if (Peek('-') && pos_ + 1 < p_.size() && p_[pos_ + 1] != ']') {
        ++pos_;
        Ranges hi_cls;
        absl::StatusOr<uint32_t> h = one(hi_cls);
        if (!h.ok()) return h.status();
        if (!hi_cls.empty()) return Error("a class escape cannot end a range");
        hi = *h;
        if (hi < *lo) return Error("character range out of order");
      }
      ranges.push_back({*lo, hi});
    }
    ++pos_;
    return Expr::CharClass(std::move(ranges), negated);
  }

  const std::string& p_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<Expr> ParseRegex(const std::string& pattern) { return RegexParser(pattern).Parse(); }

absl::StatusOr<std::shared_ptr<const Grammar>> RegexToGrammar(const std::string& pattern) {
  absl::StatusOr<Expr> e = ParseRegex(pattern);
  if (!e.ok()) return e.status();
  return Grammar::Build({{"root", std::move(*e)}}, "root");
}

}  // namespace duet::grammar
