#include "engine/grammar/matcher.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "engine/grammar/utf8.h"

namespace duet::grammar {

// --- vocabulary --------------------------------------------------------------------------------

namespace {

enum class Spelling { kRaw, kByteLevel, kByteFallback };

// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for U+0100 up.
std::map<uint32_t, uint8_t> ByteLevelDecodeTable() {
  std::map<uint32_t, uint8_t> table;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    table[printable ? uint32_t(b) : next++] = uint8_t(b);
  }
  return table;
}

std::optional<std::string> DecodeSpelling(const std::string& token, Spelling spelling,
                                          const std::map<uint32_t, uint8_t>& byte_level) {
  switch (spelling) {
    case Spelling::kRaw:
      return token;
    case Spelling::kByteLevel: {
      std::string out;
      for (size_t pos = 0; pos < token.size();) {
        absl::StatusOr<uint32_t> cp = DecodeUtf8At(token, pos);
        if (!cp.ok()) return token;
        auto it = byte_level.find(*cp);
        if (it == byte_level.end()) return token;  // not byte-level spelled (e.g. an added token)
        out.push_back(char(it->second));
      }
      return out;
    }
    case Spelling::kByteFallback: {
      if (token.size() == 6 && token.starts_with("<0x") && token.ends_with(">")) {
        return std::string(1, char(std::stoi(token.substr(3, 2), nullptr, 16)));
      }
      std::string out;
      static const std::string kSpace = "\xE2\x96\x81";  // ▁
      for (size_t i = 0; i < token.size();) {
        if (token.compare(i, kSpace.size(), kSpace) == 0) {
          out.push_back(' ');
          i += kSpace.size();
        } else {
          out.push_back(token[i++]);
        }
      }
      return out;
    }
  }
  return token;
}

}  // namespace

std::shared_ptr<const TokenVocabulary> TokenVocabulary::FromTokenStrings(
    const std::vector<std::optional<std::string>>& token_strings, std::vector<int32_t> eos_ids) {
  auto v = std::make_shared<TokenVocabulary>();
  Spelling spelling = Spelling::kRaw;
  for (const auto& t : token_strings) {
    if (t && *t == "\xC4\x8A") spelling = Spelling::kByteLevel;  // Ċ, the byte-level newline
  }
  if (spelling == Spelling::kRaw) {
    for (const auto& t : token_strings) {
      if (t && *t == "<0x0A>") spelling = Spelling::kByteFallback;
    }
  }
  const std::map<uint32_t, uint8_t> byte_level = ByteLevelDecodeTable();
  const size_t n = token_strings.size();
  v->bytes_.resize(n);
  v->is_text_.assign(n, false);
  for (size_t id = 0; id < n; ++id) {
    if (!token_strings[id]) continue;
    std::optional<std::string> bytes = DecodeSpelling(*token_strings[id], spelling, byte_level);
    if (!bytes || bytes->empty()) continue;
    v->bytes_[id] = std::move(*bytes);
    v->is_text_[id] = true;
    v->sorted_.push_back(int32_t(id));
    v->max_token_bytes_ = std::max(v->max_token_bytes_, v->bytes_[id].size());
  }
  std::sort(v->sorted_.begin(), v->sorted_.end(),
            [&](int32_t a, int32_t b) { return v->bytes_[size_t(a)] < v->bytes_[size_t(b)] || (v->bytes_[size_t(a)] == v->bytes_[size_t(b)] && a < b); });
  std::erase_if(eos_ids, [n](int32_t id) { return id < 0 || size_t(id) >= n; });
  v->eos_ids_ = std::move(eos_ids);
  return v;
}

// --- stacks ------------------------------------------------------------------------------------

