#include <fstream>
#include <random>
#include <sstream>

#include "engine/grammar/grammar.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/matcher.h"
#include "engine/grammar/regex.h"
#include "engine/grammar/structured_output.h"
#include "engine/grammar/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace duet::grammar {
namespace {

bool Matches(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  CompiledGrammar compiled(g, TokenVocabulary::FromTokenStrings({}, {}));
  GrammarMatcher m(std::shared_ptr<const CompiledGrammar>(&compiled, [](const CompiledGrammar*) {}));
  return m.AcceptBytes(text) && m.CanEnd();
}

std::shared_ptr<const Grammar> Gbnf(const std::string& text) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = ParseGbnf(text);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

std::shared_ptr<const Grammar> Regex(const std::string& pattern) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = RegexToGrammar(pattern);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

std::shared_ptr<const Grammar> Schema(const std::string& schema) {
  absl::StatusOr<std::shared_ptr<const Grammar>> g = JsonSchemaToGrammar(schema);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

TEST(Utf8, SequencesCoverExactlyTheRange) {
  // Every code point of a range that crosses every length boundary is covered, its neighbours not.
  const uint32_t lo = 0x70, hi = 0x10010;
  const std::vector<Utf8Sequence> seqs = Utf8Sequences(lo, hi);
  auto covered = [&](uint32_t cp) {
    std::string b;
    AppendUtf8(cp, b);
    for (const Utf8Sequence& s : seqs) {
      if (s.size() != b.size()) continue;
      bool all = true;
      for (size_t i = 0; i < b.size(); ++i) all &= uint8_t(b[i]) >= s[i].first && uint8_t(b[i]) <= s[i].second;
      if (all) return true;
    }
    return false;
  };
  for (uint32_t cp = 0; cp < 0x10100; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    EXPECT_EQ(covered(cp), cp >= lo && cp <= hi) << std::hex << cp;
  }
}

TEST(Gbnf, LiteralsClassesAndRepetition) {
  auto g = Gbnf(R"(
    # a comment
    root ::= "a" digits ("," digits)* | "x"{2,3}
    digits ::= [0-9]+
  )");
  EXPECT_TRUE(Matches(g, "a1"));
  EXPECT_TRUE(Matches(g, "a12,3,456"));
  EXPECT_TRUE(Matches(g, "xx"));
  EXPECT_TRUE(Matches(g, "xxx"));
  EXPECT_FALSE(Matches(g, "x"));
  EXPECT_FALSE(Matches(g, "xxxx"));
  EXPECT_FALSE(Matches(g, "a"));
  EXPECT_FALSE(Matches(g, "a1,"));
}

TEST(Gbnf, UnicodeClassesAndEscapes) {
  auto g = Gbnf(R"(root ::= [^"\\\x00-\x1F]* "\"" [α-ω] "\u00e9" .)");
  EXPECT_TRUE(Matches(g, "héllo 世界\"βéz"));
  EXPECT_TRUE(Matches(g, "\"ωé😀"));
  EXPECT_FALSE(Matches(g, "a\\b\"βéz"));
  EXPECT_FALSE(Matches(g, "\"aéz"));
  EXPECT_FALSE(Matches(g, "\"β\xC3"));  // a truncated character is no character
}

TEST(Gbnf, Errors) {
  EXPECT_THAT(ParseGbnf("root ::= x").status().message(), testing::HasSubstr("'x' is not defined"));
  EXPECT_THAT(ParseGbnf("root ::= root \"a\" | \"b\"").status().message(), testing::HasSubstr("left recursion"));
  EXPECT_THAT(ParseGbnf("root ::= (\"a\"?)*").status().message(), testing::HasSubstr("left recursion"));
  EXPECT_THAT(ParseGbnf("item ::= \"a\"").status().message(), testing::HasSubstr("no 'root' rule"));
  EXPECT_FALSE(ParseGbnf("root ::= \"a").ok());
  EXPECT_FALSE(ParseGbnf("root ::= [a").ok());
  EXPECT_FALSE(ParseGbnf("root ::= \"a\"{3,2}").ok());
  EXPECT_FALSE(ParseGbnf("root = \"a\"").ok());
}

TEST(Regex, Matching) {
  auto phone = Regex(R"(^\(\d{3}\) \d{3}-\d{4}$)");
  EXPECT_TRUE(Matches(phone, "(555) 123-4567"));
  EXPECT_FALSE(Matches(phone, "555-123-4567"));
  auto email = Regex(R"([a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,4})");
  EXPECT_TRUE(Matches(email, "john.doe@example.com"));
  EXPECT_FALSE(Matches(email, "john@example"));
  auto alt = Regex(R"((?:cat|dog)s?|[^a-z\s]\w*?)");
  EXPECT_TRUE(Matches(alt, "dogs"));
  EXPECT_TRUE(Matches(alt, "cat"));
  EXPECT_TRUE(Matches(alt, "X_9"));
  EXPECT_FALSE(Matches(alt, "bird"));
  auto dot = Regex("a.c");
  EXPECT_TRUE(Matches(dot, "a€c"));
  EXPECT_FALSE(Matches(dot, "a\nc"));
}

TEST(Regex, UnsupportedIsAnError) {
  for (const char* bad : {"(a)\\1", "a(?=b)", "\\bword", "a{2,1}", "(ab", "ab)", "*a", "[z-a]", "a++"}) {
    EXPECT_FALSE(RegexToGrammar(bad).ok()) << bad;
  }
}

TEST(JsonSchema, ObjectsWithRequiredAndOptionalProperties) {
  auto g = Schema(R"({"type": "object", "properties": {
      "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
      "required": ["name"]})");
  EXPECT_TRUE(Matches(g, R"({"name": "a"})"));
  EXPECT_TRUE(Matches(g, R"({"name":"a","age":3})"));
  EXPECT_TRUE(Matches(g, R"({"name": "a", "tags": ["x", "y"]})"));
  EXPECT_TRUE(Matches(g, "{\n  \"name\": \"a\",\n  \"age\": -10,\n  \"tags\": []\n}"));
  EXPECT_FALSE(Matches(g, R"({"age": 3})"));              // name is required
  EXPECT_FALSE(Matches(g, R"({"age": 3, "name": "a"})"));  // schema order
  EXPECT_FALSE(Matches(g, R"({"name": "a",})"));
  EXPECT_FALSE(Matches(g, R"({"name": "a", "other": 1})"));  // no additional properties
  EXPECT_FALSE(Matches(g, R"({"name": "a", "age": 3.5})"));
  EXPECT_FALSE(Matches(g, R"({"name": "a", "age": 012})"));
}

