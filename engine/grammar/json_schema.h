// JSON Schema → grammar.
//
// Supported: `type` (object, array, string, number, integer, boolean, null, or a list of them),
// `properties` (emitted in schema order; those in `required` always, the others optionally),
// `additionalProperties` (false by default when `properties` is given, as xgrammar's strict
// mode; true or a schema allows more members after the listed ones), `items`, `prefixItems`,
// `minItems`, `maxItems`, `enum`, `const`, `anyOf`, `oneOf` (as anyOf), `allOf` of one schema,
// `$ref` to `#`, `#/$defs/...` or `#/definitions/...` (recursion allowed), `minLength`,
// `maxLength`, `pattern` (outputs are limited to strings that need no escape), `minimum`,
// `maximum`, `exclusiveMinimum` and `exclusiveMaximum` on integers (the range as digit
// classes, no leading zeros), and the annotations (title, description, default, examples,
// format, $schema, $id, $comment). Keywords that constrain in other ways (bounds on numbers,
// multipleOf, uniqueItems, not, ...) are InvalidArgument naming the keyword, never ignored.
//
// Layout: no whitespace at the top level; between tokens of objects and arrays "", " ", or a
// newline and up to 20 spaces or tabs (so pretty-printed output is allowed but whitespace
// cannot run on forever). Numbers: at most 16 integer digits, 16 fraction digits and 2
// exponent digits (so every number is a finite double: parsers reject 1e400).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/grammar/grammar.h"

namespace duet::grammar {

// The grammar's GBNF text (pattern rules, which are regexes, are not in the text).
absl::StatusOr<std::string> JsonSchemaToGbnf(const std::string& schema_json);
absl::StatusOr<std::shared_ptr<const Grammar>> JsonSchemaToGrammar(const std::string& schema_json);
// Any JSON object (response_format json_object).
std::shared_ptr<const Grammar> JsonObjectGrammar();

}  // namespace duet::grammar
