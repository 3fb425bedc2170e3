#include "engine/grammar/json_schema.h"

#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/grammar/regex.h"
#include "nlohmann/json.hpp"

namespace duet::grammar {
namespace {

using json = nlohmann::ordered_json;  // properties keep the schema's order

// The JSON building blocks, each added once when first used.
const std::map<std::string, std::string>& PrimitiveRules() {
  static const auto* rules = new std::map<std::string, std::string>{
      {"ws", R"(| " " | "\n" [ \t]{0,20})"},
      {"json-char", R"([^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" json-hex4))"},
      {"json-string", R"("\"" ([^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" json-hex4))* "\"")"},
      // \uXXXX but no surrogate (a lone one is not valid Unicode and JSON parsers reject it).
      {"json-hex4", R"([0-9a-cA-CeEfF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})"},
      {"json-int", R"("-"? ("0" | [1-9] [0-9]{0,15}))"},
      {"json-number", R"("-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?)"},
      {"json-boolean", R"("true" | "false")"},
      {"json-null", R"("null")"},
      {"json-value", "json-object | json-array | json-string | json-number | json-boolean | json-null"},
      {"json-object", R"("{" ws (json-string ws ":" ws json-value (ws "," ws json-string ws ":" ws json-value)* ws)? "}")"},
      {"json-array", R"("[" ws (json-value (ws "," ws json-value)* ws)? "]")"},
  };
  return *rules;
}

const std::set<std::string>& PrimitiveDependencies(const std::string& name) {
  static const auto* deps = new std::map<std::string, std::set<std::string>>{
      {"json-value", {"json-object", "json-array", "json-string", "json-number", "json-boolean", "json-null"}},
      {"json-object", {"ws", "json-string", "json-value"}},
      {"json-array", {"ws", "json-value"}},
      {"json-char", {"json-hex4"}},
      {"json-string", {"json-hex4"}},
  };
  static const std::set<std::string> none;
  auto it = deps->find(name);
  return it == deps->end() ? none : it->second;
}

// A GBNF string literal for `bytes`.
std::string GbnfLiteral(const std::string& bytes) {
  std::string out = "\"";
  for (unsigned char c : bytes) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(char(c));
    } else if (c < 0x20) {
      absl::StrAppendFormat(&out, "\\x%02X", c);
    } else {
      out.push_back(char(c));
    }
  }
  return out + "\"";
}

// Removes from a regex expression every character a JSON string would have to escape, so its
// matches can stand unescaped between the quotes.
Expr WithoutJsonEscapes(Expr e) {
  switch (e.kind) {
    case Expr::kLiteral:
      for (unsigned char c : e.literal) {
        if (c == '"' || c == '\\' || c < 0x20) return Expr::CharClass({});  // matches nothing
      }
      return e;
    case Expr::kCharClass: {
      std::vector<std::pair<uint32_t, uint32_t>> ranges;
      const std::vector<std::pair<uint32_t, uint32_t>> excluded = {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}};
      std::vector<std::pair<uint32_t, uint32_t>> allowed = Expr::CharClass(excluded, true).ranges;
      for (auto [lo, hi] : e.ranges) {
        for (auto [alo, ahi] : allowed) {
          const uint32_t l = std::max(lo, alo), h = std::min(hi, ahi);
          if (l <= h) ranges.push_back({l, h});
        }
      }
      return Expr::CharClass(std::move(ranges));
    }
    default:
      for (Expr& c : e.children) c = WithoutJsonEscapes(std::move(c));
      return e;
  }
}

class SchemaConverter {
 public:
  explicit SchemaConverter(json root) : root_(std::move(root)) {}

  absl::Status Convert() {
    absl::StatusOr<std::string> body = Visit(root_, 0);
    if (!body.ok()) return body.status();
    rules_.insert(rules_.begin(), {"root", *body});
    return absl::OkStatus();
  }

  std::string Text() const {
    std::string out;
    for (const auto& [name, body] : rules_) absl::StrAppend(&out, name, " ::= ", body, "\n");
    for (const auto& [name, pattern] : patterns_) absl::StrAppend(&out, "# ", name, " ::= /", pattern, "/\n");
    return out;
  }