TEST(JsonSchema, StringsEnumsConstNumbersAnyOf) {
  auto g = Schema(R"({"type": "object", "properties": {
      "s": {"type": "string", "minLength": 2, "maxLength": 3},
      "e": {"enum": ["red", "green", 3, null]},
      "c": {"const": "fixed\"q"},
      "n": {"type": "number"},
      "u": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
      "t": {"type": ["integer", "string"]}},
      "required": ["s", "e", "c", "n", "u", "t"]})");
  EXPECT_TRUE(Matches(g, R"({"s": "ab", "e": "red", "c": "fixed\"q", "n": -1.5e+3, "u": true, "t": 7})"));
  EXPECT_TRUE(Matches(g, R"({"s": "a\u00e9\n", "e": 3, "c": "fixed\"q", "n": 0, "u": null, "t": "x"})"));
  EXPECT_FALSE(Matches(g, R"({"s": "a", "e": "red", "c": "fixed\"q", "n": 0, "u": true, "t": 7})"));
  EXPECT_FALSE(Matches(g, R"({"s": "abcd", "e": "red", "c": "fixed\"q", "n": 0, "u": true, "t": 7})"));
  EXPECT_FALSE(Matches(g, R"({"s": "ab", "e": "blue", "c": "fixed\"q", "n": 0, "u": true, "t": 7})"));
  EXPECT_FALSE(Matches(g, R"({"s": "ab", "e": "red", "c": "fixed", "n": 0, "u": true, "t": 7})"));
  EXPECT_FALSE(Matches(g, R"({"s": "ab", "e": "red", "c": "fixed\"q", "n": 1., "u": true, "t": 7})"));
  EXPECT_FALSE(Matches(g, R"({"s": "ab", "e": "red", "c": "fixed\"q", "n": 0, "u": 1, "t": 7})"));
  EXPECT_FALSE(Matches(g, R"({"s": "a\q", "e": "red", "c": "fixed\"q", "n": 0, "u": true, "t": 7})"));
}

