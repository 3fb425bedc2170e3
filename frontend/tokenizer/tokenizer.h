// Hugging Face `tokenizer.json` tokenizers: BPE with byte-level pre-tokenization and a regex
// Split (Llama-3, Qwen2/3, GPT-2 style), and SentencePiece-style BPE (Metaspace, byte fallback:
// Llama-2, Mistral). Added and special tokens are matched in the raw text first, as HF does.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace duet {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Loads `tokenizer.json`. Unsupported model/normalizer/pre-tokenizer/decoder types and
  // malformed files are clear errors.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& tokenizer_json_path);
  // Loads `<dir>/tokenizer.json`, and bos/eos tokens from `<dir>/tokenizer_config.json` if present.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromModelDir(const std::string& model_dir);

  // Same ids as HF `tokenizer.encode(text, add_special_tokens=...)`. With add_special_tokens the
  // post-processor's template (e.g. Llama-3's BOS) is applied.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_special_tokens = false) const = 0;
  // Same text as HF `tokenizer.decode(ids, skip_special_tokens=...)`. Invalid UTF-8 from partial
  // byte sequences becomes U+FFFD, as HF does.
  virtual std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens = true) const = 0;

  virtual int32_t vocab_size() const = 0;  // including added tokens
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  virtual std::optional<int32_t> bos_token_id() const = 0;
  virtual std::optional<int32_t> eos_token_id() const = 0;
};

// Incremental detokenizer for streaming: Push() returns only text that is final, holding back an
// incomplete UTF-8 sequence (and anything a later token could still change) until it completes.
// The concatenation of all Push() results plus Flush() equals Decode(all ids).
class StreamingDecoder {
 public:
  StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = true);
  // `prompt_ids` give context (e.g. SentencePiece's leading-space rule) without being emitted.
  StreamingDecoder(const Tokenizer& tokenizer, absl::Span<const int32_t> prompt_ids,
                   bool skip_special_tokens = true);
  std::string Push(int32_t id);
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // ids_[prefix_offset_, read_offset_) is context already emitted
  size_t read_offset_ = 0;
};

}  // namespace duet
