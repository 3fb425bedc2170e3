#include "router/worker_replies.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace duet::router {

std::optional<FinishReason> StreamFinishReason(const std::string& name) {
  const std::optional<FinishReason> reason = ParseFinishReason(name);
  if (reason == FinishReason::kStop || reason == FinishReason::kLength || reason == FinishReason::kAbort) {
    return reason;
  }
  return std::nullopt;
}

namespace {

// Why `lp`'s alternatives cannot be relayed (`what` names whose they are); empty when they can.
std::string OutOfVocabularyTop(const v1::TokenLogprobs& lp, int64_t vocab_size, const char* what) {
  for (const v1::TopLogprob& top : lp.top()) {
    if (top.token_id() < 0 || top.token_id() >= vocab_size) {
      return absl::StrFormat("%s token id %d, out of vocabulary (vocab size %d)", what, top.token_id(), vocab_size);
    }
  }
  return "";
}

std::string InvalidPromptLogprobs(const v1::PrefillResponse& reply, int64_t prompt_len, int32_t k, int64_t vocab_size) {
  if (k < 0) return reply.prompt_logprobs().empty() ? "" : "prompt logprobs that were not asked for";
  if (reply.prompt_logprobs_size() != prompt_len - 1) {
    return absl::StrFormat("%d prompt logprobs for a prompt of %d tokens", reply.prompt_logprobs_size(), prompt_len);
  }
  for (const v1::TokenLogprobs& lp : reply.prompt_logprobs()) {
    if (lp.top_size() != k || lp.rank() < 1 || lp.rank() > vocab_size) {
      return absl::StrFormat("a prompt logprob with rank %d and %d top entries (asked for %d)", lp.rank(),
                             lp.top_size(), k);
    }
    if (std::string why = OutOfVocabularyTop(lp, vocab_size, "prompt logprob"); !why.empty()) return why;
  }
  return "";
}

}  // namespace

std::string InvalidPrefillReply(const v1::PrefillResponse& reply, int64_t prompt_len, int32_t prompt_logprobs,
                                int64_t vocab_size) {
  if (reply.first_token_id() < 0 || reply.first_token_id() >= vocab_size) {
    return absl::StrFormat("first token id %d, out of vocabulary (vocab size %d)", reply.first_token_id(), vocab_size);
  }
  if (std::string why = OutOfVocabularyTop(reply.first_token_logprobs(), vocab_size, "first token's top logprob");
      !why.empty()) {
    return why;
  }
  return InvalidPromptLogprobs(reply, prompt_len, prompt_logprobs, vocab_size);
}

std::string InvalidDecodeMessage(const v1::GenerateResponse& message, int64_t vocab_size, bool finished_before) {
  if (finished_before) return "a message after the request had finished";
  for (int32_t id : message.token_ids()) {
    if (id < 0 || id >= vocab_size) {
      return absl::StrFormat("token id %d, out of vocabulary (vocab size %d)", id, vocab_size);
    }
  }
  if (message.logprobs_size() != 0 && message.logprobs_size() != message.token_ids_size()) {
    return absl::StrFormat("%d logprobs for %d token ids", message.logprobs_size(), message.token_ids_size());
  }
  for (const v1::TokenLogprobs& lp : message.logprobs()) {
    if (std::string why = OutOfVocabularyTop(lp, vocab_size, "top logprob"); !why.empty()) return why;
  }
  // The prompt's logprobs come from the prefill worker; the router adds them.
  if (message.prompt_logprobs_size() != 0) return "prompt logprobs (the prefill worker's to send)";
  if (message.finished() && !StreamFinishReason(message.finish_reason())) {
    return absl::StrCat("finish reason \"", message.finish_reason(), "\" (not stop, length or abort)");
  }
  return "";
}

}  // namespace duet::router