// Integer bounds: every integer of a window around each range matches exactly when it is inside.
TEST(JsonSchema, IntegerBoundsMatchExactlyTheRange) {
  struct Range {
    std::string bounds;
    int64_t lo, hi;
  };
  const std::vector<Range> ranges = {
      {R"("minimum": 0, "maximum": 9)", 0, 9},
      {R"("minimum": 10, "maximum": 99)", 10, 99},
      {R"("minimum": -37, "maximum": 1205)", -37, 1205},
      {R"("minimum": 5, "maximum": 5)", 5, 5},
      {R"("minimum": -100, "maximum": -3)", -100, -3},
      {R"("minimum": 190, "maximum": 2001)", 190, 2001},
      {R"("exclusiveMinimum": 7, "exclusiveMaximum": 100)", 8, 99},
      {R"("minimum": 2.5, "maximum": 30.5)", 3, 30},
      {R"("minimum": 123)", 123, 9'999'999'999'999'999},
      {R"("maximum": -12)", -9'999'999'999'999'999, -12},
  };
  for (const Range& r : ranges) {
    auto g = Schema(R"({"type": "integer", )" + r.bounds + "}");
    ASSERT_NE(g, nullptr) << r.bounds;
    auto window = [&](int64_t center) {
      for (int64_t v = center - 150; v <= center + 150; ++v) {
        EXPECT_EQ(Matches(g, std::to_string(v)), v >= r.lo && v <= r.hi) << r.bounds << ": " << v;
      }
    };
    if (r.lo > -1'000'000) window(r.lo);
    if (r.hi < 1'000'000) window(r.hi);
    EXPECT_FALSE(Matches(g, "0" + std::to_string(std::max<int64_t>(r.lo, 1)))) << r.bounds;  // leading zero
    EXPECT_FALSE(Matches(g, "-0")) << r.bounds;
  }
  EXPECT_TRUE(Matches(Schema(R"({"type": "integer", "minimum": 123})"), "9999999999999999"));
  EXPECT_FALSE(Matches(Schema(R"({"type": "integer", "minimum": 123})"), "99999999999999999"));
  for (const char* bad : {R"({"type": "integer", "minimum": 5, "maximum": 4})", R"({"type": "integer", "minimum": "1"})",
                          R"({"type": "number", "minimum": 1})", R"({"minimum": 1})",
                          R"({"type": "integer", "maximum": 1e20})"}) {
    EXPECT_FALSE(JsonSchemaToGrammar(bad).ok()) << bad;
  }
}

TEST(JsonSchema, ArraysRefsAndPatterns) {
  auto g = Schema(R"({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"]}},
      "type": "object", "properties": {
        "root": {"$ref": "#/$defs/node"},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}], "items": false},
        "few": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d+$"}},
      "required": ["root", "pair", "few", "code"]})");
  EXPECT_TRUE(Matches(g, R"({"root": {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}, "pair": ["a", false], "few": [1], "code": "AB-12"})"));
  EXPECT_FALSE(Matches(g, R"({"root": {"v": 1, "kids": [{"v": 2}, {"v": 3}, {"v": 4}]}, "pair": ["a", false], "few": [1], "code": "AB-12"})"));
  EXPECT_FALSE(Matches(g, R"({"root": {"v": 1}, "pair": ["a"], "few": [1], "code": "AB-12"})"));
  EXPECT_FALSE(Matches(g, R"({"root": {"v": 1}, "pair": ["a", true], "few": [], "code": "AB-12"})"));
  EXPECT_FALSE(Matches(g, R"({"root": {"v": 1}, "pair": ["a", true], "few": [1, 2, 3, 4], "code": "AB-12"})"));
  EXPECT_FALSE(Matches(g, R"({"root": {"v": 1}, "pair": ["a", true], "few": [1], "code": "ab-12"})"));
}

TEST(JsonSchema, AnyObjectAndErrors) {
  auto any = JsonObjectGrammar();
  EXPECT_TRUE(Matches(any, R"({"a": [1, {"b": null}, "x\"y"], "c": {}})"));
  EXPECT_TRUE(Matches(any, "{}"));
  EXPECT_FALSE(Matches(any, "[1]"));
  EXPECT_FALSE(Matches(any, R"({"a": 1,})"));
  for (const char* bad : {R"({"type": "integer", "multipleOf": 3})", R"({"type": "strin"})", "not json",
                          R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})",
                          R"({"$ref": "#/$defs/missing"})", R"({"not": {}})", "false"}) {
    EXPECT_FALSE(JsonSchemaToGrammar(bad).ok()) << bad;
  }
  EXPECT_THAT(JsonSchemaToGrammar(R"({"type": "integer", "multipleOf": 3})").status().message(),
              testing::HasSubstr("'multipleOf'"));
}

// --- token masks -------------------------------------------------------------------------------