  absl::StatusOr<std::shared_ptr<const Grammar>> Build() const {
    std::string text;
    for (const auto& [name, body] : rules_) absl::StrAppend(&text, name, " ::= ", body, "\n");
    absl::StatusOr<std::vector<std::pair<std::string, Expr>>> rules = ParseGbnfRules(text);
    if (!rules.ok()) return rules.status();
    for (const auto& [name, expr] : pattern_exprs_) rules->emplace_back(name, expr);
    return Grammar::Build(*rules, "root");
  }

 private:
  static constexpr int kMaxDepth = 64;

  absl::Status Unsupported(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("json schema: ", what, " is not supported"));
  }

  std::string Use(const std::string& primitive) {
    if (used_primitives_.insert(primitive).second) {
      rules_.emplace_back(primitive, PrimitiveRules().at(primitive));
      for (const std::string& dep : PrimitiveDependencies(primitive)) Use(dep);
    }
    return primitive;
  }

  std::string NewRule(const std::string& kind, std::string body) {
    const std::string name = absl::StrCat(kind, "-", next_id_++);
    rules_.emplace_back(name, std::move(body));
    return name;
  }

  // The GBNF expression (usually a rule name) for `schema`.
  absl::StatusOr<std::string> Visit(const json& schema, int depth) {
    if (depth > kMaxDepth) return absl::InvalidArgumentError("json schema: nested too deeply");
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return Use("json-value");
      return absl::InvalidArgumentError("json schema: `false` matches nothing");
    }
    if (!schema.is_object()) return absl::InvalidArgumentError("json schema: a schema must be an object or a boolean");
    static const std::set<std::string> kAnnotations = {"title", "description", "default", "examples", "format",
                                                       "$schema", "$id", "$comment", "$defs", "definitions",
                                                       "deprecated", "readOnly", "writeOnly", "strict", "name"};
    static const std::set<std::string> kHandled = {"type", "properties", "required", "additionalProperties",
                                                   "items", "prefixItems", "minItems", "maxItems", "enum", "const",
                                                   "anyOf", "oneOf", "allOf", "$ref", "minLength", "maxLength",
                                                   "pattern", "minimum", "maximum", "exclusiveMinimum",
                                                   "exclusiveMaximum"};
    for (const auto& [key, value] : schema.items()) {
      if (!kAnnotations.count(key) && !kHandled.count(key)) return Unsupported(absl::StrCat("keyword '", key, "'"));
    }
    if (schema.contains("$ref")) return Ref(schema["$ref"], depth);
    if (schema.contains("const")) return GbnfLiteral(schema["const"].dump());
    if (schema.contains("enum")) {
      const json& values = schema["enum"];
      if (!values.is_array() || values.empty()) return absl::InvalidArgumentError("json schema: enum must be a non-empty array");
      std::vector<std::string> alts;
      for (const json& v : values) alts.push_back(GbnfLiteral(v.dump()));
      return NewRule("enum", absl::StrJoin(alts, " | "));
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!schema.contains(key)) continue;
      const json& list = schema[key];
      if (!list.is_array() || list.empty()) return absl::InvalidArgumentError(absl::StrCat("json schema: ", key, " must be a non-empty array"));
      std::vector<std::string> alts;
      for (const json& s : list) {
        absl::StatusOr<std::string> alt = Visit(Merged(schema, s, key), depth + 1);
        if (!alt.ok()) return alt;
        alts.push_back(*alt);
      }
      return NewRule("any-of", absl::StrJoin(alts, " | "));
    }
    if (schema.contains("allOf")) {
      const json& list = schema["allOf"];
      if (!list.is_array() || list.size() != 1) return Unsupported("allOf of more than one schema");
      return Visit(Merged(schema, list[0], "allOf"), depth + 1);
    }
    if (!schema.contains("type")) {
      for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
        if (schema.contains(key)) return Unsupported(absl::StrCat(key, " without \"type\": \"integer\""));
      }
      if (schema.contains("properties")) return Object(schema, depth);
      if (schema.contains("items") || schema.contains("prefixItems")) return Array(schema, depth);
      return Use("json-value");
    }
    const json& type = schema["type"];
    if (type.is_array()) {
      std::vector<std::string> alts;
      for (const json& t : type) {
        json one = schema;
        one["type"] = t;
        absl::StatusOr<std::string> alt = Visit(one, depth + 1);
        if (!alt.ok()) return alt;
        alts.push_back(*alt);
      }
      if (alts.empty()) return absl::InvalidArgumentError("json schema: empty type list");
      return NewRule("types", absl::StrJoin(alts, " | "));
    }
    if (!type.is_string()) return absl::InvalidArgumentError("json schema: type must be a string or a list");
    const std::string t = type.get<std::string>();
    if (t == "object") return Object(schema, depth);
    if (t == "array") return Array(schema, depth);
    if (t == "string") return String(schema);
    if (t == "number") {
      for (const char* key : {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}) {
        if (schema.contains(key)) return Unsupported(absl::StrCat(key, " on a number (integers only)"));
      }
      return Use("json-number");
    }
    if (t == "integer") return Integer(schema);
    if (t == "boolean") return Use("json-boolean");
    if (t == "null") return Use("json-null");
    return absl::InvalidArgumentError(absl::StrCat("json schema: unknown type '", t, "'"));
  }

  // `branch` with the parent's other keywords (e.g. a shared `type`), minus `key`.
  static json Merged(const json& parent, const json& branch, const char* key) {
    json out = parent;
    out.erase(key);
    if (!branch.is_object()) return branch;
    for (const auto& [k, v] : branch.items()) out[k] = v;
    return out;
  }

  absl::StatusOr<std::string> Ref(const json& ref, int depth) {
    if (!ref.is_string()) return absl::InvalidArgumentError("json schema: $ref must be a string");
    const std::string path = ref.get<std::string>();
    if (auto it = ref_rules_.find(path); it != ref_rules_.end()) return it->second;
    const json* target = nullptr;
    if (path == "#") {
      target = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (!path.starts_with(p)) continue;
        const std::string defs = p.substr(2, p.size() - 3);
        const std::string name = path.substr(p.size());
        if (root_.contains(defs) && root_[defs].is_object() && root_[defs].contains(name)) target = &root_[defs][name];
      }
    }
    if (target == nullptr) return absl::InvalidArgumentError(absl::StrCat("json schema: cannot resolve $ref '", path, "'"));
    const std::string name = absl::StrCat("ref-", next_id_++);
    ref_rules_[path] = name;
    const size_t slot = rules_.size();
    rules_.emplace_back(name, "");
    absl::StatusOr<std::string> body = Visit(*target, depth + 1);
    if (!body.ok()) return body;
    rules_[slot].second = *body;
    return name;
  }

  // An integer, within minimum / maximum / exclusiveMinimum / exclusiveMaximum when given (at
  // most 16 digits either way, as json-int).
  absl::StatusOr<std::string> Integer(const json& schema) {
    constexpr int64_t kLimit = 9'999'999'999'999'999;
    int64_t lo = -kLimit, hi = kLimit;
    bool bounded = false;
    for (const auto& [key, is_min, exclusive] : {std::tuple{"minimum", true, false}, std::tuple{"maximum", false, false},
                                                 std::tuple{"exclusiveMinimum", true, true},
                                                 std::tuple{"exclusiveMaximum", false, true}}) {
      if (!schema.contains(key)) continue;
      const json& v = schema[key];
      if (!v.is_number()) return absl::InvalidArgumentError(absl::StrCat("json schema: ", key, " must be a number"));
      const double x = v.get<double>();
      if (!(std::fabs(x) <= double(kLimit))) return Unsupported(absl::StrCat(key, " beyond 16 digits"));
      // The smallest (largest) integer the bound lets through; integer bounds exactly (16 digits
      // are past a double's 53 bits).
      const int64_t step = exclusive ? (is_min ? 1 : -1) : 0;
      const int64_t bound = v.is_number_integer()
                                ? v.get<int64_t>() + step
                                : int64_t(is_min ? (exclusive ? std::floor(x) + 1 : std::ceil(x))
                                                 : (exclusive ? std::ceil(x) - 1 : std::floor(x)));
      if (is_min) {
        lo = std::max(lo, bound);
      } else {
        hi = std::min(hi, bound);
      }
      bounded = true;
    }
    if (!bounded) return Use("json-int");
    if (lo > hi) return absl::InvalidArgumentError("json schema: no integer satisfies the bounds");
    std::vector<std::string> alts;
    if (lo < 0) {
      for (const std::string& a : NonNegativeRange(hi < 0 ? -hi : 1, -lo)) alts.push_back(absl::StrCat("\"-\" ", a));
    }
    if (hi >= 0) {
      for (const std::string& a : NonNegativeRange(std::max<int64_t>(lo, 0), hi)) alts.push_back(a);
    }
    return NewRule("int", absl::StrJoin(alts, " | "));
  }

  // GBNF sequences matching the decimal numerals (no leading zeros) of [lo, hi], 0 <= lo <= hi.
  static std::vector<std::string> NonNegativeRange(int64_t lo, int64_t hi) {
    std::vector<std::string> out;
    const std::string hi_digits = std::to_string(hi);
    for (size_t length = std::to_string(lo).size(); length <= hi_digits.size(); ++length) {
      const int64_t smallest = length == 1 ? 0 : Pow10(length - 1), largest = Pow10(length) - 1;
      const std::string a = std::to_string(std::max(lo, smallest)), b = std::to_string(std::min(hi, largest));
      for (const std::string& seq : SameLengthRange(a, b)) out.push_back(seq);
    }
    return out;
  }
  static int64_t Pow10(size_t n) {
    int64_t p = 1;
    while (n-- > 0) p *= 10;
    return p;
  }
  // Sequences matching the digit strings in [a, b], both of one length (a <= b).
  static std::vector<std::string> SameLengthRange(const std::string& a, const std::string& b) {
    if (a.empty()) return {""};
    const size_t rest = a.size() - 1;
    auto digits = [](char from, char to) {
      return from == to ? absl::StrCat("\"", std::string(1, from), "\"")
                        : absl::StrCat("[", std::string(1, from), "-", std::string(1, to), "]");
    };
    auto any = [&](size_t n) { return n == 0 ? std::string() : absl::StrCat(" [0-9]{", n, "}"); };
    auto join = [](const std::string& head, const std::string& tail) {
      return tail.empty() ? head : absl::StrCat(head, " ", tail);
    };
    if (a[0] == b[0]) {
      std::vector<std::string> out;
      for (const std::string& t : SameLengthRange(a.substr(1), b.substr(1))) out.push_back(join(digits(a[0], a[0]), t));
      return out;
    }
    const bool a_rest_zeros = a.find_first_not_of('0', 1) == std::string::npos;
    const bool b_rest_nines = b.find_first_not_of('9', 1) == std::string::npos;
    std::vector<std::string> out;
    char first = a[0], last = b[0];
    if (!a_rest_zeros) {
      for (const std::string& t : SameLengthRange(a.substr(1), std::string(rest, '9'))) out.push_back(join(digits(a[0], a[0]), t));
      ++first;
    }
    if (!b_rest_nines) --last;
    if (first <= last) out.push_back(digits(first, last) + any(rest));
    if (!b_rest_nines) {
      for (const std::string& t : SameLengthRange(std::string(rest, '0'), b.substr(1))) out.push_back(join(digits(b[0], b[0]), t));
    }
    return out;
  }

  absl::StatusOr<std::string> String(const json& schema) {
    int64_t min = 0, max = -1;
    if (schema.contains("minLength")) {
      if (!schema["minLength"].is_number_unsigned()) return absl::InvalidArgumentError("json schema: bad minLength");
      min = schema["minLength"].get<int64_t>();
    }
    if (schema.contains("maxLength")) {
      if (!schema["maxLength"].is_number_unsigned()) return absl::InvalidArgumentError("json schema: bad maxLength");
      max = schema["maxLength"].get<int64_t>();
    }
    if (min > 10000 || max > 10000 || (max >= 0 && max < min)) return absl::InvalidArgumentError("json schema: bad string length bounds");
    if (schema.contains("pattern")) {
      if (min != 0 || max != -1) return Unsupported("pattern together with minLength/maxLength");
      if (!schema["pattern"].is_string()) return absl::InvalidArgumentError("json schema: pattern must be a string");
      std::string pattern = schema["pattern"].get<std::string>();
      // JSON schema patterns search: unanchored ends match anything.
      if (!pattern.starts_with("^")) pattern = ".*(?:" + pattern + ")";
      if (!pattern.ends_with("$")) pattern = "(?:" + pattern + ").*";
      absl::StatusOr<Expr> e = ParseRegex(pattern);
      if (!e.ok()) return absl::InvalidArgumentError(absl::StrCat("json schema: pattern: ", e.status().message()));
      const std::string name = absl::StrCat("pattern-", next_id_++);
      pattern_exprs_.emplace_back(name, WithoutJsonEscapes(std::move(*e)));
      patterns_.emplace_back(name, schema["pattern"].get<std::string>());
      return NewRule("string", absl::StrCat("\"\\\"\" ", name, " \"\\\"\""));
    }
    if (min == 0 && max == -1) return Use("json-string");
    Use("json-char");
    const std::string bounds = max < 0 ? absl::StrCat("{", min, ",}") : absl::StrCat("{", min, ",", max, "}");
    return NewRule("string", absl::StrCat("\"\\\"\" json-char", bounds, " \"\\\"\""));
  }

  absl::StatusOr<std::string> Array(const json& schema, int depth) {
    Use("ws");
    int64_t min = 0, max = -1;
    if (schema.contains("minItems")) {
      if (!schema["minItems"].is_number_unsigned()) return absl::InvalidArgumentError("json schema: bad minItems");
      min = schema["minItems"].get<int64_t>();
    }
    if (schema.contains("maxItems")) {
      if (!schema["maxItems"].is_number_unsigned()) return absl::InvalidArgumentError("json schema: bad maxItems");
      max = schema["maxItems"].get<int64_t>();
    }
    if (min > 1000 || max > 1000 || (max >= 0 && max < min)) return absl::InvalidArgumentError("json schema: bad item count bounds");
    if (schema.contains("prefixItems")) {
      const json& prefix = schema["prefixItems"];
      if (!prefix.is_array() || prefix.empty()) return absl::InvalidArgumentError("json schema: prefixItems must be a non-empty array");
      if (schema.contains("items") && !(schema["items"].is_boolean() && !schema["items"].get<bool>())) {
        return Unsupported("prefixItems with more items");
      }
      std::vector<std::string> parts;
      for (const json& s : prefix) {
        absl::StatusOr<std::string> item = Visit(s, depth + 1);
        if (!item.ok()) return item;
        parts.push_back(*item);
      }
      return NewRule("tuple", absl::StrCat("\"[\" ws ", absl::StrJoin(parts, " ws \",\" ws "), " ws \"]\""));
    }
    absl::StatusOr<std::string> item = schema.contains("items") ? Visit(schema["items"], depth + 1) : Use("json-value");
    if (!item.ok()) return item;
    if (max == 0) return NewRule("array", "\"[\" ws \"]\"");
    const std::string more = max < 0 ? absl::StrCat("{", std::max<int64_t>(min - 1, 0), ",}")
                                     : absl::StrCat("{", std::max<int64_t>(min - 1, 0), ",", max - 1, "}");
    const std::string items = absl::StrCat(*item, " (ws \",\" ws ", *item, ")", more, " ws");
    return NewRule("array", min == 0 ? absl::StrCat("\"[\" ws (", items, ")? \"]\"") : absl::StrCat("\"[\" ws ", items, " \"]\""));
  }

  absl::StatusOr<std::string> Object(const json& schema, int depth) {
    Use("ws");
    const json empty = json::object();
    const json& properties = schema.contains("properties") ? schema["properties"] : empty;
    if (!properties.is_object()) return absl::InvalidArgumentError("json schema: properties must be an object");
    std::set<std::string> required;
    if (schema.contains("required")) {
      if (!schema["required"].is_array()) return absl::InvalidArgumentError("json schema: required must be an array");
      for (const json& r : schema["required"]) {
        if (!r.is_string()) return absl::InvalidArgumentError("json schema: required must list strings");
        if (!properties.contains(r.get<std::string>())) {
          return absl::InvalidArgumentError(absl::StrCat("json schema: required property '", r.get<std::string>(), "' is not in properties"));
        }
        required.insert(r.get<std::string>());
      }
    }
    // Extra members: additionalProperties true or a schema; by default only without properties.
    std::optional<std::string> extra_value;
    if (schema.contains("additionalProperties")) {
      const json& a = schema["additionalProperties"];
      if (!(a.is_boolean() && !a.get<bool>())) {
        absl::StatusOr<std::string> v = Visit(a, depth + 1);
        if (!v.ok()) return v;
        extra_value = *v;
      }
    } else if (properties.empty()) {
      extra_value = Use("json-value");
    }
    struct Member {
      std::string kv;
      bool required;
    };
    std::vector<Member> members;
    for (const auto& [name, sub] : properties.items()) {
      absl::StatusOr<std::string> value = Visit(sub, depth + 1);
      if (!value.ok()) return value;
      members.push_back({NewRule("kv", absl::StrCat(GbnfLiteral(json(name).dump()), " ws \":\" ws ", *value)),
                         required.count(name) > 0});
    }
    // members(i, first): the members from i on; `first` when none has been written yet.
    const std::string id = absl::StrCat(next_id_++);
    auto rule_name = [&](size_t i, bool first) { return absl::StrCat("obj", id, "-", i, first ? "f" : "r"); };
    std::string tail_first = "", tail_rest = "";
    if (extra_value) {
      Use("json-string");
      const std::string extra_kv = NewRule("kv", absl::StrCat("json-string ws \":\" ws ", *extra_value));
      const std::string rest = rule_name(members.size(), false);
      rules_.emplace_back(rest, absl::StrCat("| ws \",\" ws ", extra_kv, " ", rest));
      rules_.emplace_back(rule_name(members.size(), true), absl::StrCat("| ", extra_kv, " ", rest));
      tail_first = rule_name(members.size(), true);
      tail_rest = rest;
    }
    std::string next_first = tail_first, next_rest = tail_rest;
    for (size_t i = members.size(); i-- > 0;) {
      const Member& m = members[i];
      const std::string first = rule_name(i, true), rest = rule_name(i, false);
      std::string first_body = absl::StrCat(m.kv, " ", next_rest);
      std::string rest_body = absl::StrCat("ws \",\" ws ", m.kv, " ", next_rest);
      if (!m.required) {
        first_body += absl::StrCat(" | ", next_first.empty() ? "\"\"" : next_first);
        rest_body += absl::StrCat(" | ", next_rest.empty() ? "\"\"" : next_rest);
      }
      rules_.emplace_back(first, first_body);
      rules_.emplace_back(rest, rest_body);
      next_first = first;
      next_rest = rest;
    }
    return NewRule("object", absl::StrCat("\"{\" ws ", next_first, next_first.empty() ? "" : " ws", " \"}\""));
  }

  json root_;
  std::vector<std::pair<std::string, std::string>> rules_;
  std::set<std::string> used_primitives_;
  std::map<std::string, std::string> ref_rules_;
  std::vector<std::pair<std::string, Expr>> pattern_exprs_;
  std::vector<std::pair<std::string, std::string>> patterns_;
  int next_id_ = 0;
};

absl::StatusOr<SchemaConverter> Converted(const std::string& schema_json) {
  json schema = json::parse(schema_json, nullptr, false);
  if (schema.is_discarded()) return absl::InvalidArgumentError("json schema: not valid JSON");
  SchemaConverter converter(std::move(schema));
  if (absl::Status s = converter.Convert(); !s.ok()) return s;
  return converter;
}

}  // namespace

absl::StatusOr<std::string> JsonSchemaToGbnf(const std::string& schema_json) {
  absl::StatusOr<SchemaConverter> c = Converted(schema_json);
  if (!c.ok()) return c.status();
  return c->Text();
}

absl::StatusOr<std::shared_ptr<const Grammar>> JsonSchemaToGrammar(const std::string& schema_json) {
  absl::StatusOr<SchemaConverter> c = Converted(schema_json);
  if (!c.ok()) return c.status();
  return c->Build();
}

std::shared_ptr<const Grammar> JsonObjectGrammar() {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = JsonSchemaToGrammar(R"({"type": "object"})");
  return g.ok() ? *g : nullptr;
}

}  // namespace duet::grammar
