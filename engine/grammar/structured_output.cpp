#include "engine/grammar/structured_output.h"

#include "absl/strings/str_cat.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex.h"

namespace duet::grammar {

const char* StructuredOutput::KindName(Kind kind) {
  switch (kind) {
    case Kind::kNone: return "none";
    case Kind::kJsonSchema: return "json_schema";
    case Kind::kJsonObject: return "json_object";
    case Kind::kRegex: return "regex";
    case Kind::kChoice: return "choice";
    case Kind::kGrammar: return "grammar";
  }
  return "none";
}

absl::StatusOr<StructuredOutput::Kind> StructuredOutput::ParseKind(const std::string& name) {
  for (Kind k : {Kind::kNone, Kind::kJsonSchema, Kind::kJsonObject, Kind::kRegex, Kind::kChoice, Kind::kGrammar}) {
    if (name == KindName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "structured output kind must be json_schema, json_object, regex, choice or grammar, got '", name, "'"));
}

absl::StatusOr<std::shared_ptr<const Grammar>> BuildGrammar(const StructuredOutput& c) {
  switch (c.kind) {
    case StructuredOutput::Kind::kNone:
      return absl::InvalidArgumentError("no structured output constraint");
    case StructuredOutput::Kind::kJsonSchema:
      return JsonSchemaToGrammar(c.spec);
    case StructuredOutput::Kind::kJsonObject:
      return JsonObjectGrammar();
    case StructuredOutput::Kind::kRegex:
      return RegexToGrammar(c.spec);
    case StructuredOutput::Kind::kGrammar:
      return ParseGbnf(c.spec);
    case StructuredOutput::Kind::kChoice: {
      if (c.choices.empty()) return absl::InvalidArgumentError("guided_choice must list at least one string");
      std::vector<Expr> alts;
      for (const std::string& s : c.choices) alts.push_back(Expr::Literal(s));
      return Grammar::Build({{"root", Expr::Alternation(std::move(alts))}}, "root");
    }
  }
  return absl::InvalidArgumentError("unknown structured output kind");
}

GrammarCompiler::GrammarCompiler(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity)
    : vocab_(std::move(vocab)), capacity_(std::max<size_t>(capacity, 1)) {}

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::Compile(const StructuredOutput& c) {
  std::string key = absl::StrCat(StructuredOutput::KindName(c.kind), ":", c.spec);
  for (const std::string& choice : c.choices) absl::StrAppend(&key, "\x1F", choice);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = index_.find(key); it != index_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    return lru_.front().second;
  }
  absl::StatusOr<std::shared_ptr<const Grammar>> grammar = BuildGrammar(c);
  if (!grammar.ok()) return grammar.status();
  auto compiled = std::make_shared<const CompiledGrammar>(std::move(*grammar), vocab_);
  if (compiled->initial_stacks().empty()) return absl::InvalidArgumentError("the constraint matches nothing");
  lru_.emplace_front(key, compiled);
  index_[key] = lru_.begin();
  if (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return compiled;
}

}  // namespace duet::grammar
