#include "engine/kv/block_hash.h"

#include "common/check.h"

namespace duet {

namespace {

// 64-bit multiply-rotate mixing (the xxHash64 round and avalanche constants).
constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kPrime3 = 0x165667B19E3779F9ull;

uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t Round(uint64_t acc, uint64_t input) { return Rotl(acc + input * kPrime2, 31) * kPrime1; }

uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

uint64_t HashBytes(uint64_t acc, std::string_view bytes) {
  acc = Round(acc, bytes.size());
  for (unsigned char c : bytes) acc = Round(acc, c);
  return acc;
}

}  // namespace

BlockHash PrefixSeed(std::string_view model, std::string_view cache_salt) {
  return Avalanche(HashBytes(HashBytes(kPrime3, model), cache_salt));
}

BlockHash HashBlock(BlockHash parent, absl::Span<const int32_t> tokens) {
  uint64_t acc = Round(parent ^ kPrime1, tokens.size());
  // Two token ids per round: a block is hashed once per scheduling of its sequence.
  size_t i = 0;
  for (; i + 1 < tokens.size(); i += 2) {
    acc = Round(acc, uint64_t(uint32_t(tokens[i])) | (uint64_t(uint32_t(tokens[i + 1])) << 32));
  }
  if (i < tokens.size()) acc = Round(acc, uint32_t(tokens[i]));
  return Avalanche(acc);
}

std::vector<BlockHash> FullBlockHashes(BlockHash seed, absl::Span<const int32_t> tokens, int64_t block_size) {
  DUET_CHECK(block_size > 0);
  std::vector<BlockHash> hashes;
  hashes.reserve(tokens.size() / size_t(block_size));
  BlockHash parent = seed;
  for (size_t start = 0; start + size_t(block_size) <= tokens.size(); start += size_t(block_size)) {
    parent = HashBlock(parent, tokens.subspan(start, size_t(block_size)));
    hashes.push_back(parent);
  }
  return hashes;
}

}  // namespace duet
