// Regular expressions → grammar. The output must match the whole pattern (as vLLM's
// guided_regex). Supported: literals, `.` (any character but newline), classes `[a-z]`, `[^...]`,
// \d \w \s \D \W \S, escapes (\n \t \xHH \uHHHH, \. ...), groups `( )`, `(?: )`, named groups,
// `|`, `* + ? {n} {n,} {n,m}` (lazy forms too: same language), `^` at the start and `$` at the
// end. Backreferences, lookaround, word boundaries and inline flags are InvalidArgument.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/grammar/grammar.h"

namespace duet::grammar {

absl::StatusOr<Expr> ParseRegex(const std::string& pattern);
absl::StatusOr<std::shared_ptr<const Grammar>> RegexToGrammar(const std::string& pattern);

}  // namespace duet::grammar
