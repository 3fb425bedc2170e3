#include "frontend/tokenizer/tokenizer_bpe.h"

#include <algorithm>
#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "frontend/tokenizer/tokenizer_unicode.h"
#include "nlohmann/json.hpp"

namespace duet {
namespace {

// A merge candidate: the pair starting at symbol `pos` becomes `merged_id`.
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t merged_id;
  // Lower rank first, then leftmost (std::priority_queue pops the "largest").
  bool operator<(const Candidate& other) const {
    return rank != other.rank ? rank > other.rank : pos > other.pos;
  }
};

// A merge is "a b" (older files) or ["a", "b"] (newer files). Tokens may contain spaces only in
// the array form.
absl::StatusOr<std::pair<std::string, std::string>> ParseMerge(const nlohmann::json& merge) {
  if (merge.is_array()) {
    if (merge.size() != 2) return absl::InvalidArgumentError("BPE merge must have two parts");
    return std::make_pair(merge[0].get<std::string>(), merge[1].get<std::string>());
  }
  const std::string text = merge.get<std::string>();
  const size_t space = text.find(' ');
  if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("malformed BPE merge '", text, "'"));
  }
  return std::make_pair(text.substr(0, space), text.substr(space + 1));
}

// `character` (one DecodeUtf8 step) is the well-formed UTF-8 of a code point below U+0800: one
// ASCII byte, or a lead byte C2..DF and a continuation byte.
bool IsCanonicalBelowU0800(std::string_view character) {
  const auto lead = static_cast<unsigned char>(character[0]);
  if (character.size() == 1) return lead < 0x80;
  return character.size() == 2 && lead >= 0xC2 && lead <= 0xDF &&
         (static_cast<unsigned char>(character[1]) & 0xC0) == 0x80;
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const nlohmann::json& config) {
  auto model = std::make_unique<BpeModel>();
  for (const char* unsupported : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (config.contains(unsupported) && !config[unsupported].is_null() &&
        !config[unsupported].get<std::string>().empty()) {
      return absl::UnimplementedError(absl::StrCat("BPE ", unsupported, " is not supported"));
    }
  }
  if (config.contains("dropout") && !config["dropout"].is_null() &&
      config["dropout"].get<double>() != 0.0) {
    // Dropout only applies in training; inference ignores it, as HF does when it is set to 0.
    return absl::UnimplementedError("BPE dropout is not supported");
  }

  const auto& vocab = config.at("vocab");
  if (!vocab.is_object()) return absl::InvalidArgumentError("BPE vocab must be an object");
  int64_t max_id = -1;
  for (const auto& [token, id_json] : vocab.items()) {
    const int64_t id = id_json.get<int64_t>();
    if (id < 0 || id > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat("bad vocab id ", id));
    model->token_to_id_.emplace(token, static_cast<int32_t>(id));
    max_id = std::max(max_id, id);
  }
  model->id_to_token_.resize(max_id + 1);
  for (const auto& [token, id] : model->token_to_id_) model->id_to_token_[id] = token;

  const auto& merges = config.at("merges");
  model->merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    auto merge = ParseMerge(merges[rank]);
    if (!merge.ok()) return merge.status();
    const auto left = model->TokenToId(merge->first);
    const auto right = model->TokenToId(merge->second);
    const auto merged = model->TokenToId(merge->first + merge->second);
    if (!left || !right || !merged) {
      return absl::InvalidArgumentError(absl::StrCat("BPE merge '", merge->first, " ",
                                                     merge->second, "' uses tokens not in the vocab"));
    }
    // A repeated pair keeps its last rank, as HF's HashMap collect does.
    model->merges_[PairKey(*left, *right)] = {static_cast<int32_t>(rank), *merged};
  }

  if (config.contains("unk_token") && !config["unk_token"].is_null()) {
    model->unk_id_ = model->TokenToId(config["unk_token"].get<std::string>());
  }
  model->fuse_unk_ = config.value("fuse_unk", false);
  model->byte_fallback_ = config.value("byte_fallback", false);
  model->ignore_merges_ = config.value("ignore_merges", false);
  for (int byte = 0; byte < 256; ++byte) {
    model->byte_token_ids_[byte] =
        model->TokenToId(absl::StrFormat("<0x%02X>", byte)).value_or(-1);
  }
  model->char_token_ids_.assign(kCharTableSize, -1);
  std::string character;
  for (char32_t code_point = 0; code_point < kCharTableSize; ++code_point) {
    character.clear();
    unicode::AppendUtf8(code_point, character);
    model->char_token_ids_[code_point] = model->TokenToId(character).value_or(-1);
  }
  return model;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = token_to_id_.find(AsKey(token));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size())) return nullptr;
  const std::string& token = id_to_token_[id];
  // An empty slot is a gap in the id space, unless "" really is a token with this id.
  if (token.empty()) {
    auto it = token_to_id_.find(absl::string_view());
    if (it == token_to_id_.end() || it->second != id) return nullptr;
  }
  return &token;
}

