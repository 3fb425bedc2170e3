// The BPE model of HF tokenizers: vocabulary, ranked merges, byte fallback and unknown tokens.
// Tokenize() gives the same ids as tokenizers' BPE::tokenize (without dropout).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace duet {

// Open addressing (absl): a lookup touches one slot, and a token of up to 15 bytes lies in it
// (std::string's inline buffer). Lookups by std::string_view need no copy.
using TokenIdMap = absl::flat_hash_map<std::string, int32_t>;
// The key type those lookups take (this build's absl::string_view is not std::string_view).
inline absl::string_view AsKey(std::string_view s) { return absl::string_view(s.data(), s.size()); }

class BpeModel {
 public:
  // Builds from a tokenizer.json "model" object of type BPE. May throw nlohmann::json exceptions
  // on malformed input; the caller converts them.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& config);

  // Appends the ids of `word` (one pre-tokenized piece) to `ids`.
  void Tokenize(std::string_view word, std::vector<int32_t>& ids) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  const std::string* IdToToken(int32_t id) const;  // null when unknown
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  struct Merge {
    int32_t rank;
    int32_t merged_id;
  };
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  // Initial symbols of `word`: one per character, or its byte-fallback / unknown tokens.
  std::vector<int32_t> InitialSymbols(std::string_view word) const;
  void MergeSymbols(std::vector<int32_t>& symbols) const;
  // MergeSymbols for short words: scans the pairs for the lowest rank on every merge, which beats
  // the queue's allocations below kMaxScannedSymbols symbols (most pre-tokenized words).
  void MergeSymbolsByScan(std::vector<int32_t>& symbols) const;
  const Merge* FindMerge(int32_t left, int32_t right) const {
    auto it = merges_.find(PairKey(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }
  static constexpr size_t kMaxScannedSymbols = 48;

  TokenIdMap token_to_id_;
  std::vector<std::string> id_to_token_;  // "" for ids not in the vocabulary
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  int32_t byte_token_ids_[256];  // ids of "<0xXX>" tokens, -1 when absent
  // Ids of the one-character tokens below U+0800 (byte-level BPE's whole alphabet), by code point;
  // -1 when that character is not a token. InitialSymbols looks these up without hashing.
  static constexpr char32_t kCharTableSize = 0x800;
  std::vector<int32_t> char_token_ids_;

  static constexpr size_t kCacheCapacity = 20000;
  static constexpr size_t kMaxCachedWordBytes = 256;
  mutable std::mutex cache_mutex_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace duet
