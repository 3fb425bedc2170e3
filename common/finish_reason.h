// Why a request stopped generating. The engine sets it, the metrics count it (vLLM's
// finished_reason label) and it crosses the RPC boundary as its name (duet.v1's finish_reason
// string), so it lives below all three.
#pragma once

#include <optional>

#include "absl/strings/string_view.h"

namespace duet {

enum class FinishReason {
  kNone,    // still running
  kStop,    // EOS, a stop token id or a stop string
  kLength,  // max_tokens or the model's context
  kAbort,   // cancelled
  kError,   // failed (the error travels beside it)
};

// "none", "stop", "length", "abort", "error": the wire's and the metrics' spelling.
inline const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "none";
}

// The reason FinishReasonName spells `name`; nullopt for any other string.
inline std::optional<FinishReason> ParseFinishReason(absl::string_view name) {
  for (FinishReason reason : {FinishReason::kNone, FinishReason::kStop, FinishReason::kLength,
                              FinishReason::kAbort, FinishReason::kError}) {
    if (name == FinishReasonName(reason)) return reason;
  }
  return std::nullopt;
}

}  // namespace duet
