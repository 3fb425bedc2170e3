#include "engine/grammar/utf8.h"

namespace duet::grammar {

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

absl::StatusOr<uint32_t> DecodeUtf8At(const std::string& text, size_t& pos) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char b0 = byte(pos);
  int n = 0;
  uint32_t cp = 0;
  if (b0 < 0x80) {
    ++pos;
    return b0;
  } else if ((b0 & 0xE0) == 0xC0) {
    n = 1, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 2, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 3, cp = b0 & 0x07;
  } else {
    return absl::InvalidArgumentError("invalid UTF-8");
  }
  if (pos + size_t(n) >= text.size()) {
    return absl::InvalidArgumentError("truncated UTF-8");
  }
  for (int i = 1; i <= n; ++i) {
    const unsigned char b = byte(pos + size_t(i));
    if ((b & 0xC0) != 0x80) return absl::InvalidArgumentError("invalid UTF-8");
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
    return absl::InvalidArgumentError("invalid UTF-8");
  }
  pos += size_t(n) + 1;
  return cp;
}

namespace {

void Split(uint32_t lo, uint32_t hi, std::vector<Utf8Sequence>& out) {
  if (lo > hi) return;
  // Surrogates have no encoding.
  if (lo <= 0xDFFF && hi >= 0xD800) {
    if (lo < 0xD800) Split(lo, 0xD7FF, out);
    if (hi > 0xDFFF) Split(0xE000, hi, out);
    return;
  }
  // Split where the encoded length changes.
  for (uint32_t boundary : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= boundary && hi > boundary) {
      Split(lo, boundary, out);
      Split(boundary + 1, hi, out);
      return;
    }
  }
  if (hi < 0x80) {
    out.push_back({{uint8_t(lo), uint8_t(hi)}});
    return;
  }
  // Make every continuation byte range independent of the ones before it.
  for (int i = 1; i < 4; ++i) {
    const uint32_t m = (uint32_t(1) << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Split(lo, lo | m, out);
        Split((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Split(lo, (hi & ~m) - 1, out);
        Split(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  AppendUtf8(lo, a);
  AppendUtf8(hi, b);
  Utf8Sequence seq;
  for (size_t i = 0; i < a.size(); ++i) seq.push_back({uint8_t(a[i]), uint8_t(b[i])});
  out.push_back(std::move(seq));
}

}  // namespace

std::vector<Utf8Sequence> Utf8Sequences(uint32_t lo, uint32_t hi) {
  std::vector<Utf8Sequence> out;
  Split(lo, std::min(hi, kMaxCodePoint), out);
  return out;
}

}  // namespace duet::grammar
