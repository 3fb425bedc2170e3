#include "frontend/tokenizer/tokenizer_unicode.h"

#include <algorithm>
#include <iterator>
#include <vector>

#include "frontend/tokenizer/tokenizer_unicode_data.h"

namespace duet::unicode {
namespace {

bool IsContinuation(unsigned char byte) { return (byte & 0xC0) == 0x80; }

// Length of the valid UTF-8 sequence at bytes[pos], or 0 with `maximal_invalid` set to the length
// of the maximal ill-formed prefix (at least 1) that from_utf8_lossy replaces by one U+FFFD.
size_t ValidSequenceLength(std::string_view bytes, size_t pos, size_t& maximal_invalid) {
  const auto lead = static_cast<unsigned char>(bytes[pos]);
  maximal_invalid = 1;
  if (lead < 0x80) return 1;
  size_t length;
  unsigned char second_low = 0x80, second_high = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_low = 0xA0;
    if (lead == 0xED) second_high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_low = 0x90;
    if (lead == 0xF4) second_high = 0x8F;
  } else {
    return 0;
  }
  for (size_t i = 1; i < length; ++i) {
    if (pos + i >= bytes.size()) return 0;
    const auto byte = static_cast<unsigned char>(bytes[pos + i]);
    const bool ok = i == 1 ? (byte >= second_low && byte <= second_high) : IsContinuation(byte);
    if (!ok) return 0;
    maximal_invalid = i + 1;
  }
  return length;
}

template <typename Table, typename Key>
const auto* FindByCodePoint(const Table& table, Key code_point) {
  auto it = std::lower_bound(std::begin(table), std::end(table), code_point,
                             [](const auto& entry, Key cp) { return entry.code_point < cp; });
  return (it != std::end(table) && it->code_point == code_point) ? &*it : nullptr;
}

uint8_t CombiningClassOf(char32_t cp) {
  if (cp < 0x300) return 0;
  const auto* entry = FindByCodePoint(unicode_data::kCombiningClasses, cp);
  return entry ? entry->ccc : 0;
}

constexpr char32_t kHangulSBase = 0xAC00, kHangulLBase = 0x1100, kHangulVBase = 0x1161,
                   kHangulTBase = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28;
constexpr char32_t kHangulNCount = kHangulVCount * kHangulTCount;
constexpr char32_t kHangulSCount = kHangulLCount * kHangulNCount;

void AppendDecomposition(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kHangulSBase && cp < kHangulSBase + kHangulSCount) {
    const char32_t index = cp - kHangulSBase;
    out.push_back(kHangulLBase + index / kHangulNCount);
    out.push_back(kHangulVBase + (index % kHangulNCount) / kHangulTCount);
    if (index % kHangulTCount != 0) out.push_back(kHangulTBase + index % kHangulTCount);
    return;
  }
  const auto* entry = cp < 0xC0 ? nullptr : FindByCodePoint(unicode_data::kDecompositions, cp);
  if (entry == nullptr) {
    out.push_back(cp);
    return;
  }
  out.insert(out.end(), unicode_data::kDecompositionChars + entry->offset,
             unicode_data::kDecompositionChars + entry->offset + entry->length);
}

// The primary composite of (first, second), or 0.
char32_t Compose(char32_t first, char32_t second) {
  if (first >= kHangulLBase && first < kHangulLBase + kHangulLCount && second >= kHangulVBase &&
      second < kHangulVBase + kHangulVCount) {
    return kHangulSBase + ((first - kHangulLBase) * kHangulVCount + (second - kHangulVBase)) *
                              kHangulTCount;
  }
  if (first >= kHangulSBase && first < kHangulSBase + kHangulSCount &&
      (first - kHangulSBase) % kHangulTCount == 0 && second > kHangulTBase &&
      second < kHangulTBase + kHangulTCount) {
    return first + (second - kHangulTBase);
  }
  const auto& table = unicode_data::kCompositions;
  auto it = std::lower_bound(std::begin(table), std::end(table), std::make_pair(first, second),
                             [](const unicode_data::Composition& entry, std::pair<char32_t, char32_t> key) {
                               return std::make_pair(entry.first, entry.second) < key;
                             });
  return (it != std::end(table) && it->first == first && it->second == second) ? it->composite : 0;
}

}  // namespace

size_t Utf8SequenceLength(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

char32_t DecodeUtf8(std::string_view text, size_t& pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  const size_t length = std::min(Utf8SequenceLength(lead), text.size() - pos);
  char32_t cp = length == 1 ? lead : (lead & (0xFF >> (length + 1)));
  for (size_t i = 1; i < length; ++i) cp = (cp << 6) | (static_cast<unsigned char>(text[pos + i]) & 0x3F);
  pos += length;
  return cp;
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsValidUtf8(std::string_view text) {
  size_t invalid_length;
  for (size_t pos = 0; pos < text.size();) {
    const size_t length = ValidSequenceLength(text, pos, invalid_length);
    if (length == 0) return false;
    pos += length;
  }
  return true;
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t invalid_length;
  for (size_t pos = 0; pos < bytes.size();) {
    const size_t length = ValidSequenceLength(bytes, pos, invalid_length);
    if (length == 0) {
      out += kReplacementChar;
      pos += invalid_length;
    } else {
      out.append(bytes.substr(pos, length));
      pos += length;
    }
  }
  return out;
}

bool IsWhitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

std::string ToNfc(std::string_view text) {
  bool fast = true;
  for (size_t pos = 0; pos < text.size() && fast;) {
    fast = DecodeUtf8(text, pos) < unicode_data::kNfcFastPathLimit;
  }
  if (fast) return std::string(text);

  std::vector<char32_t> chars;
  chars.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) AppendDecomposition(DecodeUtf8(text, pos), chars);

  // Canonical ordering: stable-sort each run of non-starters by combining class.
  for (size_t i = 0; i < chars.size();) {
    if (CombiningClassOf(chars[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < chars.size() && CombiningClassOf(chars[end]) != 0) ++end;
    std::stable_sort(chars.begin() + i, chars.begin() + end,
                     [](char32_t a, char32_t b) { return CombiningClassOf(a) < CombiningClassOf(b); });
    i = end;
  }

  // Canonical composition.
  std::vector<char32_t> composed;
  composed.reserve(chars.size());
  size_t starter = SIZE_MAX;  // index in `composed` of the last starter
  int last_class = -1;        // class of the last character appended after the starter
  for (char32_t cp : chars) {
    const int cls = CombiningClassOf(cp);
    if (starter != SIZE_MAX) {
      const bool blocked = last_class != -1 && last_class >= cls;
      if (!blocked) {
        if (char32_t composite = Compose(composed[starter], cp); composite != 0) {
          composed[starter] = composite;
          continue;
        }
      }
    }
    if (cls == 0) {
      starter = composed.size();
      last_class = -1;
    } else {
      last_class = cls;
    }
    composed.push_back(cp);
  }

  std::string out;
  out.reserve(text.size());
  for (char32_t cp : composed) AppendUtf8(cp, out);
  return out;
}

std::string ToLowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t start = pos;
    const char32_t cp = DecodeUtf8(text, pos);
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + ('a' - 'A') : cp));
    } else if (const auto* entry = FindByCodePoint(unicode_data::kLowercase, cp)) {
      out += entry->utf8;
    } else {
      out.append(text.substr(start, pos - start));
    }
  }
  return out;
}

}  // namespace duet::unicode