namespace {

// Expands position `pos` of the frame on top of `below` until every resulting stack has a byte
// class on top (or is empty: the outermost frame ended), appending them to `out`.
void Close(const Grammar& g, Stack below, int32_t pos, StackSet& out) {
  while (true) {
    const Element& e = g.at(pos);
    if (e.kind == Element::kBytes) {
      below.push_back(pos);
      out.push_back(std::move(below));
      return;
    }
    if (e.kind == Element::kEnd) {
      if (below.empty()) {
        out.push_back(std::move(below));
        return;
      }
      pos = below.back();
      below.pop_back();
      continue;
    }
    if (g.at(pos + 1).kind != Element::kEnd) below.push_back(pos + 1);  // else: a tail call
    const std::vector<int32_t>& alts = g.alternatives(e.id);
    if (alts.empty()) return;
    for (size_t i = 0; i + 1 < alts.size(); ++i) Close(g, below, alts[i], out);
    pos = alts.back();
  }
}

void Dedupe(StackSet& set) {
  if (set.size() < 2) return;
  std::sort(set.begin(), set.end());
  set.erase(std::unique(set.begin(), set.end()), set.end());
}

void Advance(const Grammar& g, const StackSet& from, uint8_t byte, StackSet& to) {
  to.clear();
  for (const Stack& s : from) {
    if (s.empty() || !g.byte_class(s.back()).Contains(byte)) continue;
    Stack below(s.begin(), s.end() - 1);
    Close(g, std::move(below), s.back() + 1, to);
  }
  Dedupe(to);
}

bool HasEmpty(const StackSet& set) {
  return std::any_of(set.begin(), set.end(), [](const Stack& s) { return s.empty(); });
}

size_t CommonPrefix(const std::string& a, const std::string& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// Walks `tokens` (ids in byte order) from `start`, sharing the states of common prefixes.
// Calls on_token(id, accepted, ended_early) for each: accepted when some path consumes all its
// bytes; ended_early when a path reached an empty stack with bytes of the token left (for a
// start that is one frame alone: the rules below it would have to match the rest).
// `follow`, when given, limits ended_early to paths whose next byte it contains.
template <typename OnToken>
void WalkTokens(const Grammar& g, const TokenVocabulary& vocab, const StackSet& start,
                absl::Span<const int32_t> tokens, const ByteClass* follow, OnToken on_token) {
  std::vector<StackSet> states(vocab.max_token_bytes() + 1);
  std::vector<char> ended(vocab.max_token_bytes() + 1, 0);
  states[0] = start;
  size_t valid = 0;  // states[0..valid] hold the previous token's prefixes
  const std::string* prev = nullptr;
  for (size_t i = 0; i < tokens.size();) {
    const std::string& tok = vocab.bytes(tokens[i]);
    size_t depth = prev ? std::min(valid, CommonPrefix(*prev, tok)) : 0;
    bool dead = false;
    while (depth < tok.size()) {
      ended[depth + 1] = ended[depth] ||
                         (HasEmpty(states[depth]) && (follow == nullptr || follow->Contains(uint8_t(tok[depth]))));
      Advance(g, states[depth], uint8_t(tok[depth]), states[depth + 1]);
      ++depth;
      if (states[depth].empty()) {
        dead = true;
        break;
      }
    }
    prev = &tok;
    if (!dead) {
      valid = depth;
      on_token(tokens[i], true, false);
      ++i;
      continue;
    }
    // Every following token with this dead prefix fares the same.
    valid = depth - 1;
    const bool ended_early = ended[depth];
    do {
      on_token(tokens[i], false, ended_early);
      ++i;
    } while (i < tokens.size() && vocab.bytes(tokens[i]).size() >= depth &&
             vocab.bytes(tokens[i]).compare(0, depth, tok, 0, depth) == 0);
  }
}

void Union(ByteClass& into, const ByteClass& from, bool& changed) {
  for (size_t w = 0; w < 4; ++w) {
    const uint64_t merged = into.bits[w] | from.bits[w];
    changed |= merged != into.bits[w];
    into.bits[w] = merged;
  }
}

// FOLLOW of every rule: the bytes that may come right after it (FIRST, nullable, FOLLOW as in
// LL parsing, over bytes), found by iterating to a fixed point.
std::vector<ByteClass> FollowSets(const Grammar& g) {
  const size_t n = size_t(g.num_rules());
  std::vector<ByteClass> first(n), follow(n);
  std::vector<bool> nullable(n, false);
  // FIRST of the sequence from `pos` to its alternative's end, and whether all of it is nullable.
  auto first_of = [&](int32_t pos, ByteClass& out) {
    bool dummy = false;
    for (; g.at(pos).kind != Element::kEnd; ++pos) {
      const Element& e = g.at(pos);
      if (e.kind == Element::kBytes) {
        Union(out, g.byte_class(pos), dummy);
        return false;
      }
      Union(out, first[size_t(e.id)], dummy);
      if (!nullable[size_t(e.id)]) return false;
    }
    return true;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      for (int32_t start : g.alternatives(int32_t(r))) {
        ByteClass f;
        const bool all_nullable = first_of(start, f);
        Union(first[r], f, changed);
        if (all_nullable && !nullable[r]) nullable[r] = changed = true;
      }
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      for (int32_t start : g.alternatives(int32_t(r))) {
        for (int32_t p = start; g.at(p).kind != Element::kEnd; ++p) {
          if (g.at(p).kind != Element::kRule) continue;
          ByteClass rest;
          const bool rest_nullable = first_of(p + 1, rest);
          ByteClass& target = follow[size_t(g.at(p).id)];
          Union(target, rest, changed);
          if (rest_nullable) Union(target, follow[r], changed);
        }
      }
    }
  }
  return follow;
}

}  // namespace