std::vector<int32_t> BpeModel::InitialSymbols(std::string_view word) const {
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  bool pending_unk = false;
  for (size_t pos = 0; pos < word.size();) {
    const size_t start = pos;
    const char32_t code_point = unicode::DecodeUtf8(word, pos);
    const std::string_view character = word.substr(start, pos - start);
    std::optional<int32_t> id;
    if (IsCanonicalBelowU0800(character)) {
      if (char_token_ids_[code_point] >= 0) id = char_token_ids_[code_point];
    } else {
      id = TokenToId(character);
    }
    if (id) {
      if (pending_unk) symbols.push_back(*unk_id_);
      pending_unk = false;
      symbols.push_back(*id);
      continue;
    }
    if (byte_fallback_ &&
        std::all_of(character.begin(), character.end(),
                    [&](char c) { return byte_token_ids_[static_cast<unsigned char>(c)] >= 0; })) {
      // Like HF, byte tokens do not flush a pending unknown token.
      for (char c : character) symbols.push_back(byte_token_ids_[static_cast<unsigned char>(c)]);
      continue;
    }
    if (!unk_id_) continue;  // no unknown token: the character is dropped, as HF does
    if (pending_unk && !fuse_unk_) symbols.push_back(*unk_id_);
    pending_unk = true;
  }
  if (pending_unk) symbols.push_back(*unk_id_);
  return symbols;
}

void BpeModel::MergeSymbolsByScan(std::vector<int32_t>& ids) const {
  // pairs[i]: the merge of ids[i] and ids[i + 1], null when there is none.
  const Merge* pairs[kMaxScannedSymbols];
  auto rank = [&](size_t i) { return pairs[i] != nullptr ? pairs[i]->rank : INT32_MAX; };
  for (size_t i = 0; i + 1 < ids.size(); ++i) pairs[i] = FindMerge(ids[i], ids[i + 1]);
  while (ids.size() >= 2) {
    size_t best = 0;  // the lowest rank, leftmost among equals: the order the queue pops in
    for (size_t i = 1; i + 1 < ids.size(); ++i) {
      if (rank(i) < rank(best)) best = i;
    }
    if (pairs[best] == nullptr) return;
    ids[best] = pairs[best]->merged_id;
    ids.erase(ids.begin() + best + 1);
    for (size_t i = best + 1; i + 1 < ids.size(); ++i) pairs[i] = pairs[i + 1];  // the pairs right of it move down one
    if (best > 0) pairs[best - 1] = FindMerge(ids[best - 1], ids[best]);
    if (best + 1 < ids.size()) pairs[best] = FindMerge(ids[best], ids[best + 1]);
  }
}

void BpeModel::MergeSymbols(std::vector<int32_t>& ids) const {
  const int32_t count = static_cast<int32_t>(ids.size());
  if (count < 2) return;
  if (ids.size() <= kMaxScannedSymbols) return MergeSymbolsByScan(ids);
  std::vector<int32_t> prev(count), next(count);
  std::vector<bool> removed(count, false);
  std::priority_queue<Candidate> queue;
  for (int32_t i = 0; i < count; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < count ? i + 1 : -1;
  }
  auto push_pair = [&](int32_t left_pos, int32_t right_pos) {
    if (const Merge* merge = FindMerge(ids[left_pos], ids[right_pos])) queue.push({merge->rank, left_pos, merge->merged_id});
  };
  for (int32_t i = 0; i + 1 < count; ++i) push_pair(i, i + 1);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    if (removed[top.pos] || next[top.pos] == -1) continue;
    const int32_t right = next[top.pos];
    // Stale entry: the pair at this position changed since it was queued.
    const Merge* merge = FindMerge(ids[top.pos], ids[right]);
    if (merge == nullptr || merge->merged_id != top.merged_id) continue;

    ids[top.pos] = top.merged_id;
    removed[right] = true;
    next[top.pos] = next[right];
    if (next[right] != -1) prev[next[right]] = top.pos;
    if (prev[top.pos] != -1) push_pair(prev[top.pos], top.pos);
    if (next[top.pos] != -1) push_pair(top.pos, next[top.pos]);
  }
  int32_t kept = 0;
  for (int32_t i = 0; i < count; ++i) {
    if (!removed[i]) ids[kept++] = ids[i];
  }
  ids.resize(kept);
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = TokenToId(word)) {
      ids.push_back(*id);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(AsKey(word));
    if (it != cache_.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> symbols = InitialSymbols(word);
  MergeSymbols(symbols);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(word, std::move(symbols));
  }
}

}  // namespace duet
