// UTF-8 and Unicode helpers for the tokenizer: code point iteration, lossy UTF-8 repair (as Rust's
// String::from_utf8_lossy), NFC, lowercase and whitespace tests.
#pragma once

#include <string>
#include <string_view>

namespace duet::unicode {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Decodes the code point starting at text[pos] (which must be valid UTF-8) and advances pos.
char32_t DecodeUtf8(std::string_view text, size_t& pos);
void AppendUtf8(char32_t code_point, std::string& out);
// Byte length of the UTF-8 sequence that starts with `lead` (1 for invalid leads).
size_t Utf8SequenceLength(unsigned char lead);

bool IsValidUtf8(std::string_view text);
// Replaces each maximal ill-formed subsequence by U+FFFD, exactly as from_utf8_lossy.
std::string Utf8Lossy(std::string_view bytes);

// Unicode White_Space property (Rust's char::is_whitespace).
bool IsWhitespace(char32_t code_point);

std::string ToNfc(std::string_view text);      // text must be valid UTF-8
std::string ToLowercase(std::string_view text);  // per-character full lowercase mapping

}  // namespace duet::unicode