StackSet AdvanceBytes(const Grammar& g, const StackSet& start, std::string_view bytes) {
  StackSet cur = start, next;
  for (char c : bytes) {
    Advance(g, cur, uint8_t(c), next);
    std::swap(cur, next);
    if (cur.empty()) break;
  }
  return cur;
}

// --- compiled grammar --------------------------------------------------------------------------

CompiledGrammar::CompiledGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocab)
    : grammar_(std::move(grammar)), vocab_(std::move(vocab)), masks_(grammar_->elements().size()) {
  for (int32_t alt : grammar_->alternatives(grammar_->root())) Close(*grammar_, Stack(), alt, initial_);
  Dedupe(initial_);
  const std::vector<ByteClass> follow = FollowSets(*grammar_);
  follow_of_position_.resize(grammar_->elements().size());
  for (int32_t r = 0; r < grammar_->num_rules(); ++r) {
    for (int32_t start : grammar_->alternatives(r)) {
      for (int32_t p = start; grammar_->at(p).kind != Element::kEnd; ++p) follow_of_position_[size_t(p)] = follow[size_t(r)];
    }
  }
}

const CompiledGrammar::PositionMasks& CompiledGrammar::MasksAt(int32_t pos) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<PositionMasks>& slot = masks_[size_t(pos)];
  if (slot) return *slot;
  slot = std::make_unique<PositionMasks>();
  slot->accepted.assign(size_t(vocab_->mask_words()), 0);
  const StackSet start = {Stack{pos}};
  WalkTokens(*grammar_, *vocab_, start, vocab_->sorted(), &follow_of_position_[size_t(pos)],
             [&](int32_t id, bool accepted, bool ended_early) {
    if (accepted) {
      slot->accepted[size_t(id) / 32] |= uint32_t(1) << (id % 32);
    } else if (ended_early) {
      slot->uncertain.push_back(id);
    }
  });
  return *slot;
}

bool CompiledGrammar::LookUpStateMask(const std::string& state, absl::Span<uint32_t> mask) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = state_index_.find(state);
  if (it == state_index_.end()) return false;
  state_masks_.splice(state_masks_.begin(), state_masks_, it->second);
  std::copy(it->second->second.begin(), it->second->second.end(), mask.begin());
  return true;
}

void CompiledGrammar::RememberStateMask(std::string state, absl::Span<const uint32_t> mask) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_index_.count(state)) return;
  state_masks_.emplace_front(state, std::vector<uint32_t>(mask.begin(), mask.end()));
  state_index_.emplace(std::move(state), state_masks_.begin());
  if (state_masks_.size() * mask.size() * sizeof(uint32_t) > kStateMaskBytes) {
    state_index_.erase(state_masks_.back().first);
    state_masks_.pop_back();
  }
}

