// The router's checks of what workers answer. A reply that fails one is not relayed to the
// client (the call ends INTERNAL, naming the worker), whatever bytes a faulty or hostile worker
// sends; the fuzz target (tests/fuzz, target 11) feeds them arbitrary replies.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/finish_reason.h"
#include "duet/v1/duet.pb.h"
#include "duet/v1/worker.pb.h"

namespace duet::router {

// A worker's stream finishes with stop, length or abort (a failure ends it with an error status).
std::optional<FinishReason> StreamFinishReason(const std::string& name);

// Why a prefill worker's reply for a prompt of `prompt_len` tokens that asked for the top
// `prompt_logprobs` (-1: none asked) cannot be used; empty when it can.
std::string InvalidPrefillReply(const v1::PrefillResponse& reply, int64_t prompt_len, int32_t prompt_logprobs,
                                int64_t vocab_size);

// Why a decode worker's stream message cannot be relayed; empty when it can.
std::string InvalidDecodeMessage(const v1::GenerateResponse& message, int64_t vocab_size, bool finished_before);

}  // namespace duet::router
