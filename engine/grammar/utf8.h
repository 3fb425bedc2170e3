// UTF-8 helpers of the grammar engine: encoding, decoding, and code point ranges as byte ranges.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace duet::grammar {

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

void AppendUtf8(uint32_t code_point, std::string& out);
// Decodes the character at `pos` and advances past it; InvalidArgument for malformed UTF-8.
absl::StatusOr<uint32_t> DecodeUtf8At(const std::string& text, size_t& pos);

// A run of byte ranges, one per byte of an encoded character: [lo0-hi0][lo1-hi1]...
using Utf8Sequence = std::vector<std::pair<uint8_t, uint8_t>>;
// The byte-range sequences whose union is exactly the UTF-8 encodings of the code points in
// [lo, hi] (surrogates excluded), as in Rust's regex-syntax utf8 module.
std::vector<Utf8Sequence> Utf8Sequences(uint32_t lo, uint32_t hi);

}  // namespace duet::grammar