std::shared_ptr<const CompiledGrammar::SuffixMasks> CompiledGrammar::MasksOfSuffix(
    absl::Span<const int32_t> frames, absl::Span<const int32_t> parent_uncertain) const {
  std::string key(reinterpret_cast<const char*>(frames.data()), frames.size() * sizeof(int32_t));
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = suffix_masks_.find(key);
    if (it != suffix_masks_.end()) return it->second;
  }
  // Computed outside the lock (two threads may both compute one; the first kept wins).
  auto masks = std::make_shared<SuffixMasks>();
  const StackSet start = {Stack(frames.begin(), frames.end())};
  WalkTokens(*grammar_, *vocab_, start, parent_uncertain, nullptr, [&](int32_t id, bool accepted, bool ended_early) {
    if (accepted) {
      masks->accepted.push_back(id);
    } else if (ended_early) {
      masks->uncertain.push_back(id);
    }
  });
  std::lock_guard<std::mutex> lock(mu_);
  if (suffix_masks_.size() >= kMaxSuffixes) suffix_masks_.clear();
  return suffix_masks_.emplace(std::move(key), std::move(masks)).first->second;
}

void CompiledGrammar::PrecomputeAllPositions() const {
  for (int32_t pos = 0; pos < int32_t(grammar_->elements().size()); ++pos) {
    if (grammar_->at(pos).kind == Element::kBytes) MasksAt(pos);
  }
}

// --- matcher -----------------------------------------------------------------------------------

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : grammar_(std::move(grammar)), stacks_(grammar_->initial_stacks()) {}

bool GrammarMatcher::AcceptBytes(std::string_view bytes) {
  StackSet next = AdvanceBytes(grammar_->grammar(), stacks_, bytes);
  if (next.empty()) return false;
  stacks_ = std::move(next);
  return true;
}

bool GrammarMatcher::AcceptToken(int32_t id) {
  const TokenVocabulary& vocab = grammar_->vocab();
  if (id < 0 || id >= vocab.size()) return false;
  const auto& eos = vocab.eos_ids();
  if (std::find(eos.begin(), eos.end(), id) != eos.end()) return CanEnd();
  if (!vocab.is_text(id)) return false;
  return AcceptBytes(vocab.bytes(id));
}

bool GrammarMatcher::CanEnd() const { return HasEmpty(stacks_); }

bool GrammarMatcher::IsTerminated() const {
  return std::all_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

void GrammarMatcher::FillNextTokenMask(absl::Span<uint32_t> mask) const {
  // A state seen before (every character of a JSON string leaves the same one) has its mask kept.
  std::string key;
  for (const Stack& s : stacks_) {
    key.append(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(int32_t));
    key.append(4, '\xFF');  // no position is -1
  }
  if (grammar_->LookUpStateMask(key, mask)) return;
  ComputeNextTokenMask(mask);
  grammar_->RememberStateMask(std::move(key), mask);
}

void GrammarMatcher::ComputeNextTokenMask(absl::Span<uint32_t> mask) const {
  const TokenVocabulary& vocab = grammar_->vocab();
  std::fill(mask.begin(), mask.end(), 0u);
  auto allow = [&](int32_t id) { mask[size_t(id) / 32] |= uint32_t(1) << (id % 32); };
  // A state accepts a token when one of its stacks does. A stack: its top's accepted tokens, then
  // its top's uncertain ones decided by longer and longer suffixes (two frames, three, ...); what
  // is still uncertain at the whole stack would need bytes past the grammar's end: rejected.
  for (const Stack& s : stacks_) {
    if (s.empty()) continue;
    const CompiledGrammar::PositionMasks& top = grammar_->MasksAt(s.back());
    for (size_t w = 0; w < mask.size(); ++w) mask[w] |= top.accepted[w];
    absl::Span<const int32_t> uncertain = top.uncertain;
    std::shared_ptr<const CompiledGrammar::SuffixMasks> level;  // owns `uncertain` below the top
    for (size_t k = 2; k <= s.size() && !uncertain.empty(); ++k) {
      level = grammar_->MasksOfSuffix(absl::MakeConstSpan(s.data() + s.size() - k, k), uncertain);
      for (int32_t id : level->accepted) allow(id);
      uncertain = level->uncertain;
    }
  }
  if (CanEnd()) {
    for (int32_t id : vocab.eos_ids()) allow(id);
  }
}

}  // namespace duet::grammar