// The bundled model's vocabulary, read straight from its tokenizer.json.
std::shared_ptr<const TokenVocabulary> TinyVocab() {
  std::ifstream in(std::string(DUET_MODELS_DIR) + "/tiny-code-llama/tokenizer.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const nlohmann::json t = nlohmann::json::parse(ss.str());
  std::vector<std::optional<std::string>> strings(8192);
  for (const auto& [token, id] : t["model"]["vocab"].items()) strings[id.get<size_t>()] = token;
  for (const auto& added : t["added_tokens"]) strings[added["id"].get<size_t>()] = std::nullopt;
  return TokenVocabulary::FromTokenStrings(strings, {1});
}

// The mask, token by token, from the matcher itself.
std::vector<bool> BruteForceMask(const GrammarMatcher& m) {
  const TokenVocabulary& v = m.compiled().vocab();
  std::vector<bool> allowed(size_t(v.size()));
  for (int32_t id = 0; id < v.size(); ++id) {
    GrammarMatcher copy = m;
    allowed[size_t(id)] = copy.AcceptToken(id);
  }
  return allowed;
}

TEST(TokenVocabulary, DecodesByteLevelSpellings) {
  auto v = TinyVocab();
  int32_t newline = -1, space_def = -1;
  for (int32_t id = 0; id < v->size(); ++id) {
    if (v->bytes(id) == "\n") newline = id;
    if (v->bytes(id) == " def") space_def = id;
  }
  EXPECT_GE(newline, 0);
  EXPECT_GE(space_def, 0);
  EXPECT_FALSE(v->is_text(0));  // <|begin_of_text|>
}

// Walks random paths through each grammar with the real vocabulary, checking at every step that
// the cached mask equals the brute-force one, then takes an allowed token at random.
TEST(TokenMask, EqualsBruteForceAlongRandomPaths) {
  auto vocab = TinyVocab();
  const std::vector<StructuredOutput> constraints = {
      {StructuredOutput::Kind::kJsonObject, "", {}},
      {StructuredOutput::Kind::kJsonSchema,
       R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "number"},
           "kind": {"enum": ["def", "class", "import os"]}, "ok": {"type": "boolean"},
           "xs": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}}, "required": ["name", "kind"]})",
       {}},
      {StructuredOutput::Kind::kRegex, R"((def|class) [a-z_]{1,12}\(\w*\):)", {}},
      {StructuredOutput::Kind::kChoice, "", {"return", "return None", "raise", "pass"}},
      {StructuredOutput::Kind::kGrammar, R"G(root ::= "print(" arg ("," " "? arg)* ")"
                                            arg ::= [0-9]+ | "'" [a-z ]* "'")G",
       {}},
  };
  std::mt19937 rng(7);
  GrammarCompiler compiler(vocab);
  for (const StructuredOutput& c : constraints) {
    absl::StatusOr<std::shared_ptr<const CompiledGrammar>> compiled = compiler.Compile(c);
    ASSERT_TRUE(compiled.ok()) << compiled.status();
    for (int path = 0; path < 4; ++path) {
      GrammarMatcher m(*compiled);
      for (int step = 0; step < 40 && !m.IsTerminated(); ++step) {
        std::vector<uint32_t> mask(size_t(vocab->mask_words()));
        m.FillNextTokenMask(absl::MakeSpan(mask));
        const std::vector<bool> expected = BruteForceMask(m);
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab->size(); ++id) {
          const bool got = (mask[size_t(id) / 32] >> (id % 32)) & 1;
          ASSERT_EQ(got, expected[size_t(id)]) << StructuredOutput::KindName(c.kind) << " step " << step
                                               << " token " << id << " '" << vocab->bytes(id) << "'";
          if (got) allowed.push_back(id);
        }
        ASSERT_FALSE(allowed.empty());
        const int32_t pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
        if (pick == 1) break;  // EOS
        ASSERT_TRUE(m.AcceptToken(pick));
      }
    }
  }
}

