// Evaluator of parsed chat templates, with the semantics of @huggingface/jinja (what the
// Hugging Face JS stack renders) and Python's str.strip/split where templates rely on them.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "frontend/chat_template/chat_template_parser.h"
#include "nlohmann/json.hpp"

namespace duet::jinja {

// Bounds that keep hostile templates from hanging or exhausting memory.
struct RenderLimits {
  int64_t max_steps = 1'000'000;         // expressions, statements and loop iterations
  size_t max_string_bytes = 64 << 20;    // any string built, including the output
  int max_call_depth = 64;               // nested macro calls
  int64_t max_range_length = 1'000'000;  // range(...) elements
};

// Renders with the top-level variables of `context` (a JSON object). Runtime errors are
// InvalidArgument; raise_exception(msg) surfaces msg verbatim.
absl::StatusOr<std::string> Render(const Body& program, const std::string& source,
                                   const nlohmann::ordered_json& context, const RenderLimits& limits = {});

}  // namespace duet::jinja
