// A request's output constraint (vLLM's guided_* / OpenAI's response_format) and the compiler
// that turns it into a CompiledGrammar for one vocabulary, caching by constraint.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/grammar/matcher.h"

namespace duet::grammar {

struct StructuredOutput {
  enum class Kind {
    kNone,
    kJsonSchema,  // `spec`: a JSON schema
    kJsonObject,  // any JSON object
    kRegex,       // `spec`: a regular expression the whole output matches
    kChoice,      // `choices`: the output is exactly one of them
    kGrammar,     // `spec`: GBNF (grammar.h)
  };
  Kind kind = Kind::kNone;
  std::string spec;
  std::vector<std::string> choices;

  bool active() const { return kind != Kind::kNone; }
  // "json_schema", "json_object", "regex", "choice", "grammar" ("none").
  static const char* KindName(Kind kind);
  static absl::StatusOr<Kind> ParseKind(const std::string& name);
};

// The constraint as a grammar (no vocabulary yet). InvalidArgument naming what is wrong.
absl::StatusOr<std::shared_ptr<const Grammar>> BuildGrammar(const StructuredOutput& constraint);

// Compiles constraints for one vocabulary, keeping the most recent ones (and their token-mask
// caches) for reuse by later requests with the same constraint. Thread-safe.
class GrammarCompiler {
 public:
  explicit GrammarCompiler(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity = 64);
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Compile(const StructuredOutput& constraint);
  const TokenVocabulary& vocab() const { return *vocab_; }

 private:
  std::shared_ptr<const TokenVocabulary> vocab_;
  size_t capacity_;
  std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<const CompiledGrammar>>> lru_;  // most recent first
  std::unordered_map<std::string, decltype(lru_)::iterator> index_;
};

}  // namespace duet::grammar