TEST(TokenMask, EosOnlyWhereTheGrammarMayEnd) {
  auto vocab = TinyVocab();
  GrammarCompiler compiler(vocab);
  auto compiled = compiler.Compile({StructuredOutput::Kind::kRegex, "ab+", {}});
  ASSERT_TRUE(compiled.ok());
  GrammarMatcher m(*compiled);
  EXPECT_FALSE(m.AcceptToken(1));
  ASSERT_TRUE(m.AcceptBytes("ab"));
  EXPECT_TRUE(m.CanEnd());
  EXPECT_FALSE(m.IsTerminated());
  std::vector<uint32_t> mask(size_t(vocab->mask_words()));
  m.FillNextTokenMask(absl::MakeSpan(mask));
  EXPECT_TRUE(mask[0] & 2u);  // EOS
  auto choice = compiler.Compile({StructuredOutput::Kind::kChoice, "", {"yes"}});
  ASSERT_TRUE(choice.ok());
  GrammarMatcher done(*choice);
  ASSERT_TRUE(done.AcceptBytes("yes"));
  EXPECT_TRUE(done.IsTerminated());
}

TEST(GrammarCompiler, ReusesCompiledGrammars) {
  GrammarCompiler compiler(TinyVocab(), 2);
  auto a = compiler.Compile({StructuredOutput::Kind::kRegex, "a+", {}});
  auto b = compiler.Compile({StructuredOutput::Kind::kRegex, "a+", {}});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->get(), b->get());
  EXPECT_FALSE(compiler.Compile({StructuredOutput::Kind::kRegex, "(a", {}}).ok());
  EXPECT_FALSE(compiler.Compile({StructuredOutput::Kind::kChoice, "", {}}).ok());
}

}  // namespace
}  // namespace duet::grammar

namespace duet::grammar {
namespace {

// Inputs of every front end, mutated at random (fixed seed): each must give a grammar or an
// error, never a crash or a hang, and a grammar must run on the real vocabulary.
TEST(GrammarFuzz, MutatedInputsNeverCrash) {
  const std::vector<std::pair<StructuredOutput::Kind, std::string>> seeds = {
      {StructuredOutput::Kind::kGrammar, R"G(root ::= "a" [0-9]+ ("," x){2,4} | .* "\u00e9"
x ::= [^"\\] x? | "(" root ")")G"},
      {StructuredOutput::Kind::kRegex, R"(^(?:[a-z]+|\d{2,3})*\.(com|org)\s[^\W_]{1,5}?$)"},
      {StructuredOutput::Kind::kJsonSchema,
       R"({"type": "object", "properties": {"a": {"type": "array", "items": {"$ref": "#"}, "maxItems": 3},
           "b": {"enum": [1, "x", null]}, "c": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 0}},
           "required": ["a"], "additionalProperties": {"type": "integer"}})"},
  };
  const std::string alphabet = "()[]{}|*+?.^$\\\"',:-0123456789az ::=root{}\n\u00e9";
  auto vocab = TinyVocab();
  GrammarCompiler compiler(vocab, 4);
  std::mt19937 rng(18);
  std::vector<uint32_t> mask(size_t(vocab->mask_words()));
  int accepted = 0;
  for (int i = 0; i < 3000; ++i) {
    auto [kind, text] = seeds[size_t(i) % seeds.size()];
    for (int edits = 1 + int(rng() % 4); edits > 0 && !text.empty(); --edits) {
      const size_t at = rng() % text.size();
      switch (rng() % 3) {
        case 0: text.erase(at, 1 + rng() % 3); break;
        case 1: text.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
        default: text[at] = char(rng() % 256); break;
      }
    }
    absl::StatusOr<std::shared_ptr<const CompiledGrammar>> c = compiler.Compile({kind, text, {}});
    if (!c.ok()) {
      EXPECT_FALSE(c.status().message().empty());
      continue;
    }
    ++accepted;
    GrammarMatcher m(*c);
    for (int step = 0; step < 8 && !m.IsTerminated(); ++step) {
      m.FillNextTokenMask(absl::MakeSpan(mask));
      int32_t pick = -1;
      for (int32_t id = 2; id < vocab->size() && pick < 0; ++id) {
        if ((mask[size_t(id) / 32] >> (id % 32)) & 1 && rng() % 8 == 0) pick = id;
      }
      if (pick < 0 || !m.AcceptToken(pick)) break;
    }
  }
  EXPECT_GT(accepted, 100);  // the mutations explore past the parsers' first checks
}

TEST(GrammarFuzz, HugeRepetitionsAreErrorsOrSmall) {
  for (const char* pattern : {"(a{1000}){1000}", "((ab){100}){100}{100}", "(a|b){0,10000}", "x{10000}y{10000}"}) {
    absl::StatusOr<std::shared_ptr<const Grammar>> g = RegexToGrammar(pattern);
    if (g.ok()) {
      EXPECT_LT((*g)->elements().size(), size_t(1) << 22) << pattern;
    }
  }
}

}  // namespace
}  // namespace duet::grammar
