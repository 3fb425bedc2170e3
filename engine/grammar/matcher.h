// Matching bytes and tokens against a Grammar, and the per-step token mask.
//
// The matcher is a pushdown automaton run non-deterministically: its state is a set of stacks
// of grammar positions. The top of a stack is always a byte class to match next (expansion runs
// eagerly: a rule reference pushes its continuation and opens the rule's alternatives; a
// reference that ends its alternative is a tail call and pushes nothing, so repetitions do not
// grow the stack); an empty stack means the root rule is complete.
//
// Token masks (xgrammar's adaptive token mask cache): for every byte-class position P, the
// vocabulary is split once, by matching each token from P alone with nothing below it, into
// tokens accepted whatever the context (some path consumes the token inside P's rule), tokens
// rejected whatever the context, and uncertain ones (a path reaches the end of P's rule with
// bytes left, which the rules below must match). A step's mask is the union of the accepted
// sets of the state's stack tops plus the uncertain tokens that their stacks accept (a token
// counts as uncertain only when the byte after the rule's end may follow the rule somewhere in
// the grammar, its FOLLOW set, which rejects most of them up front). Those are decided frame by
// frame: the top two frames of a stack accept some of them, reject others and leave the rest to
// the frames below, and so on down the stack; each suffix of frames has its verdict kept, so a
// state seen for the first time (a new nesting of the same rules) mostly reuses its suffixes'.
// A verdict walks the tokens in byte order, sharing the work for common prefixes. The
// vocabulary walk that classifies a position also shares prefixes and skips every token behind
// a dead prefix. Positions are classified on first use and kept for the grammar's life; the
// masks of the most recent whole states are kept too (inside a JSON string every character
// leaves the matcher in the same state).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"
#include "engine/grammar/grammar.h"

namespace duet::grammar {

// The tokenizer's vocabulary as byte strings.
class TokenVocabulary {
 public:
  // `token_strings[id]`: the vocabulary entry as tokenizer.json spells it; nullopt for tokens
  // that are not text (special and control tokens: never allowed by a grammar). Spellings are
  // decoded as xgrammar detects them: a vocabulary with "Ċ" is byte-level (GPT-2's byte
  // alphabet), one with "<0x0A>" uses byte fallback ("<0xNN>" is that byte, "▁" a space),
  // anything else is raw UTF-8. `eos_ids` end generation; allowed only where the grammar may end.
  static std::shared_ptr<const TokenVocabulary> FromTokenStrings(
      const std::vector<std::optional<std::string>>& token_strings, std::vector<int32_t> eos_ids);

  int32_t size() const { return int32_t(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  bool is_text(int32_t id) const { return is_text_[size_t(id)]; }
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  // Text tokens in byte order.
  const std::vector<int32_t>& sorted() const { return sorted_; }
  size_t max_token_bytes() const { return max_token_bytes_; }
  int32_t mask_words() const { return (size() + 31) / 32; }

 private:
  std::vector<std::string> bytes_;
  std::vector<bool> is_text_;
  std::vector<int32_t> eos_ids_;
  std::vector<int32_t> sorted_;
  size_t max_token_bytes_ = 0;
};

using Stack = absl::InlinedVector<int32_t, 8>;
using StackSet = std::vector<Stack>;

// A grammar bound to a vocabulary, with its token-mask cache. Shared by every request with the
// same constraint; thread-safe.
class CompiledGrammar {
 public:
  CompiledGrammar(std::shared_ptr<const Grammar> grammar, std::shared_ptr<const TokenVocabulary> vocab);

  struct PositionMasks {
    std::vector<uint32_t> accepted;  // a bit per token id
    std::vector<int32_t> uncertain;  // token ids, in byte order
  };
  const PositionMasks& MasksAt(int32_t pos) const;
  // Classifies every position now (a benchmark separates this from per-token work).
  void PrecomputeAllPositions() const;

  const Grammar& grammar() const { return *grammar_; }
  const TokenVocabulary& vocab() const { return *vocab_; }
  const StackSet& initial_stacks() const { return initial_; }

  // Of the tokens `parent_uncertain` (the uncertain tokens of the suffix one frame shorter),
  // which the stack suffix `frames` (bottom first; two or more) accepts, and which it leaves to
  // the frames below it (they end it with bytes left).
  struct SuffixMasks {
    std::vector<int32_t> accepted;   // in byte order
    std::vector<int32_t> uncertain;  // in byte order
  };
  std::shared_ptr<const SuffixMasks> MasksOfSuffix(absl::Span<const int32_t> frames,
                                                   absl::Span<const int32_t> parent_uncertain) const;

  // The most recent states' masks (a state is its stacks, serialized), shared by the requests.
  bool LookUpStateMask(const std::string& state, absl::Span<uint32_t> mask) const;
  void RememberStateMask(std::string state, absl::Span<const uint32_t> mask) const;

 private:
  static constexpr size_t kStateMaskBytes = size_t(16) << 20;  // the kept states' masks, in all
  static constexpr size_t kMaxSuffixes = size_t(1) << 16;       // kept suffix verdicts; then start over
  std::shared_ptr<const Grammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  StackSet initial_;
  // Per position, the bytes that may follow the end of its rule in any context (FOLLOW): a
  // token whose rest starts with another byte is rejected, not uncertain.
  std::vector<ByteClass> follow_of_position_;
  mutable std::mutex mu_;
  mutable std::vector<std::unique_ptr<PositionMasks>> masks_;
  mutable std::list<std::pair<std::string, std::vector<uint32_t>>> state_masks_;  // most recent first
  mutable std::unordered_map<std::string, decltype(state_masks_)::iterator> state_index_;
  mutable std::unordered_map<std::string, std::shared_ptr<const SuffixMasks>> suffix_masks_;
};

// One request's position in its grammar.
class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);

  // Advances over the token's bytes; false (state unchanged) when the grammar does not allow
  // it. An EOS token is accepted where the grammar may end and leaves the state as it is.
  bool AcceptToken(int32_t id);
  bool AcceptBytes(std::string_view bytes);
  // Sets `mask` (mask_words() words) to the tokens allowed next: a bit per token id.
  void FillNextTokenMask(absl::Span<uint32_t> mask) const;
  bool CanEnd() const;        // the grammar is complete here (EOS allowed)
  bool IsTerminated() const;  // complete, and nothing more may follow
  const CompiledGrammar& compiled() const { return *grammar_; }

 private:
  void ComputeNextTokenMask(absl::Span<uint32_t> mask) const;

  std::shared_ptr<const CompiledGrammar> grammar_;
  StackSet stacks_;
};

// Exposed for tests: the state after `bytes` from `start`, empty if rejected.
StackSet AdvanceBytes(const Grammar& g, const StackSet& start, std::string_view bytes);

}  // namespace duet::grammar
