// Little helpers to write and read the fixed-width, little-endian binary blobs that kvtransfer
// puts on the wire (layouts, receiver descriptors). A reader never trusts its input: every read
// is bounds-checked and a short or corrupt blob becomes an absl::Status, never a crash.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace duet::kvtransfer {

static_assert(std::endian::native == std::endian::little,
              "kvtransfer wire blobs are little-endian and written with memcpy");

class ByteWriter {
 public:
  template <typename T>
  void Put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  // A length-prefixed (uint32) byte string.
  void PutBytes(std::string_view bytes) {
    Put<uint32_t>(static_cast<uint32_t>(bytes.size()));
    out_.append(bytes);
  }
  std::string Take() && { return std::move(out_); }

 private:
  std::string out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::string_view in, std::string_view what) : in_(in), what_(what) {}

  template <typename T>
  absl::StatusOr<T> Get() {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in_.size() < sizeof(T)) return Truncated();
    T value;
    std::memcpy(&value, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return value;
  }
  absl::StatusOr<std::string_view> GetBytes() {
    absl::StatusOr<uint32_t> size = Get<uint32_t>();
    if (!size.ok()) return size.status();
    if (in_.size() < *size) return Truncated();
    std::string_view bytes = in_.substr(0, *size);
    in_.remove_prefix(*size);
    return bytes;
  }
  bool AtEnd() const { return in_.empty(); }

 private:
  absl::Status Truncated() const {
    return absl::InvalidArgumentError(std::string(what_) + ": blob is truncated or corrupt");
  }
  std::string_view in_;
  std::string_view what_;
};

}  // namespace duet::kvtransfer
