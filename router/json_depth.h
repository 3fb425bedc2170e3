// A guard for parsing untrusted JSON: nlohmann's parser recurses once per nesting level.
#pragma once

#include <string_view>

namespace duet::router {

// The deepest nesting a request's JSON (a body, a schema, a call's arguments) may have.
inline constexpr int kMaxRequestJsonDepth = 128;

// Whether `text`'s bracket nesting stays within `limit` (brackets inside strings skipped), so a
// hostile text cannot exhaust the stack when parsed.
inline bool JsonDepthWithin(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > limit) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

}  // namespace duet::router
